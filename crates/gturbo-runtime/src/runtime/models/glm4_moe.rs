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

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::format::manifest::Manifest;
    use crate::runtime::kernels::routing::Scores;
    use crate::runtime::layers::rope::Layout;
    use crate::runtime::models::decoder::Config;

    /// GLM-4.5-Air's axes at toy sizes, the fields its config may omit left out.
    fn manifest(extra: Value) -> Manifest {
        let mut axes = json!({
            "hidden_size": 128, "num_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 128,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
            "vocab_size": 512, "rope_theta": 10000, "partial_rotary_factor": 0.5,
            "rms_norm_eps": 1e-5, "max_position_embeddings": 256
        });
        for (k, v) in extra.as_object().unwrap() {
            axes[k] = v.clone();
        }
        serde_json::from_value(json!({
            "arch": {"axes": axes, "model_type": "glm4_moe",
                "required_axes": ["gqaAttention", "qkvBias", "partialRope", "routedMoe",
                    "sigmoidGroupRouting", "sharedExpert"]},
            "excluded_tensors": 0, "expert_pools": [], "family": "glm4_moe", "files": [],
            "format": "gturbo", "minor_version": 1, "model_id": "t/t", "plan_fingerprint": "0",
            "quantized_at_install": {"bits": 4, "group_size": 64, "overrides": [],
                "parity_gate": "", "quality_gate": null, "scheme": "int4_g64"},
            "resident": {"entries": 0, "file": "resident.bin", "payload_start": 0},
            "row_pools": [], "sidecars": {},
            "source": {"commit": null, "index_sha256": null, "repo": "t/t", "revision": "main"},
            "tool": {"name": "gturbo", "version": "0"}, "version": 1
        }))
        .expect("test manifest")
    }

    #[test]
    fn absent_fields_take_glm4_moe_config_defaults() {
        let c = Config::of(&manifest(json!({})), &GLM4_MOE).unwrap();
        let s = c.moe.as_ref().unwrap();
        assert_eq!(s.routing.scores, Scores::Sigmoid);
        assert!(s.routing.selection_bias && s.routing.renormalize);
        assert_eq!((s.routing.groups, s.routing.scaling), (None, 1.0));
        assert_eq!((s.dense_layers, s.shared_intermediate), (1, 64));
        assert_eq!(c.intermediate, 128);
        assert!(!c.qk_norm && !c.qkv_bias);
        assert_eq!((c.rope.rotary_dim, c.rope.layout), (32, Layout::HalfSplit));
    }

    #[test]
    fn glm45s_options_read_as_its_config_says() {
        let m = manifest(json!({
            "use_qk_norm": true, "attention_bias": true, "routed_scaling_factor": 2.5,
            "first_k_dense_replace": 0, "n_shared_experts": 0, "norm_topk_prob": false
        }));
        let c = Config::of(&m, &GLM4_MOE).unwrap();
        let s = c.moe.as_ref().unwrap();
        assert!(c.qk_norm && c.qkv_bias);
        assert_eq!((s.routing.scaling, s.routing.renormalize), (2.5, false));
        assert_eq!(
            (s.dense_layers, s.shared_intermediate, c.intermediate),
            (0, 0, 0)
        );
        let e = Config::of(&manifest(json!({"first_k_dense_replace": 4})), &GLM4_MOE)
            .unwrap_err()
            .to_string();
        assert!(e.contains("arch.axes.first_k_dense_replace"), "{e}");
    }
}
