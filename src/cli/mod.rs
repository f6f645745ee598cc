//! Command-line interface: parse flags, resolve them into settings, call the library,
//! print, and pick the exit code in one place.
//!
//! Exit codes: 0 success; 1 gturbo ran but refused or found damage (a hash or pin
//! gate, a capability gate); 2 gturbo could not run (bad input, network, I/O, not
//! implemented).
//!
//! stdout carries data (the dry-run report, `--json` documents); stderr carries
//! notes, warnings and errors.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::family::{self, Family};
use std::sync::Arc;

use crate::install::execute::{self, ExecuteOptions};
use crate::install::pin::{PinError, PinFlags, SourceChoice};
use crate::install::{self, PrepareSettings};
use crate::plan::{PlanOptions, QuantMode};
use crate::source::RangeSource;
use crate::source::http::{HttpConfig, HttpSource};
use crate::source::local::LocalSource;
use crate::source::pace::{self, ProgressLimits};
use crate::source::token;

mod doctor;
mod progress;
mod report;
mod run;

/// gturbo installs huge sharded Hugging Face models into a page-aligned,
/// hash-verified local layout, and runs them.
#[derive(Debug, Parser)]
#[command(
    name = "gturbo",
    version,
    after_help = "Exit codes: 0 success; 1 ran but refused or found damage (hash or pin gate); 2 could not run (bad input, network, I/O)."
)]
pub struct Cli {
    #[command(flatten)]
    global: GlobalArgs,
    #[command(subcommand)]
    command: Command,
}

/// Flags every command takes.
#[derive(Debug, Args)]
struct GlobalArgs {
    /// Less output: -q hides notes, -qq leaves only errors.
    #[arg(short, long, global = true, action = clap::ArgAction::Count, conflicts_with = "verbose")]
    quiet: u8,
    /// More logging on stderr: -v debug, -vv trace (RUST_LOG overrides).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    /// Plain progress lines instead of a bar (also GTURBO_NO_PROGRESS=1).
    #[arg(long, global = true, env = crate::env::GTURBO_NO_PROGRESS,
          value_parser = clap::builder::FalseyValueParser::new())]
    no_progress: bool,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Plan (--dry-run) or perform an install. Prints the plan summary on stdout.
    Install(Box<InstallArgs>),
    /// Re-prove every byte and the layout of an installed `.gturbo` directory.
    ///
    /// Exit 0 when everything holds (the receipt `verified-install.json` is then
    /// rewritten), 1 when something does not (one line per failure), 2 when it could
    /// not run.
    VerifyInstall {
        /// The `.gturbo` directory.
        dir: PathBuf,
        /// One JSON document on stdout instead of text.
        #[arg(long)]
        json: bool,
        /// Do not rewrite the receipt (e.g. a read-only install).
        #[arg(long)]
        no_receipt: bool,
        /// Hashing threads (default, or 0: the available cores; at most 4 per core).
        #[arg(long, default_value_t = 0, value_parser = parse_threads_or_default)]
        threads: usize,
    },
    /// Generate text from an installed `.gturbo` directory (smoke test).
    Run(Box<run::RunArgs>),
    /// Compare two installs of one model over a text: mean KL divergence and top-1
    /// agreement of their next-token distributions (e.g. INT4 against BF16).
    Eval(Box<run::EvalArgs>),
    /// Check this machine, a family (will it install and run here?) or an install
    /// directory (is it sound?); every line not OK says what to do next.
    ///
    /// Exit 0 when no check failed, 1 when one did.
    Doctor(Box<doctor::DoctorArgs>),
    /// List the known families with their source pins and runner status.
    Families {
        /// One JSON document instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Args)]
struct InstallArgs {
    /// A family id (`qwen38flashnext`) or a repo `ORG/NAME` (then `--family` says how to read it).
    target: String,
    /// Family for a repo target (`gturbo install --family qwen3_moe ORG/NAME`).
    #[arg(long, conflicts_with = "family_file")]
    family: Option<String>,
    /// A family file on disk instead of a built-in family.
    #[arg(long)]
    family_file: Option<PathBuf>,
    /// Plan from shard headers only and print the plan; write nothing.
    #[arg(long)]
    dry_run: bool,
    /// Hugging Face-compatible endpoint (a mirror, a local hub).
    #[arg(long, env = "HF_ENDPOINT")]
    endpoint: Option<String>,
    /// Read from a local snapshot directory (or a Hugging Face cache snapshot) instead of a hub.
    #[arg(long = "from", value_name = "DIR", conflicts_with = "endpoint")]
    from: Option<PathBuf>,
    /// Revision (branch, tag or commit); defaults to the family's pin, else `main`.
    #[arg(long)]
    revision: Option<String>,
    /// Expected SHA-256 of model.safetensors.index.json (overrides the family's pin, with a warning).
    #[arg(long, value_name = "HEX")]
    index_sha256: Option<String>,
    /// Output directory (`<name>.gturbo`); defaults to `./<family>.gturbo`.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Print one JSON document instead of text; on a real install, JSON Lines events.
    #[arg(long)]
    json: bool,
    /// Quant profile (profiles/quant.json): int4 (the default: the family's INT4
    /// policy), int8, bf16 (everything at its source dtype), mixed-3-4, mixed-3-6,
    /// mixed-4-6 (mlx-lm's mixed predicates), or auto (chosen from this machine's RAM;
    /// the README gives the rule). A pre-quantized source keeps its own widths and
    /// refuses a named profile unless `--requantize` is given.
    #[arg(long, value_name = "PROFILE", value_parser = QuantMode::new)]
    quant: Option<QuantMode>,
    /// With `--quant`, on a pre-quantized (MLX) source: dequantize its modules as
    /// `mx.dequantize` does and quantize them again at the profile, as `mx.quantize`
    /// does (quantizing twice loses quality; a warning says so). An error on a source
    /// that is not pre-quantized.
    #[arg(long, requires = "quant")]
    requantize: bool,
    /// Drop the multi-token-prediction sidecar.
    #[arg(long)]
    skip_mtp: bool,
    /// Also write the whole plan (every tensor and read) as JSON to this file.
    #[arg(long, value_name = "FILE")]
    emit_plan: Option<PathBuf>,
    /// Largest coalesced source read, in MiB (smaller loses less to an interruption,
    /// costs more requests). Part of the plan: changing it changes the fingerprint.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=1024))]
    range_mib: u64,
    /// Do not read and hash whole source shards against their published SHA-256
    /// (reads then skip excluded tensors and headers).
    #[arg(long)]
    no_verify_source: bool,
    /// Connections (sub-range requests in flight): `auto` grows them while the
    /// throughput rises (2 to 16), or a fixed number.
    #[arg(long, default_value = "auto", value_parser = parse_jobs)]
    jobs: execute::Jobs,
    /// Bytes per sub-range request, in KiB (4 to 1048576), or `auto`: the unit of the
    /// reorder window that lets several connections feed one shard's hash in order
    /// (memory: (connections + consuming jobs) × this). `auto` takes the largest size whose window
    /// fits its memory budget at the connection count (4 to 32 MiB), so each request's
    /// time to first byte is paid on as many bytes as the budget allows. Not part of
    /// the plan.
    #[arg(long, value_name = "KIB", default_value = "auto", value_parser = parse_sub_range)]
    sub_range_kib: SubRangeKib,
    /// Source bytes per transform tile, in KiB (memory per read in flight).
    #[arg(long, default_value_t = 512)]
    tile_kib: usize,
    /// Throw away a partial install of another plan instead of refusing.
    #[arg(long)]
    discard_partial: bool,
    /// Replace an existing output directory (swapped in atomically at the end); refused
    /// while a `gturbo run`, `eval` or `verify-install` has it open.
    #[arg(long)]
    overwrite: bool,
    /// Largest wait accepted from a server's Retry-After, in seconds.
    #[arg(long, default_value_t = 300)]
    max_retry_wait: u64,
    /// Attempts per request, the first included: the one retry budget that faults,
    /// resumptions and the progress rules below all draw on.
    #[arg(long, value_name = "N", default_value_t = crate::source::retry::DEFAULT_MAX_ATTEMPTS as u64,
          value_parser = clap::value_parser!(u64).range(1..=100), env = crate::env::GTURBO_MAX_ATTEMPTS)]
    max_attempts: u64,
    /// Low-speed limit: an attempt that receives fewer than BYTES in --low-speed-time
    /// seconds of waiting fails and is retried (0: no limit).
    #[arg(long, value_name = "BYTES", default_value_t = pace::DEFAULT_LOW_SPEED_BYTES,
          env = crate::env::GTURBO_LOW_SPEED_LIMIT)]
    low_speed_limit: u64,
    /// The low-speed window, in seconds (0: no limit).
    #[arg(long, value_name = "SECS", default_value_t = pace::DEFAULT_LOW_SPEED_TIME.as_secs(),
          env = crate::env::GTURBO_LOW_SPEED_TIME)]
    low_speed_time: u64,
    /// Most seconds one attempt at a range (request and body) may wait; the next
    /// attempt resumes from the byte reached (0: no limit).
    #[arg(long, value_name = "SECS", default_value_t = pace::DEFAULT_RANGE_TIMEOUT.as_secs(),
          env = crate::env::GTURBO_RANGE_TIMEOUT)]
    range_timeout: u64,
    /// Refuse a source unless every shard has a published SHA-256 (listing `lfs.oid`,
    /// `X-Linked-Etag`, or a SHA-256 `ETag`) to verify it against. Default: on for the
    /// Hugging Face hub (it publishes one for every LFS file, so a missing one means
    /// something in between dropped it), off for other endpoints and --from.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true,
          default_missing_value = "true")]
    require_source_hash: Option<bool>,
}

/// A failure with its exit code.
struct Failure {
    code: u8,
    message: String,
}

impl Failure {
    fn usage(message: impl Into<String>) -> Failure {
        Failure {
            code: 2,
            message: message.into(),
        }
    }
}

impl From<install::InstallError> for Failure {
    fn from(e: install::InstallError) -> Failure {
        Failure {
            code: if e.is_refusal() { 1 } else { 2 },
            message: e.to_string(),
        }
    }
}

impl From<PinError> for Failure {
    fn from(e: PinError) -> Failure {
        Failure::usage(e.to_string())
    }
}

impl From<family::FamilyError> for Failure {
    fn from(e: family::FamilyError) -> Failure {
        Failure::usage(e.to_string())
    }
}

/// Entry point of the `gturbo` binary.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.global.verbose);
    if matches!(cli.command, Command::Install(_)) {
        crate::install::bound_malloc_arenas();
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("gturbo: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("gturbo: error: {}", f.message);
            ExitCode::from(f.code)
        }
    }
}

fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "gturbo=warn",
        1 => "gturbo=debug",
        _ => "gturbo=trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let quiet = cli.global.quiet;
    match cli.command {
        Command::Install(args) => install_cmd(*args, quiet, cli.global.no_progress).await,
        Command::VerifyInstall {
            dir,
            json,
            no_receipt,
            threads,
        } => verify_cmd(
            &dir,
            json,
            no_receipt,
            threads,
            quiet,
            cli.global.no_progress,
        ),
        Command::Run(args) => run::run_cmd(*args),
        Command::Eval(args) => run::eval_cmd(*args),
        Command::Families { json } => families_cmd(json),
        Command::Doctor(args) => doctor::doctor_cmd(*args).await,
    }
}

/// Why [`json_text`] cannot fail: the documents it prints are derived `Serialize`
/// impls and `json!` values over strings, numbers and string-keyed maps.
const REPORT_SERIALIZES: &str =
    "a CLI report always serializes: derived impls and json! values with string keys";

/// A `--json` document as pretty text.
fn json_text(doc: &impl serde::Serialize) -> String {
    serde_json::to_string_pretty(doc).expect(REPORT_SERIALIZES)
}

/// Most threads per available core that `--threads` accepts. Beyond the core count
/// threads only add scheduling and memory (10,000 threads took over 60 s for two tokens,
/// issue 13); 4 per core leaves room for hyper-threads and I/O waits.
pub const THREADS_PER_CORE: usize = 4;

/// The available cores (1 when unknown).
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `--threads N`: 1 to [`THREADS_PER_CORE`] × the available cores.
fn parse_threads(text: &str) -> Result<usize, String> {
    threads_in(text, cores(), false)
}

/// `--sub-range-kib`: KiB per sub-range, `None` for `auto`.
#[derive(Debug, Clone, Copy)]
struct SubRangeKib(Option<u64>);

/// `--sub-range-kib`: `auto` or a size in KiB from 4 to 1048576.
fn parse_sub_range(text: &str) -> Result<SubRangeKib, String> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("auto") {
        return Ok(SubRangeKib(None));
    }
    match t.parse::<u64>() {
        Ok(n @ 4..=1_048_576) => Ok(SubRangeKib(Some(n))),
        _ => Err(format!(
            "{text:?}: expected `auto` or a size in KiB from 4 to 1048576"
        )),
    }
}

/// `--threads N` where 0 means "the available cores".
/// `--jobs`: `auto` or a whole number of connections from 1 to 256.
fn parse_jobs(text: &str) -> Result<execute::Jobs, String> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("auto") {
        return Ok(execute::Jobs::Auto);
    }
    match t.parse::<usize>() {
        Ok(n @ 1..=256) => Ok(execute::Jobs::Fixed(n)),
        _ => Err(format!(
            "{text:?}: expected `auto` or a number of connections from 1 to 256"
        )),
    }
}

fn parse_threads_or_default(text: &str) -> Result<usize, String> {
    threads_in(text, cores(), true)
}

fn threads_in(text: &str, cores: usize, zero_is_default: bool) -> Result<usize, String> {
    let n: usize = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a whole number of threads"))?;
    let max = THREADS_PER_CORE * cores;
    if n == 0 && !zero_is_default {
        return Err("at least 1 thread".into());
    }
    if n > max {
        return Err(format!(
            "{n} threads is more than {max} ({THREADS_PER_CORE} per core, {cores} core{} available)",
            if cores == 1 { "" } else { "s" }
        ));
    }
    Ok(n)
}

fn warn(quiet: u8, msg: &str) {
    if quiet < 2 {
        eprintln!("warning: {msg}");
    }
}

async fn install_cmd(args: InstallArgs, quiet: u8, no_progress: bool) -> Result<(), Failure> {
    let flags = PinFlags {
        target: &args.target,
        family: args.family.as_deref(),
        family_file: args.family_file.as_deref(),
        revision: args.revision.as_deref(),
        index_sha256: args.index_sha256.as_deref(),
    };
    let family = flags.family()?;
    let SourceChoice {
        repo,
        revision,
        index_pin,
        warnings,
    } = flags.source(&family)?;
    for w in &warnings {
        warn(quiet, w);
    }
    let quant = args.quant.clone().unwrap_or_default();
    let machine = if quant.is_auto() {
        crate::plan::Machine::detect().map_err(Failure::usage)?
    } else {
        None
    };
    let mut options = PlanOptions {
        quant,
        quant_requested: args.quant.is_some(),
        requantize: args.requantize,
        machine,
        coalesce_max: args.range_mib << 20,
        verify_source: !args.no_verify_source,
        ..PlanOptions::default()
    };
    if args.skip_mtp {
        if !family.file.sidecars.contains_key("mtp") {
            return Err(Failure::usage(format!(
                "--skip-mtp: family {} has no mtp sidecar",
                family.id()
            )));
        }
        options.skip_sidecars.insert("mtp".into());
    }

    let source: Box<dyn RangeSource> = match &args.from {
        Some(dir) => Box::new(
            LocalSource::open(dir, args.revision.as_deref())
                .map_err(|e| Failure::usage(e.to_string()))?,
        ),
        None => {
            let endpoint = args
                .endpoint
                .clone()
                .unwrap_or_else(|| crate::env::DEFAULT_ENDPOINT.to_string());
            let config = HttpConfig {
                token: token::discover(),
                max_retry_after: Duration::from_secs(args.max_retry_wait),
                max_attempts: args.max_attempts as usize,
                progress: ProgressLimits {
                    low_speed_bytes: args.low_speed_limit,
                    low_speed_time: Duration::from_secs(args.low_speed_time),
                    range_timeout: Duration::from_secs(args.range_timeout),
                },
                ..HttpConfig::new(&endpoint, &repo, &revision)
            };
            Box::new(HttpSource::new(config).map_err(|e| Failure::usage(e.to_string()))?)
        }
    };
    let require_hash = require_source_hash(&args)?;
    let reporter = progress::for_install(args.json && !args.dry_run, quiet, no_progress);
    let detail = format!("{} from {}", family.id(), source.describe());
    reporter.phase("resolve", &detail);
    let settings = PrepareSettings {
        family: family.clone(),
        index_pin,
        options,
    };
    let prepared = install::prepare(source.as_ref(), &settings).await?;
    let plan = &prepared.plan;
    let detail = format!(
        "{} shards, {} tensors, {} reads, {} source bytes",
        plan.shards.len(),
        plan.tensors.len(),
        plan.reads.len(),
        plan.source_bytes_read()
    );
    reporter.phase("plan", &detail);
    for w in &prepared.warnings {
        warn(quiet, w);
    }
    if let Some(q) = &plan.requantized_from {
        warn(
            quiet,
            &format!(
                "--requantize: the source is pre-quantized ({}: {} by default, {} module \
                 entries); its modules are dequantized and quantized again at --quant {}, \
                 which loses quality against quantizing the unquantized original",
                q.format,
                q.scheme.label(),
                q.modules.len(),
                plan.options.quant
            ),
        );
    }
    if let Some(path) = &args.emit_plan {
        let text = serde_json::to_vec_pretty(&prepared.plan)
            .map_err(|e| Failure::usage(format!("{}: {e}", path.display())))?;
        std::fs::write(path, text)
            .map_err(|e| Failure::usage(format!("{}: {e}", path.display())))?;
    }
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("{}.gturbo", family.id())));
    let report = report::DryRunReport::new(&family, &source.describe(), &prepared, &out);
    if args.json && !args.dry_run {
        reporter.plan(&serde_json::to_value(&report).expect(REPORT_SERIALIZES));
    } else if args.json {
        println!("{}", json_text(&report));
    } else {
        print!("{}", report.to_text());
    }
    if args.dry_run {
        return Ok(());
    }
    let unverified = progress::unverified_shards(&prepared.plan);
    let copied_unpublished =
        crate::install::copied::unpublished(source.as_ref(), &prepared.repo, &prepared.plan);
    if require_hash && (!unverified.is_empty() || !copied_unpublished.is_empty()) {
        return Err(unpublished_hash_refusal(
            &unverified,
            &copied_unpublished,
            args.require_source_hash,
        ));
    }
    let abort_after_reads = std::env::var(crate::env::GTURBO_TEST_ABORT_AFTER_READS)
        .ok()
        .and_then(|v| v.parse().ok());
    let options = ExecuteOptions {
        out: out.clone(),
        jobs: args.jobs,
        sub_range_bytes: args.sub_range_kib.0.map(|k| k * 1024),
        tile_bytes: args.tile_kib.max(1) * 1024,
        discard_partial: args.discard_partial,
        overwrite: args.overwrite,
        from: args.from.clone(),
        abort_after_reads,
        require_source_hash: require_hash,
    };
    reporter.set_total(prepared.plan.source_bytes_read());
    let source: Arc<dyn RangeSource> = Arc::from(source);
    let summary = execute::execute(source.clone(), &prepared, &options, reporter.as_ref()).await?;
    let mut unverified = unverified;
    unverified.extend(progress::unverified_copies(&summary.copied_unverified));
    reporter.done(&progress::Done::new(
        &out,
        &summary,
        source.stats().retries,
        unverified,
    ));
    Ok(())
}

/// Whether shards without a published SHA-256 refuse the install: the flag, else on
/// for the Hugging Face hub itself. The hub publishes `lfs.oid` and `X-Linked-Etag`
/// for every LFS file and every safetensors shard is one, so a missing hash there
/// means a proxy or a fault dropped it, and refusing costs an honest install nothing.
/// A mirror or a local folder may simply not publish hashes: they warn per file.
fn require_source_hash(args: &InstallArgs) -> Result<bool, Failure> {
    match (args.require_source_hash, args.no_verify_source) {
        (Some(true), true) => Err(Failure::usage(
            "--require-source-hash and --no-verify-source contradict each other",
        )),
        (Some(v), _) => Ok(v),
        (None, true) => Ok(false),
        (None, false) => Ok(args.from.is_none() && on_the_hub(args.endpoint.as_deref())),
    }
}

/// Whether `endpoint` (None: the default) is the Hugging Face hub itself.
fn on_the_hub(endpoint: Option<&str>) -> bool {
    endpoint
        .unwrap_or(crate::env::DEFAULT_ENDPOINT)
        .trim_end_matches('/')
        .eq_ignore_ascii_case(crate::env::DEFAULT_ENDPOINT)
}

/// The refusal of shards and copied files without a published hash to verify them
/// against, each group named in full.
fn unpublished_hash_refusal(
    unverified: &[progress::Unverified],
    copied: &[String],
    flag: Option<bool>,
) -> Failure {
    let names: Vec<&str> = unverified.iter().map(|u| u.path.as_str()).collect();
    let s = |n: usize| if n == 1 { "" } else { "s" };
    let mut what = Vec::new();
    if !names.is_empty() {
        let why = if flag.is_some() {
            "--require-source-hash"
        } else {
            "the Hugging Face hub publishes one for every LFS file, so gturbo requires it there"
        };
        what.push(format!(
            "{} source shard{} without a published SHA-256 to verify against ({why}): {}",
            names.len(),
            s(names.len()),
            names.join(", ")
        ));
    }
    if !copied.is_empty() {
        let why = if flag.is_some() {
            "--require-source-hash"
        } else {
            "the Hugging Face hub publishes one for every file, so gturbo requires it there"
        };
        what.push(format!(
            "{} file{} to copy without a published hash (git blob id or SHA-256) to verify against ({why}): {}",
            copied.len(),
            s(copied.len()),
            copied.join(", ")
        ));
    }
    Failure {
        code: 1,
        message: format!(
            "{}\n\nhint: the source gives no `lfs.oid` in its listing and no `X-Linked-Etag` or SHA-256 `ETag` on these shards, and no git blob id (the listing's `oid`) for these files; pass --require-source-hash=false to install them unverified",
            what.join("; ")
        ),
    }
}

fn verify_cmd(
    dir: &std::path::Path,
    json: bool,
    no_receipt: bool,
    threads: usize,
    quiet: u8,
    no_progress: bool,
) -> Result<(), Failure> {
    if !dir.is_dir() {
        return Err(Failure::usage(format!(
            "{}: not a directory (verify-install takes a .gturbo directory)",
            dir.display()
        )));
    }
    // Held while verifying, so an overwrite cannot swap the directory under the
    // hashing or the receipt rewrite (see `crate::install::lock`).
    let _lock = crate::install::lock::InstallLock::shared(dir)
        .map_err(|e| Failure::usage(format!("{}: {e}", dir.display())))?;
    let progress = progress::for_verify(json, quiet, no_progress);
    let options = crate::verify::VerifyOptions {
        threads,
        write_receipt: !no_receipt,
        progress: Some(progress.as_ref()),
    };
    // Hashing is blocking work on its own threads; keep it off the async workers.
    let report = tokio::task::block_in_place(|| crate::verify::verify(dir, &options));
    drop(progress);
    if json {
        println!("{}", json_text(&report));
    } else {
        for f in &report.failures {
            println!("{f}");
        }
        println!("{}", report.summary());
    }
    if report.ok {
        Ok(())
    } else {
        Err(Failure {
            code: 1,
            message: format!(
                "{}: {} check{} failed",
                dir.display(),
                report.failures.len(),
                if report.failures.len() == 1 { "" } else { "s" }
            ),
        })
    }
}

fn families_cmd(json: bool) -> Result<(), Failure> {
    let all = Family::all_builtin()?;
    let rows: Vec<report::FamilyRow> = all.iter().map(report::FamilyRow::new).collect();
    if json {
        let doc = serde_json::json!({ "schema_version": 1, "families": rows });
        println!("{}", json_text(&doc));
    } else {
        print!("{}", report::families_text(&rows));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn install_args(extra: &[&str]) -> InstallArgs {
        let cli = Cli::try_parse_from(
            ["gturbo", "install", "qwen38flashnext"]
                .iter()
                .chain(extra.iter()),
        )
        .unwrap();
        match cli.command {
            Command::Install(a) => *a,
            other => panic!("{other:?}"),
        }
    }

    /// The defaults' values (the tests that exercise the rules use small ones).
    #[test]
    fn network_defaults_are_the_documented_ones() {
        // The env vars would override the defaults; this test reads the defaults only.
        let unset = match [
            crate::env::GTURBO_LOW_SPEED_LIMIT,
            crate::env::GTURBO_LOW_SPEED_TIME,
            crate::env::GTURBO_RANGE_TIMEOUT,
            crate::env::GTURBO_MAX_ATTEMPTS,
        ]
        .into_iter()
        .find(|k| std::env::var_os(k).is_some())
        {
            Some(k) => Err(format!("{k} is set")),
            None => Ok(()),
        };
        if gturbo_testkit::skip::require_or_skip("network_defaults", unset).is_none() {
            return;
        }
        let a = install_args(&[]);
        assert_eq!(a.low_speed_limit, 65_536);
        assert_eq!(a.low_speed_time, 30);
        assert_eq!(a.range_timeout, 600);
        assert_eq!(a.max_attempts, 6);
        assert_eq!(a.max_retry_wait, 300);
        assert_eq!(a.require_source_hash, None);
        let a = install_args(&[
            "--low-speed-limit",
            "10",
            "--low-speed-time",
            "2",
            "--range-timeout",
            "3",
            "--max-attempts",
            "1",
        ]);
        assert_eq!(
            (
                a.low_speed_limit,
                a.low_speed_time,
                a.range_timeout,
                a.max_attempts
            ),
            (10, 2, 3, 1)
        );
        assert!(
            Cli::try_parse_from(["gturbo", "install", "x", "--max-attempts", "0"]).is_err(),
            "at least one attempt"
        );
    }

    #[test]
    fn source_hashes_are_required_on_the_hub_by_default_only() {
        let req = |extra: &[&str]| require_source_hash(&install_args(extra)).map_err(|f| f.message);
        assert_eq!(req(&[]), Ok(true), "the hub (default endpoint)");
        assert_eq!(req(&["--endpoint", "https://huggingface.co/"]), Ok(true));
        assert_eq!(req(&["--endpoint", "http://127.0.0.1:9"]), Ok(false));
        assert_eq!(req(&["--from", "/tmp"]), Ok(false));
        assert_eq!(req(&["--no-verify-source"]), Ok(false));
        assert_eq!(
            req(&["--endpoint", "http://127.0.0.1:9", "--require-source-hash"]),
            Ok(true)
        );
        assert_eq!(req(&["--require-source-hash=false"]), Ok(false));
        assert_eq!(
            req(&["--require-source-hash", "--no-verify-source"]),
            Err("--require-source-hash and --no-verify-source contradict each other".into())
        );
    }

    #[test]
    fn threads_are_bounded_by_a_multiple_of_the_cores() {
        assert_eq!(threads_in("8", 2, false), Ok(8));
        assert_eq!(
            threads_in("9", 2, false),
            Err("9 threads is more than 8 (4 per core, 2 cores available)".into())
        );
        assert_eq!(
            threads_in("10000", 1, true),
            Err("10000 threads is more than 4 (4 per core, 1 core available)".into())
        );
        assert_eq!(threads_in("0", 2, true), Ok(0));
        assert_eq!(threads_in("0", 2, false), Err("at least 1 thread".into()));
        assert_eq!(
            threads_in("-1", 2, false),
            Err("\"-1\" is not a whole number of threads".into())
        );
    }
}
