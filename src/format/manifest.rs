//! `manifest.json`: the last file an install writes, the first one verify and run read.
//!
//! Canonical JSON (sorted keys, two-space indent). It names every file with its size
//! and SHA-256, the source pins, the architecture axes a runner must support, the pool
//! geometry and what quantization was applied.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::Scheme;
use super::pools::{ExpertPool, RowPool};

/// Format tag.
pub const FORMAT: &str = "gturbo";
/// Current manifest version.
pub const VERSION: u32 = 1;
/// File name inside the `.gturbo` directory.
pub const FILE_NAME: &str = "manifest.json";
/// Largest manifest a reader accepts.
pub const MAX_MANIFEST_BYTES: u64 = 64 << 20;

/// The manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Always `gturbo`.
    pub format: String,
    /// Manifest version.
    pub version: u32,
    /// Family id.
    pub family: String,
    /// Model id (`org/name`).
    pub model_id: String,
    /// Where the weights came from.
    pub source: ManifestSource,
    /// Architecture axes.
    pub arch: ManifestArch,
    /// Fingerprint of the plan that produced this install.
    pub plan_fingerprint: String,
    /// Quantization applied at install time.
    #[serde(rename = "quantizedAtInstall")]
    pub quantized_at_install: QuantizedAtInstall,
    /// Every file except the manifest and the receipt, sorted by path.
    pub files: Vec<ManifestFile>,
    /// The resident weights file.
    pub resident: ManifestResident,
    /// Expert pools.
    pub expert_pools: Vec<ExpertPool>,
    /// Row pools.
    pub row_pools: Vec<RowPool>,
    /// Sidecar name → `carried` or `skipped`.
    pub sidecars: BTreeMap<String, String>,
    /// Source tensors not installed.
    pub excluded_tensors: u64,
    /// Tool that wrote the install.
    pub tool: ManifestTool,
}

/// Source pins.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestSource {
    /// `org/name`.
    pub repo: String,
    /// Revision asked for.
    pub revision: String,
    /// Resolved commit.
    pub commit: Option<String>,
    /// SHA-256 of the index.
    pub index_sha256: Option<String>,
}

/// Architecture.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestArch {
    /// `model_type`.
    pub model_type: String,
    /// Axis values from the config.
    pub axes: BTreeMap<String, serde_json::Value>,
    /// Capabilities a runner must implement.
    #[serde(rename = "requiredAxes")]
    pub required_axes: Vec<String>,
}

/// Quantization record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuantizedAtInstall {
    /// Default scheme (`int4_g64`), or `passthrough` for a `--quant bf16` install.
    pub scheme: Scheme,
    /// Bits of the default scheme (0 for passthrough).
    pub bits: u32,
    /// Group size.
    pub group_size: u32,
    /// Pattern → scheme overrides applied.
    pub overrides: Vec<(String, Scheme)>,
    /// The parity reference the quantizer is held to.
    pub parity_gate: String,
    /// Measured quality gate (mean KL vs a reference install), when run.
    pub quality_gate: Option<serde_json::Value>,
}

/// One file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestFile {
    /// Path inside the directory, `/`-separated.
    pub path: String,
    /// Size in bytes.
    pub bytes: u64,
    /// SHA-256, lowercase hex.
    pub sha256: String,
    /// `resident`, `experts`, `rows`, `tokenizer`.
    pub kind: String,
}

/// Resident file summary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestResident {
    /// Path.
    pub file: String,
    /// Payload start.
    pub payload_start: u64,
    /// Entries.
    pub entries: u64,
}

/// Tool identity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestTool {
    /// `gturbo`.
    pub name: String,
    /// Crate version.
    pub version: String,
}

impl Manifest {
    /// Canonical bytes: sorted keys (serde_json's map is ordered), two-space indent,
    /// trailing newline.
    pub fn to_canonical_bytes(&self) -> Vec<u8> {
        let value = serde_json::to_value(self).unwrap_or(serde_json::Value::Null);
        let mut out = serde_json::to_vec_pretty(&value).unwrap_or_default();
        out.push(b'\n');
        out
    }
}
