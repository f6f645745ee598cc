//! The expert slot cache: at most `capacity` blob buffers, the least recently used
//! idle one reused first, O(1) bookkeeping per lookup, and the blob read done with
//! the lock released.
//!
//! # Slot ownership
//! Every buffer belongs to exactly one slot for the cache's whole life, so the number
//! of buffers (the memory bound `--expert-cache-slots` promises) is the number of
//! slots, which never exceeds `capacity`. A slot is in one of three states:
//! - **Loading**: one reader took the slot's buffer out and is filling it without the
//!   lock. Nobody else can evict it; a lookup of its key waits instead of reading the
//!   same blob a second time.
//! - **Ready**: filled; `pins` counts the [`Pinned`] handles alive, each holding one
//!   reference to the buffer. Only a slot with no pins is *idle*, sits on the recency
//!   list and may be evicted, so a blob a computation is using is never overwritten,
//!   and the evicted buffer is reused in place (no second allocation).
//! - **Free**: a read failed; the slot keeps its buffer, holds no key, and is the
//!   first reused.
//!
//! When every slot is loading or pinned a lookup that misses waits for a release.
//! A thread that itself holds a pin gets [`InputError::ExpertSlotsExhausted`]
//! instead: waiters then never hold pins, so every pin belongs to a thread that is
//! not waiting for a slot and will release it, and no wait can last forever.
//!
//! # Recency
//! The idle slots form a doubly linked list through the slot table, ordered by when
//! their last pin was released (head: least recent, the next victim). Lookup, hit,
//! eviction and release are each a hash-map probe plus constant list surgery.

use std::cell::Cell;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::runtime::error::{InputError, RunError};

/// A blob's identity: (layer, expert).
pub(crate) type Key = (usize, usize);

/// No slot (end of the recency list).
const NIL: usize = usize::MAX;

enum State {
    /// A reader owns the buffer and is filling it.
    Loading,
    /// Filled; evictable when `pins` is 0.
    Ready { data: Arc<Vec<u8>>, pins: usize },
    /// No key; the buffer waits for reuse.
    Free { buf: Vec<u8> },
}

struct Slot {
    key: Option<Key>,
    state: State,
    /// Recency-list neighbours (`NIL` at the ends, and while not idle).
    prev: usize,
    next: usize,
}

/// The outcome of one lookup.
pub(crate) enum Lookup {
    /// Cached and now pinned by the caller.
    Hit { slot: usize, data: Arc<Vec<u8>> },
    /// Another reader is filling this key's slot: wait, then look again.
    Loading,
    /// Not cached: the caller owns `slot` (now loading) and its buffer, and must hand
    /// both back through [`Table::filled`] or [`Table::failed`].
    Miss { slot: usize, buf: Vec<u8> },
    /// Every slot is loading or pinned: wait for a release, then look again.
    Full,
}

/// The cache's bookkeeping: no I/O and no locking, so it is tested alone.
pub(crate) struct Table {
    capacity: usize,
    slots: Vec<Slot>,
    index: HashMap<Key, usize>,
    /// Least recently released idle slot.
    head: usize,
    /// Most recently released idle slot.
    tail: usize,
    /// Slots without a key.
    free: Vec<usize>,
}

impl Table {
    /// A table of at most `capacity` slots (at least 1).
    pub(crate) fn new(capacity: usize) -> Table {
        Table {
            capacity: capacity.max(1),
            slots: Vec::new(),
            index: HashMap::new(),
            head: NIL,
            tail: NIL,
            free: Vec::new(),
        }
    }

    /// Buffers that exist: one per slot, never more than the capacity (tests).
    #[cfg(test)]
    pub(crate) fn buffers(&self) -> usize {
        self.slots.len()
    }

    /// Look `key` up; on a hit pin its slot, on a miss reserve a slot for it.
    pub(crate) fn lookup(&mut self, key: Key) -> Lookup {
        if let Some(&i) = self.index.get(&key) {
            match &mut self.slots[i].state {
                State::Loading => return Lookup::Loading,
                State::Ready { data, pins } => {
                    let data = data.clone();
                    *pins += 1;
                    if *pins == 1 {
                        self.unlink(i);
                    }
                    return Lookup::Hit { slot: i, data };
                }
                // A free slot holds no key; the index entry is stale, drop it.
                State::Free { .. } => {
                    self.index.remove(&key);
                }
            }
        }
        let (i, buf) = if let Some(i) = self.free.pop() {
            let buf = match std::mem::replace(&mut self.slots[i].state, State::Loading) {
                State::Free { buf } => buf,
                _ => Vec::new(),
            };
            (i, buf)
        } else if self.slots.len() < self.capacity {
            self.slots.push(Slot {
                key: None,
                state: State::Loading,
                prev: NIL,
                next: NIL,
            });
            (self.slots.len() - 1, Vec::new())
        } else if self.head != NIL {
            let i = self.head;
            self.unlink(i);
            if let Some(old) = self.slots[i].key.take() {
                self.index.remove(&old);
            }
            let buf = match std::mem::replace(&mut self.slots[i].state, State::Loading) {
                // No pins: the table holds the only reference (each `Pinned` drops its
                // reference before releasing its pin), so this never copies.
                State::Ready { data, .. } => Arc::try_unwrap(data).unwrap_or_default(),
                _ => Vec::new(),
            };
            (i, buf)
        } else {
            return Lookup::Full;
        };
        self.slots[i].key = Some(key);
        self.index.insert(key, i);
        Lookup::Miss { slot: i, buf }
    }

    /// The loading `slot`'s buffer is filled: it becomes ready, pinned once by the
    /// reader.
    pub(crate) fn filled(&mut self, slot: usize, buf: Vec<u8>) -> Arc<Vec<u8>> {
        let data = Arc::new(buf);
        self.slots[slot].state = State::Ready {
            data: data.clone(),
            pins: 1,
        };
        data
    }

    /// The loading `slot`'s read failed: it forgets its key and keeps the buffer.
    pub(crate) fn failed(&mut self, slot: usize, buf: Vec<u8>) {
        if let Some(key) = self.slots[slot].key.take() {
            self.index.remove(&key);
        }
        self.slots[slot].state = State::Free { buf };
        self.free.push(slot);
    }

    /// One pin of `slot` is gone (its reference to the buffer already dropped); with
    /// the last one the slot becomes the most recently used idle slot.
    pub(crate) fn release(&mut self, slot: usize) {
        if let State::Ready { pins, .. } = &mut self.slots[slot].state
            && *pins > 0
        {
            *pins -= 1;
            if *pins == 0 {
                self.push_back(slot);
            }
        }
    }

    fn unlink(&mut self, i: usize) {
        let (p, n) = (self.slots[i].prev, self.slots[i].next);
        if p == NIL {
            self.head = n;
        } else {
            self.slots[p].next = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.slots[n].prev = p;
        }
        self.slots[i].prev = NIL;
        self.slots[i].next = NIL;
    }

    fn push_back(&mut self, i: usize) {
        self.slots[i].prev = self.tail;
        self.slots[i].next = NIL;
        if self.tail == NIL {
            self.head = i;
        } else {
            self.slots[self.tail].next = i;
        }
        self.tail = i;
    }

    /// Keys of the idle slots, least recently used first (tests).
    #[cfg(test)]
    fn idle_keys(&self) -> Vec<Key> {
        let mut out = Vec::new();
        let mut i = self.head;
        while i != NIL {
            out.extend(self.slots[i].key);
            i = self.slots[i].next;
        }
        out
    }
}

thread_local! {
    /// Pins the current thread holds, over every cache: a thread holding one never
    /// waits for a slot (see the module doc).
    static HELD: Cell<usize> = const { Cell::new(0) };
}

/// The thread-safe cache: the table under a mutex, a condition variable for the
/// waits, and the hit and miss counts.
pub(crate) struct SlotCache {
    table: Mutex<Table>,
    changed: Condvar,
    hits: AtomicU64,
    misses: AtomicU64,
}

/// A pinned blob: its slot cannot be evicted while this lives. Not `Send`: the
/// pin is counted for the thread that took it.
pub struct Pinned<'c> {
    cache: &'c SlotCache,
    slot: usize,
    data: Option<Arc<Vec<u8>>>,
    _thread: PhantomData<*const ()>,
}

impl Pinned<'_> {
    /// The blob bytes.
    pub fn bytes(&self) -> &[u8] {
        self.data.as_deref().map_or(&[], Vec::as_slice)
    }

    /// The slot's index (below the capacity). A slot holds one key at a time and
    /// changes key only when a miss refills it.
    pub fn slot(&self) -> usize {
        self.slot
    }
}

impl Drop for Pinned<'_> {
    fn drop(&mut self) {
        // The reference goes first, so that a slot without pins is referenced by the
        // table alone and its buffer is reused in place.
        self.data = None;
        HELD.with(|h| h.set(h.get().saturating_sub(1)));
        self.cache.lock().release(self.slot);
        self.cache.changed.notify_all();
    }
}

/// A reserved loading slot; handed back as failed if the reader unwinds.
struct Reservation<'c> {
    cache: &'c SlotCache,
    slot: usize,
    buf: Option<Vec<u8>>,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.cache.lock().failed(self.slot, buf);
            self.cache.changed.notify_all();
        }
    }
}

impl SlotCache {
    /// A cache of at most `capacity` blobs (at least 1).
    pub(crate) fn new(capacity: usize) -> SlotCache {
        SlotCache {
            table: Mutex::new(Table::new(capacity)),
            changed: Condvar::new(),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        // The table is consistent between calls (no method panics halfway), so a
        // poisoned lock is still usable.
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'g>(&self, g: MutexGuard<'g, Table>) -> MutexGuard<'g, Table> {
        self.changed.wait(g).unwrap_or_else(|e| e.into_inner())
    }

    /// (hits, misses) so far.
    pub(crate) fn counts(&self) -> (u64, u64) {
        (
            self.hits.load(Ordering::Relaxed),
            self.misses.load(Ordering::Relaxed),
        )
    }

    /// Buffers that exist now (at most the capacity).
    #[cfg(test)]
    pub(crate) fn buffers(&self) -> usize {
        self.lock().buffers()
    }

    /// The blob of `key`, `len` bytes: from its slot, or read by `read` into a slot's
    /// buffer with the lock released.
    pub(crate) fn get(
        &self,
        key: Key,
        len: usize,
        read: impl FnOnce(&mut [u8]) -> Result<(), RunError>,
    ) -> Result<Pinned<'_>, RunError> {
        let mut t = self.lock();
        loop {
            match t.lookup(key) {
                Lookup::Hit { slot, data } => {
                    self.hits.fetch_add(1, Ordering::Relaxed);
                    return Ok(self.pinned(slot, data));
                }
                Lookup::Loading => t = self.wait(t),
                Lookup::Full if HELD.with(Cell::get) > 0 => {
                    return Err(InputError::ExpertSlotsExhausted { slots: t.capacity }.into());
                }
                Lookup::Full => t = self.wait(t),
                Lookup::Miss { slot, buf } => {
                    self.misses.fetch_add(1, Ordering::Relaxed);
                    drop(t);
                    let mut r = Reservation {
                        cache: self,
                        slot,
                        buf: Some(buf),
                    };
                    if let Some(buf) = r.buf.as_mut() {
                        buf.resize(len, 0);
                        read(buf)?;
                    }
                    let buf = r.buf.take().unwrap_or_default();
                    let data = self.lock().filled(slot, buf);
                    self.changed.notify_all();
                    return Ok(self.pinned(slot, data));
                }
            }
        }
    }

    fn pinned(&self, slot: usize, data: Arc<Vec<u8>>) -> Pinned<'_> {
        HELD.with(|h| h.set(h.get() + 1));
        Pinned {
            cache: self,
            slot,
            data: Some(data),
            _thread: PhantomData,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::testing::Rng;
    use std::sync::atomic::AtomicUsize;

    /// Look `key` up in `t` as one get-and-drop would; whether it was a hit.
    fn touch(t: &mut Table, key: Key) -> bool {
        match t.lookup(key) {
            Lookup::Hit { slot, data } => {
                drop(data);
                t.release(slot);
                true
            }
            Lookup::Miss { slot, buf } => {
                let data = t.filled(slot, buf);
                drop(data);
                t.release(slot);
                false
            }
            Lookup::Loading | Lookup::Full => panic!("nothing is pinned or loading"),
        }
    }

    #[test]
    fn the_least_recently_used_idle_slot_is_evicted_first() {
        let mut t = Table::new(3);
        let seq = [
            (0, 1),
            (0, 2),
            (0, 3),
            (0, 1),
            (0, 4),
            (0, 2),
            (0, 3),
            (0, 1),
        ];
        let hits: Vec<bool> = seq.iter().map(|&k| touch(&mut t, k)).collect();
        // 1 2 3 miss; 1 hit (order 2 3 1); 4 evicts 2 (3 1 4); 2 evicts 3 (1 4 2);
        // 3 evicts 1 (4 2 3); 1 evicts 4 (2 3 1).
        assert_eq!(
            hits,
            [false, false, false, true, false, false, false, false]
        );
        assert_eq!(t.idle_keys(), [(0, 2), (0, 3), (0, 1)]);
        assert!(touch(&mut t, (0, 2)));
        assert_eq!(t.idle_keys(), [(0, 3), (0, 1), (0, 2)]);
        assert_eq!(t.buffers(), 3);
    }

    #[test]
    fn a_pinned_slot_is_never_evicted_and_a_full_table_says_so() {
        let mut t = Table::new(2);
        let Lookup::Miss { slot: a, buf } = t.lookup((0, 0)) else {
            panic!("miss expected")
        };
        let pinned_a = t.filled(a, buf);
        assert!(!touch(&mut t, (0, 1)));
        // (0,0) is pinned and the least recently used: (0,1) is the victim.
        assert!(!touch(&mut t, (0, 2)));
        assert_eq!(t.idle_keys(), [(0, 2)]);
        let Lookup::Miss { slot: b, buf } = t.lookup((0, 3)) else {
            panic!("miss expected")
        };
        assert!(matches!(t.lookup((0, 3)), Lookup::Loading));
        assert!(matches!(t.lookup((0, 4)), Lookup::Full));
        assert_eq!(t.buffers(), 2);
        // The pinned blob is still (0,0)'s: a second pin is a hit on it.
        let Lookup::Hit { slot, data } = t.lookup((0, 0)) else {
            panic!("hit expected")
        };
        assert_eq!(slot, a);
        assert!(Arc::ptr_eq(&data, &pinned_a));
        drop((data, pinned_a));
        t.release(a);
        assert!(t.idle_keys().is_empty(), "one pin of (0,0) remains");
        t.release(a);
        assert_eq!(t.idle_keys(), [(0, 0)]);
        // A failed read frees its slot, which the next miss takes first.
        t.failed(b, buf);
        assert!(matches!(t.lookup((0, 3)), Lookup::Miss { slot, .. } if slot == b));
    }

    #[test]
    fn the_budget_holds_over_a_long_random_sequence_and_hits_match_a_reference_lru() {
        let mut t = Table::new(5);
        let mut reference: Vec<Key> = Vec::new(); // most recent last
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for _ in 0..10_000 {
            let x = rng.next();
            let key = ((x % 3) as usize, (x >> 8) as usize % 9);
            let want_hit = match reference.iter().position(|&k| k == key) {
                Some(p) => {
                    reference.remove(p);
                    true
                }
                None => {
                    if reference.len() == 5 {
                        reference.remove(0);
                    }
                    false
                }
            };
            reference.push(key);
            assert_eq!(touch(&mut t, key), want_hit, "key {key:?}");
            assert!(t.buffers() <= 5);
            assert_eq!(t.idle_keys(), reference);
        }
    }

    #[test]
    fn concurrent_readers_read_each_blob_once_per_miss_and_keep_the_budget() {
        let cache = SlotCache::new(3);
        let reads = AtomicUsize::new(0);
        let blob = |k: Key| vec![(k.0 * 16 + k.1) as u8; 4096];
        std::thread::scope(|s| {
            for th in 0..8usize {
                let (cache, reads) = (&cache, &reads);
                s.spawn(move || {
                    let mut x = th as u64 + 1;
                    for _ in 0..400 {
                        x = x
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        let key = (0, (x >> 33) as usize % 6);
                        let got = cache
                            .get(key, 4096, |buf| {
                                reads.fetch_add(1, Ordering::Relaxed);
                                std::thread::yield_now();
                                buf.copy_from_slice(&blob(key));
                                Ok(())
                            })
                            .unwrap();
                        assert_eq!(got.bytes(), blob(key).as_slice());
                        assert!(cache.buffers() <= 3);
                    }
                });
            }
        });
        let (hits, misses) = cache.counts();
        assert_eq!(hits + misses, 8 * 400);
        assert_eq!(misses as usize, reads.load(Ordering::Relaxed));
    }

    #[test]
    fn a_second_reader_of_a_loading_blob_waits_for_it_instead_of_reading_again() {
        let cache = SlotCache::new(2);
        let reads = AtomicUsize::new(0);
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|s| {
            let (cache, reads) = (&cache, &reads);
            s.spawn(move || {
                let b = cache
                    .get((1, 1), 8, |buf| {
                        reads.fetch_add(1, Ordering::Relaxed);
                        started_tx.send(()).unwrap();
                        go_rx.recv().unwrap();
                        buf.fill(7);
                        Ok(())
                    })
                    .unwrap();
                assert_eq!(b.bytes(), [7; 8]);
            });
            started_rx.recv().unwrap();
            // The first read is under way with the lock released: another key is
            // served meanwhile, and the same key waits for the first read.
            let other = cache.get((1, 2), 8, |buf| {
                buf.fill(9);
                Ok(())
            });
            assert_eq!(other.unwrap().bytes(), [9; 8]);
            s.spawn(move || {
                let b = cache
                    .get((1, 1), 8, |_| panic!("read a second time"))
                    .unwrap();
                assert_eq!(b.bytes(), [7; 8]);
            });
            std::thread::sleep(std::time::Duration::from_millis(50));
            go_tx.send(()).unwrap();
        });
        assert_eq!(reads.load(Ordering::Relaxed), 1);
        assert_eq!(cache.counts(), (1, 2));
    }

    #[test]
    fn a_thread_holding_every_slot_gets_an_error_instead_of_waiting_forever() {
        let cache = SlotCache::new(1);
        let fill = |buf: &mut [u8]| {
            buf.fill(1);
            Ok(())
        };
        let held = cache.get((0, 0), 4, fill).unwrap();
        let err = cache.get((0, 1), 4, fill).map(|_| ()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "input: all 1 expert cache slots are held by this thread while it asks for \
             another expert; give more --expert-cache-slots"
        );
        // The same blob is a hit, not a wait.
        assert_eq!(cache.get((0, 0), 4, fill).unwrap().bytes(), [1; 4]);
        drop(held);
        assert!(cache.get((0, 1), 4, fill).is_ok());
        assert_eq!(cache.buffers(), 1);
    }

    #[test]
    fn a_failed_read_is_reported_and_the_next_reader_tries_again() {
        let cache = SlotCache::new(1);
        let err = cache
            .get((0, 0), 4, |_| {
                Err(RunError::io(
                    "packed_experts/layer_00.bin",
                    std::io::Error::from(std::io::ErrorKind::UnexpectedEof),
                ))
            })
            .map(|_| ())
            .unwrap_err();
        assert!(
            err.to_string().starts_with("packed_experts/layer_00.bin: "),
            "{err}"
        );
        let ok = cache.get((0, 0), 4, |buf| {
            buf.fill(3);
            Ok(())
        });
        assert_eq!(ok.unwrap().bytes(), [3; 4]);
        assert_eq!((cache.counts(), cache.buffers()), ((0, 2), 1));
    }
}
