//! The seam between the Flash-Next runner and a backend: [`FlashOps`], the operations
//! the runner needs beyond the core [`Backend`] seam (the extension trait
//! `kernels::backend` foresees), with the geometry its ops take ([`HcDims`],
//! [`GdnDims`], [`IndexerDims`]) and [`Act`]. A leaf: the runner's modules build on it,
//! and each backend implements it (the CPU in [`super::ops`], the GPU in
//! `kernels::gpu::flash`).

use std::ops::Range;

use super::norm::GateAct;
use crate::runtime::kernels::{Backend, Causal, OpResult};

/// Stream geometry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HcDims {
    /// Streams `S` (`hc_count`).
    pub streams: usize,
    /// Stream width `H` (`hidden_size`).
    pub hidden: usize,
    /// The mix's low rank `R` (`hc_lowrank`).
    pub lowrank: usize,
    /// Norm epsilon.
    pub eps: f32,
}

impl HcDims {
    /// `S·H`, the residual width.
    pub fn width(&self) -> usize {
        self.streams * self.hidden
    }
}

/// GDN geometry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GdnDims {
    /// Stream width `H` (the block's input and output).
    pub hidden: usize,
    /// Key heads `nk`.
    pub key_heads: usize,
    /// Key head width `dk`.
    pub key_dim: usize,
    /// Value heads `nv` (a multiple of `nk`).
    pub value_heads: usize,
    /// Value head width `dv`.
    pub value_dim: usize,
    /// Conv taps `K`.
    pub conv_kernel: usize,
    /// Gated-norm epsilon.
    pub eps: f32,
    /// Output gate activation.
    pub gate: GateAct,
}

impl GdnDims {
    /// Conv channels `C = 2·nk·dk + nv·dv`.
    pub fn channels(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }

    /// Bytes of one layer's state (conv columns and recurrent matrices, f32).
    pub fn state_bytes(&self) -> usize {
        (self.conv_kernel.saturating_sub(1) * self.channels()
            + self.value_heads * self.key_dim * self.value_dim)
            * 4
    }
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

/// An elementwise activation, in place.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Act {
    /// `silu(x / d)` (the hyper-connection's low-rank mix: divide, then activate).
    SiluOver(f32),
    /// `sigmoid(x)`.
    Sigmoid,
    /// `2 · sigmoid(x / d)` (the hyper-connection's inject scale).
    TwoSigmoidOver(f32),
}

/// Flash-Next's operations over a backend's tensors. `Self::AttnCache` is one indexed
/// attention layer's cache: keys after norm and RoPE, values, the indexer's raw keys
/// and the pooled block keys.
pub trait FlashOps: Backend {
    /// One indexed-attention layer's cache.
    type AttnCache;

    /// Offset RMSNorm of each `group`-wide piece of `x`'s rows with its own offsets:
    /// `w` covers one row (`w.len()` a multiple of `group`), and piece `j` of a row
    /// becomes `x̂ · (1 + w[j·group..(j+1)·group])`, `x̂ = x / √(mean(x²) + eps)`. With
    /// `group = w.len()` this is [`Backend::rms_norm`] with `NormGain::OnePlusWeight`.
    fn norm_grouped(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        group: usize,
        eps: f32,
        out: &mut Self::Buf,
    ) -> OpResult;
    /// `act` of every element of `x`, in place.
    fn act(&self, x: &mut Self::Buf, act: Act) -> OpResult;
    /// `x[t] *= sigmoid(gate[t])` elementwise (same lengths).
    fn sigmoid_mul(&self, x: &mut Self::Buf, gate: &Self::Buf) -> OpResult;
    /// Scale row `t` of `x` (`[n, width]`) by `sigmoid(g[t])` (`g` `[n]`).
    fn scale_rows_sigmoid(&self, x: &mut Self::Buf, g: &Self::Buf) -> OpResult;
    /// Columns `cols` of each `width`-wide row of `x` into `out`
    /// (`[rows, cols.len()]`).
    fn gather_cols(
        &self,
        x: &Self::Buf,
        width: usize,
        cols: Range<usize>,
        out: &mut Self::Buf,
    ) -> OpResult;

    /// The residual at the embedding: each `[H]` row of `e` repeated `streams` times
    /// into `out` `[n, streams·H]`.
    fn hc_expand(&self, e: &Self::Buf, d: HcDims, out: &mut Self::Buf) -> OpResult;
    /// The block input of a hyper-connection: `out[t] = (1/S) Σ_j mix[t, j] ⊙ xn[t, j]`
    /// for `[n, S·H]` `mix` and `xn`, into `out` `[n, H]` (a sum over `j` in order,
    /// then the division).
    fn hc_mix(&self, mix: &Self::Buf, xn: &Self::Buf, d: HcDims, out: &mut Self::Buf) -> OpResult;
    /// The write-back: `x[t, j] += y[t] · inject[t, j]` for every stream `j` (`x`
    /// `[n, S·H]`, `inject` `[n, S]`, `y` `[n, H]`).
    fn hc_inject(
        &self,
        x: &mut Self::Buf,
        inject: &Self::Buf,
        y: &Self::Buf,
        d: HcDims,
    ) -> OpResult;

    /// Depthwise causal conv with SiLU over the `C`-channel rows of `x` (`[n, C]`):
    /// `out[t, c] = silu(Σ_{i<K} w[c·K + i] · x[t − (K−1−i)·dilation, c])`, where rows
    /// before the first new one come from `state` (`[(K−1)·dilation, C]`, oldest
    /// first), which then holds the last `(K−1)·dilation` rows of `state ++ x`.
    fn causal_conv_silu(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        taps: usize,
        dilation: usize,
        state: &mut Self::Buf,
        out: &mut Self::Buf,
    ) -> OpResult;
    /// The gated delta rule over the conv output `conv` (`[n, C]`, channels q | k | v)
    /// with `b`, `a` (`[n, nv]`, before sigmoid and softplus), advancing the
    /// recurrent state `state` (`[nv, dk, dv]`); the per-head output into `core`
    /// (`[n, nv·dv]`). The formula is [`super::gdn`]'s.
    #[allow(clippy::too_many_arguments)]
    fn gdn_recurrence(
        &self,
        conv: &Self::Buf,
        b: &Self::Buf,
        a: &Self::Buf,
        a_log: &Self::Buf,
        dt_bias: &Self::Buf,
        dims: &GdnDims,
        state: &mut Self::Buf,
        core: &mut Self::Buf,
    ) -> OpResult;
    /// The GDN's gated norm over `w.len()`-wide heads: `rms(o) · w · act(z)`.
    fn gated_norm(
        &self,
        o: &Self::Buf,
        z: &Self::Buf,
        w: &Self::Buf,
        eps: f32,
        act: GateAct,
        out: &mut Self::Buf,
    ) -> OpResult;

    /// The PLE gate for `[n, S·H]` `key` and `qry` and `[n, H]` `value`: per stream
    /// `g = Σ key_j ⊙ qry_j / √H`, `g = sign(g) · √max(|g|, 1e-6)`, and
    /// `out[t, j] = sigmoid(g) · value[t]`.
    fn ple_gate(
        &self,
        key: &Self::Buf,
        qry: &Self::Buf,
        value: &Self::Buf,
        d: HcDims,
        out: &mut Self::Buf,
    ) -> OpResult;

    /// An empty indexed-attention cache for `kv_heads` heads of `head_dim` and the
    /// indexer's geometry.
    fn attn_cache(
        &self,
        kv_heads: usize,
        head_dim: usize,
        indexer: IndexerDims,
    ) -> OpResult<Self::AttnCache>;
    /// Append the indexer's raw keys `raw` (`[n, d_i]`, no norm, no RoPE) of tokens
    /// `pos..pos + n` (forgetting any cached after `pos`), pool every block they
    /// complete (`rope(k_norm_offset(mean_f32(raw keys of the block)), block start)`),
    /// and return for each new token at `p` the relu-sum scores of its query heads
    /// `iq` (`[n, n_i·d_i]`, normed and rotated) against the `(p + 1) / cr` complete
    /// blocks: `Σ_h relu(q_h · key_b) / √d_i`.
    #[allow(clippy::too_many_arguments)]
    fn indexer_scores(
        &self,
        cache: &mut Self::AttnCache,
        iq: &Self::Buf,
        raw: &Self::Buf,
        k_norm: &Self::Buf,
        eps: f32,
        rope: &Self::Rope,
        pos: usize,
    ) -> OpResult<Vec<Vec<f32>>>;
    /// Store `k`, `v` (`[n, kv_heads·head_dim]`) at positions `at.pos..` of `cache`
    /// (forgetting any after), then attention of `q` (`[n, heads·head_dim]`) where the
    /// query at `p = at.pos + i` reads the tokens of the complete blocks `blocks[i]`
    /// and its incomplete tail block (`n_b·cr ..= p`, `n_b = (p + 1) / cr`), in
    /// ascending block order then the tail: `softmax(at.scale · q·k)` over exactly
    /// those keys, on their values.
    #[allow(clippy::too_many_arguments)]
    fn indexed_attention(
        &self,
        cache: &mut Self::AttnCache,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        at: Causal,
        blocks: &[Vec<usize>],
        out: &mut Self::Buf,
    ) -> OpResult;
}
