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
//! Two cache layouts ([`KvLayout`]), the same attention up to rounding:
//! - **expanded**: the cache holds every head's full keys and values
//!   (`heads · (nope + rope + v)` values per token and layer), transformers' naive form;
//! - **latent**: the cache holds the normed latent and the rope key, one KV head shared
//!   by every query head; `kv_b_proj` is absorbed per head into the query
//!   (`q_lat_h = W_UK_hᵀ q_nope_h`, so `q_nope_h · W_UK_h c = q_lat_h · c`) and into the
//!   output (`v_h = W_UV_h Σ_j w_j c_j`), as MLX-LM's `embed_q` / `unembed_out` and
//!   llama.cpp's `k_b` / `v_b` do. The cache holds keys `[c | k_pe]` only and reads the
//!   values `c` from them (`AttentionSpec::values_in_keys`): `kv_lora + rope` values per
//!   token and layer (576 for DeepSeek-V3, against 40,960 expanded).
//!
//! Where the order of a head's dims is free (q·k is a sum) the layout is
//! transformers' `[nope | rope]`, and `[latent | rope]` in latent form.

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

/// What an MLA layer's KV cache holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvLayout {
    /// Every head's keys and values.
    Expanded,
    /// The normed latent and the rope key (`kv_b_proj` absorbed).
    Latent,
}

impl MlaDims {
    /// A qk head: `nope + rope`.
    pub fn qk(&self) -> usize {
        self.nope + self.rope
    }

    /// A latent key: `kv_lora + rope`.
    pub fn latent_key(&self) -> usize {
        self.kv_lora + self.rope
    }

    /// The attention op's view of the cache of `layout`.
    pub fn cache_spec(&self, layout: KvLayout) -> AttentionSpec {
        match layout {
            KvLayout::Expanded => self.attention_spec(),
            KvLayout::Latent => AttentionSpec {
                kv_heads: 1,
                qk_dim: self.latent_key(),
                v_dim: self.kv_lora,
                window: None,
                values_in_keys: true,
            },
        }
    }

    /// Values one token adds to one layer's cache of `layout`.
    pub fn cache_values(&self, layout: KvLayout) -> usize {
        let s = self.cache_spec(layout);
        s.k_width() + s.stored_v_width()
    }

    /// The attention op's view of the expanded cache: one KV head per query head, keys
    /// `nope + rope` wide and values `v` wide.
    pub fn attention_spec(&self) -> AttentionSpec {
        AttentionSpec {
            kv_heads: self.heads,
            qk_dim: self.qk(),
            v_dim: self.v,
            window: None,
            values_in_keys: false,
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

/// `kv_b_proj` split per head for the latent layout.
pub struct Absorbed<'a, B: Backend> {
    /// Per head, `W_UK_hᵀ` `[kv_lora, nope]`: the query's nope part into the latent.
    pub k_t: Vec<B::Weights<'a>>,
    /// Per head, `W_UV_h` `[v, kv_lora]` (the head's value rows of `kv_b_proj`): the
    /// attended latent into the head's values.
    pub v: Vec<B::Weights<'a>>,
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
    /// `kv_b_proj` absorbed, for a latent cache; `None`: the cache is expanded.
    pub absorbed: Option<Absorbed<'a, B>>,
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
    /// The layout of this layer's cache: latent when `kv_b_proj` is absorbed.
    pub fn layout(&self) -> KvLayout {
        match self.absorbed {
            Some(_) => KvLayout::Latent,
            None => KvLayout::Expanded,
        }
    }

    /// `out = o_proj(attention)` for the `n` rows of `x`, storing what they add to the
    /// cache in `kv` (made with [`MlaDims::cache_spec`] of [`Mla::layout`]).
    #[allow(clippy::too_many_arguments)]
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
        // The rotated part of each query head, rotated.
        let mut q_pe = b.zeros(n * heads * d.rope)?;
        b.gather_cols(&q, qk, d.nope..qk, &mut q_pe)?;
        b.rope(step.table, &mut q_pe, heads, d.rope, step.pos)?;
        let (lat, k_pe) = self.latent(b, d, step, x, n)?;
        if let Some(ab) = &self.absorbed {
            return self.attend_latent(b, d, step, kv, ab, (&q, &q_pe), (&lat, &k_pe), n, out);
        }
        b.scatter_cols(&q_pe, step.rope_factor, qk, d.nope..qk, &mut q)?;
        let (k, v) = self.keys_values(b, d, &lat, &k_pe, step.rope_factor, n)?;
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

    /// The normed latent `[n, kv_lora]` and the rotated rope key `[n, rope]` of the
    /// rows of `x`.
    fn latent(
        &self,
        b: &B,
        d: &MlaDims,
        step: &MlaStep<'_, B>,
        x: &B::Buf,
        n: usize,
    ) -> OpResult<(B::Buf, B::Buf)> {
        let (r, a_width) = (d.kv_lora, d.latent_key());
        let mut ckv = b.zeros(n * a_width)?;
        b.linear(&self.kv_a, x, &mut ckv)?;
        let mut lat = b.zeros(n * r)?;
        b.gather_cols(&ckv, a_width, 0..r, &mut lat)?;
        let mut latn = b.zeros(n * r)?;
        b.rms_norm(&lat, &self.kv_norm, d.eps, NormGain::Weight, &mut latn)?;
        let mut k_pe = b.zeros(n * d.rope)?;
        b.gather_cols(&ckv, a_width, r..a_width, &mut k_pe)?;
        b.rope(step.table, &mut k_pe, 1, d.rope, step.pos)?;
        Ok((latn, k_pe))
    }

    /// Every head's keys `[n, heads, nope + rope]` (the shared rope key, scaled, in each
    /// head) and values `[n, heads, v]` from the latent.
    fn keys_values(
        &self,
        b: &B,
        d: &MlaDims,
        latn: &B::Buf,
        k_pe: &B::Buf,
        rope_factor: f32,
        n: usize,
    ) -> OpResult<(B::Buf, B::Buf)> {
        let (heads, qk) = (d.heads, d.qk());
        let kv_width = d.nope + d.v;
        let mut kvb = b.zeros(n * heads * kv_width)?;
        b.linear(&self.kv_b, latn, &mut kvb)?;
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
        b.hc_expand(k_pe, repeat, &mut k_pe_h)?;
        b.scatter_cols(&k_pe_h, rope_factor, qk, d.nope..qk, &mut k)?;
        let mut v = b.zeros(n * heads * d.v)?;
        b.gather_cols(&kvb, kv_width, d.nope..kv_width, &mut v)?;
        Ok((k, v))
    }

    /// Attention in latent space: each head's query `[W_UK_hᵀ q_nope_h | a·q_pe_h]`
    /// against the cached `[c | a·k_pe]` (one KV head), the attended latent turned into
    /// the head's values by `W_UV_h`, then `o_proj`.
    #[allow(clippy::too_many_arguments)]
    fn attend_latent(
        &self,
        b: &B,
        d: &MlaDims,
        step: &MlaStep<'_, B>,
        kv: &mut B::Kv,
        ab: &Absorbed<'_, B>,
        (q, q_pe): (&B::Buf, &B::Buf),
        (latn, k_pe): (&B::Buf, &B::Buf),
        n: usize,
        out: &mut B::Buf,
    ) -> OpResult {
        let (heads, qk, r, lw) = (d.heads, d.qk(), d.kv_lora, d.latent_key());
        let mut ql = b.zeros(n * heads * lw)?;
        let mut qn_h = b.zeros(n * d.nope)?;
        let mut ql_h = b.zeros(n * r)?;
        for (h, k_t) in ab.k_t.iter().enumerate() {
            b.gather_cols(q, heads * qk, h * qk..h * qk + d.nope, &mut qn_h)?;
            b.linear(k_t, &qn_h, &mut ql_h)?;
            b.scatter_cols(&ql_h, 1.0, heads * lw, h * lw..h * lw + r, &mut ql)?;
        }
        b.scatter_cols(q_pe, step.rope_factor, lw, r..lw, &mut ql)?;
        let mut k = b.zeros(n * lw)?;
        b.scatter_cols(latn, 1.0, lw, 0..r, &mut k)?;
        b.scatter_cols(k_pe, step.rope_factor, lw, r..lw, &mut k)?;
        let mut ol = b.zeros(n * heads * r)?;
        let at = Causal {
            pos: step.pos,
            heads,
            scale: step.scale,
        };
        // The values are the keys' latent part (`values_in_keys`): `k` again.
        b.attention(kv, &ql, &k, &k, at, None, &mut ol)?;
        let mut att = b.zeros(n * heads * d.v)?;
        let mut ol_h = b.zeros(n * r)?;
        let mut v_h = b.zeros(n * d.v)?;
        for (h, w_uv) in ab.v.iter().enumerate() {
            b.gather_cols(&ol, heads * r, h * r..(h + 1) * r, &mut ol_h)?;
            b.linear(w_uv, &ol_h, &mut v_h)?;
            b.scatter_cols(&v_h, 1.0, heads * d.v, h * d.v..(h + 1) * d.v, &mut att)?;
        }
        b.linear(&self.o, &att, out)
    }
}
