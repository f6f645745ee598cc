//! Gated DeltaNet linear attention (`Qwen4ExpTextGatedDeltaNet`), the
//! `linear_attention` layers.
//!
//! For a block input `u` (`[T, H]`), with `nk` key heads of `dk`, `nv` value heads of
//! `dv`, `C = 2·nk·dk + nv·dv` conv channels:
//! ```text
//! c     = in_proj_qkv · u                          [T, C]  channels q | k | v
//! c'[t] = silu(Σ_i conv1d[ch, i] · c[t − (K−1) + i]) depthwise causal (state before the prompt)
//! beta  = sigmoid(in_proj_b · u);  g = −exp(A_log) · softplus(in_proj_a · u + dt_bias)
//! q ← l2(q) / √dk,  k ← l2(k); value head h reads key head h / (nv/nk)
//! S_h   ← S_h · e^g;  S_h ← S_h + k ⊗ ((v − S_hᵀ k) · beta);  o = S_hᵀ q
//! out   = out_proj · flatten(rms(o_h) · norm.weight · act(z_h))
//! ```
//! Prefill and decode both run the recurrence token by token (the reference's chunked
//! prefill is the same rule rearranged; in f32 the two agree to ~1e-6, and the
//! goldens' cached rollouts match a re-prefill to 2e-5). The state is the last `K − 1`
//! columns of `c` and one `[dk, dv]` matrix per value head.

use crate::runtime::kernels::ops::{GdnDims, Ops};
use crate::runtime::kernels::{Backend, OpResult};

/// One GDN layer's weights, as backend tensors.
pub struct GdnWeights<'a, B: Backend> {
    /// `in_proj_qkv` `[C, H]`.
    pub qkv: B::Weights<'a>,
    /// `in_proj_z` `[nv·dv, H]`.
    pub z: B::Weights<'a>,
    /// `in_proj_b` `[nv, H]`.
    pub b: B::Weights<'a>,
    /// `in_proj_a` `[nv, H]`.
    pub a: B::Weights<'a>,
    /// `conv1d.weight` `[C, 1, K]` flattened: channel `ch`, tap `i` at `ch·K + i`.
    pub conv: B::Buf,
    /// `A_log` `[nv]`.
    pub a_log: B::Buf,
    /// `dt_bias` `[nv]`.
    pub dt_bias: B::Buf,
    /// `norm.weight` `[dv]` (plain weight, not an offset).
    pub norm: B::Buf,
    /// `out_proj` `[H, nv·dv]`.
    pub out: B::Weights<'a>,
}

/// Per-sequence GDN state of one layer.
pub struct GdnState<B: Backend> {
    /// The last `K − 1` rows of `c` (`[K−1, C]`, oldest first; zeros before the prompt).
    pub conv: B::Buf,
    /// The recurrent state `[nv, dk, dv]`.
    pub recurrent: B::Buf,
}

impl<B: Backend> GdnState<B> {
    /// The state before the first token.
    pub fn new(b: &B, d: &GdnDims) -> OpResult<GdnState<B>> {
        Ok(GdnState {
            conv: b.zeros(d.conv_kernel.saturating_sub(1) * d.channels())?,
            recurrent: b.zeros(d.value_heads * d.key_dim * d.value_dim)?,
        })
    }
}

/// What one GDN call computes for `T` tokens (intermediates kept for traces).
pub struct GdnOut<B: Backend> {
    /// `in_proj_qkv · u` before the conv `[T, C]`.
    pub qkv: B::Buf,
    /// The delta-rule output before the gated norm `[T, nv·dv]`.
    pub core: B::Buf,
    /// The gated norm's output, into `out_proj` `[T, nv·dv]`.
    pub gated: B::Buf,
    /// The block output `[T, H]`.
    pub out: B::Buf,
}

/// Run `T` tokens of the block input `u` (`[T, H]`) through one GDN layer, advancing
/// `state`.
pub fn gdn_forward<B: Ops>(
    be: &B,
    w: &GdnWeights<'_, B>,
    d: &GdnDims,
    state: &mut GdnState<B>,
    u: &B::Buf,
    t: usize,
) -> OpResult<GdnOut<B>> {
    let (nv, vd, ch) = (d.value_heads, d.value_heads * d.value_dim, d.channels());
    let mut qkv = be.zeros(t * ch)?;
    be.linear(&w.qkv, u, &mut qkv)?;
    let mut z = be.zeros(t * vd)?;
    be.linear(&w.z, u, &mut z)?;
    let mut b = be.zeros(t * nv)?;
    be.linear(&w.b, u, &mut b)?;
    let mut a = be.zeros(t * nv)?;
    be.linear(&w.a, u, &mut a)?;
    let mut conv = be.zeros(t * ch)?;
    be.causal_conv_silu(&qkv, &w.conv, d.conv_kernel, 1, &mut state.conv, &mut conv)?;
    let mut core = be.zeros(t * vd)?;
    be.gdn_recurrence(
        &conv,
        &b,
        &a,
        &w.a_log,
        &w.dt_bias,
        d,
        &mut state.recurrent,
        &mut core,
    )?;
    let mut gated = be.zeros(t * vd)?;
    be.gated_norm(&core, &z, &w.norm, d.eps, d.gate, &mut gated)?;
    let mut out = be.zeros(t * d.hidden)?;
    be.linear(&w.out, &gated, &mut out)?;
    Ok(GdnOut {
        qkv,
        core,
        gated,
        out,
    })
}
