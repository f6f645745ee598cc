//! Mixtral (`MixtralForCausalLM`) end to end on the tiny random checkpoint saved in the
//! real per-expert layout (`tests/data/mixtral_toy`, goldens from transformers by
//! `scripts/golden/gen_mixtral_golden.py`): the install maps `w1|w3|w2` to the pools'
//! gate, up and down; greedy tokens equal transformers' on the CPU and on the GPU
//! (expert slots and resident experts), by ids and by text; the prompt's and every
//! decode step's logits stay within [`LOGIT_ATOL`] of transformers'; an INT4 install
//! runs with the quality `eval --record` measured against the BF16 one.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use gturbo::runtime::experts::ExpertMode;
use gturbo::runtime::kernels::{Cpu, Ops};
use gturbo::runtime::load::{self, LoadOptions};
use gturbo::runtime::models;
use serde_json::Value;

use crate::support::cli::{self, gturbo_args, text};
use crate::support::temp_dir;
use crate::support::toy::{Meta, csv, golden_rows, ids, install_toy, manifest, meta_of};

pub(crate) const TOY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/mixtral_toy");

/// Largest `|gturbo − transformers|` accepted on a logit. Both compute in f32 from the
/// same BF16 weights; only the order of the sums differs (a few ulps of values up to
/// ~15, through 3 layers). Measured: 1.8e-5 on the CPU, 2.1e-5 on llvmpipe.
const LOGIT_ATOL: f32 = 1e-3;

/// One BF16 (passthrough) install of the toy for this test run, kept under the
/// target's temp dir; the tests that read it share it.
pub(crate) fn bf16() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("mixtral-bf16");
        let _ = std::fs::remove_dir_all(&root);
        let out = root.join("bf16.gturbo");
        install(&out, &["--quant", "bf16"]);
        out
    })
}

/// `gturbo run DIR --json --max-tokens 24 --threads 2 EXTRA…`: its JSON and footer.
fn run_json(dir: &Path, extra: &[&str]) -> (Value, String) {
    let mut args = vec!["--max-tokens", "24"];
    args.extend_from_slice(extra);
    cli::run_json(dir, &args)
}

fn meta() -> Meta {
    meta_of(TOY, "mixtral")
}

/// `gturbo install mixtral --from TOY --out OUT EXTRA…`, asserting success.
fn install(out: &Path, extra: &[&str]) {
    install_toy("mixtral", TOY, out, extra)
}

#[test]
fn the_bf16_install_maps_w1_w3_w2_into_pools_of_3_layers_by_4_experts_and_verifies() {
    let tmp = temp_dir();
    let out = tmp.path().join("bf16.gturbo");
    install(&out, &["--quant", "bf16"]);
    let o = gturbo_args(&["verify-install", out.to_str().unwrap()]);
    assert!(o.status.success(), "verify-install: {}", text(&o));
    let m = manifest(&out);
    assert_eq!(m["family"], "mixtral");
    assert_eq!(m["arch"]["axes"]["num_experts"], 4);
    let pools = m["expert_pools"].as_array().unwrap();
    assert_eq!(pools.len(), 3, "one pool per layer");
    for (l, p) in pools.iter().enumerate() {
        assert_eq!(p["layer"], l);
        assert_eq!(p["experts"], 4);
        assert_eq!(p["scheme"], "passthrough");
        let parts: Vec<&str> = p["parts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["part"].as_str().unwrap())
            .collect();
        assert_eq!(parts, ["gate", "up", "down"], "layer {l}");
    }
}

#[test]
fn greedy_tokens_equal_transformers_on_the_cpu_by_ids_and_by_text() {
    let g = meta();
    let dir = bf16();
    let (doc, footer) = run_json(dir, &["--backend", "cpu", "--prompt-ids", &csv(&g.prompt)]);
    assert_eq!(ids(&doc["tokens"]), g.greedy, "{footer}");
    assert_eq!(doc["runner"], "mixtral");
    assert_eq!(doc["family"], "mixtral");
    // The text path: the tokenizer adds BOS and gives the golden's prompt ids.
    let (doc, footer) = run_json(dir, &["--backend", "cpu", "--prompt", &g.prompt_text]);
    assert_eq!(ids(&doc["prompt_ids"]), g.prompt, "{footer}");
    assert_eq!(ids(&doc["tokens"]), g.greedy, "{footer}");
}

#[cfg(feature = "gpu")]
#[test]
fn greedy_tokens_equal_transformers_on_the_gpu_with_expert_slots_and_resident_experts() {
    const TEST: &str =
        "greedy_tokens_equal_transformers_on_the_gpu_with_expert_slots_and_resident_experts";
    let Some(gpu) = crate::gpu::gpu(TEST) else {
        return;
    };
    drop(gpu);
    let g = meta();
    let prompt = csv(&g.prompt);
    for mode in [&["--expert-cache-slots", "2"][..], &["--resident-experts"]] {
        let mut extra = vec!["--backend", "gpu", "--prompt-ids", &prompt];
        extra.extend_from_slice(mode);
        let (doc, footer) = run_json(bf16(), &extra);
        assert!(
            doc["backend"].as_str().unwrap().starts_with("gpu "),
            "{doc}"
        );
        assert_eq!(ids(&doc["tokens"]), g.greedy, "{mode:?}: {footer}");
    }
}

/// The logits of the prompt (all positions) and of each decode step fed the golden's
/// greedy tokens, on `backend`, with the largest difference from transformers'.
fn logits_vs_golden<B: Ops + 'static>(backend: &B, experts: ExpertMode) -> f32 {
    let g = meta();
    let want = golden_rows(TOY);
    let install = load::open(
        bf16(),
        LoadOptions {
            experts,
            ..Default::default()
        },
    )
    .unwrap();
    let model = models::open(&install, backend).unwrap();
    let vocab = model.vocab();
    let mut s = model.session();
    let all = model.forward(&mut s, &g.prompt, true).unwrap();
    let mut got: Vec<Vec<f32>> = all.chunks_exact(vocab).map(<[f32]>::to_vec).collect();
    for &t in &g.greedy[..g.greedy.len() - 1] {
        got.push(model.forward(&mut s, &[t], false).unwrap());
    }
    assert_eq!(got.len(), want.len(), "positions");
    let mut worst = (0f32, 0);
    for (p, (a, b)) in got.iter().zip(&want).enumerate() {
        assert_eq!(a.len(), b.len(), "vocabulary");
        let d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        if d > worst.0 {
            worst = (d, p);
        }
    }
    eprintln!(
        "mixtral toy on {}: {} positions, max |logit − transformers| {:.3e} at {}",
        model.backend_name(),
        got.len(),
        worst.0,
        worst.1
    );
    assert!(
        worst.0 <= LOGIT_ATOL,
        "position {}: logits differ from transformers' by {:.3e} (> {LOGIT_ATOL})",
        worst.1,
        worst.0
    );
    worst.0
}

#[test]
fn prompt_and_decode_logits_match_transformers_on_the_cpu() {
    logits_vs_golden(&Cpu::new(2), ExpertMode::Slots(2));
}

#[cfg(feature = "gpu")]
#[test]
fn prompt_and_decode_logits_match_transformers_on_the_gpu() {
    let Some(gpu) = crate::gpu::gpu("prompt_and_decode_logits_match_transformers_on_the_gpu")
    else {
        return;
    };
    logits_vs_golden(&gpu, ExpertMode::Slots(2));
    logits_vs_golden(&gpu, ExpertMode::Resident);
}

#[test]
fn an_int4_install_with_an_int8_router_runs_with_its_recorded_quality() {
    let tmp = temp_dir();
    let q = tmp.path().join("int4.gturbo");
    // The family's policy: INT4 everywhere but the norms, the router at INT8.
    let o = gturbo_args(&["install", "mixtral", "--from", TOY, "--dry-run", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let plan: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(plan["census"]["int8"]["tensors"], 3, "one router per layer");
    assert_eq!(plan["census"]["passthrough"]["tensors"], 7, "the norms");
    install(&q, &[]);
    let m = manifest(&q);
    assert_eq!(m["quantized_at_install"]["scheme"], "int4_g64");
    assert_eq!(m["expert_pools"][0]["scheme"], "int4_g64");

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
        bf16().to_str().unwrap(),
        "--text",
        txt.to_str().unwrap(),
        "--threads",
        "2",
        "--record",
        "--json",
    ]);
    assert!(o.status.success(), "eval: {}", text(&o));
    let ev: Value = serde_json::from_slice(&o.stdout).unwrap();
    eprintln!("mixtral toy INT4 vs BF16: {ev}");
    let kl = ev["mean_kl_nats"].as_f64().unwrap();
    let top1 = ev["top1_agreement"].as_f64().unwrap();
    // Random Gaussian weights are INT4's worst case and the toy's router margins are
    // ~0.01, so the bound is loose; it catches a broken dequantization (KL of several
    // nats, top-1 near chance, 1/512), not a regression of a few percent.
    assert!(kl.is_finite() && kl > 0.0 && kl < 2.0, "{ev}");
    assert!(top1 > 0.25, "{ev}");

    let g = meta();
    let (doc, footer) = run_json(&q, &["--prompt-ids", &csv(&g.prompt)]);
    assert_eq!(doc["tokens"].as_array().unwrap().len(), 24);
    assert_eq!(doc["quality"]["format"], "gturbo-quality");
    // Within an ulp or two: serde_json's default float parsing is not exactly
    // round-trip, and the figure is parsed twice on its way here (quality.json, then
    // run's JSON).
    let close = |k: &str, want: f64| {
        let got = doc["quality"][k].as_f64().unwrap();
        assert!(
            (got - want).abs() <= 1e-12 * want.abs(),
            "{k}: {got} vs {want}"
        );
    };
    close("mean_kl_nats", kl);
    close("top1_agreement", top1);
    assert_eq!(doc["quality"]["reference"]["scheme"], "passthrough");
    assert!(
        footer.contains(&format!("quality: mean KL {kl:.4} nats"))
            && footer.contains(&format!("top-1 {:.1}%", top1 * 100.0)),
        "{footer}"
    );
    let o = gturbo_args(&["verify-install", q.to_str().unwrap()]);
    assert!(o.status.success(), "verify-install: {}", text(&o));
}
