//! The test hub speaks the protocol the official Python client expects: `hf download`
//! against it yields byte-identical files, with and without the CDN redirect, with tree
//! pagination on. Skipped (reported by `gturbo_testkit::skip`) when the client is not
//! installed, unless the run is strict (CI, `GTURBO_REQUIRE_PY=1`): then it fails.

use std::path::{Path, PathBuf};
use std::process::Command;

use gturbo_testkit::hub::HubConfig;
use gturbo_testkit::skip::require_or_skip;

use crate::support;

/// The CLI command that runs `download`: `hf`, or the older `huggingface-cli`.
fn find_hf_client() -> Result<PathBuf, String> {
    let mut tried = Vec::new();
    for name in ["hf", "huggingface-cli"] {
        match Command::new(name).args(["download", "--help"]).output() {
            Ok(out) if out.status.success() => return Ok(PathBuf::from(name)),
            Ok(out) => tried.push(format!("`{name} download --help` exited {}", out.status)),
            Err(e) => tried.push(format!("`{name}`: {e}")),
        }
    }
    Err(format!(
        "no Hugging Face CLI found ({}); install it with `pip install huggingface_hub`",
        tried.join("; ")
    ))
}

/// The client, or `None` after recording why the test is skipped.
fn client_or_skip(test: &str) -> Option<PathBuf> {
    require_or_skip(test, find_hf_client())
}

fn run_hf_download(client: &Path, endpoint: &str, repo: &str, out: &Path, hf_home: &Path) {
    let output = Command::new(client)
        .args(["download", repo, "--revision", "main", "--local-dir"])
        .arg(out)
        .env("HF_ENDPOINT", endpoint)
        .env("HF_HOME", hf_home)
        .env("HF_HUB_DISABLE_XET", "1")
        .env("HF_HUB_DISABLE_TELEMETRY", "1")
        .env("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        .env_remove("HF_HUB_OFFLINE")
        .env_remove("HF_TOKEN")
        .env_remove("HF_TOKEN_PATH")
        .env_remove("HF_HUB_ENABLE_HF_TRANSFER")
        .output()
        .expect("run the hf client");
    assert!(
        output.status.success(),
        "hf download failed ({}):\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Every file under `dir` (relative, `/`-separated), skipping the client's `.cache`.
fn list_files(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![(dir.to_path_buf(), String::new())];
    while let Some((abs, rel)) = stack.pop() {
        for entry in std::fs::read_dir(&abs).expect("read dir") {
            let entry = entry.expect("dir entry");
            let name = entry.file_name().to_string_lossy().into_owned();
            if rel.is_empty() && name == ".cache" {
                continue;
            }
            let r = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
            };
            if entry.file_type().expect("file type").is_dir() {
                stack.push((entry.path(), r));
            } else {
                out.push(r);
            }
        }
    }
    out.sort();
    out
}

async fn download_and_compare(test: &str, cdn: bool) {
    let Some(client) = client_or_skip(test) else {
        return;
    };
    let tmp = support::temp_dir();
    let snapshot = tmp.path().join("snapshot");
    let files = support::write_small_snapshot(&snapshot);
    let config = HubConfig {
        redirect_to_cdn: cdn,
        // The 3 MB file becomes an LFS file, and a tiny page forces `Link` pagination.
        lfs_threshold: 1024 * 1024,
        tree_page_size: 2,
        ..HubConfig::default()
    };
    let (hub, repo) = support::start_hub("gturbo-test/tiny", &snapshot, config).await;
    let out = tmp.path().join("out");
    let hf_home = tmp.path().join("hf_home");
    let endpoint = hub.url().to_string();
    let (c, o, h, r) = (
        client.clone(),
        out.clone(),
        hf_home.clone(),
        repo.repo.clone(),
    );
    tokio::task::spawn_blocking(move || run_hf_download(&c, &endpoint, &r, &o, &h))
        .await
        .expect("client thread");

    let want: Vec<String> = files.iter().map(|(p, _)| p.clone()).collect();
    assert_eq!(list_files(&out), want, "downloaded file set");
    for (path, bytes) in &files {
        let got = std::fs::read(out.join(path)).expect("read downloaded file");
        assert!(
            got == *bytes,
            "{path}: downloaded {} bytes (sha256 {}), served {} bytes (sha256 {})",
            got.len(),
            support::sha256_hex(&got),
            bytes.len(),
            support::sha256_hex(bytes)
        );
    }
    let stats = hub.stats();
    // 4 files + 3 directories in pages of 2: the client followed `Link` to page 4.
    assert_eq!(stats.tree, 4, "tree pages requested: {stats:?}");
    let lfs = ["model.safetensors", "weights/blob.bin"];
    for (path, _) in &files {
        let f = stats.file(&repo.repo, path);
        let is_lfs = lfs.contains(&path.as_str());
        if cdn && is_lfs {
            assert!(f.cdn >= 1, "{path}: bytes not fetched from the CDN: {f:?}");
        } else {
            assert_eq!(f.cdn, 0, "{path}: {f:?}");
        }
    }
    if !cdn {
        assert_eq!(stats.cdn, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_client_downloads_identical_bytes() {
    download_and_compare("python_client_downloads_identical_bytes", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_client_follows_the_cdn_redirect() {
    download_and_compare("python_client_follows_the_cdn_redirect", true).await;
}
