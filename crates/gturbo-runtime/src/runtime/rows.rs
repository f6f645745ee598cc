//! The PLE row cache: n-gram embedding rows read from the install's row pool by
//! `pread`, one row at a time, into a bounded LRU of rows.
//!
//! The real model's n-gram tables are 102 GB (128 pools of 0.8 GB); a token needs 16
//! rows of 320 bytes from each, so nothing is mapped: a miss is one positional read
//! of `row_bytes` at the row's place in its shard region, and at most `capacity`
//! rows are kept (the least recently used is evicted). The cache holds stored bytes
//! (BF16 or quantized rows) and widens a row to f32 when it is handed out.
//!
//! Row `r` of the table is the concatenation of the pool's shards in order (the
//! installer orders them by shard number): it lies in the shard whose cumulative row
//! range holds it, at block `i / rows_per_block`, slot `i % rows_per_block` of that
//! shard's region (rows never straddle a 16 KiB block).

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::format::dtype::Dtype;
use crate::format::pools::RowPool;
use crate::format::quant::GROUP;
use crate::format::{RowBlocks, Scheme};
use crate::runtime::RunError;
use crate::runtime::experts::CacheStats;
use crate::runtime::kernels::{FloatDtype, Matrix};
use crate::runtime::paths::safe_join;

/// No entry (end of the recency list).
const NIL: usize = usize::MAX;

/// A fixed-capacity LRU map from row id to a slot of `row_bytes` bytes in one arena.
#[derive(Debug)]
struct Lru {
    row_bytes: usize,
    capacity: usize,
    arena: Vec<u8>,
    /// Row id held by each slot.
    keys: Vec<u64>,
    /// Recency list over slots: `prev` towards the most recent end.
    prev: Vec<usize>,
    next: Vec<usize>,
    /// Most and least recently used slots.
    head: usize,
    tail: usize,
    map: HashMap<u64, usize>,
}

impl Lru {
    fn new(row_bytes: usize, capacity: usize) -> Lru {
        Lru {
            row_bytes,
            capacity,
            arena: Vec::new(),
            keys: Vec::new(),
            prev: Vec::new(),
            next: Vec::new(),
            head: NIL,
            tail: NIL,
            map: HashMap::new(),
        }
    }

    fn unlink(&mut self, s: usize) {
        let (p, n) = (self.prev[s], self.next[s]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n] = p;
        }
    }

    fn push_front(&mut self, s: usize) {
        self.prev[s] = NIL;
        self.next[s] = self.head;
        if self.head != NIL {
            self.prev[self.head] = s;
        }
        self.head = s;
        if self.tail == NIL {
            self.tail = s;
        }
    }

    fn slot_bytes(&self, s: usize) -> &[u8] {
        &self.arena[s * self.row_bytes..(s + 1) * self.row_bytes]
    }

    /// The slot holding `key`, marked most recent.
    fn get(&mut self, key: u64) -> Option<usize> {
        let s = *self.map.get(&key)?;
        self.unlink(s);
        self.push_front(s);
        Some(s)
    }

    /// A slot for `key` (a new one while under capacity, else the least recently
    /// used, evicted), marked most recent; the caller fills its bytes.
    fn insert(&mut self, key: u64) -> usize {
        let s = if self.keys.len() < self.capacity {
            let s = self.keys.len();
            self.keys.push(key);
            self.prev.push(NIL);
            self.next.push(NIL);
            self.arena.resize((s + 1) * self.row_bytes, 0);
            s
        } else {
            let s = self.tail;
            self.unlink(s);
            self.map.remove(&self.keys[s]);
            self.keys[s] = key;
            s
        };
        self.map.insert(key, s);
        self.push_front(s);
        s
    }
}

/// One row pool with its bounded row cache.
pub struct RowCache {
    pool: RowPool,
    file: File,
    geometry: RowBlocks,
    /// First global row of each shard, plus the total at the end.
    shard_starts: Vec<u64>,
    lru: Mutex<Lru>,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl std::fmt::Debug for RowCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowCache")
            .field("file", &self.pool.file)
            .field("rows", &self.rows())
            .finish()
    }
}

impl RowCache {
    /// Open `pool` (already checked by the layout checks) with room for `capacity`
    /// rows (at least 1).
    pub fn open(dir: &Path, pool: &RowPool, capacity: usize) -> Result<RowCache, RunError> {
        let bad = |msg: String| RunError::invalid(&pool.file, msg);
        let errs = pool.layout_errors();
        if let Some(e) = errs.first() {
            return Err(bad(format!("{}: {}", e.field, e.detail)));
        }
        match (pool.scheme, pool.dtype) {
            (Scheme::Passthrough, Dtype::BF16 | Dtype::F16 | Dtype::F32) => {}
            (s, _) if s.affine().is_some_and(|a| a.group() as usize == GROUP) => {}
            (s, d) => {
                return Err(bad(format!(
                    "rows stored as {} {d:?} cannot be computed with",
                    s.label()
                )));
            }
        }
        let geometry = RowBlocks::new(0, pool.row_bytes)
            .ok_or_else(|| bad(format!("row_bytes {} has no block layout", pool.row_bytes)))?;
        let mut shard_starts = vec![0u64];
        for s in &pool.shards {
            let end = shard_starts[shard_starts.len() - 1]
                .checked_add(s.rows)
                .ok_or_else(|| bad("row counts overflow".into()))?;
            shard_starts.push(end);
        }
        let path = safe_join(dir, &pool.file)?;
        let file = File::open(&path).map_err(|e| RunError::io(&pool.file, e))?;
        let len = file
            .metadata()
            .map_err(|e| RunError::io(&pool.file, e))?
            .len();
        if len != pool.file_bytes {
            return Err(bad(format!(
                "{len} bytes, the manifest says {}",
                pool.file_bytes
            )));
        }
        let row_bytes = usize::try_from(pool.row_bytes).map_err(|_| bad("row_bytes".into()))?;
        Ok(RowCache {
            pool: pool.clone(),
            file,
            geometry,
            shard_starts,
            lru: Mutex::new(Lru::new(row_bytes, capacity.max(1))),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        })
    }

    /// Rows in the table (all shards).
    pub fn rows(&self) -> u64 {
        self.shard_starts[self.shard_starts.len() - 1]
    }

    /// Elements per row.
    pub fn width(&self) -> usize {
        self.pool.width as usize
    }

    /// The pool's geometry as the manifest records it.
    pub fn pool(&self) -> &RowPool {
        &self.pool
    }

    /// Hits and misses so far.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
        }
    }

    /// Most bytes of rows the cache holds.
    pub fn capacity_bytes(&self) -> u64 {
        let lru = self.lru.lock().unwrap_or_else(|e| e.into_inner());
        (lru.capacity * lru.row_bytes) as u64
    }

    /// File offset of global row `row`.
    fn offset(&self, row: u64) -> Result<u64, RunError> {
        if row >= self.rows() {
            return Err(RunError::invalid(
                &self.pool.file,
                format!("row {row} is past the table's {} rows", self.rows()),
            ));
        }
        // The last shard whose first row is ≤ row.
        let s = self.shard_starts.partition_point(|&start| start <= row) - 1;
        let local = row - self.shard_starts[s];
        Ok(self.pool.shards[s].offset + self.geometry.row_offset(local))
    }

    /// Row `row` widened to f32 into `out` (`width` elements).
    pub fn fetch(&self, row: u64, out: &mut [f32]) -> Result<(), RunError> {
        assert_eq!(out.len(), self.width(), "RowCache::fetch: out length");
        let mut lru = self.lru.lock().unwrap_or_else(|e| e.into_inner());
        let slot = match lru.get(row) {
            Some(s) => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                s
            }
            None => {
                self.misses.fetch_add(1, Ordering::Relaxed);
                let off = self.offset(row)?;
                let mut buf = vec![0u8; lru.row_bytes];
                self.file
                    .read_exact_at(&mut buf, off)
                    .map_err(|e| RunError::io(&self.pool.file, e))?;
                let s = lru.insert(row);
                let rb = lru.row_bytes;
                lru.arena[s * rb..(s + 1) * rb].copy_from_slice(&buf);
                s
            }
        };
        let bytes = lru.slot_bytes(slot);
        let m = self.row_matrix(bytes);
        m.widen_row(0, out);
        Ok(())
    }

    /// One stored row as a one-row matrix of its scheme.
    fn row_matrix<'b>(&self, bytes: &'b [u8]) -> Matrix<'b> {
        let cols = self.width();
        match self.pool.scheme.bits() {
            Some(bits) => {
                // `open` checked the scheme and `layout_errors` the row's bytes.
                let sz = self
                    .pool
                    .scheme
                    .row_sizes(cols as u64, self.pool.dtype.size())
                    .unwrap_or(crate::format::QuantSizes {
                        weights: 0,
                        scales: 0,
                        biases: 0,
                    });
                let (w, s) = (sz.weights as usize, sz.scales as usize);
                Matrix::Quant {
                    bits,
                    group: self.pool.scheme.group().unwrap_or(64) as usize,
                    weights: &bytes[..w],
                    scales: &bytes[w..w + s],
                    biases: &bytes[w + s..w + 2 * s],
                    rows: 1,
                    cols,
                }
            }
            None => match self.pool.dtype {
                Dtype::F16 => Matrix::Float {
                    dtype: FloatDtype::F16,
                    data: bytes,
                    rows: 1,
                    cols,
                },
                Dtype::F32 => Matrix::Float {
                    dtype: FloatDtype::F32,
                    data: bytes,
                    rows: 1,
                    cols,
                },
                _ => Matrix::Float {
                    dtype: FloatDtype::Bf16,
                    data: bytes,
                    rows: 1,
                    cols,
                },
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_evicts_the_least_recently_used_row() {
        let mut l = Lru::new(2, 3);
        for k in [10, 11, 12] {
            let s = l.insert(k);
            l.arena[s * 2] = k as u8;
        }
        assert!(l.get(10).is_some()); // 11 is now the oldest
        let s = l.insert(13);
        assert!(l.get(11).is_none());
        assert_eq!(l.map.len(), 3);
        assert_eq!(l.keys[s], 13);
        for k in [10, 12, 13] {
            assert!(l.get(k).is_some(), "{k}");
        }
        // Capacity 1: every new key evicts the previous one.
        let mut one = Lru::new(4, 1);
        one.insert(1);
        one.insert(2);
        assert!(one.get(1).is_none() && one.get(2).is_some());
    }
}
