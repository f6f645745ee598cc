//! DeepSeek-V3 (`DeepseekV3ForCausalLM`) end to end on the tiny random checkpoint saved
//! in the real per-expert layout (`tests/data/deepseek_toy`, goldens from transformers
//! by `scripts/golden/gen_deepseek_golden.py`): q LoRA, a dense first layer, sigmoid
//! group-limited routing with a correction bias, a shared expert, YaRN with `mscale` ≠
//! `mscale_all_dim`, the interleaved rope layout. Greedy tokens equal transformers' on
//! the CPU and on the GPU; the prompt's and every cached decode step's logits stay
//! within [`LOGIT_ATOL`] of transformers'; an INT4 install runs.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use gturbo::runtime::experts::ExpertMode;
use gturbo::runtime::kernels::{Backend, Cpu, Ops};
use gturbo::runtime::layers::mla::{KvLayout, MlaDims};
use gturbo::runtime::load::{self, LoadOptions};
use gturbo::runtime::models::{self, Model, deepseek_v3};
use serde_json::Value;

use crate::support::cli::{self, gturbo_args, text};
use crate::support::temp_dir;
use crate::support::toy::{self, Meta, csv, golden_rows, ids, manifest, meta_of};

const TOY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/deepseek_toy");
/// The other branch of every option: plain `q_proj`, no group limit, no renormalising,
/// two shared experts, no dense layer, half-split rope without scaling (the
/// generator's `--variant`).
const VARIANT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/deepseek_toy_variant"
);
/// DeepSeek-V3's own latent widths (`kv_lora_rank` 512, `qk_rope_head_dim` 64: latent
/// keys of 576) on the main toy's options, 2 layers (the generator's `--wide`).
const WIDE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/deepseek_toy_wide");
/// The main toy stored in FP8 e4m3 with 128×128 block scales (`--store fp8`).
pub(crate) const FP8_TOY: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/deepseek_fp8_toy");
/// A Kimi-K2-shaped toy with compressed-tensors INT4 routed experts and Kimi's tiktoken
/// tokenizer (`--store ct-int4`).
pub(crate) const KIMI_TOY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/kimi_int4_toy");
pub(crate) const FAMILY: &str = "deepseek_v3";

/// Largest `|gturbo − transformers|` accepted on a logit: both compute in f32 from the
/// same BF16 weights, only the order of the sums differs.
const LOGIT_ATOL: f32 = 1e-4;

pub(crate) fn meta(toy: &str) -> Meta {
    meta_of(toy, FAMILY)
}

fn install(out: &Path, extra: &[&str]) {
    install_toy(TOY, out, extra)
}

fn install_toy(toy: &str, out: &Path, extra: &[&str]) {
    toy::install_toy(FAMILY, toy, out, extra)
}

/// One BF16 (passthrough) install of the toy for this test run.
/// One BF16 install of the variant toy.
fn variant_bf16() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("deepseek-variant-bf16");
        let _ = std::fs::remove_dir_all(&root);
        let out = root.join("bf16.gturbo");
        install_toy(VARIANT, &out, &["--quant", "bf16"]);
        out
    })
}

/// One `--quant bf16` install of `toy` into `name` under the test run's temporary
/// folder, made once in `cell`.
fn bf16_once(cell: &'static OnceLock<PathBuf>, toy: &str, name: &str) -> &'static Path {
    cell.get_or_init(|| {
        let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
        let _ = std::fs::remove_dir_all(&root);
        let out = root.join("bf16.gturbo");
        install_toy(toy, &out, &["--quant", "bf16"]);
        out
    })
}

/// One BF16 install of the wide toy.
fn wide_bf16() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    bf16_once(&DIR, WIDE, "deepseek-wide-bf16")
}

/// One `--quant bf16` install of the FP8 toy (dequantized as MLX-LM does).
pub(crate) fn fp8_bf16() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    bf16_once(&DIR, FP8_TOY, "deepseek-fp8-bf16")
}

/// One `--quant bf16` install of the Kimi toy (its INT4 experts dequantized).
pub(crate) fn kimi_bf16() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    bf16_once(&DIR, KIMI_TOY, "kimi-int4-bf16")
}

pub(crate) fn bf16() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("deepseek-bf16");
        let _ = std::fs::remove_dir_all(&root);
        let out = root.join("bf16.gturbo");
        install(&out, &["--quant", "bf16"]);
        out
    })
}

/// Whether the resident file's header lists every MoE layer's correction bias as F32
/// at passthrough (never quantized, never narrowed).
fn bias_stays_f32(dir: &Path) -> bool {
    let bytes = std::fs::read(dir.join("resident.bin")).unwrap();
    let header = String::from_utf8_lossy(&bytes[..bytes.len().min(1 << 16)]).into_owned();
    (1..3).all(|l| {
        header.contains(&format!(
            r#"{{"name":"model.layers.{l}.mlp.gate.e_score_correction_bias","dtype":"F32","shape":[8],"scheme":"passthrough""#
        ))
    })
}

pub(crate) fn run_json(dir: &Path, extra: &[&str]) -> (Value, String) {
    let mut args = vec!["--max-tokens", "24"];
    args.extend_from_slice(extra);
    cli::run_json(dir, &args)
}

#[test]
fn the_bf16_install_pools_the_routed_layers_keeps_the_bias_f32_and_verifies() {
    let tmp = temp_dir();
    let out = tmp.path().join("bf16.gturbo");
    install(&out, &["--quant", "bf16"]);
    let o = gturbo_args(&["verify-install", out.to_str().unwrap()]);
    assert!(o.status.success(), "verify-install: {}", text(&o));
    let m = manifest(&out);
    assert_eq!(m["family"], FAMILY);
    assert_eq!(m["arch"]["axes"]["num_experts"], 8);
    assert_eq!(m["arch"]["axes"]["kv_lora_rank"], 64);
    let pools = m["expert_pools"].as_array().unwrap();
    // Layer 0 is dense (`first_k_dense_replace` 1).
    let layers: Vec<u64> = pools.iter().map(|p| p["layer"].as_u64().unwrap()).collect();
    assert_eq!(layers, [1, 2]);
    for p in pools {
        assert_eq!(p["experts"], 8);
        assert_eq!(p["scheme"], "passthrough");
    }
    assert!(bias_stays_f32(&out));
}

#[test]
fn an_int4_install_keeps_the_bias_f32_and_the_router_int8_and_records_its_quality() {
    let o = gturbo_args(&["install", FAMILY, "--from", TOY, "--dry-run", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let plan: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        plan["census"]["int8"]["tensors"], 2,
        "one router per MoE layer: {plan}"
    );
    let tmp = temp_dir();
    let q = tmp.path().join("int4.gturbo");
    install(&q, &[]);
    let m = manifest(&q);
    assert_eq!(m["quantized_at_install"]["scheme"], "int4_g64");
    assert_eq!(m["expert_pools"][0]["scheme"], "int4_g64");
    assert!(bias_stays_f32(&q));
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
    eprintln!("deepseek toy INT4 vs BF16: {ev}");
    let kl = ev["mean_kl_nats"].as_f64().unwrap();
    // Random Gaussian weights are INT4's worst case: the bound catches a broken
    // dequantization (KL of several nats), not a small regression.
    assert!(kl.is_finite() && kl > 0.0 && kl < 2.0, "{ev}");
    let g = meta(TOY);
    let (doc, footer) = run_json(&q, &["--backend", "cpu", "--prompt-ids", &csv(&g.prompt)]);
    assert_eq!(doc["tokens"].as_array().unwrap().len(), 24, "{footer}");
    assert_eq!(doc["runner"], FAMILY);
    assert_eq!(doc["quality"]["format"], "gturbo-quality", "{doc}");
    // The latent path's absorbed matrices come from INT4 rows (views of `W_UV_h`,
    // `W_UK_hᵀ` widened): the same dequantized weights as the expanded path's.
    let cpu = Cpu::new(2);
    let (latent, _) = rows_of_run(TOY, &q, &cpu, ExpertMode::Slots(2), KvLayout::Latent);
    let (expanded, _) = rows_of_run(TOY, &q, &cpu, ExpertMode::Slots(2), KvLayout::Expanded);
    let d = max_diff(&latent, &expanded);
    assert!(
        d <= LOGIT_ATOL,
        "INT4: latent and expanded caches differ by {d:.3e}"
    );
}

#[test]
fn greedy_tokens_equal_transformers_on_the_cpu_by_ids_and_by_text() {
    let g = meta(TOY);
    let dir = bf16();
    let (doc, footer) = run_json(dir, &["--backend", "cpu", "--prompt-ids", &csv(&g.prompt)]);
    assert_eq!(ids(&doc["tokens"]), g.greedy, "{footer}");
    assert_eq!(doc["runner"], FAMILY);
    assert_eq!(doc["family"], FAMILY);
    let (doc, footer) = run_json(dir, &["--backend", "cpu", "--prompt", &g.prompt_text]);
    assert_eq!(ids(&doc["prompt_ids"]), g.prompt, "{footer}");
    assert_eq!(ids(&doc["tokens"]), g.greedy, "{footer}");
}

#[cfg(feature = "gpu")]
#[test]
fn greedy_tokens_equal_transformers_on_the_gpu() {
    const TEST: &str = "greedy_tokens_equal_transformers_on_the_gpu";
    let Some(gpu) = crate::gpu::gpu(TEST) else {
        return;
    };
    drop(gpu);
    let g = meta(TOY);
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

/// The logits of the golden's prompt (all positions) and of each cached decode step fed
/// its greedy tokens, on the install `dir` with a KV cache of `layout`; and the model's
/// footer figure (the cache's bytes per token).
fn rows_of_run<B: Ops + 'static>(
    toy: &str,
    dir: &Path,
    backend: &B,
    experts: ExpertMode,
    layout: KvLayout,
) -> (Vec<Vec<f32>>, String) {
    let g = meta(toy);
    let install = load::open(
        dir,
        LoadOptions {
            experts,
            ..Default::default()
        },
    )
    .unwrap();
    let model: Box<dyn Model> = match layout {
        // `models::open` builds the default: the latent cache.
        KvLayout::Latent => models::open(&install, backend).unwrap(),
        KvLayout::Expanded => {
            Box::new(deepseek_v3::Model::with_layout(&install, backend, layout).unwrap())
        }
    };
    let vocab = model.vocab();
    let mut s = model.session();
    let all = model.forward(&mut s, &g.prompt, true).unwrap();
    let mut got: Vec<Vec<f32>> = all.chunks_exact(vocab).map(<[f32]>::to_vec).collect();
    for &t in &g.greedy[..g.greedy.len() - 1] {
        got.push(model.forward(&mut s, &[t], false).unwrap());
    }
    let stat = model.stats(got.len()).first().map(|s| s.text.clone());
    (got, stat.unwrap_or_default())
}

/// [`rows_of_run`] on the BF16 install, checked against transformers'
/// within [`LOGIT_ATOL`]; returns them.
fn logits_vs_golden<B: Ops + 'static>(
    toy: &str,
    backend: &B,
    experts: ExpertMode,
    layout: KvLayout,
) -> Vec<Vec<f32>> {
    let want = golden_rows(toy);
    let dir = match toy {
        TOY => bf16(),
        WIDE => wide_bf16(),
        FP8_TOY => fp8_bf16(),
        KIMI_TOY => kimi_bf16(),
        _ => variant_bf16(),
    };
    let (got, stats) = rows_of_run(toy, dir, backend, experts, layout);
    assert_eq!(got.len(), want.len(), "positions");
    let mut worst = (0f32, 0);
    for (p, (a, b)) in got.iter().zip(&want).enumerate() {
        let d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        if d > worst.0 {
            worst = (d, p);
        }
    }
    eprintln!(
        "{} on {}, {layout:?} cache: {} positions, max |logit − transformers| {:.3e} at {}; {}",
        Path::new(toy).file_name().unwrap().to_string_lossy(),
        backend.name(),
        got.len(),
        worst.0,
        worst.1,
        stats
    );
    assert!(
        worst.0 <= LOGIT_ATOL,
        "position {}: logits differ from transformers' by {:.3e} (> {LOGIT_ATOL})",
        worst.1,
        worst.0
    );
    got
}

/// Largest difference between two runs' logits.
pub(crate) fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// Both cache layouts against transformers, and against each other.
pub(crate) fn both_layouts<B: Ops + 'static>(toy: &str, backend: &B, experts: ExpertMode) {
    let latent = logits_vs_golden(toy, backend, experts, KvLayout::Latent);
    let expanded = logits_vs_golden(toy, backend, experts, KvLayout::Expanded);
    let d = max_diff(&latent, &expanded);
    eprintln!("deepseek toy: latent vs expanded cache, max |logit difference| {d:.3e}");
    assert!(
        d <= LOGIT_ATOL,
        "latent and expanded caches differ by {d:.3e}"
    );
}

#[test]
fn prompt_and_decode_logits_match_transformers_on_the_cpu_with_either_cache() {
    both_layouts(TOY, &Cpu::new(2), ExpertMode::Slots(2));
}

#[test]
fn the_variant_plain_q_ungrouped_half_split_toy_matches_transformers_on_both_backends() {
    let g = meta(VARIANT);
    let (doc, footer) = run_json(
        variant_bf16(),
        &["--backend", "cpu", "--prompt-ids", &csv(&g.prompt)],
    );
    assert_eq!(ids(&doc["tokens"]), g.greedy, "{footer}");
    both_layouts(VARIANT, &Cpu::new(2), ExpertMode::Slots(2));
    let Some(gpu) = crate::gpu::gpu(
        "the_variant_plain_q_ungrouped_half_split_toy_matches_transformers_on_both_backends",
    ) else {
        return;
    };
    both_layouts(VARIANT, &gpu, ExpertMode::Resident);
}

#[test]
fn the_wide_toy_with_v3s_576_wide_latent_keys_matches_transformers_on_both_backends() {
    const TEST: &str =
        "the_wide_toy_with_v3s_576_wide_latent_keys_matches_transformers_on_both_backends";
    let g = meta(WIDE);
    let prompt = csv(&g.prompt);
    let (doc, footer) = run_json(wide_bf16(), &["--backend", "cpu", "--prompt-ids", &prompt]);
    assert_eq!(ids(&doc["tokens"]), g.greedy, "{footer}");
    both_layouts(WIDE, &Cpu::new(2), ExpertMode::Slots(2));
    let Some(gpu) = crate::gpu::gpu(TEST) else {
        return;
    };
    let install = load::open(wide_bf16(), LoadOptions::default()).unwrap();
    let cfg = deepseek_v3::Config::from_manifest(&install.manifest).unwrap();
    let latent = cfg.mla.cache_spec(KvLayout::Latent);
    assert_eq!((latent.qk_dim, latent.v_dim), (576, 512));
    assert!(gpu.attends(&latent), "the GPU takes 576-wide latent keys");
    both_layouts(WIDE, &gpu, ExpertMode::Resident);
    drop(gpu);
    let (doc, footer) = run_json(wide_bf16(), &["--backend", "gpu", "--prompt-ids", &prompt]);
    assert!(
        doc["backend"].as_str().unwrap().starts_with("gpu "),
        "{doc}"
    );
    assert_eq!(ids(&doc["tokens"]), g.greedy, "{footer}");
}

#[test]
fn the_latent_cache_is_smaller_than_the_expanded_one_by_the_shapes() {
    let install = load::open(bf16(), LoadOptions::default()).unwrap();
    let cfg = deepseek_v3::Config::from_manifest(&install.manifest).unwrap();
    // 3 layers × 4 bytes × (4 heads × (48 + 32)) expanded, × (64 + 16) latent (the
    // values are read from the keys' latent part).
    assert_eq!(cfg.kv_bytes_per_token(KvLayout::Expanded), 3 * 4 * 4 * 80);
    assert_eq!(cfg.kv_bytes_per_token(KvLayout::Latent), 3 * 4 * (64 + 16));
}

#[cfg(feature = "gpu")]
#[test]
fn prompt_and_decode_logits_match_transformers_on_the_gpu_with_either_cache() {
    let Some(gpu) =
        crate::gpu::gpu("prompt_and_decode_logits_match_transformers_on_the_gpu_with_either_cache")
    else {
        return;
    };
    both_layouts(TOY, &gpu, ExpertMode::Slots(2));
    both_layouts(TOY, &gpu, ExpertMode::Resident);
    // DeepSeek-V3's own widths: the GPU kernel takes its latent cache (keys 512 + 64,
    // values the 512 inside them), so `models::open` builds the latent one there too.
    let v3 = MlaDims {
        hidden: 7168,
        heads: 128,
        q_lora: Some(1536),
        kv_lora: 512,
        nope: 128,
        rope: 64,
        v: 128,
        eps: 1e-6,
    };
    assert!(gpu.attends(&v3.cache_spec(KvLayout::Latent)));
    assert!(gpu.attends(&v3.cache_spec(KvLayout::Expanded)));
}

/// A safetensors file of BF16 tensors `(name, shape)`, every value 1.0.
fn ones_bf16_safetensors(tensors: &[(String, Vec<u64>)]) -> Vec<u8> {
    const ONE_BF16: [u8; 2] = 0x3f80u16.to_le_bytes();
    let mut head = serde_json::Map::new();
    head.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut at = 0u64;
    for (name, shape) in tensors {
        let bytes = 2 * shape.iter().product::<u64>();
        head.insert(
            name.clone(),
            serde_json::json!({"dtype": "BF16", "shape": shape, "data_offsets": [at, at + bytes]}),
        );
        at += bytes;
    }
    let mut header = serde_json::to_vec(&Value::Object(head)).unwrap();
    while !header.len().is_multiple_of(8) {
        header.push(b' ');
    }
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    out.extend(ONE_BF16.iter().cycle().take(at as usize));
    out
}

/// The toy with a multi-token-prediction layer at `model.layers.3` (layer 3 =
/// `num_hidden_layers`, in a third shard listed by the index, as DeepSeek-V3's layer
/// 61): the family's `mtp` sidecar drops it at install by default, and the install runs
/// transformers' greedy tokens (the runner refuses an install holding a layer past
/// `num_layers`).
#[test]
fn a_toy_with_an_mtp_layer_installs_without_it_and_runs() {
    let tmp = temp_dir();
    let snap = tmp.path().join("with-mtp");
    std::fs::create_dir_all(&snap).unwrap();
    for entry in std::fs::read_dir(TOY).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), snap.join(entry.file_name())).unwrap();
        }
    }
    let (h, vocab) = (128u64, 512u64);
    let p = "model.layers.3.";
    let mtp: Vec<(String, Vec<u64>)> = [
        ("enorm.weight", vec![h]),
        ("hnorm.weight", vec![h]),
        ("eh_proj.weight", vec![h, 2 * h]),
        ("input_layernorm.weight", vec![h]),
        ("post_attention_layernorm.weight", vec![h]),
        ("self_attn.o_proj.weight", vec![h, 4 * 32]),
        ("mlp.gate.weight", vec![8, h]),
        ("mlp.experts.0.gate_proj.weight", vec![64, h]),
        ("shared_head.norm.weight", vec![h]),
        ("shared_head.head.weight", vec![vocab, h]),
    ]
    .into_iter()
    .map(|(n, s)| (format!("{p}{n}"), s))
    .collect();
    let shard = "model-mtp.safetensors";
    std::fs::write(snap.join(shard), ones_bf16_safetensors(&mtp)).unwrap();
    let index_path = snap.join("model.safetensors.index.json");
    let mut index: Value = serde_json::from_slice(&std::fs::read(&index_path).unwrap()).unwrap();
    for (name, _) in &mtp {
        index["weight_map"][name] = Value::from(shard);
    }
    std::fs::write(&index_path, serde_json::to_vec_pretty(&index).unwrap()).unwrap();
    let config_path = snap.join("config.json");
    let mut config: Value = serde_json::from_slice(&std::fs::read(&config_path).unwrap()).unwrap();
    config["num_nextn_predict_layers"] = Value::from(1);
    std::fs::write(&config_path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();

    let out = tmp.path().join("bf16.gturbo");
    install_toy(snap.to_str().unwrap(), &out, &["--quant", "bf16"]);
    let o = gturbo_args(&["verify-install", out.to_str().unwrap()]);
    assert!(o.status.success(), "verify-install: {}", text(&o));
    let m = manifest(&out);
    assert_eq!(m["sidecars"]["mtp"], "skipped", "{m}");
    let layers: Vec<u64> = m["expert_pools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["layer"].as_u64().unwrap())
        .collect();
    assert_eq!(layers, [1, 2], "no pool for the MTP layer's expert");
    let g = meta(TOY);
    let (doc, footer) = run_json(&out, &["--backend", "cpu", "--prompt-ids", &csv(&g.prompt)]);
    assert_eq!(ids(&doc["tokens"]), g.greedy, "{footer}");
}
