//! MoE routing as a spec: every router the supported and next families use, as one
//! CPU reference function over router logits ([`route_logits`]) that backends are
//! checked against.
//!
//! # The pipeline
//! For each token's row of `E` router logits:
//! 1. **score**: `s = softmax(logits)` over all experts, or `s = sigmoid(logits)`, or
//!    (for [`Order::TopKThenSoftmax`]) the logits themselves;
//! 2. **choose**: the key is `s`, plus the selection bias when there is one. With a
//!    [`GroupLimit`] the experts split into `n_group` consecutive groups, a group's
//!    score is the sum of its two largest keys, the `topk_group` best groups are kept
//!    and the keys of the others become `-inf`. The `top_k` largest keys win (ties to
//!    the lower id);
//! 3. **gather**: the chosen experts' *unbiased* `s` (the bias only chooses), or for
//!    [`Order::TopKThenSoftmax`] the softmax over the `k` chosen logits;
//! 4. **renormalize** (optional): `w / (Σ w + 1e-20)`;
//! 5. **scale**: `w · scaling`.
//!
//! The output lists the chosen experts by gathered weight (before steps 4 and 5, which
//! only rescale), largest first, ties to the lower id.
//!
//! # Which family is which (transformers 5.24, `tests/data/routing_golden.json`)
//! - Qwen2/3-MoE, Qwen3-Next: softmax, score then top-k, renormalize =
//!   `norm_topk_prob`, scaling 1.
//! - Mixtral: transformers takes the softmax over all experts, the top-k, then divides
//!   by their sum ([`Order::ScoreThenTopK`] with `renormalize`). That is top-k of the
//!   logits then a softmax over the k up to rounding; the golden test checks both.
//! - gpt-oss: top-k of the logits (the router linear has a bias, which is part of the
//!   logits here), softmax over the k.
//! - DeepSeek-V3 / Kimi-K2 and GLM-4.5: sigmoid, the selection bias
//!   `e_score_correction_bias`, group-limited choice (`n_group`, `topk_group`; GLM has
//!   one group), renormalize = `norm_topk_prob` with `+ 1e-20`, scaling =
//!   `routed_scaling_factor`.
//!
//! The `1e-20` is added for every spec: for softmax scores the chosen sum is at least
//! `1/E` (the top probability is `1/Σ e^(l−max) ≥ 1/E`), far above `1e-20 / ε_f32`, so
//! the addition rounds back to the sum and softmax routing stays bit-identical to the
//! CPU backend's `route`.

use super::softmax_inplace;

/// Added to the chosen weights' sum before dividing by it (DeepSeek-V3's guard against
/// an all-zero sum; a no-op for every sum above about `1e-13`).
pub const RENORM_EPS: f32 = 1e-20;

/// The router's choice for `n` tokens, read back to the host (which reads the chosen
/// experts' blobs).
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// Experts chosen per token.
    pub top_k: usize,
    /// `[n, top_k]` expert ids, most probable first (ties to the lower id).
    pub experts: Vec<u32>,
    /// `[n, top_k]` routing weights, in the same order.
    pub weights: Vec<f32>,
}

/// How router logits become scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scores {
    /// `softmax(logits)` over all experts (or, with [`Order::TopKThenSoftmax`], over
    /// the chosen ones).
    Softmax,
    /// `sigmoid(logits)` per expert.
    Sigmoid,
}

/// Whether scores are computed before the top-k or after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// Score every expert, choose the top-k scores, gather the chosen scores.
    ScoreThenTopK,
    /// Choose the top-k logits, then a softmax over those k (Mixtral, gpt-oss).
    /// Only with [`Scores::Softmax`].
    TopKThenSoftmax,
}

/// DeepSeek-V3's group-limited choice: experts split into `n_group` consecutive
/// groups of `E / n_group`; only the `topk_group` groups with the largest sum of their
/// two best keys take part in the top-k.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupLimit {
    /// Groups (`n_group`); divides the expert count, each group at least 2 experts.
    pub n_group: usize,
    /// Groups kept per token (`topk_group`), `1..=n_group`.
    pub topk_group: usize,
}

/// A router, as the family's config describes it. See the module docs for the pipeline.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoutingSpec {
    /// Experts chosen per token (`num_experts_per_tok`).
    pub top_k: usize,
    /// How logits become scores.
    pub scores: Scores,
    /// Score before or after the top-k.
    pub order: Order,
    /// A per-expert bias added to the keys for choosing only
    /// (`e_score_correction_bias`); the gathered weights stay unbiased.
    pub selection_bias: bool,
    /// Group-limited choice, or `None` for a plain top-k. Only with
    /// [`Order::ScoreThenTopK`].
    pub groups: Option<GroupLimit>,
    /// Divide the chosen weights by their sum (`norm_topk_prob`).
    pub renormalize: bool,
    /// Factor on the final weights (`routed_scaling_factor`; 1 for most families).
    pub scaling: f32,
}

impl RoutingSpec {
    /// Softmax over all experts, the `top_k` largest, optionally renormalized: the
    /// routing [`super::Backend::route`] does today (Qwen2/3-MoE, Qwen3-Next, Mixtral).
    pub fn softmax_top_k(top_k: usize, renormalize: bool) -> Self {
        RoutingSpec {
            top_k,
            scores: Scores::Softmax,
            order: Order::ScoreThenTopK,
            selection_bias: false,
            groups: None,
            renormalize,
            scaling: 1.0,
        }
    }

    /// `Some(renormalize)` when the spec is [`RoutingSpec::softmax_top_k`]'s (what a
    /// backend's fused softmax-top-k kernel computes), else `None`.
    pub fn plain_softmax(&self) -> Option<bool> {
        (*self == RoutingSpec::softmax_top_k(self.top_k, self.renormalize))
            .then_some(self.renormalize)
    }

    /// Whether the spec is one a router can run over `experts` experts. Config values
    /// are untrusted: this is where they are refused, before any routing.
    pub fn check(&self, experts: usize) -> Result<(), RoutingError> {
        if experts == 0 {
            return Err(RoutingError::NoExperts);
        }
        if self.top_k > experts {
            return Err(RoutingError::TopK {
                top_k: self.top_k,
                experts,
            });
        }
        if !self.scaling.is_finite() {
            return Err(RoutingError::Scaling(self.scaling));
        }
        if self.order == Order::TopKThenSoftmax {
            if self.scores != Scores::Softmax {
                return Err(RoutingError::Combination(
                    "top-k then softmax takes softmax scores, not sigmoid",
                ));
            }
            if self.groups.is_some() {
                return Err(RoutingError::Combination(
                    "group-limited choice needs scores before the top-k",
                ));
            }
        }
        if let Some(g) = self.groups {
            let fits = g.n_group > 0
                && experts.is_multiple_of(g.n_group)
                && experts / g.n_group >= 2
                && (1..=g.n_group).contains(&g.topk_group)
                && g.topk_group * (experts / g.n_group) >= self.top_k;
            if !fits {
                return Err(RoutingError::Groups {
                    n_group: g.n_group,
                    topk_group: g.topk_group,
                    experts,
                    top_k: self.top_k,
                });
            }
        }
        Ok(())
    }
}

/// A routing spec or input that cannot be routed. The messages name the config field;
/// the caller adds the file.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RoutingError {
    /// No experts to route to.
    #[error("routing over 0 experts (num_experts / n_routed_experts)")]
    NoExperts,
    /// More experts per token than experts.
    #[error("num_experts_per_tok is {top_k} but there are {experts} experts")]
    TopK {
        /// `num_experts_per_tok`.
        top_k: usize,
        /// Experts.
        experts: usize,
    },
    /// A group layout that does not split the experts or cannot supply the top-k.
    #[error(
        "n_group {n_group} / topk_group {topk_group} cannot route top-{top_k} of {experts} experts (n_group must divide the experts into groups of at least 2, 1 <= topk_group <= n_group, and the kept groups must hold at least top_k experts)"
    )]
    Groups {
        /// `n_group`.
        n_group: usize,
        /// `topk_group`.
        topk_group: usize,
        /// Experts.
        experts: usize,
        /// `num_experts_per_tok`.
        top_k: usize,
    },
    /// A scaling factor that is NaN or infinite.
    #[error("routed_scaling_factor is {0}, not a finite number")]
    Scaling(f32),
    /// Options that do not go together.
    #[error("routing spec: {0}")]
    Combination(&'static str),
    /// Logits that are not whole rows.
    #[error("router logits hold {len} values, not a multiple of {experts} experts")]
    Logits {
        /// Values given.
        len: usize,
        /// Experts.
        experts: usize,
    },
    /// A router logit bias of the wrong length.
    #[error("router bias: {len} values for {experts} experts")]
    LogitBias {
        /// The length given.
        len: usize,
        /// Experts.
        experts: usize,
    },
    /// A selection bias missing, unexpected, or of the wrong length.
    #[error(
        "e_score_correction_bias: the spec {wants} a selection bias; given one of {given:?} values for {experts} experts"
    )]
    Bias {
        /// `"needs"` or `"takes no"`.
        wants: &'static str,
        /// The length given, if any.
        given: Option<usize>,
        /// Experts.
        experts: usize,
    },
}

/// A router's per-expert biases. They are different things and a router may have
/// either: `logits` is the router linear's own bias (gpt-oss: `router(x) = W·x + b`),
/// part of the logits every later step sees; `selection` is DeepSeek-V3's
/// `e_score_correction_bias`, added to the keys for choosing only.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RouterBias<'a> {
    /// Added to each token's router logits (`[experts]`).
    pub logits: Option<&'a [f32]>,
    /// The selection bias (`[experts]`), given exactly when the spec has
    /// [`RoutingSpec::selection_bias`].
    pub selection: Option<&'a [f32]>,
}

impl RouterBias<'_> {
    /// A router without biases (every family before gpt-oss and DeepSeek-V3).
    pub const NONE: RouterBias<'static> = RouterBias {
        logits: None,
        selection: None,
    };

    /// Whether either bias is present.
    pub fn any(&self) -> bool {
        self.logits.is_some() || self.selection.is_some()
    }

    /// `logits[t][e] += bias[e]` for each token row (f32, as the router linear's
    /// `addmm` adds it), when there is a logit bias.
    pub fn add_to_logits(&self, logits: &mut [f32], experts: usize) -> Result<(), RoutingError> {
        let Some(b) = self.logits else {
            return Ok(());
        };
        if b.len() != experts || !logits.len().is_multiple_of(experts) {
            return Err(RoutingError::LogitBias {
                len: b.len(),
                experts,
            });
        }
        for row in logits.chunks_exact_mut(experts) {
            for (l, b) in row.iter_mut().zip(b) {
                *l += b;
            }
        }
        Ok(())
    }
}

/// Routes `n` tokens from their router logits `[n, experts]` as `spec` says (the module
/// docs give the pipeline). `bias` is the per-expert selection bias, given exactly when
/// `spec.selection_bias` is set.
///
/// For [`RoutingSpec::softmax_top_k`] the result is bit-identical to the CPU backend's
/// `route` on the same logits (a unit test holds it to that).
pub fn route_logits(
    spec: &RoutingSpec,
    logits: &[f32],
    bias: Option<&[f32]>,
    experts: usize,
) -> Result<Routing, RoutingError> {
    spec.check(experts)?;
    if !logits.len().is_multiple_of(experts) {
        return Err(RoutingError::Logits {
            len: logits.len(),
            experts,
        });
    }
    let bias = match (spec.selection_bias, bias) {
        (true, Some(b)) if b.len() == experts => Some(b),
        (false, None) => None,
        (wants, given) => {
            return Err(RoutingError::Bias {
                wants: if wants { "needs" } else { "takes no" },
                given: given.map(<[f32]>::len),
                experts,
            });
        }
    };
    let k = spec.top_k;
    let n = logits.len() / experts;
    let mut out_experts = Vec::with_capacity(n * k);
    let mut out_weights = Vec::with_capacity(n * k);
    let mut scores = vec![0f32; experts];
    let mut keys = vec![0f32; experts];
    let mut idx: Vec<usize> = Vec::with_capacity(experts);
    let mut chosen: Vec<(usize, f32)> = Vec::with_capacity(k);
    for row in logits.chunks_exact(experts) {
        // 1. Scores.
        scores.copy_from_slice(row);
        match (spec.order, spec.scores) {
            (Order::ScoreThenTopK, Scores::Softmax) => softmax_inplace(&mut scores),
            (Order::ScoreThenTopK, Scores::Sigmoid) => {
                for s in scores.iter_mut() {
                    *s = 1.0 / (1.0 + (-*s).exp());
                }
            }
            // The logits are the keys; the softmax comes after the choice.
            (Order::TopKThenSoftmax, _) => {}
        }
        // 2. Keys and the choice.
        keys.copy_from_slice(&scores);
        if let Some(b) = bias {
            for (key, b) in keys.iter_mut().zip(b) {
                *key += b;
            }
        }
        if let Some(g) = spec.groups {
            mask_groups(&mut keys, g);
        }
        idx.clear();
        idx.extend(0..experts);
        // Largest key first; ties to the lower expert id.
        idx.sort_by(|&a, &b| keys[b].total_cmp(&keys[a]).then(a.cmp(&b)));
        // 3. Gathered (unbiased) weights.
        chosen.clear();
        chosen.extend(idx[..k].iter().map(|&e| (e, scores[e])));
        if spec.order == Order::TopKThenSoftmax {
            let mut w: Vec<f32> = chosen.iter().map(|c| c.1).collect();
            softmax_inplace(&mut w);
            for (c, w) in chosen.iter_mut().zip(w) {
                c.1 = w;
            }
        }
        // Most-weighted first. Without a bias this is already the order of the choice
        // (the gathered weights are the keys, or a monotone softmax of them), so the
        // stable sort leaves it alone.
        if bias.is_some() || spec.order == Order::TopKThenSoftmax {
            chosen.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        }
        // 4. and 5. Renormalize and scale.
        let sum: f32 = chosen.iter().map(|c| c.1).sum();
        for &(e, w) in &chosen {
            let w = if spec.renormalize {
                w / (sum + RENORM_EPS)
            } else {
                w
            };
            out_experts.push(e as u32);
            out_weights.push(w * spec.scaling);
        }
    }
    Ok(Routing {
        top_k: k,
        experts: out_experts,
        weights: out_weights,
    })
}

/// Sets the keys of all but the `topk_group` best groups to `-inf` (transformers'
/// `masked_fill(~score_mask, -inf)`). A group's score is the sum of its two largest
/// keys; tied groups go to the lower group id.
fn mask_groups(keys: &mut [f32], g: GroupLimit) {
    let size = keys.len() / g.n_group;
    let group_scores: Vec<f32> = keys
        .chunks_exact(size)
        .map(|grp| {
            let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
            for &v in grp {
                if v.total_cmp(&a).is_gt() {
                    b = a;
                    a = v;
                } else if v.total_cmp(&b).is_gt() {
                    b = v;
                }
            }
            a + b
        })
        .collect();
    let mut order: Vec<usize> = (0..g.n_group).collect();
    order.sort_by(|&a, &b| group_scores[b].total_cmp(&group_scores[a]).then(a.cmp(&b)));
    for &dropped in &order[g.topk_group..] {
        keys[dropped * size..(dropped + 1) * size].fill(f32::NEG_INFINITY);
    }
}

#[cfg(test)]
mod tests;
