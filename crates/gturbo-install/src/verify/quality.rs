//! The recorded quality result, `quality.json`: checked against the receipt and the
//! manifest it measured, read for `gturbo run`, recorded by `gturbo eval --record`.

use std::fs::File;
use std::io::{self, Write};
use std::path::Path;

use super::receipt::{read_receipt, write_receipt_file};
use crate::format::check::{VerifyFailure, open_inside, read_capped, read_manifest};
use crate::format::digest::sha256_hex;
use crate::format::quality::{self, Quality};
use crate::format::receipt::{self, Receipt, ReceiptFile};

/// The recorded quality result of the install whose manifest's SHA-256 is
/// `manifest_sha`, checked against the receipt `r` (FORMAT.md, "quality.json"):
/// `Ok(None)` when none is recorded (no `quality.json`, no receipt entry), the receipt
/// entry and the parsed result when both agree, and a failure naming `quality.json`
/// when the file and the receipt disagree, the file does not parse, or it measured
/// another manifest.
pub fn check_quality(
    dir: &Path,
    manifest_sha: &str,
    r: Option<&Receipt>,
) -> Result<Option<(ReceiptFile, Quality)>, VerifyFailure> {
    let name = quality::FILE_NAME;
    let present = !matches!(std::fs::symlink_metadata(dir.join(name)),
        Err(e) if e.kind() == io::ErrorKind::NotFound);
    let entry = r.and_then(|r| r.quality.clone());
    let entry = match (present, entry) {
        (false, None) => return Ok(None),
        (false, Some(_)) => {
            return Err(VerifyFailure::new(
                name,
                "",
                format!(
                    "missing; {} lists a recorded quality result",
                    receipt::FILE_NAME
                ),
            ));
        }
        (true, None) => {
            return Err(VerifyFailure::new(
                name,
                "",
                format!(
                    "not covered by {} (only `gturbo eval --record` records a quality \
                     result; delete the file or measure again)",
                    receipt::FILE_NAME
                ),
            ));
        }
        (true, Some(e)) => e,
    };
    let (file, len) = open_inside(dir, name)?;
    if len > quality::MAX_BYTES {
        return Err(VerifyFailure::new(
            name,
            "size",
            format!(
                "{len} bytes; a quality file may have at most {}",
                quality::MAX_BYTES
            ),
        ));
    }
    let bytes = read_capped(file, quality::MAX_BYTES).map_err(|e| VerifyFailure::io(name, &e))?;
    let sha = sha256_hex(&bytes);
    if entry.path != name || sha != entry.sha256 || bytes.len() as u64 != entry.bytes {
        return Err(VerifyFailure::new(
            name,
            "sha256",
            format!(
                "{sha} ({} bytes) on disk, {} lists {} ({} bytes) for {:?}",
                bytes.len(),
                receipt::FILE_NAME,
                entry.sha256,
                entry.bytes,
                entry.path
            ),
        ));
    }
    let q = Quality::parse(&bytes).map_err(|e| VerifyFailure::new(name, "", e))?;
    if q.manifest_sha256 != manifest_sha {
        return Err(VerifyFailure::new(
            name,
            "manifest_sha256",
            format!(
                "measured the manifest {}, this install's is {manifest_sha} (the install \
                 changed after the measurement)",
                q.manifest_sha256
            ),
        ));
    }
    Ok(Some((entry, q)))
}

/// The install's recorded quality result as `gturbo run` reads it: the manifest's
/// SHA-256 and the receipt, then [`check_quality`]. Small reads only.
pub fn recorded_quality(dir: &Path) -> Result<Option<Quality>, VerifyFailure> {
    let (bytes, _) = read_manifest(dir)?;
    let r = read_receipt(dir)?;
    Ok(check_quality(dir, &sha256_hex(&bytes), r.as_ref())?.map(|(_, q)| q))
}

/// Record `q` as the install's quality result (`gturbo eval --record`), by the rule
/// FORMAT.md states: the install must have a receipt naming the manifest on disk
/// (which `q.manifest_sha256` must be too); `quality.json` is written atomically, then
/// the receipt is rewritten with every field as it was and `quality` set to the new
/// file's path, size and SHA-256. A result already recorded is replaced.
pub fn record_quality(dir: &Path, q: &Quality) -> Result<(), VerifyFailure> {
    let (bytes, _) = read_manifest(dir)?;
    let sha = sha256_hex(&bytes);
    let Some(mut r) = read_receipt(dir)? else {
        return Err(VerifyFailure::new(
            receipt::FILE_NAME,
            "",
            "missing: a quality result is recorded in the receipt (run `gturbo verify-install` first)",
        ));
    };
    if r.manifest_sha256 != sha || q.manifest_sha256 != sha {
        return Err(VerifyFailure::new(
            receipt::FILE_NAME,
            "manifest_sha256",
            format!(
                "the receipt names {}, the measurement {}, the manifest on disk is {sha} \
                 (run `gturbo verify-install`, then measure again)",
                r.manifest_sha256, q.manifest_sha256
            ),
        ));
    }
    let name = quality::FILE_NAME;
    let body = q.to_canonical_bytes();
    let tmp = dir.join(format!("{name}.tmp-{}", std::process::id()));
    let result = (|| -> io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        f.write_all(&body)?;
        f.sync_all()?;
        std::fs::rename(&tmp, dir.join(name))?;
        File::open(dir)?.sync_all()
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(VerifyFailure::new(name, "", format!("cannot write: {e}")));
    }
    r.quality = Some(ReceiptFile {
        path: name.into(),
        bytes: body.len() as u64,
        sha256: sha256_hex(&body),
    });
    write_receipt_file(dir, &r)
}
