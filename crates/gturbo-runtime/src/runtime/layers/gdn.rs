//! Gated DeltaNet linear attention, the `linear_attention` layers of Flash-Next
//! (`Qwen4ExpTextGatedDeltaNet`) and Qwen3-Next (`Qwen3NextGatedDeltaNet`).
//!
//! For a block input `u` (`[T, H]`), with `nk` key heads of `dk`, `nv` value heads of
//! `dv`, `C = 2·nk·dk + nv·dv` conv channels:
//! ```text
//! c     = in_proj_qkv · u                          [T, C]  channels q | k | v
//!         (or, as Qwen3-Next packs it, gathered from in_proj_qkvz · u: see `GdnProj`)
//! c'[t] = silu(Σ_i conv1d[ch, i] · c[t − (K−1) + i]) depthwise causal (state before the prompt)
//! beta  = sigmoid(in_proj_b · u);  g = −exp(A_log) · softplus(in_proj_a · u + dt_bias)
//! q ← l2(q) / √dk,  k ← l2(k); value head h reads key head h / (nv/nk)
//! S_h   ← S_h · e^g;  S_h ← S_h + k ⊗ ((v − S_hᵀ k) · beta);  o = S_hᵀ q
//! out   = out_proj · flatten(rms(o_h) · norm.weight · act(z_h))   act: sigmoid (Flash-Next), silu (Qwen3-Next)
//! ```
//! Prefill and decode both run the recurrence token by token (the reference's chunked
//! prefill is the same rule rearranged; in f32 the two agree to ~1e-6, and the
//! goldens' cached rollouts match a re-prefill to 2e-5). The state is the last `K − 1`
//! columns of `c` and one `[dk, dv]` matrix per value head.

use crate::runtime::RunError;
use crate::runtime::kernels::ops::{GdnDims, Ops};
use crate::runtime::kernels::{Backend, OpResult};
use crate::runtime::models::state::{Part, Parts, import_buf};

/// How a GDN layer projects its input into `q | k | v`, `z`, `b` and `a`.
pub enum GdnProj<'a, B: Backend> {
    /// Flash-Next: one matrix each.
    Split {
        /// `in_proj_qkv` `[C, H]`, rows `q | k | v`.
        qkv: B::Weights<'a>,
        /// `in_proj_z` `[nv·dv, H]`.
        z: B::Weights<'a>,
        /// `in_proj_b` `[nv, H]`.
        b: B::Weights<'a>,
        /// `in_proj_a` `[nv, H]`.
        a: B::Weights<'a>,
    },
    /// Qwen3-Next: two matrices whose rows are grouped by key head, as transformers'
    /// `fix_query_key_value_ordering` splits them. With `r = nv/nk`:
    /// `in_proj_qkvz` `[nk·(2dk + 2r·dv), H]`, per key head `q (dk) | k (dk) | v (r·dv)
    /// | z (r·dv)`; `in_proj_ba` `[nk·2r, H]`, per key head `b (r) | a (r)`. The
    /// outputs are regrouped into the split layout by column gathers, so the weights
    /// stay as installed (INT4 groups run along the input dim, rows are untouched).
    Grouped {
        /// `in_proj_qkvz`.
        qkvz: B::Weights<'a>,
        /// `in_proj_ba`.
        ba: B::Weights<'a>,
    },
}

/// One GDN layer's weights, as backend tensors.
pub struct GdnWeights<'a, B: Backend> {
    /// The input projections.
    pub proj: GdnProj<'a, B>,
    /// `conv1d.weight` `[C, 1, K]` flattened: channel `ch`, tap `i` at `ch·K + i`.
    pub conv: B::Buf,
    /// `A_log` `[nv]`.
    pub a_log: B::Buf,
    /// `dt_bias` `[nv]`.
    pub dt_bias: B::Buf,
    /// `norm.weight` `[dv]` (plain weight, not an offset, in both models).
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

    /// Append the conv and recurrent states (two parts).
    pub fn export(&self, b: &B, parts: &mut Vec<Part>) -> Result<(), RunError> {
        parts.push(Part::F32(b.read(&self.conv)?));
        parts.push(Part::F32(b.read(&self.recurrent)?));
        Ok(())
    }

    /// The state held by the next two parts, of `d`'s sizes.
    pub fn import(b: &B, d: &GdnDims, r: &mut Parts<'_>) -> Result<GdnState<B>, RunError> {
        let conv = d.conv_kernel.saturating_sub(1) * d.channels();
        Ok(GdnState {
            conv: import_buf(b, r, "conv state", conv)?,
            recurrent: import_buf(
                b,
                r,
                "recurrent state",
                d.value_heads * d.key_dim * d.value_dim,
            )?,
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
    let mut z = be.zeros(t * vd)?;
    let mut b = be.zeros(t * nv)?;
    let mut a = be.zeros(t * nv)?;
    match &w.proj {
        GdnProj::Split {
            qkv: wqkv,
            z: wz,
            b: wb,
            a: wa,
        } => {
            be.linear(wqkv, u, &mut qkv)?;
            be.linear(wz, u, &mut z)?;
            be.linear(wb, u, &mut b)?;
            be.linear(wa, u, &mut a)?;
        }
        GdnProj::Grouped { qkvz, ba } => {
            grouped_projection(be, d, qkvz, ba, u, t, &mut qkv, &mut z, &mut b, &mut a)?;
        }
    }
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

/// Qwen3-Next's packed projections regrouped into `q | k | v` (`[T, C]`), `z`
/// (`[T, nv·dv]`), `b` and `a` (`[T, nv]`): the `[T, nk·g]` output of `in_proj_qkvz`
/// read as `T·nk` rows of one key head's `g = 2dk + 2r·dv` columns, each piece gathered
/// (a `[T·nk, dk]` gather is the `[T, nk·dk]` of all heads, heads in order), then `q`,
/// `k` and `v` scattered side by side; likewise `in_proj_ba`'s `2r`-wide groups.
#[allow(clippy::too_many_arguments)]
fn grouped_projection<B: Ops>(
    be: &B,
    d: &GdnDims,
    qkvz: &B::Weights<'_>,
    ba: &B::Weights<'_>,
    u: &B::Buf,
    t: usize,
    qkv: &mut B::Buf,
    z: &mut B::Buf,
    b: &mut B::Buf,
    a: &mut B::Buf,
) -> OpResult {
    let (nk, dk) = (d.key_heads, d.key_dim);
    let r = d.value_heads / nk;
    let rv = r * d.value_dim;
    let g = 2 * dk + 2 * rv;
    let (kw, ch) = (nk * dk, d.channels());
    let mut packed = be.zeros(t * nk * g)?;
    be.linear(qkvz, u, &mut packed)?;
    for (cols, dst) in [
        (0..dk, 0..kw),
        (dk..2 * dk, kw..2 * kw),
        (2 * dk..2 * dk + rv, 2 * kw..ch),
    ] {
        let mut piece = be.zeros(t * dst.len())?;
        be.gather_cols(&packed, g, cols, &mut piece)?;
        be.scatter_cols(&piece, 1.0, ch, dst, qkv)?;
    }
    be.gather_cols(&packed, g, 2 * dk + rv..g, z)?;
    let mut pba = be.zeros(t * 2 * d.value_heads)?;
    be.linear(ba, u, &mut pba)?;
    be.gather_cols(&pba, 2 * r, 0..r, b)?;
    be.gather_cols(&pba, 2 * r, r..2 * r, a)
}
