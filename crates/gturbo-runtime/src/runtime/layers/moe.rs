//! Routed experts: the one dispatch every MoE model uses. A layer's tokens are routed
//! by the router, then each chosen expert runs once over the tokens that chose it, in
//! ascending expert id (each token's sum is added in a fixed order, as the references'
//! `index_add_` per expert does). Where the layer's pool is mapped (resident experts)
//! the backend is first asked to do the whole layer itself
//! ([`Backend::moe_resident`]: a GPU holding the pool routes and runs the experts
//! without reading the choice back); otherwise, or when the caller wants the routes
//! (traces), the host routes and reads the chosen experts' blobs from the expert store
//! (slot cache or mapped pool).

use crate::format::manifest;
use crate::format::pools::ExpertPool;
use crate::runtime::RunError;
use crate::runtime::experts::{ExpertMode, ExpertStore};
use crate::runtime::kernels::ops::ElementwiseOps;
use crate::runtime::kernels::routing::{GroupLimit, RouterBias, RoutingSpec, Scores};
use crate::runtime::kernels::{Backend, BackendError, ExpertRef, LayerExperts, Routing};
use crate::runtime::layers::axes::Axes;
use crate::runtime::layers::mlp::{SharedExpert, SwiGlu};

/// Routed-expert settings.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Experts per layer.
    pub experts: usize,
    /// Experts chosen per token.
    pub top_k: usize,
    /// Expert MLP width.
    pub intermediate: usize,
    /// Renormalise the top-k probabilities to sum 1.
    pub norm_topk_prob: bool,
}

/// A family's defaults for the fields of a DeepSeek-style MoE config that a config may
/// omit (transformers' config classes differ: DeepSeek-V3 groups 8 × 4 and scales by
/// 2.5, GLM-4.5 has one group and scales by 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SigmoidDefaults {
    /// `norm_topk_prob`.
    pub norm_topk_prob: bool,
    /// `n_group`.
    pub n_group: usize,
    /// `topk_group`.
    pub topk_group: usize,
    /// `routed_scaling_factor`.
    pub routed_scaling_factor: f64,
    /// `n_shared_experts`.
    pub n_shared_experts: usize,
    /// `first_k_dense_replace`.
    pub first_k_dense_replace: usize,
}

/// A model's routed experts as its config describes them: the experts, the router's
/// rule, which first layers stay dense and the shared expert's width. Qwen3-MoE and
/// Mixtral route by softmax with neither; DeepSeek-V3, Kimi-K2 and GLM-4.5 by sigmoid
/// scores chosen with `e_score_correction_bias` (`kernels::routing`), beside dense
/// first layers and an ungated shared expert.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeStack {
    /// The routed experts (`n_routed_experts`, `moe_intermediate_size`, …).
    pub moe: MoeConfig,
    /// The router's rule.
    pub routing: RoutingSpec,
    /// Layers `0..dense_layers` are dense (`first_k_dense_replace`).
    pub dense_layers: usize,
    /// The shared expert's width (`moe_intermediate_size · n_shared_experts`), 0 for none.
    pub shared_intermediate: usize,
}

impl MoeStack {
    /// Softmax top-k routing over every layer's experts (Qwen3-MoE, Mixtral).
    pub fn softmax(moe: MoeConfig) -> Self {
        MoeStack {
            routing: RoutingSpec::softmax_top_k(moe.top_k, moe.norm_topk_prob),
            moe,
            dense_layers: 0,
            shared_intermediate: 0,
        }
    }

    /// Read and check the DeepSeek-style MoE axes of a model of `layers` layers, a
    /// field the config omits taking `d`'s value.
    pub(crate) fn sigmoid(
        a: &Axes<'_>,
        layers: usize,
        d: &SigmoidDefaults,
    ) -> Result<Self, RunError> {
        let moe = MoeConfig {
            experts: a.usize("num_experts")?,
            top_k: a.usize("num_experts_per_tok")?,
            intermediate: a.usize("moe_intermediate_size")?,
            norm_topk_prob: a.opt_bool("norm_topk_prob")?.unwrap_or(d.norm_topk_prob),
        };
        let n_group = a.opt_usize("n_group")?.unwrap_or(d.n_group);
        let topk_group = a.opt_usize("topk_group")?.unwrap_or(d.topk_group);
        let scaling = a
            .opt_f64("routed_scaling_factor")?
            .unwrap_or(d.routed_scaling_factor) as f32;
        let routing = RoutingSpec {
            scores: Scores::Sigmoid,
            selection_bias: true,
            groups: (n_group > 1).then_some(GroupLimit {
                n_group,
                topk_group,
            }),
            renormalize: moe.norm_topk_prob,
            scaling,
            ..RoutingSpec::softmax_top_k(moe.top_k, moe.norm_topk_prob)
        };
        routing
            .check(moe.experts)
            .map_err(|e| a.err("n_group", &e.to_string()))?;
        let dense_layers =
            count_or_zero(a, "first_k_dense_replace")?.unwrap_or(d.first_k_dense_replace);
        if dense_layers > layers {
            return Err(a.err("first_k_dense_replace", "more than num_layers"));
        }
        let shared = count_or_zero(a, "n_shared_experts")?.unwrap_or(d.n_shared_experts);
        Ok(MoeStack {
            shared_intermediate: moe
                .intermediate
                .checked_mul(shared)
                .ok_or_else(|| a.err("n_shared_experts", "the shared expert's width overflows"))?,
            moe,
            routing,
            dense_layers,
        })
    }
}

/// A count that may be 0 (`first_k_dense_replace`, `n_shared_experts`), when present.
fn count_or_zero(a: &Axes<'_>, axis: &str) -> Result<Option<usize>, RunError> {
    match a.value(axis) {
        Some(v) if v.as_u64() == Some(0) => Ok(Some(0)),
        _ => a.opt_usize(axis),
    }
}

/// A layer's feed-forward part: a dense SwiGLU, or routed experts with, where the
/// family has them, the router's selection bias and a shared expert.
pub enum Ffn<'a, B: Backend> {
    /// A dense SwiGLU MLP.
    Dense(SwiGlu<'a, B>),
    /// Routed experts.
    Moe(MoeBlock<'a, B>),
}

/// A MoE layer's resident parts (its experts are in the expert store).
pub struct MoeBlock<'a, B: Backend> {
    /// The router `[experts, H]`.
    pub router: B::Weights<'a>,
    /// `e_score_correction_bias` (f32), for a spec with a selection bias.
    pub bias: Option<Vec<f32>>,
    /// The shared expert, which every token runs.
    pub shared: Option<SharedExpert<'a, B>>,
}

impl<B: Backend + ElementwiseOps> Ffn<'_, B> {
    /// The layer's output for the `n` rows of `xn` into `out`: the dense MLP, or the
    /// routed experts of `experts` (routed as `stack` says) plus the shared expert.
    pub fn forward(
        &self,
        experts: &RoutedExperts<'_, B>,
        stack: Option<&MoeStack>,
        xn: &B::Buf,
        n: usize,
        hidden: usize,
        out: &mut B::Buf,
    ) -> Result<(), RunError> {
        let b = experts.b;
        match self {
            Ffn::Dense(mlp) => mlp.forward(b, xn, out)?,
            Ffn::Moe(m) => {
                let stack =
                    stack.ok_or_else(|| RunError::invalid(manifest::FILE_NAME, "no MoE config"))?;
                let spec = RouterSpec {
                    experts: stack.moe.experts,
                    routing: stack.routing,
                    bias: RouterBias {
                        logits: None,
                        selection: m.bias.as_deref(),
                    },
                };
                experts.forward(&m.router, spec, xn, out, false)?;
                if let Some(shared) = &m.shared {
                    let y = shared.forward(b, xn, n, hidden)?;
                    b.add(out, &y)?;
                }
            }
        }
        Ok(())
    }
}

/// How a layer's router picks its experts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouterSpec<'r> {
    /// Routed experts per layer.
    pub experts: usize,
    /// The routing rule (`kernels::routing`).
    pub routing: RoutingSpec,
    /// The router's logit and selection biases (`kernels::routing::RouterBias`).
    pub bias: RouterBias<'r>,
}

/// The backend's storage for the expert pools `pools` of `store` (a device mirror of
/// the slot cache, or nothing), with every mapped (resident) pool of `layers` layers
/// handed to the backend at load ([`Backend::load_experts`]: a GPU uploads it then,
/// not inside the first prompt).
pub fn expert_slots<B: Backend>(
    b: &B,
    store: &ExpertStore,
    pools: &[&ExpertPool],
    layers: usize,
) -> Result<B::Slots, RunError> {
    let slots = match store.mode() {
        ExpertMode::Slots(n) => Some(n),
        ExpertMode::Resident => None,
    };
    let expert_slots = b.expert_slots(slots, pools)?;
    for l in 0..layers {
        if let (Some(bytes), Some(pool)) = (store.mapped(l), store.pool(l)) {
            let layer = LayerExperts {
                pool,
                layer: l,
                bytes,
            };
            b.load_experts(&expert_slots, layer)?;
        }
    }
    Ok(expert_slots)
}

/// One MoE layer's routed experts over the backend's expert storage.
pub struct RoutedExperts<'s, B: Backend> {
    /// The backend.
    pub b: &'s B,
    /// The install's expert store.
    pub store: &'s ExpertStore,
    /// The backend's expert slots.
    pub slots: &'s B::Slots,
    /// The layer.
    pub layer: usize,
}

impl<B: Backend> RoutedExperts<'_, B> {
    /// `out = Σ_j w_j · expert_j(x)` over each row of `x`'s chosen experts, routed by
    /// `router` as `spec` says. Returns the routing when the host routed (always when
    /// `want_routes`), `None` when the backend did the whole layer on its own.
    pub fn forward(
        &self,
        router: &B::Weights<'_>,
        spec: RouterSpec<'_>,
        x: &B::Buf,
        out: &mut B::Buf,
        want_routes: bool,
    ) -> Result<Option<Routing>, RunError> {
        let (b, l) = (self.b, self.layer);
        if !want_routes
            && !spec.bias.any()
            && let (Some(bytes), Some(pool)) = (self.store.mapped(l), self.store.pool(l))
        {
            let layer = LayerExperts {
                pool,
                layer: l,
                bytes,
            };
            if b.moe_resident(self.slots, layer, router, x, &spec.routing, out)? {
                return Ok(None);
            }
        }
        self.routed(router, spec, x, out, |expert, _, routes, out| {
            Ok(b.expert_ffn(expert, x, routes, out)?)
        })
        .map(Some)
    }

    /// Route `x` on the host, then `ffn(expert, e, routes, out)` for each chosen expert
    /// `e` in ascending id over the `(row, weight)` pairs that chose it, after `out` is
    /// zeroed: the dispatch of [`RoutedExperts::forward`] for experts the runner
    /// composes from the ops itself (gpt-oss: biases and a clamped activation).
    pub fn routed<F>(
        &self,
        router: &B::Weights<'_>,
        spec: RouterSpec<'_>,
        x: &B::Buf,
        out: &mut B::Buf,
        mut ffn: F,
    ) -> Result<Routing, RunError>
    where
        F: FnMut(&B::Expert<'_>, usize, &[(usize, f32)], &mut B::Buf) -> Result<(), RunError>,
    {
        let (b, l) = (self.b, self.layer);
        let routing = b.route(router, x, &spec.routing, spec.bias)?;
        let chosen = by_expert(b, &routing, spec.experts)?;
        b.zero(out)?;
        let pool = self.store.pool(l).ok_or_else(|| {
            RunError::invalid(manifest::FILE_NAME, format!("no expert pool for layer {l}"))
        })?;
        for (e, routes) in chosen.iter().enumerate() {
            if routes.is_empty() {
                continue;
            }
            let blob = self.store.get(l, e)?;
            let expert = b.expert(
                self.slots,
                ExpertRef {
                    pool,
                    layer: l,
                    expert: e,
                    slot: blob.slot(),
                    bytes: blob.bytes(),
                },
            )?;
            ffn(&expert, e, routes, out)?;
        }
        Ok(routing)
    }
}

/// `chosen[e]`: the `(token, weight)` pairs that chose expert `e`, tokens ascending;
/// an expert id past `experts` is the backend's error.
fn by_expert<B: Backend>(
    b: &B,
    routing: &Routing,
    experts: usize,
) -> Result<Vec<Vec<(usize, f32)>>, RunError> {
    let mut chosen: Vec<Vec<(usize, f32)>> = vec![Vec::new(); experts];
    let k = routing.top_k.max(1);
    for (i, (&e, &w)) in routing.experts.iter().zip(&routing.weights).enumerate() {
        let Some(c) = chosen.get_mut(e as usize) else {
            let msg = format!("chose expert {e} of {experts}");
            return Err(BackendError::new(b.name(), "route", msg).into());
        };
        c.push((i / k, w));
    }
    Ok(chosen)
}
