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
use crate::runtime::kernels::routing::{RouterBias, RoutingSpec};
use crate::runtime::kernels::{Backend, BackendError, ExpertRef, LayerExperts, Routing};

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
            b.expert_ffn(&expert, x, routes, out)?;
        }
        Ok(Some(routing))
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
