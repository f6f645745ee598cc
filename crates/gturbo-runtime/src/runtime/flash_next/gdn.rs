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

use super::norm::{l2_normalize, sigmoid, silu, softplus};
use super::seam::{FlashOps, GdnDims};
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

/// The depthwise causal conv with SiLU over `x` (`[T, C]`), tap `i` of output row `t`
/// reading row `t − (K−1−i)·dilation`, continuing from the state's `(K−1)·dilation`
/// earlier rows, which it then advances; into `out` `[T, C]`.
pub fn causal_conv_silu(
    x: &[f32],
    conv: &[f32],
    k: usize,
    dilation: usize,
    state: &mut [f32],
    out: &mut [f32],
) {
    let ch = conv.len() / k.max(1);
    let t = x.len() / ch.max(1);
    let past = k.saturating_sub(1) * dilation;
    assert!(
        k > 0
            && dilation > 0
            && conv.len() == ch * k
            && x.len() == t * ch
            && state.len() == past * ch
            && out.len() == x.len(),
        "causal_conv_silu: lengths"
    );
    // Rows −past … T−1.
    let mut ext = Vec::with_capacity(state.len() + x.len());
    ext.extend_from_slice(state);
    ext.extend_from_slice(x);
    for (ti, row) in out.chunks_exact_mut(ch).enumerate() {
        for (j, o) in row.iter_mut().enumerate() {
            let taps = &conv[j * k..(j + 1) * k];
            let mut acc = 0f32;
            for (i, &w) in taps.iter().enumerate() {
                acc += w * ext[(ti + past - (k - 1 - i) * dilation) * ch + j];
            }
            *o = silu(acc);
        }
    }
    let keep = state.len();
    state.copy_from_slice(&ext[ext.len() - keep..]);
}
/// One token of the gated delta rule for value head state `st` (`[dk, dv]`): decay,
/// write `v` against what the state predicts for `k`, read with `q`. `q` is already
/// l2-normalised and scaled, `k` l2-normalised.
pub fn delta_rule_step(
    st: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: f32,
    beta: f32,
    out: &mut [f32],
) {
    let (dk, dv) = (k.len(), v.len());
    assert!(
        st.len() == dk * dv && q.len() == dk && out.len() == dv,
        "delta_rule_step: lengths"
    );
    let decay = g.exp();
    for s in st.iter_mut() {
        *s *= decay;
    }
    let mut kv = vec![0f32; dv];
    for (row, &ki) in st.chunks_exact(dv).zip(k) {
        for (acc, &s) in kv.iter_mut().zip(row) {
            *acc += s * ki;
        }
    }
    let delta: Vec<f32> = v.iter().zip(&kv).map(|(&v, &m)| (v - m) * beta).collect();
    for (row, &ki) in st.chunks_exact_mut(dv).zip(k) {
        for (s, &d) in row.iter_mut().zip(&delta) {
            *s += ki * d;
        }
    }
    out.fill(0.0);
    for (row, &qi) in st.chunks_exact(dv).zip(q) {
        for (o, &s) in out.iter_mut().zip(row) {
            *o += s * qi;
        }
    }
}

/// The gated delta rule over `T` rows of the conv output `conv` (`[T, C]`): per
/// token, l2-normalise q (then divide by `√dk`) and k per key head, and for each value
/// head `h` (reading key head `h / (nv/nk)`) decay its state by `e^g`, `g = −e^A_log ·
/// softplus(a + dt_bias)`, write with `beta = sigmoid(b)` and read with q into `core`
/// (`[T, nv·dv]`).
#[allow(clippy::too_many_arguments)]
pub fn gdn_recurrence(
    conv: &[f32],
    b: &[f32],
    a: &[f32],
    a_log: &[f32],
    dt_bias: &[f32],
    d: &GdnDims,
    recurrent: &mut [f32],
    core: &mut [f32],
) {
    let (nk, dk, nv, dv) = (d.key_heads, d.key_dim, d.value_heads, d.value_dim);
    let (kd, vd, ch) = (nk * dk, nv * dv, d.channels());
    let t = conv.len() / ch;
    assert!(
        conv.len() == t * ch
            && b.len() == t * nv
            && a.len() == t * nv
            && core.len() == t * vd
            && recurrent.len() == nv * dk * dv,
        "gdn_recurrence: lengths"
    );
    let rep = nv / nk;
    let scale = (dk as f32).sqrt();
    for ti in 0..t {
        let row = &conv[ti * ch..(ti + 1) * ch];
        let mut q = row[..kd].to_vec();
        let mut k = row[kd..2 * kd].to_vec();
        let v = &row[2 * kd..];
        for (qh, kh) in q.chunks_exact_mut(dk).zip(k.chunks_exact_mut(dk)) {
            l2_normalize(qh);
            l2_normalize(kh);
            for x in qh.iter_mut() {
                *x /= scale;
            }
        }
        for h in 0..nv {
            let kh = h / rep;
            let beta = sigmoid(b[ti * nv + h]);
            let g = -a_log[h].exp() * softplus(a[ti * nv + h] + dt_bias[h]);
            delta_rule_step(
                &mut recurrent[h * dk * dv..(h + 1) * dk * dv],
                &q[kh * dk..(kh + 1) * dk],
                &k[kh * dk..(kh + 1) * dk],
                &v[h * dv..(h + 1) * dv],
                g,
                beta,
                &mut core[ti * vd + h * dv..ti * vd + (h + 1) * dv],
            );
        }
    }
}

/// Run `T` tokens of the block input `u` (`[T, H]`) through one GDN layer, advancing
/// `state`.
pub fn gdn_forward<B: FlashOps>(
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
