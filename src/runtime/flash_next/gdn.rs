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

use super::norm::{GateAct, gated_rms_norm, l2_normalize, sigmoid, silu, softplus};
use crate::runtime::kernels::{Backend, Matrix};

/// One GDN layer's weights.
pub struct GdnWeights<'a> {
    /// `in_proj_qkv` `[C, H]`.
    pub qkv: Matrix<'a>,
    /// `in_proj_z` `[nv·dv, H]`.
    pub z: Matrix<'a>,
    /// `in_proj_b` `[nv, H]`.
    pub b: Matrix<'a>,
    /// `in_proj_a` `[nv, H]`.
    pub a: Matrix<'a>,
    /// `conv1d.weight` `[C, 1, K]` flattened: channel `ch`, tap `i` at `ch·K + i`.
    pub conv: Vec<f32>,
    /// `A_log` `[nv]`.
    pub a_log: Vec<f32>,
    /// `dt_bias` `[nv]`.
    pub dt_bias: Vec<f32>,
    /// `norm.weight` `[dv]` (plain weight, not an offset).
    pub norm: Vec<f32>,
    /// `out_proj` `[H, nv·dv]`.
    pub out: Matrix<'a>,
}

/// GDN geometry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GdnDims {
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
}

/// Per-sequence GDN state of one layer.
#[derive(Debug, Clone, PartialEq)]
pub struct GdnState {
    /// The last `K − 1` rows of `c` (`[K−1, C]`, oldest first; zeros before the prompt).
    pub conv: Vec<f32>,
    /// The recurrent state `[nv, dk, dv]`.
    pub recurrent: Vec<f32>,
}

impl GdnState {
    /// The state before the first token.
    pub fn new(d: &GdnDims) -> GdnState {
        GdnState {
            conv: vec![0.0; d.conv_kernel.saturating_sub(1) * d.channels()],
            recurrent: vec![0.0; d.value_heads * d.key_dim * d.value_dim],
        }
    }

    /// Bytes the state holds.
    pub fn bytes(&self) -> usize {
        (self.conv.len() + self.recurrent.len()) * 4
    }
}

/// What one GDN call computes for `T` tokens (intermediates kept for traces).
#[derive(Debug, Clone, Default)]
pub struct GdnOut {
    /// `in_proj_qkv · u` before the conv `[T, C]`.
    pub qkv: Vec<f32>,
    /// The delta-rule output before the gated norm `[T, nv·dv]`.
    pub core: Vec<f32>,
    /// The gated norm's output, into `out_proj` `[T, nv·dv]`.
    pub gated: Vec<f32>,
    /// The block output `[T, H]`.
    pub out: Vec<f32>,
}

/// The depthwise causal conv with SiLU over `c` (`[T, C]`), continuing from the
/// state's `K − 1` earlier rows, which it then advances.
pub fn causal_conv_silu(c: &[f32], conv: &[f32], k: usize, state: &mut [f32]) -> Vec<f32> {
    let ch = conv.len() / k.max(1);
    let t = c.len() / ch.max(1);
    assert!(
        k > 0 && conv.len() == ch * k && c.len() == t * ch && state.len() == (k - 1) * ch,
        "causal_conv_silu: lengths"
    );
    // Rows −(K−1) … T−1.
    let mut ext = Vec::with_capacity(state.len() + c.len());
    ext.extend_from_slice(state);
    ext.extend_from_slice(c);
    let mut out = vec![0f32; t * ch];
    for (ti, row) in out.chunks_exact_mut(ch).enumerate() {
        for (j, o) in row.iter_mut().enumerate() {
            let taps = &conv[j * k..(j + 1) * k];
            let mut acc = 0f32;
            for (i, &w) in taps.iter().enumerate() {
                acc += w * ext[(ti + i) * ch + j];
            }
            *o = silu(acc);
        }
    }
    let keep = state.len();
    state.copy_from_slice(&ext[ext.len() - keep..]);
    out
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

/// Run `T` tokens of the block input `u` (`[T, H]`) through one GDN layer, advancing
/// `state`.
pub fn gdn_forward(
    be: &dyn Backend,
    w: &GdnWeights,
    d: &GdnDims,
    state: &mut GdnState,
    u: &[f32],
    t: usize,
) -> GdnOut {
    let (nk, dk, nv, dv) = (d.key_heads, d.key_dim, d.value_heads, d.value_dim);
    let (kd, vd, ch) = (nk * dk, nv * dv, d.channels());
    let mut qkv = vec![0f32; t * ch];
    be.matmul(&w.qkv, u, t, &mut qkv);
    let mut z = vec![0f32; t * vd];
    be.matmul(&w.z, u, t, &mut z);
    let mut b = vec![0f32; t * nv];
    be.matmul(&w.b, u, t, &mut b);
    let mut a = vec![0f32; t * nv];
    be.matmul(&w.a, u, t, &mut a);
    let conv = causal_conv_silu(&qkv, &w.conv, d.conv_kernel, &mut state.conv);
    let rep = nv / nk;
    let scale = (dk as f32).sqrt();
    let mut core = vec![0f32; t * vd];
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
            let g = -w.a_log[h].exp() * softplus(a[ti * nv + h] + w.dt_bias[h]);
            delta_rule_step(
                &mut state.recurrent[h * dk * dv..(h + 1) * dk * dv],
                &q[kh * dk..(kh + 1) * dk],
                &k[kh * dk..(kh + 1) * dk],
                &v[h * dv..(h + 1) * dv],
                g,
                beta,
                &mut core[ti * vd + h * dv..ti * vd + (h + 1) * dv],
            );
        }
    }
    let mut gated = vec![0f32; t * vd];
    gated_rms_norm(&core, &z, &w.norm, d.eps, d.gate, &mut gated);
    let h = w.out.rows();
    let mut out = vec![0f32; t * h];
    be.matmul(&w.out, &gated, t, &mut out);
    GdnOut {
        qkv,
        core,
        gated,
        out,
    }
}
