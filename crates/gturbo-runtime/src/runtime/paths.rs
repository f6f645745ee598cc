//! Paths inside an install: every file name a manifest gives is joined to the install
//! directory here, after the layout's rule for relative names.

use std::path::{Path, PathBuf};

use super::error::RunError;
use crate::format::check_relative_path;
use crate::format::manifest;

/// `dir/rel`, refusing names that would leave the install ([`check_relative_path`]).
pub fn safe_join(dir: &Path, rel: &str) -> Result<PathBuf, RunError> {
    check_relative_path(rel).map_err(|why| {
        RunError::invalid(
            manifest::FILE_NAME,
            format!("file name {rel:?} leaves the install directory: {why}"),
        )
    })?;
    Ok(dir.join(rel))
}
