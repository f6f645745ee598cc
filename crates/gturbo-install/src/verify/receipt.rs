//! The receipt, `verified-install.json`: read back, vouched for, rewritten atomically,
//! and the copied files it records checked against the hashes their source published.

use std::fs::File;
use std::io::{self, Write};
use std::path::Path;
use std::time::SystemTime;

use serde::Serialize;

use crate::format::check::{VerifyFailure, open_inside, read_capped, read_manifest};
use crate::format::check_relative_path;
use crate::format::digest::{self, mismatches, sha256_hex};
use crate::format::manifest::{MAX_MANIFEST_BYTES, Manifest};
use crate::format::receipt::{self, Prover, Receipt, ReceiptCopied, ReceiptFile};

/// Largest receipt read back.
pub const MAX_RECEIPT_BYTES: u64 = MAX_MANIFEST_BYTES;

/// What happened to the receipt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReceiptOutcome {
    /// Rewritten, source repo and commit carried forward from the previous receipt.
    Rewritten,
    /// Rewritten without source provenance: there was no previous receipt, or it
    /// named another manifest or other file hashes.
    RewrittenWithoutProvenance,
    /// Not written: something failed, or the caller asked not to.
    NotWritten,
}

/// Whether the receipt vouches for this install without hashing: it exists, names the
/// SHA-256 of the manifest on disk, and lists exactly the manifest's files with the
/// sizes they have on disk. This is what a runtime may accept instead of full hashing
/// when the user asks it to trust the receipt; it proves sizes, not bytes. Call it
/// after [`check_layout`](crate::format::check::check_layout) found nothing.
pub fn receipt_vouches(dir: &Path) -> Result<bool, VerifyFailure> {
    let (bytes, m) = read_manifest(dir)?;
    let Some(r) = read_receipt(dir)? else {
        return Ok(false);
    };
    if r.manifest_sha256 != sha256_hex(&bytes) || r.files.len() != m.files.len() {
        return Ok(false);
    }
    for (rf, mf) in r.files.iter().zip(&m.files) {
        if rf.path != mf.path || rf.bytes != mf.bytes || rf.sha256 != mf.sha256 {
            return Ok(false);
        }
        if open_inside(dir, &mf.path)?.1 != mf.bytes {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The receipt on disk, if any. A receipt that cannot be read or parsed is a failure.
pub fn read_receipt(dir: &Path) -> Result<Option<Receipt>, VerifyFailure> {
    let name = receipt::FILE_NAME;
    match std::fs::symlink_metadata(dir.join(name)) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        _ => {}
    }
    let (file, len) = open_inside(dir, name)?;
    if len > MAX_RECEIPT_BYTES {
        return Err(VerifyFailure::new(
            name,
            "size",
            format!("{len} bytes; a receipt may have at most {MAX_RECEIPT_BYTES}"),
        ));
    }
    let bytes = read_capped(file, MAX_RECEIPT_BYTES).map_err(|e| VerifyFailure::io(name, &e))?;
    serde_json::from_slice(&bytes).map(Some).map_err(|e| {
        VerifyFailure::new(
            name,
            format!("line {} column {}", e.line(), e.column()),
            format!("not a valid receipt (delete it to verify without it): {e}"),
        )
    })
}

/// Rewrite the receipt atomically: a temporary file in the directory, fsynced,
/// renamed over the old one, the directory fsynced. Source repo and commit are
/// carried forward only from a receipt that names this manifest and these hashes.
pub(super) fn write_receipt(
    dir: &Path,
    manifest_sha: &str,
    files: Vec<ReceiptFile>,
    old: Option<Receipt>,
    quality: Option<ReceiptFile>,
) -> Result<ReceiptOutcome, VerifyFailure> {
    let carried = old
        .filter(|r| r.manifest_sha256 == manifest_sha && r.files == files)
        .map(|r| {
            (
                r.source_repo,
                r.source_commit,
                r.source_shards,
                r.source_copied,
            )
        });
    let outcome = if carried.is_some() {
        ReceiptOutcome::Rewritten
    } else {
        ReceiptOutcome::RewrittenWithoutProvenance
    };
    // No matching receipt: no provenance, `""`, `None` and no shards (FORMAT.md's
    // rewrite rule).
    let (source_repo, source_commit, source_shards, source_copied) = carried.unwrap_or_default();
    let mut r = Receipt::new(
        Prover::VerifyInstall,
        manifest_sha.to_string(),
        files,
        source_repo,
        source_commit,
        source_shards,
        SystemTime::now(),
    );
    r.quality = quality;
    r.source_copied = source_copied;
    write_receipt_file(dir, &r)?;
    Ok(outcome)
}

/// Write `r` as the receipt atomically: a temporary file in the directory, fsynced,
/// renamed over the old one, the directory fsynced.
pub(super) fn write_receipt_file(dir: &Path, r: &Receipt) -> Result<(), VerifyFailure> {
    let name = receipt::FILE_NAME;
    let tmp = dir.join(format!("{name}.tmp-{}", std::process::id()));
    let fail =
        |e: io::Error| VerifyFailure::new(name, "", format!("cannot write the receipt: {e}"));
    let result = (|| -> io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        f.write_all(&r.to_canonical_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, dir.join(name))?;
        File::open(dir)?.sync_all()
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(fail(e));
    }
    Ok(())
}

/// Each copied file the receipt records as verified, against the git blob id or SHA-256
/// its source published. Only files the manifest lists are opened (a receipt naming
/// another path is a failure), each at most the bound the install held it to
/// ([`crate::plan::copied_max_bytes`]).
pub(super) fn check_copied(
    dir: &Path,
    m: &Manifest,
    copied: &[ReceiptCopied],
) -> Vec<VerifyFailure> {
    let mut out = Vec::new();
    let rname = receipt::FILE_NAME;
    for c in copied.iter().filter(|c| c.verified) {
        let listed = (m.files.iter()).any(|f| f.path == c.file && f.kind == "tokenizer");
        if !listed || check_relative_path(&c.file).is_err() {
            out.push(VerifyFailure::new(
                rname,
                "source_copied",
                format!("{:?} is not a copied file of the manifest", c.file),
            ));
            continue;
        }
        let bytes = match open_inside(dir, &c.file).and_then(|(file, _)| {
            read_capped(file, crate::plan::copied_max_bytes(&c.path).0)
                .map_err(|e| VerifyFailure::io(&c.file, &e))
        }) {
            Ok(b) => b,
            Err(f) => {
                out.push(f);
                continue;
            }
        };
        for (which, want, got) in mismatches(c.git_oid.as_deref(), c.sha256.as_deref(), &bytes) {
            let at = match which {
                digest::Published::GitBlob => "source git blob id",
                digest::Published::Sha256 => "source sha256",
            };
            out.push(VerifyFailure::new(
                &c.file,
                at,
                format!(
                    "{got} on disk, the source ({}) published {want}, as {rname} records",
                    c.path
                ),
            ));
        }
    }
    out
}
