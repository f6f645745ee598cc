//! Linear attention of the gated-delta-net kind: a depthwise causal conv with its
//! state, the delta-rule recurrence, and the gated output norm.

use super::elementwise::GateAct;
use crate::runtime::kernels::{Backend, OpResult};

/// GDN geometry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GdnDims {
    /// Stream width `H` (the block's input and output).
    pub hidden: usize,
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

    /// Bytes of one layer's state (conv columns and recurrent matrices, f32).
    pub fn state_bytes(&self) -> usize {
        (self.conv_kernel.saturating_sub(1) * self.channels()
            + self.value_heads * self.key_dim * self.value_dim)
            * 4
    }
}

/// Linear-attention operations over a backend's tensors.
pub trait LinearAttentionOps: Backend {
    /// Depthwise causal conv with SiLU over the `C`-channel rows of `x` (`[n, C]`):
    /// `out[t, c] = silu(Σ_{i<K} w[c·K + i] · x[t − (K−1−i)·dilation, c])`, where rows
    /// before the first new one come from `state` (`[(K−1)·dilation, C]`, oldest
    /// first), which then holds the last `(K−1)·dilation` rows of `state ++ x`.
    fn causal_conv_silu(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        taps: usize,
        dilation: usize,
        state: &mut Self::Buf,
        out: &mut Self::Buf,
    ) -> OpResult;
    /// The gated delta rule over the conv output `conv` (`[n, C]`, channels q | k | v)
    /// with `b`, `a` (`[n, nv]`, before sigmoid and softplus), advancing the
    /// recurrent state `state` (`[nv, dk, dv]`); the per-head output into `core`
    /// (`[n, nv·dv]`). The formula is the CPU's (`kernels::cpu::linear_attention`).
    #[allow(clippy::too_many_arguments)]
    fn gdn_recurrence(
        &self,
        conv: &Self::Buf,
        b: &Self::Buf,
        a: &Self::Buf,
        a_log: &Self::Buf,
        dt_bias: &Self::Buf,
        dims: &GdnDims,
        state: &mut Self::Buf,
        core: &mut Self::Buf,
    ) -> OpResult;
    /// The GDN's gated norm over `w.len()`-wide heads: `rms(o) · w · act(z)`.
    fn gated_norm(
        &self,
        o: &Self::Buf,
        z: &Self::Buf,
        w: &Self::Buf,
        eps: f32,
        act: GateAct,
        out: &mut Self::Buf,
    ) -> OpResult;
}
