//! The sparse MoE block (`Qwen4ExpTextSparseMoeBlock`): routed experts plus a
//! sigmoid-gated shared expert.
//! ```text
//! p      = softmax_f32(gate.weight · u)              [E]
//! idx    = torch.topk(p, k)  (torch's tie rule)      w = p[idx] / Σ p[idx]  (norm_topk_prob)
//! y      = Σ_{e ∈ idx, ascending e} w_e · down_e(silu(G_e u) ⊙ U_e u)     [G; U] = gate_up_proj[e]
//! y     += sigmoid(shared_expert_gate · u) · shared.down(silu(shared.gate u) ⊙ shared.up u)
//! ```
//! The reference adds the routed outputs in increasing expert id (`index_add_` per
//! expert), then the shared expert; so does this. Expert blobs come from the
//! install's expert store (slot cache or resident map); the installer has split the
//! fused `gate_up_proj` into the blob's gate and up parts, gate first.

use super::norm::sigmoid;
use super::topk::torch_topk;
use crate::runtime::experts::{ExpertStore, expert_matrices};
use crate::runtime::kernels::{Backend, Matrix, axpy, silu_mul, softmax_inplace};
use crate::runtime::load::LoadError;

/// One MoE layer's resident weights (the routed experts live in the expert store).
pub struct MoeWeights<'a> {
    /// Router `gate.weight` `[E, H]`.
    pub router: Matrix<'a>,
    /// `shared_expert_gate.weight` `[1, H]`.
    pub shared_gate: Matrix<'a>,
    /// `shared_expert.gate_proj` `[I_s, H]`.
    pub shared_w_gate: Matrix<'a>,
    /// `shared_expert.up_proj` `[I_s, H]`.
    pub shared_w_up: Matrix<'a>,
    /// `shared_expert.down_proj` `[H, I_s]`.
    pub shared_w_down: Matrix<'a>,
}

/// Routing settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeDims {
    /// Routed experts `E`.
    pub experts: usize,
    /// Experts per token `k`.
    pub top_k: usize,
    /// Renormalise the chosen probabilities to sum 1.
    pub norm_topk_prob: bool,
}

/// One token's routing.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    /// Chosen experts in torch's order (descending probability).
    pub experts: Vec<usize>,
    /// Their weights, in the same order.
    pub weights: Vec<f32>,
}

/// Route one token from its router logits: f32 softmax over all experts, torch's
/// top-k, then (with `norm_topk_prob`) division by the chosen probabilities' sum.
pub fn route(logits: &[f32], top_k: usize, norm_topk_prob: bool) -> Route {
    let mut p = logits.to_vec();
    softmax_inplace(&mut p);
    let experts = torch_topk(&p, top_k);
    let mut weights: Vec<f32> = experts.iter().map(|&e| p[e]).collect();
    if norm_topk_prob {
        let sum: f32 = weights.iter().sum();
        for w in &mut weights {
            *w /= sum;
        }
    }
    Route { experts, weights }
}

/// What one MoE call computes for `T` tokens.
#[derive(Debug, Clone, Default)]
pub struct MoeOut {
    /// Router logits `[T, E]`.
    pub router_logits: Vec<f32>,
    /// Per token routing.
    pub routes: Vec<Route>,
    /// The gated shared expert's output `[T, H]`.
    pub shared: Vec<f32>,
    /// The block output `[T, H]`.
    pub out: Vec<f32>,
}

/// `down(silu(gate · x) ⊙ (up · x))` for `n` rows of `x`.
fn swiglu(
    be: &dyn Backend,
    gate: &Matrix,
    up: &Matrix,
    down: &Matrix,
    x: &[f32],
    n: usize,
) -> Vec<f32> {
    let i = gate.rows();
    let mut g = vec![0f32; n * i];
    let mut u = vec![0f32; n * i];
    be.matmul(gate, x, n, &mut g);
    be.matmul(up, x, n, &mut u);
    silu_mul(&mut g, &u);
    let mut d = vec![0f32; n * down.rows()];
    be.matmul(down, &g, n, &mut d);
    d
}

/// Run `T` tokens of the block input `u` (`[T, H]`) through layer `layer`'s MoE.
/// Each chosen expert is fetched once per call and run over the tokens that chose it.
pub fn moe_forward(
    be: &dyn Backend,
    w: &MoeWeights,
    d: &MoeDims,
    experts: &ExpertStore,
    layer: usize,
    u: &[f32],
    t: usize,
) -> Result<MoeOut, LoadError> {
    let h = w.router.cols();
    let e_count = d.experts;
    let mut router_logits = vec![0f32; t * e_count];
    be.matmul(&w.router, u, t, &mut router_logits);
    let routes: Vec<Route> = router_logits
        .chunks_exact(e_count)
        .map(|l| route(l, d.top_k, d.norm_topk_prob))
        .collect();
    // chosen[e] = (token, weight), tokens ascending.
    let mut chosen: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e_count];
    for (ti, r) in routes.iter().enumerate() {
        for (&e, &wt) in r.experts.iter().zip(&r.weights) {
            chosen[e].push((ti, wt));
        }
    }
    let pool = experts.pool(layer).ok_or_else(|| {
        LoadError::invalid("manifest.json", format!("no expert pool for layer {layer}"))
    })?;
    let mut out = vec![0f32; t * h];
    for (e, toks) in chosen.iter().enumerate() {
        if toks.is_empty() {
            continue;
        }
        let blob = experts.get(layer, e)?;
        let [gate, up, down] = expert_matrices(pool, blob.bytes());
        let m = toks.len();
        let mut xs = vec![0f32; m * h];
        for (r, &(ti, _)) in toks.iter().enumerate() {
            xs[r * h..(r + 1) * h].copy_from_slice(&u[ti * h..(ti + 1) * h]);
        }
        let y = swiglu(be, &gate, &up, &down, &xs, m);
        for (r, &(ti, wt)) in toks.iter().enumerate() {
            axpy(wt, &y[r * h..(r + 1) * h], &mut out[ti * h..(ti + 1) * h]);
        }
    }
    let mut shared = swiglu(be, &w.shared_w_gate, &w.shared_w_up, &w.shared_w_down, u, t);
    let mut sg = vec![0f32; t];
    be.matmul(&w.shared_gate, u, t, &mut sg);
    for (row, &g) in shared.chunks_exact_mut(h).zip(&sg) {
        let s = sigmoid(g);
        for v in row {
            *v *= s;
        }
    }
    for (o, &s) in out.iter_mut().zip(&shared) {
        *o += s;
    }
    Ok(MoeOut {
        router_logits,
        routes,
        shared,
        out,
    })
}
