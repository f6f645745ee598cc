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

use clap::{Args, Parser, Subcommand};

use crate::family::{self, Family};

use crate::install::pin::PinError;

mod doctor;
mod eval;
mod install;
mod progress;
mod report;
mod run;
pub mod serve;

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
    Install(Box<install::InstallArgs>),
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
    /// Serve an install over HTTP: OpenAI's chat completions and Anthropic's Messages
    /// API, reusing cached prompt prefixes. The first line on stdout is
    /// `listening on http://HOST:PORT`.
    Serve(Box<serve::ServeArgs>),
    /// Compare two installs of one model over a text: mean KL divergence and top-1
    /// agreement of their next-token distributions (e.g. INT4 against BF16).
    Eval(Box<eval::EvalArgs>),
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

impl From<crate::install::InstallError> for Failure {
    fn from(e: crate::install::InstallError) -> Failure {
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
        install::bound_malloc_arenas();
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
        Command::Install(args) => install::install_cmd(*args, quiet, cli.global.no_progress).await,
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
        Command::Serve(args) => serve::serve_cmd(*args).await,
        Command::Eval(args) => eval::eval_cmd(*args),
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

/// `--threads N` where 0 means "the available cores".
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
    use super::install::{InstallArgs, require_source_hash};
    use super::*;

    fn install_args(extra: &[&str]) -> InstallArgs {
        let cli = Cli::try_parse_from(
            ["gturbo", "install", "some-family"]
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
