//! `verified-install.json`: who proved this install, when, and against which manifest.
//!
//! Written by the install after the manifest, inside the staging directory (so it is
//! published by the same rename), and rewritten by `verify-install` after a full check.
//! It is not listed in the manifest.

use serde::{Deserialize, Serialize};

/// File name inside the `.gturbo` directory.
pub const FILE_NAME: &str = "verified-install.json";

/// The receipt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Receipt {
    /// Always `gturbo-receipt`.
    pub format: String,
    /// Receipt version (1).
    pub version: u32,
    /// SHA-256 of `manifest.json` as verified.
    pub manifest_sha256: String,
    /// Every file of the manifest with the hash computed from the disk.
    pub files: Vec<ReceiptFile>,
    /// What produced the proof: `install` or `verify-install`.
    pub verified_by: String,
    /// Tool version.
    pub tool_version: String,
    /// When, as seconds since the Unix epoch.
    pub verified_at_unix: u64,
    /// When, as an HTTP date (RFC 9110 IMF-fixdate), for humans.
    pub verified_at: String,
    /// Source repo.
    pub source_repo: String,
    /// Source commit.
    pub source_commit: Option<String>,
    /// Each source shard, and whether the install proved its bytes against the
    /// SHA-256 the source published (absent in receipts written before this field).
    #[serde(default)]
    pub source_shards: Vec<ReceiptSource>,
}

/// One source shard of the install.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReceiptSource {
    /// Path in the source repo.
    pub path: String,
    /// The SHA-256 the source published, if it published one.
    pub sha256: Option<String>,
    /// Whether every byte of the shard was hashed and matched `sha256`.
    pub verified: bool,
}

/// One verified file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReceiptFile {
    /// Path inside the directory.
    pub path: String,
    /// Size.
    pub bytes: u64,
    /// SHA-256 computed from the disk.
    pub sha256: String,
}

impl Receipt {
    /// Canonical bytes (sorted keys, two-space indent, trailing newline).
    pub fn to_canonical_bytes(&self) -> Vec<u8> {
        let value = serde_json::to_value(self).unwrap_or(serde_json::Value::Null);
        let mut out = serde_json::to_vec_pretty(&value).unwrap_or_default();
        out.push(b'\n');
        out
    }
}
