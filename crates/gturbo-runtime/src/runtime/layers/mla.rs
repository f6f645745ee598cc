//! Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), in transformers'
//! formulation (`DeepseekV3Attention`):
//!
//! - the query: `q_b(norm(q_a · x))` (q LoRA) or `q_proj · x`, per head `[nope | rope]`;
//! - the keys and values from one latent: `kv_a_proj_with_mqa · x` splits into the
//!   latent `c` (`kv_lora_rank`) and one rope key `k_pe` (`qk_rope_head_dim`) that every
//!   head shares; `kv_b · norm(c)` gives each head's `[k_nope | v]`;
//! - RoPE on the rope parts only (q's per head, `k_pe` once), each times YaRN's
//!   attention factor (transformers scales cos and sin by it);
//! - attention over keys `[k_nope | k_pe]` of width `nope + rope` and values of width
//!   `v_head_dim`, the softmax scale `1/√(nope + rope)` times YaRN's `mscale²`
//!   (`RopeSpec::softmax_scale`), then `o_proj`.
//!
//! This is the expanded path: the KV cache holds every head's full keys and values
//! (`heads · (nope + rope + v)` values per token and layer). Where the order of a
//! head's dims is free (q·k is a sum) the layout is transformers' `[nope | rope]`.

use crate::runtime::kernels::ops::{ElementwiseOps, HcDims, HyperConnectionOps};
use crate::runtime::kernels::{AttentionSpec, Backend, Causal, NormGain, OpResult};

/// An MLA layer's shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MlaDims {
    /// Model width.
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// The query's low rank (`q_lora_rank`), `None` for a plain `q_proj`.
    pub q_lora: Option<usize>,
    /// The latent's width (`kv_lora_rank`).
    pub kv_lora: usize,
    /// The unrotated part of a qk head (`qk_nope_head_dim`).
    pub nope: usize,
    /// The rotated part of a qk head (`qk_rope_head_dim`).
    pub rope: usize,
    /// A value head (`v_head_dim`).
    pub v: usize,
    /// RMSNorm epsilon of the low-rank norms.
    pub eps: f32,
}

impl MlaDims {
    /// A qk head: `nope + rope`.
    pub fn qk(&self) -> usize {
        self.nope + self.rope
    }

    /// The attention op's view of the expanded cache: one KV head per query head, keys
    /// `nope + rope` wide and values `v` wide.
    pub fn attention_spec(&self) -> AttentionSpec {
        AttentionSpec {
            kv_heads: self.heads,
            qk_dim: self.qk(),
            v_dim: self.v,
            window: None,
        }
    }
}

/// How the query is projected.
pub enum Query<'a, B: Backend> {
    /// `q_proj` `[heads·qk, H]` (`q_lora_rank` null).
    Plain(B::Weights<'a>),
    /// `q_b_proj(q_a_layernorm(q_a_proj x))`.
    LowRank {
        /// `q_a_proj` `[q_lora, H]`.
        a: B::Weights<'a>,
        /// `q_a_layernorm` `[q_lora]`.
        norm: B::Buf,
        /// `q_b_proj` `[heads·qk, q_lora]`.
        b: B::Weights<'a>,
    },
}

/// One MLA layer's weights.
pub struct Mla<'a, B: Backend> {
    /// The query projection.
    pub q: Query<'a, B>,
    /// `kv_a_proj_with_mqa` `[kv_lora + rope, H]`.
    pub kv_a: B::Weights<'a>,
    /// `kv_a_layernorm` `[kv_lora]`.
    pub kv_norm: B::Buf,
    /// `kv_b_proj` `[heads·(nope + v), kv_lora]`.
    pub kv_b: B::Weights<'a>,
    /// `o_proj` `[H, heads·v]`.
    pub o: B::Weights<'a>,
}

/// What one call of [`Mla::forward`] needs beyond the weights.
pub struct MlaStep<'r, B: Backend> {
    /// The RoPE table of the rope parts (`rope / 2` frequencies).
    pub table: &'r B::Rope,
    /// Position of the first token.
    pub pos: usize,
    /// The softmax scale (`1/√qk · mscale²`).
    pub scale: f32,
    /// YaRN's factor on the rotated parts (transformers' `attention_scaling`).
    pub rope_factor: f32,
}

impl<B: Backend + ElementwiseOps + HyperConnectionOps> Mla<'_, B> {
    /// `out = o_proj(attention)` for the `n` rows of `x`, storing their keys and values
    /// in `kv` (made with [`MlaDims::attention_spec`]).
    pub fn forward(
        &self,
        b: &B,
        d: &MlaDims,
        step: &MlaStep<'_, B>,
        kv: &mut B::Kv,
        x: &B::Buf,
        n: usize,
        out: &mut B::Buf,
    ) -> OpResult {
        let (heads, qk) = (d.heads, d.qk());
        let mut q = b.zeros(n * heads * qk)?;
        self.query(b, d, x, n, &mut q)?;
        // The rotated part of each query head, rotated, scaled and put back.
        let mut q_pe = b.zeros(n * heads * d.rope)?;
        b.gather_cols(&q, qk, d.nope..qk, &mut q_pe)?;
        b.rope(step.table, &mut q_pe, heads, d.rope, step.pos)?;
        b.scatter_cols(&q_pe, step.rope_factor, qk, d.nope..qk, &mut q)?;

        let (k, v) = self.keys_values(b, d, step, x, n)?;
        let mut att = b.zeros(n * heads * d.v)?;
        let at = Causal {
            pos: step.pos,
            heads,
            scale: step.scale,
        };
        b.attention(kv, &q, &k, &v, at, None, &mut att)?;
        b.linear(&self.o, &att, out)
    }

    /// The queries `[n, heads, nope + rope]`, unrotated.
    fn query(&self, b: &B, d: &MlaDims, x: &B::Buf, n: usize, q: &mut B::Buf) -> OpResult {
        match &self.q {
            Query::Plain(w) => b.linear(w, x, q),
            Query::LowRank { a, norm, b: wb } => {
                let r = d.q_lora.unwrap_or(0);
                let mut qa = b.zeros(n * r)?;
                b.linear(a, x, &mut qa)?;
                let mut qn = b.zeros(n * r)?;
                b.rms_norm(&qa, norm, d.eps, NormGain::Weight, &mut qn)?;
                b.linear(wb, &qn, q)
            }
        }
    }

    /// Every head's keys `[n, heads, nope + rope]` (the shared rope key rotated, scaled
    /// and repeated into each head) and values `[n, heads, v]`.
    fn keys_values(
        &self,
        b: &B,
        d: &MlaDims,
        step: &MlaStep<'_, B>,
        x: &B::Buf,
        n: usize,
    ) -> OpResult<(B::Buf, B::Buf)> {
        let (heads, qk, r) = (d.heads, d.qk(), d.kv_lora);
        let a_width = r + d.rope;
        let mut ckv = b.zeros(n * a_width)?;
        b.linear(&self.kv_a, x, &mut ckv)?;
        let mut lat = b.zeros(n * r)?;
        b.gather_cols(&ckv, a_width, 0..r, &mut lat)?;
        let mut latn = b.zeros(n * r)?;
        b.rms_norm(&lat, &self.kv_norm, d.eps, NormGain::Weight, &mut latn)?;
        let mut k_pe = b.zeros(n * d.rope)?;
        b.gather_cols(&ckv, a_width, r..a_width, &mut k_pe)?;
        b.rope(step.table, &mut k_pe, 1, d.rope, step.pos)?;

        let kv_width = d.nope + d.v;
        let mut kvb = b.zeros(n * heads * kv_width)?;
        b.linear(&self.kv_b, &latn, &mut kvb)?;
        let mut k = b.zeros(n * heads * qk)?;
        let mut part = b.zeros(n * heads * d.nope)?;
        b.gather_cols(&kvb, kv_width, 0..d.nope, &mut part)?;
        b.scatter_cols(&part, 1.0, qk, 0..d.nope, &mut k)?;
        let mut k_pe_h = b.zeros(n * heads * d.rope)?;
        let repeat = HcDims {
            streams: heads,
            hidden: d.rope,
            lowrank: 0,
            eps: d.eps,
        };
        b.hc_expand(&k_pe, repeat, &mut k_pe_h)?;
        b.scatter_cols(&k_pe_h, step.rope_factor, qk, d.nope..qk, &mut k)?;
        let mut v = b.zeros(n * heads * d.v)?;
        b.gather_cols(&kvb, kv_width, d.nope..kv_width, &mut v)?;
        Ok((k, v))
    }
}
