//! Opening an install for `gturbo run`: manifest, capability gate, layout checks, the
//! memory-mapped resident file, and the expert store.
//!
//! Order matters: the manifest is read and the gate applied before any other file
//! is opened, so a refused install costs one small read.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::error::RunError;
use super::experts::{ExpertMode, ExpertStore};
use super::gate::{self, Runner};
use super::kernels::{FloatDtype, Matrix};
use super::paths::safe_join;
use super::rows::RowCache;
use crate::format::check::{self as verify, VerifyFailure};
use crate::format::dtype::Dtype;
use crate::format::lock::InstallLock;
use crate::format::manifest::Manifest;
use crate::format::resident::{ResidentEntry, ResidentHead, ResidentIndex, Span, Storage};

/// How to open an install.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    /// Expert residency.
    pub experts: ExpertMode,
    /// Rows each n-gram row cache keeps (at least 1).
    pub row_cache_rows: usize,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            experts: ExpertMode::Slots(16),
            row_cache_rows: DEFAULT_ROW_CACHE_ROWS,
        }
    }
}

/// Rows each n-gram row cache keeps by default: 64 Ki rows, 20 MiB of Flash-Next's
/// 320-byte rows per PLE layer.
pub const DEFAULT_ROW_CACHE_ROWS: usize = 1 << 16;

/// Read `manifest.json` (verify-install's cheap parser: size cap, known keys, safe
/// paths) and apply the capability gate; opens no other file.
pub fn open_gated(dir: &Path) -> Result<(Manifest, &'static Runner), RunError> {
    let manifest =
        verify::open_manifest(dir).map_err(|f| RunError::invalid(f.file.clone(), at_detail(&f)))?;
    let runner = gate::check(&manifest.family, &manifest.arch.required_axes)?;
    Ok((manifest, runner))
}

fn at_detail(f: &VerifyFailure) -> String {
    if f.at.is_empty() {
        f.detail.clone()
    } else {
        format!("{}: {}", f.at, f.detail)
    }
}

/// An opened install: the manifest, its runner, the mapped resident tensors and the
/// expert store.
pub struct Install {
    /// The `.gturbo` directory.
    pub dir: PathBuf,
    /// The manifest.
    pub manifest: Manifest,
    /// The runner the gate chose.
    pub runner: &'static Runner,
    resident: Mmap,
    payload_start: usize,
    tensors: HashMap<String, ResidentEntry>,
    /// Bytes of `resident.bin`.
    pub resident_bytes: u64,
    /// Routed experts.
    pub experts: ExpertStore,
    /// Row caches, one per row pool, with the pool's layer.
    pub rows: Vec<(usize, RowCache)>,
    /// The install's shared lock, held while the install is open (see
    /// [`crate::format::lock`]): no overwrite replaces it under the maps.
    _lock: InstallLock,
}

impl std::fmt::Debug for Install {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Install")
            .field("dir", &self.dir)
            .field("family", &self.manifest.family)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// Open an install: gate, layout, resident map, expert pools.
pub fn open(dir: &Path, opts: LoadOptions) -> Result<Install, RunError> {
    // The lock first, so everything read below is of one install.
    let lock = InstallLock::shared(dir);
    if let Err(e) = &lock
        && e.kind() == std::io::ErrorKind::NotFound
    {
        // No such directory: the manifest check says so in its own words.
        open_gated(dir)?;
    }
    let lock = lock.map_err(|e| RunError::io(dir.display().to_string(), e))?;
    let (manifest, runner) = open_gated(dir)?;
    // verify-install's cheap checks (sizes, resident index, pool geometry, tokenizer
    // JSON; no hashing): after them every span sliced below lies inside its file.
    let failures = verify::check_layout(dir, &manifest);
    if let Some(first) = failures.first() {
        let more = match failures.len() {
            1 => String::new(),
            n => format!(" (and {} more; `gturbo verify-install` lists them)", n - 1),
        };
        return Err(RunError::invalid(
            first.file.clone(),
            format!("{}{more}", at_detail(first)),
        ));
    }
    let rel = &manifest.resident.file;
    let path = safe_join(dir, rel)?;
    let file = File::open(&path).map_err(|e| RunError::io(rel, e))?;
    let len = file.metadata().map_err(|e| RunError::io(rel, e))?.len();
    // SAFETY: the map is only read, and no gturbo process truncates or rewrites a
    // published file (`crate::format::lock`): `install --overwrite` refuses while
    // `lock` (this install's shared lock, held as long as the map) is held, and even
    // then replaces a directory only by rename, the receipt by rename too, so the
    // mapped inode keeps its length and bytes. Only a foreign writer truncating
    // `resident.bin` in place could make a read fault (SIGBUS): the mmap contract.
    #[allow(unsafe_code)]
    let map = unsafe { Mmap::map(&file) }.map_err(|e| RunError::io(rel, e))?;
    let head = ResidentHead::parse(&map, len).map_err(|e| RunError::invalid(rel, e.to_string()))?;
    let (index, payload_start) = (head.index, head.payload_start);
    if payload_start != manifest.resident.payload_start {
        return Err(RunError::invalid(
            rel,
            format!(
                "payload starts at {payload_start}, manifest resident.payload_start says {}",
                manifest.resident.payload_start
            ),
        ));
    }
    check_index(rel, &index, len - payload_start)?;
    let mut tensors = HashMap::new();
    for e in index.tensors {
        tensors.insert(e.name.clone(), e);
    }
    let experts = ExpertStore::open(&manifest, opts.experts, |rel| {
        let path = safe_join(dir, rel)?;
        File::open(&path).map_err(|e| RunError::io(rel, e))
    })?;
    let rows = row_caches(dir, &manifest, opts.row_cache_rows)?;
    Ok(Install {
        dir: dir.to_path_buf(),
        manifest,
        runner,
        resident: map,
        payload_start: payload_start as usize,
        tensors,
        resident_bytes: len,
        experts,
        rows,
        _lock: lock,
    })
}

/// A row cache of `rows` rows for each row pool of `m`, with its layer.
fn row_caches(dir: &Path, m: &Manifest, rows: usize) -> Result<Vec<(usize, RowCache)>, RunError> {
    let mut caches: Vec<(usize, RowCache)> = Vec::new();
    for p in &m.row_pools {
        let layer = usize::try_from(p.layer)
            .ok()
            .filter(|&l| l < 1 << 20)
            .ok_or_else(|| RunError::invalid(&p.file, format!("layer {} out of range", p.layer)))?;
        if caches.iter().any(|(l, _)| *l == layer) {
            return Err(RunError::invalid(
                &p.file,
                format!("a second row pool for layer {layer}"),
            ));
        }
        caches.push((layer, RowCache::open(dir, p, rows)?));
    }
    Ok(caches)
}

impl Install {
    /// The row cache of `layer`'s n-gram table.
    pub fn row_cache(&self, layer: usize) -> Option<&RowCache> {
        self.rows.iter().find(|(l, _)| *l == layer).map(|(_, r)| r)
    }
}

/// The mapped index against the mapped payload: the same layout rule verify-install
/// applies ([`ResidentIndex::layout_errors`]), on the bytes this process will read
/// (the file could have changed since `check_layout` opened it).
fn check_index(rel: &str, index: &ResidentIndex, payload: u64) -> Result<(), RunError> {
    match index.layout_errors(payload).first() {
        None => Ok(()),
        Some(e) => Err(RunError::invalid(rel, format!("index.{e}"))),
    }
}

impl Install {
    fn span(&self, s: Span) -> &[u8] {
        let a = self.payload_start + s.offset as usize;
        &self.resident[a..a + s.len as usize]
    }

    fn entry(&self, name: &str) -> Result<&ResidentEntry, RunError> {
        self.tensors.get(name).ok_or_else(|| {
            RunError::invalid(
                &self.manifest.resident.file,
                format!("tensor {name} is not in the resident index"),
            )
        })
    }

    /// Whether the resident file holds `name`.
    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// A 2-D tensor as a matrix view, checked to be `[rows, cols]`.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix<'_>, RunError> {
        let e = self.entry(name)?;
        let shape: Vec<u64> = vec![rows as u64, cols as u64];
        if e.shape != shape {
            return Err(RunError::invalid(
                &self.manifest.resident.file,
                format!(
                    "tensor {name} has shape {:?}, the config implies {shape:?}",
                    e.shape
                ),
            ));
        }
        self.matrix_any(name, e, rows, cols)
    }

    /// A 1-D tensor (norm weights) widened to f32, checked to have `len` elements.
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, RunError> {
        let e = self.entry(name)?;
        if e.shape != [len as u64] {
            return Err(RunError::invalid(
                &self.manifest.resident.file,
                format!("tensor {name} has shape {:?}, expected [{len}]", e.shape),
            ));
        }
        let m = self.matrix_any(name, e, 1, len)?;
        let mut out = vec![0f32; len];
        m.widen_row(0, &mut out);
        Ok(out)
    }

    /// A float tensor of exactly `shape` (any rank: conv weights, gate vectors),
    /// widened to f32 in row-major order.
    pub fn floats(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, RunError> {
        let e = self.entry(name)?;
        let want: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        if e.shape != want {
            return Err(RunError::invalid(
                &self.manifest.resident.file,
                format!(
                    "tensor {name} has shape {:?}, the config implies {want:?}",
                    e.shape
                ),
            ));
        }
        let n: usize = shape.iter().product();
        let m = self.matrix_any(name, e, 1, n)?;
        let mut out = vec![0f32; n];
        m.widen_row(0, &mut out);
        Ok(out)
    }

    /// An I64 tensor of shape `[len]` (lookup tables the forward pass indexes with,
    /// such as Flash-Next's n-gram vocabularies), stored as is.
    pub fn i64s(&self, name: &str, len: usize) -> Result<Vec<i64>, RunError> {
        let file = &self.manifest.resident.file;
        let e = self.entry(name)?;
        if e.shape != [len as u64] {
            return Err(RunError::invalid(
                file,
                format!(
                    "tensor {name} has shape {:?}, the config implies [{len}]",
                    e.shape
                ),
            ));
        }
        let data = match e.storage {
            Storage::Dense { data } if e.dtype == Dtype::I64 => self.span(data),
            _ => {
                return Err(RunError::invalid(
                    file,
                    format!(
                        "tensor {name} is stored as {} {}, expected passthrough I64",
                        e.scheme_label(),
                        e.dtype.name()
                    ),
                ));
            }
        };
        if data.len() != len * 8 {
            return Err(RunError::invalid(
                file,
                format!("tensor {name}: {} bytes for {len} I64 values", data.len()),
            ));
        }
        Ok(data
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
            .collect())
    }

    fn matrix_any(
        &self,
        name: &str,
        e: &ResidentEntry,
        rows: usize,
        cols: usize,
    ) -> Result<Matrix<'_>, RunError> {
        matrix_view(
            &self.manifest.resident.file,
            name,
            rows,
            cols,
            |s| self.span(s),
            e,
        )
    }
}

/// A matrix view of `rows × cols` from a resident entry's spans.
fn matrix_view<'a>(
    file: &str,
    name: &str,
    rows: usize,
    cols: usize,
    span: impl Fn(Span) -> &'a [u8],
    e: &ResidentEntry,
) -> Result<Matrix<'a>, RunError> {
    let bad = |msg: String| RunError::invalid(file, format!("tensor {name}: {msg}"));
    match e.storage {
        Storage::Quant {
            affine,
            weights,
            scales,
            biases,
        } => Ok(Matrix::Quant {
            bits: affine.bits(),
            group: affine.group() as usize,
            weights: span(weights),
            scales: span(scales),
            biases: span(biases),
            rows,
            cols,
        }),
        Storage::Dense { data } => {
            let data = span(data);
            let dtype = e.dtype;
            let elem = match dtype {
                Dtype::BF16 | Dtype::F16 | Dtype::F32 => dtype.size() as usize,
                other => {
                    return Err(bad(format!(
                        "dtype {} cannot be computed with",
                        other.name()
                    )));
                }
            };
            if data.len() != rows * cols * elem {
                return Err(bad(format!(
                    "{} data bytes for {rows}×{cols} {}",
                    data.len(),
                    dtype.name()
                )));
            }
            Ok(match dtype {
                Dtype::BF16 => Matrix::Float {
                    dtype: FloatDtype::Bf16,
                    data,
                    rows,
                    cols,
                },
                Dtype::F16 => Matrix::Float {
                    dtype: FloatDtype::F16,
                    data,
                    rows,
                    cols,
                },
                _ => Matrix::Float {
                    dtype: FloatDtype::F32,
                    data,
                    rows,
                    cols,
                },
            })
        }
    }
}
