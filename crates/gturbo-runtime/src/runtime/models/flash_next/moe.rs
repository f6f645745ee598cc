//! The sparse MoE block (`Qwen4ExpTextSparseMoeBlock`): routed experts plus a
//! sigmoid-gated shared expert.
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
use crate::runtime::kernels::{Backend, BackendError, ExpertRef, Routing};

/// One MoE layer's resident weights (the routed experts live in the expert store).
pub struct MoeWeights<'a, B: Backend> {
    /// Router `gate.weight` `[E, H]`.
    pub router: B::Weights<'a>,
    /// `shared_expert_gate.weight` `[1, H]`.
    pub shared_gate: B::Weights<'a>,
    /// `shared_expert.gate_proj` `[I_s, H]`.
    pub shared_w_gate: B::Weights<'a>,
    /// `shared_expert.up_proj` `[I_s, H]`.
    pub shared_w_up: B::Weights<'a>,
    /// `shared_expert.down_proj` `[H, I_s]`.
    pub shared_w_down: B::Weights<'a>,
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

/// Run `T` tokens of the block input `u` (`[T, H]`) through layer `layer`'s MoE.
/// Routing is the seam's [`Backend::route`] (softmax over all experts, top-k, and
/// renormalised with `norm_topk_prob`); its ties go to the lower expert id where
/// `torch.topk` would follow its selection order, which only matters for two exactly
/// equal f32 probabilities (continuous router logits: none in the goldens). Each
/// chosen expert is fetched once per call and run over the tokens that chose it, in
/// ascending expert id as the reference's `index_add_`; then the shared expert.
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
    let routing: Routing = b.route(&w.router, u, d.top_k, d.norm_topk_prob)?;
    let k = routing.top_k.max(1);
    // chosen[e] = (token, weight), tokens ascending.
    let mut chosen: Vec<Vec<(usize, f32)>> = vec![Vec::new(); d.experts];
    let mut routes = Vec::with_capacity(t);
    for (ti, (es, ws)) in routing
        .experts
        .chunks_exact(k)
        .zip(routing.weights.chunks_exact(k))
        .enumerate()
    {
        for (&e, &wt) in es.iter().zip(ws) {
            let Some(c) = chosen.get_mut(e as usize) else {
                let msg = format!("chose expert {e} of {}", d.experts);
                return Err(BackendError::new(b.name(), "route", msg).into());
            };
            c.push((ti, wt));
        }
        routes.push(Route {
            experts: es.iter().map(|&e| e as usize).collect(),
            weights: ws.to_vec(),
        });
    }
    let pool = experts.pool(layer).ok_or_else(|| {
        RunError::invalid(
            crate::format::manifest::FILE_NAME,
            format!("no expert pool for layer {layer}"),
        )
    })?;
    let mut out = b.zeros(t * h)?;
    for (e, toks) in chosen.iter().enumerate() {
        if toks.is_empty() {
            continue;
        }
        let blob = experts.get(layer, e)?;
        let expert = b.expert(
            slots,
            ExpertRef {
                pool,
                layer,
                expert: e,
                slot: blob.slot(),
                bytes: blob.bytes(),
            },
        )?;
        b.expert_ffn(&expert, u, toks, &mut out)?;
    }
    let mut shared = b.zeros(t * h)?;
    b.ffn_swiglu(
        &w.shared_w_gate,
        &w.shared_w_up,
        &w.shared_w_down,
        u,
        &mut shared,
    )?;
    let mut sg = b.zeros(t)?;
    b.linear(&w.shared_gate, u, &mut sg)?;
    b.scale_rows_sigmoid(&mut shared, &sg)?;
    b.add(&mut out, &shared)?;
    Ok(MoeOut {
        router_logits,
        routes,
        shared,
        out,
    })
}
