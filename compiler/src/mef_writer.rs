//! The MEF writer: lays out the sections, encodes the header, and writes the file
//! through a temporary file that is renamed into place, so an error never leaves a
//! partial artifact behind. Weights are streamed one tensor at a time.

use std::io::{BufWriter, Seek, Write};

use std::path::Path;

use maxrun::format::*;

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
    for (m, len) in contents.header.sub_models.iter_mut().zip(&weight_lens) {
        m.weight_bytes = *len;
    }
    let mut lens = Vec::new();
    if let Some(code) = contents.code {
        lens.push((SectionKind::Code, code.len() as u64));
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
    let tmp = maxrun::output::TempFile::new(out);
    let total = write_file(tmp.path(), header_len, &mut contents)?;
    tmp.commit().map_err(|e| Error::write(out, e))?;
    Ok(total)
}

/// A writer that tracks its position and hashes what it writes.
struct Hashing<W> {
    inner: W,
    pos: u64,
    state: ChecksumState,
}

impl<W: Write> Hashing<W> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.inner.write_all(bytes)?;
        self.state.update(bytes);
        self.pos += bytes.len() as u64;
        Ok(())
    }

    /// Writes zeros up to absolute `offset`.
    fn pad_to(&mut self, offset: u64) -> std::io::Result<()> {
        assert!(self.pos <= offset, "writer is past offset {offset} (at {})", self.pos);
        const ZEROS: [u8; 4096] = [0; 4096];
        while self.pos < offset {
            let n = (offset - self.pos).min(ZEROS.len() as u64) as usize;
            self.write(&ZEROS[..n])?;
        }
        Ok(())
    }

    /// Starts a new checksum (at a section start) and returns the previous one.
    fn restart(&mut self) -> u64 {
        std::mem::replace(&mut self.state, ChecksumState::new()).digest()
    }
}

/// Tensors decoded in parallel per batch (their order in the file never changes).
const WEIGHT_BATCH: usize = 8;

fn write_file(tmp: &Path, header_len: u64, c: &mut ArtifactContents<'_>) -> Result<u64> {
    let io = |e| Error::write(tmp, e);
    let file = std::fs::File::create(tmp).map_err(io)?;
    let mut w = Hashing { inner: BufWriter::with_capacity(1 << 20, file), pos: 0, state: ChecksumState::new() };
    w.pad_to(header_len).map_err(io)?;
    let mut checksums = Vec::with_capacity(c.header.sections.len());
    for s in &c.header.sections {
        w.pad_to(s.offset).map_err(io)?;
        w.restart();
        match s.kind {
            SectionKind::Code => w.write(c.code.unwrap_or_default()).map_err(io)?,
            SectionKind::Ptx(i) => w.write(c.ptx[i as usize].as_bytes()).map_err(io)?,
            SectionKind::Tokenizer => w.write(c.tokenizer_json.as_bytes()).map_err(io)?,
            SectionKind::ChatTemplate => w.write(c.chat_template.unwrap_or_default().as_bytes()).map_err(io)?,
            SectionKind::Weights(device) => {
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
                for batch in groups.chunks(WEIGHT_BATCH) {
                    use rayon::prelude::*;
                    let encoded: Vec<Result<crate::quant::Encoded>> = batch.par_iter().map(|g| encode_weight(&c.weights[g.start], c.store)).collect();
                    for (group, tensor) in batch.iter().zip(encoded) {
                        let tensor = tensor?;
                        assert_eq!(tensor.parts.len(), group.len(), "{}: parts", c.weights[group.start].name);
                        for (entry, bytes) in c.header.weights[group.clone()].iter().zip(&tensor.parts) {
                            assert_eq!(bytes.len() as u64, entry.len, "{}: part length", entry.name);
                            w.pad_to(s.offset + entry.offset).map_err(io)?;
                            w.write(bytes).map_err(io)?;
                        }
                        bar.set_position(w.pos - s.offset);
                    }
                }
                bar.finish_and_clear();
                // The section ends 64-byte aligned, after the last entry's padding.
                w.pad_to(s.offset + s.len).map_err(io)?;
            }
        }
        assert_eq!(w.pos, s.offset + s.len, "{:?} section length", s.kind);
        checksums.push(w.restart());
    }
    let end = c.header.sections.last().map_or(0, |s| s.offset + s.len);
    w.pad_to(end).map_err(io)?;
    for (s, sum) in c.header.sections.iter_mut().zip(checksums) {
        s.checksum = sum;
    }
    let prelude = encode_header(&c.header);
    assert_eq!(prelude.len() as u64, header_len, "header length must not depend on offsets or checksums");
    let mut file = w.inner.into_inner().map_err(|e| io(e.into_error()))?;
    file.seek(std::io::SeekFrom::Start(0)).map_err(io)?;
    file.write_all(&prelude).map_err(io)?;
    file.sync_all().map_err(io)?;
    Ok(end)
}

/// A tensor's parts in its encoding and layout (little-endian), from its first slot.
fn encode_weight(slot: &WeightSlot, store: &WeightStore) -> Result<crate::quant::Encoded> {
    let mut e = encode_row_major(slot, store)?;
    if slot.layout == maxrun::format::Layout::Panel16 {
        let (n, k) = (slot.shape[0] as usize, slot.shape[1] as usize);
        let size = e.parts[0].len() / (n * k);
        e.parts[0] = maxc_kernels::library::matmul_panel::pack_panels(&e.parts[0], n, k, size);
    }
    if slot.layout == maxrun::format::Layout::Interleaved16 {
        let (n, k) = (slot.shape[0] as usize, slot.shape[1] as usize);
        e.parts = maxc_kernels::library::dequant::interleave_rows(slot.encoding, &e.parts, n, k);
    }
    Ok(e)
}

fn encode_row_major(slot: &WeightSlot, store: &WeightStore) -> Result<crate::quant::Encoded> {
    use crate::interp::WeightSource;
    // A shard is cut from the whole tensor, encoded as the unsharded artifact
    // would store it (native blocks stay bit-exact).
    let checkpoint = |name: &str| -> Result<crate::quant::Encoded> {
        let Some(sh) = slot.shard else {
            return store.weight_encoded(name, slot.encoding, *slot.shape.last().unwrap_or(&1) as usize);
        };
        let full = store.shape(name)?;
        let whole = store.weight_encoded(name, slot.encoding, *full.last().unwrap_or(&1) as usize)?;
        let len = full[sh.axis as usize] / sh.devices as u64;
        Ok(whole.slice(slot.encoding, &full, sh.axis as usize, sh.index as u64 * len, len))
    };
    Ok(match &slot.data {
        WeightData::Checkpoint(name) => checkpoint(name)?,
        WeightData::Stacked(names) => crate::quant::Encoded::concat_rows(names.iter().map(|n| checkpoint(n)).collect::<Result<Vec<_>>>()?),
        WeightData::Values(v) => crate::quant::encode(slot.encoding, v, *slot.shape.last().unwrap_or(&1) as usize),
    })
}
