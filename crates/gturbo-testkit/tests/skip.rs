//! `require_or_skip`'s contract, checked in a child run of this same test binary: a
//! missing prerequisite is logged by test name and reason outside a strict run, and
//! fails the test under `CI=true` or `GTURBO_REQUIRE_PY=1` alike.

use std::path::Path;
use std::process::{Command, Output};

use gturbo_testkit::skip::{self, require_or_skip};

/// Set in the child run: the test then plays the test that lacks a prerequisite.
const PROBE: &str = "GTURBO_SKIP_PROBE";
const TEST: &str = "a_missing_prerequisite_is_logged_by_name_or_fails_a_strict_run";

/// This test binary again, running only this test, with `env` on a clean slate.
fn child(log: &Path, env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", TEST, "--test-threads", "1"])
        .env(PROBE, "1")
        .env(skip::GTURBO_SKIP_LOG, log)
        .env_remove(skip::CI)
        .env_remove(skip::GTURBO_REQUIRE_PY);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

#[test]
fn a_missing_prerequisite_is_logged_by_name_or_fails_a_strict_run() {
    if std::env::var_os(PROBE).is_some() {
        let got: Option<()> = require_or_skip("label", Err("no peer\n  here".into()));
        assert_eq!(got, None);
        assert_eq!(require_or_skip("label", Ok::<_, String>(7)), Some(7));
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let log = tmp.path().join("skips.log");

    for lenient in [vec![], vec![(skip::CI, "false")], vec![(skip::CI, "")]] {
        let o = child(&log, &lenient);
        assert!(o.status.success(), "{lenient:?}: {o:?}");
    }
    let want = format!("GTURBO-SKIP {TEST}: no peer | here\n");
    assert_eq!(std::fs::read_to_string(&log).unwrap(), want.repeat(3));

    for strict in [
        [(skip::CI, "true")],
        [(skip::CI, "1")],
        [(skip::GTURBO_REQUIRE_PY, "1")],
    ] {
        let o = child(&log, &strict);
        assert_eq!(o.status.code(), Some(101), "{strict:?}: {o:?}");
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            out.contains(&format!("{TEST}: required in this run")) && out.contains("no peer"),
            "{strict:?}: {out}"
        );
    }
    // A strict run logs nothing: it failed instead.
    assert_eq!(std::fs::read_to_string(&log).unwrap(), want.repeat(3));
}
