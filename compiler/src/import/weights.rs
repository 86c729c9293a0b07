//! The weight store: every checkpoint tensor by name, backed by memory-mapped files.
//!
//! Tensors are never copied at import; [`WeightStore::to_f32`] decodes one tensor on
//! demand (dequantizing GGUF blocks exactly, and undoing llama.cpp's Q/K row
//! permutation), so peak memory stays at the mapped files plus one decoded tensor.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::{bf16, f16};
use memmap2::Mmap;

use crate::error::{Error, Result};
use crate::graph::WeightEncoding;
use crate::quant::Encoded;

/// How a tensor's bytes encode its elements.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum StorageType {
    F32,
    F16,
    BF16,
    /// GGUF Q8_0: blocks of 32 int8 with one f16 scale (34 bytes).
    Q8_0,
    /// GGUF Q4_0: blocks of 32 4-bit values, offset 8, one f16 scale (18 bytes).
    Q4_0,
    /// GGUF Q4_1: blocks of 32 4-bit values with f16 scale and f16 minimum (20 bytes).
    Q4_1,
    /// GGUF Q4_K: super-blocks of 256 (f16 d, f16 dmin, 12 bytes of packed 6-bit
    /// sub-block scales and minimums, 128 bytes of nibbles: 144 bytes).
    Q4K,
    /// GGUF Q5_0: blocks of 32 5-bit values, offset 16, one f16 scale (f16 d,
    /// 4 bytes of fifth bits, 16 of nibbles: 22 bytes). Read by dequantizing.
    Q5_0,
    /// GGUF Q5_1: blocks of 32 5-bit values with f16 scale and minimum (24 bytes).
    /// Read by dequantizing.
    Q5_1,
    /// GGUF Q2_K: super-blocks of 256 (16 bytes of 4-bit sub-block scales and
    /// minimums, 64 of 2-bit values, f16 d, f16 dmin: 84 bytes). Read by dequantizing.
    Q2K,
    /// GGUF Q3_K: super-blocks of 256 (32 bytes of high bits, 64 of 2-bit low
    /// parts, 12 of packed 6-bit signed scales, f16 d: 110 bytes). Read by dequantizing.
    Q3K,
    /// GGUF Q5_K: super-blocks of 256 (f16 d, f16 dmin, 12 bytes of 6-bit scales
    /// and minimums, 32 of fifth bits, 128 of nibbles: 176 bytes). Read by dequantizing.
    Q5K,
    /// GGUF Q6_K: super-blocks of 256 (128 bytes of low nibbles, 64 of high
    /// 2-bit parts, 16 int8 sub-block scales, f16 d: 210 bytes). Read by dequantizing.
    Q6K,
    /// GGUF MXFP4 (OCP microscaling FP4, gpt-oss's experts): blocks of 32 E2M1
    /// values sharing one E8M0 scale (the scale byte `e`, then 16 bytes of
    /// nibbles in Q4_0's order: 17 bytes); value = `2^(e - 127) * e2m1(q)`,
    /// which ggml writes `kvalues_mxfp4[q] * 2^(e - 128)` with the E2M1 values
    /// doubled to the integers 0, ±1, ±2, ±3, ±4, ±6, ±8, ±12.
    Mxfp4,
}

impl StorageType {
    /// (elements per block, bytes per block).
    pub fn block(self) -> (usize, usize) {
        match self {
            StorageType::F32 => (1, 4),
            StorageType::F16 | StorageType::BF16 => (1, 2),
            StorageType::Q8_0 => (32, 34),
            StorageType::Q4_0 => (32, 18),
            StorageType::Q4_1 => (32, 20),
            StorageType::Q4K => (256, 144),
            StorageType::Q5_0 => (32, 22),
            StorageType::Q5_1 => (32, 24),
            StorageType::Q2K => (256, 84),
            StorageType::Q3K => (256, 110),
            StorageType::Q5K => (256, 176),
            StorageType::Q6K => (256, 210),
            StorageType::Mxfp4 => (32, 17),
        }
    }

    /// Bytes needed for `n` elements, or `None` when `n` is not a whole number of blocks.
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        let (per, bytes) = self.block();
        n.is_multiple_of(per).then(|| n / per * bytes)
    }

    pub fn name(self) -> &'static str {
        match self {
            StorageType::F32 => "F32",
            StorageType::F16 => "F16",
            StorageType::BF16 => "BF16",
            StorageType::Q8_0 => "Q8_0",
            StorageType::Q4_0 => "Q4_0",
            StorageType::Q4_1 => "Q4_1",
            StorageType::Q4K => "Q4_K",
            StorageType::Q5_0 => "Q5_0",
            StorageType::Q5_1 => "Q5_1",
            StorageType::Q2K => "Q2_K",
            StorageType::Q3K => "Q3_K",
            StorageType::Q5K => "Q5_K",
            StorageType::Q6K => "Q6_K",
            StorageType::Mxfp4 => "MXFP4",
        }
    }

    /// The encoding a matrix stored as this keeps under `--quantization-encoding
    /// stored`: its own where it is a float one or its matmuls have integer
    /// kernels (F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K),
    /// float32 for F32, else the nearest more precise encoding with integer
    /// kernels: q4_k for the 2- and 3-bit blocks (Q2_K, Q3_K). Never less
    /// precise than the file.
    pub fn stored_scheme(self) -> WeightEncoding {
        use StorageType as S;
        match (self, self.native_scheme()) {
            (_, Some(native)) if !native.is_block() || maxc_kernels::library::matmul_int8::has_integer_kernels(native) => native,
            (S::F32, _) => WeightEncoding::Float32,
            (S::Q2K | S::Q3K, _) => WeightEncoding::Q4K,
            _ => WeightEncoding::Q8_0,
        }
    }

    /// The weight encoding that stores this type's blocks without loss, if any.
    pub fn native_scheme(self) -> Option<WeightEncoding> {
        match self {
            StorageType::F32 => None,
            StorageType::F16 => Some(WeightEncoding::Float16),
            StorageType::BF16 => Some(WeightEncoding::BFloat16),
            StorageType::Q8_0 => Some(WeightEncoding::Q8_0),
            StorageType::Q4_0 => Some(WeightEncoding::Q4_0),
            StorageType::Q4_1 => Some(WeightEncoding::Q4_1),
            StorageType::Q4K => Some(WeightEncoding::Q4K),
            StorageType::Q5_0 => Some(WeightEncoding::Q5_0),
            StorageType::Q5_1 => Some(WeightEncoding::Q5_1),
            StorageType::Q6K => Some(WeightEncoding::Q6K),
            StorageType::Q5K => Some(WeightEncoding::Q5K),
            // The doubled E2M1 values plus 16 are Q5_0 levels (4..=28) and the
            // halved E8M0 scale a power of two that f16 holds exactly from 2^-24
            // to 2^15: MXFP4 blocks are Q5_0 blocks with those levels and scales
            // (`mxfp4_as_q5_0`; 22 bytes per block where MXFP4 takes 17, until
            // an MXFP4 kernel exists). A scale past 2^15 is refused at import
            // (`check_mxfp4_scales`); one below 2^-24 (every value under 4e-7)
            // rounds to zero.
            StorageType::Mxfp4 => Some(WeightEncoding::Q5_0),
            // No kernels compute on these blocks: they are dequantized exactly
            // at import and encoded as the compile asks.
            StorageType::Q2K | StorageType::Q3K => None,
        }
    }
}

/// One tensor of the checkpoint.
#[derive(Clone, Debug)]
pub struct WeightEntry {
    pub storage: StorageType,
    /// Logical shape, outermost first (HF order).
    pub shape: Vec<usize>,
    file: usize,
    offset: usize,
    len: usize,
    /// `Some(heads)` for GGUF Q/K projections whose rows llama.cpp permuted per head.
    pub unpermute_heads: Option<usize>,
    /// A GGUF Gemma norm weight, which llama.cpp's converter stores as `1 + w`
    /// (its RMSNorm multiplies by the weight); read back as `w`, the Hugging
    /// Face value the graph's `(1 + w)` expects. Exact: the subtraction of 1
    /// from a value in [0.5, 2] is, and adding 1 back gives the stored value.
    pub stored_plus_one: bool,
    /// Elements stored in another order than the logical one (gpt-oss's
    /// experts): see [`MatrixView`]. Float storage only.
    pub view: Option<MatrixView>,
}

/// How a float tensor's logical rows are read from its stored matrices
/// (its trailing two dims, each `[rows, cols]` as stored), for checkpoints
/// whose layout is not the `[out, in]` one the graph binds: gpt-oss stores
/// each expert's gate-and-up projection as `[hidden, 2 * intermediate]` with
/// the gate's and the up projection's columns alternating, and its down
/// projection as `[intermediate, hidden]` (both multiplied as `x @ w`).
/// Logical row `r` of a matrix is view row `first_row + r`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct MatrixView {
    /// Rows and columns of each stored matrix.
    pub stored: [usize; 2],
    /// Logical `[cols, rows]`: view row `j` is stored column `j` (after
    /// de-interleaving), so the logical tensor is each matrix transposed.
    pub transposed: bool,
    /// The stored columns alternate two halves (`a0 b0 a1 b1 ...`): the view
    /// takes every even column first, then every odd one (`a0 a1 ... b0 b1 ...`).
    pub deinterleaved: bool,
    /// The first view row of the logical tensor (a row range of a view, as
    /// [`WeightStore::split_rows`] makes).
    pub first_row: usize,
}

impl MatrixView {
    /// The stored column of view column `j` of `n` (de-interleaving).
    fn column(&self, j: usize, n: usize) -> usize {
        match self.deinterleaved {
            true if j < n / 2 => 2 * j,
            true => 2 * (j - n / 2) + 1,
            false => j,
        }
    }

    /// The stored element index, within its matrix, of logical element
    /// `(row, col)` of a matrix.
    fn element(&self, row: usize, col: usize) -> usize {
        let cols = self.stored[1];
        let vr = self.first_row + row;
        match self.transposed {
            true => col * cols + self.column(vr, cols),
            false => vr * cols + self.column(col, cols),
        }
    }
}

impl WeightEntry {
    pub fn num_elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// Rows: every axis but the last, flattened.
    pub fn rows(&self) -> usize {
        self.num_elements() / self.shape.last().copied().unwrap_or(1).max(1)
    }
}

/// How a checkpoint names tensors and hyperparameters when not as Hugging Face
/// does: the file's name of a tensor, and what holds the hyperparameters.
type FileNaming = (Arc<dyn Fn(&str) -> Option<String> + Send + Sync>, &'static str);

/// All tensors of a checkpoint, by name.
#[derive(Default)]
pub struct WeightStore {
    files: Vec<(PathBuf, Arc<Mmap>)>,
    entries: BTreeMap<String, WeightEntry>,
    /// Tensors of a dtype the compiler does not read: name -> (dtype, file).
    skipped: BTreeMap<String, (String, usize)>,
    /// For a checkpoint whose names are not Hugging Face's (GGUF): the file's
    /// name of a tensor, and what holds the hyperparameters, for messages.
    file_names: Option<FileNaming>,
}

impl std::fmt::Debug for WeightStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightStore").field("files", &self.files.len()).field("tensors", &self.entries.len()).finish()
    }
}

impl WeightStore {
    /// Registers a mapped file and returns its index for [`WeightStore::insert`].
    pub fn add_file(&mut self, path: &Path, map: Arc<Mmap>) -> usize {
        self.files.push((path.to_path_buf(), map));
        self.files.len() - 1
    }

    /// Adds a tensor whose bytes are `file[offset..offset+len]` (already bounds-checked by the reader).
    pub fn insert(&mut self, name: String, storage: StorageType, shape: Vec<usize>, file: usize, offset: usize, len: usize) {
        let entry = WeightEntry { storage, shape, file, offset, len, unpermute_heads: None, stored_plus_one: false, view: None };
        debug_assert!(offset + len <= self.files[file].1.len());
        self.entries.insert(name, entry);
    }

    /// Tensors are stored under Hugging Face names; `file_name` gives the
    /// checkpoint's own (None: the same), `config` says what holds the
    /// hyperparameters. Messages then use the names the user's file has.
    pub fn name_as_in_file(&mut self, file_name: impl Fn(&str) -> Option<String> + Send + Sync + 'static, config: &'static str) {
        self.file_names = Some((Arc::new(file_name), config));
    }

    /// `name` as the checkpoint spells it (`token_embd.weight` in a GGUF).
    pub fn shown_name(&self, name: &str) -> String {
        self.file_names.as_ref().and_then(|(f, _)| f(name)).unwrap_or_else(|| name.to_string())
    }

    /// What holds the hyperparameters the shapes come from.
    pub fn config_source(&self) -> &'static str {
        self.file_names.as_ref().map_or("config.json", |(_, c)| c)
    }

    /// The error for a tensor the graph needs and the checkpoint lacks.
    pub fn missing(&self, path: &Path, name: &str, architecture: &str) -> Error {
        Error::MissingWeight { path: path.to_path_buf(), name: self.shown_name(name), architecture: architecture.to_string(), config: self.config_source().to_string() }
    }

    /// [`Self::missing`] for a lookup of the store's own (blamed on its first file).
    fn not_stored(&self, name: &str) -> Error {
        self.missing(&self.files.first().map(|f| f.0.clone()).unwrap_or_default(), name, "this graph")
    }

    /// Records a tensor that was not loaded because of its dtype.
    pub fn skip(&mut self, name: String, dtype: String, file: usize) {
        self.skipped.insert(name, (dtype, file));
    }

    /// The error for asking for a skipped tensor, if `name` is one.
    pub fn skipped_error(&self, name: &str) -> Option<Error> {
        self.skipped.get(name).map(|(dtype, file)| {
            Error::invalid(&self.files[*file].0, name, format!("tensor dtype {dtype} is not supported; supported: F32, F16, BF16"))
        })
    }

    pub fn get(&self, name: &str) -> Option<&WeightEntry> {
        self.entries.get(name)
    }

    pub fn get_mut(&mut self, name: &str) -> Option<&mut WeightEntry> {
        self.entries.get_mut(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The files backing the store (for provenance hashes).
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(|(p, _)| p.as_path())
    }

    /// The file that holds `name` (for error messages).
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        self.entries.get(name).map(|e| self.files[e.file].0.as_path())
    }

    /// The raw bytes of a tensor, zero-copy.
    pub fn bytes(&self, entry: &WeightEntry) -> &[u8] {
        &self.files[entry.file].1[entry.offset..entry.offset + entry.len]
    }

    /// Exposes consecutive row ranges of tensor `name` as tensors of their own
    /// (`parts`: new name and row count, in order), without copying: a row range
    /// of a row-major tensor, float or in blocks along its rows, is a byte range.
    /// The fused tensor itself is removed. Returns false (and changes nothing)
    /// when `name` is absent, its rows do not add up, or its rows are stored permuted.
    pub fn split_rows(&mut self, name: &str, parts: &[(String, usize)]) -> bool {
        let Some(e) = self.entries.get(name).cloned() else { return false };
        let rows = e.shape.first().copied().unwrap_or(0);
        if let Some(view) = e.view {
            // A view's rows are read through it: each part a view from its first row.
            if e.shape.len() != 2 || parts.iter().map(|p| p.1).sum::<usize>() != rows {
                return false;
            }
            let mut first_row = view.first_row;
            for (part, n) in parts {
                let shape = vec![*n, e.shape[1]];
                self.entries.insert(part.clone(), WeightEntry { shape, view: Some(MatrixView { first_row, ..view }), ..e.clone() });
                first_row += n;
            }
            self.entries.remove(name);
            return true;
        }
        if e.unpermute_heads.is_some() || rows == 0 || parts.iter().map(|p| p.1).sum::<usize>() != rows || e.len % rows != 0 {
            return false;
        }
        let row_bytes = e.len / rows;
        let mut offset = e.offset;
        for (part, n) in parts {
            let mut shape = e.shape.clone();
            shape[0] = *n;
            self.entries.insert(part.clone(), WeightEntry { shape, offset, len: n * row_bytes, ..e.clone() });
            offset += n * row_bytes;
        }
        self.entries.remove(name);
        true
    }

    /// Exposes each `[rows, cols]` slice of a stacked `[parts.len(), rows,
    /// cols]` tensor `name` as a tensor of its own (`parts`: the new names, in
    /// order) without copying, and removes the stacked one; false (and no
    /// change) when `name` is absent, is not 3-D, stacks another count or is
    /// stored permuted.
    pub fn split_stacked(&mut self, name: &str, parts: &[String]) -> bool {
        let Some(e) = self.entries.get(name).cloned() else { return false };
        if e.unpermute_heads.is_some() || e.shape.len() != 3 || e.shape[0] != parts.len() || parts.is_empty() || e.len % parts.len() != 0 {
            return false;
        }
        let bytes = e.len / parts.len();
        for (i, part) in parts.iter().enumerate() {
            self.entries.insert(part.clone(), WeightEntry { shape: e.shape[1..].to_vec(), offset: e.offset + i * bytes, len: bytes, ..e.clone() });
        }
        self.entries.remove(name);
        true
    }

    /// Reads float tensor `name` through `view` from now on: its logical shape
    /// becomes each stored matrix's view (`[cols, rows]` when transposed).
    /// False (and no change) for a tensor that is absent, not float, has
    /// fewer than two dims or is already read otherwise.
    pub fn set_view(&mut self, name: &str, transposed: bool, deinterleaved: bool) -> bool {
        let Some(e) = self.entries.get_mut(name) else { return false };
        let n = e.shape.len();
        if n < 2 || e.storage.block().0 != 1 || e.view.is_some() || e.unpermute_heads.is_some() || e.stored_plus_one || (deinterleaved && e.shape[n - 1] % 2 != 0) {
            return false;
        }
        let stored = [e.shape[n - 2], e.shape[n - 1]];
        if transposed {
            e.shape.swap(n - 2, n - 1);
        }
        e.view = Some(MatrixView { stored, transposed, deinterleaved, first_row: 0 });
        true
    }

    /// A tensor's logical (HF) shape.
    pub fn shape(&self, name: &str) -> Result<Vec<u64>> {
        match self.entries.get(name) {
            Some(e) => Ok(e.shape.iter().map(|&d| d as u64).collect()),
            None => Err(self.not_stored(name)),
        }
    }

    /// Decodes a tensor to f32 in logical (HF) layout.
    pub fn to_f32(&self, name: &str) -> Result<Vec<f32>> {
        let entry = self.entries.get(name).ok_or_else(|| self.not_stored(name))?;
        Ok(decoded(entry, dequantize(entry.storage, &self.stored_rows(name, entry, 0..entry.rows()), entry.num_elements())))
    }

    /// The stored bytes of rows `rows` of `entry` in logical (HF) order: a
    /// range of the mapping, or, for rows llama.cpp permuted, each row read
    /// from where it put it (blocks run along rows, so a row is whole bytes).
    fn stored_rows(&self, name: &str, entry: &WeightEntry, rows: std::ops::Range<usize>) -> std::borrow::Cow<'_, [u8]> {
        let (stored, total) = (self.bytes(entry), entry.rows());
        assert!(rows.end <= total, "{name}: rows {rows:?} of {total}");
        if let Some(view) = entry.view {
            return viewed_rows(stored, entry, &view, rows).into();
        }
        if rows == (0..total) && entry.unpermute_heads.is_none() {
            return stored.into();
        }
        assert!(total > 0 && entry.len % total == 0, "{name}: {total} rows in {} bytes", entry.len);
        let row_bytes = entry.len / total;
        match entry.unpermute_heads {
            None => stored[rows.start * row_bytes..rows.end * row_bytes].into(),
            Some(heads) => rows.flat_map(|r| &stored[permuted_row(r, total, heads) * row_bytes..][..row_bytes]).copied().collect::<Vec<u8>>().into(),
        }
    }
}

impl WeightStore {
    /// Rows `rows` of tensor `name` (its rows: every axis but the last,
    /// flattened) in `scheme`: the stored blocks as they are where the
    /// checkpoint already stores `scheme` (GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K, or
    /// F16 / BF16: no requantization, only the byte layout changes, interleaved
    /// blocks becoming separate parts), else decoded exactly and encoded. Every
    /// encoding is row-local, so the bytes are exactly that row range of the
    /// whole tensor encoded at once; only these rows are decoded (the writer
    /// streams large tensors this way). Rows llama.cpp permuted are read from
    /// where it put them.
    pub fn rows_encoded(&self, name: &str, scheme: WeightEncoding, rows: std::ops::Range<usize>) -> Result<Encoded> {
        let entry = self.entries.get(name).ok_or_else(|| self.not_stored(name))?;
        let cols = entry.shape.last().copied().unwrap_or(1);
        let bytes = self.stored_rows(name, entry, rows.clone());
        Ok(if entry.storage.native_scheme() == Some(scheme) && !entry.stored_plus_one {
            native_parts(entry.storage, &bytes)
        } else {
            crate::quant::encode(scheme, &decoded(entry, dequantize(entry.storage, &bytes, rows.len() * cols)), cols)
        })
    }

    /// The whole tensor in `scheme` ([`Self::rows_encoded`] of every row).
    pub fn encoded(&self, name: &str, scheme: WeightEncoding) -> Result<Encoded> {
        let entry = self.entries.get(name).ok_or_else(|| self.not_stored(name))?;
        self.rows_encoded(name, scheme, 0..entry.rows())
    }
}

/// `values` of `entry` as the Hugging Face checkpoint holds them (see
/// [`WeightEntry::stored_plus_one`]).
fn decoded(entry: &WeightEntry, mut values: Vec<f32>) -> Vec<f32> {
    if entry.stored_plus_one {
        values.iter_mut().for_each(|x| *x -= 1.0);
    }
    values
}

/// Rows `rows` of a viewed float tensor's logical rows, gathered from its
/// stored matrices element by element.
fn viewed_rows(stored: &[u8], entry: &WeightEntry, view: &MatrixView, rows: std::ops::Range<usize>) -> Vec<u8> {
    let size = entry.storage.block().1;
    let n = entry.shape.len();
    let (matrix_rows, cols) = (entry.shape[n - 2], entry.shape[n - 1]);
    let matrix_elems = view.stored[0] * view.stored[1];
    let mut out = Vec::with_capacity(rows.len() * cols * size);
    for r in rows {
        let (m, row) = (r / matrix_rows, r % matrix_rows);
        for c in 0..cols {
            let at = (m * matrix_elems + view.element(row, c)) * size;
            out.extend_from_slice(&stored[at..at + size]);
        }
    }
    out
}

/// Where llama.cpp's `permute(w, n_head)` put row `row` (of `rows`) of a Q or K
/// projection: HF row `h*hd + t*hd/2 + i` is GGUF row `h*hd + 2*i + t`.
fn permuted_row(row: usize, rows: usize, heads: usize) -> usize {
    let hd = rows / heads;
    let (h, j) = (row / hd, row % hd);
    let (t, i) = (j / (hd / 2), j % (hd / 2));
    h * hd + 2 * i + t
}

/// GGUF blocks re-laid out as the parts of the matching encoding (only for types
/// with a [`StorageType::native_scheme`]).
pub fn native_parts(storage: StorageType, bytes: &[u8]) -> Encoded {
    let mut parts: Vec<Vec<u8>> = vec![Vec::new(); storage.native_scheme().map_or(1, |s| s.parts().len())];
    match storage {
        StorageType::F32 | StorageType::F16 | StorageType::BF16 => parts[0].extend_from_slice(bytes),
        // Blocks whose fields are whole parts: (part, bytes) in block order.
        StorageType::Q8_0 | StorageType::Q4_0 | StorageType::Q4_1 | StorageType::Q5_0 | StorageType::Q5_1 => {
            let fields: &[(usize, usize)] = match storage {
                StorageType::Q8_0 => &[(1, 2), (0, 32)],             // d, int8 levels
                StorageType::Q4_0 => &[(1, 2), (0, 16)],             // d, nibbles (ours' order)
                StorageType::Q4_1 => &[(1, 2), (2, 2), (0, 16)],     // d, m, nibbles
                StorageType::Q5_0 => &[(2, 2), (1, 4), (0, 16)],     // d, qh (the fifth bits), nibbles
                StorageType::Q5_1 => &[(2, 2), (3, 2), (1, 4), (0, 16)], // d, m, qh, nibbles
                _ => unreachable!("the types of this arm"),
            };
            let block_bytes: usize = fields.iter().map(|(_, n)| n).sum();
            for block in bytes.chunks_exact(block_bytes) {
                let mut at = 0;
                for &(part, n) in fields {
                    parts[part].extend_from_slice(&block[at..at + n]);
                    at += n;
                }
            }
        }
        StorageType::Q4K | StorageType::Q5K => {
            // d, dmin, 12 bytes of packed 6-bit scales and minimums, (Q5_K: 32
            // bytes of fifth bits,) 128 bytes of nibbles.
            let five = storage == StorageType::Q5K;
            let first = if five { 1 } else { 0 };
            for block in bytes.chunks_exact(if five { 176 } else { 144 }) {
                parts[first + 3].extend_from_slice(&block[..2]);
                parts[first + 4].extend_from_slice(&block[2..4]);
                let packed = &block[4..16];
                let (qh, qs) = if five { (&block[16..48], &block[48..]) } else { (&block[16..16], &block[16..]) };
                for j in 0..8 {
                    let (sc, m) = q4_k_scale_min(j, packed);
                    parts[first + 1].push(sc);
                    parts[first + 2].push(m);
                }
                // Chunk c of 64 values: 32 bytes, sub-block 2c in the low nibbles and
                // 2c+1 in the high ones (Q5_K: their fifth bits in bits 2c and
                // 2c+1 of qh[l]). Our blocks pack values t and t+16 in byte t,
                // the fifth bits in 4 bytes per block (bit t of their u32).
                for (c, chunk) in qs.chunks_exact(32).enumerate() {
                    for (h, shift) in [0, 4].into_iter().enumerate() {
                        let nib = |l: usize| (chunk[l] >> shift) & 15;
                        parts[0].extend((0..16).map(|t| nib(t) | (nib(t + 16) << 4)));
                        if five {
                            let bits: u32 = (0..32).map(|l| (((qh[l] >> (2 * c + h)) & 1) as u32) << l).sum();
                            parts[1].extend(bits.to_le_bytes());
                        }
                    }
                }
            }
        }
        StorageType::Q6K => {
            // ql[128], qh[64], scales: i8[16], d: f16. Value 128 n + 32 i + l
            // (n, i < 2... 4, l < 32): the low or high nibble of ql[64 n + 32 (i % 2)
            // + l] (high for i >= 2), bits 2 i.. of qh[32 n + l].
            for block in bytes.chunks_exact(210) {
                let (ql, qh, scales, d) = (&block[..128], &block[128..192], &block[192..208], &block[208..]);
                let level = |v: usize| {
                    let (n, i, l) = (v / 128, (v % 128) / 32, v % 32);
                    let byte = ql[64 * n + 32 * (i % 2) + l];
                    let nibble = if i < 2 { byte & 15 } else { byte >> 4 };
                    nibble | ((qh[32 * n + l] >> (2 * i)) & 3) << 4
                };
                for blk in 0..8 {
                    let l = |t: usize| level(32 * blk + t);
                    parts[0].extend((0..16).map(|t| (l(t) & 15) | (l(t + 16) & 15) << 4));
                    parts[1].extend((0..8).map(|b| (0..4).fold(0u8, |acc, i| acc | ((l(4 * b + i) >> 4) & 3) << (2 * i))));
                }
                parts[2].extend_from_slice(scales);
                parts[3].extend_from_slice(d);
            }
        }
        StorageType::Mxfp4 => {
            for block in bytes.chunks_exact(17) {
                let (quants, high_bits, scale) = mxfp4_as_q5_0(block);
                parts[0].extend_from_slice(&quants);
                parts[1].extend_from_slice(&high_bits);
                parts[2].extend_from_slice(&scale);
            }
        }
        StorageType::Q2K | StorageType::Q3K => {
            unreachable!("{} blocks have no native encoding", storage.name())
        }
    }
    Encoded { parts }
}

/// ggml's `kvalues_mxfp4`: the E2M1 value of each nibble, doubled (bit 3 the sign).
pub const MXFP4_LEVELS: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Half of an E8M0 scale, `2^(e - 128)` (ggml's `ggml_e8m0_to_fp32_half`; the
/// two smallest are f32 subnormals).
pub fn e8m0_half(e: u8) -> f32 {
    if e < 2 {
        f32::from_bits(0x0020_0000 << e)
    } else {
        f32::from_bits(((e as u32) - 1) << 23)
    }
}

/// The largest E8M0 scale byte whose half an f16 holds (`2^15`).
pub const MXFP4_MAX_SCALE_BYTE: u8 = 143;

/// Value `t` of an MXFP4 block (scale byte, then value `t` in the low nibble
/// of byte `1 + t` and value `16 + t` in its high nibble) as its doubled E2M1 level.
fn mxfp4_level(block: &[u8], t: usize) -> i8 {
    MXFP4_LEVELS[((block[1 + t % 16] >> (4 * (t / 16))) & 15) as usize]
}

/// One MXFP4 block (scale byte, 16 bytes of nibbles) as Q5_0's parts: the
/// nibbles of `level + 16` (values `t` and `t + 16` in byte `t`), their fifth
/// bits (bit `t % 8` of byte `t / 8`) and the f16 scale `2^(e - 128)`.
pub fn mxfp4_as_q5_0(block: &[u8]) -> ([u8; 16], [u8; 4], [u8; 2]) {
    let level = |t: usize| (mxfp4_level(block, t) + 16) as u8;
    let mut quants = [0u8; 16];
    let mut high_bits = [0u8; 4];
    for t in 0..16 {
        quants[t] = (level(t) & 15) | (level(t + 16) & 15) << 4;
    }
    for t in 0..32 {
        high_bits[t / 8] |= (level(t) >> 4) << (t % 8);
    }
    (quants, high_bits, f16::from_f32(e8m0_half(block[0])).to_le_bytes())
}

/// llama.cpp's `get_scale_min_k4`: sub-block `j`'s 6-bit scale and minimum.
fn q4_k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Decodes `n` elements of `storage` from `bytes` (which the reader sized exactly).
pub fn dequantize(storage: StorageType, bytes: &[u8], n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n);
    let f16_at = |b: &[u8], i: usize| f16::from_le_bytes([b[i], b[i + 1]]).to_f32();
    match storage {
        StorageType::F32 => out.extend(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
        StorageType::F16 => out.extend(bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())),
        StorageType::BF16 => out.extend(bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())),
        StorageType::Q8_0 => {
            for block in bytes.chunks_exact(34) {
                let d = f16_at(block, 0);
                out.extend(block[2..].iter().map(|&q| q as i8 as f32 * d));
            }
        }
        StorageType::Q4_0 => {
            for block in bytes.chunks_exact(18) {
                let d = f16_at(block, 0);
                let qs = &block[2..];
                out.extend(qs.iter().map(|&q| ((q & 0x0f) as i32 - 8) as f32 * d));
                out.extend(qs.iter().map(|&q| ((q >> 4) as i32 - 8) as f32 * d));
            }
        }
        StorageType::Q4_1 => {
            for block in bytes.chunks_exact(20) {
                let (d, m) = (f16_at(block, 0), f16_at(block, 2));
                let qs = &block[4..];
                out.extend(qs.iter().map(|&q| (q & 0x0f) as f32 * d + m));
                out.extend(qs.iter().map(|&q| (q >> 4) as f32 * d + m));
            }
        }
        StorageType::Q4K | StorageType::Q5K => {
            // dequantize_row_q4_K: y = d * sc * q - dmin * m per sub-block of 32.
            // dequantize_row_q5_K: the same, with a fifth bit of q (16) from the
            // 32 bytes of qh after the scales: bit 2c + half of byte l.
            let qh_len = if storage == StorageType::Q5K { 32 } else { 0 };
            for block in bytes.chunks_exact(storage.block().1) {
                let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
                let (packed, qh, qs) = (&block[4..16], &block[16..16 + qh_len], &block[16 + qh_len..]);
                for (c, chunk) in qs.chunks_exact(32).enumerate() {
                    for (half, shift) in [(0, 0), (1, 4)] {
                        let (sc, m) = q4_k_scale_min(2 * c + half, packed);
                        let (scale, min) = (d * sc as f32, dmin * m as f32);
                        let fifth = |l: usize| qh.get(l).map_or(0, |h| ((h >> (2 * c + half)) & 1) * 16);
                        out.extend(chunk.iter().enumerate().map(|(l, &q)| scale * (((q >> shift) & 15) + fifth(l)) as f32 - min));
                    }
                }
            }
        }
        StorageType::Q5_0 | StorageType::Q5_1 => {
            // dequantize_row_q5_0 / _1: value j of 32 takes bit j of the 32-bit
            // little-endian qh as its fifth bit (16 for Q5_0's offset).
            let with_min = storage == StorageType::Q5_1;
            let head = if with_min { 4 } else { 2 };
            for block in bytes.chunks_exact(storage.block().1) {
                let d = f16_at(block, 0);
                let m = if with_min { f16_at(block, 2) } else { 0.0 };
                let qh = u32::from_le_bytes(block[head..head + 4].try_into().unwrap());
                let qs = &block[head + 4..];
                let level = |j: usize, nibble: u8| (nibble | (((qh >> j) & 1) << 4) as u8) as i32;
                let value = |x: i32| if with_min { x as f32 * d + m } else { (x - 16) as f32 * d };
                out.extend(qs.iter().enumerate().map(|(j, &q)| value(level(j, q & 0x0f))));
                out.extend(qs.iter().enumerate().map(|(j, &q)| value(level(j + 16, q >> 4))));
            }
        }
        StorageType::Q2K => {
            // dequantize_row_q2_K: per half of 128, four 2-bit planes of its 32
            // bytes; each plane is two sub-blocks of 16 with a 4-bit scale and min.
            for block in bytes.chunks_exact(84) {
                let (scales, qs) = (&block[..16], &block[16..80]);
                let (d, dmin) = (f16_at(block, 80), f16_at(block, 82));
                let mut is = 0;
                for q in qs.chunks_exact(32) {
                    for shift in [0, 2, 4, 6] {
                        for half in [&q[..16], &q[16..]] {
                            let sc = scales[is];
                            is += 1;
                            let (dl, ml) = (d * (sc & 0xf) as f32, dmin * (sc >> 4) as f32);
                            out.extend(half.iter().map(|&b| dl * ((b >> shift) & 3) as f32 - ml));
                        }
                    }
                }
            }
        }
        StorageType::Q3K => {
            // dequantize_row_q3_K: 2-bit low parts as Q2_K's, a high bit from
            // hmask (bit n of byte l; clear means minus 4), 16 signed 6-bit scales.
            for block in bytes.chunks_exact(110) {
                let (hmask, qs, packed) = (&block[..32], &block[32..96], &block[96..108]);
                let d = f16_at(block, 108);
                let scales = q3_k_scales(packed);
                let (mut is, mut bit) = (0, 0);
                for q in qs.chunks_exact(32) {
                    for shift in [0, 2, 4, 6] {
                        for (offset, half) in [(0, &q[..16]), (16, &q[16..])] {
                            let dl = d * (scales[is] as i32 - 32) as f32;
                            is += 1;
                            out.extend(half.iter().enumerate().map(|(l, &b)| {
                                let high = if hmask[offset + l] >> bit & 1 == 1 { 0 } else { 4 };
                                dl * (((b >> shift) & 3) as i32 - high) as f32
                            }));
                        }
                        bit += 1;
                    }
                }
            }
        }
        StorageType::Mxfp4 => {
            for block in bytes.chunks_exact(17) {
                let d = e8m0_half(block[0]);
                out.extend((0..32).map(|t| mxfp4_level(block, t) as f32 * d));
            }
        }
        StorageType::Q6K => {
            // dequantize_row_q6_K: per half of 128, value l + 32 * k takes a
            // nibble of ql[l + 32 * (k % 2)] (low for k < 2) and bits 2k, 2k+1 of
            // qh[l], minus 32, times d and the int8 scale of its sub-block of 16.
            for block in bytes.chunks_exact(210) {
                let (ql, qh, scales) = (&block[..128], &block[128..192], &block[192..208]);
                let d = f16_at(block, 208);
                for n in 0..2 {
                    let (ql, qh, sc) = (&ql[64 * n..64 * n + 64], &qh[32 * n..32 * n + 32], &scales[8 * n..8 * n + 8]);
                    for k in 0..4 {
                        out.extend((0..32).map(|l| {
                            let byte = ql[l + 32 * (k % 2)];
                            let low = if k < 2 { byte & 0xf } else { byte >> 4 };
                            let q = (low | ((qh[l] >> (2 * k)) & 3) << 4) as i32 - 32;
                            d * sc[l / 16 + 2 * k] as i8 as f32 * q as f32
                        }));
                    }
                }
            }
        }
    }
    debug_assert_eq!(out.len(), n);
    out
}

/// llama.cpp's unpacking of Q3_K's 12 bytes into 16 6-bit scales (0..=63, 32
/// meaning 1): the low 4 bits of scale j from byte j % 8 (low nibble for j < 8,
/// high after), its top 2 bits from byte 8 + j % 4 at bit 2 * (j / 4).
fn q3_k_scales(packed: &[u8]) -> [u8; 16] {
    let mut scales = [0u8; 16];
    for (j, s) in scales.iter_mut().enumerate() {
        let low = if j < 8 { packed[j] & 0xf } else { packed[j - 8] >> 4 };
        let high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
        *s = low | high << 4;
    }
    scales
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An E2M1 code decoded from its bits as the OCP microscaling spec defines
    /// it (sign, two exponent bits with bias 1, one mantissa bit; exponent 0
    /// subnormal), written out anew.
    fn e2m1(code: u8) -> f32 {
        let (sign, exp, man) = (code >> 3, (code >> 1) & 3, (code & 1) as f32);
        let magnitude = if exp == 0 { man * 0.5 } else { (1.0 + man / 2.0) * 2f32.powi(exp as i32 - 1) };
        if sign == 1 { -magnitude } else { magnitude }
    }

    /// MXFP4 blocks: every code at scale bytes from the smallest f16 holds to
    /// the largest, and 0 and 1 (f32 subnormal halves): the reader's values are
    /// the spec's `2^(e - 127) * e2m1(q)`, and the same blocks as Q5_0 parts
    /// decode to them exactly where f16 holds the scale (below it, to zero).
    #[test]
    fn mxfp4_blocks_read_as_the_spec_says_and_as_q5_0_without_loss() {
        for e in [0u8, 1, 103, 104, 117, 127, 128, 140, MXFP4_MAX_SCALE_BYTE] {
            // Values t and t + 16 in byte t: codes t % 16 and 15 - t % 16.
            let mut block = vec![e];
            block.extend((0..16u8).map(|t| t | (15 - t) << 4));
            let want: Vec<f32> = (0..32).map(|t| 2f32.powi(e as i32 - 127) * e2m1(if t < 16 { t } else { 31 - t } as u8)).collect();
            let got = dequantize(StorageType::Mxfp4, &block, 32);
            assert_eq!(got, want, "scale byte {e}");
            let parts = native_parts(StorageType::Mxfp4, &block);
            let q5 = crate::quant::decode(WeightEncoding::Q5_0, &parts, 32);
            let exact = e >= 104;
            for t in 0..32 {
                assert_eq!(q5[t], if exact { got[t] } else { 0.0 }, "scale byte {e}, value {t} as Q5_0");
            }
        }
        assert_eq!(e8m0_half(127), 0.5);
        assert_eq!(f16::from_f32(e8m0_half(MXFP4_MAX_SCALE_BYTE)).to_f32(), 32768.0);
        assert!(f16::from_f32(e8m0_half(MXFP4_MAX_SCALE_BYTE + 1)).is_infinite());
    }

    /// The reference: undoes llama.cpp's `permute(w, n_head)` on the rows of a Q or K projection.
    ///
    /// convert_hf_to_gguf reorders each head's rows from rotate-half order to
    /// interleaved pairs: GGUF row `h*hd + 2*i + t` holds HF row `h*hd + t*hd/2 + i`.
    fn unpermute_rows(data: &[f32], shape: &[usize], heads: usize) -> Vec<f32> {
        let rows = shape[0];
        let cols: usize = shape[1..].iter().product();
        let hd = rows / heads;
        let half = hd / 2;
        let mut out = vec![0.0; data.len()];
        for h in 0..heads {
            for i in 0..half {
                for t in 0..2 {
                    let src = h * hd + 2 * i + t;
                    let dst = h * hd + t * half + i;
                    out[dst * cols..(dst + 1) * cols].copy_from_slice(&data[src * cols..(src + 1) * cols]);
                }
            }
        }
        out
    }

    /// A Q4_K super-block with distinct scales: the native parts decode (through
    /// the same decoder the interpreter and kernels follow) to exactly the
    /// values llama.cpp's dequantization gives.
    #[test]
    fn q4_k_native_parts_decode_like_the_gguf_dequantizer() {
        let mut block = Vec::new();
        block.extend(f16::from_f32(0.03125).to_le_bytes());
        block.extend(f16::from_f32(0.0625).to_le_bytes());
        block.extend([5u8, 200, 17, 63, 9, 130, 255, 1, 0x3c, 0x7a, 0xf1, 0x0e]);
        block.extend((0..128u32).map(|i| (i * 37 % 256) as u8));
        let want = dequantize(StorageType::Q4K, &block, 256);
        let parts = native_parts(StorageType::Q4K, &block);
        assert_eq!(crate::quant::decode(WeightEncoding::Q4K, &parts, 256), want);
        // And a sub-block scale from the high bits (j >= 4) is used at all.
        assert!(parts.parts[1][4..].iter().any(|&s| s > 15));
    }

    #[test]
    fn q8_q4_native_parts_decode_exactly() {
        for (storage, scheme, block_bytes) in [(StorageType::Q8_0, WeightEncoding::Q8_0, 34), (StorageType::Q4_0, WeightEncoding::Q4_0, 18), (StorageType::Q4_1, WeightEncoding::Q4_1, 20)] {
            let mut bytes = Vec::new();
            for b in 0..3u32 {
                bytes.extend(f16::from_f32(0.5 + b as f32).to_le_bytes());
                if storage == StorageType::Q4_1 {
                    bytes.extend(f16::from_f32(-1.0 - b as f32).to_le_bytes());
                }
                let header = bytes.len() % block_bytes;
                bytes.extend((0..block_bytes - header).map(|i| (i as u32 * 41 + b) as u8));
            }
            let want = dequantize(storage, &bytes, 96);
            assert_eq!(crate::quant::decode(scheme, &native_parts(storage, &bytes), 96), want, "{storage:?}");
        }
    }

    #[test]
    fn q4_1_dequantizes_low_nibbles_first() {
        let mut block = Vec::new();
        block.extend(f16::from_f32(0.5).to_le_bytes());
        block.extend(f16::from_f32(-1.0).to_le_bytes());
        block.extend((0..16u8).map(|i| (15 - i) << 4 | i));
        let v = dequantize(StorageType::Q4_1, &block, 32);
        assert_eq!(v[0], -1.0);
        assert_eq!(v[15], 15.0 * 0.5 - 1.0);
        assert_eq!(v[16], 15.0 * 0.5 - 1.0);
        assert_eq!(v[31], -1.0);
    }

    #[test]
    fn q8_0_and_q4_0_apply_scale_and_offset() {
        let mut block = Vec::new();
        block.extend(f16::from_f32(0.25).to_le_bytes());
        block.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let v = dequantize(StorageType::Q8_0, &block, 32);
        assert_eq!(v[0], -4.0);
        assert_eq!(v[31], 15.0 * 0.25);
        let mut block = Vec::new();
        block.extend(f16::from_f32(2.0).to_le_bytes());
        block.extend([0x10u8; 16]);
        let v = dequantize(StorageType::Q4_0, &block, 32);
        assert_eq!(v[0], -16.0);
        assert_eq!(v[16], -14.0);
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // One head of head_dim 4 with 1 column: HF rows [a0 a1 b0 b1] (rotate-half
        // pairs (a0,b0), (a1,b1)) are stored by llama.cpp as [a0 b0 a1 b1].
        let gguf = [10.0, 20.0, 11.0, 21.0, 30.0, 40.0, 31.0, 41.0];
        let expected = vec![10.0, 11.0, 20.0, 21.0, 30.0, 31.0, 40.0, 41.0];
        assert_eq!(unpermute_rows(&gguf, &[8, 1], 2), expected);
        assert_eq!((0..8).map(|r| gguf[permuted_row(r, 8, 2)]).collect::<Vec<f32>>(), expected);
    }

    /// The row a row-range read takes each HF row from is where llama.cpp's
    /// permute put it: reading rows one by one through `permuted_row` gives
    /// what un-permuting the whole tensor gives.
    #[test]
    fn permuted_row_reads_what_unpermute_gives() {
        let (rows, heads) = (24, 3);
        let gguf: Vec<f32> = (0..rows).map(|r| r as f32).collect();
        let hf = unpermute_rows(&gguf, &[rows, 1], heads);
        let by_row: Vec<f32> = (0..rows).map(|r| gguf[permuted_row(r, rows, heads)]).collect();
        assert_eq!(by_row, hf);
    }

    #[test]
    fn stored_encodings_are_never_less_precise_than_the_file() {
        use crate::quant::{bits_per_value, parse_linear_encoding};
        use StorageType as S;
        let order = [WeightEncoding::Float32, WeightEncoding::Float16, WeightEncoding::Q8_0, WeightEncoding::Float8E4M3, WeightEncoding::Q4_1, WeightEncoding::Q4K, WeightEncoding::Q4_0];
        assert!(order.windows(2).all(|w| bits_per_value(w[0]) > bits_per_value(w[1])), "{:?}", order.map(bits_per_value));
        assert_eq!(bits_per_value(WeightEncoding::Q8_0), 8.5);
        // File bits per value: Q2_K 2.625, Q3_K 3.4375.
        for (storage, want) in [(S::Q2K, WeightEncoding::Q4K), (S::Q3K, WeightEncoding::Q4K)] {
            assert_eq!(storage.stored_scheme(), want, "{storage:?}");
            let (per, bytes) = storage.block();
            assert!(bits_per_value(want) >= (bytes * 8) as f32 / per as f32, "{storage:?}");
        }
        for storage in [S::F16, S::BF16, S::Q8_0, S::Q4_0, S::Q4_1, S::Q4K, S::Q5_0, S::Q5_1, S::Q5K, S::Q6K] {
            assert_eq!(Some(storage.stored_scheme()), storage.native_scheme(), "{storage:?} keeps its blocks");
        }
        assert_eq!(S::F32.stored_scheme(), WeightEncoding::Float32);
        assert_eq!(parse_linear_encoding("stored"), Ok(None));
        assert_eq!(parse_linear_encoding("q4_k"), Ok(Some(WeightEncoding::Q4K)));
        assert!(parse_linear_encoding("q3_k").unwrap_err().contains("stored"));
    }
}
