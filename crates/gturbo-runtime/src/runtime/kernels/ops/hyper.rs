//! Hyper-connections: a residual of several streams read through a low-rank mix and
//! written back through an inject scale (Flash-Next's `hc_*`).

use crate::runtime::kernels::{Backend, OpResult};

/// Stream geometry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HcDims {
    /// Streams `S` (`hc_count`).
    pub streams: usize,
    /// Stream width `H` (`hidden_size`).
    pub hidden: usize,
    /// The mix's low rank `R` (`hc_lowrank`).
    pub lowrank: usize,
    /// Norm epsilon.
    pub eps: f32,
}

impl HcDims {
    /// `S·H`, the residual width.
    pub fn width(&self) -> usize {
        self.streams * self.hidden
    }
}

/// Hyper-connection operations over a backend's tensors.
pub trait HyperConnectionOps: Backend {
    /// The residual at the embedding: each `[H]` row of `e` repeated `streams` times
    /// into `out` `[n, streams·H]`.
    fn hc_expand(&self, e: &Self::Buf, d: HcDims, out: &mut Self::Buf) -> OpResult;
    /// The block input of a hyper-connection: `out[t] = (1/S) Σ_j mix[t, j] ⊙ xn[t, j]`
    /// for `[n, S·H]` `mix` and `xn`, into `out` `[n, H]` (a sum over `j` in order,
    /// then the division).
    fn hc_mix(&self, mix: &Self::Buf, xn: &Self::Buf, d: HcDims, out: &mut Self::Buf) -> OpResult;
    /// The write-back: `x[t, j] += y[t] · inject[t, j]` for every stream `j` (`x`
    /// `[n, S·H]`, `inject` `[n, S]`, `y` `[n, H]`).
    fn hc_inject(
        &self,
        x: &mut Self::Buf,
        inject: &Self::Buf,
        y: &Self::Buf,
        d: HcDims,
    ) -> OpResult;
}
