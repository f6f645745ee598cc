//! The sparse MoE block (`Qwen4ExpTextSparseMoeBlock`, `Qwen3NextSparseMoeBlock`): routed
//! experts plus a sigmoid-gated shared expert.
//! ```text
//! p      = softmax_f32(gate.weight · u)              [E]
//! idx    = top-k of p (the seam's route)             w = p[idx] / Σ p[idx]  (norm_topk_prob)
//! y      = Σ_{e ∈ idx, ascending e} w_e · down_e(silu(G_e u) ⊙ U_e u)     [G; U] = gate_up_proj[e]
//! y     += sigmoid(shared_expert_gate · u) · shared.down(silu(shared.gate u) ⊙ shared.up u)
//! ```
//! The reference adds the routed outputs in increasing expert id (`index_add_` per
//! expert), then the shared expert; so does this. Expert blobs come from the
//! install's expert store (slot cache or resident map); the installer has split the
//! fused `gate_up_proj` into the blob's gate and up parts, gate first.

use crate::runtime::RunError;
use crate::runtime::experts::ExpertStore;
use crate::runtime::kernels::ops::Ops;
use crate::runtime::kernels::routing::{RouterBias, RoutingSpec};
use crate::runtime::kernels::{Backend, Routing};
use crate::runtime::layers::mlp::SharedExpert;
use crate::runtime::layers::moe::{RoutedExperts, RouterSpec};

/// One MoE layer's resident weights (the routed experts live in the expert store).
pub struct MoeWeights<'a, B: Backend> {
    /// Router `gate.weight` `[E, H]`.
    pub router: B::Weights<'a>,
    /// `shared_expert.{gate,up,down}_proj` (`[I_s, H]`, `[I_s, H]`, `[H, I_s]`) gated
    /// by `shared_expert_gate.weight` `[1, H]`.
    pub shared: SharedExpert<'a, B>,
}

/// Routing settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeDims {
    /// Stream width `H`.
    pub hidden: usize,
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
    /// Chosen experts, most probable first.
    pub experts: Vec<usize>,
    /// Their weights, in the same order.
    pub weights: Vec<f32>,
}

/// Each token's experts and weights, from the backend's routing.
fn routes_of(r: &Routing) -> Vec<Route> {
    let k = r.top_k.max(1);
    r.experts
        .chunks_exact(k)
        .zip(r.weights.chunks_exact(k))
        .map(|(es, ws)| Route {
            experts: es.iter().map(|&e| e as usize).collect(),
            weights: ws.to_vec(),
        })
        .collect()
}

/// What one MoE call computes for `T` tokens.
pub struct MoeOut<B: Backend> {
    /// Router logits `[T, E]`, when asked for (traces).
    pub router_logits: Option<B::Buf>,
    /// Per token routing.
    pub routes: Vec<Route>,
    /// The gated shared expert's output `[T, H]`.
    pub shared: B::Buf,
    /// The block output `[T, H]`.
    pub out: B::Buf,
}

/// Run `T` tokens of the block input `u` (`[T, H]`) through layer `layer`'s MoE: the
/// routed experts through `layers::moe` (softmax over all experts, top-k,
/// renormalised with `norm_topk_prob`; ties to the lower expert id where `torch.topk`
/// would follow its selection order, which only matters for two exactly equal f32
/// probabilities: none in the goldens), then the shared expert. `want_logits` (traces)
/// also keeps the router logits and the routes, so the host routes.
#[allow(clippy::too_many_arguments)]
pub fn moe_forward<B: Ops>(
    b: &B,
    w: &MoeWeights<'_, B>,
    d: &MoeDims,
    experts: &ExpertStore,
    slots: &B::Slots,
    layer: usize,
    u: &B::Buf,
    t: usize,
    want_logits: bool,
) -> Result<MoeOut<B>, RunError> {
    let h = d.hidden;
    let router_logits = if want_logits {
        let mut l = b.zeros(t * d.experts)?;
        b.linear(&w.router, u, &mut l)?;
        Some(l)
    } else {
        None
    };
    let spec = RouterSpec {
        experts: d.experts,
        routing: RoutingSpec::softmax_top_k(d.top_k, d.norm_topk_prob),
        bias: RouterBias::NONE,
    };
    let routed = RoutedExperts {
        b,
        store: experts,
        slots,
        layer,
    };
    let mut out = b.zeros(t * h)?;
    let routes = match routed.forward(&w.router, spec, u, &mut out, want_logits)? {
        Some(r) => routes_of(&r),
        None => Vec::new(),
    };
    let shared = w.shared.forward(b, u, t, h)?;
    b.add(&mut out, &shared)?;
    Ok(MoeOut {
        router_logits,
        routes,
        shared,
        out,
    })
}
