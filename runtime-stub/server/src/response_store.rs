//! The Responses API's store: responses kept in memory (`store: true`, the
//! default) so that a later request may continue one (`previous_response_id`)
//! or read or delete it (`GET` / `DELETE /v1/responses/{id}`). It is a cache
//! bounded by count and by bytes, least recently used out first, and lives as
//! long as the process: a replica's stored responses are state a router may
//! route to, never state a request needs to be served (the client can always
//! send the whole conversation as `input`).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// How much the store keeps (`maxrun serve --response-store-entries`,
/// `--response-store-memory`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreLimits {
    /// Responses kept at most; 0 keeps none.
    pub entries: usize,
    /// Bytes of kept responses at most (as [`ResponseStore::insert`] is told their sizes).
    pub bytes: usize,
}

impl Default for StoreLimits {
    /// 1024 responses, 64 MiB: an agent loop's turns for many clients, and a
    /// small part of a server whose KV pool takes gigabytes.
    fn default() -> StoreLimits {
        StoreLimits { entries: 1024, bytes: 64 << 20 }
    }
}

struct Entry<T> {
    value: Arc<T>,
    bytes: usize,
    /// When it was last stored or read: its key in `ResponseStore::order`.
    stamp: u64,
}

/// Values by id, least recently used out first once either limit is passed.
pub struct ResponseStore<T> {
    limits: StoreLimits,
    entries: HashMap<String, Entry<T>>,
    /// Ids by the stamp of their last use, oldest first.
    order: BTreeMap<u64, String>,
    next_stamp: u64,
    bytes: usize,
}

impl<T> ResponseStore<T> {
    pub fn new(limits: StoreLimits) -> ResponseStore<T> {
        ResponseStore { limits, entries: HashMap::new(), order: BTreeMap::new(), next_stamp: 0, bytes: 0 }
    }

    pub fn limits(&self) -> StoreLimits {
        self.limits
    }

    fn stamp(&mut self) -> u64 {
        self.next_stamp += 1;
        self.next_stamp
    }

    /// Keeps `value` (of about `bytes` bytes) under `id`, replacing what was
    /// there, and evicts the least recently used until both limits hold.
    /// Returns false, keeping nothing, when one value alone is over the byte
    /// limit or the store keeps no entries.
    pub fn insert(&mut self, id: String, value: T, bytes: usize) -> bool {
        self.remove(&id);
        if self.limits.entries == 0 || bytes > self.limits.bytes {
            return false;
        }
        while self.entries.len() + 1 > self.limits.entries || self.bytes + bytes > self.limits.bytes {
            let Some((_, oldest)) = self.order.pop_first() else { break };
            if let Some(e) = self.entries.remove(&oldest) {
                self.bytes -= e.bytes;
            }
        }
        let stamp = self.stamp();
        self.order.insert(stamp, id.clone());
        self.entries.insert(id, Entry { value: Arc::new(value), bytes, stamp });
        self.bytes += bytes;
        true
    }

    /// The value under `id`, now the most recently used.
    pub fn get(&mut self, id: &str) -> Option<Arc<T>> {
        let stamp = self.stamp();
        let e = self.entries.get_mut(id)?;
        self.order.remove(&e.stamp);
        e.stamp = stamp;
        self.order.insert(stamp, id.to_string());
        Some(e.value.clone())
    }

    /// Forgets `id`; returns whether it was kept.
    pub fn remove(&mut self, id: &str) -> bool {
        match self.entries.remove(id) {
            Some(e) => {
                self.order.remove(&e.stamp);
                self.bytes -= e.bytes;
                true
            }
            None => false,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(s: &mut ResponseStore<u32>, all: &[&str]) -> Vec<String> {
        all.iter().filter(|id| s.get(id).is_some()).map(|id| id.to_string()).collect()
    }

    #[test]
    fn the_least_recently_used_go_first_by_count() {
        let mut s = ResponseStore::new(StoreLimits { entries: 3, bytes: 1000 });
        for (i, id) in ["a", "b", "c"].iter().enumerate() {
            assert!(s.insert(id.to_string(), i as u32, 10));
        }
        // Reading `a` makes `b` the oldest, so `d` pushes `b` out.
        assert_eq!(s.get("a").as_deref(), Some(&0));
        assert!(s.insert("d".into(), 3, 10));
        assert_eq!((s.len(), s.bytes()), (3, 30));
        assert!(s.get("b").is_none());
        assert_eq!(ids(&mut s, &["a", "c", "d"]), ["a", "c", "d"]);
    }

    #[test]
    fn bytes_bound_the_store_and_a_value_too_big_is_not_kept() {
        let mut s = ResponseStore::new(StoreLimits { entries: 100, bytes: 100 });
        assert!(s.insert("a".into(), 1, 40));
        assert!(s.insert("b".into(), 2, 40));
        assert!(s.insert("c".into(), 3, 40), "a goes to make room");
        assert_eq!((s.len(), s.bytes()), (2, 80));
        assert!(s.get("a").is_none());
        assert!(!s.insert("huge".into(), 4, 101), "one value over the whole limit");
        assert_eq!((s.len(), s.bytes()), (2, 80), "and nothing was evicted for it");
        assert!(s.insert("full".into(), 5, 100), "exactly the limit evicts the rest");
        assert_eq!((s.len(), s.bytes()), (1, 100));
    }

    #[test]
    fn replacing_removing_and_a_store_that_keeps_nothing() {
        let mut s = ResponseStore::new(StoreLimits { entries: 2, bytes: 100 });
        assert!(s.insert("a".into(), 1, 30));
        assert!(s.insert("a".into(), 2, 50));
        assert_eq!((s.len(), s.bytes(), s.get("a").as_deref().copied()), (1, 50, Some(2)));
        assert!(s.remove("a") && !s.remove("a"));
        assert_eq!((s.len(), s.bytes()), (0, 0));
        let mut none = ResponseStore::new(StoreLimits { entries: 0, bytes: 100 });
        assert!(!none.insert("a".into(), 1, 1) && none.get("a").is_none());
    }
}
