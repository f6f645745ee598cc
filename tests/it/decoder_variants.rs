//! The decoder's config variants against transformers: a sliding window
//! (`sliding_window`) and dynamic NTK RoPE (`rope_scaling: dynamic`), on the Mixtral
//! toy with its config.json patched as `scripts/golden/gen_decoder_variants_golden.py`
//! patched it (`tests/data/decoder_variants/meta.json` holds each patch). The golden is
//! a session as gturbo runs one: the prompt in one call, then one token per call with
//! the cache, so dynamic NTK's per-call frequencies are what is compared.

use std::path::{Path, PathBuf};

use gturbo::runtime::experts::ExpertMode;
use gturbo::runtime::kernels::{Cpu, Ops};
use gturbo::runtime::load::{self, LoadOptions};
use gturbo::runtime::models;
use serde_json::Value;

use crate::mixtral::TOY;
use crate::support::cli::{self, gturbo, text};
use crate::support::toy::{csv, ids};
use crate::support::{f32_safetensors, temp_dir};

const GOLDEN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/decoder_variants");

/// Largest `|gturbo − transformers|` accepted on a logit, as for the unpatched toy
/// (`mixtral::LOGIT_ATOL`); the golden's generator refuses a variant whose logits move
/// less than 0.05 from the same config without the feature (recorded as
/// `max_abs_delta_vs_base`, 13–19 here), so a runner that ignored the feature fails.
const LOGIT_ATOL: f32 = 1e-3;

fn meta() -> Value {
    serde_json::from_slice(&std::fs::read(Path::new(GOLDEN).join("meta.json")).unwrap()).unwrap()
}

/// The toy with `variant`'s config patch, installed at BF16 (weights as on disk) under
/// `tmp`.
fn install_variant(tmp: &Path, variant: &str) -> PathBuf {
    let src = tmp.join(format!("{variant}-src"));
    std::fs::create_dir_all(&src).unwrap();
    for e in std::fs::read_dir(TOY).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), src.join(e.file_name())).unwrap();
        }
    }
    let mut cfg: Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    let patch = &meta()["variants"][variant]["patch"];
    for (k, v) in patch.as_object().unwrap() {
        cfg[k] = v.clone();
    }
    std::fs::write(src.join("config.json"), cfg.to_string()).unwrap();
    let out = tmp.join(format!("{variant}.gturbo"));
    let o = gturbo()
        .args(["-q", "install", "mixtral", "--from"])
        .arg(&src)
        .arg("--out")
        .arg(&out)
        .args(["--quant", "bf16"])
        .output()
        .unwrap();
    assert!(o.status.success(), "install {variant}: {}", text(&o));
    out
}

/// The golden's logits in gturbo's call order: the prompt's rows, then each decode
/// call's (the golden's steps after the first, which is the prompt's last row).
fn golden_rows(variant: &str) -> Vec<Vec<f32>> {
    let t = f32_safetensors(&Path::new(GOLDEN).join(format!("{variant}.safetensors")));
    let (ps, pl) = &t["prompt_logits"];
    let (ss, sl) = &t["step_logits"];
    assert_eq!(ps[1], ss[1], "vocabularies");
    let mut rows: Vec<Vec<f32>> = pl.chunks_exact(ps[1]).map(<[f32]>::to_vec).collect();
    let steps: Vec<&[f32]> = sl.chunks_exact(ss[1]).collect();
    assert_eq!(
        steps[0],
        &rows[ps[0] - 1][..],
        "step 0 is the prompt's last row"
    );
    rows.extend(steps[1..].iter().map(|r| r.to_vec()));
    rows
}

/// The prompt and each decode step fed the golden's greedy ids on `backend`: the
/// largest logit difference from transformers'.
fn logits_vs_golden<B: Ops + 'static>(dir: &Path, variant: &str, backend: &B) -> f32 {
    let m = meta();
    let (prompt, greedy) = (ids(&m["prompt"]), ids(&m["variants"][variant]["greedy"]));
    let want = golden_rows(variant);
    let install = load::open(
        dir,
        LoadOptions {
            experts: ExpertMode::Slots(2),
            ..Default::default()
        },
    )
    .unwrap();
    let model = models::open(&install, backend).unwrap();
    let vocab = model.vocab();
    let mut s = model.session();
    let all = model.forward(&mut s, &prompt, true).unwrap();
    let mut got: Vec<Vec<f32>> = all.chunks_exact(vocab).map(<[f32]>::to_vec).collect();
    for &t in &greedy[..greedy.len() - 1] {
        got.push(model.forward(&mut s, &[t], false).unwrap());
    }
    assert_eq!(got.len(), want.len(), "positions");
    let (mut worst, mut at) = (0f32, 0);
    for (p, (a, b)) in got.iter().zip(&want).enumerate() {
        let d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        if d > worst {
            (worst, at) = (d, p);
        }
    }
    eprintln!(
        "{variant} on {}: {} positions, max |logit − transformers| {worst:.3e} at {at}",
        model.backend_name(),
        got.len()
    );
    assert!(
        worst <= LOGIT_ATOL,
        "{variant}: position {at} differs from transformers' by {worst:.3e}"
    );
    worst
}

const VARIANTS: [&str; 3] = ["window", "dynamic", "dynamic_long"];

#[test]
fn the_golden_tests_each_feature() {
    let m = meta();
    for v in VARIANTS {
        let d = m["variants"][v]["max_abs_delta_vs_base"].as_f64().unwrap();
        assert!(
            d > 100.0 * f64::from(LOGIT_ATOL),
            "{v}: the feature moves logits by {d}"
        );
    }
}

#[test]
fn sliding_window_and_dynamic_ntk_follow_transformers_on_the_cpu_by_logits_and_tokens() {
    let tmp = temp_dir();
    let m = meta();
    let prompt = ids(&m["prompt"]);
    for v in VARIANTS {
        let dir = install_variant(tmp.path(), v);
        logits_vs_golden(&dir, v, &Cpu::new(2));
        let (doc, footer) = cli::run_json(
            &dir,
            &[
                "--backend",
                "cpu",
                "--max-tokens",
                "24",
                "--prompt-ids",
                &csv(&prompt),
            ],
        );
        assert_eq!(
            ids(&doc["tokens"]),
            ids(&m["variants"][v]["greedy"]),
            "{v}: {footer}"
        );
    }
}

#[cfg(feature = "gpu")]
#[test]
fn sliding_window_and_dynamic_ntk_follow_transformers_on_the_gpu() {
    let Some(gpu) =
        crate::gpu::gpu("sliding_window_and_dynamic_ntk_follow_transformers_on_the_gpu")
    else {
        return;
    };
    let tmp = temp_dir();
    for v in VARIANTS {
        let dir = install_variant(tmp.path(), v);
        logits_vs_golden(&dir, v, &gpu);
    }
}

#[test]
fn dynamic_ntk_runs_to_factor_times_the_pretraining_context_and_no_further() {
    let tmp = temp_dir();
    // `dynamic`: max_position_embeddings 24, factor 2 → 48 positions.
    let dir = install_variant(tmp.path(), "dynamic");
    let install = load::open(&dir, LoadOptions::default()).unwrap();
    let cpu = Cpu::new(2);
    let model = models::open(&install, &cpu).unwrap();
    let mut s = model.session();
    assert!(model.forward(&mut s, &[5; 48], false).is_ok());
    let mut s = model.session();
    let err = model
        .forward(&mut s, &[5; 49], false)
        .unwrap_err()
        .to_string();
    assert!(err.contains("49") && err.contains("48"), "{err}");
}
