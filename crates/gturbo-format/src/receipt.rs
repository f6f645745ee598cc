//! `verified-install.json`: who proved this install, when, and against which manifest.
//!
//! Written by the install after the manifest, inside the staging directory (so it is
//! published by the same rename), and rewritten by `verify-install` after a full check.
//! It is not listed in the manifest.

use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use super::manifest::ManifestFile;

/// File name inside the `.gturbo` directory.
pub const FILE_NAME: &str = "verified-install.json";

/// The receipt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Receipt {
    /// Always [`FORMAT`].
    pub format: String,
    /// Receipt version ([`VERSION`]).
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
    /// Each file copied from the source (config, tokenizer, chat template), with the
    /// hash the source published for it and whether the copy matched it (absent in
    /// receipts written before this field). `verify-install` checks the files on disk
    /// against these hashes again.
    #[serde(default)]
    pub source_copied: Vec<ReceiptCopied>,
    /// `quality.json` as `gturbo eval --record` wrote it (absent when no quality was
    /// recorded): the receipt's signature over the quality result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quality: Option<ReceiptFile>,
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

/// One file copied verbatim from the source.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReceiptCopied {
    /// Path in the source repo.
    pub path: String,
    /// Path inside the directory.
    pub file: String,
    /// The git blob id the source published (a file not in LFS: the listing's `oid`,
    /// the `ETag`), if it published one.
    pub git_oid: Option<String>,
    /// The SHA-256 the source published (a file in LFS), if it published one.
    pub sha256: Option<String>,
    /// Whether the source published a hash and the copied bytes matched every one
    /// it published.
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

/// Always `gturbo-receipt`.
pub const FORMAT: &str = "gturbo-receipt";
/// Current receipt version.
pub const VERSION: u32 = 1;

/// What produced a receipt's proof.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prover {
    /// `gturbo install`, which hashed every file it wrote.
    Install,
    /// `gturbo verify-install`, after a full check.
    VerifyInstall,
}

impl Prover {
    /// The `verified_by` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Prover::Install => "install",
            Prover::VerifyInstall => "verify-install",
        }
    }
}

impl From<&ManifestFile> for ReceiptFile {
    fn from(f: &ManifestFile) -> ReceiptFile {
        ReceiptFile {
            path: f.path.clone(),
            bytes: f.bytes,
            sha256: f.sha256.clone(),
        }
    }
}

impl Receipt {
    /// The receipt `by` writes at `now` for the manifest whose SHA-256 is
    /// `manifest_sha256`, with the `files` hashes it computed and the source
    /// provenance it vouches for (`""`, `None` and no shards when it vouches for none).
    pub fn new(
        by: Prover,
        manifest_sha256: String,
        files: Vec<ReceiptFile>,
        source_repo: String,
        source_commit: Option<String>,
        source_shards: Vec<ReceiptSource>,
        now: SystemTime,
    ) -> Receipt {
        Receipt {
            format: FORMAT.into(),
            version: VERSION,
            manifest_sha256,
            files,
            verified_by: by.as_str().into(),
            tool_version: env!("CARGO_PKG_VERSION").into(),
            // A clock before 1970 records 0; the HTTP date still says when.
            verified_at_unix: now
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            verified_at: httpdate::fmt_http_date(now),
            source_repo,
            source_commit,
            source_shards,
            source_copied: Vec::new(),
            quality: None,
        }
    }

    /// Canonical bytes ([`super::json::to_pretty`]: sorted keys, two-space indent,
    /// trailing newline).
    pub fn to_canonical_bytes(&self) -> Vec<u8> {
        super::json::to_pretty(self)
            .expect("a Receipt always serializes: derived impls over strings and integers")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_receipt_is_canonical_json_with_its_prover_and_time() {
        let at = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000);
        let file = ManifestFile {
            path: "resident.bin".into(),
            bytes: 3,
            sha256: "ab".repeat(32),
            kind: "resident".into(),
        };
        let r = Receipt::new(
            Prover::VerifyInstall,
            "cd".repeat(32),
            vec![ReceiptFile::from(&file)],
            "org/m".into(),
            None,
            Vec::new(),
            at,
        );
        let text = String::from_utf8(r.to_canonical_bytes()).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["format"], "gturbo-receipt");
        assert_eq!(v["version"], 1);
        assert_eq!(v["verified_by"], "verify-install");
        assert_eq!(v["verified_at_unix"], 1_700_000_000u64);
        assert_eq!(v["verified_at"], "Tue, 14 Nov 2023 22:13:20 GMT");
        assert_eq!(v["files"][0]["sha256"], "ab".repeat(32));
        assert!(text.starts_with("{\n  \"files\": ["), "{text}");
        assert!(text.ends_with("}\n"));
        let back: Receipt = serde_json::from_str(&text).unwrap();
        assert_eq!(back, r);
        assert_eq!(Prover::Install.as_str(), "install");
    }
}
