//! Tests that need something the machine may lack (a Python peer, the SmolLM2 snapshot,
//! root for a tmpfs) either run, fail, or are reported as skipped, never passed silently.
//!
//! [`require_or_skip`] is the one place that decides:
//! - in a strict run ([`strict`]: `CI` set, or `GTURBO_REQUIRE_PY=1`), a missing
//!   prerequisite panics, so CI never skips;
//! - otherwise it records `GTURBO-SKIP <test name>: <reason>` and the test returns. The
//!   line goes to the file named by `GTURBO_SKIP_LOG` (appended, so it survives cargo
//!   capturing the test's output; `scripts/test.sh` sets it and counts the lines) and to
//!   stderr.
//!
//! A test that skips only some of its checks calls it too; it is then reported as
//! skipped, since not everything it covers ran.

use std::io::Write as _;

/// Env var: the file that skip lines are appended to.
pub const GTURBO_SKIP_LOG: &str = "GTURBO_SKIP_LOG";
/// Env var: `1` makes every prerequisite required (as `CI` does).
pub const GTURBO_REQUIRE_PY: &str = "GTURBO_REQUIRE_PY";
/// Env var: `1` makes the GPU tests fail instead of skipping when no adapter opens
/// (the GPU is a prerequisite of its own: a strict run without one still needs it).
pub const GTURBO_REQUIRE_GPU: &str = "GTURBO_REQUIRE_GPU";
/// Env var: set by CI systems (`CI=true`); any value but empty, `0` or `false` counts.
pub const CI: &str = "CI";
/// What each skip line starts with.
pub const SKIP_PREFIX: &str = "GTURBO-SKIP";

/// Whether this run must not skip anything: under CI (`CI=true`) or with
/// `GTURBO_REQUIRE_PY=1`. Both mean the same.
pub fn strict() -> bool {
    let ci = std::env::var(CI).is_ok_and(|v| !matches!(v.trim(), "" | "0" | "false"));
    ci || std::env::var(GTURBO_REQUIRE_PY).as_deref() == Ok("1")
}

/// `Ok(value)` → `Some(value)`. `Err(reason)` → a panic naming the test and the reason
/// in a strict run, else the skip is recorded (see the module doc) and `None` returned.
///
/// Call it on the test's own thread: the test's name is that thread's name (libtest
/// names each test's thread after the test), `label` is used when it has none.
pub fn require_or_skip<T>(label: &str, prerequisite: Result<T, String>) -> Option<T> {
    let reason = match prerequisite {
        Ok(v) => return Some(v),
        Err(reason) => one_line(&reason),
    };
    let thread = std::thread::current();
    let test = match thread.name() {
        Some(name) if name != "main" => name.to_string(),
        _ => label.to_string(),
    };
    assert!(
        !strict(),
        "{test}: required in this run (CI or GTURBO_REQUIRE_PY=1) but {reason}"
    );
    let line = format!("{SKIP_PREFIX} {test}: {reason}");
    eprintln!("{line}");
    if let Some(path) = std::env::var_os(GTURBO_SKIP_LOG) {
        // One write of one line with O_APPEND: lines from parallel tests do not interleave.
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(format!("{line}\n").as_bytes()));
        if let Err(e) = written {
            panic!("{test}: cannot record the skip in {}: {e}", path.display());
        }
    }
    None
}

/// The reason on one line (a peer's stderr may hold a traceback): its lines joined
/// with ` | `, at most 400 characters.
fn one_line(reason: &str) -> String {
    let joined = reason
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" | ");
    match joined.char_indices().nth(400) {
        Some((cut, _)) => format!("{}…", &joined[..cut]),
        None => joined,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_are_one_bounded_line() {
        assert_eq!(
            one_line("Traceback:\n  File x\n\nModuleNotFoundError: numpy\n"),
            "Traceback: | File x | ModuleNotFoundError: numpy"
        );
        let long = "x".repeat(1000);
        assert_eq!(one_line(&long).chars().count(), 401);
    }
}
