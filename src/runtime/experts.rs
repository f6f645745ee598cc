//! Routed experts: one aligned `pread` per expert blob into a bounded LRU slot cache,
//! or (resident mode) every pool memory-mapped.
//!
//! A pool file holds expert `e` of one layer at `e × stride` (a PAGE multiple), so an
//! expert costs exactly one read of `blob_bytes` at a page-aligned offset. The cache
//! keeps at most `slots` blobs; a miss evicts the least recently used slot and reuses
//! its buffer when no computation still holds it.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use memmap2::Mmap;

use super::kernels::Matrix;
use super::load::{LoadError, safe_join};
use crate::format::Scheme;
use crate::format::manifest::Manifest;
use crate::format::pools::{BlobPart, ExpertPool};
use crate::header::Dtype;

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

struct Slot {
    key: (usize, usize),
    data: Arc<Vec<u8>>,
    last_used: u64,
}

#[derive(Default)]
struct Lru {
    slots: Vec<Slot>,
    clock: u64,
}

/// The experts of every MoE layer of the main model.
pub struct ExpertStore {
    /// Pools by layer (`None` for dense layers).
    pools: Vec<Option<Pool>>,
    mode: ExpertMode,
    lru: Mutex<Lru>,
    hits: AtomicU64,
    misses: AtomicU64,
}

/// One expert blob, borrowed from a map or shared from a cache slot.
pub enum ExpertBlob<'a> {
    /// A slice of a mapped pool.
    Mapped(&'a [u8]),
    /// A cache slot's buffer.
    Cached(Arc<Vec<u8>>),
}

impl ExpertBlob<'_> {
    /// The blob bytes.
    pub fn bytes(&self) -> &[u8] {
        match self {
            ExpertBlob::Mapped(b) => b,
            ExpertBlob::Cached(v) => v,
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
}

impl ExpertStore {
    /// Open the main model's pools (sidecar pools are not run).
    pub fn open(dir: &Path, m: &Manifest, mode: ExpertMode) -> Result<ExpertStore, LoadError> {
        let mut pools: Vec<Option<Pool>> = Vec::new();
        for p in m.expert_pools.iter().filter(|p| p.sidecar.is_none()) {
            let layer = usize::try_from(p.layer)
                .ok()
                .filter(|&l| l < 1 << 20)
                .ok_or_else(|| {
                    LoadError::invalid(&p.file, format!("layer {} out of range", p.layer))
                })?;
            if p.scheme == Scheme::Passthrough
                && !matches!(p.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32)
            {
                return Err(LoadError::invalid(
                    &p.file,
                    format!("experts stored as {:?} cannot be computed with", p.dtype),
                ));
            }
            let path = safe_join(dir, &p.file)?;
            let file = File::open(&path).map_err(|e| LoadError::io(&p.file, e))?;
            let len = file
                .metadata()
                .map_err(|e| LoadError::io(&p.file, e))?
                .len();
            if len != p.file_bytes {
                return Err(LoadError::invalid(
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
                    let map = unsafe { Mmap::map(&file) }.map_err(|e| LoadError::io(&p.file, e))?;
                    Some(map)
                }
                ExpertMode::Slots(_) => None,
            };
            if pools.len() <= layer {
                pools.resize_with(layer + 1, || None);
            }
            if pools[layer].is_some() {
                return Err(LoadError::invalid(
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
            lru: Mutex::new(Lru::default()),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
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

    /// Hit and miss counts so far.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
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

    /// Expert `e` of `layer`.
    pub fn get(&self, layer: usize, e: usize) -> Result<ExpertBlob<'_>, LoadError> {
        let p = self
            .pools
            .get(layer)
            .and_then(Option::as_ref)
            .ok_or_else(|| {
                LoadError::invalid("manifest.json", format!("no expert pool for layer {layer}"))
            })?;
        if e as u64 >= p.pool.experts {
            return Err(LoadError::invalid(
                &p.pool.file,
                format!("expert {e} out of range (pool has {})", p.pool.experts),
            ));
        }
        let off = e as u64 * p.pool.stride;
        let len = p.pool.blob_bytes as usize;
        if let Some(map) = &p.map {
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(ExpertBlob::Mapped(&map[off as usize..off as usize + len]));
        }
        let ExpertMode::Slots(cap) = self.mode else {
            unreachable!("a pool without a map is only opened in slot mode");
        };
        let mut lru = self.lru.lock().unwrap_or_else(|e| e.into_inner());
        lru.clock += 1;
        let now = lru.clock;
        if let Some(s) = lru.slots.iter_mut().find(|s| s.key == (layer, e)) {
            s.last_used = now;
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(ExpertBlob::Cached(s.data.clone()));
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        // Reuse the least recently used slot's buffer when the cache is full and no
        // computation still holds it; otherwise allocate.
        let mut buf = if lru.slots.len() >= cap {
            let (i, _) = lru
                .slots
                .iter()
                .enumerate()
                .min_by_key(|(_, s)| s.last_used)
                .unwrap_or((0, &lru.slots[0]));
            let old = lru.slots.swap_remove(i);
            Arc::try_unwrap(old.data).unwrap_or_default()
        } else {
            Vec::new()
        };
        buf.resize(len, 0);
        p.file
            .read_exact_at(&mut buf, off)
            .map_err(|err| LoadError::io(&p.pool.file, err))?;
        let data = Arc::new(buf);
        lru.slots.push(Slot {
            key: (layer, e),
            data: data.clone(),
            last_used: now,
        });
        Ok(ExpertBlob::Cached(data))
    }
}

/// The gate, up and down matrices of one blob of `pool`.
pub fn expert_matrices<'a>(pool: &ExpertPool, blob: &'a [u8]) -> [Matrix<'a>; 3] {
    let view = |b: &BlobPart| -> Matrix<'a> {
        let (o, w, s) = (b.offset as usize, b.weights as usize, b.scales as usize);
        let (rows, cols) = (b.rows as usize, b.cols as usize);
        match pool.scheme {
            Scheme::Int4G64 | Scheme::Int8G64 => Matrix::Quant {
                bits: pool.scheme.bits().unwrap_or(4),
                weights: &blob[o..o + w],
                scales: &blob[o + w..o + w + s],
                biases: &blob[o + w + s..o + w + 2 * s],
                rows,
                cols,
            },
            Scheme::Passthrough => {
                let data = &blob[o..o + w];
                match pool.dtype {
                    Dtype::F16 => Matrix::F16 { data, rows, cols },
                    Dtype::F32 => Matrix::F32 { data, rows, cols },
                    _ => Matrix::Bf16 { data, rows, cols },
                }
            }
        }
    };
    [
        view(&pool.parts[0]),
        view(&pool.parts[1]),
        view(&pool.parts[2]),
    ]
}
