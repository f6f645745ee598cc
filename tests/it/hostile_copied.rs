//! Issue 22, items 2 and 3, through the real binary: the files an install copies
//! verbatim (`config.json`, the tokenizer, the chat template) are checked against the
//! hash their source publishes (the git blob id of a file not in LFS) and the receipt
//! records it, and a `tokenizer.json` whose patterns would cost `gturbo run` gigabytes
//! is refused at install, at verify and at run, naming the file and the field.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use gturbo_testkit::hub::{Fault, FaultKind, Hub, HubConfig, HubRepo};
use gturbo_testkit::replica::{self, Qwen3Spec};
use serde_json::Value;

use crate::support::cli::{error_line, gturbo, install_cmd, text};
use crate::support::{sha256_hex, start_hub, temp_dir};

const REPO: &str = "Org/tiny-qwen3";

/// The git blob id of `bytes` (what `git hash-object` prints), computed here rather than
/// by gturbo, which it checks.
fn git_blob_sha1(bytes: &[u8]) -> String {
    use sha1::Digest as _;
    let mut h = sha1::Sha1::new();
    h.update(format!("blob {}\0", bytes.len()));
    h.update(bytes);
    hex::encode(h.finalize())
}

/// A tiny dense Qwen3 snapshot under `dir`.
fn snapshot(dir: &Path) -> PathBuf {
    replica::write_qwen3(dir, &Qwen3Spec::tiny()).unwrap();
    dir.to_path_buf()
}

/// `gturbo install` of the tiny Qwen3 from `hub`.
fn hub_install(hub: &Hub, repo: &HubRepo, out: &Path, extra: &[&str]) -> Output {
    gturbo()
        .args([
            "install",
            "--family",
            "qwen3",
            REPO,
            "--endpoint",
            hub.url(),
        ])
        .args(["--revision", &repo.commit, "--out"])
        .arg(out)
        .args(extra)
        .output()
        .unwrap()
}

/// `gturbo install` of the tiny Qwen3 from a local folder.
fn local_install(snap: &Path, out: &Path, extra: &[&str]) -> Output {
    install_cmd("qwen3", snap, out, extra).output().unwrap()
}

/// `gturbo ARGS… DIR`.
fn gturbo_on(args: &[&str], dir: &Path) -> Output {
    gturbo().args(args).arg(dir).output().unwrap()
}

/// `bytes` with the first `from` replaced by `to`, of the same length.
fn swapped(bytes: &[u8], from: &str, to: &str) -> Vec<u8> {
    assert_eq!(from.len(), to.len());
    let at = bytes
        .windows(from.len())
        .position(|w| w == from.as_bytes())
        .unwrap_or_else(|| panic!("{from:?} not found"));
    let mut out = bytes.to_vec();
    out[at..at + to.len()].copy_from_slice(to.as_bytes());
    out
}

/// The same-length tampering of each copied file the issue found installed: another
/// `rms_norm_eps`, another id for a vocabulary entry, another chat template.
fn tampered(snap: &Path, file: &str) -> Vec<u8> {
    let honest = std::fs::read(snap.join(file)).unwrap();
    let out = match file {
        "config.json" => {
            let v: Value = serde_json::from_slice(&honest).unwrap();
            let eps = v["rms_norm_eps"].to_string();
            let other = eps.replace('6', "5");
            assert_ne!(eps, other, "{eps}");
            swapped(
                &honest,
                &format!("\"rms_norm_eps\": {eps}"),
                &format!("\"rms_norm_eps\": {other}"),
            )
        }
        "tokenizer.json" => swapped(&honest, "\"h\": 104", "\"h\": 105"),
        "tokenizer_config.json" => swapped(&honest, "assistant", "attacker!"),
        _ => unreachable!(),
    };
    assert_eq!(out.len(), honest.len());
    assert_ne!(out, honest);
    out
}

fn receipt(out: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(out.join("verified-install.json")).unwrap()).unwrap()
}

/// Item 2: a hub that keeps the listing and the ETags but serves other bytes of the same
/// length for a copied file used to get them installed (exit 0; `verify-install` passed).
/// Each is refused now, exit 1, naming the file and both git blob ids, and nothing is
/// published; `config.json` is refused before the planner reads it (`--dry-run` too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue22_a_copied_file_with_other_bytes_of_the_same_length_is_refused_naming_it() {
    let tmp = temp_dir();
    let snap = snapshot(&tmp.path().join("snap"));
    let (hub, repo) = start_hub(REPO, &snap, HubConfig::default()).await;
    for file in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        let honest = std::fs::read(snap.join(file)).unwrap();
        let bad = tampered(&snap, file);
        hub.faults().clear();
        hub.faults().push(
            Fault::new(FaultKind::SwappedBody(bad.clone()))
                .path(file)
                .always(),
        );
        let out = tmp.path().join(format!("{file}.gturbo"));
        let runs: &[&[&str]] = if file == "config.json" {
            &[&["-q", "--dry-run"], &["-q"]]
        } else {
            &[&["-q"]]
        };
        for extra in runs {
            let o = hub_install(&hub, &repo, &out, extra);
            assert_eq!(o.status.code(), Some(1), "{file} {extra:?}: {}", text(&o));
            assert_eq!(
                error_line(&o),
                format!(
                    "gturbo: error: {file}: source git blob id mismatch: the bytes read are not the published file"
                ),
                "{}",
                text(&o)
            );
            let err = text(&o);
            assert!(
                err.contains(&format!("  Expected: {}\n", git_blob_sha1(&honest))),
                "{err}"
            );
            assert!(
                err.contains(&format!("  Computed: {}\n", git_blob_sha1(&bad))),
                "{err}"
            );
            assert!(!out.exists(), "{file}: published");
        }
    }
}

/// Item 2: an honest install from the hub records every copied file's git blob id in its
/// receipt, verified; `verify-install` carries the record forward and checks the files
/// against it, so a copied file changed afterwards fails (the manifest's SHA-256 already
/// caught that), and so does one whose manifest entry and receipt were forged to match.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue22_the_receipt_records_the_copied_files_hashes_and_verify_checks_them() {
    let tmp = temp_dir();
    let snap = snapshot(&tmp.path().join("snap"));
    let (hub, repo) = start_hub(REPO, &snap, HubConfig::default()).await;
    let out = tmp.path().join("m.gturbo");
    let o = hub_install(&hub, &repo, &out, &["--require-source-hash"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(!text(&o).contains("not verified"), "{}", text(&o));
    let r = receipt(&out);
    let copied = r["source_copied"].as_array().expect("source_copied");
    let mut names: Vec<&str> = copied.iter().map(|c| c["path"].as_str().unwrap()).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json"
        ]
    );
    for c in copied {
        let path = c["path"].as_str().unwrap();
        let bytes = std::fs::read(snap.join(path)).unwrap();
        assert_eq!(c["file"], format!("tokenizer/{path}"), "{c}");
        assert_eq!(c["git_oid"], git_blob_sha1(&bytes).as_str(), "{c}");
        assert_eq!(c["sha256"], Value::Null, "{c}");
        assert_eq!(c["verified"], true, "{c}");
    }
    let o = gturbo_on(&["verify-install"], &out);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(receipt(&out)["source_copied"], r["source_copied"]);

    // A copied file changed afterwards (same length): the manifest's hash fails it.
    let cfg = out.join("tokenizer/tokenizer_config.json");
    let honest = std::fs::read(&cfg).unwrap();
    let bad = swapped(&honest, "assistant", "attacker!");
    std::fs::write(&cfg, &bad).unwrap();
    let o = gturbo_on(&["verify-install"], &out);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("tokenizer/tokenizer_config.json: sha256: "),
        "{}",
        text(&o)
    );

    // The manifest's entry and the receipt forged to match the changed file: the
    // source's blob id, as the receipt recorded it, still fails it.
    let mpath = out.join("manifest.json");
    let mut m: Value = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    for f in m["files"].as_array_mut().unwrap() {
        if f["path"] == "tokenizer/tokenizer_config.json" {
            f["sha256"] = Value::from(sha256_hex(&bad));
        }
    }
    let mbytes = {
        let mut b = serde_json::to_vec_pretty(&m).unwrap();
        b.push(b'\n');
        b
    };
    std::fs::write(&mpath, &mbytes).unwrap();
    let mut forged = receipt(&out);
    forged["manifest_sha256"] = Value::from(sha256_hex(&mbytes));
    for f in forged["files"].as_array_mut().unwrap() {
        if f["path"] == "tokenizer/tokenizer_config.json" {
            f["sha256"] = Value::from(sha256_hex(&bad));
        }
    }
    std::fs::write(
        out.join("verified-install.json"),
        serde_json::to_vec_pretty(&forged).unwrap(),
    )
    .unwrap();
    let o = gturbo_on(&["verify-install"], &out);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains(&format!(
            "tokenizer/tokenizer_config.json: source git blob id: {} on disk, the source (tokenizer_config.json) published {}",
            git_blob_sha1(&bad),
            git_blob_sha1(&honest)
        )),
        "{}",
        text(&o)
    );
}

/// `models--Org--Name` (a Hugging Face cache) holding `snap`'s files: shards as blobs
/// named by their SHA-256, the other files as blobs named by their git blob id when
/// `named_copies`, else as plain files in the snapshot folder (which name no hash).
fn hf_cache(base: &Path, snap: &Path, named_copies: bool) -> PathBuf {
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let repo = base.join("models--Org--Name");
    let snapshot = repo.join("snapshots").join(commit);
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::write(repo.join("refs/main"), commit).unwrap();
    for e in std::fs::read_dir(snap).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().to_string_lossy().into_owned();
        let bytes = std::fs::read(e.path()).unwrap();
        let blob = if name.ends_with(".safetensors") {
            sha256_hex(&bytes)
        } else if named_copies {
            git_blob_sha1(&bytes)
        } else {
            std::fs::write(snapshot.join(&name), &bytes).unwrap();
            continue;
        };
        std::fs::write(repo.join("blobs").join(&blob), &bytes).unwrap();
        std::os::unix::fs::symlink(Path::new("../../blobs").join(&blob), snapshot.join(&name))
            .unwrap();
    }
    snapshot
}

/// Item 2 for local sources: a Hugging Face cache names each blob by its hash, so its
/// copied files are verified too; a plain folder publishes none, so they are installed
/// unverified, said per file, and `--require-source-hash` refuses them (it used to pass
/// where every shard had its SHA-256).
#[test]
fn issue22_local_sources_verify_copies_where_they_name_a_hash_and_require_covers_them() {
    let tmp = temp_dir();
    let snap = snapshot(&tmp.path().join("snap"));

    let named = hf_cache(&tmp.path().join("a"), &snap, true);
    let out = tmp.path().join("named.gturbo");
    let o = local_install(&named, &out, &["--require-source-hash"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(!text(&o).contains("not verified"), "{}", text(&o));
    for c in receipt(&out)["source_copied"].as_array().unwrap() {
        assert_eq!(c["verified"], true, "{c}");
    }
    // A cached blob changed on disk (same length) is refused naming the file.
    let cfg = std::fs::read(named.join("tokenizer_config.json")).unwrap();
    let blob = std::fs::canonicalize(named.join("tokenizer_config.json")).unwrap();
    std::fs::write(&blob, swapped(&cfg, "assistant", "attacker!")).unwrap();
    let o = local_install(&named, &tmp.path().join("x.gturbo"), &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert_eq!(
        error_line(&o),
        "gturbo: error: tokenizer_config.json: source git blob id mismatch: the bytes read are not the published file"
    );

    let plain = hf_cache(&tmp.path().join("b"), &snap, false);
    let out = tmp.path().join("plain.gturbo");
    let o = local_install(&plain, &out, &["--require-source-hash"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert_eq!(
        error_line(&o),
        "gturbo: error: 4 files to copy without a published hash (git blob id or SHA-256) to verify against (--require-source-hash): config.json, generation_config.json, tokenizer.json, tokenizer_config.json"
    );
    assert!(!out.exists());
    // Without the flag the install goes ahead and says which files it could not prove.
    let o = local_install(&plain, &out, &[]);
    assert!(o.status.success(), "{}", text(&o));
    for f in ["config.json", "tokenizer.json"] {
        assert!(
            text(&o).contains(&format!("gturbo: {f}: not verified: no published hash")),
            "{}",
            text(&o)
        );
    }
    for c in receipt(&out)["source_copied"].as_array().unwrap() {
        assert_eq!(
            (&c["git_oid"], &c["verified"]),
            (&Value::Null, &Value::Bool(false)),
            "{c}"
        );
    }
    let o = gturbo_on(&["verify-install"], &out);
    assert!(o.status.success(), "{}", text(&o));
}

/// A tokenizer.json whose pre-tokenizer splits on one pattern of `pattern_bytes` bytes
/// (a regex that matches only itself, so it compiles), after the honest ByteLevel step.
fn hostile_tokenizer(honest: &[u8], pattern_bytes: usize) -> Vec<u8> {
    let mut v: Value = serde_json::from_slice(honest).unwrap();
    let split = serde_json::json!({
        "type": "Split",
        "pattern": { "Regex": "q".repeat(pattern_bytes) },
        "behavior": "Isolated",
        "invert": false
    });
    v["pre_tokenizer"] = serde_json::json!({
        "type": "Sequence",
        "pretokenizers": [v["pre_tokenizer"].clone(), split]
    });
    serde_json::to_vec(&v).unwrap()
}

const FIELD: &str = "pre_tokenizer.pretokenizers[1].pattern.Regex";

/// Item 3: a tokenizer.json with a 1 MB pre-tokenizer pattern used to be installed (and
/// a 10 MB one took `gturbo run` to 3.1 GiB and 16 s). The install refuses it, naming
/// the file and the field, before anything is published.
#[test]
fn issue22_a_tokenizer_with_a_huge_pattern_is_refused_at_install_naming_file_and_field() {
    let tmp = temp_dir();
    let snap = snapshot(&tmp.path().join("snap"));
    let honest = std::fs::read(snap.join("tokenizer.json")).unwrap();
    std::fs::write(
        snap.join("tokenizer.json"),
        hostile_tokenizer(&honest, 1 << 20),
    )
    .unwrap();
    let out = tmp.path().join("m.gturbo");
    let o = local_install(&snap, &out, &["-q"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_eq!(
        error_line(&o),
        format!(
            "gturbo: error: tokenizer.json: field `{FIELD}`: a pattern of 1048576 bytes, more than the 65536 accepted (compiling it would take memory and time in proportion)"
        )
    );
    assert!(!out.exists());
    // A real-sized pattern is fine.
    std::fs::write(snap.join("tokenizer.json"), hostile_tokenizer(&honest, 200)).unwrap();
    let out = tmp.path().join("ok.gturbo");
    let o = local_install(&snap, &out, &["-q"]);
    assert!(o.status.success(), "{}", text(&o));
}

/// Item 3, the run side: an install whose tokenizer.json was swapped afterwards for one
/// with a 1 MB pattern (its manifest entry rewritten to match, so the layout checks
/// pass on sizes) is refused by `gturbo run` in well under a second of work, before the
/// tokenizers crate sees it, naming the file and the field; `verify-install`,
/// `doctor` and the library's loader name it too.
#[test]
fn issue22_a_run_of_an_install_whose_tokenizer_is_out_of_bounds_fails_fast() {
    let tmp = temp_dir();
    let snap = snapshot(&tmp.path().join("snap"));
    let out = tmp.path().join("m.gturbo");
    let o = local_install(&snap, &out, &["-q"]);
    assert!(o.status.success(), "{}", text(&o));
    let tok = out.join("tokenizer/tokenizer.json");
    let bad = hostile_tokenizer(&std::fs::read(&tok).unwrap(), 1 << 20);
    std::fs::write(&tok, &bad).unwrap();
    let mpath = out.join("manifest.json");
    let mut m: Value = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    for f in m["files"].as_array_mut().unwrap() {
        if f["path"] == "tokenizer/tokenizer.json" {
            f["bytes"] = Value::from(bad.len());
            f["sha256"] = Value::from(sha256_hex(&bad));
        }
    }
    std::fs::write(&mpath, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    let want = format!(
        "tokenizer/tokenizer.json: {FIELD}: a pattern of 1048576 bytes, more than the 65536 accepted"
    );

    let started = Instant::now();
    let o = gturbo()
        .args(["run"])
        .arg(&out)
        .args(["--prompt", "hello", "--max-tokens", "1"])
        .output()
        .unwrap();
    let took = started.elapsed();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(error_line(&o).contains(&want), "{}", text(&o));
    assert!(took < Duration::from_secs(10), "{took:?}");

    let o = gturbo_on(&["verify-install"], &out);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains(&want), "{}", text(&o));
    let o = gturbo_on(&["doctor", "--json"], &out);
    assert!(text(&o).contains(&want), "{}", text(&o));

    let e = gturbo::runtime::text::TextCodec::load(&out).unwrap_err();
    assert!(
        matches!(&e, gturbo::runtime::text::TextError::Field { field, .. } if field == FIELD),
        "{e:?}"
    );
}
