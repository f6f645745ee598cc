//! A published install is never replaced under a running model: readers (`run`, `eval`,
//! `verify-install`) hold the directory's shared lock, `install --overwrite` takes it
//! exclusively, and neither waits (manifests/FORMAT.md, "Concurrent use: the install
//! lock").

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::support::cli::{self, gturbo, moe_install, text};
use crate::support::temp_dir;

/// `gturbo -qq install --family qwen3_moe local/x --from SNAP --out OUT EXTRA…`.
fn install_cmd(snap: &Path, out: &Path, extra: &[&str]) -> Command {
    let mut c = cli::install_cmd("qwen3_moe", snap, out, extra);
    c.arg("-qq");
    c
}

const PROMPT: &str = "5,17,200,33,9,48,310,2,77,120,64,1,250,19,8,400";

fn run_cmd(dir: &Path, max_tokens: &str, json: bool) -> Command {
    let mut c = gturbo();
    c.arg("run").arg(dir).args([
        "--max-tokens",
        max_tokens,
        "--threads",
        "1",
        "--expert-cache-slots",
        "2",
        "--prompt-ids",
        PROMPT,
    ]);
    if json {
        c.arg("--json");
    }
    c
}

fn signal(pid: u32, sig: &str) {
    let o = Command::new("kill")
        .args([sig, &pid.to_string()])
        .output()
        .unwrap();
    assert!(o.status.success(), "kill {sig} {pid}: {}", text(&o));
}

/// The one error `gturbo` printed for an overwrite refused because `out` is in use.
fn in_use_error(out: &Path) -> String {
    format!(
        "gturbo: error: {}: in use: a `gturbo run`, `gturbo eval` or `gturbo verify-install` \
         holds the install's shared lock; --overwrite never replaces an install that is in \
         use\n\nhint: let it finish (or stop it), then rerun this command\n",
        out.display()
    )
}

#[test]
fn an_overwrite_refuses_while_a_run_generates_and_the_run_keeps_its_tokens() {
    let tmp = temp_dir();
    let (snap, out) = moe_install(tmp.path());
    let max_tokens = "256";

    // The undisturbed run: its tokens, and the text streaming mode prints for them.
    let o = run_cmd(&out, max_tokens, true).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let generated = doc["generated_tokens"].as_u64().unwrap();
    assert!(generated >= 64, "the run must last: {doc}");
    let want_text = format!("{}\n", doc["text"].as_str().unwrap());
    let o = run_cmd(&out, max_tokens, false).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout), want_text);

    // The same run again; once it prints its first text it is generating (and holds
    // the install's lock since it opened it). Freeze it there, so the overwrite
    // certainly meets a run in the middle of its generation.
    let mut child = run_cmd(&out, max_tokens, false)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 1];
    stdout.read_exact(&mut first).unwrap();
    signal(child.id(), "-STOP");
    assert!(
        child.try_wait().unwrap().is_none(),
        "the run ended before the overwrite started"
    );

    let o = install_cmd(&snap, &out, &["--overwrite"]).output().unwrap();
    signal(child.id(), "-CONT");
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_eq!(String::from_utf8_lossy(&o.stderr), in_use_error(&out));
    // Refused before anything changed: no staging directory, no journal.
    let partial = |suffix: &str| PathBuf::from(format!("{}{suffix}", out.display()));
    assert!(!partial(".partial").exists());
    assert!(!partial(".partial.journal").exists());

    let mut rest = Vec::new();
    stdout.read_to_end(&mut rest).unwrap();
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(status.success(), "{status:?}: {stderr}");
    let mut got = first.to_vec();
    got.extend(rest);
    assert_eq!(String::from_utf8_lossy(&got), want_text, "{stderr}");
    assert!(
        stderr.contains(&format!("generated {generated};")),
        "{stderr}"
    );

    // With the run gone, the overwrite goes through, and the new install runs the same.
    let o = install_cmd(&snap, &out, &["--overwrite"]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let o = run_cmd(&out, max_tokens, true).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let again: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(again["tokens"], doc["tokens"]);
}

#[test]
fn readers_refuse_an_install_an_overwrite_holds() {
    let tmp = temp_dir();
    let (_, out) = moe_install(tmp.path());
    // Hold the lock exactly as `install --overwrite` does: exclusive, on the directory.
    let held = File::open(&out).unwrap();
    held.try_lock().unwrap();
    let want = format!(
        "gturbo: error: {}: being replaced by `gturbo install --overwrite`, which holds the \
         install's lock; run this again once that install has finished\n",
        out.display()
    );
    let o = run_cmd(&out, "4", true).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_eq!(String::from_utf8_lossy(&o.stderr), want);
    assert!(o.stdout.is_empty(), "{}", text(&o));
    let o = gturbo().arg("verify-install").arg(&out).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_eq!(String::from_utf8_lossy(&o.stderr), want);
    drop(held);
    // Released: both read again (verify rewrites the receipt by rename only).
    let o = run_cmd(&out, "4", true).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let o = gturbo().arg("verify-install").arg(&out).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
}
