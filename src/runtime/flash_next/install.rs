//! Opening a qwen4_exp install for the Flash-Next forward pass: the manifest and its
//! layout checks, the memory-mapped resident tensors (I64 tables included), the
//! expert store and one bounded row cache per PLE row pool.
//!
//! This mirrors [`crate::runtime::load::open`] without the capability gate, which does
//! not admit the family until the runner is wired in behind it; tests and the runner
//! under construction open installs through here.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::rows::RowCache;
use crate::format::manifest::Manifest;
use crate::format::resident::{ResidentEntry, ResidentHead, Span};
use crate::runtime::experts::{ExpertMode, ExpertStore};
use crate::runtime::kernels::{Backend, Cpu, Matrix};
use crate::runtime::load::{LoadError, safe_join};
use crate::verify::{self, VerifyFailure};

/// The model type this forward pass implements.
pub const MODEL_TYPE: &str = "qwen4_exp";

/// How to open a Flash-Next install.
#[derive(Debug, Clone, Copy)]
pub struct FlashOptions {
    /// Expert residency.
    pub experts: ExpertMode,
    /// Rows each PLE row cache keeps (at least 1).
    pub row_cache_rows: usize,
}

impl Default for FlashOptions {
    fn default() -> Self {
        FlashOptions {
            experts: ExpertMode::Slots(16),
            // 64 Ki rows: 20 MiB of the real model's 320-byte rows per PLE layer.
            row_cache_rows: 1 << 16,
        }
    }
}

/// An opened qwen4_exp install.
pub struct FlashInstall {
    /// The `.gturbo` directory.
    pub dir: PathBuf,
    /// The manifest.
    pub manifest: Manifest,
    resident: Mmap,
    payload_start: usize,
    tensors: HashMap<String, ResidentEntry>,
    /// Bytes of `resident.bin`.
    pub resident_bytes: u64,
    /// Routed experts.
    pub experts: ExpertStore,
    /// Row caches, one per row pool, with the pool's layer.
    pub rows: Vec<(usize, RowCache)>,
}

impl std::fmt::Debug for FlashInstall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlashInstall")
            .field("dir", &self.dir)
            .field("tensors", &self.tensors.len())
            .field("row_pools", &self.rows.len())
            .finish()
    }
}

fn failure(f: &VerifyFailure) -> LoadError {
    let msg = if f.at.is_empty() {
        f.detail.clone()
    } else {
        format!("{}: {}", f.at, f.detail)
    };
    LoadError::invalid(f.file.clone(), msg)
}

/// Open `dir`: manifest (model type `qwen4_exp`), layout checks, resident map, expert
/// pools and row pools.
pub fn open(dir: &Path, opts: FlashOptions) -> Result<FlashInstall, LoadError> {
    let manifest = verify::open_manifest(dir).map_err(|f| failure(&f))?;
    if manifest.arch.model_type != MODEL_TYPE {
        return Err(LoadError::invalid(
            "manifest.json",
            format!(
                "arch.model_type is {:?}; the Flash-Next runner runs {MODEL_TYPE:?}",
                manifest.arch.model_type
            ),
        ));
    }
    if let Some(first) = verify::check_layout(dir, &manifest).first() {
        return Err(failure(first));
    }
    let rel = manifest.resident.file.clone();
    let path = safe_join(dir, &rel)?;
    let file = File::open(&path).map_err(|e| LoadError::io(&rel, e))?;
    let len = file.metadata().map_err(|e| LoadError::io(&rel, e))?.len();
    // SAFETY: as in `load::open`: an install is read-only once published and the map
    // is only read; a concurrent truncation would fault (SIGBUS), the accepted mmap
    // contract.
    #[allow(unsafe_code)]
    let map = unsafe { Mmap::map(&file) }.map_err(|e| LoadError::io(&rel, e))?;
    let head =
        ResidentHead::parse(&map, len).map_err(|e| LoadError::invalid(&rel, e.to_string()))?;
    if head.payload_start != manifest.resident.payload_start {
        return Err(LoadError::invalid(
            &rel,
            format!(
                "payload starts at {}, manifest resident.payloadStart says {}",
                head.payload_start, manifest.resident.payload_start
            ),
        ));
    }
    let payload_start = usize::try_from(head.payload_start)
        .ok()
        .filter(|&p| p as u64 <= len)
        .ok_or_else(|| LoadError::invalid(&rel, "payload start past the end of the file"))?;
    let tensors = head
        .index
        .tensors
        .into_iter()
        .map(|e| (e.name.clone(), e))
        .collect();
    let experts = ExpertStore::open(dir, &manifest, opts.experts)?;
    let mut rows = Vec::new();
    for p in &manifest.row_pools {
        let layer = usize::try_from(p.layer)
            .ok()
            .filter(|&l| l < 1 << 20)
            .ok_or_else(|| {
                LoadError::invalid(&p.file, format!("layer {} out of range", p.layer))
            })?;
        rows.push((layer, RowCache::open(dir, p, opts.row_cache_rows)?));
    }
    Ok(FlashInstall {
        dir: dir.to_path_buf(),
        manifest,
        resident: map,
        payload_start,
        tensors,
        resident_bytes: len,
        experts,
        rows,
    })
}

impl FlashInstall {
    fn file(&self) -> &str {
        &self.manifest.resident.file
    }

    fn bad(&self, name: &str, msg: impl std::fmt::Display) -> LoadError {
        LoadError::invalid(self.file(), format!("tensor {name}: {msg}"))
    }

    /// The bytes of `s`, checked to lie inside the payload.
    fn span(&self, name: &str, s: Option<Span>, what: &str) -> Result<&[u8], LoadError> {
        let s = s.ok_or_else(|| self.bad(name, format!("no {what} span")))?;
        let start = (self.payload_start as u64).checked_add(s.offset);
        let end = start.and_then(|a| a.checked_add(s.len));
        match (start, end) {
            (Some(a), Some(e)) if e <= self.resident.len() as u64 => {
                Ok(&self.resident[a as usize..e as usize])
            }
            _ => Err(self.bad(
                name,
                format!(
                    "{what} span {}+{} runs past {} bytes",
                    s.offset,
                    s.len,
                    self.resident.len()
                ),
            )),
        }
    }

    fn entry(&self, name: &str) -> Result<&ResidentEntry, LoadError> {
        self.tensors.get(name).ok_or_else(|| {
            LoadError::invalid(
                self.file(),
                format!("tensor {name} is not in the resident index"),
            )
        })
    }

    fn entry_shaped(&self, name: &str, shape: &[usize]) -> Result<&ResidentEntry, LoadError> {
        let e = self.entry(name)?;
        let want: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        if e.shape != want {
            return Err(self.bad(
                name,
                format!("shape {:?}, the config implies {want:?}", e.shape),
            ));
        }
        Ok(e)
    }

    /// Whether the resident file holds `name`.
    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The shape of `name`, if present.
    pub fn shape(&self, name: &str) -> Option<&[u64]> {
        self.tensors.get(name).map(|e| e.shape.as_slice())
    }

    /// A tensor of shape `[rows, cols]` as a matrix view.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix<'_>, LoadError> {
        let e = self.entry_shaped(name, &[rows, cols])?;
        self.view(name, e, rows, cols)
    }

    fn view(
        &self,
        name: &str,
        e: &ResidentEntry,
        rows: usize,
        cols: usize,
    ) -> Result<Matrix<'_>, LoadError> {
        let m = match e.scheme.bits() {
            Some(bits) => Matrix::Quant {
                bits,
                weights: self.span(name, e.weights, "weights")?,
                scales: self.span(name, e.scales, "scales")?,
                biases: self.span(name, e.biases, "biases")?,
                rows,
                cols,
            },
            None => {
                let data = self.span(name, e.data, "data")?;
                match e.dtype.as_str() {
                    "BF16" => Matrix::Bf16 { data, rows, cols },
                    "F16" => Matrix::F16 { data, rows, cols },
                    "F32" => Matrix::F32 { data, rows, cols },
                    other => {
                        return Err(
                            self.bad(name, format!("dtype {other} cannot be computed with"))
                        );
                    }
                }
            }
        };
        m.check().map_err(|err| self.bad(name, err))?;
        Ok(m)
    }

    /// A float tensor of exactly `shape`, widened to f32 (row-major).
    pub fn floats(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
        let e = self.entry_shaped(name, shape)?;
        let n: usize = shape.iter().product();
        let m = self.view(name, e, 1, n)?;
        let mut out = vec![0f32; n];
        Cpu::new(1).row(&m, 0, &mut out);
        Ok(out)
    }

    /// An I64 tensor of shape `[len]` (the PLE tables), stored as is.
    pub fn i64s(&self, name: &str, len: usize) -> Result<Vec<i64>, LoadError> {
        let e = self.entry_shaped(name, &[len])?;
        if e.dtype != "I64" || e.scheme.bits().is_some() {
            return Err(self.bad(
                name,
                format!("stored as {} {}, expected I64", e.scheme.label(), e.dtype),
            ));
        }
        let data = self.span(name, e.data, "data")?;
        if data.len() != len * 8 {
            return Err(self.bad(name, format!("{} bytes for {len} I64 values", data.len())));
        }
        Ok(data
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
            .collect())
    }

    /// The row cache of `layer`'s PLE table.
    pub fn row_cache(&self, layer: usize) -> Option<&RowCache> {
        self.rows.iter().find(|(l, _)| *l == layer).map(|(_, r)| r)
    }
}
