//! The CPU's [`LinearAttentionOps`] and the slice functions they run: the depthwise
//! causal conv and the gated delta rule (the formulas are in `layers::gdn`).

use super::math::{gated_rms_norm, l2_normalize, sigmoid, silu, softplus};
use crate::runtime::kernels::ops::{GateAct, GdnDims, LinearAttentionOps};
use crate::runtime::kernels::{Cpu, OpResult};

impl LinearAttentionOps for Cpu {
    fn causal_conv_silu(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        taps: usize,
        dilation: usize,
        state: &mut Vec<f32>,
        out: &mut Vec<f32>,
    ) -> OpResult {
        causal_conv_silu(x, w, taps, dilation, state, out);
        Ok(())
    }

    fn gdn_recurrence(
        &self,
        conv: &Vec<f32>,
        b: &Vec<f32>,
        a: &Vec<f32>,
        a_log: &Vec<f32>,
        dt_bias: &Vec<f32>,
        dims: &GdnDims,
        state: &mut Vec<f32>,
        core: &mut Vec<f32>,
    ) -> OpResult {
        gdn_recurrence(conv, b, a, a_log, dt_bias, dims, state, core);
        Ok(())
    }

    fn gated_norm(
        &self,
        o: &Vec<f32>,
        z: &Vec<f32>,
        w: &Vec<f32>,
        eps: f32,
        act: GateAct,
        out: &mut Vec<f32>,
    ) -> OpResult {
        gated_rms_norm(o, z, w, eps, act, out);
        Ok(())
    }
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
