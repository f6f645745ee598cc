//! The family capability gate: which installs `gturbo run` can execute.
//!
//! Each runner declares the families it reads and the architecture axes it
//! implements (the vocabulary of `required_axes` in `families/*.json`, copied into a
//! manifest's `arch.required_axes`). The gate compares a manifest's family and
//! required axes with this registry before any weight file is opened, and refuses
//! with one line that names the family and every missing axis.

/// Grouped-query attention (KV heads shared by groups of query heads).
pub const GQA_ATTENTION: &str = "gqaAttention";
/// Rotary position embeddings, rotate-half layout.
pub const ROPE: &str = "rope";
/// RMSNorm scaled by `w` (not `1 + w`).
pub const RMS_NORM: &str = "rmsNorm";
/// SwiGLU MLP: `down(silu(gate x) * up x)`.
pub const SWIGLU: &str = "swiglu";
/// Per-head RMSNorm of queries and keys before RoPE (Qwen3).
pub const QK_NORM: &str = "qkNorm";
/// Softmax top-k routed experts read from expert pools (Qwen3-MoE).
pub const ROUTED_MOE: &str = "routedMoe";
/// LM head shared with the token embedding.
pub const TIED_EMBEDDINGS: &str = "tiedEmbeddings";
/// Attention whose output is multiplied by a sigmoid gate packed with the query
/// (Flash-Next's and Qwen3-Next's `q_proj`), with partial RoPE and QK-norm.
pub const GATED_ATTENTION: &str = "gatedAttention";
/// Gated DeltaNet linear attention: causal conv state and the delta-rule recurrence.
pub const GATED_DELTA_NET: &str = "gatedDeltaNetLinearAttention";
/// The QSA indexer: block-pooled keys, relu-sum scores, torch's top-k tie rule.
pub const ATTENTION_INDEXER: &str = "attentionIndexer";
/// A shared expert next to the routed ones, scaled by a sigmoid gate.
pub const SHARED_EXPERT_GATED: &str = "sharedExpertGated";
/// A residual of several streams read and written through low-rank hyper-connections.
pub const HYPER_CONNECTIONS: &str = "hyperConnectionsLowRank";
/// The PLE n-gram embedding: hashed row ids into row pools, gated and convolved.
pub const PLE_NGRAM: &str = "pleNgramEmbedding";
/// RMSNorm scaled by `1 + w` (zero-centred weights).
pub const OFFSET_RMS_NORM: &str = "offsetRmsNorm";

/// Multi-head latent attention: low-rank q and kv projections with their norms, a
/// decoupled rope key shared by the heads, qk and v heads of different widths.
pub const MLA_ATTENTION: &str = "multiHeadLatentAttention";
/// Sigmoid router scores, a per-expert selection bias, group-limited top-k, scaled
/// weights (DeepSeek-V3's `noaux_tc`).
pub const SIGMOID_GROUP_ROUTING: &str = "sigmoidGroupRouting";
/// An ungated shared expert beside the routed ones.
pub const SHARED_EXPERT: &str = "sharedExpert";
/// Biases on the q, k and v projections (GLM-4.5's `attention_bias`).
pub const QKV_BIAS: &str = "qkvBias";
/// Rotary embeddings on the first `partial_rotary_factor` of each head, rotate-half.
pub const PARTIAL_ROPE: &str = "partialRope";

/// A learned per-head logit in each attention softmax's denominator (gpt-oss's
/// `self_attn.sinks`).
pub const ATTENTION_SINKS: &str = "attentionSinks";
/// Layers alternating a sliding window and full attention as `layer_types` says.
pub const SLIDING_WINDOW_ALTERNATING: &str = "slidingWindowAlternating";
/// gpt-oss's experts: gate and up interleaved in the source, biases on every
/// projection, the clamped SwiGLU `(clamp(up) + 1) · g · σ(α g)`, `g = min(gate, limit)`.
pub const CLAMPED_SWIGLU_INTERLEAVED: &str = "clampedSwigluInterleaved";

/// The model a runner builds (`runtime::models::open` turns it into a loader).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// `models::decoder`: the transformer decoder parametrised by the install's axes.
    Decoder,
    /// `models::flash_next`: Qwen3.8-Flash-Next.
    FlashNext,
    /// `models::mixtral`: the decoder with Mixtral's names and routing.
    Mixtral,
    /// `models::deepseek_v3`: DeepSeek-V3 and Kimi-K2.
    DeepseekV3,
    /// `models::glm4_moe`: the decoder with GLM-4.5's biases, partial rotary and
    /// sigmoid routing.
    Glm4Moe,
    /// `models::qwen3_next`: Qwen3-Next.
    Qwen3Next,
    /// `models::gpt_oss`: gpt-oss.
    GptOss,
}

/// A runner: the families it reads, the axes it implements and the model it builds.
#[derive(Debug, PartialEq, Eq)]
pub struct Runner {
    /// Name shown by `gturbo families` and the run footer.
    pub name: &'static str,
    /// The model that runs these families.
    pub arch: Arch,
    /// Family ids it accepts.
    pub families: &'static [&'static str],
    /// Axes it implements.
    pub axes: &'static [&'static str],
}

impl Runner {
    /// Whether the runner implements `axis`.
    pub fn implements(&self, axis: &str) -> bool {
        self.axes.contains(&axis)
    }
}

/// The runner of the qwen4_exp text model (`runtime::flash_next`).
pub const FLASH_NEXT: &str = "flash-next";

/// Every runner gturbo has. One decoder, parametrised by axes, covers the plain
/// transformer families (Mixtral with its own names and routing); `flash-next` runs
/// Qwen3.8-Flash-Next, `qwen3_next` Qwen3-Next.
pub const RUNNERS: &[Runner] = &[
    Runner {
        name: "decoder",
        arch: Arch::Decoder,
        families: &["llama", "qwen3", "qwen3_moe"],
        axes: &[
            GQA_ATTENTION,
            ROPE,
            RMS_NORM,
            SWIGLU,
            QK_NORM,
            ROUTED_MOE,
            TIED_EMBEDDINGS,
        ],
    },
    Runner {
        name: "mixtral",
        arch: Arch::Mixtral,
        families: &["mixtral"],
        axes: &[GQA_ATTENTION, ROPE, RMS_NORM, SWIGLU, ROUTED_MOE],
    },
    Runner {
        name: "deepseek_v3",
        arch: Arch::DeepseekV3,
        families: &["deepseek_v3"],
        axes: &[
            MLA_ATTENTION,
            ROPE,
            RMS_NORM,
            SWIGLU,
            ROUTED_MOE,
            SIGMOID_GROUP_ROUTING,
            SHARED_EXPERT,
        ],
    },
    Runner {
        name: "glm4_moe",
        arch: Arch::Glm4Moe,
        families: &["glm4_moe"],
        axes: &[
            GQA_ATTENTION,
            QKV_BIAS,
            PARTIAL_ROPE,
            QK_NORM,
            RMS_NORM,
            SWIGLU,
            ROUTED_MOE,
            SIGMOID_GROUP_ROUTING,
            SHARED_EXPERT,
        ],
    },
    Runner {
        name: FLASH_NEXT,
        arch: Arch::FlashNext,
        families: &["qwen38flashnext"],
        axes: &[
            GATED_ATTENTION,
            GATED_DELTA_NET,
            ATTENTION_INDEXER,
            ROUTED_MOE,
            SHARED_EXPERT_GATED,
            HYPER_CONNECTIONS,
            PLE_NGRAM,
            OFFSET_RMS_NORM,
        ],
    },
    Runner {
        name: "qwen3_next",
        arch: Arch::Qwen3Next,
        families: &["qwen3_next"],
        axes: &[
            GATED_ATTENTION,
            GATED_DELTA_NET,
            ROUTED_MOE,
            SHARED_EXPERT_GATED,
            OFFSET_RMS_NORM,
        ],
    },
    Runner {
        name: "gpt_oss",
        arch: Arch::GptOss,
        families: &["gpt_oss"],
        axes: &[
            GQA_ATTENTION,
            QKV_BIAS,
            ATTENTION_SINKS,
            SLIDING_WINDOW_ALTERNATING,
            ROPE,
            RMS_NORM,
            ROUTED_MOE,
            CLAMPED_SWIGLU_INTERLEAVED,
        ],
    },
];

/// Why an install cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GateError {
    /// No runner accepts the family. `missing`: its required axes that no runner
    /// implements, in manifest order.
    #[error(
        "family {family} is installed but has no runner; missing axes: {}",
        no_runner_axes(missing)
    )]
    NoRunner {
        /// Family id.
        family: String,
        /// Axes no runner implements.
        missing: Vec<String>,
    },
    /// The family's runner lacks axes the install requires.
    #[error(
        "family {family} is installed but its runner {runner} lacks axes; missing axes: {}",
        missing.join(", ")
    )]
    MissingAxes {
        /// Family id.
        family: String,
        /// Runner name.
        runner: &'static str,
        /// Axes the runner lacks, in manifest order.
        missing: Vec<String>,
    },
}

/// The axis list of a `NoRunner` refusal: when every required axis exists in some
/// other family's runner, say so rather than print an empty list.
fn no_runner_axes(missing: &[String]) -> String {
    if missing.is_empty() {
        "none (every required axis exists in another family's runner)".into()
    } else {
        missing.join(", ")
    }
}

/// The runner registered for `family`, if any (axes not checked).
pub fn runner_for(family: &str) -> Option<&'static Runner> {
    RUNNERS.iter().find(|r| r.families.contains(&family))
}

/// The runner for an install of `family` that requires `required` axes, or the
/// refusal naming every missing axis.
pub fn check(family: &str, required: &[String]) -> Result<&'static Runner, GateError> {
    match runner_for(family) {
        Some(runner) => {
            let missing: Vec<String> = dedup(required.iter().filter(|a| !runner.implements(a)));
            if missing.is_empty() {
                Ok(runner)
            } else {
                Err(GateError::MissingAxes {
                    family: family.to_string(),
                    runner: runner.name,
                    missing,
                })
            }
        }
        None => Err(GateError::NoRunner {
            family: family.to_string(),
            missing: dedup(
                required
                    .iter()
                    .filter(|a| !RUNNERS.iter().any(|r| r.implements(a))),
            ),
        }),
    }
}

fn dedup<'a>(axes: impl Iterator<Item = &'a String>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for a in axes {
        if !out.contains(a) {
            out.push(a.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn plain_families_pass_with_their_axes() {
        for (fam, axes) in [
            ("llama", s(&["gqaAttention", "rope", "rmsNorm", "swiglu"])),
            ("qwen3_moe", s(&["gqaAttention", "qkNorm", "routedMoe"])),
        ] {
            assert_eq!(check(fam, &axes).map(|r| r.name), Ok("decoder"));
        }
    }

    #[test]
    fn unknown_family_lists_only_axes_no_runner_has() {
        let err = check(
            "deepseek_v4",
            &s(&[
                "multiLatentAttention",
                "routedMoe",
                "slidingWindow",
                "multiLatentAttention",
            ]),
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "family deepseek_v4 is installed but has no runner; missing axes: \
             multiLatentAttention, slidingWindow"
        );
    }

    #[test]
    fn unknown_family_whose_axes_all_exist_elsewhere_says_none_are_missing() {
        let err = check("mistral", &s(&["rope", "swiglu"])).unwrap_err();
        assert_eq!(
            err.to_string(),
            "family mistral is installed but has no runner; missing axes: none (every \
             required axis exists in another family's runner)"
        );
    }

    #[test]
    fn flash_next_passes_with_its_family_axes_and_refuses_mtp_as_required() {
        let fam: serde_json::Value =
            serde_json::from_str(include_str!("../../../../families/qwen38flashnext.json"))
                .unwrap();
        let axes: Vec<String> = fam["arch"]["required_axes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect();
        assert_eq!(
            check("qwen38flashnext", &axes).map(|r| r.name),
            Ok(FLASH_NEXT)
        );
        // MTP is a carried sidecar, not needed to generate: a family that required
        // it would be refused, naming the axis.
        let mut with_mtp = axes.clone();
        with_mtp.push("multiTokenPrediction".into());
        assert_eq!(
            check("qwen38flashnext", &with_mtp).unwrap_err().to_string(),
            "family qwen38flashnext is installed but its runner flash-next lacks axes; \
             missing axes: multiTokenPrediction"
        );
    }

    #[test]
    fn known_family_with_an_unknown_axis_is_refused() {
        let err = check("qwen3", &s(&["rope", "slidingWindow", "qkNorm", "mystery"])).unwrap_err();
        assert_eq!(
            err.to_string(),
            "family qwen3 is installed but its runner decoder lacks axes; missing axes: \
             slidingWindow, mystery"
        );
    }
}
