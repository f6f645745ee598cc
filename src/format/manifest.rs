//! `manifest.json`: the last file an install writes, the first one verify and run read.
//!
//! Canonical JSON (sorted keys, two-space indent). It names every file with its size
//! and SHA-256, the source pins, the architecture axes a runner must support, the pool
//! geometry and what quantization was applied.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::pools::{ExpertPool, RowPool};
use super::{LayoutError, Scheme};

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
    /// Parse manifest bytes: at most [`MAX_MANIFEST_BYTES`], JSON with known keys only
    /// (serde_json's nesting limit stops hostile depth), the `gturbo` format at
    /// [`VERSION`]. Consistency of the numbers is checked separately (the pools'
    /// `layout_errors`, and verify-install's checks against the disk).
    pub fn parse(bytes: &[u8]) -> Result<Manifest, LayoutError> {
        if bytes.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(LayoutError::new(
                "size",
                format!(
                    "{} bytes; a manifest may have at most {MAX_MANIFEST_BYTES}",
                    bytes.len()
                ),
            ));
        }
        // Read the tag and version first, so a newer manifest says so instead of
        // failing on a key this version does not know.
        #[derive(Deserialize)]
        struct Tag {
            format: Option<serde_json::Value>,
            version: Option<serde_json::Value>,
        }
        if let Ok(tag) = serde_json::from_slice::<Tag>(bytes) {
            if tag.format.as_ref().and_then(|v| v.as_str()) != Some(FORMAT) {
                return Err(LayoutError::new(
                    "format",
                    format!("{:?}; expected {FORMAT:?}", tag.format),
                ));
            }
            if tag.version.as_ref().and_then(|v| v.as_u64()) != Some(VERSION as u64) {
                return Err(LayoutError::new(
                    "version",
                    format!(
                        "{}; this gturbo reads version {VERSION}",
                        tag.version.map_or("missing".to_string(), |v| v.to_string())
                    ),
                ));
            }
        }
        serde_json::from_slice(bytes).map_err(|e| {
            LayoutError::new(
                format!("line {} column {}", e.line(), e.column()),
                format!("not a valid manifest: {e}"),
            )
        })
    }

    /// Canonical bytes ([`super::json::to_pretty`]: sorted keys, two-space indent,
    /// trailing newline).
    pub fn to_canonical_bytes(&self) -> Vec<u8> {
        super::json::to_pretty(self).expect(
            "a Manifest always serializes: derived impls over strings, integers, \
             string-keyed maps and serde_json::Values",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_manifest_bytes_are_refused_cleanly() {
        let e = Manifest::parse(br#"{"format":"gturbo","version":2}"#).unwrap_err();
        assert_eq!(e.to_string(), "version: 2; this gturbo reads version 1");
        let e = Manifest::parse(br#"{"format":"safetensors","version":1}"#).unwrap_err();
        assert_eq!(e.field, "format");
        let e = Manifest::parse(br#"{"format":"gturbo","version":1}"#).unwrap_err();
        assert!(e.detail.contains("missing field"), "{e}");
        // 100,000 levels of nesting inside a free-form value: serde_json's recursion
        // limit answers, the stack does not overflow.
        let deep = format!(
            r#"{{"format":"gturbo","version":1,"arch":{{"axes":{{"x":{}}}}}}}"#,
            "[".repeat(100_000)
        );
        let e = Manifest::parse(deep.as_bytes()).unwrap_err();
        assert!(e.detail.contains("recursion limit exceeded"), "{e}");
        let big = vec![b' '; (MAX_MANIFEST_BYTES + 1) as usize];
        assert_eq!(Manifest::parse(&big).unwrap_err().field, "size");
        assert!(Manifest::parse(b"\xff\xfe").is_err());
    }
}
