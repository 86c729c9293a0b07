//! The MEF writer: lays out the sections, encodes the header, and writes the file
//! through a temporary file that is renamed into place, so an error never leaves a
//! partial artifact behind. Weights are streamed one tensor at a time.

use std::io::{BufWriter, Seek, Write};
use std::path::{Path, PathBuf};

use maxrun::format::*;

use crate::error::{Error, Result};
use crate::import::WeightStore;
use crate::schedule::{WeightData, WeightSlot};

/// Weight entries are aligned to this within the weights section.
const WEIGHT_ALIGN: u64 = 64;

/// Everything the writer needs besides the header fields the driver fills in.
pub struct ArtifactContents<'a> {
    pub header: Header,
    pub code: &'a [u8],
    pub weights: &'a [WeightSlot],
    pub store: &'a WeightStore,
    pub tokenizer_json: &'a str,
    pub chat_template: Option<&'a str>,
}

/// Fills in `header.weights` (offsets within the weights section) and returns its size.
fn layout_weights(slots: &[WeightSlot]) -> (Vec<WeightEntry>, u64) {
    let mut offset = 0u64;
    let mut entries = Vec::with_capacity(slots.len());
    for s in slots {
        let len = s.shape.iter().product::<u64>() * 4;
        entries.push(WeightEntry { name: s.name.clone(), dtype: DType::F32, shape: s.shape.clone(), offset, len });
        offset = (offset + len).div_ceil(WEIGHT_ALIGN) * WEIGHT_ALIGN;
    }
    (entries, offset)
}

/// Writes the artifact to `out` atomically.
pub fn write_artifact(out: &Path, mut contents: ArtifactContents<'_>) -> Result<u64> {
    let (entries, weights_len) = layout_weights(contents.weights);
    contents.header.weights = entries;
    let mut lens = vec![
        (SectionKind::Code, contents.code.len() as u64),
        (SectionKind::Weights, weights_len),
        (SectionKind::Tokenizer, contents.tokenizer_json.len() as u64),
    ];
    if let Some(t) = contents.chat_template {
        lens.push((SectionKind::ChatTemplate, t.len() as u64));
    }
    // Fixed-width integer encoding: the header length does not depend on the offsets,
    // so encode once with placeholders, then again with the real offsets.
    contents.header.sections = lens.iter().map(|&(kind, len)| Section { kind, offset: 0, len }).collect();
    let header_len = encode_header(&contents.header).len() as u64;
    let mut at = align_section(header_len);
    for s in &mut contents.header.sections {
        s.offset = at;
        at = align_section(at + s.len);
    }
    let prelude = encode_header(&contents.header);
    assert_eq!(prelude.len() as u64, header_len, "header length must not depend on section offsets");

    let tmp = temp_path(out);
    let result = write_file(&tmp, &prelude, &contents);
    match result {
        Ok(total) => {
            std::fs::rename(&tmp, out).map_err(|e| {
                let _ = std::fs::remove_file(&tmp);
                Error::io(out, e)
            })?;
            Ok(total)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

fn temp_path(out: &Path) -> PathBuf {
    let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "artifact".into());
    out.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

fn write_file(tmp: &Path, prelude: &[u8], c: &ArtifactContents<'_>) -> Result<u64> {
    let io = |e| Error::io(tmp, e);
    let file = std::fs::File::create(tmp).map_err(io)?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    w.write_all(prelude).map_err(io)?;
    for s in &c.header.sections {
        pad_to(&mut w, s.offset).map_err(io)?;
        match s.kind {
            SectionKind::Code => w.write_all(c.code).map_err(io)?,
            SectionKind::Tokenizer => w.write_all(c.tokenizer_json.as_bytes()).map_err(io)?,
            SectionKind::ChatTemplate => w.write_all(c.chat_template.unwrap_or_default().as_bytes()).map_err(io)?,
            SectionKind::Weights => {
                for (slot, entry) in c.weights.iter().zip(&c.header.weights) {
                    pad_to(&mut w, s.offset + entry.offset).map_err(io)?;
                    write_weight(&mut w, slot, c.store).map_err(|e| match e {
                        Error::Io { source, .. } => Error::io(tmp, source),
                        other => other,
                    })?;
                }
            }
        }
    }
    let end = c.header.sections.last().map_or(0, |s| s.offset + s.len);
    pad_to(&mut w, end).map_err(io)?;
    let file = w.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(io)?;
    Ok(end)
}

fn write_weight(w: &mut impl Write, slot: &WeightSlot, store: &WeightStore) -> Result<()> {
    let put = |w: &mut dyn Write, values: &[f32]| -> std::io::Result<()> {
        let mut bytes = Vec::with_capacity(values.len() * 4);
        for v in values {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        w.write_all(&bytes)
    };
    let io = |e| Error::io("<weights>", e);
    match &slot.data {
        WeightData::Checkpoint(name) => put(w, &store.to_f32(name)?).map_err(io),
        WeightData::Stacked(names) => {
            for n in names {
                put(w, &store.to_f32(n)?).map_err(io)?;
            }
            Ok(())
        }
        WeightData::Values(v) => put(w, v).map_err(io),
    }
}

fn pad_to<W: Write + Seek>(w: &mut W, offset: u64) -> std::io::Result<()> {
    let pos = w.stream_position()?;
    assert!(pos <= offset, "writer is past offset {offset} (at {pos})");
    const ZEROS: [u8; 4096] = [0; 4096];
    let mut left = offset - pos;
    while left > 0 {
        let n = left.min(ZEROS.len() as u64) as usize;
        w.write_all(&ZEROS[..n])?;
        left -= n as u64;
    }
    Ok(())
}
