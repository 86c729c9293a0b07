//! The MEF writer: lays out the sections, encodes the header, and writes the file
//! through a temporary file that is renamed into place, so an error never leaves a
//! partial artifact behind. Weights are streamed in pieces of rows, so the
//! memory a compile needs does not grow with the model ([`PIECE_VALUES`]).

use std::path::Path;

use maxc_format::*;

use crate::error::{Error, Result};
use crate::import::WeightStore;
use crate::schedule::{WeightData, WeightSlot};

/// Weight entries are aligned to this within the weights section.
const WEIGHT_ALIGN: u64 = 64;

/// Everything the writer needs besides the header fields the driver fills in.
pub struct ArtifactContents<'a> {
    pub header: Header,
    /// The CPU shared object; `None` for a GPU-only artifact.
    pub code: Option<&'a [u8]>,
    /// The shared objects of `header.cpu_variants`, in order (multi-ISA artifacts).
    pub variant_code: &'a [&'a [u8]],
    /// PTX modules, in the order of `header.gpu_archs`.
    pub ptx: &'a [String],
    pub weights: &'a [WeightSlot],
    pub store: &'a WeightStore,
    pub tokenizer_json: &'a str,
    pub chat_template: Option<&'a str>,
    /// Show a progress bar while the weights are written.
    pub progress: bool,
}

/// Fills in `header.weights` (offsets within their device's weights section) and
/// returns each device's section size.
fn layout_weights(slots: &[WeightSlot], devices: usize) -> (Vec<WeightEntry>, Vec<u64>) {
    let mut ends = vec![0u64; devices];
    let mut entries = Vec::with_capacity(slots.len());
    for s in slots {
        let offset = ends[s.device as usize];
        let encoding = s.encoding;
        let (part, dtype, _) = encoding.parts()[s.part];
        let elems = encoding.part_elems(s.part, &s.shape).expect("the quantize pass only picks encodings whose blocks fit");
        let len = elems * dtype.size();
        entries.push(WeightEntry {
            name: s.name.clone(),
            encoding: encoding.name().into(),
            part: part.into(),
            dtype,
            layout: s.layout.name().into(),
            shape: s.shape.clone(),
            device: s.device,
            offset,
            len,
        });
        ends[s.device as usize] = (offset + len).div_ceil(WEIGHT_ALIGN) * WEIGHT_ALIGN;
    }
    (entries, ends)
}

/// Writes the artifact to `out` atomically.
pub fn write_artifact(out: &Path, mut contents: ArtifactContents<'_>) -> Result<u64> {
    let devices = contents.header.sub_models.len();
    let (entries, weight_lens) = layout_weights(contents.weights, devices);
    contents.header.weights = entries;
    let variant_sub_models = contents.header.cpu_variants.iter_mut().flat_map(|v| v.sub_models.iter_mut());
    for (i, m) in contents.header.sub_models.iter_mut().chain(variant_sub_models).enumerate() {
        m.weight_bytes = weight_lens[i % devices];
    }
    let mut lens = Vec::new();
    if let Some(code) = contents.code {
        lens.push((SectionKind::Code, code.len() as u64));
    }
    assert_eq!(contents.variant_code.len(), contents.header.cpu_variants.len(), "one shared object per further CPU variant");
    for (i, code) in contents.variant_code.iter().enumerate() {
        lens.push((SectionKind::VariantCode(i as u32), code.len() as u64));
    }
    for (d, len) in weight_lens.iter().enumerate() {
        lens.push((SectionKind::Weights(d as u32), *len));
    }
    lens.push((SectionKind::Tokenizer, contents.tokenizer_json.len() as u64));
    if let Some(t) = contents.chat_template {
        lens.push((SectionKind::ChatTemplate, t.len() as u64));
    }
    assert_eq!(contents.ptx.len(), contents.header.gpu_archs.len(), "one PTX module per GPU architecture");
    for (i, module) in contents.ptx.iter().enumerate() {
        lens.push((SectionKind::Ptx(i as u32), module.len() as u64));
    }
    // Fixed-width integer encoding: the header length does not depend on the offsets
    // or checksums, so the sections can be laid out (and written, and hashed) before
    // the final header is encoded and written over its placeholder.
    contents.header.sections = lens.iter().map(|&(kind, len)| Section { kind, offset: 0, len, checksum: 0 }).collect();
    let header_len = encode_header(&contents.header).len() as u64;
    let mut at = align_section(header_len);
    for s in &mut contents.header.sections {
        s.offset = at;
        at = align_section(at + s.len);
    }

    // Removed on error (when dropped) and on a signal (`output::remove_temp_files`).
    let tmp = maxrun_runtime::output::TempFile::new(out);
    let total = write_file(tmp.path(), header_len, &mut contents)?;
    tmp.commit().map_err(|e| Error::write(out, e))?;
    Ok(total)
}

/// Values per piece of a large tensor: a tensor is decoded, encoded, laid out
/// and written in pieces of at most this many values (whole groups of 16 rows),
/// so that a compile's memory does not grow with the model: each worker thread
/// holds one piece, about 3 x 4 MiB (the values as f32, encoded, laid out).
pub const PIECE_VALUES: usize = 1 << 20;

/// One piece of work: rows `rows` of the tensor whose parts are the slots `group`.
struct Piece {
    group: std::ops::Range<usize>,
    rows: std::ops::Range<usize>,
}

/// Rows of a tensor of `shape`: every axis but the last, flattened.
fn rows_of(shape: &[u64]) -> usize {
    shape.iter().rev().skip(1).product::<u64>() as usize
}

/// Columns of a tensor of `shape`: its last axis (1 for a scalar).
fn cols_of(shape: &[u64]) -> usize {
    *shape.last().unwrap_or(&1) as usize
}

/// Whether shard `sh` of a tensor of shape `full` splits its rows (an axis
/// before the last) rather than its columns.
fn splits_rows(sh: crate::graph::WeightShard, full: &[u64]) -> bool {
    (sh.axis as usize) + 1 < full.len()
}

/// Writes the file at `tmp` (sections at the offsets in the header, gaps zero),
/// then reads each section back for its checksum and writes the header.
/// Weights are written in pieces by all of rayon's threads, each piece to its
/// own offsets, so no thread holds more than one piece.
fn write_file(tmp: &Path, header_len: u64, c: &mut ArtifactContents<'_>) -> Result<u64> {
    use std::os::unix::fs::FileExt;
    let io = |e| Error::write(tmp, e);
    let end = c.header.sections.last().map_or(header_len, |s| s.offset + s.len);
    let file = std::fs::File::options().read(true).write(true).create(true).truncate(true).open(tmp).map_err(io)?;
    file.set_len(end).map_err(io)?;
    for s in &c.header.sections {
        match s.kind {
            SectionKind::Code => file.write_all_at(c.code.unwrap_or_default(), s.offset).map_err(io)?,
            SectionKind::VariantCode(i) => file.write_all_at(c.variant_code[i as usize], s.offset).map_err(io)?,
            SectionKind::Ptx(i) => file.write_all_at(c.ptx[i as usize].as_bytes(), s.offset).map_err(io)?,
            SectionKind::Tokenizer => file.write_all_at(c.tokenizer_json.as_bytes(), s.offset).map_err(io)?,
            SectionKind::ChatTemplate => file.write_all_at(c.chat_template.unwrap_or_default().as_bytes(), s.offset).map_err(io)?,
            SectionKind::Weights(device) => write_weights(&file, tmp, s, device, c)?,
        }
    }
    let mut buffer = vec![0u8; 4 << 20];
    for s in &mut c.header.sections {
        let mut state = ChecksumState::new();
        let mut at = s.offset;
        while at < s.offset + s.len {
            let n = (s.offset + s.len - at).min(buffer.len() as u64) as usize;
            file.read_exact_at(&mut buffer[..n], at).map_err(io)?;
            state.update(&buffer[..n]);
            at += n as u64;
        }
        s.checksum = state.digest();
    }
    let prelude = encode_header(&c.header);
    assert_eq!(prelude.len() as u64, header_len, "header length must not depend on offsets or checksums");
    file.write_all_at(&prelude, 0).map_err(io)?;
    file.sync_all().map_err(io)?;
    Ok(end)
}

/// Writes one device's weights section in pieces ([`PIECE_VALUES`]).
fn write_weights(file: &std::fs::File, tmp: &Path, s: &Section, device: u32, c: &ArtifactContents<'_>) -> Result<()> {
    use rayon::prelude::*;
    use std::os::unix::fs::FileExt;
    let bar = crate::progress::bytes_bar(s.len, "writing weights", c.progress);
    // One group per tensor: its parts are consecutive slots, encoded together.
    let mut groups: Vec<std::ops::Range<usize>> = Vec::new();
    for (i, slot) in c.weights.iter().enumerate() {
        if slot.device != device {
            continue;
        }
        match groups.last_mut() {
            Some(g) if slot.part > 0 => g.end = i + 1,
            _ => groups.push(i..i + 1),
        }
    }
    let mut pieces = Vec::new();
    for g in groups {
        let slot = &c.weights[g.start];
        let rows = rows_of(&slot.shape);
        let cols = cols_of(&slot.shape);
        let step = (PIECE_VALUES / cols.max(1)).max(1).next_multiple_of(16);
        pieces.extend((0..rows).step_by(step).map(|r| Piece { group: g.clone(), rows: r..(r + step).min(rows) }));
    }
    pieces.par_iter().try_for_each(|piece| -> Result<()> {
        let first = &c.weights[piece.group.start];
        let tensor = encode_piece(first, c.store, piece.rows.clone())?;
        assert_eq!(tensor.parts.len(), piece.group.len(), "{}: parts", first.name);
        let rows = rows_of(&first.shape) as u64;
        for (entry, bytes) in c.header.weights[piece.group.clone()].iter().zip(&tensor.parts) {
            // Every part's rows (or groups of 16 rows, laid out) are equal runs of bytes.
            let (at, len) = (entry.len / rows * piece.rows.start as u64, entry.len / rows * piece.rows.len() as u64);
            assert_eq!(bytes.len() as u64, len, "{}: rows {:?} of a part", entry.name, piece.rows);
            file.write_all_at(bytes, s.offset + entry.offset + at).map_err(|e| Error::write(tmp, e))?;
            bar.inc(len);
        }
        Ok(())
    })?;
    bar.finish_and_clear();
    Ok(())
}

/// Rows `rows` of a tensor's parts in its encoding and layout (little-endian),
/// from its first slot; `rows` starts at a multiple of 16, so a layout's groups
/// of 16 rows are whole.
fn encode_piece(slot: &WeightSlot, store: &WeightStore, rows: std::ops::Range<usize>) -> Result<crate::quant::Encoded> {
    let mut e = encode_rows(slot, store, rows.clone())?;
    let k = cols_of(&slot.shape);
    if slot.layout == maxc_format::Layout::Panel16 {
        let size = e.parts[0].len() / (rows.len() * k);
        e.parts[0] = maxc_kernels::library::matmul_panel::pack_panels(&e.parts[0], rows.len(), k, size);
    }
    if slot.layout == maxc_format::Layout::Interleaved16 {
        e.parts = maxc_kernels::library::dequant::interleave_rows(slot.encoding, &e.parts, rows.len(), k);
    }
    Ok(e)
}

/// Rows `rows` of the slot's tensor, row-major: its checkpoint tensor (or the
/// slot's shard of it), the stacked tensors' rows in turn, or computed values.
fn encode_rows(slot: &WeightSlot, store: &WeightStore, rows: std::ops::Range<usize>) -> Result<crate::quant::Encoded> {
    let cols = cols_of(&slot.shape);
    let names = match &slot.data {
        WeightData::Values(v) => return Ok(crate::quant::encode(slot.encoding, &v[rows.start * cols..rows.end * cols], cols)),
        WeightData::Checkpoint(name) => std::slice::from_ref(name),
        WeightData::Stacked(names) => names.as_slice(),
    };
    let mut pieces = Vec::new();
    let mut at = 0;
    for name in names {
        let len = shard_rows(slot, store, name)?;
        let (lo, hi) = (rows.start.max(at), rows.end.min(at + len));
        if lo < hi {
            pieces.push(checkpoint_rows(slot, store, name, lo - at..hi - at)?);
        }
        at += len;
    }
    Ok(if pieces.len() == 1 { pieces.pop().expect("one piece") } else { crate::quant::Encoded::concat_rows(pieces) })
}

/// The rows of checkpoint tensor `name` that the slot holds: all of them, or
/// its shard's share when the shard splits the rows.
fn shard_rows(slot: &WeightSlot, store: &WeightStore, name: &str) -> Result<usize> {
    let full = store.shape(name)?;
    Ok(match slot.shard {
        Some(sh) if splits_rows(sh, &full) => rows_of(&full) / sh.devices as usize,
        _ => rows_of(&full),
    })
}

/// Rows `rows` of the slot's share of checkpoint tensor `name`. A shard is cut
/// from the tensor as the unsharded artifact would store it (native blocks stay
/// bit-exact): a range of its rows, or of its columns in whole blocks.
fn checkpoint_rows(slot: &WeightSlot, store: &WeightStore, name: &str, rows: std::ops::Range<usize>) -> Result<crate::quant::Encoded> {
    let Some(sh) = slot.shard else {
        return store.rows_encoded(name, slot.encoding, rows);
    };
    let full = store.shape(name)?;
    if splits_rows(sh, &full) {
        assert_eq!(sh.axis, 0, "{name}: shards split the first axis or the last");
        let start = rows_of(&full) / sh.devices as usize * sh.index as usize;
        return store.rows_encoded(name, slot.encoding, start + rows.start..start + rows.end);
    }
    let cols = *full.last().unwrap_or(&1);
    let len = cols / sh.devices as u64;
    let whole_rows = store.rows_encoded(name, slot.encoding, rows.clone())?;
    Ok(whole_rows.slice(slot.encoding, &[rows.len() as u64, cols], 1, sh.index as u64 * len, len))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tensor written in pieces is the tensor written whole: every part's
    /// pieces, in order, are its bytes, in each layout (groups of 16 rows stay
    /// whole) and encoding (every encoding is row-local).
    #[test]
    fn pieces_concatenate_to_the_whole_tensor() {
        let (rows, cols) = (64usize, 256usize);
        let values: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 1013) as f32 - 506.0) / 300.0).collect();
        let store = WeightStore::default();
        let cases = [
            (WeightEncoding::Float32, Layout::Panel16),
            (WeightEncoding::BFloat16, Layout::Panel16),
            (WeightEncoding::Q8_0, Layout::Interleaved16),
            (WeightEncoding::Q4K, Layout::Interleaved16),
            (WeightEncoding::Q5_1, Layout::Interleaved16),
            (WeightEncoding::Q6K, Layout::Interleaved16),
            (WeightEncoding::Q5K, Layout::Interleaved16),
            (WeightEncoding::Q4_1, Layout::RowMajor),
            (WeightEncoding::Float8E4M3, Layout::Panel16),
        ];
        for (encoding, layout) in cases {
            let slot = WeightSlot {
                name: "w".into(),
                shape: vec![rows as u64, cols as u64],
                data: WeightData::Values(values.clone()),
                encoding,
                part: 0,
                layout,
                device: 0,
                shard: None,
            };
            let whole = encode_piece(&slot, &store, 0..rows).unwrap();
            let pieces: Vec<_> = [0..16, 16..48, 48..64].into_iter().map(|r| encode_piece(&slot, &store, r).unwrap()).collect();
            for (p, bytes) in whole.parts.iter().enumerate() {
                let joined: Vec<u8> = pieces.iter().flat_map(|e| e.parts[p].iter().copied()).collect();
                assert!(joined == *bytes, "{} {:?}: part {p} in pieces differs", encoding.name(), layout);
            }
        }
    }
}
