//! DeepSeek-V3 and Kimi-K2 toys stored as the real repos store them (issue 26, made by
//! `scripts/golden/gen_deepseek_golden.py --store …` with transformers' own config
//! classes; the goldens are transformers' logits of the dequantized weights):
//!
//! - `deepseek_fp8_toy`: every decoder linear weight FP8 e4m3 with an F32
//!   `weight_scale_inv` per 128×128 block (full and partial blocks), installed with
//!   `--quant bf16`;
//! - `kimi_int4_toy`: `model_type: kimi_k2`, routed experts compressed-tensors INT4
//!   (`weight_packed`, `weight_scale`, `weight_shape`, group 32, symmetric), Kimi's
//!   tiktoken tokenizer. The default install keeps the experts as MLX affine INT4 g32;
//!   `--quant bf16` dequantizes them (the toy's scales have 5 significant bits, so that
//!   is the reference's weight exactly).
//!
//! The installed bytes equal MLX-LM's `sanitize` of the same tensors
//! (tests/data/deepseek_store_mlx_golden.json, `gen_deepseek_store_mlx_golden.py`),
//! verify-install passes, and the BF16 installs give transformers' logits within
//! 1e-4 and its greedy tokens on the CPU and the GPU.

use std::path::Path;

use gturbo::runtime::experts::ExpertMode;
use gturbo::runtime::kernels::Cpu;
use gturbo::runtime::text::TextCodec;
use serde_json::Value;

use crate::deepseek::{
    FAMILY, FP8_TOY, KIMI_TOY, both_layouts, fp8_bf16, kimi_bf16, meta, run_json,
};
use crate::support::cli::{gturbo_args, text};
use crate::support::toy::{csv, ids, install_toy, manifest};
use crate::support::{sha256_hex, temp_dir};

const MLX_GOLDEN: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/deepseek_store_mlx_golden.json"
);

/// MLX-LM's converted tensors of `toy` (its folder name): name → {dtype, shape, sha256}.
fn mlx_golden(toy: &str) -> serde_json::Map<String, Value> {
    let g: Value = serde_json::from_slice(&std::fs::read(MLX_GOLDEN).unwrap()).unwrap();
    g["toys"][toy].as_object().unwrap().clone()
}

/// The installed bytes MLX-LM names `name`: a resident tensor's data (`…weight`), or
/// one routed expert's `weight` / `scales` / `biases`
/// (`model.layers.L.mlp.experts.E.{gate,up,down}_proj.K`) from its layer's pool file.
fn installed_bytes(dir: &Path, name: &str) -> Vec<u8> {
    let m = manifest(dir);
    if let Some((layer, rest)) = name
        .strip_prefix("model.layers.")
        .and_then(|r| r.split_once(".mlp.experts."))
    {
        let mut it = rest.split('.');
        let (e, proj, kind) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
        let (layer, e): (u64, u64) = (layer.parse().unwrap(), e.parse().unwrap());
        let pool = (m["expert_pools"].as_array().unwrap().iter())
            .find(|p| p["layer"] == layer && p["sidecar"].is_null())
            .unwrap();
        let part = (pool["parts"].as_array().unwrap().iter())
            .find(|p| p["part"] == proj.trim_end_matches("_proj"))
            .unwrap();
        let n = |k: &str| part[k].as_u64().unwrap() as usize;
        let start = e as usize * pool["stride"].as_u64().unwrap() as usize + n("offset");
        let (at, len) = match kind {
            "weight" => (start, n("weights")),
            "scales" => (start + n("weights"), n("scales")),
            _ => (start + n("weights") + n("scales"), n("biases")),
        };
        let file = std::fs::read(dir.join(pool["file"].as_str().unwrap())).unwrap();
        return file[at..at + len].to_vec();
    }
    let res = std::fs::read(dir.join("resident.bin")).unwrap();
    let n = u64::from_le_bytes(res[8..16].try_into().unwrap()) as usize;
    let index: Value = serde_json::from_slice(&res[16..16 + n]).unwrap();
    let start = m["resident"]["payload_start"].as_u64().unwrap() as usize;
    let e = (index["tensors"].as_array().unwrap().iter())
        .find(|e| e["name"] == name)
        .unwrap_or_else(|| panic!("{name} is not resident"));
    let span = |k: &str| e["data"][k].as_u64().unwrap() as usize;
    res[start + span("offset")..start + span("offset") + span("len")].to_vec()
}

/// Every tensor MLX-LM's `sanitize` converts is installed with its bytes.
fn assert_mlx_bytes(dir: &Path, toy: &str) -> usize {
    let g = mlx_golden(toy);
    for (name, d) in &g {
        assert_eq!(
            sha256_hex(&installed_bytes(dir, name)),
            d["sha256"].as_str().unwrap(),
            "{toy}: {name} differs from MLX-LM's"
        );
    }
    g.len()
}

fn verify(dir: &Path) {
    let o = gturbo_args(&["verify-install", dir.to_str().unwrap()]);
    assert!(o.status.success(), "verify-install: {}", text(&o));
}

/// Greedy tokens of the golden's prompt on `backend` through `gturbo run`.
fn greedy(dir: &Path, toy: &str, backend: &str) {
    let g = meta(toy);
    let (doc, footer) = run_json(
        dir,
        &["--backend", backend, "--prompt-ids", &csv(&g.prompt)],
    );
    assert!(
        doc["backend"].as_str().unwrap().starts_with(backend),
        "{doc}"
    );
    assert_eq!(ids(&doc["tokens"]), g.greedy, "{backend}: {footer}");
}

#[test]
fn an_fp8_deepseek_installs_at_bf16_as_mlx_lm_dequantizes_it_and_matches_transformers() {
    const TEST: &str =
        "an_fp8_deepseek_installs_at_bf16_as_mlx_lm_dequantizes_it_and_matches_transformers";
    let dir = fp8_bf16();
    assert_eq!(assert_mlx_bytes(dir, "deepseek_fp8_toy"), 72);
    assert!(!manifest(dir).to_string().contains("_scale_inv"));
    verify(dir);
    greedy(dir, FP8_TOY, "cpu");
    both_layouts(FP8_TOY, &Cpu::new(2), ExpertMode::Slots(2));
    let Some(gpu) = crate::gpu::gpu(TEST) else {
        return;
    };
    both_layouts(FP8_TOY, &gpu, ExpertMode::Resident);
    drop(gpu);
    greedy(dir, FP8_TOY, "gpu");
}

#[test]
fn a_kimi_toy_with_compressed_tensors_int4_experts_installs_as_mlx_lm_converts_it() {
    const TEST: &str =
        "a_kimi_toy_with_compressed_tensors_int4_experts_installs_as_mlx_lm_converts_it";
    // The default profile keeps the experts' INT4 g32 words and scales as they are.
    let tmp = temp_dir();
    let int4 = tmp.path().join("int4.gturbo");
    install_toy(FAMILY, KIMI_TOY, &int4, &[]);
    let m = manifest(&int4);
    assert_eq!(m["arch"]["model_type"], "kimi_k2");
    let pools = m["expert_pools"].as_array().unwrap();
    assert!(pools.iter().all(|p| p["scheme"] == "int4_g32"), "{pools:?}");
    assert_eq!(assert_mlx_bytes(&int4, "kimi_int4_toy"), 2 * 16 * 3 * 3);
    verify(&int4);
    assert!(int4.join("tokenizer/tokenizer.json").is_file());

    // --quant bf16: the dequantized experts are the reference's weights exactly.
    let dir = kimi_bf16();
    verify(dir);
    let g = meta(KIMI_TOY);
    // Kimi's tokenizer, converted at install, gives the golden's prompt ids.
    let codec = TextCodec::load(dir).unwrap();
    assert_eq!(codec.encode(&g.prompt_text).unwrap(), g.prompt);
    let (doc, footer) = run_json(dir, &["--backend", "cpu", "--prompt", &g.prompt_text]);
    assert_eq!(ids(&doc["prompt_ids"]), g.prompt, "{footer}");
    assert_eq!(ids(&doc["tokens"]), g.greedy, "{footer}");
    both_layouts(KIMI_TOY, &Cpu::new(2), ExpertMode::Slots(2));
    let Some(gpu) = crate::gpu::gpu(TEST) else {
        return;
    };
    both_layouts(KIMI_TOY, &gpu, ExpertMode::Resident);
    drop(gpu);
    greedy(dir, KIMI_TOY, "gpu");
}
