//! What the executor is given and what it hands back: its options, the connection
//! setting, the summary and the progress callbacks. A leaf: every step of the executor
//! (`stage`, `stream`, `publish`) reads these, and none of them
//! reads [`super::execute`].

use std::path::PathBuf;

/// Settings of the executor.
#[derive(Debug, Clone)]
pub struct ExecuteOptions {
    /// The final `.gturbo` directory.
    pub out: PathBuf,
    /// Connections (sub-range requests in flight): fixed, or grown while throughput rises.
    pub jobs: Jobs,
    /// Bytes per sub-range request: the unit of the reorder window (see
    /// `window::Links`); `None` sizes it to the connections
    /// (`window::auto_sub_range`).
    pub sub_range_bytes: Option<u64>,
    /// Source bytes per transform tile (rounded to whole rows, at least one row).
    pub tile_bytes: usize,
    /// Throw away a partial install instead of resuming it.
    pub discard_partial: bool,
    /// Replace an existing output directory (its exclusive lock is taken first: see
    /// [`super::lock`]).
    pub overwrite: bool,
    /// The local source folder (`--from`), which the output may neither be, hold nor
    /// lie inside (`stage::Staging::claim`).
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
