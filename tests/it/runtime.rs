//! `gturbo run`: the family capability gate, agreement with mlx-lm on the same INT4
//! weights (goldens from `scripts/golden/gen_runtime_golden.py`), and expert streaming
//! through a bounded slot cache.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use gturbo::runtime::experts::ExpertMode;
use gturbo::runtime::generate::{self, argmax};
use gturbo::runtime::kernels::Cpu;
use gturbo::runtime::load::{self, LoadOptions};
use gturbo::runtime::models::decoder::Model;
use gturbo_testkit::replica::{self, FlashNextSpec, Qwen3MoeSpec, Qwen3Spec};
use gturbo_testkit::skip::require_or_skip;
use serde_json::Value;

use crate::support::cli::{gturbo, install, moe_install, text};
use crate::support::{rewrite_as_manifest_1_0, sha256_hex, temp_dir};

fn run(dir: &Path, args: &[&str]) -> Output {
    gturbo().arg("run").arg(dir).args(args).output().unwrap()
}

/// The one line `gturbo` printed on stderr: its error line, and nothing else.
fn sole_error_line(o: &Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "expected one stderr line: {}", text(o));
    lines[0].to_string()
}

#[test]
fn a_flash_next_install_requiring_an_axis_its_runner_lacks_is_refused_before_any_weight_is_read() {
    let tmp = temp_dir();
    let snap = tmp.path().join("snap");
    replica::write_flash_next(&snap, &FlashNextSpec::scaled()).unwrap();
    let index_sha = sha256_hex(&std::fs::read(snap.join("model.safetensors.index.json")).unwrap());
    let out = tmp.path().join("flash.gturbo");
    let o = gturbo()
        .args(["-q", "install", "qwen38flashnext", "--from"])
        .arg(&snap)
        .args(["--index-sha256", &index_sha, "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "install: {}", text(&o));
    // MTP is a carried sidecar the runner never reads; a manifest that claims the
    // runner must implement it is refused, naming the axis.
    let path = out.join("manifest.json");
    let mut m: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let axes = m["arch"]["required_axes"].as_array_mut().unwrap();
    assert!(!axes.contains(&Value::from("multiTokenPrediction")));
    axes.push(Value::from("multiTokenPrediction"));
    std::fs::write(&path, serde_json::to_vec(&m).unwrap()).unwrap();
    // Every weight file gone: the gate must answer from manifest.json alone.
    std::fs::remove_file(out.join("resident.bin")).unwrap();
    std::fs::remove_dir_all(out.join("packed_experts")).unwrap();
    std::fs::remove_dir_all(out.join("ple")).unwrap();
    let o = run(&out, &["--prompt-ids", "1,2,3"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert_eq!(
        sole_error_line(&o),
        "gturbo: error: family qwen38flashnext is installed but its runner flash-next lacks \
         axes; missing axes: multiTokenPrediction"
    );
    assert!(o.stdout.is_empty(), "{}", text(&o));
}

/// A tiny qwen3 install in `tmp`, from the golden's seed.
pub(crate) fn qwen3_install(tmp: &Path, seed: u64) -> PathBuf {
    let snap = tmp.join("snap");
    replica::write_qwen3(
        &snap,
        &Qwen3Spec {
            seed,
            ..Qwen3Spec::tiny()
        },
    )
    .unwrap();
    let out = tmp.join("q3.gturbo");
    install("qwen3", &snap, &out, &[]);
    out
}

#[test]
fn a_manifest_claiming_an_axis_no_runner_implements_is_refused() {
    // `gturbo run` reads the manifest as it is (the receipt's manifest hash is
    // verify-install's business); the gate still refuses what it cannot run.
    let tmp = temp_dir();
    let out = qwen3_install(tmp.path(), 0);
    let path = out.join("manifest.json");
    let mut m: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let axes = m["arch"]["required_axes"].as_array_mut().unwrap();
    axes.insert(1, Value::from("slidingWindowAttention"));
    axes.push(Value::from("hyperConnectionsLowRank"));
    std::fs::write(&path, serde_json::to_vec(&m).unwrap()).unwrap();
    let o = run(&out, &["--prompt-ids", "1,2,3"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert_eq!(
        sole_error_line(&o),
        "gturbo: error: family qwen3 is installed but its runner decoder lacks axes; missing \
         axes: slidingWindowAttention, hyperConnectionsLowRank"
    );
}

#[test]
fn an_install_written_before_manifest_1_1_runs_with_the_same_tokens() {
    let tmp = temp_dir();
    let out = qwen3_install(tmp.path(), 0);
    let args = ["--prompt-ids", "1,2,3", "--max-tokens", "6", "--json"];
    let tokens = |o: &Output| -> Value {
        assert!(o.status.success(), "{}", text(o));
        serde_json::from_slice::<Value>(&o.stdout).unwrap()["tokens"].clone()
    };
    let new = tokens(&run(&out, &args));
    assert!(new.as_array().is_some_and(|t| !t.is_empty()), "{new}");
    let old_bytes = rewrite_as_manifest_1_0(&out);
    assert_eq!(tokens(&run(&out, &args)), new);
    assert_eq!(std::fs::read(out.join("manifest.json")).unwrap(), old_bytes);
}

#[test]
fn families_lists_the_runner_of_each_family() {
    let o = gturbo().args(["families", "--json"]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let doc: Value = serde_json::from_slice(&o.stdout).unwrap();
    let runners: Vec<(String, Value)> = doc["families"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| (f["id"].as_str().unwrap().to_string(), f["runner"].clone()))
        .collect();
    assert_eq!(
        runners,
        vec![
            ("deepseek_v3".to_string(), Value::from("deepseek_v3")),
            ("glm4_moe".to_string(), Value::from("glm4_moe")),
            ("gpt_oss".to_string(), Value::from("gpt_oss")),
            ("llama".to_string(), Value::from("decoder")),
            ("minimax_m2".to_string(), Value::Null),
            ("mixtral".to_string(), Value::from("mixtral")),
            ("qwen3".to_string(), Value::from("decoder")),
            ("qwen38flashnext".to_string(), Value::from("flash-next")),
            ("qwen3_moe".to_string(), Value::from("decoder")),
            ("qwen3_next".to_string(), Value::from("qwen3_next")),
        ]
    );
    let o = gturbo().arg("families").output().unwrap();
    let table = String::from_utf8_lossy(&o.stdout);
    let flash = table
        .lines()
        .find(|l| l.starts_with("qwen38flashnext"))
        .unwrap();
    assert!(flash.ends_with("flash-next"), "{table}");
    let q3 = table.lines().find(|l| l.starts_with("qwen3 ")).unwrap();
    assert!(q3.ends_with("decoder"), "{table}");
}

// ------------------------------------------------------------------ mlx-lm parity

struct Golden {
    seed: u64,
    prompt: Vec<u32>,
    logits: Vec<Vec<f32>>,
    greedy: Vec<u32>,
}

fn golden(family: &str) -> Golden {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("tests/data/runtime_golden_{family}.json"));
    let v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(v["family"], family);
    let ids = |k: &str| -> Vec<u32> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    Golden {
        seed: v["seed"].as_u64().unwrap(),
        prompt: ids("prompt"),
        greedy: ids("greedy"),
        logits: v["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                r.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap() as f32)
                    .collect()
            })
            .collect(),
    }
}

/// Largest |gturbo − mlx-lm| logit difference accepted. Both sides compute in f32
/// on bit-identical INT4 weights; what differs is summation order and RoPE angle
/// rounding (~1e-6 relative), plus the golden's 6-decimal rounding (5e-7); measured
/// worst case 9.5e-7.
const LOGIT_TOLERANCE: f32 = 1e-5;

fn check_against_golden(dir: &Path, g: &Golden, experts: ExpertMode) {
    let install = load::open(
        dir,
        LoadOptions {
            experts,
            ..Default::default()
        },
    )
    .unwrap();
    let cpu = Cpu::new(2);
    let model = Model::new(&install, &cpu).unwrap();
    let vocab = model.cfg.vocab;
    let mut s = model.session();
    let logits = model.forward(&mut s, &g.prompt, true).unwrap();
    assert_eq!(logits.len(), g.prompt.len() * vocab);
    let mut worst = (0.0f32, 0, 0);
    for (p, want) in g.logits.iter().enumerate() {
        for (i, &w) in want.iter().enumerate() {
            let d = (logits[p * vocab + i] - w).abs();
            if d > worst.0 {
                worst = (d, p, i);
            }
        }
    }
    eprintln!(
        "max |gturbo - mlx-lm| logit difference: {:.2e} at position {} token {}",
        worst.0, worst.1, worst.2
    );
    assert!(
        worst.0 <= LOGIT_TOLERANCE,
        "logit at position {} token {} differs by {} (> {LOGIT_TOLERANCE})",
        worst.1,
        worst.2,
        worst.0
    );
    let out = generate::generate(&model, &g.prompt, g.greedy.len(), &[], argmax, |_| {}).unwrap();
    assert_eq!(out.tokens, g.greedy);
}

#[test]
fn qwen3_int4_matches_mlx_lm_logits_and_greedy_tokens() {
    let g = golden("qwen3");
    let tmp = temp_dir();
    let out = qwen3_install(tmp.path(), g.seed);
    check_against_golden(&out, &g, ExpertMode::Slots(1));
}

#[test]
fn qwen3_moe_int4_matches_mlx_lm_logits_and_greedy_tokens() {
    let g = golden("qwen3_moe");
    let tmp = temp_dir();
    let snap = tmp.path().join("snap");
    replica::write_qwen3_moe(
        &snap,
        &Qwen3MoeSpec {
            seed: g.seed,
            ..Qwen3MoeSpec::tiny()
        },
    )
    .unwrap();
    let out = tmp.path().join("moe.gturbo");
    install("qwen3_moe", &snap, &out, &[]);
    for mode in [ExpertMode::Slots(2), ExpertMode::Resident] {
        check_against_golden(&out, &g, mode);
    }
}

// ------------------------------------------------------------------ expert streaming

fn run_json(dir: &Path, args: &[&str]) -> Value {
    let mut all = vec![
        "--json",
        "--max-tokens",
        "24",
        "--threads",
        "2",
        "--prompt-ids",
    ];
    all.push("5,17,200,33,9,48,310,2,77,120,64,1,250,19,8,400");
    all.extend_from_slice(args);
    let o = run(dir, &all);
    assert!(o.status.success(), "run {args:?}: {}", text(&o));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&o)))
}

/// Allowance over resident weights plus cache slots: the binary, its heap and the
/// KV cache (the process baseline measured ~10 MiB).
const RSS_OVERHEAD: u64 = 24 << 20;

#[test]
fn experts_stream_through_2_or_16_slots_with_the_tokens_of_resident_mode() {
    let tmp = temp_dir();
    let (_, out) = moe_install(tmp.path());
    let m: Value =
        serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    let pools: u64 = m["expert_pools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["file_bytes"].as_u64().unwrap())
        .sum();
    let resident = run_json(&out, &["--resident-experts"]);
    let two = run_json(&out, &["--expert-cache-slots", "2"]);
    let sixteen = run_json(&out, &["--expert-cache-slots", "16"]);
    let tokens = |v: &Value| v["tokens"].clone();
    assert_eq!(tokens(&resident).as_array().unwrap().len(), 24);
    assert_eq!(tokens(&two), tokens(&resident));
    assert_eq!(tokens(&sixteen), tokens(&resident));
    let slot = two["expert_slot_bytes"].as_u64().unwrap();
    assert!(
        pools >= 4 * 16 * slot,
        "pools {pools} < 4 × 16 slots of {slot}"
    );
    // More slots, more hits; resident mode never reads.
    let hits = |v: &Value, k: &str| v["expert_cache"][k].as_u64().unwrap();
    assert!(
        hits(&sixteen, "misses") < hits(&two, "misses"),
        "{sixteen} vs {two}"
    );
    assert_eq!(hits(&resident, "misses"), 0);
    assert_eq!(
        hits(&two, "hits") + hits(&two, "misses"),
        hits(&resident, "hits"),
        "every mode looks up the same experts"
    );
    if let Some(peak) = two["peak_rss_bytes"].as_u64() {
        let resident_bytes = two["resident_bytes"].as_u64().unwrap();
        let bound = resident_bytes + 2 * slot + RSS_OVERHEAD;
        eprintln!("2 slots: peak RSS {peak} B, bound {bound} B (pools {pools} B)");
        assert!(peak <= bound, "peak RSS {peak} > {bound}");
    }
}

// ------------------------------------------------------------------ SmolLM2 (real model)

/// INT4 and BF16 installs of the SmolLM2 snapshot from `scripts/fetch_smollm2.sh`
/// (GTURBO_SMOLLM2_SNAPSHOT overrides `target/smollm2/snapshot`), made once per test
/// run; `None` after recording the skip when the snapshot is absent (a failure in a
/// strict run: CI, GTURBO_REQUIRE_PY=1).
pub(crate) fn smollm2(test: &str) -> Option<&'static (PathBuf, PathBuf, PathBuf)> {
    static INSTALLS: std::sync::OnceLock<Option<(PathBuf, PathBuf, PathBuf)>> =
        std::sync::OnceLock::new();
    let snap = std::env::var_os("GTURBO_SMOLLM2_SNAPSHOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target/smollm2/snapshot"));
    if !snap.join("model.safetensors.index.json").is_file() {
        let why = format!(
            "no SmolLM2 snapshot at {} (run scripts/fetch_smollm2.sh)",
            snap.display()
        );
        return require_or_skip(test, Err(why));
    }
    INSTALLS
        .get_or_init(|| {
            // Kept for the whole test run (several tests share the installs).
            let tmp = crate::support::run_dir("smollm2-installs");
            let (int4, bf16) = (tmp.join("smol-int4.gturbo"), tmp.join("smol-bf16.gturbo"));
            install("llama", &snap, &int4, &[]);
            install("llama", &snap, &bf16, &["--quant", "bf16"]);
            Some((snap, int4, bf16))
        })
        .as_ref()
}

#[test]
fn smollm2_int4_continues_the_capital_of_france_with_paris() {
    let Some((_, int4, _)) = smollm2("smollm2_int4_continues_the_capital_of_france_with_paris")
    else {
        return;
    };
    let o = run(
        int4,
        &[
            "--prompt",
            "The capital of France is",
            "--max-tokens",
            "3",
            "--json",
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        v["prompt_ids"],
        serde_json::json!([504, 3575, 282, 4649, 314])
    );
    let t = v["text"].as_str().unwrap();
    assert!(t.starts_with(" Paris"), "INT4 continued with {t:?}");
}

#[test]
fn smollm2_bf16_answers_the_chat_question_naming_paris_and_stops_at_im_end() {
    let Some((_, int4, bf16)) = smollm2("smollm2_bf16_answers_the_chat_question") else {
        return;
    };
    let chat = [
        "--chat",
        "What is the capital of France?",
        "--system",
        "",
        "--max-tokens",
        "48",
        "--json",
    ];
    let o = run(bf16, &chat);
    assert!(o.status.success(), "{}", text(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let answer = v["text"].as_str().unwrap();
    assert_eq!(v["stop"], "eos", "{v}");
    assert_eq!(
        v["tokens"].as_array().unwrap().last(),
        Some(&Value::from(2)),
        "ends at <|im_end|> (id 2)"
    );
    assert!(answer.contains("Paris"), "BF16 answered {answer:?}");
    // The INT4 answer is reported as it comes (re-quantised Q4_1 weights lose quality).
    let o = run(int4, &chat);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
    eprintln!(
        "BF16 chat answer: {answer:?}\nINT4 chat answer: {:?} (stop {})",
        v["text"], v["stop"]
    );
}

/// A paragraph for the longer greedy comparison and the INT4-vs-BF16 KL figure.
const PARAGRAPH: &str = "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. \
It is named after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889.";

#[test]
fn smollm2_bf16_matches_mlx_lm_greedy_tokens_for_32_steps() {
    let Some((snap, _, bf16)) = smollm2("smollm2_bf16_matches_mlx_lm_greedy_tokens_for_32_steps")
    else {
        return;
    };
    let o = run(
        bf16,
        &["--prompt", PARAGRAPH, "--max-tokens", "32", "--json"],
    );
    assert!(o.status.success(), "{}", text(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let ids = serde_json::to_string(&v["prompt_ids"]).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/peers/mlx_lm_greedy.py");
    let peer = Command::new("python3")
        .arg(script)
        .arg(snap)
        .arg(&ids)
        .arg("32")
        .output();
    let peer = match peer {
        Ok(p) if p.status.success() => Ok(p),
        Ok(p) => Err(format!(
            "mlx-lm comparison: scripts/peers/mlx_lm_greedy.py failed: {}",
            String::from_utf8_lossy(&p.stderr)
        )),
        Err(e) => Err(format!("mlx-lm comparison: cannot run python3: {e}")),
    };
    let Some(peer) = require_or_skip("mlx-lm comparison", peer) else {
        return;
    };
    let want: Value = serde_json::from_slice(&peer.stdout).unwrap();
    assert_eq!(v["tokens"], want, "gturbo {} vs mlx-lm {want}", v["tokens"]);
}

#[test]
fn smollm2_int4_stays_close_to_bf16_by_kl_divergence() {
    let Some((_, int4, bf16)) = smollm2("smollm2_int4_stays_close_to_bf16_by_kl_divergence") else {
        return;
    };
    let tmp = temp_dir();
    let para = tmp.path().join("paragraph.txt");
    std::fs::write(&para, PARAGRAPH).unwrap();
    let o = gturbo()
        .arg("eval")
        .args([int4, bf16])
        .arg("--text")
        .arg(&para)
        .arg("--json")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    eprintln!("SmolLM2 INT4 vs BF16 over the paragraph: {v}");
    let kl = v["mean_kl_nats"].as_f64().unwrap();
    let top1 = v["top1_agreement"].as_f64().unwrap();
    assert!(v["positions"].as_u64().unwrap() >= 40, "{v}");
    // Re-quantising Q4_1-derived weights costs quality (measured: mean KL 0.87 nats,
    // top-1 agreement 56% over this paragraph, and the INT4 chat answer still names
    // Paris); a broken INT4 path (nibble order, scales) gives several nats and
    // near-zero agreement.
    assert!(kl > 0.0 && kl < 2.0, "mean KL {kl}");
    assert!(top1 > 0.4, "top-1 agreement {top1}");
}

// ------------------------------------------------------------------ input errors

#[test]
fn input_the_install_cannot_run_is_reported_as_input_with_exit_2() {
    let tmp = temp_dir();
    let out = qwen3_install(tmp.path(), 0);
    // A token id past the vocabulary is the caller's, not a fault of the install.
    let o = run(&out, &["--prompt-ids", "1,4000000000"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let line = sole_error_line(&o);
    assert!(
        line.starts_with("gturbo: error: input: token id 4000000000 is outside the vocabulary ("),
        "{line}"
    );
    // A sequence longer than the model's positions: 3 prompt tokens fit 4 positions,
    // the second generated token does not.
    let path = out.join("manifest.json");
    let mut m: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    m["arch"]["axes"]["max_position_embeddings"] = Value::from(4);
    std::fs::write(&path, serde_json::to_vec(&m).unwrap()).unwrap();
    let o = run(&out, &["--prompt-ids", "1,2,3", "--max-tokens", "5"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_eq!(
        sole_error_line(&o),
        "gturbo: error: input: a sequence of 5 tokens (prompt and generated) exceeds the \
         model's max_position_embeddings 4"
    );
}
