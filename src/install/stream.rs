//! The executor's *stream* stage: every read still to do is fetched, its bytes fed
//! through the transforms in bounded tiles and written at their planned offsets, the
//! touched files fsynced, and the read journaled with the digest of what it wrote.
//!
//! A read's digest is derived from the bytes it wrote, per tensor segment and per
//! output stream (weights, scales, biases) in row order, so [`digest_on_disk`]
//! recomputes it from the files alone: that is how the *resume* stage tells an intact
//! journaled read from a damaged one.

use std::collections::BTreeSet;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};

use crate::format::Scheme;
use crate::plan::placement::TensorPlacement;
use crate::plan::{Plan, RangeRead};
use futures_util::StreamExt;

use crate::source::{RangeSource, SourceError};
use crate::transform::quant::{self, Spec};

use super::execute::{ExecuteOptions, InstallReporter};
use super::journal::Journal;
use super::source_hash::ResumableSha256;
use super::stage::OutputFiles;
use super::{InstallError, io_err};

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
            // A pre-quantized part: its bytes are its stream's, unchanged.
            _ if p.stream.is_some() => {
                let k = p.stream.unwrap_or(0);
                self.out[k].clear();
                self.out[k].extend_from_slice(&self.tile);
            }
            Scheme::Passthrough => {
                if let Some(i) = crate::transform::first_non_finite(&self.tile, t.dtype) {
                    let per_row = p.src_row_bytes / t.dtype.size();
                    return Err(InstallError::NonFinite {
                        shard: self.plan.shards[t.shard].path.clone(),
                        tensor: t.name.clone(),
                        element: self.tile_row0 * per_row + i as u64,
                    });
                }
                self.out[0].clear();
                self.out[0].extend_from_slice(&self.tile);
            }
            Scheme::Affine(affine) => {
                let spec = Spec::from_affine(affine);
                for (buf, per) in self.out.iter_mut().zip([ow, os, ob]) {
                    buf.clear();
                    buf.resize((per * n) as usize, 0);
                }
                let [w, s, b] = &mut self.out;
                quant::quantize_rows_le_bytes(&self.tile, p.cols as usize, spec, w, s, b).map_err(
                    |e| match e {
                        quant::QuantError::NonFinite { index } => InstallError::NonFinite {
                            shard: self.plan.shards[t.shard].path.clone(),
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
        for stream in (0..3).filter(|&k| p.writes(k)) {
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

/// Every tensor's placement, in plan order (`None` for excluded tensors).
pub(super) fn placements(plan: &Plan) -> Vec<Option<TensorPlacement>> {
    plan.tensors
        .iter()
        .map(|t| TensorPlacement::new(plan, t))
        .collect()
}

/// The digest a read's bytes on disk should have, recomputed from the files.
pub(super) fn digest_on_disk(
    plan: &Plan,
    placements: &[Option<TensorPlacement>],
    out: &OutputFiles,
    read: &RangeRead,
) -> Result<String, InstallError> {
    let (files, paths) = (&out.files, &out.paths);
    let mut digest = Sha256::new();
    let mut buf = Vec::new();
    for seg in segments(plan, placements, read) {
        let Some(p) = &placements[seg.tensor] else {
            continue;
        };
        for stream in 0..3 {
            let mut h = Sha256::new();
            // A stream the tensor does not write hashes as empty, as the writer's does.
            let runs = if p.writes(stream) {
                runs(p, seg.row0, seg.row1, stream)
            } else {
                Vec::new()
            };
            for (file, off, len, _) in runs {
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

/// Reads done one after another: one read, or a verified shard's reads in order.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Job {
    /// Index into the plan's shards.
    pub shard: usize,
    /// (read index, whether its bytes feed the shard hash).
    pub steps: Vec<(usize, bool)>,
    /// Hash state before the first hashed step (verified shards).
    pub start_hash: Option<ResumableSha256>,
}

#[derive(Default)]
struct Counters {
    reads: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    shards_verified: AtomicU64,
}

/// What the stream stage did in this run.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Streamed {
    /// Reads fetched.
    pub reads: u64,
    /// Source bytes fetched.
    pub bytes_read: u64,
    /// Output bytes written.
    pub bytes_written: u64,
    /// Shards whose SHA-256 was checked end to end.
    pub shards_verified: u64,
}

/// Everything the jobs share.
pub(super) struct JobContext {
    source: Arc<dyn RangeSource>,
    plan: Plan,
    placements: Vec<Option<TensorPlacement>>,
    files: Vec<File>,
    paths: Vec<PathBuf>,
    journal: std::sync::Mutex<Journal>,
    counters: Counters,
    /// Source bytes per transform tile (at least 1).
    tile: usize,
    /// Test hook: exit after this many reads are journaled in this run.
    abort_after: Option<u64>,
}

impl JobContext {
    /// The context for streaming `plan` into `out`, journaling into `journal`.
    pub fn new(
        source: Arc<dyn RangeSource>,
        plan: &Plan,
        placements: Vec<Option<TensorPlacement>>,
        out: OutputFiles,
        journal: Journal,
        options: &ExecuteOptions,
    ) -> JobContext {
        JobContext {
            source,
            plan: plan.clone(),
            placements,
            files: out.files,
            paths: out.paths,
            journal: std::sync::Mutex::new(journal),
            counters: Counters::default(),
            tile: options.tile_bytes.max(1),
            abort_after: options.abort_after_reads,
        }
    }
}

/// Run `jobs`, `parallel` at a time, each on its own task so the transforms of
/// different jobs run on different cores; reports each read as it completes.
///
/// The tasks belong to a [`tokio::task::JoinSet`]: on the first error every other task
/// is aborted and awaited before this returns. Before, the failed install returned
/// while other read tasks ran on: a task inside `block_in_place` (a transform, an
/// fsync) has given its worker back, so the runtime's shutdown did not wait for it,
/// and when it came back and polled its body's read timer, tokio panicked ("A Tokio
/// 1.x context was found, but it is being shutdown", issue 13, item 1). Now no read
/// outlives the install.
pub(super) async fn run(
    ctx: JobContext,
    jobs: Vec<Job>,
    parallel: usize,
    reporter: &dyn InstallReporter,
) -> Result<Streamed, InstallError> {
    let ctx = Arc::new(ctx);
    let limit = parallel.max(1);
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
    outcome?;
    let c = &ctx.counters;
    Ok(Streamed {
        reads: c.reads.load(Ordering::Relaxed),
        bytes_read: c.bytes_read.load(Ordering::Relaxed),
        bytes_written: c.bytes_written.load(Ordering::Relaxed),
        shards_verified: c.shards_verified.load(Ordering::Relaxed),
    })
}

/// Run one job; returns the source bytes of each read it completed.
async fn run_job(ctx: &JobContext, job: Job) -> Result<Vec<u64>, InstallError> {
    let plan = &ctx.plan;
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
                j.discard_shard(job.shard)?;
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
    let plan = &ctx.plan;
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
