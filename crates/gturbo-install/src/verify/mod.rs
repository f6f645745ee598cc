//! `verify-install`: prove that a `.gturbo` directory is what its manifest says, byte
//! for byte and layout for layout, without trusting anything in it.
//!
//! The cheap level, shared with the runtime, is [`crate::format::check`] (re-exported
//! here): the manifest, the resident file's head, the tokenizer JSON files and directory
//! metadata. [`verify`] adds the SHA-256 of every file (hashed in parallel, streamed in
//! [`CHUNK`] pieces), the source hashes of the copied files, the quality record and,
//! when everything holds, rewrites the receipt.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{self, Read, Write};
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Instant, SystemTime};

use serde::Serialize;
use sha2::{Digest, Sha256};

pub use crate::format::check::{
    MAX_TOKENIZER_JSON_BYTES, VerifyFailure, check_layout, check_manifest, open_inside,
    open_manifest, unexpected_files,
};
use crate::format::check::{read_capped, read_manifest};
use crate::format::check_relative_path;
use crate::format::digest::{git_blob_sha1, sha256_hex};
use crate::format::manifest::{self, MAX_MANIFEST_BYTES, Manifest};
use crate::format::quality::{self, Quality};
use crate::format::receipt::{self, Prover, Receipt, ReceiptCopied, ReceiptFile};

/// Bytes read and hashed at a time by each hashing thread: memory stays
/// `threads × CHUNK` whatever the file sizes. Small enough that the kernel's copy and
/// the hash both stay in the core's L2: on the 2-core EPYC CI host page-cache reads
/// run at 4.5 GB/s with 64–128 KiB buffers and 1 GB/s with 256 KiB or more.
pub const CHUNK: usize = 128 << 10;
/// Largest receipt read back.
pub const MAX_RECEIPT_BYTES: u64 = MAX_MANIFEST_BYTES;

/// Hooks a caller can use to show progress of a full verify.
pub trait VerifyProgress: Sync {
    /// Hashing starts: `files` files of `bytes` bytes in all.
    fn start(&self, _files: u64, _bytes: u64) {}
    /// `bytes` more bytes were hashed (called from the hashing threads).
    fn hashed(&self, _bytes: u64) {}
}

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

    // The receipt, if any, must name this manifest: a manifest edited after it was
    // verified is caught here even where its numbers stay consistent.
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
                receipt::FILE_NAME,
                r.manifest_sha256
            ),
        ));
    }

    // A recorded quality result must be the one the receipt lists, measured on this
    // manifest; one that checks out is carried into the rewritten receipt.
    let quality_entry = match check_quality(dir, &manifest_sha, old_receipt.as_ref()) {
        Ok(q) => q.map(|(entry, _)| entry),
        Err(f) => {
            report.failures.push(f);
            None
        }
    };

    // Hash every listed file whose size checked out; bigger files first so the
    // threads finish together.
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
    if let Some(p) = opts.progress {
        p.start(todo.len() as u64, todo.iter().map(|f| f.bytes).sum::<u64>());
    }
    let paths: Vec<&str> = todo.iter().map(|f| f.path.as_str()).collect();
    let results = hash_files(dir, &paths, threads, opts.progress);
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

/// Each copied file the receipt records as verified, against the git blob id or SHA-256
/// its source published. Only files the manifest lists are opened (a receipt naming
/// another path is a failure), each at most the bound the install held it to
/// ([`crate::plan::copied_max_bytes`]).
fn check_copied(dir: &Path, m: &Manifest, copied: &[ReceiptCopied]) -> Vec<VerifyFailure> {
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
        let checks = [
            (
                "source git blob id",
                &c.git_oid,
                git_blob_sha1 as fn(&[u8]) -> String,
            ),
            ("source sha256", &c.sha256, sha256_hex),
        ];
        for (at, want, hash) in checks {
            if let Some(want) = want {
                let got = hash(&bytes);
                if got != *want {
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
        }
    }
    out
}

/// A file's SHA-256 (lowercase hex) and length as read.
pub type HashResult = Result<(String, u64), VerifyFailure>;

/// The SHA-256 and length of each file `dir/rel`, in `files` order: the one file
/// hasher of gturbo (verify-install and the installer's finalize step both use it).
///
/// `threads` threads (0: the available cores) each take the next file from a shared
/// counter and stream it in [`CHUNK`] pieces, so memory is `threads × CHUNK` whatever
/// the sizes; list big files first for the threads to finish together. Each path is
/// opened with [`open_inside`] (no link followed); a file that cannot be opened or
/// read is an `Err` naming it and the byte offset.
pub fn hash_files(
    dir: &Path,
    files: &[&str],
    threads: usize,
    progress: Option<&dyn VerifyProgress>,
) -> Vec<HashResult> {
    let threads = if threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        threads
    };
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<HashResult>>> = Mutex::new(vec![None; files.len()]);
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, files.len().max(1)) {
            s.spawn(|| {
                let mut buf = vec![0u8; CHUNK];
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(f) = files.get(i) else { break };
                    let r = hash_one(dir, f, &mut buf, progress);
                    results.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(r);
                }
            });
        }
    });
    results
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(VerifyFailure::new("", "", "not hashed"))))
        .collect()
}

fn hash_one(
    dir: &Path,
    rel: &str,
    buf: &mut [u8],
    progress: Option<&dyn VerifyProgress>,
) -> HashResult {
    let (mut file, _) = open_inside(dir, rel)?;
    let mut h = Sha256::new();
    let mut len = 0u64;
    loop {
        let n = match file.read(buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(VerifyFailure::new(
                    rel,
                    format!("byte {len}"),
                    format!("read failed: {e}"),
                ));
            }
        };
        h.update(&buf[..n]);
        len += n as u64;
        if let Some(p) = progress {
            p.hashed(n as u64);
        }
    }
    Ok((hex::encode(h.finalize()), len))
}

/// Whether the receipt vouches for this install without hashing: it exists, names the
/// SHA-256 of the manifest on disk, and lists exactly the manifest's files with the
/// sizes they have on disk. This is what a runtime may accept instead of full hashing
/// when the user asks it to trust the receipt; it proves sizes, not bytes. Call it
/// after [`check_layout`] found nothing.
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
fn write_receipt(
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
fn write_receipt_file(dir: &Path, r: &Receipt) -> Result<(), VerifyFailure> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
