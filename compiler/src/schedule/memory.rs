//! Memory planning: assign every activation buffer an offset in one arena so that
//! buffers whose live ranges overlap never overlap in memory.
//!
//! Buffers are placed in definition order at the lowest 64-byte aligned offset that
//! clears every buffer still live at that point (first fit). A launch's output is
//! never placed over its own inputs, because the inputs are live at that launch.

use super::BufferInfo;

/// Arena alignment of every buffer.
pub const ALIGN: u64 = 64;

/// Returns each buffer's offset and the arena size.
pub fn plan_arena(buffers: &[BufferInfo]) -> (Vec<u64>, u64) {
    let mut offsets = vec![0u64; buffers.len()];
    let mut order: Vec<usize> = (0..buffers.len()).collect();
    order.sort_by_key(|&b| (buffers[b].def, b));
    let mut placed: Vec<usize> = Vec::new();
    let mut size = 0u64;
    for &b in &order {
        let info = &buffers[b];
        let mut live: Vec<(u64, u64)> = placed
            .iter()
            .filter(|&&o| buffers[o].last_use >= info.def && buffers[o].def <= info.last_use)
            .map(|&o| (offsets[o], offsets[o] + buffers[o].bytes))
            .collect();
        live.sort();
        let mut at = 0u64;
        for (start, end) in live {
            if at + info.bytes <= start {
                break;
            }
            at = at.max(end.div_ceil(ALIGN) * ALIGN);
        }
        offsets[b] = at;
        size = size.max(at + info.bytes);
        placed.push(b);
    }
    (offsets, size.div_ceil(ALIGN) * ALIGN)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buf(bytes: u64, def: usize, last_use: usize) -> BufferInfo {
        BufferInfo { bytes, def, last_use }
    }

    #[test]
    fn dead_buffers_are_reused_and_live_ones_never_overlap() {
        let bufs = vec![buf(100, 0, 1), buf(100, 1, 2), buf(100, 2, 3), buf(64, 3, 3)];
        let (off, size) = plan_arena(&bufs);
        for i in 0..bufs.len() {
            for j in 0..i {
                let overlap_time = bufs[i].def <= bufs[j].last_use && bufs[j].def <= bufs[i].last_use;
                let overlap_mem = off[i] < off[j] + bufs[j].bytes && off[j] < off[i] + bufs[i].bytes;
                assert!(!(overlap_time && overlap_mem), "buffers {i} and {j} collide: {off:?}");
            }
            assert_eq!(off[i] % ALIGN, 0);
        }
        // Buffer 2 is defined after buffer 0 died, so it reuses offset 0.
        assert_eq!(off[2], 0);
        assert!(size <= 256, "arena of {size} bytes for at most two live 100-byte buffers");
    }
}
