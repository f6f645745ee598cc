//! `verify-install`: prove that a `.gturbo` directory is what its manifest says, byte
//! for byte and layout for layout, without trusting anything in it.
//!
//! The cheap level, shared with the runtime, is [`crate::format::check`] (re-exported
//! here): the manifest, the resident file's head, the tokenizer JSON files and directory
//! metadata. [`verify`] adds the SHA-256 of every file (hashed in parallel, streamed in
//! [`CHUNK`] pieces), the source hashes of the copied files, the quality record and,
//! when everything holds, rewrites the receipt.

mod hash;
mod quality;
mod receipt;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Instant;

use serde::Serialize;

pub use self::hash::{CHUNK, HashResult, VerifyProgress, hash_files};
pub use self::quality::{check_quality, record_quality, recorded_quality};
pub use self::receipt::{MAX_RECEIPT_BYTES, ReceiptOutcome, read_receipt, receipt_vouches};
use self::receipt::{check_copied, write_receipt};
use crate::format::check::read_manifest;
pub use crate::format::check::{
    MAX_TOKENIZER_JSON_BYTES, VerifyFailure, check_layout, check_manifest, open_inside,
    open_manifest, unexpected_files,
};
use crate::format::check_relative_path;
use crate::format::digest::sha256_hex;
use crate::format::manifest;
use crate::format::receipt::{self as receipt_file, Receipt, ReceiptFile};

/// Settings of a full verify.
#[derive(Clone, Copy)]
pub struct VerifyOptions<'a> {
    /// Hashing threads; 0 means the available cores.
    pub threads: usize,
    /// Rewrite `verified-install.json` when everything holds.
    pub write_receipt: bool,
    /// Progress hooks.
    pub progress: Option<&'a dyn VerifyProgress>,
}

impl Default for VerifyOptions<'_> {
    fn default() -> Self {
        VerifyOptions {
            threads: 0,
            write_receipt: true,
            progress: None,
        }
    }
}

/// The outcome of [`verify`].
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The directory verified.
    pub dir: String,
    /// Whether everything holds.
    pub ok: bool,
    /// What does not hold, in check order.
    pub failures: Vec<VerifyFailure>,
    /// Files hashed (the manifest included).
    pub files: u64,
    /// Bytes hashed.
    pub bytes: u64,
    /// Wall time in seconds.
    pub elapsed_s: f64,
    /// SHA-256 of `manifest.json`, when it could be read.
    pub manifest_sha256: Option<String>,
    /// What happened to the receipt.
    pub receipt: ReceiptOutcome,
    /// Hashing threads used.
    pub threads: usize,
}

impl Report {
    /// Hashing rate in MB/s (10^6 bytes per second).
    pub fn mb_per_s(&self) -> f64 {
        self.bytes as f64 / 1e6 / self.elapsed_s.max(1e-9)
    }

    /// `verified N files, B bytes, in T s (X MB/s)`.
    pub fn summary(&self) -> String {
        format!(
            "verified {} files, {} bytes, in {:.2} s ({:.0} MB/s)",
            self.files,
            self.bytes,
            self.elapsed_s,
            self.mb_per_s()
        )
    }
}

/// The full check: [`open_manifest`], [`check_layout`], the SHA-256 of every listed
/// file against the manifest (in parallel, `threads × CHUNK` bytes of memory), the
/// manifest's SHA-256 against the receipt's when there is one, then, when everything
/// holds, the receipt rewritten atomically.
pub fn verify(dir: &Path, opts: &VerifyOptions<'_>) -> Report {
    let started = Instant::now();
    let threads = if opts.threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        opts.threads
    };
    let mut report = Report {
        dir: dir.display().to_string(),
        ok: false,
        failures: Vec::new(),
        files: 0,
        bytes: 0,
        elapsed_s: 0.0,
        manifest_sha256: None,
        receipt: ReceiptOutcome::NotWritten,
        threads,
    };
    let (manifest_bytes, m) = match read_manifest(dir) {
        Ok(x) => x,
        Err(f) => {
            report.failures.push(f);
            report.elapsed_s = started.elapsed().as_secs_f64();
            return report;
        }
    };
    let manifest_sha = sha256_hex(&manifest_bytes);
    report.manifest_sha256 = Some(manifest_sha.clone());
    report.files = 1;
    report.bytes = manifest_bytes.len() as u64;
    report.failures = check_layout(dir, &m);
    let old_receipt = check_receipt_names_manifest(dir, &manifest_sha, &mut report);
    // A recorded quality result must be the one the receipt lists, measured on this
    // manifest; one that checks out is carried into the rewritten receipt.
    let quality_entry = match check_quality(dir, &manifest_sha, old_receipt.as_ref()) {
        Ok(q) => q.map(|(entry, _)| entry),
        Err(f) => {
            report.failures.push(f);
            None
        }
    };
    let hashes = hash_listed_files(dir, &m, threads, opts.progress, &mut report);
    // The copied files against the hashes their source published, as the receipt
    // records them: the install proved them once, this proves them again on disk.
    if let Some(r) = old_receipt
        .as_ref()
        .filter(|r| r.manifest_sha256 == manifest_sha)
    {
        report
            .failures
            .extend(check_copied(dir, &m, &r.source_copied));
    }
    report.ok = report.failures.is_empty();
    if report.ok && opts.write_receipt {
        match write_receipt(dir, &manifest_sha, hashes, old_receipt, quality_entry) {
            Ok(outcome) => report.receipt = outcome,
            Err(f) => {
                report.failures.push(f);
                report.ok = false;
            }
        }
    }
    report.elapsed_s = started.elapsed().as_secs_f64();
    report
}

/// The receipt on disk, if any, which must name this manifest: a manifest edited
/// after it was verified is caught here even where its numbers stay consistent.
/// Failures go to `report`.
fn check_receipt_names_manifest(
    dir: &Path,
    manifest_sha: &str,
    report: &mut Report,
) -> Option<Receipt> {
    let old_receipt = match read_receipt(dir) {
        Ok(r) => r,
        Err(f) => {
            report.failures.push(f);
            None
        }
    };
    if let Some(r) = &old_receipt
        && r.manifest_sha256 != manifest_sha
    {
        report.failures.push(VerifyFailure::new(
            manifest::FILE_NAME,
            "sha256",
            format!(
                "{manifest_sha} on disk, {} recorded {} (the manifest changed after it was verified)",
                receipt_file::FILE_NAME,
                r.manifest_sha256
            ),
        ));
    }
    old_receipt
}

/// Hash every listed file whose size checked out (bigger files first, so the threads
/// finish together) against the manifest, counting files and bytes in `report` and
/// adding what does not match to its failures. Returns the hashes as the receipt
/// lists them, in path order.
fn hash_listed_files(
    dir: &Path,
    m: &manifest::Manifest,
    threads: usize,
    progress: Option<&dyn VerifyProgress>,
    report: &mut Report,
) -> Vec<ReceiptFile> {
    let failed: BTreeSet<&str> = report
        .failures
        .iter()
        .filter(|f| f.at == "size" || f.at.is_empty())
        .map(|f| f.file.as_str())
        .collect();
    let mut todo: Vec<&manifest::ManifestFile> = m
        .files
        .iter()
        .filter(|f| check_relative_path(&f.path).is_ok() && !failed.contains(f.path.as_str()))
        .collect();
    todo.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.path.cmp(&b.path)));
    if let Some(p) = progress {
        p.start(todo.len() as u64, todo.iter().map(|f| f.bytes).sum::<u64>());
    }
    let paths: Vec<&str> = todo.iter().map(|f| f.path.as_str()).collect();
    let results = hash_files(dir, &paths, threads, progress);
    let mut hashes: Vec<ReceiptFile> = Vec::new();
    for (f, r) in todo.iter().zip(results) {
        match r {
            Err(e) => report.failures.push(e),
            Ok((sha, len)) => {
                report.files += 1;
                report.bytes += len;
                if len != f.bytes {
                    report.failures.push(VerifyFailure::new(
                        &f.path,
                        "size",
                        format!(
                            "{len} bytes read, the manifest lists {} (changed during the check)",
                            f.bytes
                        ),
                    ));
                } else if sha != f.sha256 {
                    report.failures.push(VerifyFailure::new(
                        &f.path,
                        "sha256",
                        format!("{sha} on disk, the manifest lists {}", f.sha256),
                    ));
                }
                hashes.push(ReceiptFile {
                    path: f.path.clone(),
                    bytes: len,
                    sha256: sha,
                });
            }
        }
    }
    hashes.sort_by(|a, b| a.path.cmp(&b.path));
    hashes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::manifest::Manifest;

    /// The seed manifest of the fuzz script, in a directory with files of its sizes.
    fn manifest() -> Manifest {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../scripts/fuzz.sh"
        ))
        .unwrap();
        let start = text.find("<<'JSON'\n").unwrap() + 8;
        let end = text[start..].find("\nJSON\n").unwrap() + start;
        Manifest::parse(&text.as_bytes()[start..end]).unwrap()
    }

    fn ats(f: &[VerifyFailure]) -> Vec<String> {
        f.iter().map(|f| format!("{}: {}", f.file, f.at)).collect()
    }

    #[test]
    fn the_seed_manifest_is_consistent() {
        assert_eq!(check_manifest(&manifest()), vec![]);
    }

    #[test]
    fn manifest_cross_checks_name_the_field() {
        let mut m = manifest();
        m.files[0].bytes += 1;
        m.files[1].kind = "weights".into();
        m.files[3].sha256 = "ABC".into();
        m.row_pools[0].layer = 2;
        m.expert_pools[0].sidecar = Some("mtp2".into());
        m.resident.payload_start = 100;
        let got = ats(&check_manifest(&m));
        assert_eq!(
            got,
            [
                "manifest.json: files[1].kind",
                "manifest.json: files[3].sha256",
                "manifest.json: files[0].bytes",
                "manifest.json: files[1].kind",
                "manifest.json: resident.payload_start",
                "manifest.json: expert_pools[0].file",
                "manifest.json: expert_pools[0].sidecar",
                "manifest.json: row_pools[0].file",
            ]
            .map(String::from)
            .to_vec(),
        );
    }

    #[test]
    fn unsorted_duplicate_and_reserved_paths_are_refused() {
        let mut m = manifest();
        m.files.swap(0, 1);
        m.files[3].path = "manifest.json".into();
        let got = ats(&check_manifest(&m));
        assert!(
            got.contains(&"manifest.json: files[1].path".to_string()),
            "{got:?}"
        );
        assert!(
            got.contains(&"manifest.json: files[3].path".to_string()),
            "{got:?}"
        );
        assert!(
            got.contains(&"manifest.json: files".to_string()),
            "no tokenizer left: {got:?}"
        );
        let mut m = manifest();
        m.files[2].path = "../resident.bin".into();
        let f = &check_manifest(&m)[0];
        assert_eq!(
            f.to_string(),
            "manifest.json: files[2].path: \"../resident.bin\" has a \"..\" component; paths must stay inside the directory"
        );
    }

    #[test]
    fn open_inside_never_follows_links() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().join("i");
        std::fs::create_dir_all(d.join("sub")).unwrap();
        std::fs::write(d.join("sub/a.bin"), b"abc").unwrap();
        std::fs::write(tmp.path().join("secret"), b"secret").unwrap();
        std::os::unix::fs::symlink(tmp.path().join("secret"), d.join("link")).unwrap();
        std::os::unix::fs::symlink(d.join("sub"), d.join("sublink")).unwrap();
        assert_eq!(open_inside(&d, "sub/a.bin").unwrap().1, 3);
        let e = open_inside(&d, "link").unwrap_err();
        assert_eq!(
            e.to_string(),
            "link: link is a symlink; verify-install never follows links"
        );
        let e = open_inside(&d, "sublink/a.bin").unwrap_err();
        assert_eq!(
            e.to_string(),
            "sublink/a.bin: sublink is a symlink; verify-install never follows links"
        );
        assert_eq!(
            open_inside(&d, "sub").unwrap_err().detail,
            "not a regular file"
        );
        assert_eq!(
            open_inside(&d, "sub/a.bin/x").unwrap_err().detail,
            "sub/a.bin is not a directory"
        );
        assert_eq!(open_inside(&d, "../secret").unwrap_err().at, "path");
        assert_eq!(
            open_inside(&d, "nope").unwrap_err().detail,
            "missing: listed in the manifest, not on disk"
        );
    }

    #[test]
    fn failure_lines_name_file_and_field() {
        assert_eq!(
            VerifyFailure::new("a.bin", "byte 8", "bad").to_string(),
            "a.bin: byte 8: bad"
        );
        assert_eq!(
            VerifyFailure::new("a.bin", "", "bad").to_string(),
            "a.bin: bad"
        );
    }
}
