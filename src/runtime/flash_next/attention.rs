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

use super::norm::{offset_rms_norm, offset_rms_norm_inplace, sigmoid};
use super::rope::Rope;
use super::topk::torch_topk;
use crate::runtime::kernels::{Backend, Matrix, axpy, dot, softmax_inplace};

/// The indexer's weights.
pub struct IndexerWeights<'a> {
    /// `index_qk_proj` `[(n_i + 1)·d_i, H]`: query heads, then the one key head.
    pub qk: Matrix<'a>,
    /// `q_layernorm.weight` `[d_i]` (offset).
    pub q_norm: Vec<f32>,
    /// `k_layernorm.weight` `[d_i]` (offset).
    pub k_norm: Vec<f32>,
}

/// One attention layer's weights.
pub struct AttnWeights<'a> {
    /// `q_proj` `[nh·2d, H]`: per head `d` query rows then `d` gate rows.
    pub q: Matrix<'a>,
    /// `k_proj` `[nkv·d, H]`.
    pub k: Matrix<'a>,
    /// `v_proj` `[nkv·d, H]`.
    pub v: Matrix<'a>,
    /// `o_proj` `[H, nh·d]`.
    pub o: Matrix<'a>,
    /// `q_norm.weight` `[d]` (offset).
    pub q_norm: Vec<f32>,
    /// `k_norm.weight` `[d]` (offset).
    pub k_norm: Vec<f32>,
    /// The QSA indexer.
    pub indexer: IndexerWeights<'a>,
}

/// Attention geometry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnDims {
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

/// Indexer geometry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IndexerDims {
    /// Query heads `n_i`.
    pub heads: usize,
    /// Head width `d_i` (at least the rotary width).
    pub head_dim: usize,
    /// Token budget (a multiple of `cr`).
    pub budget: usize,
    /// Tokens per block `cr`.
    pub compress: usize,
}

impl IndexerDims {
    /// Blocks selected at most: `budget / cr`.
    pub fn block_topk(&self) -> usize {
        self.budget / self.compress
    }
}

/// Per-sequence cache of one attention layer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AttnCache {
    /// Keys after norm and RoPE, `[len, nkv·d]`.
    pub k: Vec<f32>,
    /// Values `[len, nkv·d]`.
    pub v: Vec<f32>,
    /// The indexer's raw keys `[len, d_i]` (no norm, no RoPE).
    pub raw_keys: Vec<f32>,
    /// Pooled, normed and rotated keys of the complete blocks `[len / cr, d_i]`.
    pub block_keys: Vec<f32>,
    /// Tokens cached.
    pub len: usize,
}

impl AttnCache {
    /// Bytes the cache holds.
    pub fn bytes(&self) -> usize {
        (self.k.len() + self.v.len() + self.raw_keys.len() + self.block_keys.len()) * 4
    }
}

/// What one attention call computes for `T` tokens.
#[derive(Debug, Clone, Default)]
pub struct AttnOut {
    /// Attention output times the sigmoid gate, into `o_proj` `[T, nh·d]`.
    pub gated: Vec<f32>,
    /// The block output `[T, H]`.
    pub out: Vec<f32>,
    /// Per query: the indexer score of every complete visible block.
    pub scores: Vec<Vec<f32>>,
    /// Per query: the selected complete blocks, ascending.
    pub blocks: Vec<Vec<usize>>,
}

/// The pooled key of one block: the f32 mean of its `cr` raw keys (`[cr, d_i]`),
/// `k_layernorm`, then RoPE at the block's first position.
pub fn block_key(raw: &[f32], k_norm: &[f32], eps: f32, rope: &Rope, start: usize) -> Vec<f32> {
    let di = k_norm.len();
    let cr = raw.len() / di.max(1);
    assert!(cr > 0 && raw.len() == cr * di, "block_key: lengths");
    let mut mean = vec![0f32; di];
    for r in raw.chunks_exact(di) {
        for (m, &x) in mean.iter_mut().zip(r) {
            *m += x;
        }
    }
    for m in &mut mean {
        *m /= cr as f32;
    }
    let mut key = vec![0f32; di];
    offset_rms_norm(&mean, k_norm, di, eps, &mut key);
    rope.apply(&mut key, di, start);
    key
}

/// Relu-sum scores of one query's heads (`[n_i, d_i]`, normed and rotated) against
/// block keys (`[n, d_i]`): `s_b = Σ_h relu(q_h · key_b) / √d_i`.
pub fn block_scores(q: &[f32], keys: &[f32], head_dim: usize) -> Vec<f32> {
    let scale = (head_dim as f32).sqrt();
    keys.chunks_exact(head_dim)
        .map(|kb| {
            let s: f32 = q
                .chunks_exact(head_dim)
                .map(|qh| dot(qh, kb).max(0.0))
                .sum();
            s / scale
        })
        .collect()
}

/// The blocks a query attends to: torch's top-`min(kb, n)` of its scores, as an
/// ascending set.
pub fn select_blocks(scores: &[f32], block_topk: usize) -> Vec<usize> {
    let mut sel = torch_topk(scores, block_topk.min(scores.len()));
    sel.sort_unstable();
    sel
}

/// The key positions a query at `pos` may read, ascending: the tokens of `blocks`
/// and the tail `n·cr ..= pos`.
pub fn allowed_positions(blocks: &[usize], compress: usize, pos: usize) -> Vec<usize> {
    let n = (pos + 1) / compress;
    let mut out: Vec<usize> = blocks
        .iter()
        .flat_map(|&b| b * compress..(b + 1) * compress)
        .collect();
    out.extend(n * compress..=pos);
    out
}

/// Run `T` tokens of the block input `u` (`[T, H]`) at positions `cache.len ..` through
/// one attention layer, appending to `cache`.
pub fn attention_forward(
    be: &dyn Backend,
    w: &AttnWeights,
    d: &AttnDims,
    rope: &Rope,
    cache: &mut AttnCache,
    u: &[f32],
    t: usize,
) -> AttnOut {
    let (nh, nkv, hd, id) = (d.heads, d.kv_heads, d.head_dim, &d.indexer);
    let (ni, di, cr) = (id.heads, id.head_dim, id.compress);
    let (qw, kvw) = (nh * hd, nkv * hd);
    let past = cache.len;
    // The indexer's queries and raw keys.
    let mut qk = vec![0f32; t * (ni + 1) * di];
    be.matmul(&w.indexer.qk, u, t, &mut qk);
    let mut iq = vec![0f32; t * ni * di];
    for (ti, row) in qk.chunks_exact((ni + 1) * di).enumerate() {
        let q = &mut iq[ti * ni * di..(ti + 1) * ni * di];
        offset_rms_norm(&row[..ni * di], &w.indexer.q_norm, di, d.eps, q);
        rope.apply(q, di, past + ti);
        cache.raw_keys.extend_from_slice(&row[ni * di..]);
    }
    // Attention projections.
    let mut qg = vec![0f32; t * 2 * qw];
    be.matmul(&w.q, u, t, &mut qg);
    let mut k = vec![0f32; t * kvw];
    be.matmul(&w.k, u, t, &mut k);
    let mut v = vec![0f32; t * kvw];
    be.matmul(&w.v, u, t, &mut v);
    let mut q = vec![0f32; t * qw];
    let mut gate = vec![0f32; t * qw];
    for ti in 0..t {
        for h in 0..nh {
            let src = &qg[ti * 2 * qw + h * 2 * hd..ti * 2 * qw + (h + 1) * 2 * hd];
            q[ti * qw + h * hd..ti * qw + (h + 1) * hd].copy_from_slice(&src[..hd]);
            gate[ti * qw + h * hd..ti * qw + (h + 1) * hd].copy_from_slice(&src[hd..]);
        }
        let pos = past + ti;
        let qt = &mut q[ti * qw..(ti + 1) * qw];
        offset_rms_norm_inplace(qt, &w.q_norm, hd, d.eps);
        rope.apply(qt, hd, pos);
        let kt = &mut k[ti * kvw..(ti + 1) * kvw];
        offset_rms_norm_inplace(kt, &w.k_norm, hd, d.eps);
        rope.apply(kt, hd, pos);
    }
    cache.k.extend_from_slice(&k);
    cache.v.extend_from_slice(&v);
    cache.len += t;

    let scale = 1.0 / (hd as f32).sqrt();
    let group = nh / nkv;
    let mut o = vec![0f32; t * qw];
    let mut all_scores = Vec::with_capacity(t);
    let mut all_blocks = Vec::with_capacity(t);
    for ti in 0..t {
        let pos = past + ti;
        // Blocks completed up to this query get their pooled keys.
        let n = (pos + 1) / cr;
        while cache.block_keys.len() / di < n {
            let b = cache.block_keys.len() / di;
            let raw = &cache.raw_keys[b * cr * di..(b + 1) * cr * di];
            let key = block_key(raw, &w.indexer.k_norm, d.eps, rope, b * cr);
            cache.block_keys.extend_from_slice(&key);
        }
        let scores = block_scores(
            &iq[ti * ni * di..(ti + 1) * ni * di],
            &cache.block_keys[..n * di],
            di,
        );
        let blocks = select_blocks(&scores, id.block_topk());
        let allowed = allowed_positions(&blocks, cr, pos);
        let mut att = vec![0f32; allowed.len()];
        for h in 0..nh {
            let kvh = h / group;
            let qh = &q[ti * qw + h * hd..ti * qw + (h + 1) * hd];
            for (s, &j) in att.iter_mut().zip(&allowed) {
                *s = dot(qh, &cache.k[j * kvw + kvh * hd..j * kvw + (kvh + 1) * hd]) * scale;
            }
            softmax_inplace(&mut att);
            let oh = &mut o[ti * qw + h * hd..ti * qw + (h + 1) * hd];
            for (&p, &j) in att.iter().zip(&allowed) {
                axpy(
                    p,
                    &cache.v[j * kvw + kvh * hd..j * kvw + (kvh + 1) * hd],
                    oh,
                );
            }
        }
        all_scores.push(scores);
        all_blocks.push(blocks);
    }
    for (x, &g) in o.iter_mut().zip(&gate) {
        *x *= sigmoid(g);
    }
    let h = w.o.rows();
    let mut out = vec![0f32; t * h];
    be.matmul(&w.o, &o, t, &mut out);
    AttnOut {
        gated: o,
        out,
        scores: all_scores,
        blocks: all_blocks,
    }
}
