//! How `gturbo install` shows an install running: a bar on a terminal, plain lines
//! otherwise, or JSON Lines on stdout with `--json`.
//!
//! The library calls [`InstallReporter`] (phases, finished reads, bytes kept from a
//! previous run); this module owns the drawing. The CLI adds what only it knows: the
//! planned source bytes ([`CliReporter::set_total`]), the dry-run report of a real
//! `--json` install ([`CliReporter::plan`]) and the outcome ([`CliReporter::done`]).
//! [`for_install`] picks one reporter per run from the flags and the terminal.
//!
//! Throttled output takes the clock as an argument ([`Throttle::due`]) so its tests
//! run without sleeping.

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;

use crate::install::execute::{ExecuteSummary, InstallReporter};
use crate::verify::VerifyProgress;

/// Plain progress lines come at most this often: a log stays readable, and a
/// 2 s gap is still short enough to show a stall.
const TEXT_EVERY: Duration = Duration::from_secs(2);
/// JSON `progress` events come at most this often: enough for a consumer's bar, and
/// a multi-hour install stays a few thousand lines.
const JSON_EVERY: Duration = Duration::from_secs(1);

/// The reporter a run gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// A bar with rate and ETA on stderr, phase lines above it.
    Bar,
    /// Plain lines on stderr.
    Text,
    /// JSON Lines on stdout.
    Json,
}

/// Which reporter: JSON Lines for a real `--json` install; a bar only on a terminal,
/// without `-q` and without `--no-progress`; plain lines otherwise.
pub(super) fn choose(json_lines: bool, quiet: u8, no_progress: bool, stderr_tty: bool) -> Mode {
    if json_lines {
        Mode::Json
    } else if quiet == 0 && !no_progress && stderr_tty {
        Mode::Bar
    } else {
        Mode::Text
    }
}

/// The reporter for this run. `json_lines` is `--json` on a real (not dry-run) install.
pub(super) fn for_install(json_lines: bool, quiet: u8, no_progress: bool) -> Box<dyn CliReporter> {
    let tty = std::io::stderr().is_terminal();
    match choose(json_lines, quiet, no_progress, tty) {
        Mode::Json => Box::new(JsonReporter::new(Box::new(std::io::stdout()))),
        Mode::Text => Box::new(TextReporter::new(quiet, Box::new(std::io::stderr()))),
        Mode::Bar => {
            // https://no-color.org: set and not empty disables colour.
            let color = std::env::var_os(crate::env::NO_COLOR).is_none_or(|v| v.is_empty());
            Box::new(IndicatifReporter::new(color))
        }
    }
}

/// Progress of `verify-install`'s hashing, on stderr only: a bar on a terminal, a
/// plain line at most every 2 s otherwise, nothing with `--json` or `-q` (stdout then
/// carries only the report).
pub(super) fn for_verify(json: bool, quiet: u8, no_progress: bool) -> Box<dyn VerifyProgress> {
    if json || quiet > 0 {
        return Box::new(NoVerifyProgress);
    }
    match choose(false, quiet, no_progress, std::io::stderr().is_terminal()) {
        Mode::Bar => {
            let color = std::env::var_os(crate::env::NO_COLOR).is_none_or(|v| v.is_empty());
            Box::new(VerifyBar {
                bar: Mutex::new(None),
                color,
            })
        }
        _ => Box::new(VerifyText {
            out: Mutex::new(Box::new(std::io::stderr())),
            bytes: Counter::default(),
            throttle: Throttle::new(TEXT_EVERY),
            started: Mutex::new(None),
        }),
    }
}

struct NoVerifyProgress;
impl VerifyProgress for NoVerifyProgress {}

/// Plain `gturbo: hash: …` lines.
struct VerifyText {
    out: Mutex<Box<dyn Write + Send>>,
    bytes: Counter,
    throttle: Throttle,
    started: Mutex<Option<Instant>>,
}

impl VerifyProgress for VerifyText {
    fn start(&self, files: u64, bytes: u64) {
        self.bytes.total.store(bytes, Ordering::Relaxed);
        *self.started.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        write_line(
            &self.out,
            &format!("gturbo: hash: {files} files, {bytes} B"),
        );
    }

    fn hashed(&self, bytes: u64) {
        let now = Instant::now();
        let (done, complete) = self.bytes.add(bytes);
        if !self.throttle.due(now, complete) {
            return;
        }
        let total = self.bytes.total.load(Ordering::Relaxed);
        let started = self
            .started
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .unwrap_or(now);
        let secs = now.saturating_duration_since(started).as_secs_f64();
        write_line(
            &self.out,
            &format!(
                "gturbo: hash: {done} / {total} B ({:.1}%), {:.1} MB/s",
                100.0 * done as f64 / total.max(1) as f64,
                done as f64 / 1e6 / secs.max(1e-9)
            ),
        );
    }
}

/// A byte bar on stderr.
struct VerifyBar {
    bar: Mutex<Option<ProgressBar>>,
    color: bool,
}

impl VerifyProgress for VerifyBar {
    fn start(&self, _files: u64, bytes: u64) {
        let template = if self.color {
            "{spinner:.green} [{elapsed_precise}] {wide_bar:.cyan/blue} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} ETA {eta}"
        } else {
            "{spinner} [{elapsed_precise}] {wide_bar} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} ETA {eta}"
        };
        let bar = ProgressBar::with_draw_target(Some(bytes), ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template(template)
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.enable_steady_tick(Duration::from_millis(200));
        *self.bar.lock().unwrap_or_else(|p| p.into_inner()) = Some(bar);
    }

    fn hashed(&self, bytes: u64) {
        if let Some(bar) = self.bar.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            bar.inc(bytes);
        }
    }
}

impl Drop for VerifyBar {
    fn drop(&mut self) {
        if let Some(bar) = self.bar.lock().unwrap_or_else(|p| p.into_inner()).take() {
            bar.finish_and_clear();
        }
    }
}

/// What the CLI tells a reporter beyond the library's callbacks.
pub(super) trait CliReporter: InstallReporter {
    /// Planning is over: the source bytes the install will read, in total.
    fn set_total(&self, bytes: u64);
    /// The plan summary of a real install. Only the JSON reporter shows it: the
    /// others leave it to the caller's text report.
    fn plan(&self, _report: &serde_json::Value) {}
    /// The install finished.
    fn done(&self, done: &Done);
}

/// Outcome of an install, as the last line of every reporter.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Done {
    /// The installed `.gturbo` directory.
    pub out: String,
    /// What the executor did (its fields appear at the top level of the event).
    #[serde(flatten)]
    pub summary: ExecuteSummary,
    /// HTTP retries the source made (0 for a local source).
    pub retries: u64,
    /// Source shards and copied files not checked against a published hash, and why.
    pub source_unverified: Vec<Unverified>,
}

/// A source shard or copied file the install could not prove against the source's own
/// hash.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(super) struct Unverified {
    /// The shard or copied file, a path in the repo.
    pub path: String,
    /// `no published SHA-256` or `--no-verify-source` (a shard), `no published hash`
    /// (a copied file).
    pub reason: &'static str,
}

/// The shards of `plan` that the install does not verify, in plan order.
pub(super) fn unverified_shards(plan: &crate::plan::Plan) -> Vec<Unverified> {
    plan.shards
        .iter()
        .filter_map(|s| {
            let reason = if !plan.options.verify_source {
                "--no-verify-source"
            } else if s.sha256.is_none() {
                "no published SHA-256"
            } else {
                return None;
            };
            Some(Unverified {
                path: s.path.clone(),
                reason,
            })
        })
        .collect()
}

/// The copied files (repo paths) the install copied without a published hash.
pub(super) fn unverified_copies(paths: &[String]) -> Vec<Unverified> {
    paths
        .iter()
        .map(|p| Unverified {
            path: p.clone(),
            reason: "no published hash",
        })
        .collect()
}

impl Done {
    pub(super) fn new(
        out: &Path,
        s: &ExecuteSummary,
        retries: u64,
        source_unverified: Vec<Unverified>,
    ) -> Done {
        Done {
            out: out.display().to_string(),
            summary: s.clone(),
            retries,
            source_unverified,
        }
    }

    fn text(&self) -> String {
        if self.summary.already_installed {
            return format!(
                "gturbo: {} was already installed by an interrupted run of this plan: verified, leftovers removed, nothing fetched",
                self.out
            );
        }
        format!(
            "gturbo: installed {} in {:.1} s: read {} B, wrote {} B ({:.1} MB/s), {} reads fetched, {} kept from a previous run, {} damaged and redone, {} source shards verified, {} retries, {} connections, peak {:.1} MB/s",
            self.out,
            self.summary.elapsed_s,
            self.summary.bytes_read,
            self.summary.bytes_written,
            self.summary.bytes_read as f64 / 1e6 / self.summary.elapsed_s.max(1e-9),
            self.summary.reads_fetched,
            self.summary.reads_kept,
            self.summary.reads_damaged,
            self.summary.shards_verified,
            self.retries,
            self.summary.connections,
            self.summary.peak_bytes_per_s / 1e6
        ) + &self
            .source_unverified
            .iter()
            .map(|u| format!("\ngturbo: {}: not verified: {}", u.path, u.reason))
            .collect::<String>()
    }
}

/// Lets an event through at most once per `every`. The first call and forced calls
/// always pass.
struct Throttle {
    every: Duration,
    last: Mutex<Option<Instant>>,
}

impl Throttle {
    fn new(every: Duration) -> Throttle {
        Throttle {
            every,
            last: Mutex::new(None),
        }
    }

    /// Whether to emit at `now`; `force` for the event that must not be dropped
    /// (the last bytes of the stream).
    fn due(&self, now: Instant, force: bool) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let pass = force
            || match *last {
                None => true,
                Some(t) => now.saturating_duration_since(t) >= self.every,
            };
        if pass {
            *last = Some(now);
        }
        pass
    }
}

/// Source bytes done out of the planned total, shared by the reporters.
#[derive(Default)]
struct Counter {
    total: AtomicU64,
    done: AtomicU64,
}

impl Counter {
    /// Adds `bytes`; returns the new count and whether it reached the total.
    fn add(&self, bytes: u64) -> (u64, bool) {
        let done = self.done.fetch_add(bytes, Ordering::Relaxed) + bytes;
        let total = self.total.load(Ordering::Relaxed);
        (done, total > 0 && done >= total)
    }
}

/// Writes one line and flushes it so a reader sees it at once. A failed write
/// (a closed pipe) must not fail the install, so errors are dropped.
fn write_line(out: &Mutex<Box<dyn Write + Send>>, line: &str) {
    let mut w = out.lock().unwrap_or_else(|p| p.into_inner());
    let _ = writeln!(w, "{line}");
    let _ = w.flush();
}

/// Plain lines on stderr: one per phase, a progress line at most every 2 s and at
/// the end of the stream, the outcome. `-q` hides all but the outcome, `-qq` all.
pub(super) struct TextReporter {
    quiet: u8,
    out: Mutex<Box<dyn Write + Send>>,
    bytes: Counter,
    /// Bytes kept from a previous run: not part of this run's rate.
    kept: AtomicU64,
    throttle: Throttle,
    /// When streaming began; the rate is measured from here.
    stream_started: Mutex<Option<Instant>>,
}

impl TextReporter {
    pub(super) fn new(quiet: u8, out: Box<dyn Write + Send>) -> TextReporter {
        TextReporter {
            quiet,
            out: Mutex::new(out),
            bytes: Counter::default(),
            kept: AtomicU64::new(0),
            throttle: Throttle::new(TEXT_EVERY),
            stream_started: Mutex::new(None),
        }
    }

    fn note(&self, line: &str) {
        if self.quiet == 0 {
            write_line(&self.out, line);
        }
    }

    fn phase_at(&self, name: &str, detail: &str, now: Instant) {
        if name == "stream" {
            *self
                .stream_started
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = Some(now);
        }
        self.note(&format!("gturbo: {name}: {detail}"));
    }

    fn read_done_at(&self, bytes: u64, now: Instant) {
        let (done, complete) = self.bytes.add(bytes);
        if !self.throttle.due(now, complete) {
            return;
        }
        let total = self.bytes.total.load(Ordering::Relaxed);
        let started = self
            .stream_started
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .unwrap_or(now);
        let secs = now.saturating_duration_since(started).as_secs_f64();
        let fetched = done.saturating_sub(self.kept.load(Ordering::Relaxed));
        self.note(&format!(
            "gturbo: stream: {done} / {total} B ({:.1}%), {:.1} MB/s",
            100.0 * done as f64 / total.max(1) as f64,
            fetched as f64 / 1e6 / secs.max(1e-9)
        ));
    }
}

impl InstallReporter for TextReporter {
    fn phase(&self, name: &str, detail: &str) {
        self.phase_at(name, detail, Instant::now());
    }

    fn read_done(&self, bytes: u64) {
        self.read_done_at(bytes, Instant::now());
    }

    fn bytes_kept(&self, bytes: u64) {
        self.kept.store(bytes, Ordering::Relaxed);
        self.bytes.done.fetch_add(bytes, Ordering::Relaxed);
    }
}

impl CliReporter for TextReporter {
    fn set_total(&self, bytes: u64) {
        self.bytes.total.store(bytes, Ordering::Relaxed);
    }

    fn done(&self, done: &Done) {
        // The outcome is shown unless -qq.
        if self.quiet < 2 {
            write_line(&self.out, &done.text());
        }
    }
}

/// A bar on stderr for source bytes read (total = planned source bytes) with rate
/// and ETA, and a line per phase printed above it. Only used on a terminal without
/// `-q`; `NO_COLOR` drops the bar's colours.
pub(super) struct IndicatifReporter {
    multi: MultiProgress,
    /// Created once the total is known ([`CliReporter::set_total`]).
    bar: Mutex<Option<ProgressBar>>,
    color: bool,
}

impl IndicatifReporter {
    pub(super) fn new(color: bool) -> IndicatifReporter {
        IndicatifReporter {
            multi: MultiProgress::with_draw_target(ProgressDrawTarget::stderr()),
            bar: Mutex::new(None),
            color,
        }
    }

    fn bar(&self) -> Option<ProgressBar> {
        self.bar.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn style(&self) -> ProgressStyle {
        let template = if self.color {
            "{spinner:.green} [{elapsed_precise}] {wide_bar:.cyan/blue} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} ETA {eta}"
        } else {
            "{spinner} [{elapsed_precise}] {wide_bar} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} ETA {eta}"
        };
        ProgressStyle::with_template(template)
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ")
    }
}

impl InstallReporter for IndicatifReporter {
    fn phase(&self, name: &str, detail: &str) {
        // A hidden target (stderr went away) makes this a no-op; nothing to report.
        let _ = self.multi.println(format!("gturbo: {name}: {detail}"));
    }

    fn read_done(&self, bytes: u64) {
        if let Some(bar) = self.bar() {
            bar.inc(bytes);
        }
    }

    fn bytes_kept(&self, bytes: u64) {
        if let Some(bar) = self.bar() {
            bar.inc(bytes);
            // Kept bytes cost no time: leave them out of the rate and ETA.
            bar.reset_eta();
        }
    }
}

impl CliReporter for IndicatifReporter {
    fn set_total(&self, bytes: u64) {
        let bar = self.multi.add(ProgressBar::new(bytes));
        bar.set_style(self.style());
        bar.enable_steady_tick(Duration::from_millis(200));
        *self.bar.lock().unwrap_or_else(|p| p.into_inner()) = Some(bar);
    }

    fn done(&self, done: &Done) {
        if let Some(bar) = self.bar() {
            bar.finish_and_clear();
        }
        eprintln!("{}", done.text());
    }
}

/// JSON Lines on stdout for `gturbo install --json` (not `--dry-run`, which prints
/// one document): one object per line, each with `"schema_version": 1` and
/// `"event"`, flushed as it happens. Messages, in the order they come:
///
/// `phase`: a step begins. `name` is one of `resolve` (find the snapshot, read the
/// index and the shard headers), `plan` (planning done; `detail` counts shards, tensors
/// and reads), `resume-check`, `stream`, `tokenizer`, `hash`, `publish`. `detail` is
/// free text for people.
///
/// ```json
/// {"schema_version":1,"event":"phase","name":"stream","detail":"12 reads to fetch, 0 kept"}
/// ```
///
/// `plan`: once, after planning. `report` is the `--dry-run --json` document
/// (its own `schema_version` and fields are documented on `DryRunReport`).
///
/// ```json
/// {"schema_version":1,"event":"plan","report":{"schema_version":1,"family":"qwen38flashnext","...":"..."}}
/// ```
///
/// `progress`: source bytes done (fetched in this run plus kept from a previous one)
/// out of `bytes_total`, the planned source bytes. At most one per second, and always
/// one when `bytes_done` reaches `bytes_total`.
///
/// ```json
/// {"schema_version":1,"event":"progress","bytes_done":67108864,"bytes_total":268435456}
/// ```
///
/// `done`: the last line of a successful install. `out` the installed directory;
/// `elapsed_s` wall time of the install step; `reads_total` reads in the plan, of which
/// `reads_kept` were intact from a previous run and `reads_fetched` fetched now
/// (`reads_damaged` of the kept ones failed their check and were fetched again);
/// `bytes_read` source bytes and `bytes_written` output bytes of this run;
/// `shards_verified` source shards checked against their published SHA-256; `retries`
/// HTTP retries; `source_unverified` the shards and copied files not checked, each
/// `{"path", "reason"}` (`no published SHA-256` or `--no-verify-source` for a shard,
/// `no published hash` for a copied file). A failed install has no `done`:
/// the error is on stderr and the exit code is not 0.
///
/// ```json
/// {"schema_version":1,"event":"done","out":"qwen38flashnext.gturbo","elapsed_s":41.2,"reads_total":12,"reads_kept":0,"reads_fetched":12,"reads_damaged":0,"bytes_read":268435456,"bytes_written":150994944,"shards_verified":6,"retries":0,"source_unverified":[]}
/// ```
pub(super) struct JsonReporter {
    out: Mutex<Box<dyn Write + Send>>,
    bytes: Counter,
    throttle: Throttle,
}

/// One JSON line: the version, then the event's tag and fields.
#[derive(Serialize)]
struct Line<'a> {
    schema_version: u32,
    #[serde(flatten)]
    event: Event<'a>,
}

#[derive(Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
enum Event<'a> {
    Phase { name: &'a str, detail: &'a str },
    Plan { report: &'a serde_json::Value },
    Progress { bytes_done: u64, bytes_total: u64 },
    Done(&'a Done),
}

impl JsonReporter {
    pub(super) fn new(out: Box<dyn Write + Send>) -> JsonReporter {
        JsonReporter {
            out: Mutex::new(out),
            bytes: Counter::default(),
            throttle: Throttle::new(JSON_EVERY),
        }
    }

    fn emit(&self, event: Event<'_>) {
        let line = Line {
            schema_version: 1,
            event,
        };
        // These types always serialize (no maps with non-string keys, no NaN reaches
        // serde_json as an error); a failure would only drop one line.
        if let Ok(text) = serde_json::to_string(&line) {
            write_line(&self.out, &text);
        }
    }

    fn read_done_at(&self, bytes: u64, now: Instant) {
        let (done, complete) = self.bytes.add(bytes);
        if self.throttle.due(now, complete) {
            self.emit(Event::Progress {
                bytes_done: done,
                bytes_total: self.bytes.total.load(Ordering::Relaxed),
            });
        }
    }
}

impl InstallReporter for JsonReporter {
    fn phase(&self, name: &str, detail: &str) {
        self.emit(Event::Phase { name, detail });
    }

    fn read_done(&self, bytes: u64) {
        self.read_done_at(bytes, Instant::now());
    }

    fn bytes_kept(&self, bytes: u64) {
        self.bytes.done.fetch_add(bytes, Ordering::Relaxed);
    }
}

impl CliReporter for JsonReporter {
    fn set_total(&self, bytes: u64) {
        self.bytes.total.store(bytes, Ordering::Relaxed);
    }

    fn plan(&self, report: &serde_json::Value) {
        self.emit(Event::Plan { report });
    }

    fn done(&self, done: &Done) {
        self.emit(Event::Done(done));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};
    use std::sync::Arc;

    /// A writer the test can read back.
    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);

    impl Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Buf {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }
    }

    fn done() -> Done {
        Done {
            out: "m.gturbo".into(),
            summary: ExecuteSummary {
                elapsed_s: 2.5,
                reads_total: 4,
                reads_kept: 1,
                reads_fetched: 3,
                reads_damaged: 0,
                bytes_read: 300,
                bytes_written: 200,
                shards_verified: 1,
                already_installed: false,
                connections: 3,
                peak_bytes_per_s: 4.5e6,
                copied_unverified: Vec::new(),
            },
            retries: 2,
            source_unverified: Vec::new(),
        }
    }

    #[test]
    fn choose_follows_flags_and_terminal() {
        assert_eq!(choose(true, 0, false, true), Mode::Json);
        assert_eq!(choose(true, 2, true, false), Mode::Json);
        assert_eq!(choose(false, 0, false, true), Mode::Bar);
        assert_eq!(choose(false, 0, false, false), Mode::Text);
        assert_eq!(choose(false, 0, true, true), Mode::Text);
        assert_eq!(choose(false, 1, false, true), Mode::Text);
    }

    #[test]
    fn throttle_passes_first_then_once_per_interval_and_forced() {
        let t = Throttle::new(Duration::from_secs(2));
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        assert!(t.due(at(0), false));
        assert!(!t.due(at(1999), false));
        assert!(t.due(at(2000), false));
        assert!(!t.due(at(2001), false));
        assert!(t.due(at(2002), true), "forced passes inside the interval");
        // Forced passes restart the interval.
        assert!(!t.due(at(4001), false));
        assert!(t.due(at(4002), false));
        // A clock that goes backwards (another thread's earlier Instant) is not due.
        assert!(!t.due(at(1000), false));
    }

    #[test]
    fn json_lines_shape_and_order() {
        let buf = Buf::default();
        let r = JsonReporter::new(Box::new(buf.clone()));
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        r.phase("resolve", "local dir");
        r.set_total(1000);
        r.plan(&json!({"schema_version": 1, "family": "f"}));
        r.bytes_kept(100);
        r.phase("stream", "3 reads to fetch, 1 kept");
        r.read_done_at(300, at(0)); // first: emitted
        r.read_done_at(300, at(500)); // throttled
        r.read_done_at(300, at(700)); // reaches the total: forced
        r.done(&done());

        let text = buf.text();
        assert!(text.ends_with('\n'));
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        for l in &lines {
            assert_eq!(l["schema_version"], 1, "{l}");
        }
        let events: Vec<&str> = lines.iter().map(|l| l["event"].as_str().unwrap()).collect();
        assert_eq!(
            events,
            ["phase", "plan", "phase", "progress", "progress", "done"]
        );
        assert_eq!(
            lines[0],
            json!({"schema_version": 1, "event": "phase", "name": "resolve", "detail": "local dir"})
        );
        assert_eq!(
            lines[1]["report"],
            json!({"schema_version": 1, "family": "f"})
        );
        assert_eq!(
            lines[3],
            json!({"schema_version": 1, "event": "progress", "bytes_done": 400, "bytes_total": 1000})
        );
        assert_eq!(lines[4]["bytes_done"], 1000);
        assert_eq!(
            lines[5],
            json!({
                "schema_version": 1, "event": "done", "out": "m.gturbo", "elapsed_s": 2.5,
                "reads_total": 4, "reads_kept": 1, "reads_fetched": 3, "reads_damaged": 0,
                "bytes_read": 300, "bytes_written": 200, "shards_verified": 1, "retries": 2,
                "connections": 3, "peak_bytes_per_s": 4.5e6, "source_unverified": []
            })
        );
    }

    #[test]
    fn text_lines_throttled_with_rate_from_stream_start() {
        let buf = Buf::default();
        let r = TextReporter::new(0, Box::new(buf.clone()));
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        r.set_total(4_000_000);
        r.bytes_kept(1_000_000);
        r.phase_at("stream", "2 reads to fetch, 1 kept", at(0));
        r.read_done_at(1_000_000, at(1000)); // first: emitted
        r.read_done_at(1_000_000, at(2500)); // 1.5 s later: throttled
        r.read_done_at(1_000_000, at(3000)); // total reached: forced
        r.done(&done());
        assert_eq!(
            buf.text(),
            "gturbo: stream: 2 reads to fetch, 1 kept\n\
             gturbo: stream: 2000000 / 4000000 B (50.0%), 1.0 MB/s\n\
             gturbo: stream: 4000000 / 4000000 B (100.0%), 1.0 MB/s\n\
             gturbo: installed m.gturbo in 2.5 s: read 300 B, wrote 200 B (0.0 MB/s), 3 reads fetched, 1 kept from a previous run, 0 damaged and redone, 1 source shards verified, 2 retries, 3 connections, peak 4.5 MB/s\n"
        );
    }

    #[test]
    fn text_quiet_levels() {
        let buf = Buf::default();
        let r = TextReporter::new(1, Box::new(buf.clone()));
        r.set_total(10);
        r.phase("stream", "x");
        r.read_done(10);
        r.done(&done());
        assert_eq!(buf.text().lines().count(), 1, "-q keeps only the outcome");
        assert!(buf.text().starts_with("gturbo: installed m.gturbo"));

        let buf = Buf::default();
        let r = TextReporter::new(2, Box::new(buf.clone()));
        r.phase("stream", "x");
        r.done(&done());
        assert_eq!(buf.text(), "", "-qq shows nothing");
    }

    #[test]
    fn unverified_shards_get_a_line_each_after_the_summary() {
        let buf = Buf::default();
        let r = TextReporter::new(1, Box::new(buf.clone()));
        let mut d = done();
        d.source_unverified = vec![
            Unverified {
                path: "a.safetensors".into(),
                reason: "no published SHA-256",
            },
            Unverified {
                path: "b.safetensors".into(),
                reason: "--no-verify-source",
            },
        ];
        r.done(&d);
        let text = buf.text();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines[0].starts_with("gturbo: installed m.gturbo"));
        assert_eq!(
            lines[1..],
            [
                "gturbo: a.safetensors: not verified: no published SHA-256",
                "gturbo: b.safetensors: not verified: --no-verify-source"
            ]
        );
        let v = serde_json::to_value(&d).unwrap();
        assert_eq!(
            v["source_unverified"],
            json!([
                {"path": "a.safetensors", "reason": "no published SHA-256"},
                {"path": "b.safetensors", "reason": "--no-verify-source"}
            ])
        );
    }
}
