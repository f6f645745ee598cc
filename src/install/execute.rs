//! The install's back half: stream every planned read through the transforms into
//! positional writes under `<out>.partial/`, journal each completed read durably,
//! then hash, write the manifest last, and publish by an atomic rename.
//!
//! # Memory
//! Each read in flight holds one tile of source rows and its transformed output
//! (`tile_bytes` each, set by `--tile-kib`), never a tensor or a shard: memory is
//! O(jobs × tile).
//!
//! # Crash safety and resume
//! Beside the staging directory live `<out>.partial.journal` (JSON lines: the plan
//! fingerprint, then one `{"read", "digest"}` line per completed read) and
//! `<out>.partial.lock` (an exclusive lock held for the whole install). A read counts
//! as done only after its output bytes are fsynced and its journal line is fsynced.
//! The digest of a read is derived from the bytes it wrote (per tensor segment and
//! per output stream, in row order), so a rerun re-derives it from the disk: intact
//! reads are kept, damaged or missing ones are fetched again. A journal written for
//! another plan fingerprint is refused (or discarded with `--discard-partial`).

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use futures_util::StreamExt;
use sha2::{Digest, Sha256};

use crate::format::Scheme;
use crate::format::manifest::{
    self, Manifest, ManifestArch, ManifestFile, ManifestResident, ManifestSource, ManifestTool,
    QuantizedAtInstall,
};
use crate::format::receipt::{self, Prover, Receipt, ReceiptFile, ReceiptSource};
use crate::format::resident::MAGIC;
use crate::plan::placement::{TensorPlacement, output_file_paths};
use crate::plan::{Dest, Plan, QuantMode, RangeRead};
use crate::source::{RangeSource, SourceError};
use crate::transform::quant::{self, Bits};

use super::source_hash::ResumableSha256;

use super::{InstallError, Prepared};

/// Largest tokenizer/config file copied.
const MAX_COPIED_BYTES: u64 = 512 << 20;

/// Settings of the executor.
#[derive(Debug, Clone)]
pub struct ExecuteOptions {
    /// The final `.gturbo` directory.
    pub out: PathBuf,
    /// Reads in flight.
    pub jobs: usize,
    /// Source bytes per transform tile (rounded to whole rows, at least one row).
    pub tile_bytes: usize,
    /// Throw away a partial install instead of resuming it.
    pub discard_partial: bool,
    /// Replace an existing output directory.
    pub overwrite: bool,
    /// Test hook: stop (as if killed) after this many reads complete in this run.
    pub abort_after_reads: Option<u64>,
}

/// What the executor did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ExecuteSummary {
    /// Reads in the plan.
    pub reads_total: u64,
    /// Reads found intact in the journal and kept.
    pub reads_kept: u64,
    /// Reads fetched in this run.
    pub reads_fetched: u64,
    /// Journaled reads whose bytes on disk no longer matched (fetched again).
    pub reads_damaged: u64,
    /// Source bytes fetched in this run.
    pub bytes_read: u64,
    /// Output bytes written in this run (weights files).
    pub bytes_written: u64,
    /// Source shards whose SHA-256 was checked end to end in this run.
    pub shards_verified: u64,
    /// Wall time.
    pub elapsed_s: f64,
}

/// Progress callbacks; the CLI draws them.
pub trait InstallReporter: Send + Sync {
    /// A phase starts (`resume-check`, `stream`, `tokenizer`, `hash`, `publish`).
    fn phase(&self, name: &str, detail: &str);
    /// A read finished: its source bytes.
    fn read_done(&self, bytes: u64);
    /// Before streaming: source bytes of the reads kept from a previous run, so
    /// progress starts where that run left off.
    fn bytes_kept(&self, _bytes: u64) {}
}

/// Reporter that shows nothing.
pub struct NoReport;
impl InstallReporter for NoReport {
    fn phase(&self, _: &str, _: &str) {}
    fn read_done(&self, _: u64) {}
}

fn io_err(path: &Path, e: std::io::Error) -> InstallError {
    if e.kind() == std::io::ErrorKind::StorageFull || e.raw_os_error() == Some(28) {
        return InstallError::NoSpace {
            path: path.display().to_string(),
        };
    }
    InstallError::Io {
        path: path.display().to_string(),
        source: e,
    }
}

fn with_suffix(out: &Path, suffix: &str) -> PathBuf {
    let mut s = out.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// One tensor's rows inside one read.
#[derive(Debug, Clone)]
struct Segment {
    tensor: usize,
    /// Absolute source offset of the first byte.
    src_start: u64,
    row0: u64,
    row1: u64,
}

fn segments(plan: &Plan, placements: &[Option<TensorPlacement>], read: &RangeRead) -> Vec<Segment> {
    let mut out = Vec::new();
    for (ti, t) in plan.tensors.iter().enumerate() {
        if t.shard != read.shard {
            continue;
        }
        let Some(p) = &placements[ti] else { continue };
        let s = t.src[0].max(read.start);
        let e = t.src[1].min(read.end);
        if s >= e {
            continue;
        }
        let row0 = (s - t.src[0]) / p.src_row_bytes;
        let row1 = (e - t.src[0]).div_ceil(p.src_row_bytes);
        out.push(Segment {
            tensor: ti,
            src_start: s,
            row0,
            row1,
        });
    }
    out
}

/// Contiguous output runs `(file, offset, len, first_row)` of one stream (0 weights,
/// 1 scales, 2 biases) for rows `row0..row1`.
fn runs(p: &TensorPlacement, row0: u64, row1: u64, stream: usize) -> Vec<(usize, u64, u64, u64)> {
    let len = [p.out_row.0, p.out_row.1, p.out_row.2][stream];
    let mut v: Vec<(usize, u64, u64, u64)> = Vec::new();
    if len == 0 {
        return v;
    }
    for r in row0..row1 {
        let d = p.row(r);
        let off = [d.weights, d.scales, d.biases][stream];
        match v.last_mut() {
            Some(last) if last.0 == d.file && last.1 + last.2 == off => last.2 += len,
            _ => v.push((d.file, off, len, r)),
        }
    }
    v
}

/// Streams one read's bytes through the transforms into the output files.
struct ReadWriter<'a> {
    plan: &'a Plan,
    placements: &'a [Option<TensorPlacement>],
    files: &'a [File],
    paths: &'a [PathBuf],
    segs: Vec<Segment>,
    seg: usize,
    /// Absolute source position of the next byte.
    pos: u64,
    tile: Vec<u8>,
    tile_row0: u64,
    tile_rows: u64,
    out: [Vec<u8>; 3],
    hashers: [Sha256; 3],
    digest: Sha256,
    touched: BTreeSet<usize>,
    written: u64,
}

impl<'a> ReadWriter<'a> {
    fn feed(&mut self, mut chunk: &[u8], tile_bytes: usize) -> Result<(), InstallError> {
        while !chunk.is_empty() {
            let Some(seg) = self.segs.get(self.seg).cloned() else {
                // Bytes after the last segment (excluded tensors read for the hash).
                self.pos += chunk.len() as u64;
                return Ok(());
            };
            if self.pos < seg.src_start {
                let skip = ((seg.src_start - self.pos) as usize).min(chunk.len());
                chunk = &chunk[skip..];
                self.pos += skip as u64;
                continue;
            }
            let p = self.placements[seg.tensor]
                .as_ref()
                .ok_or_else(|| InstallError::Internal("segment without placement".into()))?;
            if self.tile.is_empty() && self.tile_rows == 0 {
                self.tile_row0 =
                    (self.pos - self.plan.tensors[seg.tensor].src[0]) / p.src_row_bytes;
                self.tile_rows =
                    ((tile_bytes as u64 / p.src_row_bytes).max(1)).min(seg.row1 - self.tile_row0);
            }
            let want = (self.tile_rows * p.src_row_bytes) as usize - self.tile.len();
            let take = want.min(chunk.len());
            self.tile.extend_from_slice(&chunk[..take]);
            chunk = &chunk[take..];
            self.pos += take as u64;
            if self.tile.len() as u64 == self.tile_rows * p.src_row_bytes {
                self.flush_tile(&seg)?;
                if self.tile_row0 >= seg.row1 {
                    self.finish_segment();
                }
            }
        }
        Ok(())
    }

    fn flush_tile(&mut self, seg: &Segment) -> Result<(), InstallError> {
        let t = &self.plan.tensors[seg.tensor];
        let p = self.placements[seg.tensor]
            .as_ref()
            .ok_or_else(|| InstallError::Internal("segment without placement".into()))?;
        let n = self.tile_rows;
        let (ow, os, ob) = p.out_row;
        match p.scheme {
            Scheme::Passthrough => {
                self.out[0].clear();
                self.out[0].extend_from_slice(&self.tile);
            }
            scheme => {
                let bits = if scheme == Scheme::Int4G64 {
                    Bits::Four
                } else {
                    Bits::Eight
                };
                for (buf, per) in self.out.iter_mut().zip([ow, os, ob]) {
                    buf.clear();
                    buf.resize((per * n) as usize, 0);
                }
                let [w, s, b] = &mut self.out;
                quant::quantize_rows_le_bytes(&self.tile, p.cols as usize, bits, w, s, b).map_err(
                    |e| match e {
                        quant::QuantError::NonFinite { index } => InstallError::NonFinite {
                            tensor: t.name.clone(),
                            element: self.tile_row0 * p.cols + index as u64,
                        },
                        other => InstallError::Transform {
                            tensor: t.name.clone(),
                            detail: other.to_string(),
                        },
                    },
                )?;
            }
        }
        for stream in 0..3 {
            let per = [ow, os, ob][stream];
            for (file, off, len, first) in runs(p, self.tile_row0, self.tile_row0 + n, stream) {
                let at = ((first - self.tile_row0) * per) as usize;
                let bytes = &self.out[stream][at..at + len as usize];
                self.files[file]
                    .write_all_at(bytes, off)
                    .map_err(|e| io_err(&self.paths[file], e))?;
                self.hashers[stream].update(bytes);
                self.touched.insert(file);
                self.written += len;
            }
        }
        self.tile.clear();
        self.tile_row0 += n;
        self.tile_rows = 0;
        Ok(())
    }

    fn finish_segment(&mut self) {
        for h in &mut self.hashers {
            let d = std::mem::take(h).finalize();
            self.digest.update(d);
        }
        self.seg += 1;
        self.tile_rows = 0;
    }
}

/// The digest a read's bytes on disk should have, recomputed from the files.
fn digest_on_disk(
    plan: &Plan,
    placements: &[Option<TensorPlacement>],
    files: &[File],
    paths: &[PathBuf],
    read: &RangeRead,
) -> Result<String, InstallError> {
    let mut digest = Sha256::new();
    let mut buf = Vec::new();
    for seg in segments(plan, placements, read) {
        let Some(p) = &placements[seg.tensor] else {
            continue;
        };
        for stream in 0..3 {
            let mut h = Sha256::new();
            for (file, off, len, _) in runs(p, seg.row0, seg.row1, stream) {
                buf.resize(len as usize, 0);
                files[file]
                    .read_exact_at(&mut buf, off)
                    .map_err(|e| io_err(&paths[file], e))?;
                h.update(&buf);
            }
            digest.update(h.finalize());
        }
    }
    Ok(hex::encode(digest.finalize()))
}

/// One journaled read.
#[derive(Debug, Clone)]
struct Done {
    read: usize,
    digest: String,
    /// The shard's hash state after this read (verified shards only).
    sha: Option<ResumableSha256>,
}

struct Journal {
    path: PathBuf,
    file: File,
}

impl Journal {
    /// Open or create; returns completed reads, minus those of discarded shards.
    fn open(
        path: &Path,
        fingerprint: &str,
        discard: bool,
        shard_of: impl Fn(usize) -> Option<usize>,
    ) -> Result<(Journal, Vec<Done>), InstallError> {
        let mut done: Vec<Done> = Vec::new();
        if path.exists() && !discard {
            let f = File::open(path).map_err(|e| io_err(path, e))?;
            let mut lines = BufReader::new(f).lines();
            let head: serde_json::Value = match lines.next() {
                Some(Ok(l)) => serde_json::from_str(&l).unwrap_or(serde_json::Value::Null),
                _ => serde_json::Value::Null,
            };
            let theirs = head
                .get("fingerprint")
                .and_then(|v| v.as_str())
                .unwrap_or("");
            if !theirs.is_empty() && theirs != fingerprint {
                return Err(InstallError::PlanChanged {
                    journal: path.display().to_string(),
                    theirs: theirs.to_string(),
                    ours: fingerprint.to_string(),
                });
            }
            if !theirs.is_empty() {
                for l in lines.map_while(Result::ok) {
                    // A torn last line (a crash mid-append) simply does not count.
                    let Ok(v) = serde_json::from_str::<serde_json::Value>(&l) else {
                        continue;
                    };
                    if let Some(s) = v.get("discard_shard").and_then(|s| s.as_u64()) {
                        done.retain(|d| shard_of(d.read) != Some(s as usize));
                        continue;
                    }
                    if let (Some(r), Some(d)) = (
                        v.get("read").and_then(|r| r.as_u64()),
                        v.get("digest").and_then(|d| d.as_str()),
                    ) {
                        let sha = v
                            .get("sha")
                            .and_then(|h| serde_json::from_value(h.clone()).ok());
                        done.push(Done {
                            read: r as usize,
                            digest: d.to_string(),
                            sha,
                        });
                    }
                }
                let file = OpenOptions::new()
                    .append(true)
                    .open(path)
                    .map_err(|e| io_err(path, e))?;
                return Ok((
                    Journal {
                        path: path.to_path_buf(),
                        file,
                    },
                    done,
                ));
            }
        }
        let mut file = File::create(path).map_err(|e| io_err(path, e))?;
        let head = serde_json::json!({ "journal": "gturbo-install", "version": 1, "fingerprint": fingerprint });
        writeln!(file, "{head}").map_err(|e| io_err(path, e))?;
        file.sync_all().map_err(|e| io_err(path, e))?;
        Ok((
            Journal {
                path: path.to_path_buf(),
                file,
            },
            done,
        ))
    }

    fn append(&mut self, line: serde_json::Value) -> Result<(), InstallError> {
        writeln!(self.file, "{line}").map_err(|e| io_err(&self.path, e))?;
        self.file.sync_data().map_err(|e| io_err(&self.path, e))
    }

    fn record(
        &mut self,
        read: usize,
        digest: &str,
        sha: Option<&ResumableSha256>,
    ) -> Result<(), InstallError> {
        let mut line = serde_json::json!({ "read": read, "digest": digest });
        if let Some(h) = sha {
            line["sha"] = serde_json::to_value(h).unwrap_or(serde_json::Value::Null);
        }
        self.append(line)
    }
}

fn sha256_file(path: &Path) -> Result<String, InstallError> {
    let mut f = File::open(path).map_err(|e| io_err(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| io_err(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

/// Bytes kept free beyond what the install still needs: 1 % of the output, at least
/// 64 MiB (filesystems misbehave when full, and other programs need room too).
fn space_reserve(total: u64) -> u64 {
    (total / 100).max(64 << 20)
}

/// Refuse to start writing when the output's filesystem cannot hold what remains.
fn space_preflight(
    staging: &Path,
    files: &[File],
    paths: &[PathBuf],
    total: u64,
) -> Result<(), InstallError> {
    if std::env::var_os(crate::env::GTURBO_TEST_SKIP_SPACE_CHECK).is_some() {
        return Ok(());
    }
    use std::os::unix::fs::MetadataExt;
    let mut allocated = 0u64;
    for (f, p) in files.iter().zip(paths) {
        allocated += f.metadata().map_err(|e| io_err(p, e))?.blocks() * 512;
    }
    let remaining = total.saturating_sub(allocated);
    let available = fs4::available_space(staging).map_err(|e| io_err(staging, e))?;
    let needed = remaining + space_reserve(total);
    if available < needed {
        return Err(InstallError::NotEnoughSpace {
            path: staging.display().to_string(),
            needed,
            available,
        });
    }
    Ok(())
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), InstallError> {
    let mut f = File::create(path).map_err(|e| io_err(path, e))?;
    f.write_all(bytes).map_err(|e| io_err(path, e))?;
    f.sync_all().map_err(|e| io_err(path, e))
}

fn sync_dir(path: &Path) -> Result<(), InstallError> {
    File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_err(path, e))
}

/// Reads done one after another: one read, or a verified shard's reads in order.
struct Job {
    shard: usize,
    /// (read index, whether its bytes feed the shard hash).
    steps: Vec<(usize, bool)>,
    /// Hash state before the first hashed step (verified shards).
    start_hash: Option<ResumableSha256>,
}

#[derive(Default)]
struct Counters {
    reads: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    shards_verified: AtomicU64,
}

struct JobContext {
    source: Arc<dyn RangeSource>,
    plan: Arc<Plan>,
    placements: Arc<Vec<Option<TensorPlacement>>>,
    files: Arc<Vec<File>>,
    paths: Arc<Vec<PathBuf>>,
    journal: Arc<std::sync::Mutex<Journal>>,
    counters: Arc<Counters>,
    tile: usize,
    abort_after: Option<u64>,
}

/// Run `jobs`, at most `limit` at once, each on its own task (so transforms of
/// different jobs run on different cores), reporting each completed read.
///
/// The tasks belong to a [`tokio::task::JoinSet`]: on the first error every other task
/// is aborted and awaited before this returns. Before, the failed install returned
/// while other read tasks ran on: a task inside `block_in_place` (a transform, an
/// fsync) has given its worker back, so the runtime's shutdown did not wait for it,
/// and when it came back and polled its body's read timer, tokio panicked ("A Tokio
/// 1.x context was found, but it is being shutdown", issue 13, item 1). Now no read
/// outlives the install.
async fn run_jobs(
    ctx: &Arc<JobContext>,
    jobs: Vec<Job>,
    limit: usize,
    reporter: &dyn InstallReporter,
) -> Result<(), InstallError> {
    let mut waiting = jobs.into_iter();
    let mut running = tokio::task::JoinSet::new();
    let mut outcome = Ok(());
    loop {
        while running.len() < limit {
            let Some(job) = waiting.next() else { break };
            let ctx = ctx.clone();
            running.spawn(async move { run_job(&ctx, job).await });
        }
        let Some(joined) = running.join_next().await else {
            break;
        };
        match joined {
            Ok(Ok(sizes)) => sizes.into_iter().for_each(|n| reporter.read_done(n)),
            Ok(Err(e)) => {
                outcome = Err(e);
                break;
            }
            Err(e) => {
                outcome = Err(InstallError::Internal(format!("read task failed: {e}")));
                break;
            }
        }
    }
    // Abort what still runs and wait until every task has stopped.
    running.shutdown().await;
    outcome
}

/// Run one job; returns the source bytes of each read it completed.
async fn run_job(ctx: &JobContext, job: Job) -> Result<Vec<u64>, InstallError> {
    let plan = &*ctx.plan;
    let mut hash = job.start_hash;
    let mut sizes = Vec::new();
    for (ri, hashed) in job.steps {
        let read = &plan.reads[ri];
        // One attempt: the source's retry budget already covers every request and
        // resumption of this read (HTTP: backoff, Retry-After, progress deadlines).
        // Retrying the whole read here would multiply that budget and re-request at
        // once after a refusal such as a Retry-After over the limit (issue 13, item 7).
        let mut after = if hashed { hash.clone() } else { None };
        let digest = fetch_read(ctx, ri, after.as_mut()).await?;
        if hashed {
            hash = after;
        }
        let journaled_hash =
            if plan.options.verify_source && plan.shards[job.shard].sha256.is_some() {
                hash.as_ref()
            } else {
                None
            };
        {
            let mut j = ctx.journal.lock().unwrap_or_else(|p| p.into_inner());
            j.record(ri, &digest, journaled_hash)?;
            // Counted under the journal lock so the count equals the journal's lines
            // at any moment; the test hook below relies on it.
            let n = ctx.counters.reads.fetch_add(1, Ordering::Relaxed) + 1;
            if ctx.abort_after == Some(n) {
                // Test hook: behave like a kill right after the n-th durable journal
                // line. Exiting with the lock held keeps another job from adding one.
                std::process::exit(137);
            }
        }
        sizes.push(read.end - read.start);
    }
    if let (Some(h), Some(expected)) = (&hash, &plan.shards[job.shard].sha256) {
        let shard = &plan.shards[job.shard];
        if h.len() == shard.size {
            let computed = h.finalize_hex();
            if computed != *expected {
                let mut j = ctx.journal.lock().unwrap_or_else(|p| p.into_inner());
                j.append(serde_json::json!({ "discard_shard": job.shard }))?;
                return Err(InstallError::SourceHashMismatch {
                    shard: shard.path.clone(),
                    expected: expected.clone(),
                    computed,
                });
            }
            ctx.counters.shards_verified.fetch_add(1, Ordering::Relaxed);
        }
    }
    Ok(sizes)
}

/// Fetch one read, transform and write it, fsync what it touched; returns its digest.
async fn fetch_read(
    ctx: &JobContext,
    ri: usize,
    mut hash: Option<&mut ResumableSha256>,
) -> Result<String, InstallError> {
    let plan = &*ctx.plan;
    let read = &plan.reads[ri];
    let shard = &plan.shards[read.shard].path;
    let mut w = ReadWriter {
        plan,
        placements: &ctx.placements,
        files: &ctx.files,
        paths: &ctx.paths,
        segs: segments(plan, &ctx.placements, read),
        seg: 0,
        pos: read.start,
        tile: Vec::new(),
        tile_row0: 0,
        tile_rows: 0,
        out: [Vec::new(), Vec::new(), Vec::new()],
        hashers: Default::default(),
        digest: Sha256::new(),
        touched: BTreeSet::new(),
        written: 0,
    };
    let mut body = ctx.source.stream_range(shard, read.start..read.end).await?;
    while let Some(chunk) = body.next().await {
        let chunk = chunk?;
        ctx.counters
            .bytes_read
            .fetch_add(chunk.len() as u64, Ordering::Relaxed);
        if let Some(h) = hash.as_deref_mut() {
            h.update(&chunk);
        }
        tokio::task::block_in_place(|| w.feed(&chunk, ctx.tile))?;
    }
    if w.pos != read.end {
        return Err(SourceError::BadRange {
            path: shard.clone(),
            range: read.start..read.end,
            detail: format!("stream ended at byte {}", w.pos),
        }
        .into());
    }
    let touched: Vec<usize> = w.touched.iter().copied().collect();
    tokio::task::block_in_place(|| -> Result<(), InstallError> {
        for f in touched {
            ctx.files[f]
                .sync_data()
                .map_err(|e| io_err(&ctx.paths[f], e))?;
        }
        Ok(())
    })?;
    ctx.counters
        .bytes_written
        .fetch_add(w.written, Ordering::Relaxed);
    Ok(hex::encode(w.digest.finalize()))
}

/// Run the install. Returns the summary; the `.gturbo` directory is published at
/// `options.out` on success.
pub async fn execute(
    source: Arc<dyn RangeSource>,
    prepared: &Prepared,
    options: &ExecuteOptions,
    reporter: &dyn InstallReporter,
) -> Result<ExecuteSummary, InstallError> {
    let started = Instant::now();
    let plan = &prepared.plan;
    let out = &options.out;
    if out.exists() && !options.overwrite {
        return Err(InstallError::OutputExists {
            path: out.display().to_string(),
        });
    }
    let staging = with_suffix(out, ".partial");
    let lock_path = with_suffix(out, ".partial.lock");
    let journal_path = with_suffix(out, ".partial.journal");
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| io_err(parent, e))?;
    }
    let lock = File::create(&lock_path).map_err(|e| io_err(&lock_path, e))?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            return Err(InstallError::Locked {
                path: lock_path.display().to_string(),
            });
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(io_err(&lock_path, e)),
    }
    if options.discard_partial && staging.exists() {
        std::fs::remove_dir_all(&staging).map_err(|e| io_err(&staging, e))?;
    }
    let fingerprint = plan.fingerprint();
    let (journal, done) =
        Journal::open(&journal_path, &fingerprint, options.discard_partial, |r| {
            plan.reads.get(r).map(|x| x.shard)
        })?;

    // Output files, created at their planned sizes (sparse: unwritten slack reads as zero).
    let rel = output_file_paths(plan);
    let sizes: Vec<u64> = std::iter::once(plan.outputs.resident.file_bytes)
        .chain(plan.outputs.expert_pools.iter().map(|p| p.file_bytes))
        .chain(plan.outputs.row_pools.iter().map(|p| p.file_bytes))
        .collect();
    let needed: u64 = sizes.iter().sum();
    let mut paths = Vec::new();
    let mut files = Vec::new();
    for (r, size) in rel.iter().zip(&sizes) {
        let path = staging.join(r);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
        }
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| io_err(&path, e))?;
        let len = f.metadata().map_err(|e| io_err(&path, e))?.len();
        if len != *size {
            f.set_len(*size).map_err(|e| io_err(&path, e))?;
        }
        paths.push(path);
        files.push(f);
    }
    space_preflight(
        &staging,
        &files,
        &paths,
        needed + plan.outputs.copied.iter().map(|c| c.bytes).sum::<u64>(),
    )?;

    // The resident file's head: magic, index length, index.
    {
        let r = &plan.outputs.resident;
        let mut head = Vec::with_capacity(16 + r.index_len as usize);
        head.extend_from_slice(MAGIC);
        head.extend_from_slice(&r.index_len.to_le_bytes());
        head.extend_from_slice(
            &serde_json::to_vec(&r.index).map_err(|e| InstallError::Internal(e.to_string()))?,
        );
        files[0]
            .write_all_at(&head, 0)
            .map_err(|e| io_err(&paths[0], e))?;
    }

    let placements: Vec<Option<TensorPlacement>> = plan
        .tensors
        .iter()
        .map(|t| TensorPlacement::new(plan, t))
        .collect();

    // Which reads are already done and intact?
    reporter.phase("resume-check", &format!("{} journaled reads", done.len()));
    let mut summary = ExecuteSummary {
        reads_total: plan.reads.len() as u64,
        ..Default::default()
    };
    let mut complete = vec![false; plan.reads.len()];
    let mut checkpoint: Vec<Option<ResumableSha256>> = vec![None; plan.reads.len()];
    for d in &done {
        let Some(read) = plan.reads.get(d.read) else {
            continue;
        };
        if complete[d.read] {
            continue;
        }
        checkpoint[d.read] = d.sha.clone();
        if digest_on_disk(plan, &placements, &files, &paths, read)? == d.digest {
            complete[d.read] = true;
            summary.reads_kept += 1;
        } else {
            summary.reads_damaged += 1;
        }
    }

    // Jobs: a verified shard is one job that reads it front to back, feeding a hash
    // whose state is journaled after every read; other reads are a job each.
    let verified = |si: usize| plan.options.verify_source && plan.shards[si].sha256.is_some();
    let mut jobs_list: Vec<Job> = Vec::new();
    let mut ri = 0;
    while ri < plan.reads.len() {
        let si = plan.reads[ri].shard;
        if !verified(si) {
            if !complete[ri] {
                jobs_list.push(Job {
                    shard: si,
                    steps: vec![(ri, false)],
                    start_hash: None,
                });
            }
            ri += 1;
            continue;
        }
        let end = (ri..plan.reads.len())
            .find(|&j| plan.reads[j].shard != si)
            .unwrap_or(plan.reads.len());
        // The journaled prefix carries the hash; reads after it are hashed again.
        let prefix = (ri..end).take_while(|&j| checkpoint[j].is_some()).count();
        let start_hash = if prefix > 0 {
            checkpoint[ri + prefix - 1].clone()
        } else {
            Some(ResumableSha256::default())
        };
        let mut steps = Vec::new();
        for (j, done) in complete.iter().enumerate().take(end).skip(ri) {
            let hashed = j >= ri + prefix;
            if hashed || !done {
                steps.push((j, hashed));
            }
        }
        if !steps.is_empty() || prefix == end - ri {
            jobs_list.push(Job {
                shard: si,
                steps,
                start_hash,
            });
        }
        ri = end;
    }
    let fetch_count: usize = jobs_list.iter().map(|j| j.steps.len()).sum();
    reporter.bytes_kept(
        plan.source_bytes_read().saturating_sub(
            jobs_list
                .iter()
                .flat_map(|j| &j.steps)
                .map(|&(ri, _)| plan.reads[ri].end - plan.reads[ri].start)
                .sum(),
        ),
    );
    reporter.phase(
        "stream",
        &format!("{fetch_count} reads to fetch, {} kept", summary.reads_kept),
    );

    let files = Arc::new(files);
    let paths = Arc::new(paths);
    let shared_plan = Arc::new(plan.clone());
    let placements = Arc::new(placements);
    let journal = Arc::new(std::sync::Mutex::new(journal));
    let counters = Arc::new(Counters::default());
    let ctx = Arc::new(JobContext {
        source: source.clone(),
        plan: shared_plan,
        placements,
        files,
        paths,
        journal,
        counters: counters.clone(),
        tile: options.tile_bytes.max(1),
        abort_after: options.abort_after_reads,
    });
    run_jobs(&ctx, jobs_list, options.jobs.max(1), reporter).await?;
    summary.reads_fetched = counters.reads.load(Ordering::Relaxed);
    summary.shards_verified = counters.shards_verified.load(Ordering::Relaxed);
    let bytes_read = &counters.bytes_read;
    let bytes_written = &counters.bytes_written;
    summary.bytes_read = bytes_read.load(Ordering::Relaxed);
    summary.bytes_written = bytes_written.load(Ordering::Relaxed);

    // Tokenizer and config copies.
    reporter.phase("tokenizer", &format!("{} files", plan.outputs.copied.len()));
    for c in &plan.outputs.copied {
        let bytes = source.read_file(&c.source, MAX_COPIED_BYTES).await?;
        if bytes.len() as u64 != c.bytes {
            return Err(SourceError::BadRange {
                path: c.source.clone(),
                range: 0..c.bytes,
                detail: format!(
                    "{} bytes arrived, the listing says {}",
                    bytes.len(),
                    c.bytes
                ),
            }
            .into());
        }
        let path = staging.join(&c.file);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
        }
        std::fs::write(&path, &bytes).map_err(|e| io_err(&path, e))?;
    }

    // Hash every file, write the manifest last, publish.
    reporter.phase(
        "hash",
        &format!("{} files", rel.len() + plan.outputs.copied.len()),
    );
    let mut listed: Vec<(String, String)> = rel
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let kind = if i == 0 {
                "resident"
            } else if i <= plan.outputs.expert_pools.len() {
                "experts"
            } else {
                "rows"
            };
            (r.clone(), kind.to_string())
        })
        .collect();
    listed.extend(
        plan.outputs
            .copied
            .iter()
            .map(|c| (c.file.clone(), "tokenizer".to_string())),
    );
    let hashed = tokio::task::block_in_place(|| -> Result<Vec<ManifestFile>, InstallError> {
        let mut v = Vec::new();
        for (r, kind) in &listed {
            let path = staging.join(r);
            let bytes = std::fs::metadata(&path)
                .map_err(|e| io_err(&path, e))?
                .len();
            File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(|e| io_err(&path, e))?;
            v.push(ManifestFile {
                path: r.clone(),
                bytes,
                sha256: sha256_file(&path)?,
                kind: kind.clone(),
            });
        }
        v.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(v)
    })?;
    let manifest = build_manifest(prepared, &fingerprint, hashed);
    let mpath = staging.join(manifest::FILE_NAME);
    let manifest_bytes = manifest.to_canonical_bytes();
    write_synced(&mpath, &manifest_bytes)?;
    // The receipt: this install just hashed every file it lists.
    let receipt = Receipt::new(
        Prover::Install,
        crate::format::digest::sha256_hex(&manifest_bytes),
        manifest.files.iter().map(ReceiptFile::from).collect(),
        plan.source.repo.clone(),
        plan.source.commit.clone(),
        source_shards(plan),
        std::time::SystemTime::now(),
    );
    let rpath = staging.join(receipt::FILE_NAME);
    write_synced(&rpath, &receipt.to_canonical_bytes())?;
    for dir in ["packed_experts", "ple", "tokenizer", ""] {
        let d = staging.join(dir);
        if d.is_dir() {
            sync_dir(&d)?;
        }
    }
    reporter.phase("publish", &out.display().to_string());
    if out.exists() {
        let old = with_suffix(out, &format!(".replaced-{}", std::process::id()));
        std::fs::rename(out, &old).map_err(|e| io_err(out, e))?;
        std::fs::rename(&staging, out).map_err(|e| io_err(out, e))?;
        std::fs::remove_dir_all(&old).map_err(|e| io_err(&old, e))?;
    } else {
        std::fs::rename(&staging, out).map_err(|e| io_err(out, e))?;
    }
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        sync_dir(parent)?;
    }
    let _ = std::fs::remove_file(&journal_path);
    drop(lock);
    let _ = std::fs::remove_file(&lock_path);
    summary.elapsed_s = started.elapsed().as_secs_f64();
    Ok(summary)
}

/// The receipt's record of the source: every shard with a published SHA-256 was hashed
/// end to end by the jobs (a mismatch stops the install before this point), unless
/// `--no-verify-source`.
fn source_shards(plan: &Plan) -> Vec<ReceiptSource> {
    plan.shards
        .iter()
        .map(|s| ReceiptSource {
            path: s.path.clone(),
            sha256: s.sha256.clone(),
            verified: plan.options.verify_source && s.sha256.is_some(),
        })
        .collect()
}

fn build_manifest(prepared: &Prepared, fingerprint: &str, files: Vec<ManifestFile>) -> Manifest {
    let plan = &prepared.plan;
    let (scheme, bits) = match plan.options.quant {
        QuantMode::Int4 => (Scheme::Int4G64, 4),
        QuantMode::Bf16 => (Scheme::Passthrough, 0),
    };
    let overrides = match plan.options.quant {
        QuantMode::Bf16 => Vec::new(),
        QuantMode::Int4 => prepared.family_overrides.clone(),
    };
    Manifest {
        format: manifest::FORMAT.into(),
        version: manifest::VERSION,
        minor_version: manifest::MINOR_VERSION,
        family: plan.family.clone(),
        model_id: plan.source.repo.clone(),
        source: ManifestSource {
            repo: plan.source.repo.clone(),
            revision: plan.source.revision.clone(),
            commit: plan.source.commit.clone(),
            index_sha256: plan.source.index_sha256.clone(),
        },
        arch: ManifestArch {
            model_type: plan.arch.model_type.clone(),
            axes: plan.arch.axes.clone(),
            required_axes: plan.arch.required_axes.clone(),
        },
        plan_fingerprint: fingerprint.to_string(),
        quantized_at_install: QuantizedAtInstall {
            scheme,
            bits,
            group_size: 64,
            overrides,
            parity_gate: "bit-exact with MLX 0.32.4 mx.quantize (tests/data/mlx_q4g64_golden.json)"
                .into(),
            quality_gate: None,
        },
        files,
        resident: ManifestResident {
            file: "resident.bin".into(),
            payload_start: plan.outputs.resident.payload_start,
            entries: plan.outputs.resident.index.tensors.len() as u64,
        },
        expert_pools: plan.outputs.expert_pools.clone(),
        row_pools: plan.outputs.row_pools.clone(),
        sidecars: prepared.sidecars.clone(),
        excluded_tensors: plan
            .tensors
            .iter()
            .filter(|t| matches!(t.dest, Dest::Excluded { .. }))
            .count() as u64,
        tool: ManifestTool {
            name: "gturbo".into(),
            version: env!("CARGO_PKG_VERSION").into(),
        },
    }
}
