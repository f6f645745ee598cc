//! Issue 13 ("hostile world, round two"), the network side, through the real binary
//! against the project's hub: no panic on a fatal install error, a bounded end to a
//! stalling or dripping server, source hashes from every place the hub publishes them,
//! a `Retry-After` over the limit, and the CLI bounds (`--threads`, FIFOs in `--from`).

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use gturbo_testkit::hub::{Fault, FaultKind, Hub, HubConfig, HubRepo, PublishedHashes};
use serde_json::Value;

use crate::support::cli::{error_line, gturbo, hub_install, stderr};
use crate::support::{Replica, sha256_hex};

const REPO: &str = Replica::REPO;
/// A shard that holds one INT4-bound matrix, `layers.1.ple.key_proj.weight` [1024, 2560].
const SHARD: &str = "model-00003-of-00006.safetensors";

/// `gturbo install` of the replica from `hub`, with `extra` flags and `env`.
fn install(hub: &Hub, repo: &HubRepo, r: &Replica, out: &Path, extra: &[&str]) -> Output {
    install_env(hub, repo, r, out, extra, &[])
}

fn install_env(
    hub: &Hub,
    repo: &HubRepo,
    r: &Replica,
    out: &Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Output {
    hub_install(hub.url(), &repo.commit, r, out, extra, env)
}

/// Nothing of a refused install is left but what a rerun resumes from: no published
/// directory.
fn assert_not_published(out: &Path) {
    assert!(!out.exists(), "{} was published", out.display());
}

/// Item 1: a fatal error while other reads are in flight (a shard that does not hash to
/// its published SHA-256; a NaN in a matrix) used to panic in 10 of 30 runs, inside
/// tokio, as the runtime shut down under still-running reads. The install owns its read
/// tasks now and stops them before it returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_a_fatal_install_error_never_panics_in_20_runs_each() {
    let r = Replica::new();
    // The hub publishes a hash for SHARD that is not its content (as a server whose
    // ETag/lfs.oid lies would).
    let mut oids = r.true_oids();
    for (p, h) in &mut oids {
        if p == SHARD {
            *h = "0".repeat(64);
        }
    }
    r.publish(&oids);
    let (hub, repo) = r.start(HubConfig::default()).await;
    let flags = ["-q", "--jobs", "4", "--range-mib", "1"];
    for run in 0..20 {
        let out = r.out(&format!("mismatch-{run}.gturbo"));
        let o = install(&hub, &repo, &r, &out, &flags);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "run {run}: {err}");
        assert!(!err.contains("panicked"), "run {run}: {err}");
        assert!(
            err.contains(&format!("{SHARD}: source SHA-256 mismatch")),
            "run {run}: {err}"
        );
        assert_not_published(&out);
    }

    // A NaN in the last element of an INT4-bound matrix: found at the end of a read
    // while the other jobs stream.
    let tensor = "model.language_model.layers.1.ple.key_proj.weight";
    let (at, len) = r.tensor_span(SHARD, tensor);
    let path = r.dir.join(SHARD);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[at + len - 2..at + len].copy_from_slice(&0x7fc0u16.to_le_bytes()); // BF16 NaN
    std::fs::write(&path, &bytes).unwrap();
    r.publish(&r.true_oids());
    let (hub, repo) = r.start(HubConfig::default()).await;
    for run in 0..20 {
        let out = r.out(&format!("nan-{run}.gturbo"));
        let o = install(&hub, &repo, &r, &out, &flags);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "run {run}: {err}");
        assert!(!err.contains("panicked"), "run {run}: {err}");
        assert!(
            err.contains(&format!(
                "tensor `{tensor}`: non-finite weight (inf or NaN) at element {}",
                len / 2 - 1
            )),
            "run {run}: {err}"
        );
        assert_not_published(&out);
    }
}

/// Item 3: a server that stalls every read of a shard ends the install with a clear
/// error naming the shard and the rate, within attempts × the low-speed window (plus
/// backoff); the limits come from flags or environment variables.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_a_stalling_or_dripping_server_ends_the_install_within_the_bound() {
    let r = Replica::new();
    let (hub, repo) = r.start(HubConfig::default()).await;

    // Stall on every read of SHARD after its header read.
    hub.faults()
        .push(Fault::new(FaultKind::Stall).path(SHARD).skip(1).always());
    let out = r.out("stall.gturbo");
    let t = Instant::now();
    let o = install(
        &hub,
        &repo,
        &r,
        &out,
        &["--low-speed-time", "1", "--max-attempts", "2"],
    );
    let took = t.elapsed();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    // 2 attempts × 1 s, 0.5 s of backoff at most, and the rest of the install.
    assert!(took < Duration::from_secs(20), "{took:?}: {err}");
    let line = error_line(&o);
    // Any of the shard's sub-ranges in flight may give up first; it is named.
    assert!(
        line.starts_with(&format!("gturbo: error: {SHARD} (bytes "))
            && line.contains(
                "): too slow, gave up after 2 attempt(s): fewer than 65536 bytes in 1 s (the low-speed limit): 0 bytes in 1."
            )
            && line.contains(" s, 0.0 B/s (from "),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert_not_published(&out);

    // A drip of 100 bytes every 100 ms (1 KB/s), limits from the environment.
    hub.faults().clear();
    hub.faults().push(
        Fault::new(FaultKind::SlowDrip {
            bytes: 100,
            every_ms: 100,
        })
        .path(SHARD)
        .skip(1)
        .always(),
    );
    let out = r.out("drip.gturbo");
    let t = Instant::now();
    let o = install_env(
        &hub,
        &repo,
        &r,
        &out,
        &[],
        &[
            ("GTURBO_LOW_SPEED_LIMIT", "4096"),
            ("GTURBO_LOW_SPEED_TIME", "1"),
            ("GTURBO_MAX_ATTEMPTS", "2"),
        ],
    );
    let took = t.elapsed();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(took < Duration::from_secs(20), "{took:?}: {err}");
    let line = error_line(&o);
    assert!(
        // Sub-ranges of the shard are in flight at once: whichever gives up first is
        // named, with its byte range.
        line.starts_with(&format!("gturbo: error: {SHARD} (bytes ")) && line.contains(
            "too slow, gave up after 2 attempt(s): fewer than 4096 bytes in 1 s (the low-speed limit): "
        ) && line.contains(" B/s (from "),
        "{err}"
    );
    assert_not_published(&out);

    // The range timeout: a drip fast enough for the low-speed limit, too slow for a
    // range of 1 MiB in 1 s.
    hub.faults().clear();
    hub.faults().push(
        Fault::new(FaultKind::SlowDrip {
            bytes: 16 * 1024,
            every_ms: 50,
        })
        .path(SHARD)
        .skip(1)
        .always(),
    );
    let out = r.out("deadline.gturbo");
    let o = install(
        &hub,
        &repo,
        &r,
        &out,
        &["--range-timeout", "1", "--max-attempts", "2"],
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("too slow, gave up after 2 attempt(s): the range timeout of 1 s passed: ")
            && err.contains("KiB/s"),
        "{err}"
    );
    assert_not_published(&out);

    // Nothing scripted: the same hub installs.
    hub.faults().clear();
    let out = r.out("ok.gturbo");
    let o = install(&hub, &repo, &r, &out, &["--low-speed-time", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// Item 4: a mirror whose listing has no `lfs.oid` still publishes the hash in
/// `X-Linked-Etag`; a corrupted body (64 KiB swapped inside a matrix) is caught, where it
/// used to be installed with "0 source shards verified".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_a_corrupted_body_is_caught_through_x_linked_etag() {
    let r = Replica::new();
    let published = r.true_oids();
    r.publish(&published);
    // Swap two 64 KiB blocks inside the matrix: same header, same plan, other bytes.
    let (at, len) = r.tensor_span(SHARD, "model.language_model.layers.1.ple.key_proj.weight");
    assert!(len >= 4 * 65536);
    let path = r.dir.join(SHARD);
    let mut bytes = std::fs::read(&path).unwrap();
    let (a, b) = (at + 65536, at + 3 * 65536);
    let block: Vec<u8> = bytes[a..a + 65536].to_vec();
    bytes.copy_within(b..b + 65536, a);
    bytes[b..b + 65536].copy_from_slice(&block);
    std::fs::write(&path, &bytes).unwrap();
    let config = HubConfig {
        published_hashes: PublishedHashes::LinkedEtag,
        redirect_to_cdn: true,
        ..HubConfig::default()
    };
    let (hub, repo) = r.start(config).await;
    let out = r.out("corrupt.gturbo");
    let o = install(&hub, &repo, &r, &out, &[]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let expected = &published.iter().find(|(p, _)| p == SHARD).unwrap().1;
    assert!(
        err.contains(&format!("{SHARD}: source SHA-256 mismatch"))
            && err.contains(&format!("Expected: {expected}"))
            && err.contains(&format!("Computed: {}", sha256_hex(&bytes))),
        "{err}"
    );
    assert_not_published(&out);
}

/// Item 4: where no hash is published at all, the install says so per shard, the
/// receipt records which shards were verified, and `--require-source-hash` refuses
/// before any weight is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_unpublished_hashes_are_reported_per_shard_recorded_and_can_be_required() {
    let r = Replica::new();
    let shards = r.shards();
    let config = HubConfig {
        published_hashes: PublishedHashes::Nowhere,
        ..HubConfig::default()
    };
    let (hub, repo) = r.start(config).await;

    let out = r.out("required.gturbo");
    hub.reset_stats();
    let o = install(&hub, &repo, &r, &out, &["--require-source-hash"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "gturbo: error: 6 source shards without a published SHA-256 to verify against (--require-source-hash): {}",
            shards.join(", ")
        )),
        "{err}"
    );
    assert_not_published(&out);
    assert!(!r.out("required.gturbo.partial").exists(), "nothing staged");
    // Only header reads (one or two per shard) reached the shards.
    let stats = hub.stats();
    for s in &shards {
        let n = stats.file(REPO, s).ranges.len();
        assert!((1..=2).contains(&n), "{s}: {n} requests");
    }

    let out = r.out("unverified.gturbo");
    let o = install(&hub, &repo, &r, &out, &[]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains(" 0 source shards verified"), "{err}");
    for s in &shards {
        assert!(
            err.contains(&format!("gturbo: {s}: not verified: no published SHA-256")),
            "{s}: {err}"
        );
    }
    let receipt: Value =
        serde_json::from_slice(&std::fs::read(out.join("verified-install.json")).unwrap()).unwrap();
    let recorded: Vec<(String, Value, bool)> = receipt["source_shards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["path"].as_str().unwrap().to_string(),
                s["sha256"].clone(),
                s["verified"].as_bool().unwrap(),
            )
        })
        .collect();
    let want: Vec<(String, Value, bool)> = shards
        .iter()
        .map(|s| (s.clone(), Value::Null, false))
        .collect();
    assert_eq!(recorded, want);

    // verify-install rewrites the receipt and carries the record forward.
    let v = gturbo().arg("verify-install").arg(&out).output().unwrap();
    assert!(v.status.success(), "{}", stderr(&v));
    let again: Value =
        serde_json::from_slice(&std::fs::read(out.join("verified-install.json")).unwrap()).unwrap();
    assert_eq!(again["verified_by"], "verify-install");
    assert_eq!(again["source_shards"], receipt["source_shards"]);

    // The same replica where the hub publishes hashes: every shard verified, recorded.
    let (hub, repo) = r.start(HubConfig::default()).await;
    let out = r.out("verified.gturbo");
    let o = install(&hub, &repo, &r, &out, &["--require-source-hash"]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains(" 6 source shards verified"), "{err}");
    assert!(!err.contains("not verified"), "{err}");
    let receipt: Value =
        serde_json::from_slice(&std::fs::read(out.join("verified-install.json")).unwrap()).unwrap();
    let oids = r.true_oids();
    for (s, (path, sha)) in receipt["source_shards"]
        .as_array()
        .unwrap()
        .iter()
        .zip(&oids)
    {
        assert_eq!(s["path"], path.as_str());
        assert_eq!(s["sha256"], sha.as_str());
        assert_eq!(s["verified"], true);
    }
}

/// Item 7: a `Retry-After` over `--max-retry-wait` on a weight read ends the install
/// after that one request; retries that do happen are all counted in the summary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_retry_after_over_the_limit_is_not_re_requested_and_retries_are_counted() {
    let r = Replica::new();
    let (hub, repo) = r.start(HubConfig::default()).await;
    hub.faults()
        .push(Fault::too_many_requests("86400").path(SHARD).skip(1));
    let out = r.out("wait.gturbo");
    let o = install(
        &hub,
        &repo,
        &r,
        &out,
        &["--max-retry-wait", "10", "--jobs", "1"],
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("server asked to wait 86400 s (Retry-After: 86400), over the 10 s limit"),
        "{err}"
    );
    // The header read, the refused weight read, and nothing after it.
    let ranges = hub.stats().file(REPO, SHARD).ranges;
    assert_eq!(ranges.len(), 2, "{ranges:?} {err}");
    assert_not_published(&out);

    // Two 503s on weight reads of SHARD: retried, and counted.
    hub.faults().clear();
    hub.faults()
        .push(Fault::status(503).path(SHARD).skip(1).times(2));
    let out = r.out("retried.gturbo");
    let o = install(&hub, &repo, &r, &out, &[]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains(", 2 retries"), "{err}");
}

/// Item 15: `--threads` is refused clearly beyond 4 per core (10,000 threads took over
/// a minute for two tokens).
#[test]
fn issue13_threads_beyond_the_bound_are_refused() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let over = (4 * cores + 1).to_string();
    for args in [
        vec!["run", "x.gturbo", "--prompt", "hi", "--threads", &over],
        vec!["eval", "a", "b", "--text", "t", "--threads", &over],
        vec!["verify-install", "x.gturbo", "--threads", &over],
    ] {
        let o = gturbo().args(&args).output().unwrap();
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains(&format!(
                "{over} threads is more than {} (4 per core, {cores} core",
                4 * cores
            )),
            "{args:?}: {err}"
        );
    }
}

/// Item 16: a FIFO inside a `--from` snapshot is named and refused (it used to be
/// skipped, and the install went on without it).
#[test]
fn issue13_a_fifo_in_a_from_snapshot_is_named_and_refused() {
    let r = Replica::new();
    let fifo = r.dir.join("extra.bin");
    assert!(
        Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let out = r.out("fifo.gturbo");
    let o = gturbo()
        .args(["-q", "install", "qwen38flashnext", "--from"])
        .arg(&r.dir)
        .args(["--index-sha256", &r.index_sha, "--out"])
        .arg(&out)
        .output()
        .unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains(": extra.bin: a FIFO (named pipe), not a regular file"),
        "{err}"
    );
    assert_not_published(&out);
}

/// Item 9: the source changed under the same file names (the hub now publishes another
/// SHA-256 for one shard): the refusal to resume names that shard's hash, old and new,
/// where it used to say "another revision, family or flags".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_a_changed_source_hash_is_named_when_the_resume_is_refused() {
    let r = Replica::new();
    let oids = r.true_oids();
    r.publish(&oids);
    let (hub, repo) = r.start(HubConfig::default()).await;
    let out = r.out("changed.gturbo");
    let flags = ["-q", "--range-mib", "1"];
    let o = install_env(
        &hub,
        &repo,
        &r,
        &out,
        &flags,
        &[("GTURBO_TEST_ABORT_AFTER_READS", "2")],
    );
    assert_eq!(o.status.code(), Some(137), "{}", stderr(&o));
    let old = oids.iter().find(|(p, _)| p == SHARD).unwrap().1.clone();
    let new = "ab".repeat(32);
    let changed: Vec<(String, String)> = oids
        .iter()
        .map(|(p, h)| (p.clone(), if p == SHARD { new.clone() } else { h.clone() }))
        .collect();
    r.publish(&changed);
    let (hub, repo) = r.start(HubConfig::default()).await;
    let o = install(&hub, &repo, &r, &out, &flags);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let line = error_line(&o);
    assert!(
        line.contains(&format!(
            " (changed: {SHARD}: published SHA-256: was {old}, now {new}); refusing to mix them"
        )),
        "{line}"
    );
}

/// Item 14: a 2 GB `tokenizer.json` (sparse) is refused from the listing's size before
/// any weight is read: the shards see their header reads and nothing more. It used to
/// be refused only after every weight had streamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_an_oversized_tokenizer_is_refused_before_any_weight_streams() {
    let r = Replica::new();
    let tok = r.dir.join("tokenizer.json");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&tok)
        .unwrap();
    f.set_len(2_000_000_000).unwrap();
    drop(f);
    // Published hashes, so the hub never hashes the 2 GB file for its listing.
    let mut oids = r.true_oids();
    oids.push(("tokenizer.json".into(), "cd".repeat(32)));
    r.publish(&oids);
    let (hub, repo) = r.start(HubConfig::default()).await;
    hub.reset_stats();
    let out = r.out("tok.gturbo");
    let o = install(&hub, &repo, &r, &out, &["-q"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(
        error_line(&o),
        "gturbo: error: tokenizer.json: 2000000000 bytes, more than the 67108864 a tokenizer.json may have; refusing before any weight is read"
    );
    let stats = hub.stats();
    for s in r.shards() {
        let n = stats.file(REPO, &s).ranges.len();
        assert!((1..=2).contains(&n), "{s}: {n} requests");
    }
    assert_eq!(stats.file(REPO, "tokenizer.json").ranges.len(), 0);
    assert_not_published(&out);
}

/// Issue 22, defect 6: a hub served other bytes for every shard (its published hashes
/// right), and a run was stopped with those bytes journaled. The rerun against a clean
/// hub used to fail once per poisoned shard ("source SHA-256 mismatch") before one
/// succeeded; now a shard whose kept pieces fail its hash is fetched again in the same
/// run, said so, and the one rerun publishes the same install as a clean one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue22_a_poisoned_journal_is_cleared_in_one_rerun() {
    let r = Replica::new();
    r.publish(&r.true_oids());
    let clean: Vec<(String, Vec<u8>)> = r
        .shards()
        .into_iter()
        .map(|s| {
            let b = std::fs::read(r.dir.join(&s)).unwrap();
            (s, b)
        })
        .collect();
    // Every shard's first and last data bytes changed in their lowest mantissa bit
    // (finite stays finite), so a read's bytes are wrong but nothing else is.
    for (s, bytes) in &clean {
        let mut b = bytes.clone();
        let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        b[8 + n] ^= 1;
        let last = b.len() - 2;
        b[last] ^= 1;
        std::fs::write(r.dir.join(s), &b).unwrap();
    }
    let (hub, repo) = r.start(HubConfig::default()).await;
    let out = r.out("poisoned.gturbo");
    // Stopped (as if killed) with poisoned reads journaled: one job at a time, so the
    // first shard (5 MB, more than two reads of 1 MiB) has not reached its hash check.
    let flags = ["--range-mib", "1"];
    let o = install_env(
        &hub,
        &repo,
        &r,
        &out,
        &["--range-mib", "1", "--jobs", "1"],
        &[("GTURBO_TEST_ABORT_AFTER_READS", "2")],
    );
    assert_eq!(o.status.code(), Some(137), "{}", stderr(&o));
    drop(hub);

    for (s, bytes) in &clean {
        std::fs::write(r.dir.join(s), bytes).unwrap();
    }
    let (hub, repo) = r.start(HubConfig::default()).await;
    let o = install(&hub, &repo, &r, &out, &flags);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    let refetched: Vec<&str> = err
        .lines()
        .filter(|l| {
            l.starts_with("gturbo: refetch: ")
                && l.ends_with(": the pieces kept from an earlier run do not hash to its published SHA-256; fetching the whole shard again")
        })
        .collect();
    assert!(!refetched.is_empty(), "{err}");
    assert!(!err.contains("mismatch"), "{err}");
    let v = gturbo().arg("verify-install").arg(&out).output().unwrap();
    assert!(v.status.success(), "{}", stderr(&v));

    // The same bytes as an install from the clean hub alone.
    let fresh = r.out("fresh.gturbo");
    let o = install(&hub, &repo, &r, &fresh, &flags);
    assert!(o.status.success(), "{}", stderr(&o));
    let files = |d: &Path| -> Value {
        let m: Value =
            serde_json::from_slice(&std::fs::read(d.join("manifest.json")).unwrap()).unwrap();
        m["files"].clone()
    };
    assert_eq!(files(&out), files(&fresh));
    eprintln!("{}", refetched.join("\n"));
}
