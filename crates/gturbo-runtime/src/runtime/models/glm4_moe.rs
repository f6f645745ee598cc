//! GLM-4.5 / GLM-4.5-Air / GLM-4.6 (`Glm4MoeForCausalLM`): the decoder with q/k/v
//! biases (`attention_bias`), per-head QK norm when `use_qk_norm` (GLM-4.5 and 4.6,
//! not Air), rotary embeddings on the first half of each head (`partial_rotary_factor`
//! 0.5, rotate-half), the first `first_k_dense_replace` layers dense and the others
//! routed experts beside an ungated shared expert. The router is transformers'
//! `Glm4MoeTopkRouter`, DeepSeek-V3's (`kernels::routing`): f32 logits, sigmoid
//! scores, the choice on the scores plus `e_score_correction_bias`, the weights the
//! unbiased scores renormalised (`norm_topk_prob`) and times `routed_scaling_factor`;
//! GLM's configs keep one group (`n_group` = `topk_group` = 1).
//!
//! The NextN (multi-token-prediction) layer at `num_hidden_layers` is not decoded: the
//! family drops it at install (its `mtp` sidecar).

use super::decoder::{Model, Variant};
use crate::runtime::RunError;
use crate::runtime::kernels::Ops;
use crate::runtime::layers::moe::SigmoidDefaults;
use crate::runtime::load::Install;

/// transformers 5.24's `Glm4MoeConfig` defaults for the MoE fields a config may omit.
pub const DEFAULTS: SigmoidDefaults = SigmoidDefaults {
    norm_topk_prob: true,
    n_group: 1,
    topk_group: 1,
    routed_scaling_factor: 1.0,
    n_shared_experts: 1,
    first_k_dense_replace: 1,
};

/// GLM-4.5's place in the decoder.
pub const GLM4_MOE: Variant = Variant {
    router: "mlp.gate.weight",
    renormalize: None,
    sigmoid: Some(&DEFAULTS),
};

/// The GLM-4.5 model of `install` on `backend`.
pub fn open<'a, B: Ops>(install: &'a Install, backend: &'a B) -> Result<Model<'a, B>, RunError> {
    Model::with(install, backend, &GLM4_MOE)
}
