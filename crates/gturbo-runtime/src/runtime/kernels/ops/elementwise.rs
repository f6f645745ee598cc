//! Elementwise and row-wise operations beyond the core seam: grouped offset RMSNorm,
//! activations, sigmoid gating, column gathers. Used by the hyper-connection and
//! linear-attention models (Flash-Next today).

use std::ops::Range;

use crate::runtime::kernels::{Backend, OpResult};

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Act {
    /// `silu(x / d)` (the hyper-connection's low-rank mix: divide, then activate).
    SiluOver(f32),
    /// `sigmoid(x)`.
    Sigmoid,
    /// `2 · sigmoid(x / d)` (the hyper-connection's inject scale).
    TwoSigmoidOver(f32),
}

/// The activation of a gated norm's gate (`output_gate_type`, else `hidden_act`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateAct {
    /// `sigmoid(z)`.
    Sigmoid,
    /// `silu(z)`.
    Silu,
}

/// Elementwise and row-wise operations over a backend's tensors.
pub trait ElementwiseOps: Backend {
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
    /// The inverse of [`ElementwiseOps::gather_cols`], scaled: each row of `x`
    /// (`[rows, cols.len()]`) times `scale` into columns `cols` of the `width`-wide
    /// rows of `out` (`[rows, width]`); the other columns are left alone. With
    /// `scale = 1` an exact copy. MLA assembles its per-head `[nope | rope]` keys and
    /// queries with it (the rope part scaled by YaRN's attention factor).
    fn scatter_cols(
        &self,
        x: &Self::Buf,
        scale: f32,
        width: usize,
        cols: Range<usize>,
        out: &mut Self::Buf,
    ) -> OpResult;
    /// gpt-oss's clamped, offset SwiGLU in place, elementwise over `gate` and `up`
    /// (same lengths): with `g = min(gate, limit)` and `u = clamp(up, −limit, limit)`,
    /// `gate = (u + 1) · g · sigmoid(alpha · g)` (transformers' `GptOssExperts._apply_gate`).
    fn clamped_swiglu(&self, gate: &mut Self::Buf, up: &Self::Buf, glu: ClampedGlu) -> OpResult;
    /// Rows `rows` (each below `x`'s row count) of the `width`-wide rows of `x`, in
    /// that order, into `out` (`[rows.len(), width]`): the tokens one expert runs over.
    fn gather_rows(
        &self,
        x: &Self::Buf,
        width: usize,
        rows: &[usize],
        out: &mut Self::Buf,
    ) -> OpResult;
    /// The weighted inverse of [`ElementwiseOps::gather_rows`]: for each `(t, w)` of
    /// `routes` (distinct `t`), row `t` of `out` `+= w ·` row `r` of `x` (`r` the
    /// route's index), rows `width` wide.
    fn scatter_add_rows(
        &self,
        x: &Self::Buf,
        width: usize,
        routes: &[(usize, f32)],
        out: &mut Self::Buf,
    ) -> OpResult;
}

/// The constants of [`ElementwiseOps::clamped_swiglu`]: gpt-oss's `swiglu_alpha`
/// (1.702) and `swiglu_limit` (7.0).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClampedGlu {
    /// The sigmoid's slope `alpha`.
    pub alpha: f32,
    /// The clamp `limit` (positive).
    pub limit: f32,
}

impl ClampedGlu {
    /// The formula on one pair: the reference the backends are held to.
    pub fn apply(self, gate: f32, up: f32) -> f32 {
        let g = gate.min(self.limit);
        let u = up.clamp(-self.limit, self.limit);
        let s = 1.0 / (1.0 + (-self.alpha * g).exp());
        (u + 1.0) * (g * s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::kernels::Cpu;

    #[test]
    fn clamped_swiglu_clamps_gate_above_and_up_both_sides_then_offsets_up() {
        let glu = ClampedGlu {
            alpha: 1.702,
            limit: 7.0,
        };
        let sig = |x: f32| 1.0 / (1.0 + (-x).exp());
        // gate past the limit is 7; up past −7 is −7: (−7 + 1) · 7 · σ(1.702 · 7).
        assert_eq!(glu.apply(10.0, -9.0), -6.0 * (7.0 * sig(1.702 * 7.0)));
        // a very negative gate is not clamped below: its sigmoid vanishes.
        assert_eq!(glu.apply(-100.0, 2.0), 3.0 * (-100.0 * sig(-170.2)));
        // inside the limits: (u + 1) · g · σ(α g).
        assert_eq!(glu.apply(0.5, 0.25), 1.25 * (0.5 * sig(0.851)));
        let mut g = vec![10.0, -100.0, 0.5];
        Cpu::new(1)
            .clamped_swiglu(&mut g, &vec![-9.0, 2.0, 0.25], glu)
            .unwrap();
        assert_eq!(
            g,
            [
                glu.apply(10.0, -9.0),
                glu.apply(-100.0, 2.0),
                glu.apply(0.5, 0.25)
            ]
        );
    }
}
