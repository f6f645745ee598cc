//! The files copied verbatim from the source (`config.json`, the tokenizer, the chat
//! template) against the hash the source publishes for each: the install copies them
//! whole, so it checks them whole, like the shards.
//!
//! The hub publishes a hash for every file: a file in LFS has its SHA-256 (`lfs.oid`,
//! `X-Linked-Etag`), any other its git blob id (the listing's `oid`, the `ETag`). A copy
//! is checked against every hash published for it, and one that does not match is
//! refused naming the file and both hashes. A source that publishes none (a plain local
//! folder, a mirror that drops them) leaves the file unverified: the install says so per
//! file and the receipt records it, and `--require-source-hash` refuses it.

use crate::format::digest::{self, mismatches};
use crate::format::receipt::ReceiptCopied;
use crate::source::{RangeSource, ResolvedRepo};

use super::InstallError;

/// What a source publishes for one file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Published {
    /// The SHA-256 (a file in LFS).
    pub sha256: Option<String>,
    /// The git blob id (a file not in LFS).
    pub git_oid: Option<String>,
}

/// The hashes `source` publishes for `path` as known now: the listing's, or what an
/// answer for the file carried ([`RangeSource::published_sha256`],
/// [`RangeSource::published_git_oid`]). Ask after reading the file, so its answers
/// count.
pub fn published(source: &dyn RangeSource, repo: &ResolvedRepo, path: &str) -> Published {
    Published {
        sha256: repo
            .file(path)
            .and_then(|f| f.sha256.clone())
            .or_else(|| source.published_sha256(path)),
        git_oid: source.published_git_oid(path),
    }
}

impl Published {
    /// Whether there is a hash to check against.
    pub fn any(&self) -> bool {
        self.sha256.is_some() || self.git_oid.is_some()
    }

    /// Check `bytes` (the whole of `file`, a path in the repo) against every hash
    /// published.
    pub fn check(&self, file: &str, bytes: &[u8]) -> Result<(), InstallError> {
        let first = mismatches(self.git_oid.as_deref(), self.sha256.as_deref(), bytes)
            .into_iter()
            .next();
        match first {
            None => Ok(()),
            Some((which, expected, computed)) => Err(InstallError::CopiedHashMismatch {
                file: file.to_string(),
                what: match which {
                    digest::Published::GitBlob => "git blob id",
                    digest::Published::Sha256 => "SHA-256",
                },
                expected: expected.to_string(),
                computed,
            }),
        }
    }

    /// The receipt's record of `path`, copied to `file`, after [`Published::check`]
    /// passed.
    pub fn record(self, path: &str, file: &str) -> ReceiptCopied {
        ReceiptCopied {
            path: path.to_string(),
            file: file.to_string(),
            verified: self.any(),
            git_oid: self.git_oid,
            sha256: self.sha256,
        }
    }
}

/// The copied files of the plan that the source publishes no hash for, as known before
/// they are read (the listing; `config.json` was read already): what
/// `--require-source-hash` refuses before any weight streams.
pub fn unpublished(
    source: &dyn RangeSource,
    repo: &ResolvedRepo,
    plan: &crate::plan::Plan,
) -> Vec<String> {
    plan.outputs
        .copied
        .iter()
        .filter(|c| !published(source, repo, &c.source).any())
        .map(|c| c.source.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::digest::{git_blob_sha1, sha256_hex};

    #[test]
    fn a_copy_is_checked_against_every_published_hash() {
        let bytes = b"{\"rms_norm_eps\": 1e-06}";
        let honest = Published {
            sha256: None,
            git_oid: Some(git_blob_sha1(bytes)),
        };
        honest.check("config.json", bytes).unwrap();
        let tampered = b"{\"rms_norm_eps\": 1e-05}";
        let e = honest.check("config.json", tampered).unwrap_err();
        let text = e.to_string();
        assert!(
            text.starts_with("config.json: source git blob id mismatch: the bytes read are not the published file"),
            "{text}"
        );
        assert!(
            text.contains(&format!("Expected: {}", git_blob_sha1(bytes))),
            "{text}"
        );
        assert!(
            text.contains(&format!("Computed: {}", git_blob_sha1(tampered))),
            "{text}"
        );
        assert!(e.is_refusal());

        let lfs = Published {
            sha256: Some(sha256_hex(bytes)),
            git_oid: None,
        };
        lfs.check("tokenizer.json", bytes).unwrap();
        let e = lfs
            .check("tokenizer.json", tampered)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("tokenizer.json: source SHA-256 mismatch"),
            "{e}"
        );

        let none = Published::default();
        none.check("vocab.json", tampered).unwrap();
        let r = none.record("vocab.json", "tokenizer/vocab.json");
        assert!(!r.verified);
        let r = honest.record("config.json", "tokenizer/config.json");
        assert!(r.verified);
        assert_eq!(r.git_oid, Some(git_blob_sha1(bytes)));
    }
}
