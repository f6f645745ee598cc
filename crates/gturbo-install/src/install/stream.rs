//! The executor's *stream* stage: every read still to do is fetched, its bytes fed
//! through the transforms in bounded tiles ([`super::tile`]) and written at their
//! planned offsets, the touched files fsynced, and the read journaled with the digest
//! of what it wrote. This file schedules the jobs (a read, or a verified shard's reads
//! in order) over the connections and window places of [`super::window`].

use std::collections::BTreeSet;
use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::Digest;

use crate::plan::Plan;
use crate::plan::placement::{TensorPlacement, output_file_paths};

use crate::source::{RangeSource, SourceError};

use super::autojobs::{self, Controller, Sample, Step};
use super::finished::Finished;
use super::journal::Journal;
use super::options::{ExecuteOptions, InstallReporter, Jobs};
use super::source_hash::ResumableSha256;
use super::stage::OutputFiles;
use super::tile::{ReadWriter, segments, stage};
use super::window::{Links, Window, auto_sub_range};
use super::{InstallError, io_err};

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
    let all_requested = events.clone();
    let mut window = Window::new(
        &ctx.source,
        &ctx.links,
        shard_path,
        job.steps
            .iter()
            .map(|&(ri, _)| plan.reads[ri].start..plan.reads[ri].end),
        Box::new(move || {
            let _ = all_requested.send(JobEvent::AllRequested(id));
        }),
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
    let (staged, staged_bytes) = stage(ctx.source.as_ref(), plan, &ctx.placements, &segs).await?;
    ctx.counters
        .bytes_read
        .fetch_add(staged_bytes, Ordering::Relaxed);
    let mut w = ReadWriter::new(
        plan,
        &ctx.placements,
        &ctx.files,
        &ctx.paths,
        segs,
        read.start,
        staged,
    );
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
