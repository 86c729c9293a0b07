//! The paged KV cache's bookkeeping: a pool of fixed-size blocks of positions,
//! reference counts, and the prefix cache.
//!
//! A sequence holds a table of blocks, one per `block_size` positions; the
//! kernels find position `p` of a sequence in block `table[p / block_size]` at
//! offset `p % block_size` (docs/serving.md). Blocks come from one pool sized
//! when the engine starts, so memory is never reserved per sequence at the
//! maximum length.
//!
//! **Prefix caching.** Every full block a sequence computes is keyed by a hash of
//! its token ids chained with the hash of the block before it, so the key names
//! the block's whole prefix, not just its own tokens (vLLM's scheme). A new
//! sequence whose prompt starts with the same tokens takes those blocks instead
//! of computing them (the reference count says how many sequences share one).
//! A block whose count drops to zero keeps its contents and its key: it is
//! evictable, and is reused least recently used first when no plain free block
//! is left.

use std::collections::{BTreeSet, HashMap};

/// A block's index in the pool.
pub type BlockId = u32;

/// The hash of a full block of token ids and everything before it.
pub type BlockHash = u64;

/// The key of the block holding `tokens` (a whole block) after the block keyed
/// `prev` (`None` for a sequence's first block).
pub fn chain_hash(prev: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
    let mut bytes = Vec::with_capacity(9 + 4 * tokens.len());
    match prev {
        Some(h) => {
            bytes.push(1);
            bytes.extend_from_slice(&h.to_le_bytes());
        }
        None => bytes.push(0),
    }
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_64(&bytes)
}

/// Counters of the prefix cache, for stats and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Full prompt blocks looked up.
    pub queried_blocks: u64,
    /// Of those, found cached (their positions were not computed again).
    pub hit_blocks: u64,
    /// Cached blocks reused for something else.
    pub evictions: u64,
}

/// The pool of KV blocks.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    /// Sequences holding each block.
    refs: Vec<u32>,
    /// Blocks that hold nothing worth keeping, taken first.
    free: Vec<BlockId>,
    /// Unreferenced blocks that keep a cached prefix, by last use (oldest first).
    evictable: BTreeSet<(u64, BlockId)>,
    /// Each block's key, once it holds a full, computed block.
    key: Vec<Option<BlockHash>>,
    last_use: Vec<u64>,
    cached: HashMap<BlockHash, BlockId>,
    clock: u64,
    pub stats: PrefixStats,
}

impl BlockPool {
    pub fn new(blocks: usize, block_size: usize) -> BlockPool {
        assert!(block_size > 0, "blocks hold at least one position");
        BlockPool {
            block_size,
            refs: vec![0; blocks],
            // Popped from the end: block 0 first.
            free: (0..blocks as BlockId).rev().collect(),
            evictable: BTreeSet::new(),
            key: vec![None; blocks],
            last_use: vec![0; blocks],
            cached: HashMap::new(),
            clock: 0,
            stats: PrefixStats::default(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn capacity(&self) -> usize {
        self.refs.len()
    }

    /// Blocks a sequence could take now: the free ones and the evictable ones.
    pub fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks held by sequences.
    pub fn used(&self) -> usize {
        self.capacity() - self.available()
    }

    /// Unreferenced blocks that still hold a cached prefix.
    pub fn cached_unused(&self) -> usize {
        self.evictable.len()
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Takes a block for a sequence: a free one, else the least recently used
    /// evictable one (its cached prefix is forgotten). `None` when every block
    /// is held.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let &(at, b) = self.evictable.iter().next()?;
                self.evictable.remove(&(at, b));
                if let Some(k) = self.key[b as usize].take() {
                    self.cached.remove(&k);
                }
                self.stats.evictions += 1;
                b
            }
        };
        debug_assert_eq!(self.refs[b as usize], 0);
        self.refs[b as usize] = 1;
        Some(b)
    }

    /// A sequence lets go of `block`: unreferenced, it becomes free, or
    /// evictable if it holds a cached prefix.
    pub fn release(&mut self, block: BlockId) {
        let i = block as usize;
        assert!(self.refs[i] > 0, "block {block} released more often than taken");
        self.refs[i] -= 1;
        if self.refs[i] == 0 {
            if self.key[i].is_some() {
                let at = self.tick();
                self.last_use[i] = at;
                self.evictable.insert((at, block));
            } else {
                self.free.push(block);
            }
        }
    }

    /// Records that `block` now holds the full block keyed `key`, so later
    /// prompts with the same prefix can take it. A key already held by another
    /// block stays with that one.
    pub fn register(&mut self, block: BlockId, key: BlockHash) {
        let i = block as usize;
        if self.key[i].is_some() || self.cached.contains_key(&key) {
            return;
        }
        self.key[i] = Some(key);
        self.cached.insert(key, block);
    }

    /// The cached blocks that hold the longest run of `prompt`'s full blocks from
    /// its start, at most `max_blocks` of them, each taken for the caller (its
    /// reference counted). Returns the blocks and their keys.
    pub fn take_prefix(&mut self, prompt: &[u32], max_blocks: usize) -> (Vec<BlockId>, Vec<BlockHash>) {
        let (mut blocks, mut keys) = (Vec::new(), Vec::new());
        let mut prev = None;
        let full = (prompt.len() / self.block_size).min(max_blocks);
        self.stats.queried_blocks += full as u64;
        for chunk in prompt.chunks_exact(self.block_size).take(full) {
            let key = chain_hash(prev, chunk);
            let Some(&b) = self.cached.get(&key) else { break };
            let i = b as usize;
            if self.refs[i] == 0 {
                self.evictable.remove(&(self.last_use[i], b));
            }
            self.refs[i] += 1;
            blocks.push(b);
            keys.push(key);
            prev = Some(key);
        }
        self.stats.hit_blocks += blocks.len() as u64;
        (blocks, keys)
    }

    /// How many sequences hold `block`.
    pub fn refs(&self, block: BlockId) -> u32 {
        self.refs[block as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_taken_and_given_back() {
        let mut p = BlockPool::new(3, 4);
        let a: Vec<BlockId> = (0..3).map(|_| p.allocate().unwrap()).collect();
        assert_eq!(a, vec![0, 1, 2]);
        assert_eq!(p.allocate(), None, "every block is held");
        assert_eq!(p.available(), 0);
        p.release(1);
        assert_eq!(p.available(), 1);
        assert_eq!(p.allocate(), Some(1));
    }

    #[test]
    #[should_panic(expected = "released more often")]
    fn a_double_release_is_a_bug() {
        let mut p = BlockPool::new(1, 4);
        let b = p.allocate().unwrap();
        p.release(b);
        p.release(b);
    }

    #[test]
    fn a_prefix_is_found_block_by_block_and_shared() {
        let mut p = BlockPool::new(8, 2);
        let prompt = [5, 6, 7, 8, 9];
        // A first sequence computes two full blocks and registers them.
        let (b0, b1) = (p.allocate().unwrap(), p.allocate().unwrap());
        let k0 = chain_hash(None, &prompt[0..2]);
        let k1 = chain_hash(Some(k0), &prompt[2..4]);
        p.register(b0, k0);
        p.register(b1, k1);
        // A second prompt with the same first block but a different second one.
        let (found, keys) = p.take_prefix(&[5, 6, 7, 0, 1], 10);
        assert_eq!((found, keys), (vec![b0], vec![k0]));
        assert_eq!(p.refs(b0), 2);
        // The same prompt finds both, limited by max_blocks.
        assert_eq!(p.take_prefix(&prompt, 1).0, vec![b0]);
        assert_eq!(p.take_prefix(&prompt, 10).0, vec![b0, b1]);
        assert_eq!(p.stats.hit_blocks, 4);
        // The same block's tokens at another place in a prompt are another key.
        assert_eq!(p.take_prefix(&[7, 8, 7, 8], 10).0, Vec::<BlockId>::new());
    }

    #[test]
    fn cached_blocks_outlive_their_sequences_and_are_evicted_oldest_first() {
        let mut p = BlockPool::new(3, 1);
        let blocks: Vec<BlockId> = (0..3).map(|_| p.allocate().unwrap()).collect();
        let mut prev = None;
        let mut keys = Vec::new();
        for (t, &b) in [10u32, 11, 12].iter().zip(&blocks) {
            let k = chain_hash(prev, &[*t]);
            p.register(b, k);
            keys.push(k);
            prev = Some(k);
        }
        // Released in the order 2, 0, 1: all evictable, none free.
        for b in [2, 0, 1] {
            p.release(blocks[b]);
        }
        assert_eq!((p.available(), p.cached_unused()), (3, 3));
        // A prompt finds the first two (taking them out of the evictable set).
        assert_eq!(p.take_prefix(&[10, 11, 99], 10).0, vec![blocks[0], blocks[1]]);
        assert_eq!(p.available(), 1);
        // The one left (block 2, released first) is taken and its key forgotten.
        assert_eq!(p.allocate(), Some(blocks[2]));
        assert_eq!(p.stats.evictions, 1);
        p.release(blocks[2]);
        assert_eq!(p.take_prefix(&[10, 11, 12], 10).0.len(), 2, "block 2's prefix is gone");
    }
}
