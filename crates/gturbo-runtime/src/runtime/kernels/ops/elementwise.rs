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
}
