//! The install's back half: stream every planned read through the transforms into
//! positional writes under `<out>.partial/`, journal each completed read durably,
//! then hash, write the manifest last, and publish by an atomic rename.
//!
//! [`execute`] runs these steps, each in its own module: *stage* (claim the output,
//! lay out the staging files: [`super::stage`]), *journal* (open or start the resume
//! journal: [`super::journal`]), *resume* (keep the journaled reads still intact:
//! [`super::resume`]), *stream* (fetch, transform, write, journal: [`super::stream`]),
//! then *copy*, *finalize* and *publish* ([`super::publish`]).
//!
//! # Memory
//! Each job holds one tile of source rows and its transformed output (`tile_bytes`
//! each, set by `--tile-kib`), never a tensor or a shard; the reorder window holds at
//! most `(connections + consuming jobs) × sub_range_bytes` of fetched source bytes, and
//! connections are held so that this stays within 192 MiB
//! (`stream::WINDOW_BUDGET`). Memory is O(jobs × tile + connections × sub-range).
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

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use crate::source::RangeSource;

use super::journal::Journal;
use super::stage::Staging;
use super::stream::{self, JobContext};
use super::{InstallError, Prepared, publish, resume};

/// Settings of the executor.
#[derive(Debug, Clone)]
pub struct ExecuteOptions {
    /// The final `.gturbo` directory.
    pub out: PathBuf,
    /// Connections (sub-range requests in flight): fixed, or grown while throughput rises.
    pub jobs: Jobs,
    /// Bytes per sub-range request: the unit of the reorder window (see
    /// [`super::stream::Links`]); `None` sizes it to the connections
    /// ([`super::stream::auto_sub_range`]).
    pub sub_range_bytes: Option<u64>,
    /// Source bytes per transform tile (rounded to whole rows, at least one row).
    pub tile_bytes: usize,
    /// Throw away a partial install instead of resuming it.
    pub discard_partial: bool,
    /// Replace an existing output directory (its exclusive lock is taken first: see
    /// [`super::lock`]).
    pub overwrite: bool,
    /// The local source folder (`--from`), which the output may neither be, hold nor
    /// lie inside ([`super::stage::Staging::claim`]).
    pub from: Option<PathBuf>,
    /// Test hook: stop (as if killed) after this many reads complete in this run.
    pub abort_after_reads: Option<u64>,
    /// `--require-source-hash`: refuse a copied file whose source turns out to publish
    /// no hash for it (the shards' and the listed files' hashes are required before
    /// the executor starts).
    pub require_source_hash: bool,
}

/// How many connections the stream stage uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Jobs {
    /// Exactly this many (at least 1).
    Fixed(usize),
    /// Start at [`Jobs::AUTO_START`] and add connections while the throughput rises,
    /// up to [`Jobs::AUTO_MAX`] (the rules: `install::autojobs`).
    Auto,
}

impl Jobs {
    /// Connections `--jobs auto` starts with: 8 reach 16 on the benchmark's capped
    /// link one level (0.75 s) sooner than 4, and cost loopback nothing (one job
    /// consumes until the connections grow).
    pub const AUTO_START: usize = 8;
    /// The most connections `--jobs auto` opens. With redirected (CDN) locations only
    /// the first request of each file reaches the hub's resolver; the window's memory
    /// (`(connections + consuming jobs) × sub-range`) is held within its budget as well.
    pub const AUTO_MAX: usize = 16;

    /// Connections at the start.
    pub fn initial(self) -> usize {
        match self {
            Jobs::Fixed(n) => n.max(1),
            Jobs::Auto => Self::AUTO_START,
        }
    }

    /// The most connections this setting may use.
    pub fn max(self) -> usize {
        match self {
            Jobs::Fixed(n) => n.max(1),
            Jobs::Auto => Self::AUTO_MAX,
        }
    }
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
    /// The output was already published by an interrupted run of this plan (verified,
    /// its leftover journal and lock removed); nothing was fetched. Serialized only
    /// when true.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub already_installed: bool,
    /// The most sub-range requests that were in flight at once.
    pub connections: u64,
    /// The best source throughput over one sampling interval, bytes per second.
    pub peak_bytes_per_s: f64,
    /// Copied files (repo paths) the source published no hash for: copied unverified.
    /// Reported with the unverified shards, not here.
    #[serde(skip)]
    pub copied_unverified: Vec<String>,
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

/// Run the install, step by step. Returns the summary; the `.gturbo` directory is
/// published at `options.out` on success.
pub async fn execute(
    source: Arc<dyn RangeSource>,
    prepared: &Prepared,
    options: &ExecuteOptions,
    reporter: &dyn InstallReporter,
) -> Result<ExecuteSummary, InstallError> {
    let started = Instant::now();
    let plan = &prepared.plan;
    let fingerprint = plan.fingerprint();
    if !options.overwrite && publish::finish_interrupted(&options.out, &fingerprint, reporter)? {
        return Ok(ExecuteSummary {
            reads_total: plan.reads.len() as u64,
            reads_kept: plan.reads.len() as u64,
            already_installed: true,
            elapsed_s: started.elapsed().as_secs_f64(),
            ..Default::default()
        });
    }
    let staging = Staging::claim(options)?;
    let shard_of = |r: usize| plan.reads.get(r).map(|x| x.shard);
    let (journal, done) = Journal::open(
        &staging.journal,
        &fingerprint,
        &plan.facts(),
        options.discard_partial,
        shard_of,
    )?;
    let out = staging.create_outputs(plan)?;
    let placements = stream::placements(plan);

    reporter.phase("resume-check", &format!("{} journaled reads", done.len()));
    let kept = resume::check(plan, &placements, &out, &done)?;
    let jobs = resume::jobs(plan, &kept);
    reporter.bytes_kept(resume::bytes_kept(plan, &jobs));
    let fetch_count: usize = jobs.iter().map(|j| j.steps.len()).sum();
    reporter.phase(
        "stream",
        &format!("{fetch_count} reads to fetch, {} kept", kept.kept),
    );
    let ctx = JobContext::new(
        source.clone(),
        plan,
        placements,
        out,
        journal,
        options,
        &jobs,
    );
    // The copied files (tokenizer, chat template) come while the stream runs: each
    // costs requests with their time to first byte, which on a far hub added up to a
    // third of a second after the last weight byte.
    let mut copied = Vec::new();
    let copy = publish::copy_files(
        source.as_ref(),
        prepared,
        &staging.dir,
        reporter,
        options.require_source_hash,
        &mut copied,
    );
    let streamed = stream::run(ctx, jobs, options.jobs, reporter, copy).await?;
    let copied_unverified = (copied.iter())
        .filter(|c| !c.verified)
        .map(|c| c.path.clone())
        .collect();
    publish::finalize(
        prepared,
        &fingerprint,
        &staging.dir,
        &streamed.file_sha256,
        copied,
        reporter,
    )?;
    publish::publish(staging, reporter)?;
    Ok(ExecuteSummary {
        reads_total: plan.reads.len() as u64,
        reads_kept: kept.kept,
        reads_fetched: streamed.reads,
        reads_damaged: kept.damaged,
        bytes_read: streamed.bytes_read,
        bytes_written: streamed.bytes_written,
        shards_verified: streamed.shards_verified,
        elapsed_s: started.elapsed().as_secs_f64(),
        already_installed: false,
        connections: streamed.connections,
        peak_bytes_per_s: streamed.peak_bytes_per_s,
        copied_unverified,
    })
}
