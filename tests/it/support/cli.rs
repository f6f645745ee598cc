//! Running the built `gturbo` binary: one [`gturbo`] command with a clean environment,
//! the installs the tests make again and again, and readers for what a run printed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use gturbo_testkit::replica::{self, Qwen3MoeSpec};

use serde_json::Value;

use super::{Replica, gturbo_bin, sha256_hex};

/// Variables a developer's shell may hold that would steer a run away from what the
/// test set up: a hub endpoint or token, the network tunables, and the test hooks
/// (a test that wants one sets it on the command, which overrides the removal).
const INHERITED_ENV_REMOVED: &[&str] = &[
    "HF_ENDPOINT",
    "HF_TOKEN",
    "GTURBO_LOW_SPEED_LIMIT",
    "GTURBO_LOW_SPEED_TIME",
    "GTURBO_RANGE_TIMEOUT",
    "GTURBO_MAX_ATTEMPTS",
    "GTURBO_TEST_ABORT_AFTER_READS",
    "GTURBO_TEST_EXIT_AFTER_PUBLISH",
];

/// A command for the built `gturbo` binary, without [`INHERITED_ENV_REMOVED`].
pub fn gturbo() -> Command {
    let mut c = Command::new(gturbo_bin());
    for k in INHERITED_ENV_REMOVED {
        c.env_remove(k);
    }
    c
}

/// Exit status, stdout and stderr of a run, for an assertion's message.
pub fn text(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}\n--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A run's stdout.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A run's stderr.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A run's stdout then its stderr, undecorated.
pub fn streams(o: &Output) -> String {
    format!("{}{}", stdout(o), stderr(o))
}

/// The `gturbo: error: …` line of a failed run's stderr.
pub fn error_line(o: &Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr);
    err.lines()
        .find(|l| l.starts_with("gturbo: error: "))
        .unwrap_or_else(|| panic!("no error line: {}", text(o)))
        .to_string()
}

/// `gturbo install --family FAMILY local/x --from SNAP --out OUT EXTRA…`: a local install,
/// not yet run.
pub fn install_cmd(family: &str, snap: &Path, out: &Path, extra: &[&str]) -> Command {
    let mut c = gturbo();
    c.args(["install", "--family", family, "local/x", "--from"])
        .arg(snap)
        .arg("--out")
        .arg(out)
        .args(extra);
    c
}

/// [`install_cmd`], run to the end.
pub fn try_install(family: &str, snap: &Path, out: &Path, extra: &[&str]) -> Output {
    install_cmd(family, snap, out, extra).output().unwrap()
}

/// [`install_cmd`], quiet (`-q`), asserting success.
pub fn install(family: &str, snap: &Path, out: &Path, extra: &[&str]) {
    let o = install_cmd(family, snap, out, extra)
        .arg("-q")
        .output()
        .unwrap();
    assert!(o.status.success(), "install: {}", text(&o));
}

/// `gturbo install qwen38flashnext` of the replica served by a hub at `url` (revision
/// `commit`, the replica's index hash), stdout dropped, with `env` set on the run.
pub fn hub_install(
    url: &str,
    commit: &str,
    r: &Replica,
    out: &Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Output {
    gturbo()
        .args(["install", "qwen38flashnext", "--endpoint", url])
        .args(["--revision", commit, "--index-sha256", &r.index_sha])
        .arg("--out")
        .arg(out)
        .args(extra)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .output()
        .unwrap()
}

/// A qwen3_moe install whose pools (2 layers × 64 experts, 112 KiB stride, 14 MiB) are
/// far larger than a few expert cache slots: its snapshot `tmp/snap` and install
/// `tmp/moe.gturbo`.
pub fn moe_install(tmp: &Path) -> (PathBuf, PathBuf) {
    let spec = Qwen3MoeSpec {
        hidden_size: 256,
        num_experts: 64,
        num_experts_per_tok: 4,
        moe_intermediate_size: 256,
        seed: 3,
        ..Qwen3MoeSpec::tiny()
    };
    let snap = tmp.join("snap");
    replica::write_qwen3_moe(&snap, &spec).unwrap();
    let out = tmp.join("moe.gturbo");
    install("qwen3_moe", &snap, &out, &[]);
    (snap, out)
}

/// path → sha256 of every file under `dir`, except the receipt, which records the time
/// of the install by design.
pub fn tree_hashes(dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
                if rel != "verified-install.json" {
                    out.insert(rel, sha256_hex(&std::fs::read(&p).unwrap()));
                }
            }
        }
    }
    out
}

/// `gturbo ARGS…`, run to the end.
pub fn gturbo_args(args: &[&str]) -> Output {
    gturbo().args(args).output().unwrap()
}

/// `gturbo run DIR --json --threads 2 ARGS…`, which must succeed: its JSON document and
/// its stderr (the footer).
pub fn run_json(dir: &Path, args: &[&str]) -> (Value, String) {
    let dir = dir.to_str().unwrap();
    let mut all = vec!["run", dir, "--json", "--threads", "2"];
    all.extend_from_slice(args);
    let o = gturbo_args(&all);
    assert!(o.status.success(), "run {args:?}: {}", text(&o));
    let doc = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&o)));
    (doc, String::from_utf8_lossy(&o.stderr).into_owned())
}
