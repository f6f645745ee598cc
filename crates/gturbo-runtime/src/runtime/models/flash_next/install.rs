//! Opening a Flash-Next install: the loader's [`Install`] (which holds the n-gram row
//! caches of every install that has row pools) after a check of the model type.

use std::path::Path;

use crate::format::manifest;
use crate::runtime::RunError;
use crate::runtime::experts::ExpertMode;
pub use crate::runtime::load::DEFAULT_ROW_CACHE_ROWS;
use crate::runtime::load::{self, Install, LoadOptions};

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
            row_cache_rows: DEFAULT_ROW_CACHE_ROWS,
        }
    }
}

/// An opened qwen4_exp install: the loader's install, row caches included.
pub type FlashInstall = Install;

/// Open `dir` through the loader (gate, layout, resident map, experts, row pools); the
/// model type is checked by [`FlashModel::new`](super::model::FlashModel::new), the one
/// way in for this open and for `models::open`.
pub fn open(dir: &Path, opts: FlashOptions) -> Result<FlashInstall, RunError> {
    load::open(
        dir,
        LoadOptions {
            experts: opts.experts,
            row_cache_rows: opts.row_cache_rows,
        },
    )
}

/// Whether `install` holds the model type this runner implements (the gate chose the
/// runner by family; a manifest whose `arch.model_type` disagrees is refused here).
pub fn check_model_type(install: &Install) -> Result<(), RunError> {
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
    Ok(())
}
