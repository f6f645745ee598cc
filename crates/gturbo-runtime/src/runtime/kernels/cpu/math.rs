//! The norms and activations of the operation families (qwen4_exp first needed them), in f32 as the reference
//! computes them (it upcasts to f32 before every norm).
//!
//! Every function panics on slice lengths other than the documented ones, like the
//! kernels: callers size their buffers from the validated config.

use crate::runtime::kernels::dot;
use crate::runtime::kernels::ops::GateAct;

/// `1 / sqrt(mean(x²) + eps)` of one group.
#[inline]
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let mean_sq = dot(x, x) / x.len().max(1) as f32;
    1.0 / (mean_sq + eps).sqrt()
}

/// The zero-centred ("offset") RMSNorm `Qwen4ExpTextRMSNorm`: each `group`-wide piece
/// of `x` is scaled to unit RMS and multiplied by `1 + w`. `w` covers one row (its
/// length is a multiple of `group`; a `[S·H]` norm with `group = H` normalises each
/// hyper-connection stream on its own, with its own offsets); `x` holds whole rows.
pub fn offset_rms_norm(x: &[f32], w: &[f32], group: usize, eps: f32, out: &mut [f32]) {
    assert!(
        group > 0 && w.len().is_multiple_of(group) && x.len().is_multiple_of(w.len().max(1)),
        "offset_rms_norm: lengths"
    );
    assert_eq!(x.len(), out.len(), "offset_rms_norm: out length");
    for (xr, or) in x.chunks_exact(w.len()).zip(out.chunks_exact_mut(w.len())) {
        for ((xg, og), wg) in xr
            .chunks_exact(group)
            .zip(or.chunks_exact_mut(group))
            .zip(w.chunks_exact(group))
        {
            let inv = inv_rms(xg, eps);
            for ((o, &x), &w) in og.iter_mut().zip(xg).zip(wg) {
                *o = x * inv * (1.0 + w);
            }
        }
    }
}

/// `Qwen4ExpTextRMSNormGated` over `w.len()`-wide heads: `rms(o) · w · act(z)` with a
/// plain weight (no offset), all f32.
pub fn gated_rms_norm(o: &[f32], z: &[f32], w: &[f32], eps: f32, act: GateAct, out: &mut [f32]) {
    let d = w.len();
    assert!(
        d > 0 && o.len().is_multiple_of(d) && z.len() == o.len() && out.len() == o.len(),
        "gated_rms_norm: lengths"
    );
    for ((oh, zh), outh) in o
        .chunks_exact(d)
        .zip(z.chunks_exact(d))
        .zip(out.chunks_exact_mut(d))
    {
        let inv = inv_rms(oh, eps);
        for (((y, &x), &g), &w) in outh.iter_mut().zip(oh).zip(zh).zip(w) {
            let a = match act {
                GateAct::Sigmoid => sigmoid(g),
                GateAct::Silu => silu(g),
            };
            *y = w * (x * inv) * a;
        }
    }
}

/// `x · rsqrt(Σ x² + 1e-6)` in place (the GDN's q/k normalisation; FLA's l2norm).
pub fn l2_normalize(x: &mut [f32]) {
    let inv = 1.0 / (dot(x, x) + 1e-6).sqrt();
    for v in x {
        *v *= inv;
    }
}

/// `1 / (1 + e^-x)`.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `x · sigmoid(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// torch's `softplus` (β = 1, threshold 20): `x` above the threshold, else
/// `log(1 + e^x)`.
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offset_norm_normalises_each_group_and_adds_one_to_the_weight() {
        // Two groups of 2 in one row: [3, 4] has RMS √12.5, [1, -1] has RMS 1.
        let x = [3.0, 4.0, 1.0, -1.0];
        let w = [0.0, 1.0, -0.5, 0.5];
        let mut out = [0.0; 4];
        offset_rms_norm(&x, &w, 2, 0.0, &mut out);
        let r = 12.5f32.sqrt();
        let want = [3.0 / r, 4.0 / r * 2.0, 0.5, -1.5];
        for (a, b) in out.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{out:?} vs {want:?}");
        }
        // Two rows share the weight.
        let x2 = [3.0, 4.0, 1.0, -1.0, 3.0, 4.0, 1.0, -1.0];
        let mut out2 = [0.0; 8];
        offset_rms_norm(&x2, &w, 2, 0.0, &mut out2);
        assert_eq!(out2[..4], out2[4..]);
    }

    #[test]
    fn gated_norm_uses_the_plain_weight_and_the_chosen_gate() {
        let o = [1.0, -1.0];
        let z = [0.0, 2.0];
        let w = [2.0, 3.0];
        let mut out = [0.0; 2];
        gated_rms_norm(&o, &z, &w, 0.0, GateAct::Sigmoid, &mut out);
        assert!((out[0] - 2.0 * 0.5).abs() < 1e-6);
        assert!((out[1] + 3.0 * sigmoid(2.0)).abs() < 1e-6);
        gated_rms_norm(&o, &z, &w, 0.0, GateAct::Silu, &mut out);
        assert_eq!(out[0], 0.0);
        assert!((out[1] + 3.0 * silu(2.0)).abs() < 1e-6);
    }

    #[test]
    fn softplus_and_l2_match_their_definitions() {
        assert!((softplus(0.0) - 2f32.ln()).abs() < 1e-7);
        assert_eq!(softplus(30.0), 30.0);
        assert!((softplus(-30.0) - (-30f32).exp()).abs() < 1e-18);
        let mut v = [3.0, 4.0];
        l2_normalize(&mut v);
        assert!((v[0] - 0.6).abs() < 1e-6 && (v[1] - 0.8).abs() < 1e-6);
    }
}
