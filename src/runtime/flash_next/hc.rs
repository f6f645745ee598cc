//! Hyper-connections (`Qwen4ExpTextGatedResidual`): the residual stream is `S`
//! streams of width `H` (`[S·H]` per token). Each block reads one `[H]` input mixed
//! from the normalised streams and writes its `[H]` output back into every stream,
//! scaled per stream. The final `hyper_connection_mixer` is the same read without the
//! write-back; its output is what `lm_head` reads (there is no final norm).
//!
//! Per token, with `x` the `[S·H]` residual:
//! ```text
//! xn  = hc_norm(x)                                 (per-stream offset RMSNorm)
//! a   = silu((input_mix_weight_down · xn) / S)     [R]   (divide after the product)
//! m   = sigmoid(input_mix_weight_up · a)           [S·H]
//! u   = (1/S) Σ_j m_j ⊙ xn_j                       [H]   (mean over the normalised streams)
//! inj = 2 · sigmoid((block_inject_weight · xn) / S) [S]
//! x_j ← x_j + inj_j · block(u)                     (into the un-normalised streams)
//! ```

use super::norm::{offset_rms_norm, sigmoid, silu};
use crate::runtime::kernels::{Backend, Matrix};

/// One hyper-connection's weights.
pub struct HyperConnection<'a> {
    /// `hc_norm.weight` `[S·H]` (offsets, one per stream and channel).
    pub norm: Vec<f32>,
    /// `input_mix_weight_down` `[R, S·H]`.
    pub down: Matrix<'a>,
    /// `input_mix_weight_up` `[S·H, R]`.
    pub up: Matrix<'a>,
    /// `block_inject_weight` `[S, S·H]`; `None` for the final mixer.
    pub inject: Option<Matrix<'a>>,
}

/// Stream geometry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HcDims {
    /// Streams `S` (`hc_count`).
    pub streams: usize,
    /// Stream width `H` (`hidden_size`).
    pub hidden: usize,
    /// Norm epsilon.
    pub eps: f32,
}

impl HcDims {
    /// `S·H`, the residual width.
    pub fn width(&self) -> usize {
        self.streams * self.hidden
    }
}

/// What a hyper-connection read gives for `T` tokens.
#[derive(Debug, Clone, Default)]
pub struct HcRead {
    /// The block input `u` `[T, H]`.
    pub mixed: Vec<f32>,
    /// Write-back scales `inj` `[T, S]` (empty for the mixer).
    pub inject: Vec<f32>,
    /// The sigmoid mix weights `m` `[T, S·H]` (kept for traces).
    pub mix: Vec<f32>,
}

/// Read `T` tokens of the residual `x` (`[T, S·H]`) through `hc`.
pub fn hc_read(be: &dyn Backend, hc: &HyperConnection, d: HcDims, x: &[f32], t: usize) -> HcRead {
    let (s, h, w) = (d.streams, d.hidden, d.width());
    assert_eq!(x.len(), t * w, "hc_read: x length");
    let mut xn = vec![0f32; t * w];
    offset_rms_norm(x, &hc.norm, h, d.eps, &mut xn);
    let r = hc.down.rows();
    let mut a = vec![0f32; t * r];
    be.matmul(&hc.down, &xn, t, &mut a);
    for v in &mut a {
        *v = silu(*v / s as f32);
    }
    let mut mix = vec![0f32; t * w];
    be.matmul(&hc.up, &a, t, &mut mix);
    for v in &mut mix {
        *v = sigmoid(*v);
    }
    let mut mixed = vec![0f32; t * h];
    for ((u, m), xn) in mixed
        .chunks_exact_mut(h)
        .zip(mix.chunks_exact(w))
        .zip(xn.chunks_exact(w))
    {
        for (c, uc) in u.iter_mut().enumerate() {
            let mut acc = 0f32;
            for j in 0..s {
                acc += m[j * h + c] * xn[j * h + c];
            }
            *uc = acc / s as f32;
        }
    }
    let inject = match &hc.inject {
        Some(inj) => {
            let mut out = vec![0f32; t * s];
            be.matmul(inj, &xn, t, &mut out);
            for v in &mut out {
                *v = 2.0 * sigmoid(*v / s as f32);
            }
            out
        }
        None => Vec::new(),
    };
    HcRead { mixed, inject, mix }
}

/// Write a block's output `y` (`[T, H]`) back: `x_j += inject_j · y` for every stream.
pub fn hc_write(x: &mut [f32], inject: &[f32], y: &[f32], d: HcDims) {
    let (s, h, w) = (d.streams, d.hidden, d.width());
    let t = y.len() / h.max(1);
    assert!(
        x.len() == t * w && inject.len() == t * s && y.len() == t * h,
        "hc_write: lengths"
    );
    for ((xt, it), yt) in x
        .chunks_exact_mut(w)
        .zip(inject.chunks_exact(s))
        .zip(y.chunks_exact(h))
    {
        for (j, &g) in it.iter().enumerate() {
            for (xv, &yv) in xt[j * h..(j + 1) * h].iter_mut().zip(yt) {
                *xv += yv * g;
            }
        }
    }
}
