//! Issue 9: one read path and one retry budget, concurrency inside a shard through a
//! bounded reorder window (resume, corruption), and `--jobs auto`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use gturbo::source::RangeSource;
use gturbo::source::http::{HttpConfig, HttpSource};
use gturbo_testkit::hub::{Fault, FaultKind, Hub, HubConfig, HubRepo};
use gturbo_testkit::replica::{self, FlashNextSpec};

use crate::support::{self, gturbo_bin, sha256_hex, temp_dir};

const REPO: &str = "Qwen/Qwen3.8-Flash-Next";

/// The gaps between consecutive arrivals.
fn gaps(arrivals: &[Instant]) -> Vec<Duration> {
    arrivals.windows(2).map(|w| w[1] - w[0]).collect()
}

/// Each gap is the one second the server asked for: at least that, and well under the
/// next second (the computed backoff alone would be milliseconds here).
fn assert_waited_as_asked(gaps: &[Duration]) {
    for g in gaps {
        assert!(
            *g >= Duration::from_millis(990) && *g < Duration::from_millis(1800),
            "waits {gaps:?}: each should be the 1 s Retry-After"
        );
    }
}

/// Point 5: `read_range` and `stream_range` are one path with one budget. A server that
/// answers every request `503 Retry-After: 1` sees exactly `max_attempts` requests per
/// read, one second apart, whichever way the read is asked for.
#[tokio::test]
async fn a_server_failing_every_request_is_tried_exactly_the_budget_with_its_waits() {
    const BIN: &str = "weights/blob.bin";
    let tmp = temp_dir();
    support::write_small_snapshot(tmp.path());
    let (hub, _) = support::start_hub(
        "gturbo-test/tiny",
        tmp.path(),
        HubConfig {
            lfs_threshold: 1024 * 1024,
            ..HubConfig::default()
        },
    )
    .await;
    for (how, attempts) in [("read_range", 3usize), ("stream_range", 4)] {
        hub.faults().clear();
        hub.reset_stats();
        let mut c = HttpConfig::new(hub.url(), "gturbo-test/tiny", "main");
        c.max_attempts = attempts;
        c.base_delay = Duration::from_millis(5);
        c.max_delay = Duration::from_millis(50);
        let src = HttpSource::new(c).unwrap();
        src.resolve().await.unwrap();
        hub.faults().push(
            Fault::new(FaultKind::Status {
                code: 503,
                retry_after: Some("1".into()),
            })
            .path(BIN)
            .always(),
        );
        let e = if how == "read_range" {
            src.read_range(BIN, 0..100).await.unwrap_err()
        } else {
            match src.stream_range(BIN, 0..100).await {
                Err(e) => e,
                Ok(_) => panic!("a stream from a server that fails everything"),
            }
        };
        assert!(
            e.to_string().contains("HTTP 503 (bytes 0-99)"),
            "{how}: {e}"
        );
        let f = hub.stats().file("gturbo-test/tiny", BIN);
        assert_eq!(f.ranges.len(), attempts, "{how}: {f:?}");
        assert_waited_as_asked(&gaps(&f.arrivals));
        assert_eq!(src.stats().retries, attempts as u64 - 1, "{how}");
    }
}

struct Replica {
    tmp: tempfile::TempDir,
    dir: PathBuf,
    index_sha: String,
}

impl Replica {
    fn new() -> Replica {
        let tmp = temp_dir();
        let dir = tmp.path().join("snapshot");
        replica::write_flash_next(&dir, &FlashNextSpec::scaled()).unwrap();
        let index_sha =
            sha256_hex(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap());
        Replica {
            tmp,
            dir,
            index_sha,
        }
    }

    fn out(&self, name: &str) -> PathBuf {
        self.tmp.path().join(name)
    }

    async fn start(&self, config: HubConfig) -> (Hub, HubRepo) {
        let repo = HubRepo::new(REPO, &self.dir);
        let hub = gturbo_testkit::hub::start(HubConfig {
            repos: vec![repo.clone()],
            ..config
        })
        .await
        .expect("start the test hub");
        (hub, repo)
    }
}

/// `gturbo install` of the replica from `hub` with `extra` flags and `env`.
fn install(
    hub_url: &str,
    commit: &str,
    r: &Replica,
    out: &Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Output {
    let mut c = Command::new(gturbo_bin());
    c.args(["install", "qwen38flashnext", "--endpoint", hub_url])
        .args(["--revision", commit, "--index-sha256", &r.index_sha])
        .arg("--out")
        .arg(out)
        .args(extra)
        .envs(env.iter().copied())
        .env_remove("HF_TOKEN")
        .stdout(Stdio::null());
    for k in ["GTURBO_MAX_ATTEMPTS", "GTURBO_TEST_ABORT_AFTER_READS"] {
        if !env.iter().any(|(e, _)| *e == k) {
            c.env_remove(k);
        }
    }
    c.output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Point 5 through the installer: nothing above the source retries a read, so a weight
/// read that always fails costs exactly `--max-attempts` requests, spaced by the
/// server's `Retry-After`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_install_against_a_failing_server_spends_exactly_one_budget() {
    const SHARD: &str = "model-00003-of-00006.safetensors";
    let r = Replica::new();
    let (hub, repo) = r.start(HubConfig::default()).await;
    // The header read goes through; every later request of the shard fails.
    hub.faults().push(
        Fault::new(FaultKind::Status {
            code: 503,
            retry_after: Some("1".into()),
        })
        .path(SHARD)
        .skip(1)
        .always(),
    );
    let out = r.out("fail.gturbo");
    let url = hub.url().to_string();
    let o = tokio::task::block_in_place(|| {
        install(
            &url,
            &repo.commit,
            &r,
            &out,
            &["--jobs", "1"],
            &[("GTURBO_MAX_ATTEMPTS", "3")],
        )
    });
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("HTTP 503"), "{err}");
    let f = hub.stats().file(REPO, SHARD);
    assert_eq!(
        f.ranges.len(),
        1 + 3,
        "header read + 3 attempts: {f:?}\n{err}"
    );
    assert_waited_as_asked(&gaps(&f.arrivals[1..]));
    assert!(!out.exists());
}
