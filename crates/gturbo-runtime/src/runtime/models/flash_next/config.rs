//! The Flash-Next numbers, read from the manifest's `arch.axes` (which the family
//! file `families/qwen38flashnext.json` extracts from `config.json`'s `text_config`)
//! and checked against each other.
//!
//! Two facts of the config are lists or strings, which axes cannot carry, so they are
//! read from the install itself: which layers are `indexed_attention` (those with
//! `self_attn.*` tensors; the rest have `linear_attn.*`, as `layer_types` says) and
//! which layers have PLE (those with an n-gram row pool, as `ple_layer_ids` says).
//! The GDN output gate (`output_gate_type`, a string) is sigmoid, as in the real and
//! toy configs; the reference's fallback for a config without it (`hidden_act`,
//! silu) is not reachable from an install.

use super::attention::AttnDims;
use super::ple::PleDims;
use crate::format::manifest::Manifest;
use crate::runtime::RunError;
use crate::runtime::kernels::ops::GateAct;
use crate::runtime::kernels::ops::{GdnDims, HcDims, IndexerDims};
use crate::runtime::layers::axes::Axes;
use crate::runtime::layers::sparse_moe::MoeDims;

/// What kind of token mixer a layer has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet (`linear_attention`).
    Linear,
    /// Gated attention with the QSA indexer (`indexed_attention`).
    Indexed,
}

/// Every number the qwen4_exp forward pass needs.
#[derive(Debug, Clone, PartialEq)]
pub struct FlashConfig {
    /// Stream width `H`.
    pub hidden: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// `rms_norm_eps`.
    pub eps: f32,
    /// Longest sequence (`max_position_embeddings`).
    pub max_positions: usize,
    /// `eos_token_id` (PLE history padding and segment ends).
    pub eos: u32,
    /// RoPE base.
    pub rope_theta: f64,
    /// Rotated dimensions per head: `int(head_dim · partial_rotary_factor)`.
    pub rotary_dim: usize,
    /// Hyper-connection streams.
    pub hc: HcDims,
    /// `hc_lowrank`.
    pub hc_lowrank: usize,
    /// Attention and indexer geometry.
    pub attn: AttnDims,
    /// GDN geometry.
    pub gdn: GdnDims,
    /// Routing.
    pub moe: MoeDims,
    /// Routed expert width.
    pub moe_intermediate: usize,
    /// Shared expert width.
    pub shared_intermediate: usize,
    /// PLE geometry (the row width is checked against the row pools at load).
    pub ple: PleDims,
    /// `ple_embed_dim`.
    pub ple_embed_dim: usize,
    /// Primes' lower bound for the n-gram head vocabularies, when the config says.
    pub ngram_vocab_size_base: Option<u64>,
    /// The n-gram table's row count is a multiple of this, when the config says.
    pub ngram_vocab_divisor: Option<u64>,
}

/// The Flash-Next runner reads integer axes below 2^40.
const AXIS_BELOW: u64 = 1 << 40;

/// The axes read and checked before the buffer sizes are: the geometry every
/// later stage shares.
struct Core {
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    indexer: IndexerDims,
    nk: usize,
    nv: usize,
    experts: usize,
    top_k: usize,
    eps: f32,
    streams: usize,
    vocab: usize,
    eos: u32,
    ngram: usize,
    heads_per_ngram: usize,
    ple_embed_dim: usize,
    ple_heads: usize,
}

impl FlashConfig {
    /// Read and cross-check the axes. Nothing here depends on the tensors.
    ///
    /// The stages read the axes in a fixed order, so the first bad axis named is
    /// always the same one.
    pub fn from_manifest(m: &Manifest) -> Result<FlashConfig, RunError> {
        let a = Axes::new(m, AXIS_BELOW, "missing (the Flash-Next runner needs it)");
        let c = read_core(&a)?;
        check_sizes(&a, &c)?;
        assemble(&a, &c)
    }
}

/// The attention geometry: heads, head width, rotated dimensions.
/// Returns `(hidden, heads, kv_heads, head_dim, rotary_dim)`.
fn read_attention(a: &Axes) -> Result<(usize, usize, usize, usize, usize), RunError> {
    let hidden = a.usize("hidden_size")?;
    let heads = a.usize("num_attention_heads")?;
    let kv_heads = a.usize("num_key_value_heads")?;
    if !heads.is_multiple_of(kv_heads) {
        return Err(a.err(
            "num_key_value_heads",
            &format!("{kv_heads} does not divide num_attention_heads {heads}"),
        ));
    }
    let head_dim = a.usize("head_dim")?;
    let prf = a.f64("partial_rotary_factor")?;
    if prf > 1.0 {
        return Err(a.err("partial_rotary_factor", &format!("{prf} is above 1")));
    }
    // Python's int() of the product, as the reference computes it.
    let rotary_dim = (head_dim as f64 * prf) as usize;
    if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) {
        return Err(a.err(
            "partial_rotary_factor",
            &format!("head_dim {head_dim} × {prf} = {rotary_dim} rotated dimensions; RoPE needs a positive even number"),
        ));
    }
    Ok((hidden, heads, kv_heads, head_dim, rotary_dim))
}

/// The QSA indexer's geometry, checked against the rotated width.
fn read_indexer(a: &Axes, rotary_dim: usize) -> Result<IndexerDims, RunError> {
    let ix_heads = a.usize("indexer_n_heads")?;
    if let Some(kvh) = a.opt_usize("indexer_kv_heads")?
        && kvh != 1
    {
        return Err(a.err(
            "indexer_kv_heads",
            &format!("{kvh}; the QSA indexer has one key head"),
        ));
    }
    let ix_dim = a.usize("indexer_head_dim")?;
    if rotary_dim > ix_dim {
        return Err(a.err(
            "indexer_head_dim",
            &format!("{ix_dim} is narrower than the {rotary_dim} rotated dimensions"),
        ));
    }
    let budget = a.usize("indexer_budget")?;
    let compress = a.usize("indexer_compress_ratio")?;
    if !budget.is_multiple_of(compress) {
        return Err(a.err(
            "indexer_budget",
            &format!("{budget} is not a multiple of indexer_compress_ratio {compress}"),
        ));
    }
    Ok(IndexerDims {
        heads: ix_heads,
        head_dim: ix_dim,
        budget,
        compress,
    })
}

/// GDN head counts and routing: `(nk, nv, experts, top_k)`.
fn read_mixers(a: &Axes) -> Result<(usize, usize, usize, usize), RunError> {
    let nk = a.usize("linear_num_key_heads")?;
    let nv = a.usize("linear_num_value_heads")?;
    if !nv.is_multiple_of(nk) {
        return Err(a.err(
            "linear_num_value_heads",
            &format!("{nv} is not a multiple of linear_num_key_heads {nk}"),
        ));
    }
    let experts = a.usize("num_experts")?;
    let top_k = a.usize("num_experts_per_tok")?;
    if top_k > experts {
        return Err(a.err(
            "num_experts_per_tok",
            &format!("{top_k} is more than num_experts {experts}"),
        ));
    }
    Ok((nk, nv, experts, top_k))
}

/// `eos_token_id`, a token id below `vocab_size`.
fn read_eos(a: &Axes, vocab: usize) -> Result<u32, RunError> {
    match a.value("eos_token_id").and_then(|v| v.as_u64()) {
        Some(e) if (e as usize) < vocab => Ok(e as u32),
        _ => Err(a.err(
            "eos_token_id",
            &format!("missing or not a token id below vocab_size {vocab}"),
        )),
    }
}

/// The n-gram geometry: `(ngram, heads_per_ngram, ple_embed_dim, ple_heads)`.
fn read_ngram(a: &Axes) -> Result<(usize, usize, usize, usize), RunError> {
    let ngram = a.usize("ngram_size")?;
    if ngram < 2 {
        return Err(a.err("ngram_size", &format!("{ngram}; n-grams start at bigrams")));
    }
    let heads_per_ngram = a.usize("heads_per_ngram")?;
    let ple_embed_dim = a.usize("ple_embed_dim")?;
    let ple_heads = (ngram - 1).saturating_mul(heads_per_ngram);
    if ple_heads > ple_embed_dim || !ple_embed_dim.is_multiple_of(ple_heads) {
        return Err(a.err(
            "ple_embed_dim",
            &format!("{ple_embed_dim} is not a multiple of the {ple_heads} n-gram heads"),
        ));
    }
    Ok((ngram, heads_per_ngram, ple_embed_dim, ple_heads))
}

/// Every axis the buffer sizes are products of, in the order they are checked.
fn read_core(a: &Axes) -> Result<Core, RunError> {
    let (hidden, heads, kv_heads, head_dim, rotary_dim) = read_attention(a)?;
    let indexer = read_indexer(a, rotary_dim)?;
    let (nk, nv, experts, top_k) = read_mixers(a)?;
    let eps = a.f64("rms_norm_eps")? as f32;
    let streams = a.usize("hc_count")?;
    let vocab = a.usize("vocab_size")?;
    let eos = read_eos(a, vocab)?;
    let (ngram, heads_per_ngram, ple_embed_dim, ple_heads) = read_ngram(a)?;
    Ok(Core {
        hidden,
        heads,
        kv_heads,
        head_dim,
        rotary_dim,
        indexer,
        nk,
        nv,
        experts,
        top_k,
        eps,
        streams,
        vocab,
        eos,
        ngram,
        heads_per_ngram,
        ple_embed_dim,
        ple_heads,
    })
}

/// Buffer sizes are products of axes; a manifest whose products overflow (or
/// exceed 2^40 elements) describes no installable model.
fn check_sizes(a: &Axes, c: &Core) -> Result<(), RunError> {
    let sizes: [(&str, &[usize]); 8] = [
        ("hc_count", &[c.streams, c.hidden]),
        ("num_attention_heads", &[c.heads, c.head_dim, 2]),
        ("num_key_value_heads", &[c.kv_heads, c.head_dim]),
        (
            "indexer_n_heads",
            &[c.indexer.heads + 1, c.indexer.head_dim],
        ),
        (
            "linear_num_value_heads",
            &[
                c.nv,
                a.usize("linear_key_head_dim")?,
                a.usize("linear_value_head_dim")?,
            ],
        ),
        (
            "linear_num_key_heads",
            &[c.nk, a.usize("linear_key_head_dim")?, 2],
        ),
        ("vocab_size", &[c.vocab, c.hidden]),
        (
            "ple_conv_kernel_size",
            &[
                a.usize("ple_conv_kernel_size")?,
                c.ngram,
                c.streams,
                c.hidden,
            ],
        ),
    ];
    for (axis, factors) in sizes {
        let n = factors
            .iter()
            .try_fold(1usize, |acc, &f| acc.checked_mul(f));
        if n.is_none_or(|n| n > 1 << 40) {
            return Err(a.err(axis, &format!("the product {factors:?} is too large")));
        }
    }
    Ok(())
}

/// The config, from the checked core and the axes no check involves (read here,
/// in this order).
fn assemble(a: &Axes, c: &Core) -> Result<FlashConfig, RunError> {
    let (hidden, eps) = (c.hidden, c.eps);
    Ok(FlashConfig {
        hidden,
        layers: a.usize("num_layers")?,
        vocab: c.vocab,
        eps,
        max_positions: a.usize("max_position_embeddings")?,
        eos: c.eos,
        rope_theta: a.f64("rope_theta")?,
        rotary_dim: c.rotary_dim,
        hc: HcDims {
            streams: c.streams,
            hidden,
            lowrank: a.usize("hc_lowrank")?,
            eps,
        },
        hc_lowrank: a.usize("hc_lowrank")?,
        attn: AttnDims {
            hidden,
            heads: c.heads,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
            eps,
            indexer: c.indexer,
        },
        gdn: GdnDims {
            hidden,
            key_heads: c.nk,
            key_dim: a.usize("linear_key_head_dim")?,
            value_heads: c.nv,
            value_dim: a.usize("linear_value_head_dim")?,
            conv_kernel: a.usize("linear_conv_kernel_dim")?,
            eps,
            gate: GateAct::Sigmoid,
        },
        moe: MoeDims {
            hidden,
            experts: c.experts,
            top_k: c.top_k,
            norm_topk_prob: a.bool("norm_topk_prob")?,
        },
        moe_intermediate: a.usize("moe_intermediate_size")?,
        shared_intermediate: a.usize("shared_expert_intermediate_size")?,
        ple: PleDims {
            ngram: c.ngram,
            heads_per_ngram: c.heads_per_ngram,
            row_width: c.ple_embed_dim / c.ple_heads,
            conv_kernel: a.usize("ple_conv_kernel_size")?,
            streams: c.streams,
            hidden,
            eps,
            eos: c.eos as i64,
        },
        ple_embed_dim: c.ple_embed_dim,
        ngram_vocab_size_base: a.opt_usize("ngram_vocab_size_base")?.map(|v| v as u64),
        ngram_vocab_divisor: a
            .opt_usize("make_ngram_vocab_size_divisible_by")?
            .map(|v| v as u64),
    })
}
