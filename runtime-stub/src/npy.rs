//! Reading and writing NumPy `.npy` files (format 1.0, little-endian float32, C order).

use std::path::Path;

/// Errors from `.npy` reading.
#[derive(Debug, thiserror::Error)]
pub enum NpyError {
    #[error("{path}: {error}")]
    Io { path: String, error: std::io::Error },
    #[error("{path}: {message}")]
    Format { path: String, message: String },
}

/// Serializes a float32 array of `shape` in `.npy` 1.0 format.
pub fn to_bytes(shape: &[usize], data: &[f32]) -> Vec<u8> {
    assert_eq!(shape.iter().product::<usize>(), data.len(), "npy shape does not match the data");
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_str = if dims.len() == 1 { format!("({},)", dims[0]) } else { format!("({})", dims.join(", ")) };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_str}, }}");
    // Magic (6) + version (2) + length (2) + header + newline, padded to 64 bytes.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + data.len() * 4);
    out.extend(b"\x93NUMPY\x01\x00");
    out.extend((header.len() as u16).to_le_bytes());
    out.extend(header.as_bytes());
    for v in data {
        out.extend(v.to_le_bytes());
    }
    out
}

/// Writes a float32 array to `path` (through a temporary file beside it: no
/// partial file is left on error or on a signal; `crate::output`).
pub fn write_f32(path: &Path, shape: &[usize], data: &[f32]) -> std::io::Result<()> {
    crate::output::write_atomically(path, &to_bytes(shape, data))
}

/// Reads a little-endian float32 `.npy` file: (shape, data).
pub fn read_f32(path: &Path) -> Result<(Vec<usize>, Vec<f32>), NpyError> {
    let p = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|error| NpyError::Io { path: p.clone(), error })?;
    let fail = |m: &str| NpyError::Format { path: p.clone(), message: m.to_string() };
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(fail("not a .npy file (bad magic)"));
    }
    let (hlen, hstart) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
        _ => return Err(fail("unsupported .npy version")),
    };
    let header = std::str::from_utf8(bytes.get(hstart..hstart + hlen).ok_or_else(|| fail("truncated header"))?)
        .map_err(|_| fail("header is not UTF-8"))?;
    if !header.contains("'descr': '<f4'") {
        return Err(fail("only little-endian float32 ('<f4') arrays are supported"));
    }
    if header.contains("'fortran_order': True") {
        return Err(fail("Fortran-order arrays are not supported"));
    }
    let open = header.find("'shape': (").ok_or_else(|| fail("header has no shape"))? + "'shape': (".len();
    let close = header[open..].find(')').ok_or_else(|| fail("header shape is not closed"))? + open;
    let shape: Vec<usize> = header[open..close]
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().map_err(|_| fail("bad shape entry")))
        .collect::<Result<_, _>>()?;
    let n: usize = shape.iter().product();
    let data = &bytes[hstart + hlen..];
    if data.len() != n * 4 {
        return Err(fail(&format!("expected {} data bytes for shape {shape:?}, found {}", n * 4, data.len())));
    }
    Ok((shape, data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_pads_the_header() {
        let bytes = to_bytes(&[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let hlen = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
        assert_eq!((10 + hlen) % 64, 0);
        let path = std::env::temp_dir().join(format!("maxrun-npy-{}.npy", std::process::id()));
        std::fs::write(&path, &bytes).unwrap();
        let (shape, data) = read_f32(&path).unwrap();
        assert_eq!(shape, vec![2, 3]);
        assert_eq!(data[5], 6.0);
    }
}
