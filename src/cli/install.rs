//! `gturbo install`: its flags, and the command in stages: family and source, plan and
//! report (all a dry run does), the source-hash gate, then execute and publish.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;

use super::{Failure, REPORT_SERIALIZES, json_text, progress, report, warn};
use crate::family::Family;
use crate::install::execute::{self, ExecuteOptions};
use crate::install::pin::{PinFlags, SourceChoice};
use crate::install::{self, PrepareSettings};
use crate::plan::{PlanOptions, QuantMode};
use crate::source::RangeSource;
use crate::source::http::{HttpConfig, HttpSource};
use crate::source::local::LocalSource;
use crate::source::pace::{self, ProgressLimits};
use crate::source::token;

#[derive(Debug, Args)]
pub(super) struct InstallArgs {
    /// A family id (`qwen38flashnext`) or a repo `ORG/NAME` (then `--family` says how to
    /// read it, else config.json's `model_type` picks the family); optional with `--from`.
    pub(super) target: Option<String>,
    /// Family for a repo target (`gturbo install --family qwen3_moe ORG/NAME`).
    #[arg(long, conflicts_with = "family_file")]
    pub(super) family: Option<String>,
    /// A family file on disk instead of a built-in family.
    #[arg(long)]
    pub(super) family_file: Option<PathBuf>,
    /// Plan from shard headers only and print the plan; write nothing.
    #[arg(long)]
    pub(super) dry_run: bool,
    /// Hugging Face-compatible endpoint (a mirror, a local hub).
    #[arg(long, env = "HF_ENDPOINT")]
    pub(super) endpoint: Option<String>,
    /// Read from a local snapshot directory (or a Hugging Face cache snapshot) instead of a hub.
    #[arg(long = "from", value_name = "DIR", conflicts_with = "endpoint")]
    pub(super) from: Option<PathBuf>,
    /// Revision (branch, tag or commit); defaults to the family's pin, else `main`.
    #[arg(long)]
    pub(super) revision: Option<String>,
    /// Expected SHA-256 of model.safetensors.index.json (overrides the family's pin, with a warning).
    #[arg(long, value_name = "HEX")]
    pub(super) index_sha256: Option<String>,
    /// Output directory (`<name>.gturbo`); defaults to `./<family>.gturbo`.
    #[arg(long)]
    pub(super) out: Option<PathBuf>,
    /// Print one JSON document instead of text; on a real install, JSON Lines events.
    #[arg(long)]
    pub(super) json: bool,
    /// Quant profile (profiles/quant.json): int4 (the default: the family's INT4
    /// policy), int8, bf16 (everything at its source dtype), mixed-3-4, mixed-3-6,
    /// mixed-4-6 (mlx-lm's mixed predicates), or auto (chosen from this machine's RAM;
    /// docs/INSTALL.md gives the rule). A pre-quantized source keeps its own widths and
    /// refuses a named profile unless `--requantize` is given.
    #[arg(long, value_name = "PROFILE", value_parser = QuantMode::new)]
    pub(super) quant: Option<QuantMode>,
    /// With `--quant`, on a pre-quantized (MLX) source: dequantize its modules as
    /// `mx.dequantize` does and quantize them again at the profile, as `mx.quantize`
    /// does (quantizing twice loses quality; a warning says so). An error on a source
    /// that is not pre-quantized.
    #[arg(long, requires = "quant")]
    pub(super) requantize: bool,
    /// Drop the multi-token-prediction sidecar (of a family that carries it).
    #[arg(long, conflicts_with = "keep_mtp")]
    pub(super) skip_mtp: bool,
    /// Keep the multi-token-prediction (MTP / NextN) layers a family drops by default
    /// (DeepSeek-V3, GLM-4.5, Qwen3-Next, MiniMax-M2), quantized like the rest.
    #[arg(long)]
    pub(super) keep_mtp: bool,
    /// Also write the whole plan (every tensor and read) as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub(super) emit_plan: Option<PathBuf>,
    /// Largest coalesced source read, in MiB (smaller loses less to an interruption,
    /// costs more requests). Part of the plan: changing it changes the fingerprint.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub(super) range_mib: u64,
    /// Do not read and hash whole source shards against their published SHA-256
    /// (reads then skip excluded tensors and headers).
    #[arg(long)]
    pub(super) no_verify_source: bool,
    /// Connections (sub-range requests in flight): `auto` grows them while the
    /// throughput rises (2 to 16), or a fixed number.
    #[arg(long, default_value = "auto", value_parser = parse_jobs)]
    pub(super) jobs: execute::Jobs,
    /// Bytes per sub-range request, in KiB (4 to 1048576), or `auto`: the unit of the
    /// reorder window that lets several connections feed one shard's hash in order
    /// (memory: (connections + consuming jobs) × this). `auto` takes the largest size whose window
    /// fits its memory budget at the connection count (4 to 32 MiB), so each request's
    /// time to first byte is paid on as many bytes as the budget allows. Not part of
    /// the plan.
    #[arg(long, value_name = "KIB", default_value = "auto", value_parser = parse_sub_range)]
    pub(super) sub_range_kib: SubRangeKib,
    /// Source bytes per transform tile, in KiB (memory per read in flight).
    #[arg(long, default_value_t = 512)]
    pub(super) tile_kib: usize,
    /// Throw away a partial install of another plan instead of refusing.
    #[arg(long)]
    pub(super) discard_partial: bool,
    /// Replace an existing output directory (swapped in atomically at the end); refused
    /// while a `gturbo run`, `eval` or `verify-install` has it open.
    #[arg(long)]
    pub(super) overwrite: bool,
    /// Largest wait accepted from a server's Retry-After, in seconds.
    #[arg(long, default_value_t = 300)]
    pub(super) max_retry_wait: u64,
    /// Attempts per request, the first included: the one retry budget that faults,
    /// resumptions and the progress rules below all draw on.
    #[arg(long, value_name = "N", default_value_t = crate::source::retry::DEFAULT_MAX_ATTEMPTS as u64,
          value_parser = clap::value_parser!(u64).range(1..=100), env = crate::env::GTURBO_MAX_ATTEMPTS)]
    pub(super) max_attempts: u64,
    /// Low-speed limit: an attempt that receives fewer than BYTES in --low-speed-time
    /// seconds of waiting fails and is retried (0: no limit).
    #[arg(long, value_name = "BYTES", default_value_t = pace::DEFAULT_LOW_SPEED_BYTES,
          env = crate::env::GTURBO_LOW_SPEED_LIMIT)]
    pub(super) low_speed_limit: u64,
    /// The low-speed window, in seconds (0: no limit).
    #[arg(long, value_name = "SECS", default_value_t = pace::DEFAULT_LOW_SPEED_TIME.as_secs(),
          env = crate::env::GTURBO_LOW_SPEED_TIME)]
    pub(super) low_speed_time: u64,
    /// Most seconds one attempt at a range (request and body) may wait; the next
    /// attempt resumes from the byte reached (0: no limit).
    #[arg(long, value_name = "SECS", default_value_t = pace::DEFAULT_RANGE_TIMEOUT.as_secs(),
          env = crate::env::GTURBO_RANGE_TIMEOUT)]
    pub(super) range_timeout: u64,
    /// Refuse a source unless every shard has a published SHA-256 (listing `lfs.oid`,
    /// `X-Linked-Etag`, or a SHA-256 `ETag`) to verify it against. Default: on for the
    /// Hugging Face hub (it publishes one for every LFS file, so a missing one means
    /// something in between dropped it), off for other endpoints and --from.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true,
          default_missing_value = "true")]
    pub(super) require_source_hash: Option<bool>,
}

/// `--sub-range-kib`: KiB per sub-range, `None` for `auto`.
#[derive(Debug, Clone, Copy)]
pub(super) struct SubRangeKib(Option<u64>);

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

/// `gturbo install`: choose the family and source, plan (the dry run stops after the
/// report), then execute and publish.
pub(super) async fn install_cmd(
    args: InstallArgs,
    quiet: u8,
    no_progress: bool,
) -> Result<(), Failure> {
    let target = install_target(&args)?;
    let flags = PinFlags {
        target: &target,
        family: args.family.as_deref(),
        family_file: args.family_file.as_deref(),
        revision: args.revision.as_deref(),
        index_sha256: args.index_sha256.as_deref(),
    };
    let (family, picked, source, choice) = match flags.named_family()? {
        Some(family) => {
            let choice = flags.source(&family)?;
            let source = open_source(&args, &choice.repo, &choice.revision)?;
            (family, None, source, choice)
        }
        None => {
            // The repo at the revision asked for (else `main`) says which family reads
            // it; that family's pin may name another revision of the same repo.
            let first = args.revision.clone().unwrap_or_else(|| "main".into());
            let probe = open_source(&args, &target, &first)?;
            let config = install::source_config(probe.as_ref()).await?;
            let (family, why) = install::pin::family_for_config(&config)?;
            let choice = flags.source(&family)?;
            let source = if choice.revision == first {
                probe
            } else {
                open_source(&args, &choice.repo, &choice.revision)?
            };
            if quiet < 2 {
                eprintln!("{why}");
            }
            (family, Some(why), source, choice)
        }
    };
    let SourceChoice {
        index_pin,
        warnings,
        ..
    } = choice;
    for w in &warnings {
        warn(quiet, w);
    }
    let options = plan_options(&args, &family)?;
    let require_hash = require_source_hash(&args)?;
    let reporter = progress::for_install(args.json && !args.dry_run, quiet, no_progress);
    reporter.phase(
        "resolve",
        &format!("{} from {}", family.id(), source.describe()),
    );
    let settings = PrepareSettings {
        family: family.clone(),
        index_pin,
        options,
    };
    let prepared = install::prepare(source.as_ref(), &settings).await?;
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("{}.gturbo", family.id())));
    report_plan(
        &args,
        quiet,
        (&family, picked.as_deref()),
        source.as_ref(),
        &prepared,
        &out,
        reporter.as_ref(),
    )?;
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
    let options = execute_options(&args, out.clone(), require_hash);
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

/// The install's target: the positional one, else (with `--from`) the folder read as a
/// repo `local/<folder name>` whose family its config.json picks.
fn install_target(args: &InstallArgs) -> Result<String, Failure> {
    match (&args.target, &args.from) {
        (Some(t), _) => Ok(t.clone()),
        (None, Some(dir)) => {
            let name = dir
                .canonicalize()
                .ok()
                .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
                .filter(|n| !n.is_empty() && !n.contains('/'))
                .unwrap_or_else(|| "snapshot".into());
            Ok(format!("local/{name}"))
        }
        (None, None) => Err(Failure::usage(
            "name a family id or a repo ORG/NAME to install (or a folder with --from DIR)",
        )),
    }
}

/// The plan's options from the flags: the quant profile (`auto` reads this machine),
/// read coalescing, source verification and the sidecars skipped.
fn plan_options(args: &InstallArgs, family: &Family) -> Result<PlanOptions, Failure> {
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
    if args.keep_mtp {
        if !family.file.sidecars.contains_key("mtp") {
            return Err(Failure::usage(format!(
                "--keep-mtp: family {} has no mtp sidecar",
                family.id()
            )));
        }
        options.keep_sidecars.insert("mtp".into());
    }
    Ok(options)
}

/// The source: a local folder (`--from`), else the endpoint with the progress rules
/// and retry budget of the flags.
fn open_source(
    args: &InstallArgs,
    repo: &str,
    revision: &str,
) -> Result<Box<dyn RangeSource>, Failure> {
    if let Some(dir) = &args.from {
        return Ok(Box::new(
            LocalSource::open(dir, args.revision.as_deref())
                .map_err(|e| Failure::usage(e.to_string()))?,
        ));
    }
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
        ..HttpConfig::new(&endpoint, repo, revision)
    };
    Ok(Box::new(
        HttpSource::new(config).map_err(|e| Failure::usage(e.to_string()))?,
    ))
}

/// The plan's phase line and warnings, `--emit-plan`, and the dry-run report (text, or
/// the `--json` document; during a real `--json` install, the reporter's plan event).
fn report_plan(
    args: &InstallArgs,
    quiet: u8,
    (family, picked): (&Family, Option<&str>),
    source: &dyn RangeSource,
    prepared: &install::Prepared,
    out: &std::path::Path,
    reporter: &dyn progress::CliReporter,
) -> Result<(), Failure> {
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
    let report =
        report::DryRunReport::new(family, &source.describe(), prepared, out).picked_by(picked);
    if args.json && !args.dry_run {
        reporter.plan(&serde_json::to_value(&report).expect(REPORT_SERIALIZES));
    } else if args.json {
        println!("{}", json_text(&report));
    } else {
        print!("{}", report.to_text());
    }
    Ok(())
}

/// The executor's options from the flags.
fn execute_options(args: &InstallArgs, out: PathBuf, require_hash: bool) -> ExecuteOptions {
    ExecuteOptions {
        out,
        jobs: args.jobs,
        sub_range_bytes: args.sub_range_kib.0.map(|k| k * 1024),
        tile_bytes: args.tile_kib.max(1) * 1024,
        discard_partial: args.discard_partial,
        overwrite: args.overwrite,
        from: args.from.clone(),
        abort_after_reads: std::env::var(crate::env::GTURBO_TEST_ABORT_AFTER_READS)
            .ok()
            .and_then(|v| v.parse().ok()),
        require_source_hash: require_hash,
    }
}

/// Whether shards without a published SHA-256 refuse the install: the flag, else on
/// for the Hugging Face hub itself. The hub publishes `lfs.oid` and `X-Linked-Etag`
/// for every LFS file and every safetensors shard is one, so a missing hash there
/// means a proxy or a fault dropped it, and refusing costs an honest install nothing.
/// A mirror or a local folder may simply not publish hashes: they warn per file.
pub(super) fn require_source_hash(args: &InstallArgs) -> Result<bool, Failure> {
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

/// glibc malloc arenas an install allocates from ([`bound_malloc_arenas`]).
const MALLOC_ARENAS: i32 = 2;

/// Hold the process to [`MALLOC_ARENAS`] glibc malloc arenas (unless the user set
/// `MALLOC_ARENA_MAX`); called before the install's runtime starts: process setup, so
/// it is the CLI's, not the installer library's.
///
/// The install's transforms run on whichever thread `block_in_place` hands them, and
/// each new thread may get an arena of its own (up to 8 per core), which keeps the
/// tiles and buffers freed on it: the peak RSS then depended on how the threads
/// happened to be scheduled and grew with the install's length (default arenas,
/// release build, loopback: 51–71 MiB at 1.2 GB, 64–88 MiB at 3.4 GB; with 2 arenas
/// 48 and 54–55 MiB, at the same speed).
#[allow(unsafe_code)]
pub(super) fn bound_malloc_arenas() {
    if std::env::var_os("MALLOC_ARENA_MAX").is_some() {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` takes no pointers and only sets an allocator parameter under
    // glibc's own lock; `M_ARENA_MAX` accepts any positive count (a constant here), and
    // glibc applies it to arenas created after the call.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, MALLOC_ARENAS);
    }
}
