//! Gated full attention with the QSA indexer (`Qwen4ExpTextAttention`,
//! `Qwen4ExpTextQSAIndexer`), the `indexed_attention` layers.
//!
//! Attention, for a block input `u` (`[T, H]`), `nh` query heads, `nkv` KV heads of
//! width `d`:
//! ```text
//! [query | gate] = q_proj · u, per head (query first, then gate)
//! q = rope(q_norm(query)),  k = rope(k_norm(k_proj · u)),  v = v_proj · u
//! o = softmax_f32(q·k/√d over the allowed keys) · v     (head h reads KV head h/(nh/nkv))
//! out = o_proj · (o ⊙ sigmoid(gate))
//! ```
//! The allowed keys of a query at position `p` are the indexer's selected blocks plus
//! the incomplete tail block. The indexer (`n_i` heads of `d_i`, one key head,
//! compress ratio `cr`, `kb = budget / cr` blocks):
//! ```text
//! [qi | kraw] = index_qk_proj · u;   qi = rope(q_layernorm(qi), p)
//! n      = (p + 1) / cr                         complete blocks visible to p
//! key_b  = rope(k_layernorm(mean_f32(kraw[b·cr .. b·cr+cr])), b·cr)
//! s_b    = Σ_h relu(qi_h · key_b) / √d_i
//! sel    = torch.topk(s, min(kb, n)) as a set   (torch's tie rule: `topk`)
//! allowed = tokens of sel ∪ tokens n·cr ..= p
//! ```
//! When `(p + 1) % cr == 0` there is no tail, so the query's own block must win a
//! place. The selection equals dense causal attention exactly while `n ≤ kb`.
//! A block's key depends only on its `cr` raw keys, so it is computed once, when the
//! block completes, and cached with the KV cache.

use crate::runtime::kernels::ops::{IndexerDims, Ops};
use crate::runtime::kernels::topk::select_blocks;
use crate::runtime::kernels::{Backend, Causal, NormGain, OpResult};

/// The indexer's weights.
pub struct IndexerWeights<'a, B: Backend> {
    /// `index_qk_proj` `[(n_i + 1)·d_i, H]`: query heads, then the one key head.
    pub qk: B::Weights<'a>,
    /// `q_layernorm.weight` `[d_i]` (offset).
    pub q_norm: B::Buf,
    /// `k_layernorm.weight` `[d_i]` (offset).
    pub k_norm: B::Buf,
}

/// One attention layer's weights.
pub struct AttnWeights<'a, B: Backend> {
    /// `q_proj` `[nh·2d, H]`: per head `d` query rows then `d` gate rows.
    pub q: B::Weights<'a>,
    /// `k_proj` `[nkv·d, H]`.
    pub k: B::Weights<'a>,
    /// `v_proj` `[nkv·d, H]`.
    pub v: B::Weights<'a>,
    /// `o_proj` `[H, nh·d]`.
    pub o: B::Weights<'a>,
    /// `q_norm.weight` `[d]` (offset).
    pub q_norm: B::Buf,
    /// `k_norm.weight` `[d]` (offset).
    pub k_norm: B::Buf,
    /// The QSA indexer.
    pub indexer: IndexerWeights<'a, B>,
}

/// Attention geometry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnDims {
    /// Stream width `H` (the block's input and output).
    pub hidden: usize,
    /// Query heads `nh`.
    pub heads: usize,
    /// KV heads `nkv` (divides `nh`).
    pub kv_heads: usize,
    /// Head width `d`.
    pub head_dim: usize,
    /// Norm epsilon.
    pub eps: f32,
    /// The indexer's geometry.
    pub indexer: IndexerDims,
}

impl AttnDims {
    /// Bytes one layer's cache holds for `positions` tokens: keys and values, the
    /// indexer's raw keys and the pooled block keys (f32).
    pub fn cache_bytes(&self, positions: usize) -> usize {
        let ix = &self.indexer;
        (positions * (2 * self.kv_heads * self.head_dim + ix.head_dim)
            + positions / ix.compress * ix.head_dim)
            * 4
    }
}

/// What one attention call computes for `T` tokens.
pub struct AttnOut<B: Backend> {
    /// Attention output times the sigmoid gate, into `o_proj` `[T, nh·d]`.
    pub gated: B::Buf,
    /// The block output `[T, H]`.
    pub out: B::Buf,
    /// Per query: the indexer score of every complete visible block.
    pub scores: Vec<Vec<f32>>,
    /// Per query: the selected complete blocks, ascending.
    pub blocks: Vec<Vec<usize>>,
}

/// Run `T` tokens of the block input `u` (`[T, H]`) at positions `pos ..` through one
/// attention layer, appending to `cache`.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward<B: Ops>(
    b: &B,
    w: &AttnWeights<'_, B>,
    d: &AttnDims,
    rope: &B::Rope,
    cache: &mut B::AttnCache,
    pos: usize,
    u: &B::Buf,
    t: usize,
) -> OpResult<AttnOut<B>> {
    let (nh, nkv, hd, id) = (d.heads, d.kv_heads, d.head_dim, &d.indexer);
    let (ni, di) = (id.heads, id.head_dim);
    let (qw, kvw) = (nh * hd, nkv * hd);
    // The indexer's queries (normed per head, rotated) and raw keys.
    let iw = (ni + 1) * di;
    let mut qk = b.zeros(t * iw)?;
    b.linear(&w.indexer.qk, u, &mut qk)?;
    let mut iq_raw = b.zeros(t * ni * di)?;
    b.gather_cols(&qk, iw, 0..ni * di, &mut iq_raw)?;
    let mut raw = b.zeros(t * di)?;
    b.gather_cols(&qk, iw, ni * di..iw, &mut raw)?;
    let mut iq = b.zeros(t * ni * di)?;
    b.rms_norm(
        &iq_raw,
        &w.indexer.q_norm,
        d.eps,
        NormGain::OnePlusWeight,
        &mut iq,
    )?;
    b.rope(rope, &mut iq, ni, di, pos)?;
    // Attention projections: per head the query, then the gate.
    let mut qg = b.zeros(t * 2 * qw)?;
    b.linear(&w.q, u, &mut qg)?;
    let mut query = b.zeros(t * qw)?;
    b.gather_cols(&qg, 2 * hd, 0..hd, &mut query)?;
    let mut gate = b.zeros(t * qw)?;
    b.gather_cols(&qg, 2 * hd, hd..2 * hd, &mut gate)?;
    let mut kp = b.zeros(t * kvw)?;
    b.linear(&w.k, u, &mut kp)?;
    let mut v = b.zeros(t * kvw)?;
    b.linear(&w.v, u, &mut v)?;
    let mut q = b.zeros(t * qw)?;
    b.rms_norm(&query, &w.q_norm, d.eps, NormGain::OnePlusWeight, &mut q)?;
    b.rope(rope, &mut q, nh, hd, pos)?;
    let mut k = b.zeros(t * kvw)?;
    b.rms_norm(&kp, &w.k_norm, d.eps, NormGain::OnePlusWeight, &mut k)?;
    b.rope(rope, &mut k, nkv, hd, pos)?;
    // The indexer's choice, made on the host with torch's tie rule.
    let scores = b.indexer_scores(cache, &iq, &raw, &w.indexer.k_norm, d.eps, rope, pos)?;
    let blocks: Vec<Vec<usize>> = scores
        .iter()
        .map(|s| select_blocks(s, id.block_topk()))
        .collect();
    let at = Causal {
        pos,
        heads: nh,
        scale: 1.0 / (hd as f32).sqrt(),
    };
    let mut o = b.zeros(t * qw)?;
    b.indexed_attention(cache, &q, &k, &v, at, &blocks, &mut o)?;
    b.sigmoid_mul(&mut o, &gate)?;
    let mut out = b.zeros(t * d.hidden)?;
    b.linear(&w.o, &o, &mut out)?;
    Ok(AttnOut {
        gated: o,
        out,
        scores,
        blocks,
    })
}
