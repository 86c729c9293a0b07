//! The CPU KV cache: one key buffer and one value buffer holding every layer's
//! rows for the artifact's whole context (`max_length` positions), zeroed, each
//! layer at a fixed offset.
//!
//! Where the whole cache takes at most [`HUGE_PAGE_SHARE`] of the memory the
//! system has available, it lives on transparent huge pages. Each layer's keys
//! (and values) are laid out `[kv_heads][max_length][head_dim]` by the kernels
//! that use them (CPU kernels store each aligned 16 key positions transposed,
//! `[head_dim][16]`, within the same span): a decode step stores one head row per KV head,
//! `4 * max_length * head_dim` bytes apart, and attention reads each head's
//! positions back as one run. Huge pages were chosen when the key cache was transposed
//! (`[kv_width][max_length]`, one float in each of `kv_width` rows per step: on
//! 4 KiB pages 192 TLB misses per layer and step for SmolLM2), where they made
//! SmolLM2 q4_1+int8 decode 1.07-1.10x faster; with head rows a step touches
//! `2 * kv_heads` pages per layer, and a long context's attention still reads
//! fewer pages (docs/performance-log.md, Decisions). The price is residency: the
//! first token's stores touch every huge page of the cache (a layer's keys are
//! at most a few huge pages), so all of it is resident from the start, where on
//! small pages a long context fills in as it is used. Above the share the cache
//! stays on ordinary, lazily faulted pages.
//!
//! A cache on huge pages is written through once when it is created (zeros, as
//! it already reads), as llama.cpp clears its cache buffer: on the Zen 3 VM the
//! first write to each part of fresh memory was expensive when it came from a
//! decode step's scattered row stores (the KV store took 16 us per layer instead
//! of 2 in the first 128 tokens of a process, about 170 ms in all), and more
//! than ten times cheaper per byte as one sequential pass at start
//! (docs/performance-log.md, Decisions).

use crate::huge::{available_memory, HugeBuf};

/// The largest fraction of available memory (`MemAvailable`) the KV cache may
/// take and still be placed on huge pages (1 / this).
pub const HUGE_PAGE_SHARE: u64 = 8;

/// Bytes added to each layer's stride (67 cache lines, an odd number) and
/// before the first layer's values (33 lines). Without them every layer's
/// rows for a position sit at the same address modulo the 2 MiB huge page
/// (layers are `max_length * kv_width * 4` bytes apart, 1.5 MiB for SmolLM2 at
/// 2048; keys and values in buffers aligned alike), so a decode step's 180 key
/// and value rows (30 layers x 3 heads x 2) fall into the same four L2 sets and,
/// depending on where the huge pages land physically, into the same L3 sets:
/// on the Zen 3 VM the KV store took 17-20 us per layer in 4 of 6 processes
/// and about 2 us in the others; with the skew, 1.6-3.5 us in all 6. (That slow
/// mode later turned out to follow first writes to fresh memory, fixed by the
/// write-through in [`KvCache::new`]; the skew's own effect on it is not shown.
/// docs/performance-log.md, Decisions.)
const LAYER_SKEW_BYTES: usize = 67 * 64;
/// Where the value buffer's first layer starts (see [`LAYER_SKEW_BYTES`]).
const VALUE_SKEW_BYTES: usize = 33 * 64;

/// One part of the encoding (a float cache has one): every layer's keys in
/// one buffer and values in another.
struct Part {
    keys: HugeBuf,
    values: HugeBuf,
    /// Bytes from one layer's keys (or values) to the next: the layer's bytes
    /// rounded up to whole cache lines, plus [`LAYER_SKEW_BYTES`].
    layer_bytes: usize,
}

/// Every layer's keys and values for the artifact's whole context (or a batch
/// pool's blocks), one pair of buffers per part of the KV encoding.
pub struct KvCache {
    parts: Vec<Part>,
    layers: usize,
    huge_pages: bool,
}

impl KvCache {
    /// Zeroed caches for `layers` layers with `part_layer_bytes[p]` bytes of
    /// part `p` per layer (keys and values alike, as the artifact's KV encoding
    /// says); if the system has no memory for them, the bytes all buffers
    /// needed (`u64::MAX` where that overflows).
    pub fn new(layers: usize, part_layer_bytes: &[usize]) -> Result<Self, u64> {
        let sizes: Option<Vec<(usize, usize)>> = part_layer_bytes
            .iter()
            .map(|&b| {
                let layer = b.checked_next_multiple_of(64)?.checked_add(LAYER_SKEW_BYTES)?;
                Some((layer, layers.checked_mul(layer)?.checked_add(VALUE_SKEW_BYTES)?))
            })
            .collect();
        // Per part, `bytes` is per buffer; keys and values together take twice it.
        let Some(sizes) = sizes else { return Err(u64::MAX) };
        let total = sizes.iter().try_fold(0u64, |t, &(_, bytes)| t.checked_add((bytes as u64).checked_mul(2)?)).ok_or(u64::MAX)?;
        let huge_pages = available_memory().is_some_and(|available| total <= available / HUGE_PAGE_SHARE);
        let buffer = |bytes: usize| {
            let mut b = HugeBuf::zeroed_on(bytes, huge_pages).ok_or(total)?;
            if huge_pages {
                // One sequential first write (see the module docs).
                b.as_mut_slice().fill(0);
            }
            Ok::<HugeBuf, u64>(b)
        };
        let parts = sizes.iter().map(|&(layer_bytes, bytes)| Ok(Part { keys: buffer(bytes)?, values: buffer(bytes)?, layer_bytes })).collect::<Result<_, u64>>()?;
        Ok(KvCache { parts, layers, huge_pages })
    }

    /// The cache of an artifact's KV layout for `positions` positions per layer
    /// (a sequence's whole context, or a batch pool's blocks times their
    /// positions), one pair of buffers per part of its encoding.
    pub fn for_layout(kv: &crate::format::KvCacheLayout, positions: u64, max_length: u64) -> Result<Self, crate::executor::RunError> {
        let too_much = |bytes| crate::executor::RunError::KvCacheMemory { bytes, max_length };
        let sizes: Vec<usize> = (0..kv.encoding.parts().len())
            .map(|p| kv.part_layer_bytes(p, positions).and_then(|b| usize::try_from(b).ok()).ok_or(too_much(u64::MAX)))
            .collect::<Result<_, _>>()?;
        KvCache::new(kv.layers as usize, &sizes).map_err(too_much)
    }

    /// Whether the cache asked for huge pages.
    pub fn on_huge_pages(&self) -> bool {
        self.huge_pages
    }

    /// The start of part `part` of layer `layer`'s keys (kernels write through it).
    pub fn keys(&mut self, layer: usize, part: usize) -> *mut u8 {
        let at = self.layer_offset(layer, part);
        self.parts[part].keys.as_mut_slice()[at..].as_mut_ptr()
    }

    /// The start of part `part` of layer `layer`'s values (kernels write through it).
    pub fn values(&mut self, layer: usize, part: usize) -> *mut u8 {
        let at = VALUE_SKEW_BYTES + self.layer_offset(layer, part);
        self.parts[part].values.as_mut_slice()[at..].as_mut_ptr()
    }

    /// Where layer `layer` starts in either buffer of part `part`.
    fn layer_offset(&self, layer: usize, part: usize) -> usize {
        assert!(layer < self.layers, "layer {layer} of a {}-layer KV cache", self.layers);
        assert!(part < self.parts.len(), "part {part} of a {}-part KV cache", self.parts.len());
        layer * self.parts[part].layer_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_are_disjoint_zeroed_and_aligned() {
        let (layers, elems) = (3, 1000);
        let mut cache = KvCache::new(layers, &[elems * 4]).unwrap();
        let mut starts = Vec::new();
        for l in 0..layers {
            for p in [cache.keys(l, 0), cache.values(l, 0)] {
                assert_eq!(p as usize % 64, 0);
                // SAFETY: each layer holds `elems` floats from its start.
                let rows = unsafe { std::slice::from_raw_parts_mut(p as *mut f32, elems) };
                assert!(rows.iter().all(|&x| x == 0.0));
                rows.fill(l as f32 + 1.0);
                starts.push(p as usize);
            }
        }
        // Each layer still holds what was written to it: no two overlap.
        for l in 0..layers {
            for p in [cache.keys(l, 0), cache.values(l, 0)] {
                // SAFETY: as above.
                let rows = unsafe { std::slice::from_raw_parts(p as *const f32, elems) };
                assert!(rows.iter().all(|&x| x == l as f32 + 1.0), "layer {l}");
            }
        }
        starts.sort();
        assert!(starts.windows(2).all(|w| w[1] - w[0] >= elems * 4));
    }

    #[test]
    fn a_small_cache_goes_on_huge_pages_where_memory_is_known() {
        let cache = KvCache::new(2, &[1024 * 4]).unwrap();
        let both_buffers = 2 * (2 * (4096 + LAYER_SKEW_BYTES) + VALUE_SKEW_BYTES) as u64;
        assert_eq!(cache.on_huge_pages(), available_memory().is_some_and(|a| a >= both_buffers * HUGE_PAGE_SHARE));
    }

    /// With a layer as long as a power of two of cache lines (SmolLM2's 1.5 MiB),
    /// no two layers' keys or values start at the same offset within a 64 KiB
    /// span (what picks an L2 set): a position's rows of all layers do not
    /// compete for the same sets.
    #[test]
    fn layers_and_values_are_skewed_against_cache_aliasing() {
        let (layers, elems) = (30, 3 * 2048 * 64);
        let mut cache = KvCache::new(layers, &[elems * 4]).unwrap();
        let mut offsets: Vec<usize> = (0..layers).flat_map(|l| [cache.keys(l, 0) as usize % 65536, cache.values(l, 0) as usize % 65536]).collect();
        offsets.sort();
        offsets.dedup();
        assert_eq!(offsets.len(), 2 * layers);
    }

    /// A cache on huge pages is resident as soon as it exists (written through
    /// once at creation), not filled in by the first decode steps' scattered
    /// row stores (module docs); `mincore` reports every page of both buffers.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_cache_on_huge_pages_is_resident_from_creation() {
        let cache = KvCache::new(8, &[4 << 20]).unwrap();
        if !cache.on_huge_pages() {
            return; // Too little memory here for the huge-page placement (32 MiB).
        }
        let page = 4096usize;
        for buf in [&cache.parts[0].keys, &cache.parts[0].values] {
            let bytes = buf.as_slice();
            let mut resident = vec![0u8; bytes.len().div_ceil(page)];
            // SAFETY: the range is the buffer's own mapping (page-aligned start), and
            // `resident` has one byte per page of it.
            let rc = unsafe { libc::mincore(bytes.as_ptr() as *mut libc::c_void, bytes.len(), resident.as_mut_ptr()) };
            assert_eq!(rc, 0, "mincore failed");
            let missing = resident.iter().filter(|&&r| r & 1 == 0).count();
            assert_eq!(missing, 0, "{missing} of {} pages of a huge-page KV cache are not resident after creation", resident.len());
        }
    }

    /// Each part of a two-part encoding (levels and scales, say) has buffers
    /// of its own size, disjoint from the other part's.
    #[test]
    fn every_part_has_its_own_buffers() {
        let (layers, sizes) = (2, [4096usize, 256]);
        let mut cache = KvCache::new(layers, &sizes).unwrap();
        for l in 0..layers {
            for (part, &bytes) in sizes.iter().enumerate() {
                for p in [cache.keys(l, part), cache.values(l, part)] {
                    // SAFETY: each layer holds `bytes` bytes of the part from its start.
                    unsafe { std::slice::from_raw_parts_mut(p, bytes) }.fill(1 + (l * 2 + part) as u8);
                }
            }
        }
        for l in 0..layers {
            for (part, &bytes) in sizes.iter().enumerate() {
                for p in [cache.keys(l, part), cache.values(l, part)] {
                    // SAFETY: as above.
                    let got = unsafe { std::slice::from_raw_parts(p, bytes) };
                    assert!(got.iter().all(|&b| b == 1 + (l * 2 + part) as u8), "layer {l} part {part}");
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "layer 2 of a 2-layer KV cache")]
    fn a_layer_past_the_last_is_refused() {
        KvCache::new(2, &[64]).unwrap().keys(2, 0);
    }
}
