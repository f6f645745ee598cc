//! Mixtral (`MixtralForCausalLM`): the decoder with routed experts under
//! `block_sparse_moe` (the installer maps the experts' `w1`, `w3`, `w2` to the pool's
//! gate, up and down through `families/mixtral.json`) and its router's rule:
//! `softmax` over all experts, the top k, renormalised to sum 1, whatever the config
//! says (Mixtral has no `norm_topk_prob`; transformers' `MixtralSparseMoeBlock` always
//! divides by the sum of the k).

use super::decoder::{Model, Variant};
use crate::runtime::RunError;
use crate::runtime::kernels::Ops;
use crate::runtime::load::Install;

/// Mixtral's place in the decoder.
pub const MIXTRAL: Variant = Variant {
    router: "block_sparse_moe.gate.weight",
    renormalize: Some(true),
    sigmoid: None,
};

/// The Mixtral model of `install` on `backend`.
pub fn open<'a, B: Ops>(install: &'a Install, backend: &'a B) -> Result<Model<'a, B>, RunError> {
    Model::with(install, backend, &MIXTRAL)
}
