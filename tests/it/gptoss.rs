//! gpt-oss (`GptOssForCausalLM`) end to end on the tiny random checkpoint saved in the
//! layout transformers writes gpt-oss's BF16 weights in (`tests/data/gptoss_toy`: experts
//! transposed `[E, in, out]` with gate and up interleaved, biases on every projection,
//! sinks, alternating sliding-window and full layers with a window of 8 that the prompt
//! runs past, YaRN with `truncate: false`; goldens by
//! `scripts/golden/gen_gptoss_golden.py`): the BF16 install writes the pools' gate, up
//! and down and verifies; greedy tokens equal transformers' on the CPU and on the GPU;
//! the prompt's and every cached decode step's logits stay within [`LOGIT_ATOL`] of
//! transformers'; a snapshot decodes exactly as the session it was taken from; an INT4
//! install runs with its recorded quality.

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

pub(crate) const TOY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/gptoss_toy");

/// Largest `|gturbo − transformers|` accepted on a logit (the goldens are the reference
/// in f64; its own f32 run is 2.9e-5 from that).
const LOGIT_ATOL: f32 = 1e-4;

/// One BF16 (passthrough) install of the toy for this test run, shared by the tests
/// that read it.
pub(crate) fn bf16() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("gptoss-bf16");
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
    meta_of(TOY, "gpt_oss")
}

/// `gturbo install gpt_oss --from TOY --out OUT EXTRA…`, asserting success.
fn install(out: &Path, extra: &[&str]) {
    install_toy("gpt_oss", TOY, out, extra)
}

#[test]
fn the_bf16_install_packs_4_pools_of_8_experts_from_the_transposed_tensors_and_verifies() {
    let tmp = temp_dir();
    let out = tmp.path().join("bf16.gturbo");
    install(&out, &["--quant", "bf16"]);
    let o = gturbo_args(&["verify-install", out.to_str().unwrap()]);
    assert!(o.status.success(), "verify-install: {}", text(&o));
    let m = manifest(&out);
    assert_eq!(m["family"], "gpt_oss");
    assert_eq!(m["arch"]["axes"]["num_experts"], 8);
    assert_eq!(m["arch"]["axes"]["sliding_window"], 8);
    let pools = m["expert_pools"].as_array().unwrap();
    assert_eq!(pools.len(), 4, "one pool per layer");
    for (l, p) in pools.iter().enumerate() {
        assert_eq!(p["layer"], l);
        assert_eq!(p["experts"], 8);
        let parts: Vec<(&str, u64, u64)> = p["parts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| {
                (
                    x["part"].as_str().unwrap(),
                    x["rows"].as_u64().unwrap(),
                    x["cols"].as_u64().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            parts,
            [("gate", 64, 128), ("up", 64, 128), ("down", 128, 64)],
            "layer {l}"
        );
    }
    assert_eq!(m["excluded_tensors"], 0);
}

#[test]
fn greedy_tokens_equal_transformers_on_the_cpu_by_ids_and_by_text() {
    let g = meta();
    let dir = bf16();
    let (doc, footer) = run_json(dir, &["--backend", "cpu", "--prompt-ids", &csv(&g.prompt)]);
    assert_eq!(ids(&doc["tokens"]), g.greedy, "{footer}");
    assert_eq!(doc["runner"], "gpt_oss");
    assert_eq!(doc["family"], "gpt_oss");
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
    logits_vs_golden_of(TOY, bf16(), backend, experts)
}

/// [`logits_vs_golden`] of the install `dir` of `toy`, asserting [`LOGIT_ATOL`].
pub(crate) fn logits_vs_golden_of<B: Ops + 'static>(
    toy: &str,
    dir: &Path,
    backend: &B,
    experts: ExpertMode,
) -> f32 {
    let g = meta_of(toy, "gpt_oss");
    let want = golden_rows(toy);
    let install = load::open(
        dir,
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
        "gpt_oss toy {} on {}: {} positions, max |logit − transformers| {:.3e} at {}",
        dir.display(),
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

/// Decode after restoring a snapshot equals decode without it, bit for bit: the
/// snapshot is taken mid-sequence, at position 25, after the sliding layers' window
/// caches first dropped the positions no query sees again (at 23: window 8 plus
/// `WINDOW_REWIND` 8 behind, once 8 piled up), the original then decodes on across two
/// more drops (31 and 39), and the snapshot, restored after that, decodes the same
/// tokens to the same logits; a second restore of the same snapshot again.
fn snapshot_restores<B: Ops + 'static>(backend: &B) {
    let g = meta();
    let install = load::open(bf16(), LoadOptions::default()).unwrap();
    let model = models::open(&install, backend).unwrap();
    let mut s = model.session();
    model.forward(&mut s, &g.prompt, false).unwrap();
    let (before, after) = g.greedy.split_at(8);
    for &t in before {
        model.forward(&mut s, &[t], false).unwrap();
    }
    let snap = model.snapshot(&s).unwrap();
    assert_eq!(snap.pos, s.pos);
    assert!(model.session_bytes(&snap) > 0);
    let decode = |s: &mut models::Session| -> Vec<Vec<f32>> {
        after
            .iter()
            .map(|&t| model.forward(s, &[t], false).unwrap())
            .collect()
    };
    let straight = decode(&mut s);
    for _ in 0..2 {
        let mut restored = model.snapshot(&snap).unwrap();
        assert_eq!(decode(&mut restored), straight, "decode after a restore");
    }
    // The snapshot itself was not advanced by the sessions restored from it.
    let mut again = model.snapshot(&snap).unwrap();
    assert_eq!(again.pos, g.prompt.len() + before.len());
    assert_eq!(decode(&mut again), straight);
    // And the logits are the golden's greedy choices.
    for (row, &want) in straight.iter().zip(&after[1..]) {
        let best = row
            .iter()
            .enumerate()
            .fold((0, f32::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b })
            .0;
        assert_eq!(best as u32, want);
    }
}

#[test]
fn decode_after_restoring_a_snapshot_equals_decode_without_it_on_the_cpu() {
    snapshot_restores(&Cpu::new(2));
}

#[cfg(feature = "gpu")]
#[test]
fn decode_after_restoring_a_snapshot_equals_decode_without_it_on_the_gpu() {
    let Some(gpu) =
        crate::gpu::gpu("decode_after_restoring_a_snapshot_equals_decode_without_it_on_the_gpu")
    else {
        return;
    };
    snapshot_restores(&gpu);
}

#[test]
fn an_int4_install_runs_with_its_recorded_quality() {
    let tmp = temp_dir();
    let q = tmp.path().join("int4.gturbo");
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
    eprintln!("gpt_oss toy INT4 vs BF16: {ev}");
    let kl = ev["mean_kl_nats"].as_f64().unwrap();
    let top1 = ev["top1_agreement"].as_f64().unwrap();
    // Random Gaussian weights are INT4's worst case. The bound catches a broken
    // dequantization (top-1 near chance, 1/512), not a regression of a few percent.
    assert!(kl.is_finite() && kl > 0.0 && kl < 5.0, "{ev}");
    assert!(top1 > 0.1, "{ev}");

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
