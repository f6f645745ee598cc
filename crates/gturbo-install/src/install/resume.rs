//! The executor's *resume* step: which journaled reads are still intact on disk, and
//! the jobs that fetch the rest.
//!
//! A journaled read is kept only when the digest recomputed from the output files
//! equals the journal's; otherwise it is counted damaged and fetched again. A verified
//! shard is one job reading it front to back: its journaled prefix carries the shard's
//! hash state, and every read after that prefix is fetched (and hashed) again, even if
//! it is intact, because the hash must see the shard's bytes in order.

use crate::plan::Plan;
use crate::plan::placement::TensorPlacement;

use super::InstallError;
use super::journal::Done;
use super::source_hash::ResumableSha256;
use super::stage::OutputFiles;
use super::stream::Job;
use super::tile::digest_on_disk;

/// What the journal and the disk agree on.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Resume {
    /// Per read: journaled and intact on disk.
    pub complete: Vec<bool>,
    /// Per read: the shard's hash state after it, as journaled.
    pub checkpoint: Vec<Option<ResumableSha256>>,
    /// Reads kept.
    pub kept: u64,
    /// Journaled reads whose bytes on disk no longer match.
    pub damaged: u64,
}

/// Check every journaled read against the bytes on disk.
pub(super) fn check(
    plan: &Plan,
    placements: &[Option<TensorPlacement>],
    out: &OutputFiles,
    done: &[Done],
) -> Result<Resume, InstallError> {
    let mut r = Resume {
        complete: vec![false; plan.reads.len()],
        checkpoint: vec![None; plan.reads.len()],
        kept: 0,
        damaged: 0,
    };
    for d in done {
        let Some(read) = plan.reads.get(d.read) else {
            continue;
        };
        if r.complete[d.read] {
            continue;
        }
        r.checkpoint[d.read] = d.sha.clone();
        if digest_on_disk(plan, placements, out, read)? == d.digest {
            r.complete[d.read] = true;
            r.kept += 1;
        } else {
            r.damaged += 1;
        }
    }
    Ok(r)
}

/// The jobs still to run: a verified shard is one job that reads it front to back,
/// feeding a hash whose state is journaled after every read; any other read not yet
/// complete is a job of its own.
pub(super) fn jobs(plan: &Plan, resume: &Resume) -> Vec<Job> {
    let (complete, checkpoint) = (&resume.complete, &resume.checkpoint);
    let verified = |si: usize| plan.options.verify_source && plan.shards[si].sha256.is_some();
    let mut jobs = Vec::new();
    let mut ri = 0;
    while ri < plan.reads.len() {
        let si = plan.reads[ri].shard;
        if !verified(si) {
            if !complete[ri] {
                jobs.push(Job {
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
            jobs.push(Job {
                shard: si,
                steps,
                start_hash,
            });
        }
        ri = end;
    }
    jobs
}

/// Source bytes of the reads the jobs do not fetch (kept from a previous run).
pub(super) fn bytes_kept(plan: &Plan, jobs: &[Job]) -> u64 {
    let fetched: u64 = jobs
        .iter()
        .flat_map(|j| &j.steps)
        .map(|&(ri, _)| plan.reads[ri].end - plan.reads[ri].start)
        .sum();
    plan.source_bytes_read().saturating_sub(fetched)
}
