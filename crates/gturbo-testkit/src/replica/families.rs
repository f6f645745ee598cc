//! Small Hugging Face checkpoints of the plain families, with random BF16 data:
//! Qwen3-MoE (`Qwen3MoeForCausalLM`, unfused experts), dense Qwen3
//! (`Qwen3ForCausalLM`) and Llama (`LlamaForCausalLM`, tied embeddings).
//!
//! Tensors are listed in module order per layer (`input_layernorm`, `self_attn.*`,
//! `post_attention_layernorm`, `mlp.*`), then `model.norm`, then `lm_head` when the
//! embeddings are untied. RMSNorm weights sit near 1 (these families scale by `w`,
//! not `1 + w`).

use std::io;
use std::path::Path;

use serde_json::{Value, json};

use super::hf_files::{Specials, write_tokenizer_files};
use super::st::{DataMode, ShardRule, TensorDef, write_checkpoint, write_json};
use super::{ReplicaSummary, finish_summary};

/// A tiny Qwen3-MoE checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Qwen3MoeSpec {
    /// Model width.
    pub hidden_size: u64,
    /// Decoder layers (all sparse: `decoder_sparse_step` 1, no `mlp_only_layers`).
    pub num_hidden_layers: u64,
    /// Query heads.
    pub num_attention_heads: u64,
    /// KV heads.
    pub num_key_value_heads: u64,
    /// Head width.
    pub head_dim: u64,
    /// Routed experts per layer.
    pub num_experts: u64,
    /// Experts chosen per token.
    pub num_experts_per_tok: u64,
    /// Width of each expert.
    pub moe_intermediate_size: u64,
    /// Vocabulary (the three ChatML specials take its last ids).
    pub vocab_size: u64,
    /// Weight files; 1 writes `model.safetensors` and no index.
    pub shards: usize,
    /// PRNG seed for the weights.
    pub seed: u64,
}

impl Qwen3MoeSpec {
    /// 2 layers, hidden 128, 8 experts of width 64, vocab 512, 2 shards.
    pub fn tiny() -> Self {
        Qwen3MoeSpec {
            hidden_size: 128,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 64,
            num_experts: 8,
            num_experts_per_tok: 2,
            moe_intermediate_size: 64,
            vocab_size: 512,
            shards: 2,
            seed: 0,
        }
    }
}

impl Qwen3MoeSpec {
    /// The install benchmark's checkpoint (`gturbo-dev replica qwen3-moe --bench`):
    /// hidden 1024, 64 experts of width 512, vocab 32000, 4 shards; about 206 MB of
    /// BF16 per layer, so `layers` 16 is 3.4 GB (1.7B parameters).
    pub fn bench(layers: u64) -> Self {
        Qwen3MoeSpec {
            hidden_size: 1024,
            num_hidden_layers: layers.max(1),
            num_attention_heads: 16,
            num_key_value_heads: 4,
            head_dim: 64,
            num_experts: 64,
            num_experts_per_tok: 8,
            moe_intermediate_size: 512,
            vocab_size: 32000,
            shards: 4,
            seed: 0,
        }
    }
}

/// A tiny dense Qwen3 checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Qwen3Spec {
    /// Model width.
    pub hidden_size: u64,
    /// Decoder layers.
    pub num_hidden_layers: u64,
    /// Query heads.
    pub num_attention_heads: u64,
    /// KV heads.
    pub num_key_value_heads: u64,
    /// Head width.
    pub head_dim: u64,
    /// MLP width.
    pub intermediate_size: u64,
    /// Vocabulary (the three ChatML specials take its last ids).
    pub vocab_size: u64,
    /// No `lm_head.weight` when true (as Qwen3-0.6B).
    pub tie_word_embeddings: bool,
    /// Weight files; 1 writes `model.safetensors` and no index.
    pub shards: usize,
    /// PRNG seed for the weights.
    pub seed: u64,
}

impl Qwen3Spec {
    /// 2 layers, hidden 128, MLP 256, vocab 512, tied embeddings, 1 file.
    pub fn tiny() -> Self {
        Qwen3Spec {
            hidden_size: 128,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 64,
            intermediate_size: 256,
            vocab_size: 512,
            tie_word_embeddings: true,
            shards: 1,
            seed: 0,
        }
    }
}

/// A tiny Llama checkpoint (head width is `hidden / heads`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LlamaSpec {
    /// Model width.
    pub hidden_size: u64,
    /// Decoder layers.
    pub num_hidden_layers: u64,
    /// Query heads.
    pub num_attention_heads: u64,
    /// KV heads.
    pub num_key_value_heads: u64,
    /// MLP width.
    pub intermediate_size: u64,
    /// Vocabulary (BOS and EOS take its last two ids).
    pub vocab_size: u64,
    /// No `lm_head.weight` when true (as Llama 3.2 1B/3B).
    pub tie_word_embeddings: bool,
    /// Weight files; 1 writes `model.safetensors` and no index.
    pub shards: usize,
    /// PRNG seed for the weights.
    pub seed: u64,
}

impl LlamaSpec {
    /// 2 layers, hidden 128 (4 heads × 32), MLP 256, vocab 512, tied, 1 file.
    pub fn tiny() -> Self {
        LlamaSpec {
            hidden_size: 128,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            intermediate_size: 256,
            vocab_size: 512,
            tie_word_embeddings: true,
            shards: 1,
            seed: 0,
        }
    }
}

/// Dimensions shared by the attention blocks of the three families.
struct Attn {
    h: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    qk_norm: bool,
}

fn attention(out: &mut Vec<TensorDef>, p: &str, a: &Attn) {
    let (q, kv) = (a.heads * a.head_dim, a.kv_heads * a.head_dim);
    out.push(TensorDef::bf16(
        format!("{p}self_attn.q_proj.weight"),
        &[q, a.h],
    ));
    out.push(TensorDef::bf16(
        format!("{p}self_attn.k_proj.weight"),
        &[kv, a.h],
    ));
    out.push(TensorDef::bf16(
        format!("{p}self_attn.v_proj.weight"),
        &[kv, a.h],
    ));
    out.push(TensorDef::bf16(
        format!("{p}self_attn.o_proj.weight"),
        &[a.h, q],
    ));
    if a.qk_norm {
        for n in ["q_norm", "k_norm"] {
            out.push(TensorDef::bf16_around(
                format!("{p}self_attn.{n}.weight"),
                &[a.head_dim],
                1.0,
            ));
        }
    }
}

fn dense_mlp(out: &mut Vec<TensorDef>, p: &str, h: u64, i: u64) {
    out.push(TensorDef::bf16(format!("{p}gate_proj.weight"), &[i, h]));
    out.push(TensorDef::bf16(format!("{p}up_proj.weight"), &[i, h]));
    out.push(TensorDef::bf16(format!("{p}down_proj.weight"), &[h, i]));
}

/// Embeddings, `layers` decoder layers built by `mlp`, final norm, and `lm_head`.
fn decoder(
    a: &Attn,
    layers: u64,
    vocab: u64,
    tied: bool,
    mlp: impl Fn(&mut Vec<TensorDef>, &str),
) -> Vec<TensorDef> {
    let mut out = vec![TensorDef::bf16("model.embed_tokens.weight", &[vocab, a.h])];
    for i in 0..layers {
        let p = format!("model.layers.{i}.");
        out.push(TensorDef::bf16_around(
            format!("{p}input_layernorm.weight"),
            &[a.h],
            1.0,
        ));
        attention(&mut out, &p, a);
        out.push(TensorDef::bf16_around(
            format!("{p}post_attention_layernorm.weight"),
            &[a.h],
            1.0,
        ));
        mlp(&mut out, &format!("{p}mlp."));
    }
    out.push(TensorDef::bf16_around("model.norm.weight", &[a.h], 1.0));
    if !tied {
        out.push(TensorDef::bf16("lm_head.weight", &[vocab, a.h]));
    }
    out
}

fn write_family(
    dir: &Path,
    tensors: &[TensorDef],
    shards: usize,
    seed: u64,
    config: &Value,
    specials: &Specials,
) -> io::Result<ReplicaSummary> {
    std::fs::create_dir_all(dir)?;
    let ckpt = write_checkpoint(
        dir,
        tensors,
        ShardRule::Count(shards),
        DataMode::Random { seed },
    )?;
    write_json(&dir.join("config.json"), config)?;
    let extra = write_tokenizer_files(dir, specials, 4096)?;
    finish_summary(dir, ckpt, extra)
}

fn qwen_common(
    model_type: &str,
    arch: &str,
    a: &Attn,
    layers: u64,
    vocab: u64,
    tied: bool,
    specials: &Specials,
) -> serde_json::Map<String, Value> {
    let v = json!({
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": a.h,
        "num_hidden_layers": layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "head_dim": a.head_dim,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_scaling": null,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "max_position_embeddings": 4096,
        "bos_token_id": specials.tokens[0].1,
        "eos_token_id": specials.eos_id(),
        "torch_dtype": "bfloat16",
        "use_cache": true,
        "transformers_version": "4.51.0",
    });
    match v {
        Value::Object(map) => map,
        _ => serde_json::Map::new(),
    }
}

/// Write a Qwen3-MoE snapshot (unfused `mlp.experts.{e}.{gate,up,down}_proj.weight`).
pub fn write_qwen3_moe(dir: &Path, spec: &Qwen3MoeSpec) -> io::Result<ReplicaSummary> {
    let a = Attn {
        h: spec.hidden_size,
        heads: spec.num_attention_heads,
        kv_heads: spec.num_key_value_heads,
        head_dim: spec.head_dim,
        qk_norm: true,
    };
    let (h, i) = (spec.hidden_size, spec.moe_intermediate_size);
    let tensors = decoder(
        &a,
        spec.num_hidden_layers,
        spec.vocab_size,
        false,
        |out, p| {
            out.push(TensorDef::bf16(
                format!("{p}gate.weight"),
                &[spec.num_experts, h],
            ));
            for e in 0..spec.num_experts {
                dense_mlp(out, &format!("{p}experts.{e}."), h, i);
            }
        },
    );
    let specials = Specials::chatml(spec.vocab_size.saturating_sub(3));
    let mut config = qwen_common(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        &a,
        spec.num_hidden_layers,
        spec.vocab_size,
        false,
        &specials,
    );
    for (k, v) in [
        ("num_experts", json!(spec.num_experts)),
        ("num_experts_per_tok", json!(spec.num_experts_per_tok)),
        ("moe_intermediate_size", json!(spec.moe_intermediate_size)),
        ("intermediate_size", json!(spec.moe_intermediate_size * 4)),
        ("norm_topk_prob", json!(true)),
        ("decoder_sparse_step", json!(1)),
        ("mlp_only_layers", json!([])),
        ("output_router_logits", json!(false)),
        ("router_aux_loss_coef", json!(0.001)),
    ] {
        config.insert(k.into(), v);
    }
    write_family(
        dir,
        &tensors,
        spec.shards,
        spec.seed,
        &Value::Object(config),
        &specials,
    )
}

/// Write a dense Qwen3 snapshot.
pub fn write_qwen3(dir: &Path, spec: &Qwen3Spec) -> io::Result<ReplicaSummary> {
    let a = Attn {
        h: spec.hidden_size,
        heads: spec.num_attention_heads,
        kv_heads: spec.num_key_value_heads,
        head_dim: spec.head_dim,
        qk_norm: true,
    };
    let tensors = decoder(
        &a,
        spec.num_hidden_layers,
        spec.vocab_size,
        spec.tie_word_embeddings,
        |out, p| dense_mlp(out, p, spec.hidden_size, spec.intermediate_size),
    );
    let specials = Specials::chatml(spec.vocab_size.saturating_sub(3));
    let mut config = qwen_common(
        "qwen3",
        "Qwen3ForCausalLM",
        &a,
        spec.num_hidden_layers,
        spec.vocab_size,
        spec.tie_word_embeddings,
        &specials,
    );
    config.insert("intermediate_size".into(), json!(spec.intermediate_size));
    write_family(
        dir,
        &tensors,
        spec.shards,
        spec.seed,
        &Value::Object(config),
        &specials,
    )
}

/// Write a Llama snapshot.
pub fn write_llama(dir: &Path, spec: &LlamaSpec) -> io::Result<ReplicaSummary> {
    let heads = spec.num_attention_heads.max(1);
    let a = Attn {
        h: spec.hidden_size,
        heads,
        kv_heads: spec.num_key_value_heads,
        head_dim: spec.hidden_size / heads,
        qk_norm: false,
    };
    let tensors = decoder(
        &a,
        spec.num_hidden_layers,
        spec.vocab_size,
        spec.tie_word_embeddings,
        |out, p| dense_mlp(out, p, spec.hidden_size, spec.intermediate_size),
    );
    let specials = Specials::llama3(spec.vocab_size.saturating_sub(2));
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.hidden_size / heads,
        "vocab_size": spec.vocab_size,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500_000.0,
        "rope_scaling": null,
        "attention_bias": false,
        "mlp_bias": false,
        "max_position_embeddings": 4096,
        "bos_token_id": specials.bos_id(),
        "eos_token_id": specials.eos_id(),
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
    });
    write_family(dir, &tensors, spec.shards, spec.seed, &config, &specials)
}
