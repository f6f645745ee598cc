//! Routed experts: one aligned `pread` per expert blob into a bounded LRU slot cache
//! (`experts::slots`), or (resident mode) every pool memory-mapped.
//!
//! A pool file holds expert `e` of one layer at `e × stride` (a PAGE multiple), so an
//! expert costs exactly one read of `blob_bytes` at a page-aligned offset. The cache
//! keeps at most `slots` blobs; a miss reuses the buffer of the least recently used
//! slot no computation holds.
//!
//! This module knows the manifest's pool entries and open files, not the install's
//! directory: [`ExpertStore::open`] is handed a function that opens a file of the
//! install by its manifest name (the loader's, which checks the name stays inside).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::Mmap;

use super::error::RunError;
use crate::format::Scheme;
use crate::format::dtype::Dtype;
use crate::format::manifest::{self, Manifest};
use crate::format::pools::ExpertPool;

mod slots;

pub use slots::Pinned;
use slots::SlotCache;

/// Where expert blobs live while running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertMode {
    /// An LRU cache of this many blobs (at least 1), filled by `pread`.
    Slots(usize),
    /// Every pool memory-mapped (the OS page cache holds what was touched).
    Resident,
}

struct Pool {
    pool: ExpertPool,
    file: File,
    map: Option<Mmap>,
}

/// The experts of every MoE layer of the main model.
pub struct ExpertStore {
    /// Pools by layer (`None` for dense layers).
    pools: Vec<Option<Pool>>,
    mode: ExpertMode,
    /// The slot cache (slot mode only).
    cache: Option<SlotCache>,
    /// Lookups served from a mapped pool (resident mode).
    mapped_hits: AtomicU64,
}

/// One expert blob, borrowed from a map or pinned in a cache slot.
pub enum ExpertBlob<'a> {
    /// A slice of a mapped pool.
    Mapped(&'a [u8]),
    /// A cache slot, which stays unevicted while this lives.
    Cached(Pinned<'a>),
}

impl ExpertBlob<'_> {
    /// The blob bytes.
    pub fn bytes(&self) -> &[u8] {
        match self {
            ExpertBlob::Mapped(b) => b,
            ExpertBlob::Cached(p) => p.bytes(),
        }
    }

    /// The cache slot holding the blob (`None` for a mapped pool): a device backend
    /// mirrors the slots and uploads a blob when its slot's content changed.
    pub fn slot(&self) -> Option<usize> {
        match self {
            ExpertBlob::Mapped(_) => None,
            ExpertBlob::Cached(p) => Some(p.slot()),
        }
    }
}

/// Cache counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups served without a read.
    pub hits: u64,
    /// Lookups that read a blob.
    pub misses: u64,
}

impl CacheStats {
    /// Hits over lookups, `None` when nothing was looked up.
    pub fn hit_rate(&self) -> Option<f64> {
        let n = self.hits + self.misses;
        (n > 0).then(|| self.hits as f64 / n as f64)
    }

    /// `98.0% hits (490 hits, 10 misses)`, or `unused`: the run footer's words.
    pub fn text(&self) -> String {
        match self.hit_rate() {
            Some(r) => format!(
                "{:.1}% hits ({} hits, {} misses)",
                100.0 * r,
                self.hits,
                self.misses
            ),
            None => "unused".into(),
        }
    }
}

impl ExpertStore {
    /// Open the main model's pools (sidecar pools are not run); `open_file` opens a
    /// file of the install by its manifest name.
    pub fn open(
        m: &Manifest,
        mode: ExpertMode,
        mut open_file: impl FnMut(&str) -> Result<File, RunError>,
    ) -> Result<ExpertStore, RunError> {
        let mut pools: Vec<Option<Pool>> = Vec::new();
        for p in m.expert_pools.iter().filter(|p| p.sidecar.is_none()) {
            let layer = usize::try_from(p.layer)
                .ok()
                .filter(|&l| l < 1 << 20)
                .ok_or_else(|| {
                    RunError::invalid(&p.file, format!("layer {} out of range", p.layer))
                })?;
            if p.scheme == Scheme::Passthrough
                && !matches!(p.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32)
            {
                return Err(RunError::invalid(
                    &p.file,
                    format!("experts stored as {:?} cannot be computed with", p.dtype),
                ));
            }
            let file = open_file(&p.file)?;
            let len = file.metadata().map_err(|e| RunError::io(&p.file, e))?.len();
            if len != p.file_bytes {
                return Err(RunError::invalid(
                    &p.file,
                    format!("{len} bytes, the manifest says {}", p.file_bytes),
                ));
            }
            let map = match mode {
                ExpertMode::Resident => {
                    // SAFETY: as for `resident.bin` (see `load::open`): the map is only
                    // read and lives inside the `Install` holding the install's shared
                    // lock; gturbo never truncates or rewrites a published pool (an
                    // overwrite refuses while the lock is held and replaces by rename),
                    // so only a foreign in-place truncation could fault (SIGBUS).
                    #[allow(unsafe_code)]
                    let map = unsafe { Mmap::map(&file) }.map_err(|e| RunError::io(&p.file, e))?;
                    Some(map)
                }
                ExpertMode::Slots(_) => None,
            };
            if pools.len() <= layer {
                pools.resize_with(layer + 1, || None);
            }
            if pools[layer].is_some() {
                return Err(RunError::invalid(
                    &p.file,
                    format!("a second pool for layer {layer}"),
                ));
            }
            pools[layer] = Some(Pool {
                pool: p.clone(),
                file,
                map,
            });
        }
        let mode = match mode {
            ExpertMode::Slots(n) => ExpertMode::Slots(n.max(1)),
            r => r,
        };
        Ok(ExpertStore {
            pools,
            mode,
            cache: match mode {
                ExpertMode::Slots(n) => Some(SlotCache::new(n)),
                ExpertMode::Resident => None,
            },
            mapped_hits: AtomicU64::new(0),
        })
    }

    /// The residency mode.
    pub fn mode(&self) -> ExpertMode {
        self.mode
    }

    /// The pool geometry of `layer`, if it is an MoE layer.
    pub fn pool(&self, layer: usize) -> Option<&ExpertPool> {
        self.pools.get(layer)?.as_ref().map(|p| &p.pool)
    }

    /// The whole mapped pool file of `layer` (resident mode only): expert `e` at
    /// `e × stride`, for a backend that uploads a layer's experts at once.
    pub fn mapped(&self, layer: usize) -> Option<&[u8]> {
        self.pools.get(layer)?.as_ref()?.map.as_deref()
    }

    /// Hit and miss counts so far.
    pub fn stats(&self) -> CacheStats {
        let (hits, misses) = self.cache.as_ref().map_or((0, 0), SlotCache::counts);
        CacheStats {
            hits: hits + self.mapped_hits.load(Ordering::Relaxed),
            misses,
        }
    }

    /// Bytes of the largest blob (one cache slot).
    pub fn slot_bytes(&self) -> u64 {
        self.pools
            .iter()
            .flatten()
            .map(|p| p.pool.blob_bytes)
            .max()
            .unwrap_or(0)
    }

    /// Expert `e` of `layer`. In slot mode the blob stays pinned in its slot while the
    /// returned value lives; a thread should drop it before asking for the next one
    /// (the decoder does), or hold fewer blobs than there are slots.
    pub fn get(&self, layer: usize, e: usize) -> Result<ExpertBlob<'_>, RunError> {
        let p = self
            .pools
            .get(layer)
            .and_then(Option::as_ref)
            .ok_or_else(|| {
                RunError::invalid(
                    manifest::FILE_NAME,
                    format!("no expert pool for layer {layer}"),
                )
            })?;
        if e as u64 >= p.pool.experts {
            return Err(RunError::invalid(
                &p.pool.file,
                format!("expert {e} out of range (pool has {})", p.pool.experts),
            ));
        }
        let off = e as u64 * p.pool.stride;
        let len = p.pool.blob_bytes as usize;
        match (&p.map, &self.cache) {
            (Some(map), _) => {
                self.mapped_hits.fetch_add(1, Ordering::Relaxed);
                Ok(ExpertBlob::Mapped(&map[off as usize..off as usize + len]))
            }
            (None, Some(cache)) => {
                let blob = cache.get((layer, e), len, |buf| {
                    p.file
                        .read_exact_at(buf, off)
                        .map_err(|err| RunError::io(&p.pool.file, err))
                })?;
                Ok(ExpertBlob::Cached(blob))
            }
            (None, None) => Err(RunError::invalid(
                &p.pool.file,
                "pool neither mapped nor cached (opened in resident mode without a map)",
            )),
        }
    }
}
