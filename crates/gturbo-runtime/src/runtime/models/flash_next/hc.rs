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

use crate::runtime::kernels::ops::{Act, HcDims, Ops};
use crate::runtime::kernels::{Backend, OpResult};

/// One hyper-connection's weights, as backend tensors.
pub struct HyperConnection<'a, B: Backend> {
    /// `hc_norm.weight` `[S·H]` (offsets, one per stream and channel).
    pub norm: B::Buf,
    /// `input_mix_weight_down` `[R, S·H]`.
    pub down: B::Weights<'a>,
    /// `input_mix_weight_up` `[S·H, R]`.
    pub up: B::Weights<'a>,
    /// `block_inject_weight` `[S, S·H]`; `None` for the final mixer.
    pub inject: Option<B::Weights<'a>>,
}

/// What a hyper-connection read gives for `T` tokens.
pub struct HcRead<B: Backend> {
    /// The block input `u` `[T, H]`.
    pub mixed: B::Buf,
    /// Write-back scales `inj` `[T, S]` (empty for the mixer).
    pub inject: B::Buf,
    /// The sigmoid mix weights `m` `[T, S·H]` (kept for traces).
    pub mix: B::Buf,
}

/// Read `T` tokens of the residual `x` (`[T, S·H]`) through `hc`.
pub fn hc_read<B: Ops>(
    b: &B,
    hc: &HyperConnection<'_, B>,
    d: HcDims,
    x: &B::Buf,
    t: usize,
) -> OpResult<HcRead<B>> {
    let (s, h, w) = (d.streams, d.hidden, d.width());
    let mut xn = b.zeros(t * w)?;
    b.norm_grouped(x, &hc.norm, h, d.eps, &mut xn)?;
    let mut a = b.zeros(t * d.lowrank)?;
    b.linear(&hc.down, &xn, &mut a)?;
    b.act(&mut a, Act::SiluOver(s as f32))?;
    let mut mix = b.zeros(t * w)?;
    b.linear(&hc.up, &a, &mut mix)?;
    b.act(&mut mix, Act::Sigmoid)?;
    let mut mixed = b.zeros(t * h)?;
    b.hc_mix(&mix, &xn, d, &mut mixed)?;
    let inject = match &hc.inject {
        Some(inj) => {
            let mut out = b.zeros(t * s)?;
            b.linear(inj, &xn, &mut out)?;
            b.act(&mut out, Act::TwoSigmoidOver(s as f32))?;
            out
        }
        None => b.zeros(0)?,
    };
    Ok(HcRead { mixed, inject, mix })
}
