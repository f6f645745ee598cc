//! GLM-4.5 (`Glm4MoeForCausalLM`) end to end on tiny random checkpoints saved in the
//! real per-expert layout with a NextN layer (`tests/data/glm_toy`: QK norm on, as
//! GLM-4.5; `tests/data/glm_toy_air`: off, as Air; goldens from transformers by
//! `scripts/golden/gen_glm_golden.py`): q/k/v biases, partial rotary, a dense first
//! layer, sigmoid routing with a correction bias and `routed_scaling_factor`, a shared
//! expert. The install drops the NextN layer; greedy tokens equal transformers' on the
//! CPU and on the GPU; the prompt's and every cached decode step's logits stay within
//! [`LOGIT_ATOL`] of transformers'; an INT4 install records its quality and runs.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use gturbo::runtime::experts::ExpertMode;
use gturbo::runtime::kernels::{Cpu, Ops};
use gturbo::runtime::load::{self, LoadOptions};
use gturbo::runtime::models::{self, Model};
use serde_json::Value;

use crate::deepseek::max_diff;
use crate::support::cli::{self, gturbo, gturbo_args, text};
use crate::support::temp_dir;
use crate::support::toy::{csv, golden_rows, ids, meta_of};

const TOY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/glm_toy");
/// GLM-4.5-Air's options: no QK norm, `routed_scaling_factor` 1, 2 layers.
const AIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/glm_toy_air");
const FAMILY: &str = "glm4_moe";

/// Largest `|gturbo − transformers|` accepted on a logit: both compute in f32 from the
/// same BF16 weights, only the order of the sums differs.
const LOGIT_ATOL: f32 = 1e-4;

fn install(toy: &str, out: &Path, extra: &[&str]) {
    let o = gturbo()
        .args(["-q", "install", FAMILY, "--from", toy, "--out"])
        .arg(out)
        .args(extra)
        .output()
        .unwrap();
    assert!(o.status.success(), "install {extra:?}: {}", text(&o));
}

/// One BF16 (passthrough) install of `toy` for this test run.
fn bf16(toy: &'static str) -> &'static Path {
    static TOY_DIR: OnceLock<PathBuf> = OnceLock::new();
    static AIR_DIR: OnceLock<PathBuf> = OnceLock::new();
    let (cell, name) = if toy == TOY {
        (&TOY_DIR, "glm-bf16")
    } else {
        (&AIR_DIR, "glm-air-bf16")
    };
    cell.get_or_init(|| {
        let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
        let _ = std::fs::remove_dir_all(&root);
        let out = root.join("bf16.gturbo");
        install(toy, &out, &["--quant", "bf16"]);
        out
    })
}

fn manifest(dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap()
}

fn run_json(dir: &Path, extra: &[&str]) -> (Value, String) {
    let mut args = vec!["--max-tokens", "24"];
    args.extend_from_slice(extra);
    cli::run_json(dir, &args)
}

#[test]
fn the_bf16_install_drops_the_nextn_layer_pools_the_routed_layers_and_verifies() {
    let tmp = temp_dir();
    let out = tmp.path().join("bf16.gturbo");
    install(TOY, &out, &["--quant", "bf16"]);
    let o = gturbo_args(&["verify-install", out.to_str().unwrap()]);
    assert!(o.status.success(), "verify-install: {}", text(&o));
    let m = manifest(&out);
    assert_eq!(m["family"], FAMILY);
    assert_eq!(m["arch"]["axes"]["use_qk_norm"], true);
    assert_eq!(m["arch"]["axes"]["attention_bias"], true);
    assert_eq!(m["sidecars"]["mtp"], "skipped", "{m}");
    // The NextN layer (model.layers.3: a whole decoder layer plus its own norms and
    // projection) is gone: no tensor of it in the install, no pool for its experts.
    assert!(m["excluded_tensors"].as_u64().unwrap() > 0, "{m}");
    let resident = std::fs::read(out.join("resident.bin")).unwrap();
    let header = String::from_utf8_lossy(&resident[..resident.len().min(1 << 16)]);
    assert!(header.contains("model.layers.2.self_attn.q_proj.bias"));
    assert!(!header.contains("model.layers.3."), "{header}");
    let layers: Vec<u64> = m["expert_pools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["layer"].as_u64().unwrap())
        .collect();
    assert_eq!(layers, [1, 2]);
}

#[test]
fn greedy_tokens_equal_transformers_on_the_cpu_by_ids_and_by_text() {
    for toy in [TOY, AIR] {
        let g = meta_of(toy, FAMILY);
        let dir = bf16(toy);
        let (doc, footer) = run_json(dir, &["--backend", "cpu", "--prompt-ids", &csv(&g.prompt)]);
        assert_eq!(ids(&doc["tokens"]), g.greedy, "{toy}: {footer}");
        assert_eq!(doc["runner"], FAMILY);
        let (doc, footer) = run_json(dir, &["--backend", "cpu", "--prompt", &g.prompt_text]);
        assert_eq!(ids(&doc["prompt_ids"]), g.prompt, "{footer}");
        assert_eq!(ids(&doc["tokens"]), g.greedy, "{toy}: {footer}");
    }
}

#[cfg(feature = "gpu")]
#[test]
fn greedy_tokens_equal_transformers_on_the_gpu() {
    let Some(gpu) = crate::gpu::gpu("glm::greedy_tokens_equal_transformers_on_the_gpu") else {
        return;
    };
    drop(gpu);
    for toy in [TOY, AIR] {
        let g = meta_of(toy, FAMILY);
        let prompt = csv(&g.prompt);
        for mode in [&["--expert-cache-slots", "2"][..], &["--resident-experts"]] {
            let mut extra = vec!["--backend", "gpu", "--prompt-ids", &prompt];
            extra.extend_from_slice(mode);
            let (doc, footer) = run_json(bf16(toy), &extra);
            assert!(
                doc["backend"].as_str().unwrap().starts_with("gpu "),
                "{doc}"
            );
            assert_eq!(ids(&doc["tokens"]), g.greedy, "{toy} {mode:?}: {footer}");
        }
    }
}

/// The logits of the golden's prompt (all positions) and of each cached decode step fed
/// its greedy tokens, on the install `dir`.
fn rows_of_run<B: Ops + 'static>(
    toy: &str,
    dir: &Path,
    backend: &B,
    experts: ExpertMode,
) -> Vec<Vec<f32>> {
    let g = meta_of(toy, FAMILY);
    let install = load::open(
        dir,
        LoadOptions {
            experts,
            ..Default::default()
        },
    )
    .unwrap();
    let model: Box<dyn Model> = models::open(&install, backend).unwrap();
    let vocab = model.vocab();
    let mut s = model.session();
    let all = model.forward(&mut s, &g.prompt, true).unwrap();
    let mut got: Vec<Vec<f32>> = all.chunks_exact(vocab).map(<[f32]>::to_vec).collect();
    for &t in &g.greedy[..g.greedy.len() - 1] {
        got.push(model.forward(&mut s, &[t], false).unwrap());
    }
    got
}

/// [`rows_of_run`] on `toy`'s BF16 install against transformers' logits.
fn logits_vs_golden<B: Ops + 'static>(toy: &'static str, backend: &B, experts: ExpertMode) {
    let want = golden_rows(toy);
    let got = rows_of_run(toy, bf16(toy), backend, experts);
    assert_eq!(got.len(), want.len(), "positions");
    let mut worst = (0f32, 0);
    for (p, (a, b)) in got.iter().zip(&want).enumerate() {
        let d = max_diff(std::slice::from_ref(a), std::slice::from_ref(b));
        if d > worst.0 {
            worst = (d, p);
        }
    }
    eprintln!(
        "{} on {} ({experts:?}): {} positions, max |logit − transformers| {:.3e} at {}",
        Path::new(toy).file_name().unwrap().to_string_lossy(),
        backend.name(),
        got.len(),
        worst.0,
        worst.1,
    );
    assert!(
        worst.0 <= LOGIT_ATOL,
        "position {}: logits differ from transformers' by {:.3e} (> {LOGIT_ATOL})",
        worst.1,
        worst.0
    );
}

#[test]
fn prompt_and_decode_logits_match_transformers_on_the_cpu() {
    for toy in [TOY, AIR] {
        logits_vs_golden(toy, &Cpu::new(2), ExpertMode::Slots(2));
        logits_vs_golden(toy, &Cpu::new(2), ExpertMode::Resident);
    }
}

#[cfg(feature = "gpu")]
#[test]
fn prompt_and_decode_logits_match_transformers_on_the_gpu() {
    let Some(gpu) = crate::gpu::gpu("glm::prompt_and_decode_logits_match_transformers_on_the_gpu")
    else {
        return;
    };
    for toy in [TOY, AIR] {
        logits_vs_golden(toy, &gpu, ExpertMode::Slots(2));
        logits_vs_golden(toy, &gpu, ExpertMode::Resident);
    }
}

#[test]
fn an_int4_install_records_its_quality_and_runs() {
    let tmp = temp_dir();
    let q = tmp.path().join("int4.gturbo");
    install(TOY, &q, &[]);
    let m = manifest(&q);
    assert_eq!(m["quantized_at_install"]["scheme"], "int4_g64");
    assert_eq!(m["expert_pools"][0]["scheme"], "int4_g64");
    assert_eq!(m["sidecars"]["mtp"], "skipped", "{m}");
    let o = gturbo_args(&["verify-install", q.to_str().unwrap()]);
    assert!(o.status.success(), "verify-install: {}", text(&o));
    let txt = tmp.path().join("text.txt");
    std::fs::write(
        &txt,
        "A café for the quick brown fox. The quick brown fox jumps over the lazy dog while \
         the cat sleeps in the sun, and the birds sing of rain, of wind and of the long road \
         home.",
    )
    .unwrap();
    let o = gturbo_args(&[
        "eval",
        q.to_str().unwrap(),
        bf16(TOY).to_str().unwrap(),
        "--text",
        txt.to_str().unwrap(),
        "--threads",
        "2",
        "--record",
        "--json",
    ]);
    assert!(o.status.success(), "eval: {}", text(&o));
    let ev: Value = serde_json::from_slice(&o.stdout).unwrap();
    eprintln!("glm toy INT4 vs BF16: {ev}");
    let kl = ev["mean_kl_nats"].as_f64().unwrap();
    // Random Gaussian weights are INT4's worst case: the bound catches a broken
    // dequantization (KL of several nats), not a small regression.
    assert!(kl.is_finite() && kl > 0.0 && kl < 2.0, "{ev}");
    let g = meta_of(TOY, FAMILY);
    let (doc, footer) = run_json(&q, &["--backend", "cpu", "--prompt-ids", &csv(&g.prompt)]);
    assert_eq!(doc["tokens"].as_array().unwrap().len(), 24, "{footer}");
    assert_eq!(doc["runner"], FAMILY);
    assert_eq!(doc["quality"]["format"], "gturbo-quality", "{doc}");
}
