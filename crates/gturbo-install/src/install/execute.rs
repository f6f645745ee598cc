//! The install's back half: stream every planned read through the transforms into
//! positional writes under `<out>.partial/`, journal each completed read durably,
//! then hash, write the manifest last, and publish by an atomic rename.
//!
//! [`execute`] runs these steps, each in its own module: *stage* (claim the output,
//! lay out the staging files: `stage`), *journal* (open or start the resume
//! journal: `journal`), *resume* (keep the journaled reads still intact:
//! `resume`), *stream* (fetch, transform, write, journal: `stream`),
//! then *copy*, *finalize* and *publish* (`publish`).
//!
//! # Memory
//! Each job holds one tile of source rows and its transformed output (`tile_bytes`
//! each, set by `--tile-kib`), never a tensor or a shard; the reorder window holds at
//! most `(connections + consuming jobs) × sub_range_bytes` of fetched source bytes, and
//! connections are held so that this stays within 192 MiB
//! (`window::WINDOW_BUDGET`). Memory is O(jobs × tile + connections × sub-range).
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

use std::sync::Arc;
use std::time::Instant;

use crate::source::RangeSource;

pub use super::options::{ExecuteOptions, ExecuteSummary, InstallReporter, Jobs, NoReport};

use super::journal::Journal;
use super::stage::Staging;
use super::stream::{self, JobContext};
use super::tile;
use super::{InstallError, Prepared, publish, resume};

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
    let placements = tile::placements(plan);

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
