//! The streaming install end to end through the real binary: dry-run bytes equal
//! installed bytes, the manifest's hashes match the disk, and interrupted installs
//! (a test hook that exits like a kill after N journaled reads, and a real SIGKILL)
//! resume to byte-identical output, refetching only what was not journaled.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use gturbo_testkit::hub::HubConfig;
use gturbo_testkit::replica;
use gturbo_testkit::skip::require_or_skip;
use serde_json::Value;

use crate::support::cli::{gturbo, hub_install, stderr, tree_hashes};
use crate::support::{Replica, sha256_hex, start_hub, temp_dir};

fn install(r: &Replica, out: &Path, extra: &[&str], abort_after: Option<u64>) -> Output {
    let mut c = gturbo();
    c.args(["-q", "install", "qwen38flashnext", "--from"])
        .arg(&r.dir)
        .args(["--index-sha256", &r.index_sha, "--out"])
        .arg(out)
        .args(extra);
    if let Some(n) = abort_after {
        c.env("GTURBO_TEST_ABORT_AFTER_READS", n.to_string());
    }
    c.output().unwrap()
}

fn summary_numbers(stderr: &str) -> (u64, u64, u64) {
    // "... N reads fetched, K kept from a previous run, D damaged and redone, ..."
    let line = stderr
        .lines()
        .find(|l| l.contains("reads fetched"))
        .unwrap_or_else(|| panic!("no summary in: {stderr}"));
    let num = |key: &str| -> u64 {
        let before = &line[..line.find(key).unwrap()];
        before
            .trim_end()
            .rsplit(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    (
        num(" reads fetched"),
        num(" kept from"),
        num(" damaged and"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scaled_flash_next_over_http_installs_exactly_the_planned_bytes() {
    let r = Replica::new();
    let config = HubConfig {
        redirect_to_cdn: true,
        ..HubConfig::default()
    };
    let (hub, repo) = start_hub("Qwen/Qwen3.8-Flash-Next", &r.dir, config).await;
    let url = hub.url().to_string();
    let out = r.dir.parent().unwrap().join("flash.gturbo");
    let (plan, inst) = {
        let (url, out, sha, commit) = (
            url.clone(),
            out.clone(),
            r.index_sha.clone(),
            repo.commit.clone(),
        );
        tokio::task::spawn_blocking(move || {
            let base = [
                "install",
                "qwen38flashnext",
                "--endpoint",
                &url,
                "--revision",
                &commit,
                "--index-sha256",
                &sha,
                "--json",
                "--jobs",
                "3",
                "--tile-kib",
                "16",
                "--out",
            ];
            let mut dry = base.to_vec();
            dry.push(out.to_str().unwrap());
            dry.push("--dry-run");
            let plan = gturbo().args(&dry).output().unwrap();
            let inst = gturbo().args(base).arg(&out).output().unwrap();
            (plan, inst)
        })
        .await
        .unwrap()
    };
    assert!(plan.status.success(), "{}", stderr(&plan));
    assert!(inst.status.success(), "{}", stderr(&inst));
    let plan: Value = serde_json::from_slice(&plan.stdout).unwrap();

    // Dry-run bytes == installed bytes, file by file kind and in total.
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    let on_disk = tree_hashes(&out);
    let mut total = 0u64;
    let mut by_kind: BTreeMap<String, u64> = BTreeMap::new();
    for f in manifest["files"].as_array().unwrap() {
        let path = f["path"].as_str().unwrap();
        let bytes = std::fs::metadata(out.join(path)).unwrap().len();
        assert_eq!(f["bytes"].as_u64(), Some(bytes), "{path}");
        assert_eq!(
            on_disk.get(path).map(String::as_str),
            f["sha256"].as_str(),
            "{path}: manifest hash vs disk"
        );
        total += bytes;
        *by_kind
            .entry(f["kind"].as_str().unwrap().to_string())
            .or_default() += bytes;
    }
    assert_eq!(Some(total), plan["outputs"]["total"].as_u64());
    assert_eq!(
        by_kind.get("resident").copied(),
        plan["outputs"]["resident"].as_u64()
    );
    assert_eq!(
        by_kind.get("rows").copied(),
        plan["outputs"]["rows"].as_u64()
    );
    let experts = plan["outputs"]["experts"].as_u64().unwrap()
        + plan["outputs"]["sidecar_experts"].as_u64().unwrap();
    assert_eq!(by_kind.get("experts").copied(), Some(experts));
    // Nothing but the listed files, the manifest (and the receipt, which `tree_hashes`
    // leaves out), and no staging leftovers.
    assert_eq!(
        on_disk.len(),
        manifest["files"].as_array().unwrap().len() + 1
    );
    assert!(out.join("verified-install.json").is_file());
    let receipt: Value =
        serde_json::from_slice(&std::fs::read(out.join("verified-install.json")).unwrap()).unwrap();
    assert_eq!(
        receipt["manifest_sha256"].as_str(),
        on_disk.get("manifest.json").map(String::as_str)
    );
    assert_eq!(
        receipt["files"].as_array().unwrap().len(),
        manifest["files"].as_array().unwrap().len()
    );
    assert_eq!(receipt["verified_by"], "install");
    assert_eq!(
        receipt["source_commit"].as_str(),
        Some(repo.commit.as_str())
    );
    assert!(
        !r.dir
            .parent()
            .unwrap()
            .join("flash.gturbo.partial")
            .exists()
    );
    assert!(
        !r.dir
            .parent()
            .unwrap()
            .join("flash.gturbo.partial.journal")
            .exists()
    );
    assert_eq!(
        manifest["source"]["commit"].as_str(),
        Some(repo.commit.as_str())
    );
    assert_eq!(manifest["plan_fingerprint"], plan["fingerprint"]);
    assert_eq!(
        manifest["arch"]["required_axes"].as_array().unwrap().len(),
        8,
        "MTP is a carried sidecar, not a required axis"
    );

    // The resident file opens with its magic and index length.
    let head = std::fs::read(out.join("resident.bin")).unwrap();
    assert_eq!(&head[..8], b"GTRBRES1");

    // An independent check of every region (Python + MLX), where the peers exist.
    check_with_python(&r.dir, &out);
}

/// `scripts/peers/check_install.py` recomputes every output region from the source tensors
/// with numpy and MLX; a strict run (CI, GTURBO_REQUIRE_PY=1) requires it.
fn check_with_python(snapshot: &Path, out: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/peers/check_install.py");
    let probe = Command::new("python3")
        .args(["-c", "import numpy, mlx.core, jsonschema"])
        .status();
    let available = script.exists() && matches!(probe, Ok(s) if s.success());
    let checker = if available {
        Ok(())
    } else {
        Err(
            "independent check: scripts/peers/check_install.py with numpy, mlx[cpu] and jsonschema \
             not available (scripts/venv.sh test installs them)"
                .to_string(),
        )
    };
    if require_or_skip("check_with_python", checker).is_none() {
        return;
    }
    // The manifest conforms to the published JSON Schema, and the schema bites.
    let schema = Path::new(env!("CARGO_MANIFEST_DIR")).join("manifests/manifest.schema.json");
    let validate = |manifest: &Path| {
        Command::new("python3")
            .args(["-c", "import json,sys,jsonschema; jsonschema.validate(json.load(open(sys.argv[2])), json.load(open(sys.argv[1])))"])
            .arg(&schema)
            .arg(manifest)
            .output()
            .unwrap()
    };
    let v = validate(&out.join("manifest.json"));
    assert!(
        v.status.success(),
        "manifest fails its schema: {}",
        String::from_utf8_lossy(&v.stderr)
    );
    let mut bad: Value =
        serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    bad["files"][0]["path"] = Value::String("../escape.bin".into());
    let bad_path = out.parent().unwrap().join("bad-manifest.json");
    std::fs::write(&bad_path, serde_json::to_vec(&bad).unwrap()).unwrap();
    assert!(
        !validate(&bad_path).status.success(),
        "the schema accepted a `..` path"
    );
    let o = Command::new("python3")
        .arg(script)
        .arg(snapshot)
        .arg(out)
        .arg("--all")
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "independent check failed:\n{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Small ranges (1 MiB) give the scaled replica enough reads to interrupt it at many
/// points.
const SMALL_RANGES: &[&str] = &["--range-mib", "1", "--jobs", "2"];

#[test]
fn killed_installs_resume_to_identical_bytes_refetching_only_unjournaled_reads() {
    let r = Replica::new();
    let base = r.dir.parent().unwrap();
    let reference = base.join("reference.gturbo");
    let o = install(&r, &reference, SMALL_RANGES, None);
    assert!(o.status.success(), "{}", stderr(&o));
    let (total_reads, kept, _) = summary_numbers(&stderr(&o));
    assert_eq!(kept, 0);
    assert!(
        total_reads >= 20,
        "only {total_reads} reads; the test needs more interruption points"
    );
    let want = tree_hashes(&reference);

    for (i, k) in [1, 3, 7, total_reads / 2, total_reads - 1]
        .into_iter()
        .enumerate()
    {
        let out = base.join(format!("kill{i}.gturbo"));
        let o = install(&r, &out, SMALL_RANGES, Some(k));
        assert_eq!(
            o.status.code(),
            Some(137),
            "abort after {k}: {}",
            stderr(&o)
        );
        assert!(!out.exists(), "nothing is published before the end");
        let o = install(&r, &out, SMALL_RANGES, None);
        assert!(o.status.success(), "resume after {k}: {}", stderr(&o));
        let (fetched, kept, damaged) = summary_numbers(&stderr(&o));
        // Every journaled read is kept; only the rest (including what was in flight
        // at the kill) is fetched again.
        assert_eq!(
            (kept, damaged, fetched),
            (k, 0, total_reads - k),
            "resume after {k}"
        );
        assert_eq!(
            tree_hashes(&out),
            want,
            "resume after {k}: bytes differ from the uninterrupted install"
        );
    }
}

#[test]
fn real_sigkill_mid_stream_resumes_to_identical_bytes() {
    let r = Replica::new();
    let base = r.dir.parent().unwrap();
    let reference = base.join("reference.gturbo");
    assert!(install(&r, &reference, SMALL_RANGES, None).status.success());
    let out = base.join("killed.gturbo");
    let journal = base.join("killed.gturbo.partial.journal");
    let mut child = gturbo()
        .args(["-q", "install", "qwen38flashnext", "--from"])
        .arg(&r.dir)
        .args(["--index-sha256", &r.index_sha, "--out"])
        .arg(&out)
        .args(["--range-mib", "1", "--jobs", "1", "--tile-kib", "4"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Kill -9 once a few reads are journaled (the journal's first two lines are its
    // header and the plan's facts).
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut killed_mid_stream = false;
    while Instant::now() < deadline {
        let lines = std::fs::read_to_string(&journal)
            .map(|t| t.lines().count())
            .unwrap_or(0);
        if lines >= 5 {
            child.kill().unwrap(); // SIGKILL
            killed_mid_stream = true;
            break;
        }
        if child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = child.wait();
    assert!(
        killed_mid_stream,
        "the install finished before it could be killed"
    );
    assert!(!out.exists());
    let o = install(&r, &out, SMALL_RANGES, None);
    assert!(o.status.success(), "{}", stderr(&o));
    let (_, kept, _) = summary_numbers(&stderr(&o));
    assert!(kept >= 3, "journaled reads were not kept: {}", stderr(&o));
    assert_eq!(tree_hashes(&out), tree_hashes(&reference));
}

#[test]
fn another_plan_refuses_the_partial_install_and_damage_is_redone() {
    let r = Replica::new();
    let base = r.dir.parent().unwrap();
    let reference = base.join("reference.gturbo");
    assert!(install(&r, &reference, SMALL_RANGES, None).status.success());
    let out = base.join("p.gturbo");
    assert_eq!(
        install(&r, &out, SMALL_RANGES, Some(6)).status.code(),
        Some(137)
    );

    // Other flags, other fingerprint: refused, exit 1, the journal named.
    let o = install(&r, &out, &["--range-mib", "2"], None);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("p.gturbo.partial.journal: the partial install was planned with fingerprint"),
        "{err}"
    );
    assert!(err.contains("--discard-partial"), "{err}");

    // Damage one byte that a journaled read wrote: find, through the emitted plan, a
    // resident tensor inside the first journaled read, and flip its first byte.
    let plan_path = base.join("plan.json");
    let o = install(
        &r,
        &base.join("unused.gturbo"),
        &[
            "--range-mib",
            "1",
            "--dry-run",
            "--emit-plan",
            plan_path.to_str().unwrap(),
        ],
        None,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let plan: Value = serde_json::from_slice(&std::fs::read(&plan_path).unwrap()).unwrap();
    let journal = std::fs::read_to_string(base.join("p.gturbo.partial.journal")).unwrap();
    // Line 1 is the head, line 2 the plan's facts; then one line per read.
    let journaled: Vec<usize> = journal
        .lines()
        .skip(2)
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["read"]
                .as_u64()
                .unwrap() as usize
        })
        .collect();
    assert_eq!(journaled.len(), 6);
    let payload_start = plan["outputs"]["resident"]["payload_start"]
        .as_u64()
        .unwrap();
    let entries = plan["outputs"]["resident"]["index"]["tensors"]
        .as_array()
        .unwrap();
    let target = journaled.iter().find_map(|&ri| {
        let read = &plan["reads"][ri];
        plan["tensors"].as_array().unwrap().iter().find_map(|t| {
            let inside = t["shard"] == read["shard"]
                && t["src"][0].as_u64() >= read["start"].as_u64()
                && t["src"][1].as_u64() <= read["end"].as_u64();
            (inside && t["dest"]["kind"] == "resident").then(|| {
                let e = &entries[t["dest"]["entry"].as_u64().unwrap() as usize];
                let span = if e["data"].is_object() {
                    &e["data"]
                } else {
                    &e["weights"]
                };
                payload_start + span["offset"].as_u64().unwrap()
            })
        })
    });
    let at = target.expect("a journaled read holding a resident tensor") as usize;
    let resident = base.join("p.gturbo.partial/resident.bin");
    let mut bytes = std::fs::read(&resident).unwrap();
    bytes[at] ^= 0x5a;
    std::fs::write(&resident, &bytes).unwrap();
    let o = install(&r, &out, SMALL_RANGES, None);
    assert!(o.status.success(), "{}", stderr(&o));
    let (_, kept, damaged) = summary_numbers(&stderr(&o));
    assert!(
        damaged >= 1,
        "the damaged read was not detected: {}",
        stderr(&o)
    );
    assert_eq!(kept + damaged, 6);
    assert_eq!(tree_hashes(&out), tree_hashes(&reference));

    // --discard-partial starts over under another plan.
    let out2 = base.join("q.gturbo");
    assert_eq!(
        install(&r, &out2, SMALL_RANGES, Some(2)).status.code(),
        Some(137)
    );
    let o = install(&r, &out2, &["--range-mib", "2", "--discard-partial"], None);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(summary_numbers(&stderr(&o)).1, 0);
}

#[test]
fn an_existing_output_and_a_held_lock_are_refused() {
    let r = Replica::new();
    let base = r.dir.parent().unwrap();
    let out = base.join("x.gturbo");
    assert!(install(&r, &out, &[], None).status.success());
    let before = tree_hashes(&out);
    let o = install(&r, &out, &[], None);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("x.gturbo already exists; pass --overwrite to replace it"),
        "{}",
        stderr(&o)
    );
    let o = install(&r, &out, &["--overwrite"], None);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(tree_hashes(&out), before);

    let other = base.join("y.gturbo");
    let lock = std::fs::File::create(base.join("y.gturbo.partial.lock")).unwrap();
    lock.lock().unwrap();
    let o = install(&r, &other, &[], None);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("y.gturbo.partial.lock is locked by another gturbo install"),
        "{}",
        stderr(&o)
    );
    drop(lock);
}

fn http_install(
    url: &str,
    commit: &str,
    r: &Replica,
    out: &Path,
    extra: &[&str],
    abort_after: Option<u64>,
) -> Output {
    let n = abort_after.map(|n| n.to_string());
    let env: Vec<(&str, &str)> = n
        .iter()
        .map(|n| ("GTURBO_TEST_ABORT_AFTER_READS", n.as_str()))
        .collect();
    hub_install(url, commit, r, out, extra, &env)
}

fn verified_count(stderr: &str) -> u64 {
    let line = stderr
        .lines()
        .find(|l| l.contains("source shards verified"))
        .unwrap_or_else(|| panic!("{stderr}"));
    let before = &line[..line.find(" source shards verified").unwrap()];
    before.rsplit(' ').next().unwrap().parse().unwrap()
}

/// Every shard is hashed front to back against the hub's `lfs.oid`, and a resumed
/// install still proves every shard from the hash state in the journal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_shards_are_verified_across_a_resume() {
    let r = Replica::new();
    let (hub, repo) = start_hub("Qwen/Qwen3.8-Flash-Next", &r.dir, HubConfig::default()).await;
    let url = hub.url().to_string();
    let base = r.dir.parent().unwrap().to_path_buf();
    let shards = std::fs::read_dir(&r.dir)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".safetensors")
        })
        .count() as u64;
    let outcome = tokio::task::spawn_blocking(move || {
        let reference = base.join("ref.gturbo");
        let whole = http_install(
            &url,
            &repo.commit,
            &r,
            &reference,
            &["--range-mib", "1", "--jobs", "2"],
            None,
        );
        let out = base.join("v.gturbo");
        let killed = http_install(
            &url,
            &repo.commit,
            &r,
            &out,
            &["--range-mib", "1", "--jobs", "2"],
            Some(5),
        );
        let resumed = http_install(
            &url,
            &repo.commit,
            &r,
            &out,
            &["--range-mib", "1", "--jobs", "2"],
            None,
        );
        (
            whole,
            killed,
            resumed,
            tree_hashes(&reference),
            tree_hashes(&out),
        )
    })
    .await
    .unwrap();
    let (whole, killed, resumed, want, got) = outcome;
    assert!(whole.status.success(), "{}", stderr(&whole));
    assert_eq!(verified_count(&stderr(&whole)), shards);
    assert_eq!(killed.status.code(), Some(137), "{}", stderr(&killed));
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    assert_eq!(
        summary_numbers(&stderr(&resumed)).1,
        5,
        "{}",
        stderr(&resumed)
    );
    assert_eq!(
        verified_count(&stderr(&resumed)),
        shards,
        "{}",
        stderr(&resumed)
    );
    assert_eq!(got, want);
}

/// A shard whose bytes changed behind the published hash stops the install, names the
/// shard and both hashes, and publishes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_that_does_not_match_its_published_hash_is_refused() {
    let r = Replica::new();
    let (hub, repo) = start_hub("Qwen/Qwen3.8-Flash-Next", &r.dir, HubConfig::default()).await;
    let url = hub.url().to_string();
    let base = r.dir.parent().unwrap().to_path_buf();
    let outcome = tokio::task::spawn_blocking(move || {
        // The listing hashes every file once; a dry run makes the hub list the tree.
        let dry = http_install(
            &url,
            &repo.commit,
            &r,
            &base.join("d.gturbo"),
            &["--dry-run"],
            None,
        );
        assert!(dry.status.success(), "{}", stderr(&dry));
        // Flip the last byte of the first shard (the vision tower comes first in the
        // state dict and is excluded, so the plan does not change).
        let shard = r.dir.join("model-00001-of-00006.safetensors");
        let mut bytes = std::fs::read(&shard).unwrap();
        let published = sha256_hex(&bytes);
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&shard, &bytes).unwrap();
        let out = base.join("bad.gturbo");
        let o = http_install(&url, &repo.commit, &r, &out, &[], None);
        (o, published, sha256_hex(&bytes), out.exists())
    })
    .await
    .unwrap();
    let (o, published, tampered, published_dir) = outcome;
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("model-00001-of-00006.safetensors: source SHA-256 mismatch"),
        "{err}"
    );
    assert!(err.contains(&format!("Expected: {published}")), "{err}");
    assert!(err.contains(&format!("Computed: {tampered}")), "{err}");
    assert!(
        !published_dir,
        "nothing is published after a source mismatch"
    );
}

/// A tmpfs of a given size, unmounted on drop (root only; CI runs as root).
struct SmallDisk {
    path: PathBuf,
}

impl SmallDisk {
    fn mount(path: PathBuf, mib: u64) -> Option<SmallDisk> {
        std::fs::create_dir_all(&path).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(&path)
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        ok.then_some(SmallDisk { path })
    }

    fn grow(&self, mib: u64) {
        let ok = Command::new("mount")
            .args(["-o", &format!("remount,size={mib}m")])
            .arg(&self.path)
            .status()
            .unwrap()
            .success();
        assert!(ok, "remount {}", self.path.display());
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.path).status();
    }
}

#[test]
fn a_full_disk_is_refused_up_front_and_enospc_mid_install_stays_resumable() {
    let r = Replica::new();
    let base = r.dir.parent().unwrap();
    let reference = base.join("reference.gturbo");
    assert!(install(&r, &reference, SMALL_RANGES, None).status.success());
    let disk = SmallDisk::mount(base.join("disk"), 8)
        .ok_or_else(|| "cannot mount a tmpfs here (not root?); CI runs as root".to_string());
    let Some(disk) = require_or_skip("a_full_disk_is_refused_up_front", disk) else {
        return;
    };
    let out = disk.path.join("m.gturbo");

    // The 12 MB install does not fit 8 MB: refused before writing, with the figures.
    let o = install(&r, &out, SMALL_RANGES, None);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("m.gturbo.partial: not enough free space: the rest of the install needs"),
        "{err}"
    );

    // Past the preflight, the disk fills up mid-stream: a clear error, and resumable.
    let o = gturbo()
        .args(["-q", "install", "qwen38flashnext", "--from"])
        .arg(&r.dir)
        .args(["--index-sha256", &r.index_sha, "--out"])
        .arg(&out)
        .args(SMALL_RANGES)
        .env("GTURBO_TEST_SKIP_SPACE_CHECK", "1")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("no space left on device") && err.contains("rerun the same command to resume"),
        "{err}"
    );
    assert!(!out.exists());

    disk.grow(128); // the output plus the 64 MiB reserve
    let o = install(&r, &out, SMALL_RANGES, None);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(tree_hashes(&out), tree_hashes(&reference));
}

/// A +inf weight in a tensor bound for INT4 stops the install, naming the tensor and
/// the element; nothing is published.
#[test]
fn a_non_finite_weight_is_refused_naming_tensor_and_element() {
    let tmp = temp_dir();
    let dir = tmp.path().join("snap");
    let spec = replica::Qwen3Spec {
        shards: 1,
        ..replica::Qwen3Spec::tiny()
    };
    replica::write_qwen3(&dir, &spec).unwrap();
    let shard = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let name = "model.layers.0.mlp.up_proj.weight";
    let begin = header[name]["data_offsets"][0].as_u64().unwrap() as usize;
    assert_eq!(header[name]["dtype"], "BF16");
    let at = 8 + n + begin + 2 * 1000; // element 1000 of the tensor
    bytes[at..at + 2].copy_from_slice(&0x7f80u16.to_le_bytes()); // BF16 +inf
    std::fs::write(&shard, &bytes).unwrap();
    let out = tmp.path().join("inf.gturbo");
    let o = gturbo()
        .args(["-q", "install", "--family", "qwen3", "local/tiny", "--from"])
        .arg(&dir)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("tensor `model.layers.0.mlp.up_proj.weight`: non-finite weight (inf or NaN) at element 1000"),
        "{}",
        stderr(&o)
    );
    assert!(!out.exists());
}
