//! `gturbo install --dry-run` end to end through the real binary: the full-size
//! Qwen3.8-Flash-Next replica over the local hub, the index pin gate, hostile index
//! names, unmatched tensors, single-file repos and `--family` repos.

use std::path::Path;
use std::process::Output;

use gturbo_testkit::hub::HubConfig;
use gturbo_testkit::replica::{self, FlashNextSpec, Qwen3MoeSpec, Qwen3Spec};
use serde_json::Value;

use crate::support::cli::{gturbo, stderr};
use crate::support::{sha256_hex, start_hub, temp_dir};

/// `gturbo ARGS…` with no Hugging Face home to read a token or cache from.
fn gturbo_homeless(args: &[&str]) -> Output {
    gturbo()
        .args(args)
        .env("HF_HOME", "/nonexistent-gturbo-test-home")
        .output()
        .expect("run gturbo")
}

fn index_sha(dir: &Path) -> String {
    sha256_hex(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap())
}

fn json_stdout(o: &Output) -> Value {
    assert!(o.status.success(), "gturbo failed: {}", stderr(o));
    serde_json::from_slice(&o.stdout).expect("stdout is one JSON document")
}

/// The flagship case: 131 shards, ~360 GB apparent, planned from headers alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_flash_next_replica_over_the_hub_plans_every_tensor_in_two_requests_per_shard() {
    let dir = temp_dir();
    let summary = replica::write_flash_next(dir.path(), &FlashNextSpec::full()).unwrap();
    assert_eq!(summary.shards.len(), 131);
    let config = HubConfig {
        redirect_to_cdn: true,
        hash_on_listing: false,
        ..HubConfig::default()
    };
    let (hub, repo) = start_hub("Qwen/Qwen3.8-Flash-Next", dir.path(), config).await;
    let sha = index_sha(dir.path());
    let url = hub.url().to_string();
    let o = tokio::task::spawn_blocking(move || {
        gturbo_homeless(&[
            "install",
            "qwen38flashnext",
            "--dry-run",
            "--json",
            "--endpoint",
            &url,
            "--revision",
            &repo.commit,
            "--index-sha256",
            &sha,
        ])
    })
    .await
    .unwrap();
    let d = json_stdout(&o);

    // Cost: one tree listing, the index, the config, and two requests per shard
    // (resolve → CDN redirect, then the CDN read of the first 64 KiB).
    assert_eq!(d["shards"]["count"], 131);
    assert_eq!(d["requests"]["headers"], 262);
    assert_eq!(d["requests"]["total"], 265);
    assert_eq!(hub.stats().tree, 1);

    // Every tensor is accounted for: the plan holds exactly the index's tensors.
    let index: Value = serde_json::from_slice(
        &std::fs::read(dir.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let n = index["weight_map"].as_object().unwrap().len() as u64;
    assert_eq!(d["tensors"].as_u64(), Some(n));
    let c = &d["census"];
    let counted: u64 = ["int4", "int8", "passthrough", "excluded"]
        .iter()
        .map(|k| c[k]["tensors"].as_u64().unwrap())
        .sum();
    assert_eq!(counted, n);
    assert_eq!(
        d["source"]["index_total_size"].as_u64(),
        Some(summary.total_size)
    );

    // Sizes from the reference facts, computed here independently of the planner:
    // expert blob = 3 × (640·2560/2 + 2 × 640·2560/64·2) = 2,764,800 → 169 pages.
    let stride = 169 * 16384u64;
    assert_eq!(d["outputs"]["experts"].as_u64(), Some(48 * 512 * stride));
    assert_eq!(d["outputs"]["sidecar_experts"].as_u64(), Some(512 * stride));
    // n-gram rows: 2,500,012 rows of 320 B, 51 per block → 49,020 blocks per shard.
    assert_eq!(d["outputs"]["rows"].as_u64(), Some(128 * 49_020 * 16384));
    let pools = d["expert_pools"].as_array().unwrap();
    assert_eq!(pools[0]["files"], 48);
    assert_eq!(pools[0]["blob_bytes"], 2_764_800);
    assert_eq!(pools[0]["stride"], 2_768_896);
    assert_eq!(d["row_pools"][0]["rows_per_block"], 51);
    assert_eq!(d["row_pools"][0]["rows"], 128 * 2_500_012u64);
    // Routers at INT8 through the family override: one per layer plus MTP, with the
    // one-row shared-expert gates.
    assert_eq!(c["int8"]["tensors"], 98);
    // The vision tower is excluded, not dropped silently.
    assert!(c["excluded"]["tensors"].as_u64().unwrap() > 0);
    let total = &d["outputs"];
    let sum: u64 = ["resident", "experts", "sidecar_experts", "rows", "copied"]
        .iter()
        .map(|k| total[k].as_u64().unwrap())
        .sum();
    assert_eq!(total["total"].as_u64(), Some(sum));
    assert_eq!(d["fingerprint"].as_str().map(str::len), Some(64));
}

#[test]
fn skip_mtp_drops_the_sidecar_pool_and_changes_the_fingerprint() {
    let dir = temp_dir();
    replica::write_flash_next(dir.path(), &FlashNextSpec::scaled()).unwrap();
    let sha = index_sha(dir.path());
    let from = dir.path().to_str().unwrap();
    let with = json_stdout(&gturbo_homeless(&[
        "install",
        "qwen38flashnext",
        "--dry-run",
        "--json",
        "--from",
        from,
        "--index-sha256",
        &sha,
    ]));
    let without = json_stdout(&gturbo_homeless(&[
        "install",
        "qwen38flashnext",
        "--dry-run",
        "--json",
        "--from",
        from,
        "--index-sha256",
        &sha,
        "--skip-mtp",
    ]));
    assert!(with["outputs"]["sidecar_experts"].as_u64().unwrap() > 0);
    assert_eq!(without["outputs"]["sidecar_experts"], 0);
    assert!(
        without["census"]["excluded"]["tensors"].as_u64()
            > with["census"]["excluded"]["tensors"].as_u64()
    );
    assert_ne!(with["fingerprint"], without["fingerprint"]);
    // Same inputs, same plan.
    let again = json_stdout(&gturbo_homeless(&[
        "install",
        "qwen38flashnext",
        "--dry-run",
        "--json",
        "--from",
        from,
        "--index-sha256",
        &sha,
    ]));
    assert_eq!(with["fingerprint"], again["fingerprint"]);
}

#[test]
fn index_pin_mismatch_is_a_hard_gate_printing_both_hashes() {
    let dir = temp_dir();
    replica::write_flash_next(dir.path(), &FlashNextSpec::scaled()).unwrap();
    let computed = index_sha(dir.path());
    let o = gturbo_homeless(&[
        "install",
        "qwen38flashnext",
        "--dry-run",
        "--from",
        dir.path().to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("model.safetensors.index.json: SHA-256 mismatch (pinned by families/qwen38flashnext.json)"), "{err}");
    assert!(
        err.contains("Expected: 99e815241ef03325536b0aaa4441deea45174c17fae31e10f0bb456410c590de"),
        "{err}"
    );
    assert!(err.contains(&format!("Computed: {computed}")), "{err}");
    assert!(o.stdout.is_empty(), "no plan is printed past the gate");
}

/// Copy a small qwen3 snapshot, then let `edit` damage its index.
fn qwen3_with_index(edit: impl Fn(&mut Value)) -> tempfile::TempDir {
    let dir = temp_dir();
    let spec = Qwen3Spec {
        shards: 2,
        ..Qwen3Spec::tiny()
    };
    replica::write_qwen3(dir.path(), &spec).unwrap();
    let p = dir.path().join("model.safetensors.index.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
    dir
}

#[test]
fn traversal_names_in_the_index_are_refused_before_any_read() {
    for (evil, why) in [
        ("../outside.safetensors", "`.` or `..` component"),
        ("/etc/passwd", "absolute path"),
        ("sub\\x.safetensors", "backslash in name"),
    ] {
        let dir = qwen3_with_index(|v| {
            v["weight_map"]["model.norm.weight"] = Value::String(evil.into());
        });
        let o = gturbo_homeless(&[
            "install",
            "--family",
            "qwen3",
            "local/tiny",
            "--dry-run",
            "--from",
            dir.path().to_str().unwrap(),
        ]);
        assert_eq!(o.status.code(), Some(2));
        let err = stderr(&o);
        assert!(
            err.contains(&format!("model.safetensors.index.json weight_map[\"model.norm.weight\"]: unsafe file name {evil:?}: {why}")),
            "{err}"
        );
    }
}

#[test]
fn index_that_disagrees_with_the_headers_names_the_tensor() {
    let dir = qwen3_with_index(|v| {
        v["weight_map"]["model.layers.0.ghost.weight"] =
            Value::String("model-00001-of-00002.safetensors".into());
    });
    let o = gturbo_homeless(&[
        "install",
        "--family",
        "qwen3",
        "local/tiny",
        "--dry-run",
        "--from",
        dir.path().to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("model.safetensors.index.json: field `weight_map.model.layers.0.ghost.weight`: names model-00001-of-00002.safetensors, whose header has no such tensor"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn a_tensor_no_rule_matches_is_an_error_naming_it() {
    let dir = temp_dir();
    replica::write_qwen3(
        dir.path(),
        &Qwen3Spec {
            shards: 1,
            ..Qwen3Spec::tiny()
        },
    )
    .unwrap();
    // A family file that forgot the norms.
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/families/qwen3.json"))
        .unwrap();
    let text = text.replace(
        r#"{ "match": "model.layers.{layer}.{input_layernorm|post_attention_layernorm}.weight", "role": "resident" },"#,
        "",
    );
    let fam = dir.path().join("forgetful.json");
    std::fs::write(&fam, text).unwrap();
    let o = gturbo_homeless(&[
        "install",
        "local/tiny",
        "--family-file",
        fam.to_str().unwrap(),
        "--dry-run",
        "--from",
        dir.path().to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(
        err.contains(
            "model.safetensors: tensor `model.layers.0.input_layernorm.weight` matches no rule of "
        ) && err.contains("forgetful.json; refusing to drop it silently"),
        "{err}"
    );
}

#[test]
fn single_file_repo_without_index_plans() {
    let dir = temp_dir();
    let s = replica::write_qwen3(
        dir.path(),
        &Qwen3Spec {
            shards: 1,
            ..Qwen3Spec::tiny()
        },
    )
    .unwrap();
    assert!(s.index.is_none());
    let d = json_stdout(&gturbo_homeless(&[
        "install",
        "--family",
        "qwen3",
        "local/tiny",
        "--dry-run",
        "--json",
        "--from",
        dir.path().to_str().unwrap(),
    ]));
    assert_eq!(d["shards"]["count"], 1);
    assert_eq!(d["source"]["index_sha256"], Value::Null);
    assert_eq!(d["tensors"].as_u64(), Some(s.tensors as u64));
    assert!(d["census"]["int4"]["tensors"].as_u64().unwrap() > 0);
    // Norms stay at their source dtype.
    assert!(d["census"]["passthrough"]["tensors"].as_u64().unwrap() > 0);
}

/// Unfused experts (Qwen3-MoE layout) over HTTP with `--family`: one pool per layer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn family_repo_over_the_hub_packs_unfused_experts() {
    let dir = temp_dir();
    let spec = Qwen3MoeSpec::tiny();
    replica::write_qwen3_moe(dir.path(), &spec).unwrap();
    let (hub, _) = start_hub("someone/tiny-moe", dir.path(), HubConfig::default()).await;
    let url = hub.url().to_string();
    let o = tokio::task::spawn_blocking(move || {
        gturbo_homeless(&[
            "install",
            "--family",
            "qwen3_moe",
            "someone/tiny-moe",
            "--dry-run",
            "--json",
            "--endpoint",
            &url,
        ])
    })
    .await
    .unwrap();
    let d = json_stdout(&o);
    let (h, i, e) = (
        spec.hidden_size,
        spec.moe_intermediate_size,
        spec.num_experts,
    );
    let blob = 3 * (i * h / 2 + 2 * (i * h / 64 * 2));
    let stride = blob.div_ceil(16384) * 16384;
    assert_eq!(
        d["expert_pools"][0]["files"].as_u64(),
        Some(spec.num_hidden_layers)
    );
    assert_eq!(d["expert_pools"][0]["blob_bytes"].as_u64(), Some(blob));
    assert_eq!(
        d["outputs"]["experts"].as_u64(),
        Some(spec.num_hidden_layers * e * stride)
    );
    assert!(
        d["warnings"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w.as_str().unwrap().contains("is not pinned"))
    );
    assert_eq!(d["source"]["commit"].as_str().map(str::len), Some(40));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_and_gated_repos_fail_fast_without_leaking_the_token() {
    let dir = temp_dir();
    replica::write_qwen3(
        dir.path(),
        &Qwen3Spec {
            shards: 1,
            ..Qwen3Spec::tiny()
        },
    )
    .unwrap();
    let config = HubConfig {
        gated: vec!["org/gated".into()],
        token: Some("hf_right_token".into()),
        ..HubConfig::default()
    };
    let (hub, _) = start_hub("org/gated", dir.path(), config).await;
    let url = hub.url().to_string();
    let (missing, gated) = tokio::task::spawn_blocking(move || {
        let missing = gturbo_homeless(&[
            "install",
            "--family",
            "qwen3",
            "org/nope",
            "--dry-run",
            "--endpoint",
            &url,
        ]);
        let gated = gturbo()
            .args([
                "-vv",
                "install",
                "--family",
                "qwen3",
                "org/gated",
                "--dry-run",
                "--endpoint",
                &url,
            ])
            .env("HF_TOKEN", "hf_wrong_secret_token")
            .output()
            .unwrap();
        (missing, gated)
    })
    .await
    .unwrap();
    assert_eq!(missing.status.code(), Some(2));
    assert!(
        stderr(&missing).contains("HTTP 404: not found"),
        "{}",
        stderr(&missing)
    );
    assert_eq!(gated.status.code(), Some(2));
    let err = stderr(&gated);
    assert!(
        // A token was sent: the hint says it was refused (issue 13, item 10).
        err.contains(
            "HTTP 401: access denied with the token given: it is invalid, expired or revoked"
        ),
        "{err}"
    );
    assert!(
        !err.contains("hf_wrong_secret_token"),
        "token leaked into -vv output: {err}"
    );
    // Failing fast: no retries on 401/404.
    assert!(hub.stats().revision <= 2, "{:?}", hub.stats().revision);
}

#[test]
fn families_lists_pins_and_runners() {
    let o = gturbo_homeless(&["families", "--json"]);
    let d = json_stdout(&o);
    let fams = d["families"].as_array().unwrap();
    let flash = fams.iter().find(|f| f["id"] == "qwen38flashnext").unwrap();
    assert_eq!(
        flash["revision"],
        "de4b8e4d43b917e7706784d8bb445c9af86a3540"
    );
    assert_eq!(
        flash["index_sha256"],
        "99e815241ef03325536b0aaa4441deea45174c17fae31e10f0bb456410c590de"
    );
    assert_eq!(flash["runner"], "flash-next");
    let text = String::from_utf8(gturbo_homeless(&["families"]).stdout).unwrap();
    assert!(
        text.lines().any(|l| l.starts_with("qwen38flashnext")
            && l.contains("Qwen/Qwen3.8-Flash-Next")
            && l.ends_with("flash-next")),
        "{text}"
    );
}
