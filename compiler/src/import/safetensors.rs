//! Reading `*.safetensors` files (single or sharded with an index) into the weight store.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use safetensors::{Dtype, SafeTensors};

use super::mmap_file;
use super::weights::{StorageType, WeightStore};
use crate::error::{Error, Result};

/// The safetensors files of an HF directory: those named by `model.safetensors.index.json`
/// when it exists, otherwise every `*.safetensors` file, in name order.
pub fn list_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::invalid(&index, "index", format!("not valid JSON: {e}")))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::invalid(&index, "weight_map", "required object is missing"))?;
        let mut files = BTreeSet::new();
        for (tensor, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| Error::invalid(&index, format!("weight_map.{tensor}"), "expected a file name"))?;
            files.insert(dir.join(file));
        }
        return Ok(files.into_iter().collect());
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::invalid(dir, "*.safetensors", "no safetensors weight files in the model directory"));
    }
    Ok(files)
}

/// One tensor found in a safetensors file: name, storage, shape, byte offset, byte length.
pub type TensorRecord = (String, StorageType, Vec<usize>, usize, usize);

/// What a safetensors file holds: float tensors, and the names and dtypes of the
/// others (integer buffers such as BERT's `position_ids`), which are skipped and
/// only an error if a builder asks for them.
#[derive(Debug, Default)]
pub struct Parsed {
    pub tensors: Vec<TensorRecord>,
    pub skipped: Vec<(String, String)>,
}

/// Parses safetensors bytes (`path` names them in errors). The header and every
/// tensor's byte range are validated against `bytes`.
pub fn parse(path: &Path, bytes: &[u8]) -> Result<Parsed> {
    check_header(path, bytes)?;
    let st = SafeTensors::deserialize(bytes)
        .map_err(|e| Error::invalid(path, "header", format!("not a valid safetensors file ({e}); the file may be truncated or corrupt")))?;
    let base = bytes.as_ptr() as usize;
    let mut parsed = Parsed::default();
    for (name, view) in st.tensors() {
        let storage = match view.dtype() {
            Dtype::F32 => StorageType::F32,
            Dtype::F16 => StorageType::F16,
            Dtype::BF16 => StorageType::BF16,
            other => {
                parsed.skipped.push((name, format!("{other:?}")));
                continue;
            }
        };
        let data = view.data();
        let offset = data.as_ptr() as usize - base;
        let n: usize = view.shape().iter().product();
        if storage.bytes_for(n) != Some(data.len()) {
            return Err(Error::invalid(path, &name, format!("{} bytes for {n} elements of {}", data.len(), storage.name())));
        }
        parsed.tensors.push((name, storage, view.shape().to_vec(), offset, data.len()));
    }
    parsed.tensors.sort_by(|a, b| a.0.cmp(&b.0));
    parsed.skipped.sort();
    Ok(parsed)
}

/// Bits per element of each safetensors dtype (the format's own list).
const DTYPE_BITS: &[(&str, usize)] = &[
    ("BOOL", 8), ("U8", 8), ("I8", 8), ("F8_E5M2", 8), ("F8_E4M3", 8), ("F8_E8M0", 8), ("F4", 4), ("F6_E2M3", 6), ("F6_E3M2", 6),
    ("I16", 16), ("U16", 16), ("F16", 16), ("BF16", 16), ("I32", 32), ("U32", 32), ("F32", 32), ("I64", 64), ("U64", 64), ("F64", 64),
];

/// The header's entries in file order, duplicates kept (a JSON object read
/// into a map keeps only the last of two equal keys).
struct HeaderEntries(Vec<(String, serde_json::Value)>);

impl<'de> serde::Deserialize<'de> for HeaderEntries {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Entries;
        impl<'de> serde::de::Visitor<'de> for Entries {
            type Value = HeaderEntries;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object of tensors")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> std::result::Result<HeaderEntries, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = map.next_entry()? {
                    entries.push(entry);
                }
                Ok(HeaderEntries(entries))
            }
        }
        d.deserialize_map(Entries)
    }
}

/// Checks every tensor entry of the header, naming the tensor and the value
/// found: a known dtype, a shape of whole numbers, data offsets inside the data
/// and as many bytes as the shape needs, and no tensor named twice. (The
/// safetensors crate checks the same but names neither tensor nor value.)
fn check_header(path: &Path, bytes: &[u8]) -> Result<()> {
    let corrupt = |what: String| Error::invalid(path, "header", format!("{what}; the file may be truncated or corrupt"));
    let n = bytes.get(..8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize).ok_or_else(|| corrupt("shorter than its 8-byte header length".into()))?;
    let header = bytes.get(8..8usize.saturating_add(n)).ok_or_else(|| corrupt(format!("the header length {n} runs past the end of the file ({} bytes)", bytes.len())))?;
    let data_len = bytes.len() - 8 - n;
    let HeaderEntries(entries) = serde_json::from_slice(header).map_err(|e| corrupt(format!("the header is not a JSON object of tensors ({e})")))?;
    let mut seen = BTreeSet::new();
    for (name, entry) in &entries {
        if name == "__metadata__" {
            continue;
        }
        if !seen.insert(name.as_str()) {
            return Err(Error::invalid(path, name, "the header names this tensor twice; the file is corrupt: write it again"));
        }
        let field = |f: &str| format!("{name}.{f}");
        let dtype = entry.get("dtype").ok_or_else(|| Error::invalid(path, field("dtype"), "missing"))?;
        let bits = dtype.as_str().and_then(|d| DTYPE_BITS.iter().find(|(n, _)| *n == d)).map(|(_, b)| *b).ok_or_else(|| {
            let known: Vec<&str> = DTYPE_BITS.iter().map(|(n, _)| *n).collect();
            Error::invalid(path, field("dtype"), format!("{dtype} is not a safetensors dtype; known: {}", known.join(", ")))
        })?;
        let shape = entry.get("shape").ok_or_else(|| Error::invalid(path, field("shape"), "missing"))?;
        let dims: Option<Vec<usize>> = shape.as_array().and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect());
        let dims = dims.ok_or_else(|| Error::invalid(path, field("shape"), format!("{shape} is not a list of sizes")))?;
        let offsets = entry.get("data_offsets").ok_or_else(|| Error::invalid(path, field("data_offsets"), "missing"))?;
        let (begin, end) = match offsets.as_array().map(|a| a.iter().map(serde_json::Value::as_u64).collect::<Vec<_>>()).as_deref() {
            Some([Some(b), Some(e)]) if b <= e => (*b as usize, *e as usize),
            _ => return Err(Error::invalid(path, field("data_offsets"), format!("{offsets} is not [begin, end] with begin <= end"))),
        };
        if end > data_len {
            return Err(Error::invalid(
                path,
                field("data_offsets"),
                format!("{offsets} runs past the end of the data ({data_len} bytes after the header); the file is truncated or corrupt"),
            ));
        }
        let needed = dims.iter().try_fold(bits, |a, &d| a.checked_mul(d)).map(|b| b.div_ceil(8));
        if needed != Some(end - begin) {
            return Err(Error::invalid(
                path,
                name,
                format!("shape {shape} of {dtype} needs {} bytes, but data_offsets {offsets} hold {}", needed.map_or("too many".into(), |b| b.to_string()), end - begin),
            ));
        }
    }
    Ok(())
}

/// Maps one safetensors file and registers its tensors.
pub fn load_file(path: &Path, store: &mut WeightStore) -> Result<()> {
    let map = Arc::new(mmap_file(path)?);
    let parsed = parse(path, &map)?;
    // A tensor in two files would leave which one counts to the reading order.
    for (name, ..) in &parsed.tensors {
        if let Some(earlier) = store.file_of(name) {
            return Err(Error::invalid(
                path,
                name,
                format!("is also in {}: each tensor must be in one weight file; remove one of them", earlier.display()),
            ));
        }
    }
    let file = store.add_file(path, map);
    for (name, storage, shape, offset, len) in parsed.tensors {
        store.insert(name, storage, shape, file, offset, len);
    }
    for (name, dtype) in parsed.skipped {
        store.skip(name, dtype, file);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(name: &str, bytes: &[u8]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("maxc-st-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    fn file_with_header(header: &str, data_len: usize) -> Vec<u8> {
        let mut v = (header.len() as u64).to_le_bytes().to_vec();
        v.extend(header.as_bytes());
        v.extend(std::iter::repeat_n(0u8, data_len));
        v
    }

    #[test]
    fn reads_a_valid_file() {
        let p = write("ok.safetensors", &file_with_header(r#"{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#, 16));
        let mut store = WeightStore::default();
        load_file(&p, &mut store).unwrap();
        assert_eq!(store.get("w").unwrap().shape, vec![2, 2]);
        assert_eq!(store.to_f32("w").unwrap(), vec![0.0; 4]);
    }

    #[test]
    fn truncated_header_is_an_error_naming_the_file() {
        let mut bytes = file_with_header(r#"{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#, 16);
        bytes.truncate(20);
        let p = write("trunc.safetensors", &bytes);
        let e = load_file(&p, &mut WeightStore::default()).unwrap_err().to_string();
        assert!(e.contains("trunc.safetensors") && e.contains("header"), "{e}");
    }

    #[test]
    fn tensor_past_end_of_file_is_an_error() {
        let p = write("short.safetensors", &file_with_header(r#"{"w":{"dtype":"F32","shape":[4,4],"data_offsets":[0,64]}}"#, 16));
        let e = load_file(&p, &mut WeightStore::default()).unwrap_err().to_string();
        assert!(e.contains("short.safetensors") && e.contains("truncated"), "{e}");
    }

    #[test]
    fn header_problems_name_the_tensor_and_the_value() {
        let cases = [
            (r#"{"w":{"dtype":"F99","shape":[4],"data_offsets":[0,16]}}"#, &["w.dtype", "F99"][..]),
            (r#"{"w":{"dtype":"F32","shape":[5],"data_offsets":[0,16]}}"#, &["w:", "[5]", "20 bytes"][..]),
            (r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,99]}}"#, &["w.data_offsets", "[0,99]", "past the end"][..]),
            (r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#, &["w:", "twice"][..]),
        ];
        for (i, (header, needles)) in cases.iter().enumerate() {
            let p = write(&format!("bad{i}.safetensors"), &file_with_header(header, 16));
            let e = load_file(&p, &mut WeightStore::default()).unwrap_err().to_string();
            assert!(needles.iter().all(|n| e.contains(n)), "{header}: {e}");
        }
    }

    #[test]
    fn unsupported_dtype_is_skipped_and_named_when_used() {
        let p = write("i8.safetensors", &file_with_header(r#"{"q":{"dtype":"I8","shape":[4],"data_offsets":[0,4]}}"#, 4));
        let mut store = WeightStore::default();
        load_file(&p, &mut store).unwrap();
        assert!(store.get("q").is_none());
        let e = store.skipped_error("q").unwrap().to_string();
        assert!(e.contains("i8.safetensors") && e.contains("q") && e.contains("I8") && e.contains("not supported"), "{e}");
    }
}
