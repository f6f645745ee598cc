//! The executor's *stream* stage: every read still to do is fetched, its bytes fed
//! through the transforms in bounded tiles and written at their planned offsets, the
//! touched files fsynced, and the read journaled with the digest of what it wrote.
//!
//! A read's digest is derived from the bytes it wrote, per tensor segment and per
//! output stream (weights, scales, biases) in row order, so [`digest_on_disk`]
//! recomputes it from the files alone: that is how the *resume* stage tells an intact
//! journaled read from a damaged one.
//!
//! A module of a pre-quantized source installed with `--requantize` streams its packed
//! weights like any tensor; the scales and biases of the rows a read covers are fetched
//! first ([`stage`]), so each tile is dequantized and quantized again on its own. What
//! a read writes still depends on the source alone, so a resumed read rewrites the
//! same bytes.

use std::collections::BTreeSet;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};

use crate::format::Scheme;
use crate::plan::placement::{TensorPlacement, output_file_paths};
use crate::plan::{Plan, RangeRead};
use futures_util::StreamExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::source::{RangeSource, SourceError};
use crate::transform::quant::{self, Spec};

use super::autojobs::{self, Controller, Sample, Step};
use super::finished::Finished;
use super::journal::Journal;
use super::options::{ExecuteOptions, InstallReporter, Jobs};
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
    /// Scales and biases of the requantized modules this read covers ([`stage`]).
    staged: std::collections::BTreeMap<usize, Staged>,
    /// Scratch: a requantized tile dequantized to BF16 (little-endian bytes).
    deq: Vec<u8>,
}

/// One requantized module's scales and biases for the rows `row0..` one read covers,
/// as the source stores them (BF16, one per group).
struct Staged {
    row0: u64,
    scales: bytes::Bytes,
    biases: bytes::Bytes,
}

/// Fetch the scales and biases of every requantized module among `segs` (their rows
/// only), before the read's packed weights stream through. They are small next to
/// the weights (4 bytes per group against `group·bits/8`), so a read stages at most
/// half its own size (2-bit g32) and an eighth at 4-bit g64. Returns them and the
/// source bytes fetched.
async fn stage(
    ctx: &JobContext,
    segs: &[Segment],
) -> Result<(std::collections::BTreeMap<usize, Staged>, u64), InstallError> {
    let plan = &ctx.plan;
    let mut out = std::collections::BTreeMap::new();
    let mut fetched = 0u64;
    for seg in segs {
        let t = &plan.tensors[seg.tensor];
        let (Some(r), Some(Some(p))) = (&t.requant, ctx.placements.get(seg.tensor)) else {
            continue;
        };
        let per = p
            .requant
            .and_then(|a| a.row_sizes(p.cols))
            .map(|s| s.scales)
            .ok_or_else(|| InstallError::Internal(format!("{}: requant layout", t.name)))?;
        let rows = seg.row0..seg.row1;
        let scales = stage_rows(ctx, &r.scales, rows.clone(), per).await?;
        let biases = stage_rows(ctx, &r.biases, rows, per).await?;
        fetched += 2 * (seg.row1 - seg.row0) * per;
        out.insert(
            seg.tensor,
            Staged {
                row0: seg.row0,
                scales,
                biases,
            },
        );
    }
    Ok((out, fetched))
}

/// Rows `rows` (of `per` bytes each) of a staged source tensor, checked to lie inside
/// it and to come back whole.
async fn stage_rows(
    ctx: &JobContext,
    part: &crate::plan::SourcePart,
    rows: std::ops::Range<u64>,
    per: u64,
) -> Result<bytes::Bytes, InstallError> {
    let range = part.src[0] + rows.start * per..part.src[0] + rows.end * per;
    let path = &ctx.plan.shards[part.shard].path;
    if range.end > part.src[1] {
        return Err(InstallError::Internal(format!(
            "{}: staged rows past the tensor",
            part.name
        )));
    }
    let want = range.end - range.start;
    let bytes = ctx.source.read_range(path, range.clone()).await?;
    if bytes.len() as u64 != want {
        return Err(SourceError::BadRange {
            path: path.clone(),
            range,
            detail: format!("{} bytes for `{}`, not {want}", bytes.len(), part.name),
        }
        .into());
    }
    Ok(bytes)
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
            let tile_len = (self.tile_rows * p.src_row_bytes) as usize;
            if self.tile.is_empty() && chunk.len() >= tile_len {
                // The whole tile is in this piece: transform it where it lies.
                let (whole, rest) = chunk.split_at(tile_len);
                chunk = rest;
                self.pos += tile_len as u64;
                self.flush_tile(&seg, whole)?;
            } else {
                // A tile across two pieces is gathered first.
                let take = (tile_len - self.tile.len()).min(chunk.len());
                self.tile.extend_from_slice(&chunk[..take]);
                chunk = &chunk[take..];
                self.pos += take as u64;
                if self.tile.len() < tile_len {
                    continue;
                }
                let tile = std::mem::take(&mut self.tile);
                let flushed = self.flush_tile(&seg, &tile);
                self.tile = tile;
                self.tile.clear();
                flushed?;
            }
            if self.tile_row0 >= seg.row1 {
                self.finish_segment();
            }
        }
        Ok(())
    }

    /// Transform and write one tile of source rows, `src` (the tile's bytes, from the
    /// piece or gathered in `tile`).
    fn flush_tile(&mut self, seg: &Segment, src: &[u8]) -> Result<(), InstallError> {
        let t = &self.plan.tensors[seg.tensor];
        let p = self.placements[seg.tensor]
            .as_ref()
            .ok_or_else(|| InstallError::Internal("segment without placement".into()))?;
        let n = self.tile_rows;
        let (ow, os, ob) = p.out_row;
        // A requantized module's tile is packed words: dequantize it to the BF16
        // matrix `mx.dequantize` gives, which is then quantized (or kept) like a
        // BF16 source's.
        let mut deq = std::mem::take(&mut self.deq);
        if let Some(from) = p.requant {
            let st = self
                .staged
                .get(&seg.tensor)
                .ok_or_else(|| InstallError::Internal(format!("{}: not staged", t.name)))?;
            let per = from.row_sizes(p.cols).map_or(0, |s| s.scales) as usize;
            let at = (self.tile_row0 - st.row0) as usize * per;
            let len = n as usize * per;
            let (s, b) = (&st.scales[at..at + len], &st.biases[at..at + len]);
            let mut vals = vec![0u16; (n * p.cols) as usize];
            quant::dequantize_rows_bf16(
                src,
                s,
                b,
                p.cols as usize,
                Spec::from_affine(from),
                &mut vals,
            )
            .map_err(|e| InstallError::Transform {
                tensor: t.name.clone(),
                detail: format!("dequantizing: {e}"),
            })?;
            deq.clear();
            deq.extend(vals.iter().flat_map(|v| v.to_le_bytes()));
        }
        let input: &[u8] = if p.requant.is_some() { &deq } else { src };
        // A stream written straight from the input (no copy): a pre-quantized part's
        // bytes are its stream's, a passthrough tensor's its weights'.
        let mut direct: Option<(usize, &[u8])> = None;
        match (p.stream, p.scheme) {
            (Some(k), _) => direct = Some((k, src)),
            (None, Scheme::Passthrough) => {
                if let Some(i) = crate::transform::first_non_finite(input, t.dtype) {
                    return Err(InstallError::NonFinite {
                        shard: self.plan.shards[t.shard].path.clone(),
                        tensor: t.name.clone(),
                        element: self.tile_row0 * p.cols + i as u64,
                    });
                }
                direct = Some((0, input));
            }
            (None, Scheme::Affine(affine)) => {
                let spec = Spec::from_affine(affine);
                for (buf, per) in self.out.iter_mut().zip([ow, os, ob]) {
                    buf.clear();
                    buf.resize((per * n) as usize, 0);
                }
                let [w, s, b] = &mut self.out;
                quant::quantize_rows_le_bytes(input, p.cols as usize, spec, w, s, b).map_err(
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
                let produced = match direct {
                    Some((k, bytes)) if k == stream => bytes,
                    _ => &self.out[stream][..],
                };
                let bytes = &produced[at..at + len as usize];
                self.files[file]
                    .write_all_at(bytes, off)
                    .map_err(|e| io_err(&self.paths[file], e))?;
                self.hashers[stream].update(bytes);
                self.touched.insert(file);
                self.written += len;
            }
        }
        self.deq = deq;
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
#[derive(Debug, Clone, Default)]
pub(super) struct Streamed {
    /// The SHA-256 of each output file the stream finished and hashed, by output file
    /// index (`None`: hashed at publish).
    pub file_sha256: Vec<Option<String>>,
    /// Reads fetched.
    pub reads: u64,
    /// Source bytes fetched.
    pub bytes_read: u64,
    /// Output bytes written.
    pub bytes_written: u64,
    /// Shards whose SHA-256 was checked end to end.
    pub shards_verified: u64,
    /// The most sub-range requests in flight at once.
    pub connections: u64,
    /// The best throughput over one sampling interval, bytes per second.
    pub peak_bytes_per_s: f64,
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
    /// The connection and reorder-window budget every job draws on.
    pub(super) links: Arc<Links>,
    /// Output files hashed once the last read writing them is durable.
    finished: Finished,
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
        jobs: &[Job],
    ) -> JobContext {
        let finished = Finished::new(
            files_of(plan, &placements, jobs),
            out.dir.clone(),
            output_file_paths(plan),
        );
        JobContext {
            finished,
            source,
            plan: plan.clone(),
            placements,
            files: out.files,
            paths: out.paths,
            journal: std::sync::Mutex::new(journal),
            counters: Counters::default(),
            tile: options.tile_bytes.max(1),
            abort_after: options.abort_after_reads,
            links: {
                let sub_range = options
                    .sub_range_bytes
                    .unwrap_or_else(|| auto_sub_range(options.jobs.max()))
                    .max(1);
                let connections = options
                    .jobs
                    .initial()
                    .min(Links::max_connections(sub_range));
                let fixed = options.jobs != Jobs::Auto;
                Arc::new(Links::new(connections, sub_range, jobs.len(), fixed))
            },
        }
    }
}

/// The output files each read of `jobs` writes (by read index; empty for the others).
///
/// A tensor's placement lies in one file; the reads a tensor overlaps are found by a
/// binary search among its shard's reads, so this is one pass over the tensors, not
/// [`segments`] (a pass over every tensor) for every read.
fn files_of(plan: &Plan, placements: &[Option<TensorPlacement>], jobs: &[Job]) -> Vec<Vec<usize>> {
    let mut fetched = vec![false; plan.reads.len()];
    for &(ri, _) in jobs.iter().flat_map(|j| &j.steps) {
        fetched[ri] = true;
    }
    let mut by_shard: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
    for (ri, r) in plan.reads.iter().enumerate() {
        by_shard.entry(r.shard).or_default().push(ri);
    }
    for reads in by_shard.values_mut() {
        reads.sort_by_key(|&ri| plan.reads[ri].start);
    }
    let mut files = vec![Vec::new(); plan.reads.len()];
    for (t, p) in plan.tensors.iter().zip(placements) {
        let (Some(p), Some(reads)) = (p, by_shard.get(&t.shard)) else {
            continue;
        };
        let file = p.row(0).file;
        let first = reads.partition_point(|&ri| plan.reads[ri].end <= t.src[0]);
        for &ri in reads[first..]
            .iter()
            .take_while(|&&ri| plan.reads[ri].start < t.src[1])
        {
            if fetched[ri] && !files[ri].contains(&file) {
                files[ri].push(file);
            }
        }
    }
    files
}

/// Run `jobs`, `parallel` at a time, each on its own task so the transforms of
/// different jobs run on different cores; reports each read as it becomes durable
/// (a job's reads used to be reported when the whole job ended: on a capped link the
/// first progress line of a 3.4 GB install came after 13 s, with 2 % done).
///
/// The tasks belong to a [`tokio::task::JoinSet`]: on the first error every other task
/// is aborted and awaited before this returns. Before, the failed install returned
/// while other read tasks ran on: a task inside `block_in_place` (a transform, an
/// fsync) has given its worker back, so the runtime's shutdown did not wait for it,
/// and when it came back and polled its body's read timer, tokio panicked ("A Tokio
/// 1.x context was found, but it is being shutdown", issue 13, item 1). Now no read
/// outlives the install.
///
/// `beside` runs alongside the jobs (the copied files): its error ends the stream the
/// same way a job's does.
pub(super) async fn run(
    ctx: JobContext,
    jobs: Vec<Job>,
    connections: Jobs,
    reporter: &dyn InstallReporter,
    beside: impl std::future::Future<Output = Result<(), InstallError>>,
) -> Result<Streamed, InstallError> {
    let ctx = Arc::new(ctx);
    // Each job uses at least one connection: more jobs at once than connections
    // would only wait.
    let cap = Links::max_connections(ctx.links.sub_range);
    let limit = connections.max().min(cap);
    tracing::debug!(
        connections = limit,
        jobs_at_once = jobs_at_once(&ctx.links),
        "stream"
    );
    let mut grow = Grower::new(connections, &ctx, limit as u64);
    let mut tick = tokio::time::interval(autojobs::TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // What the jobs report: reads made durable, windows that requested their last.
    let (events, mut events_rx) = tokio::sync::mpsc::unbounded_channel::<JobEvent>();
    let mut sched = Scheduler::new(ctx.clone(), jobs, reporter, events);
    let mut beside = std::pin::pin!(beside);
    let mut beside_done = false;
    let mut outcome = Ok(());
    loop {
        sched.start_jobs();
        let joined = tokio::select! {
            j = sched.running.join_next() => j,
            Some(e) = events_rx.recv() => {
                sched.on_event(e);
                continue;
            }
            r = &mut beside, if !beside_done => {
                beside_done = true;
                match r {
                    Ok(()) => continue,
                    Err(e) => {
                        outcome = Err(e);
                        break;
                    }
                }
            }
            _ = tick.tick() => {
                grow.sample(&ctx);
                continue;
            }
        };
        let Some(joined) = joined else {
            break;
        };
        // Reads a job made durable just before it ended.
        while let Ok(e) = events_rx.try_recv() {
            sched.on_event(e);
        }
        if let Err(e) = sched.on_joined(joined) {
            outcome = Err(e);
            break;
        }
    }
    // Abort what still runs and wait until every task has stopped.
    sched.running.shutdown().await;
    outcome?;
    if !beside_done {
        beside.await?;
    }
    let c = &ctx.counters;
    Ok(Streamed {
        reads: c.reads.load(Ordering::Relaxed),
        bytes_read: c.bytes_read.load(Ordering::Relaxed),
        bytes_written: c.bytes_written.load(Ordering::Relaxed),
        shards_verified: c.shards_verified.load(Ordering::Relaxed),
        connections: ctx.links.peak(),
        peak_bytes_per_s: grow.peak_bytes_per_s(&ctx),
        file_sha256: ctx.finished.take(),
    })
}

/// What a job task answers: its id and how it ended.
type JobOutcome = (usize, Result<(), InstallError>);

/// The stream stage's job scheduling: which jobs wait, which still request
/// sub-ranges, which run, and what each job reports.
struct Scheduler<'r> {
    ctx: Arc<JobContext>,
    reporter: &'r dyn InstallReporter,
    /// Per job id: its shard, and whether it goes on from hash state an earlier run
    /// journaled (then a mismatch may lie in bytes that run kept, not in the source).
    started: Vec<(usize, bool)>,
    /// Jobs whose reads fetch a shard a second time: their bytes were counted once.
    again: BTreeSet<usize>,
    /// Jobs that still have sub-ranges to request. The next job starts as soon as one
    /// has requested its last, not when it ends: its last sub-ranges arriving, the
    /// consumer, the flush and the shard's hash check left connections idle between
    /// jobs (at `--jobs 4` on the capped link, 3 of 4 busy for ~0.5 s at every one).
    requesting: BTreeSet<usize>,
    waiting: std::collections::VecDeque<Job>,
    running: tokio::task::JoinSet<JobOutcome>,
    events: tokio::sync::mpsc::UnboundedSender<JobEvent>,
}

impl<'r> Scheduler<'r> {
    fn new(
        ctx: Arc<JobContext>,
        jobs: Vec<Job>,
        reporter: &'r dyn InstallReporter,
        events: tokio::sync::mpsc::UnboundedSender<JobEvent>,
    ) -> Self {
        Scheduler {
            ctx,
            reporter,
            started: Vec::new(),
            again: BTreeSet::new(),
            requesting: BTreeSet::new(),
            waiting: jobs.into(),
            running: tokio::task::JoinSet::new(),
            events,
        }
    }

    /// Start waiting jobs while fewer than [`jobs_at_once`] still request (under
    /// `--jobs auto` that rises as the connections grow), each on its own task; then
    /// tell the links how many jobs the last of the stream has.
    fn start_jobs(&mut self) {
        while self.requesting.len() < jobs_at_once(&self.ctx.links) {
            let Some(job) = self.waiting.pop_front() else {
                break;
            };
            let (ctx, events, id) = (self.ctx.clone(), self.events.clone(), self.started.len());
            let resumed = job.start_hash.as_ref().is_some_and(|h| !h.is_empty());
            self.started.push((job.shard, resumed));
            self.requesting.insert(id);
            self.running
                .spawn(async move { (id, run_job(ctx, job, id, events).await) });
        }
        let last_jobs = if self.waiting.is_empty() {
            self.requesting.len().max(1) as u64
        } else {
            0
        };
        self.ctx.links.last_jobs.store(last_jobs, Ordering::Relaxed);
    }

    /// A job's report: a durable read's bytes to the reporter (once per read, not
    /// again for a shard fetched a second time), a window that requested its last.
    fn on_event(&mut self, e: JobEvent) {
        match e {
            JobEvent::Durable(id, n) => {
                if !self.again.contains(&id) {
                    self.reporter.read_done(n);
                }
            }
            JobEvent::AllRequested(id) => {
                self.requesting.remove(&id);
            }
        }
    }

    /// A job ended: done, queued again whole (below), or the install's error.
    fn on_joined(
        &mut self,
        joined: Result<JobOutcome, tokio::task::JoinError>,
    ) -> Result<(), InstallError> {
        match joined {
            Ok((id, Ok(()))) => {
                self.requesting.remove(&id);
                Ok(())
            }
            // A shard that went on from an earlier run's hash state and does not hash to
            // its published SHA-256: the bytes kept from that run may be what is wrong
            // (a hub that served other bytes then), so the shard is fetched whole once
            // more in this run (its journal lines are discarded already). Only a fresh
            // fetch that is still wrong fails the install.
            Ok((id, Err(InstallError::SourceHashMismatch { shard, .. })))
                if self.started.get(id).is_some_and(|&(_, resumed)| resumed) =>
            {
                self.requesting.remove(&id);
                let si = self.started[id].0;
                self.reporter.phase(
                    "refetch",
                    &format!(
                        "{shard}: the pieces kept from an earlier run do not hash to its \
                         published SHA-256; fetching the whole shard again"
                    ),
                );
                let ctx = &self.ctx;
                ctx.finished
                    .forget(shard_files(&ctx.plan, &ctx.placements, si));
                self.again.insert(self.started.len());
                self.waiting.push_front(whole_shard(&ctx.plan, si));
                Ok(())
            }
            Ok((_, Err(e))) => Err(e),
            Err(e) => Err(InstallError::Internal(format!("read task failed: {e}"))),
        }
    }
}

/// Every read of shard `si`, in order, each hashed from a fresh hash state: the job
/// that fetches a shard again from its first byte.
fn whole_shard(plan: &Plan, si: usize) -> Job {
    let mut steps: Vec<usize> = (0..plan.reads.len())
        .filter(|&ri| plan.reads[ri].shard == si)
        .collect();
    steps.sort_by_key(|&ri| plan.reads[ri].start);
    Job {
        shard: si,
        steps: steps.into_iter().map(|ri| (ri, true)).collect(),
        start_hash: Some(ResumableSha256::default()),
    }
}

/// The output files shard `si`'s tensors are written to.
fn shard_files(plan: &Plan, placements: &[Option<TensorPlacement>], si: usize) -> Vec<usize> {
    let mut files: Vec<usize> = (plan.tensors.iter().zip(placements))
        .filter(|(t, _)| t.shard == si)
        .filter_map(|(_, p)| p.as_ref().map(|p| p.row(0).file))
        .collect();
    files.sort_unstable();
    files.dedup();
    files
}

/// Shard jobs that run at once: [`autojobs::shard_jobs`] of the connections allowed
/// now (a fixed `--jobs N`: N held to the window budget). `--jobs auto` runs one job
/// per two cores until it has grown the connections: until then the consumer may be
/// the bound, as on loopback, and a job already keeps two cores busy (it hashes on
/// one while it transforms on another); on the 3.4 GB benchmark over loopback, 2
/// cores, 4 jobs took 6.7 s, 2 jobs 6.2–6.6 and 1 job 5.9 (`--jobs 1`). A
/// fixed `--jobs N` used to run N jobs at once: at `--jobs 4` four jobs shared six
/// window places on two cores, so while three consumed a sub-range each, a connection
/// stood idle.
fn jobs_at_once(links: &Links) -> usize {
    let (cores, limit) = (links.cores, links.limit());
    let jobs = autojobs::shard_jobs(cores, limit);
    if links.grown.load(Ordering::Relaxed) {
        jobs as usize
    } else {
        jobs.min((cores / 2).max(1)) as usize
    }
}

/// Samples the link every [`autojobs::TICK`]: feeds `--jobs auto`'s
/// [`Controller`] (which decides the connections; `None` for a fixed `--jobs N`) and
/// tracks the peak throughput for the summary line. Each decision is logged at debug
/// level (`-v`).
struct Grower {
    controller: Option<Controller>,
    last_at: std::time::Instant,
    last_received: u64,
    last_pushbacks: u64,
    /// The start of the current peak-rate interval and the bytes received by then.
    peak_from: (std::time::Instant, u64),
    peak: f64,
    started: std::time::Instant,
}

impl Grower {
    /// The interval the peak rate is measured over: long enough that one sub-range
    /// arriving does not read as a burst.
    const PEAK_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

    fn new(jobs: Jobs, ctx: &JobContext, max: u64) -> Grower {
        let now = std::time::Instant::now();
        Grower {
            controller: (jobs == Jobs::Auto).then(|| Controller::new(ctx.links.limit(), max)),
            last_at: now,
            last_received: 0,
            last_pushbacks: ctx.source.pushbacks(),
            peak_from: (now, 0),
            peak: 0.0,
            started: now,
        }
    }

    fn sample(&mut self, ctx: &JobContext) {
        let now = std::time::Instant::now();
        let links = &ctx.links;
        let received = links.received.load(Ordering::Relaxed);
        let (from, at_from) = self.peak_from;
        if now.duration_since(from) >= Self::PEAK_INTERVAL {
            let rate = (received - at_from) as f64 / now.duration_since(from).as_secs_f64();
            self.peak = self.peak.max(rate);
            self.peak_from = (now, received);
        }
        let pushbacks = ctx.source.pushbacks();
        let sample = Sample {
            bytes: received - self.last_received,
            elapsed: now.duration_since(self.last_at),
            busy: links.busy.load(Ordering::Relaxed),
            pushed_back: pushbacks != self.last_pushbacks,
        };
        (self.last_at, self.last_received, self.last_pushbacks) = (now, received, pushbacks);
        tracing::trace!(
            connections = links.limit(),
            busy = sample.busy,
            free_places = links.places.available_permits(),
            mb_s = sample.bytes as f64 / sample.elapsed.as_secs_f64().max(1e-9) / 1e6,
            "link: sample"
        );
        let Some(c) = &mut self.controller else {
            return;
        };
        match c.sample(sample) {
            Step::Hold => {}
            Step::Grow(n) => {
                while links.limit() < n {
                    links.grow();
                }
                tracing::debug!(
                    connections = n,
                    shard_jobs = jobs_at_once(links),
                    level_mb_s = c.last_rate().unwrap_or(0.0) / 1e6,
                    busy = sample.busy,
                    "jobs auto: more connections"
                );
            }
            Step::Stop(why) => tracing::debug!(
                connections = c.limit(),
                level_mb_s = c.last_rate().unwrap_or(0.0) / 1e6,
                busy = sample.busy,
                why = ?why,
                "jobs auto: connections stop growing"
            ),
        }
    }

    /// The peak rate, or the mean rate for a stream shorter than one interval.
    fn peak_bytes_per_s(&self, ctx: &JobContext) -> f64 {
        let total = ctx.links.received.load(Ordering::Relaxed) as f64;
        let mean = total / self.started.elapsed().as_secs_f64().max(1e-9);
        if self.peak == 0.0 { mean } else { self.peak }
    }
}

/// What a job tells the stream stage while it runs.
enum JobEvent {
    /// A read of job `.0` is durable: its source bytes.
    Durable(usize, u64),
    /// Job `id` has requested its last sub-range.
    AllRequested(usize),
}

/// Run job `id`; sends the source bytes of each read once it is durable, and
/// [`JobEvent::AllRequested`] once its window has requested everything.
///
/// A read's bytes are made durable (fsync of the files it wrote) and its journal line
/// written on a blocking thread while the job goes on with the next read: the disk
/// flush of one read overlaps the fetch, hash and transform of the next instead of
/// stalling them (an install whose output is as large as its source, such as a
/// pre-quantized one, was bound by the flushes, one after another). The journal still
/// gets a read's line only after its bytes are on disk, lines in read order, and at
/// most one read more is in flight than before.
async fn run_job(
    ctx: Arc<JobContext>,
    job: Job,
    id: usize,
    events: tokio::sync::mpsc::UnboundedSender<JobEvent>,
) -> Result<(), InstallError> {
    let plan = &ctx.plan;
    let mut hash = job.start_hash;
    // The read whose flush is pending, and its source bytes.
    let mut flushing = 0u64;
    let shard_path = &plan.shards[job.shard].path;
    let mut window = Window::new(
        &ctx,
        shard_path,
        job.steps
            .iter()
            .map(|&(ri, _)| plan.reads[ri].start..plan.reads[ri].end),
        (events.clone(), id),
    );
    let journal_hash = plan.options.verify_source && plan.shards[job.shard].sha256.is_some();
    let mut pending: Option<tokio::task::JoinHandle<Result<(), InstallError>>> = None;
    let streamed: Result<(), InstallError> = 'reads: {
        for (ri, hashed) in job.steps.iter().copied() {
            let read = &plan.reads[ri];
            // One attempt: the source's retry budget already covers every request and
            // resumption of this read (HTTP: backoff, Retry-After, progress deadlines).
            // Retrying the whole read here would multiply that budget and re-request at
            // once after a refusal such as a Retry-After over the limit (issue 13, item 7).
            let mut after = if hashed { hash.clone() } else { None };
            let written = match fetch_read(&ctx, &mut window, ri, after.as_mut()).await {
                Ok(w) => w,
                Err(e) => break 'reads Err(e),
            };
            if hashed {
                hash = after;
            }
            // The previous read's line first: the journal stays in read order.
            if let Some(p) = pending.take() {
                if let Err(e) = durable(p).await {
                    break 'reads Err(e);
                }
                // The receiver is gone only when the install is ending anyway.
                let _ = events.send(JobEvent::Durable(id, flushing));
            }
            let journaled = if journal_hash { hash.clone() } else { None };
            let c = ctx.clone();
            pending = Some(tokio::task::spawn_blocking(move || {
                c.make_durable(ri, &written, journaled.as_ref())
            }));
            flushing = read.end - read.start;
        }
        Ok(())
    };
    // Also on an error: a flush already started finishes (its read is whole) and
    // nothing of this job runs on after it returns.
    if let Some(p) = pending.take() {
        let last = durable(p).await;
        if last.is_ok() {
            let _ = events.send(JobEvent::Durable(id, flushing));
        }
        streamed?;
        last?;
    } else {
        streamed?;
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
    Ok(())
}

/// Fetch one read, transform and write it (not yet durable: [`JobContext::make_durable`]).
async fn fetch_read(
    ctx: &JobContext,
    window: &mut Window<'_>,
    ri: usize,
    mut hash: Option<&mut ResumableSha256>,
) -> Result<Written, InstallError> {
    let plan = &ctx.plan;
    let read = &plan.reads[ri];
    let shard = &plan.shards[read.shard].path;
    let segs = segments(plan, &ctx.placements, read);
    let (staged, staged_bytes) = stage(ctx, &segs).await?;
    ctx.counters
        .bytes_read
        .fetch_add(staged_bytes, Ordering::Relaxed);
    let mut w = ReadWriter {
        plan,
        placements: &ctx.placements,
        files: &ctx.files,
        paths: &ctx.paths,
        segs,
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
        staged,
        deq: Vec::new(),
    };
    let mut at = read.start;
    while at < read.end {
        let Some(piece) = window.next().await else {
            break;
        };
        let piece = piece?;
        let n = piece.bytes.len() as u64;
        at += n;
        ctx.counters.bytes_read.fetch_add(n, Ordering::Relaxed);
        let tile = ctx.tile;
        // The hash and the transforms each see the piece, in order, on two cores at
        // once: hashing is off the transforms' critical path, and neither copies it.
        tokio::task::block_in_place(|| -> Result<(), InstallError> {
            std::thread::scope(|scope| {
                let hashing = hash.as_deref_mut().map(|h| {
                    let bytes = &piece.bytes[..];
                    scope.spawn(move || h.update(bytes))
                });
                let fed = w.feed(&piece.bytes, tile);
                if let Some(t) = hashing {
                    t.join().map_err(|_| {
                        InstallError::Internal("source hash thread panicked".into())
                    })?;
                }
                fed
            })
        })?;
        // The piece's window place is given back only now that its bytes are consumed.
        drop(piece);
    }
    if w.pos != read.end {
        return Err(SourceError::BadRange {
            path: shard.clone(),
            range: read.start..read.end,
            detail: format!("stream ended at byte {}", w.pos),
        }
        .into());
    }
    ctx.counters
        .bytes_written
        .fetch_add(w.written, Ordering::Relaxed);
    Ok(Written {
        digest: hex::encode(w.digest.finalize()),
        touched: w.touched.iter().copied().collect(),
    })
}

/// A read transformed and written (not yet durable): its output digest and the
/// output files it wrote into.
struct Written {
    digest: String,
    touched: Vec<usize>,
}

/// Wait for a read's flush and journal line.
async fn durable(p: tokio::task::JoinHandle<Result<(), InstallError>>) -> Result<(), InstallError> {
    p.await
        .map_err(|e| InstallError::Internal(format!("flush task failed: {e}")))?
}

impl JobContext {
    /// Make read `ri` durable: fsync the files it wrote, then journal it (with the
    /// shard's hash state after it, when source hashes are journaled).
    fn make_durable(
        &self,
        ri: usize,
        written: &Written,
        hash: Option<&ResumableSha256>,
    ) -> Result<(), InstallError> {
        for &f in &written.touched {
            self.files[f]
                .sync_data()
                .map_err(|e| io_err(&self.paths[f], e))?;
        }
        let mut j = self.journal.lock().unwrap_or_else(|p| p.into_inner());
        j.record(ri, &written.digest, hash)?;
        self.finished.read_durable(ri);
        // Counted under the journal lock so the count equals the journal's lines
        // at any moment; the test hook below relies on it.
        let n = self.counters.reads.fetch_add(1, Ordering::Relaxed) + 1;
        if self.abort_after == Some(n) {
            // Test hook: behave like a kill right after the n-th durable journal
            // line. Exiting with the lock held keeps another job from adding one.
            std::process::exit(137);
        }
        Ok(())
    }
}

/// The budget every job draws on: connections (requests in flight) and places in the
/// reorder window (sub-ranges fetched or being fetched and not yet consumed).
///
/// A sub-range holds a window place from before its request until its bytes have been
/// hashed and transformed, so the window's memory is at most `places × sub_range`
/// bytes, whatever the shard count: that is the memory the RSS budget counts
/// ([`Links::window_bytes`]). A connection is held only while the request runs, so a
/// job transforms one sub-range while the next ones arrive.
pub(super) struct Links {
    connections: Arc<Semaphore>,
    places: Arc<Semaphore>,
    /// Connections allowed now (grows under `--jobs auto`).
    limit: AtomicU64,
    /// Bytes per sub-range request.
    sub_range: u64,
    /// Requests in flight now, and the most seen at once.
    busy: AtomicU64,
    /// Source bytes received so far (as they arrive, before the window hands them on).
    received: AtomicU64,
    peak_busy: AtomicU64,
    /// Set by the first sub-range that fails for good. Every such failure ends the
    /// install, so no request may start after it: a sub-range queued behind the
    /// failed one would otherwise take its connection and ask the server again before
    /// the install's shutdown aborts it (after a refusal such as a `Retry-After` over
    /// the limit, issue 13, item 7).
    failed: std::sync::atomic::AtomicBool,
    /// The jobs the install runs, and the cores they run on.
    jobs: usize,
    cores: u64,
    /// Whether `--jobs auto` has added connections (a fixed `--jobs N` starts so).
    grown: std::sync::atomic::AtomicBool,
    /// Jobs still requesting once no job waits to start (0 while some wait): the
    /// install's last sub-ranges are then cut smaller ([`Links::sub_range_now`]).
    last_jobs: AtomicU64,
    /// Piece buffers not in use, each of capacity `sub_range`. A buffer is made only
    /// when none is spare and comes back when its piece is consumed (or its request
    /// fails), so at most one exists per window place ever granted: the window's
    /// memory is at most `places × sub_range`, allocated once and reused.
    spare: std::sync::Mutex<Vec<Vec<u8>>>,
}

/// The reorder window's share of the install's memory budget ([`super::MEMORY_BUDGET`],
/// 256 MiB of RSS at any `--jobs`, issue 9): the rest is tiles, HTTP buffers and the
/// runtime (about 45 MiB at 16 connections, measured). 192 MiB so that at 4 connections (`--jobs 4`,
/// `--jobs auto`'s start) a 64 MiB read is two requests of 32 MiB, not three of 21.3:
/// each request waits its time to first byte, and at 40 ms and 50 MB/s per
/// connection that wait cost 8.6 % of the link at 21.3 MiB, 5.6 % at 32.
pub(super) const WINDOW_BUDGET: u64 = super::MEMORY_BUDGET - (64 << 20);

/// The sub-range size `--sub-range-kib auto` gives `connections`: the largest whole
/// MiB whose window ([`places_for`] the connections) fits [`WINDOW_BUDGET`], within 4
/// to 32 MiB.
///
/// Each request waits for its first byte (a CDN's or a far hub's latency) before
/// bytes flow, so a connection moves `size / (size + latency × rate)` of its rate:
/// at 50 MB/s and 40 ms, 0.67 with 4 MiB sub-ranges and 0.92 at 21 MiB. Few
/// connections can afford large sub-ranges within the budget, many need them less
/// (their sum outruns the consumer). Above 32 MiB a sub-range only adds to what a
/// kill re-fetches.
pub(super) fn auto_sub_range(connections: usize) -> u64 {
    sub_range_for(connections, cores())
}

fn sub_range_for(connections: usize, cores: u64) -> u64 {
    const MIB: u64 = 1 << 20;
    let places = places_for(connections, cores, usize::MAX) as u64;
    (WINDOW_BUDGET / places / MIB).clamp(4, 32) * MIB
}

/// Window places at `connections` on `cores`: one per connection fetching, and one
/// per shard job ([`autojobs::shard_jobs`] run at once, at most `jobs`, the jobs
/// there are) consuming a sub-range while its next ones arrive. Two consuming places in all (as before) left connections idle
/// whenever more than two jobs consumed at once: under `--jobs auto` at 8 connections
/// (4 jobs) 6 of 8 were busy, and growth stopped there as if the link were the bound.
fn places_for(connections: usize, cores: u64, jobs: usize) -> usize {
    let c = connections.max(1);
    c + (autojobs::shard_jobs(cores, c as u64) as usize).min(jobs.max(1))
}

/// The cores the install's jobs run on.
fn cores() -> u64 {
    std::thread::available_parallelism().map_or(1, |n| n.get() as u64)
}

/// The smallest sub-range [`Links::sub_range_now`] cuts: below it the time to first
/// byte costs more than the idle connections it fills.
const MIN_TAIL_SUB_RANGE: u64 = 4 << 20;

impl Links {
    /// `jobs`: the jobs the install runs (bounds the consuming places).
    /// `grown`: whether the connections are already the link's bound (a fixed count).
    fn new(connections: usize, sub_range: u64, jobs: usize, grown: bool) -> Links {
        let (connections, cores) = (connections.max(1), cores());
        Links {
            connections: Arc::new(Semaphore::new(connections)),
            places: Arc::new(Semaphore::new(places_for(connections, cores, jobs))),
            jobs,
            cores,
            grown: std::sync::atomic::AtomicBool::new(grown),
            limit: AtomicU64::new(connections as u64),
            sub_range,
            busy: AtomicU64::new(0),
            received: AtomicU64::new(0),
            peak_busy: AtomicU64::new(0),
            failed: std::sync::atomic::AtomicBool::new(false),
            last_jobs: AtomicU64::new(0),
            spare: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// An empty piece buffer of capacity `sub_range`: a spare one, or a new one.
    fn take_buffer(&self) -> Vec<u8> {
        let spare = self.spare.lock().unwrap_or_else(|p| p.into_inner()).pop();
        spare.unwrap_or_else(|| Vec::with_capacity(self.sub_range as usize))
    }

    fn give_back(&self, mut buf: Vec<u8>) {
        buf.clear();
        self.spare
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(buf);
    }

    /// The size of a job's next sub-range when `left` bytes of it are still to be
    /// requested: `sub_range`, or, once no job waits to start, the job's share of the
    /// connections over what it has left (at least [`MIN_TAIL_SUB_RANGE`]). Full-size
    /// sub-ranges to the end left connections idle while the install's last one or two
    /// arrived (at `--jobs 4` on the capped link: 1 or 2 of 4 busy for its last 0.5 s).
    fn sub_range_now(&self, left: u64) -> u64 {
        let jobs = self.last_jobs.load(Ordering::Relaxed);
        if jobs == 0 {
            return self.sub_range;
        }
        let share = (self.limit() / jobs).max(1);
        (left / share).clamp(MIN_TAIL_SUB_RANGE.min(self.sub_range), self.sub_range)
    }

    /// Allow one more connection (and the window places that come with it).
    pub(super) fn grow(&self) {
        let now = self.limit.fetch_add(1, Ordering::Relaxed) as usize;
        self.grown.store(true, Ordering::Relaxed);
        let (cores, jobs) = (self.cores, self.jobs);
        self.connections.add_permits(1);
        self.places
            .add_permits(places_for(now + 1, cores, jobs) - places_for(now, cores, jobs));
    }

    /// Connections allowed now.
    pub(super) fn limit(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }

    /// The most requests that were in flight at once.
    pub(super) fn peak(&self) -> u64 {
        self.peak_busy.load(Ordering::Relaxed)
    }

    /// The most connections whose window fits [`WINDOW_BUDGET`] at `sub_range` bytes
    /// each (at least 1): `--jobs` above it is held to it.
    pub(super) fn max_connections(sub_range: u64) -> usize {
        max_connections_for(sub_range, cores())
    }
}

fn max_connections_for(sub_range: u64, cores: u64) -> usize {
    let places = (WINDOW_BUDGET / sub_range.max(1)) as usize;
    let mut c = 1;
    while places_for(c + 1, cores, usize::MAX) <= places {
        c += 1;
    }
    c
}

/// One fetched sub-range, in one buffer of the window's pool, and the window place it
/// holds until dropped.
///
/// The body's chunks are copied into the buffer as they arrive and dropped at once.
/// Keeping them instead (as before) kept alive the HTTP client's whole read buffer
/// behind each chunk: every socket read that returned less than the buffer size the
/// client had reserved for it leaves that allocation pinned by its chunk, and the
/// next read reserves a fresh one; measured at 16 connections, the window's 72 MiB
/// of data held ~240 MiB of RSS. One copy of each source byte (memcpy speed, a few
/// per cent of the hash's cost) buys a window whose memory is exactly its bound.
struct Piece {
    bytes: Vec<u8>,
    links: Arc<Links>,
    _place: OwnedSemaphorePermit,
}

impl Drop for Piece {
    fn drop(&mut self) {
        // Back to the pool before the place is released (the fields drop after this),
        // so the request that takes the place finds the buffer spare.
        self.links.give_back(std::mem::take(&mut self.bytes));
    }
}

/// The bounded reorder window of one read: its sub-ranges are fetched concurrently,
/// each on a task of its own, and handed on strictly in order. The tasks belong to a
/// [`tokio::task::JoinSet`], so none outlives the read (an error, a cancelled job).
struct Window<'a> {
    ctx: &'a JobContext,
    path: String,
    /// The job's reads, in order; sub-ranges never cross a read's end, and the window
    /// runs on across reads so a job's connections stay busy at read boundaries.
    ranges: std::collections::VecDeque<std::ops::Range<u64>>,
    /// Index of the next sub-range to request and to hand on.
    spawned: u64,
    handed: u64,
    tasks: tokio::task::JoinSet<(u64, Result<Piece, SourceError>)>,
    /// Sub-ranges that arrived before their turn.
    early: std::collections::BTreeMap<u64, Result<Piece, SourceError>>,
    /// Sent once the last sub-range is requested (the stream stage then starts the
    /// next job).
    all_requested: Option<(tokio::sync::mpsc::UnboundedSender<JobEvent>, usize)>,
}

impl<'a> Window<'a> {
    fn new(
        ctx: &'a JobContext,
        path: &str,
        ranges: impl IntoIterator<Item = std::ops::Range<u64>>,
        all_requested: (tokio::sync::mpsc::UnboundedSender<JobEvent>, usize),
    ) -> Window<'a> {
        Window {
            all_requested: Some(all_requested),
            ctx,
            path: path.to_string(),
            ranges: ranges.into_iter().filter(|r| !r.is_empty()).collect(),
            spawned: 0,
            handed: 0,
            tasks: tokio::task::JoinSet::new(),
            early: std::collections::BTreeMap::new(),
        }
    }

    /// Request more sub-ranges while window places are free; waits for one only when
    /// nothing of this read is in the window, so a job always makes progress and
    /// never holds places it cannot use.
    async fn top_up(&mut self) {
        let links = self.ctx.links.clone();
        while !self.ranges.is_empty() {
            let place = if self.spawned == self.handed {
                match links.places.clone().acquire_owned().await {
                    Ok(p) => p,
                    Err(_) => return,
                }
            } else {
                match links.places.clone().try_acquire_owned() {
                    Ok(p) => p,
                    Err(_) => return,
                }
            };
            self.request(place);
        }
    }

    /// Request the next sub-range under `place` (there is one).
    fn request(&mut self, place: OwnedSemaphorePermit) {
        let Some(front) = self.ranges.front().cloned() else {
            return;
        };
        let links = self.ctx.links.clone();
        let left: u64 = self.ranges.iter().map(|r| r.end - r.start).sum();
        let size = next_sub_range(front.end - front.start, links.sub_range_now(left));
        let range = front.start..front.start + size;
        if range.end == front.end {
            self.ranges.pop_front();
        } else if let Some(f) = self.ranges.front_mut() {
            f.start = range.end;
        }
        let (index, source, path) = (self.spawned, self.ctx.source.clone(), self.path.clone());
        self.tasks.spawn(async move {
            let got = fetch_piece(source.as_ref(), links, &path, range, place).await;
            (index, got)
        });
        self.spawned += 1;
        if self.ranges.is_empty()
            && let Some((events, id)) = self.all_requested.take()
        {
            let _ = events.send(JobEvent::AllRequested(id));
        }
    }

    /// The next sub-range in order; `None` after the last.
    async fn next(&mut self) -> Option<Result<Piece, SourceError>> {
        self.top_up().await;
        if self.handed == self.spawned {
            return None;
        }
        loop {
            if let Some(p) = self.early.remove(&self.handed) {
                self.handed += 1;
                return Some(p);
            }
            // While the head is on its way, a place given back by another job's
            // consumer is taken at once (topping up only between pieces left it
            // free for the rest of a sub-range: at the capped link's tail, 2 of 4
            // connections busy with 4 places free).
            let more = !self.ranges.is_empty();
            let joined = tokio::select! {
                j = self.tasks.join_next() => j,
                p = self.ctx.links.places.clone().acquire_owned(), if more => {
                    if let Ok(p) = p {
                        self.request(p);
                    }
                    continue;
                }
            };
            match joined? {
                // A sub-range that failed for good (its retry budget spent, or an
                // answer such as 404) fails the read at once, whatever its place: the
                // rest of the window is cancelled with it instead of spending budgets
                // of its own against a server that refuses.
                Ok((_, Err(e))) => return Some(Err(e)),
                Ok((i, got)) => {
                    self.early.insert(i, got);
                }
                Err(e) => {
                    return Some(Err(SourceError::Config(format!(
                        "sub-range task of {} failed: {e}",
                        self.path
                    ))));
                }
            }
        }
    }
}

/// The size of the next sub-range of a read with `rest` bytes left: the rest in equal
/// parts of at most `max` (a 64 MiB read at 24 MiB: three of 21.3, not 24 + 24 + 16),
/// since a short last part would pay a whole time to first byte for little.
fn next_sub_range(rest: u64, max: u64) -> u64 {
    rest.div_ceil(rest.div_ceil(max.max(1)))
}

/// When a request gives its connection to the next one: once the bytes it has left
/// would take no longer to arrive, at the rate this response runs, than its time to
/// first byte took. Each request waits that long for its first byte (40 ms on the
/// benchmark's capped link, a CDN's or a far hub's latency), and the HTTP client
/// cannot pipeline a second request on a connection, so without the handover every
/// connection stood idle for one time to first byte per sub-range: 5.6 % of the link
/// at 32 MiB sub-ranges, 50 MB/s and 40 ms (`--jobs 4`: 181 MB/s of 200 while
/// streaming). The next request then waits for its first byte while these last bytes
/// arrive: the two overlap only while it waits (a TCP connection more is open then),
/// and the connection count the summary reports stays at most `--jobs`. The lead is
/// capped at [`Handover::MAX_LEAD`]: a first byte that came after a retry's wait
/// (inside the source's budget) is no measure of the link, and would hand over most
/// of the response early. On loopback the time to first byte is well under a
/// millisecond and the handover comes with the last chunk or two.
struct Handover {
    asked: std::time::Instant,
    /// When the first chunk arrived, and the bytes since then (after it).
    first: Option<(std::time::Instant, u64)>,
}

impl Handover {
    /// Bytes of a response before its rate is trusted.
    const MEASURED: u64 = 1 << 20;
    /// The longest time to first byte the handover leads by (a far CDN's is tens to a
    /// couple of hundred milliseconds).
    const MAX_LEAD: f64 = 0.25;

    fn new(asked: std::time::Instant) -> Handover {
        Handover { asked, first: None }
    }

    /// Whether the connection goes to the next request now (`now`: when a chunk of `n`
    /// bytes arrived, with `left` bytes still to come).
    fn due(&mut self, now: std::time::Instant, n: u64, left: u64) -> bool {
        let Some((at, since)) = &mut self.first else {
            self.first = Some((now, 0));
            return left == 0;
        };
        *since += n;
        if left == 0 {
            return true;
        }
        if *since < Self::MEASURED {
            return false;
        }
        let rate = *since as f64 / now.duration_since(*at).as_secs_f64().max(1e-9);
        let lead = at
            .duration_since(self.asked)
            .as_secs_f64()
            .min(Self::MAX_LEAD);
        left as f64 <= rate * lead
    }
}

/// A connection a request holds: its permit, counted in [`Links::busy`] (and the peak)
/// from when it is taken until it is dropped, at the handover or the request's end.
struct Busy<'a> {
    links: &'a Links,
    _permit: tokio::sync::SemaphorePermit<'a>,
}

impl<'a> Busy<'a> {
    fn new(links: &'a Links, permit: tokio::sync::SemaphorePermit<'a>) -> Busy<'a> {
        let busy = links.busy.fetch_add(1, Ordering::Relaxed) + 1;
        links.peak_busy.fetch_max(busy, Ordering::Relaxed);
        Busy {
            links,
            _permit: permit,
        }
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        // Before the permit goes (the fields drop after this), as before the handover.
        self.links.busy.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Fetch one sub-range under a connection permit into a piece buffer; the permit goes
/// to the next request a time to first byte before the last byte ([`Handover`]).
async fn fetch_piece(
    source: &dyn RangeSource,
    links: Arc<Links>,
    path: &str,
    range: std::ops::Range<u64>,
    place: OwnedSemaphorePermit,
) -> Result<Piece, SourceError> {
    let permit = links
        .connections
        .acquire()
        .await
        .map_err(|_| SourceError::Config("connection budget closed".into()))?;
    if links.failed.load(Ordering::Acquire) {
        // The install is ending with another sub-range's error; park until the
        // shutdown aborts this task rather than add an error or a request of its own.
        drop(permit);
        return std::future::pending().await;
    }
    let mut conn = Some(Busy::new(&links, permit));
    let mut buf = links.take_buffer();
    let want = range.end - range.start;
    let mut handover = Handover::new(std::time::Instant::now());
    let result = async {
        let mut body = source.stream_range(path, range.clone()).await?;
        while let Some(c) = body.next().await {
            let c = c?;
            links.received.fetch_add(c.len() as u64, Ordering::Relaxed);
            if (buf.len() + c.len()) as u64 > want {
                // The sources refuse a long body themselves; this keeps the buffer
                // within its capacity whatever a source does.
                return Err(SourceError::BadRange {
                    path: path.to_string(),
                    range: range.clone(),
                    detail: format!("more than the {want} bytes asked for"),
                });
            }
            buf.extend_from_slice(&c);
            let (n, left) = (c.len() as u64, want - buf.len() as u64);
            if conn.is_some() && handover.due(std::time::Instant::now(), n, left) {
                // The next request goes out now and waits for its first byte while
                // this one's last bytes arrive.
                conn = None;
            }
        }
        Ok(())
    }
    .await;
    if let Err(e) = result {
        // Before the connection is given back, so whoever takes it next sees it.
        links.failed.store(true, Ordering::Release);
        links.give_back(buf);
        return Err(e);
    }
    drop(conn);
    Ok(Piece {
        bytes: buf,
        links,
        _place: place,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn auto_sub_ranges_fit_the_window_budget_at_every_connection_count() {
        // Two cores (this project's CI): 1 + 1, 4 + 2 and 16 + 8 places.
        assert_eq!(sub_range_for(1, 2), 32 * MIB);
        assert_eq!(sub_range_for(4, 2), 32 * MIB);
        assert_eq!(sub_range_for(16, 2), 8 * MIB);
        assert_eq!(sub_range_for(256, 2), 4 * MIB);
        // Sixteen: four jobs consume at 4 connections.
        assert_eq!(sub_range_for(4, 16), 24 * MIB);
        for cores in [1, 2, 8, 16, 64] {
            for c in 1..=256 {
                let size = sub_range_for(c, cores);
                assert!((4 * MIB..=32 * MIB).contains(&size), "{c}: {size}");
                // The connections the install opens at that size, and their window.
                let used = c.min(max_connections_for(size, cores));
                let window = places_for(used, cores, usize::MAX) as u64 * size;
                assert!(window <= WINDOW_BUDGET, "{cores} cores, {c}: {window}");
            }
        }
    }

    #[test]
    fn a_connection_is_handed_on_one_time_to_first_byte_before_the_last_byte() {
        use std::time::{Duration, Instant};
        let t0 = Instant::now();
        let (size, chunk) = (32 * MIB, 64 << 10);
        // The bytes left when a 32 MiB response, in 64 KiB chunks, whose first byte
        // came `first` after its request and the rest at `rate` B/s, hands on.
        let handed_on_with = |first: Duration, rate: f64| {
            let mut h = Handover::new(t0);
            let mut got = 0;
            loop {
                got += chunk;
                let at = t0 + first + Duration::from_secs_f64((got - chunk) as f64 / rate);
                if h.due(at, chunk, size - got) {
                    return size - got;
                }
                assert!(got < size, "never handed on");
            }
        };
        // 50 MB/s after 40 ms: once what is left takes at most 40 ms, 2 MB.
        let left = handed_on_with(Duration::from_millis(40), 50e6);
        assert!((1_900_000..=2_000_000).contains(&left), "{left} bytes left");
        // Loopback: a first byte after 0.1 ms at 1 GB/s leaves 100 kB, the last chunks.
        let left = handed_on_with(Duration::from_micros(100), 1e9);
        assert!(left <= 100_000, "{left} bytes left");
        // A first byte after a retry's 3 s wait: the lead is capped at 0.25 s (12.5 MB
        // at 50 MB/s), not 3 s (the whole response).
        let left = handed_on_with(Duration::from_secs(3), 50e6);
        assert!(
            (12_000_000..=12_500_000).contains(&left),
            "{left} bytes left"
        );
        // A response shorter than the measuring stretch keeps its connection to the end.
        let first = t0 + Duration::from_millis(40);
        let mut h = Handover::new(t0);
        assert!(!h.due(first, chunk, MIB - chunk));
        assert!(!h.due(first + Duration::from_secs(1), chunk, 1));
        assert!(h.due(first + Duration::from_secs(2), 1, 0));
    }

    #[test]
    fn reads_split_into_equal_sub_ranges_of_at_most_the_size() {
        let split = |len: u64, max: u64| {
            let (mut rest, mut parts) = (len, Vec::new());
            while rest > 0 {
                let n = next_sub_range(rest, max);
                assert!(n >= 1 && n <= max && n <= rest, "{len} {max}: {n}");
                parts.push(n);
                rest -= n;
            }
            parts
        };
        assert_eq!(
            split(64 * MIB, 24 * MIB),
            vec![22369622, 22369621, 22369621]
        );
        assert_eq!(split(64 * MIB, 32 * MIB), vec![32 * MIB, 32 * MIB]);
        assert_eq!(split(5, 2), vec![2, 2, 1]);
        assert_eq!(split(1, 4 * MIB), vec![1]);
        for len in [1, 7, 4095, 64 * MIB - 1, 64 * MIB + 1, 1 << 33] {
            for max in [1, 3, 4 * MIB, 21 * MIB] {
                if len / max > 100_000 {
                    continue;
                }
                let parts = split(len, max);
                assert_eq!(parts.len() as u64, len.div_ceil(max), "{len} {max}");
                let (lo, hi) = (parts.iter().min().unwrap(), parts.iter().max().unwrap());
                assert!(hi - lo <= 1, "{len} {max}: {lo}..{hi}");
            }
        }
    }
}
