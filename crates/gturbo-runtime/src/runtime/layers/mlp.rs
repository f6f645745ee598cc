//! Dense MLPs: SwiGLU `down(silu(gate·x) ⊙ up·x)`, and the shared expert of an MoE
//! layer (a SwiGLU beside the routed experts, optionally scaled per token by
//! `sigmoid(gate·x)`: Qwen3-Next and Flash-Next gate it, DeepSeek-V3 does not).

use crate::runtime::RunError;
use crate::runtime::kernels::ops::ElementwiseOps;
use crate::runtime::kernels::{Backend, OpResult};
use crate::runtime::load::Install;

/// One SwiGLU MLP's weights.
pub struct SwiGlu<'a, B: Backend> {
    /// `gate_proj` `[I, H]`.
    pub gate: B::Weights<'a>,
    /// `up_proj` `[I, H]`.
    pub up: B::Weights<'a>,
    /// `down_proj` `[H, I]`.
    pub down: B::Weights<'a>,
}

impl<'a, B: Backend> SwiGlu<'a, B> {
    /// The install's `{prefix}.{gate,up,down}_proj.weight`, `i` wide over a model
    /// `h` wide, bound on `b`.
    pub fn bind(
        install: &'a Install,
        b: &B,
        prefix: &str,
        i: usize,
        h: usize,
    ) -> Result<Self, RunError> {
        let m = |part: &str, rows, cols| -> Result<B::Weights<'a>, RunError> {
            let name = format!("{prefix}.{part}_proj.weight");
            Ok(b.weights(install.matrix(&name, rows, cols)?)?)
        };
        Ok(SwiGlu {
            gate: m("gate", i, h)?,
            up: m("up", i, h)?,
            down: m("down", h, i)?,
        })
    }

    /// `out = down(silu(gate·x) ⊙ up·x)` for each row of `x`.
    pub fn forward(&self, b: &B, x: &B::Buf, out: &mut B::Buf) -> OpResult {
        b.ffn_swiglu(&self.gate, &self.up, &self.down, x, out)
    }
}

/// A shared expert: a SwiGLU every token runs, optionally gated.
pub struct SharedExpert<'a, B: Backend> {
    /// The expert.
    pub mlp: SwiGlu<'a, B>,
    /// `shared_expert_gate` `[1, H]`: when present, token `t`'s output is scaled by
    /// `sigmoid(gate · x[t])`.
    pub gate: Option<B::Weights<'a>>,
}

impl<B: Backend + ElementwiseOps> SharedExpert<'_, B> {
    /// The shared expert's output for the `t` rows of `x`, into a new tensor.
    pub fn forward(&self, b: &B, x: &B::Buf, t: usize, hidden: usize) -> OpResult<B::Buf> {
        let mut out = b.zeros(t * hidden)?;
        self.mlp.forward(b, x, &mut out)?;
        if let Some(g) = &self.gate {
            let mut sg = b.zeros(t)?;
            b.linear(g, x, &mut sg)?;
            b.scale_rows_sigmoid(&mut out, &sg)?;
        }
        Ok(out)
    }
}
