//! The snapshot cache of `gturbo serve`: whole-state session snapshots keyed by the
//! token prefix they hold, bounded in bytes, least recently used evicted first.
//!
//! Restoring a whole snapshot (rather than trimming a cache back to a prefix) is what
//! makes reuse work for every family: a recurrent state (gated delta net) or a sliding
//! window cannot be trimmed, but a copy taken at the prefix's end can be continued.

/// One kept snapshot.
struct Entry<S> {
    tokens: Vec<u32>,
    state: S,
    bytes: u64,
    /// The cache's clock when it was last stored or restored.
    used: u64,
}

/// Snapshots of type `S` keyed by token prefix, at most `capacity` bytes in all.
pub struct PrefixCache<S> {
    entries: Vec<Entry<S>>,
    bytes: u64,
    capacity: u64,
    clock: u64,
}

impl<S> PrefixCache<S> {
    /// An empty cache holding at most `capacity` bytes (0 keeps nothing).
    pub fn new(capacity: u64) -> PrefixCache<S> {
        PrefixCache {
            entries: Vec::new(),
            bytes: 0,
            capacity,
            clock: 0,
        }
    }

    /// Whether anything can be kept at all.
    pub fn enabled(&self) -> bool {
        self.capacity > 0
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Snapshots held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// The snapshot of the longest prefix of `prompt` held, shorter than `prompt` (at
    /// least one token is left to run, whose logits pick the first new token), with
    /// that prefix's length; it becomes the most recently used.
    pub fn longest(&mut self, prompt: &[u32]) -> Option<(&S, usize)> {
        self.clock += 1;
        let i = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.tokens.len() < prompt.len() && prompt.starts_with(&e.tokens))
            .max_by_key(|(_, e)| e.tokens.len())
            .map(|(i, _)| i)?;
        let e = &mut self.entries[i];
        e.used = self.clock;
        Some((&e.state, e.tokens.len()))
    }

    /// Whether a snapshot of exactly `tokens` is held.
    pub fn contains(&self, tokens: &[u32]) -> bool {
        self.entries.iter().any(|e| e.tokens == tokens)
    }

    /// Keep `state`, the snapshot after `tokens`, costing `bytes`; the least recently
    /// used snapshots go until it fits. A snapshot larger than the whole bound, or of
    /// an empty prefix, or any with a bound of 0, is not kept; one of a prefix already held replaces it.
    pub fn insert(&mut self, tokens: Vec<u32>, state: S, bytes: u64) {
        if !self.enabled() || bytes > self.capacity || tokens.is_empty() {
            return;
        }
        if let Some(i) = self.entries.iter().position(|e| e.tokens == tokens) {
            let old = self.entries.swap_remove(i);
            self.bytes -= old.bytes;
        }
        while self.bytes + bytes > self.capacity {
            let Some(lru) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.used)
                .map(|(i, _)| i)
            else {
                break;
            };
            let old = self.entries.swap_remove(lru);
            self.bytes -= old.bytes;
        }
        self.clock += 1;
        self.bytes += bytes;
        self.entries.push(Entry {
            tokens,
            state,
            bytes,
            used: self.clock,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_held_prefix_shorter_than_the_prompt_is_restored() {
        let mut c = PrefixCache::new(100);
        c.insert(vec![1, 2], "a", 10);
        c.insert(vec![1, 2, 3, 4], "b", 10);
        c.insert(vec![1, 9], "c", 10);
        assert_eq!(c.longest(&[1, 2, 3, 4, 5]), Some((&"b", 4)));
        assert_eq!(c.longest(&[1, 2, 3]), Some((&"a", 2)));
        // The whole prompt held still leaves one token to run.
        assert_eq!(c.longest(&[1, 2, 3, 4]), Some((&"a", 2)));
        assert_eq!(c.longest(&[2, 1, 2]), None);
        assert_eq!(c.longest(&[]), None);
    }

    #[test]
    fn the_least_recently_used_go_first_and_the_bound_holds() {
        let mut c = PrefixCache::new(30);
        c.insert(vec![1], "a", 10);
        c.insert(vec![2], "b", 10);
        c.insert(vec![3], "c", 10);
        // Restoring [1] makes [2] the least recently used.
        assert!(c.longest(&[1, 5]).is_some());
        c.insert(vec![4], "d", 10);
        assert!(!c.contains(&[2]) && c.contains(&[1]) && c.contains(&[4]));
        assert_eq!((c.len(), c.bytes()), (3, 30));
        // One as large as the bound evicts everything else; a larger one is refused.
        c.insert(vec![5], "e", 30);
        assert_eq!((c.len(), c.bytes()), (1, 30));
        c.insert(vec![6], "f", 31);
        assert!(!c.contains(&[6]) && c.contains(&[5]));
        // The same prefix again replaces the old snapshot.
        c.insert(vec![5], "g", 20);
        assert_eq!((c.len(), c.bytes()), (1, 20));
        assert_eq!(c.longest(&[5, 0]), Some((&"g", 1)));
    }

    #[test]
    fn a_zero_bound_keeps_nothing() {
        let mut c = PrefixCache::new(0);
        assert!(!c.enabled());
        c.insert(vec![1], (), 0);
        c.insert(vec![1, 2], (), 1);
        assert_eq!(c.len(), 0);
    }
}
