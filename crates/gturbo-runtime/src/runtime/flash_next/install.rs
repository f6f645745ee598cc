//! Opening a qwen4_exp install for the Flash-Next runner: the install as `gturbo run`
//! opens every install ([`crate::runtime::load::open`]: manifest, capability gate,
//! layout checks, the memory-mapped resident tensors, the expert store), plus one
//! bounded row cache per PLE row pool.

use std::ops::Deref;
use std::path::Path;

use super::rows::RowCache;
use crate::format::manifest;
use crate::runtime::RunError;
use crate::runtime::experts::ExpertMode;
use crate::runtime::load::{self, Install, LoadOptions};

/// The model type this forward pass implements.
pub const MODEL_TYPE: &str = "qwen4_exp";

/// Rows each PLE row cache keeps by default: 64 Ki rows, 20 MiB of the real model's
/// 320-byte rows per PLE layer.
pub const DEFAULT_ROW_CACHE_ROWS: usize = 1 << 16;

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
            row_cache_rows: DEFAULT_ROW_CACHE_ROWS,
        }
    }
}

/// An opened qwen4_exp install: the install and its row caches.
pub struct FlashInstall {
    /// The install as the loader opened it (gate passed, layout checked).
    pub install: Install,
    /// Row caches, one per row pool, with the pool's layer.
    pub rows: Vec<(usize, RowCache)>,
}

impl std::fmt::Debug for FlashInstall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlashInstall")
            .field("install", &self.install)
            .field("row_pools", &self.rows.len())
            .finish()
    }
}

impl Deref for FlashInstall {
    type Target = Install;
    fn deref(&self) -> &Install {
        &self.install
    }
}

/// Open `dir` through the loader (gate, layout, resident map, experts), then its row
/// pools.
pub fn open(dir: &Path, opts: FlashOptions) -> Result<FlashInstall, RunError> {
    let install = load::open(
        dir,
        LoadOptions {
            experts: opts.experts,
        },
    )?;
    FlashInstall::new(install, opts.row_cache_rows)
}

impl FlashInstall {
    /// Add the row caches (`row_cache_rows` rows each) to an opened install of model
    /// type `qwen4_exp`.
    pub fn new(install: Install, row_cache_rows: usize) -> Result<FlashInstall, RunError> {
        let m = &install.manifest;
        if m.arch.model_type != MODEL_TYPE {
            return Err(RunError::invalid(
                manifest::FILE_NAME,
                format!(
                    "arch.model_type is {:?}; the Flash-Next runner runs {MODEL_TYPE:?}",
                    m.arch.model_type
                ),
            ));
        }
        let mut rows = Vec::new();
        for p in &m.row_pools {
            let layer = usize::try_from(p.layer)
                .ok()
                .filter(|&l| l < 1 << 20)
                .ok_or_else(|| {
                    RunError::invalid(&p.file, format!("layer {} out of range", p.layer))
                })?;
            if rows.iter().any(|(l, _)| *l == layer) {
                return Err(RunError::invalid(
                    &p.file,
                    format!("a second row pool for layer {layer}"),
                ));
            }
            rows.push((layer, RowCache::open(&install.dir, p, row_cache_rows)?));
        }
        Ok(FlashInstall { install, rows })
    }

    /// The row cache of `layer`'s PLE table.
    pub fn row_cache(&self, layer: usize) -> Option<&RowCache> {
        self.rows.iter().find(|(l, _)| *l == layer).map(|(_, r)| r)
    }
}
