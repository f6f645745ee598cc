//! The quantization policy of one plan: which scheme each matrix is stored at.

use super::profile;
use crate::family::Family;
use crate::format::Scheme;
use crate::header::Dtype;

/// The quantization policy of one plan: the profile's rules, the family's overrides
/// and `never_quantize` on top, and the group fit (a matrix whose rows are not whole
/// groups of its scheme stays at its dtype, as mlx-lm leaves it).
pub(super) struct Policy<'a> {
    pub(super) family: &'a Family,
    pub(super) profile: &'static profile::Profile,
    pub(super) num_layers: u64,
    pub(super) prequantized: bool,
    /// `--requantize` on a pre-quantized source: its modules are planned as the
    /// BF16 matrices they dequantize to.
    pub(super) requantize: bool,
}

/// `scheme` if rows of `cols` elements are whole groups of it, else passthrough.
fn fit(scheme: Scheme, cols: u64) -> Scheme {
    match scheme.group() {
        Some(g) if cols == 0 || !cols.is_multiple_of(u64::from(g)) => Scheme::Passthrough,
        _ => scheme,
    }
}

impl Policy<'_> {
    /// Whether nothing of this plan is quantized here (a pre-quantized source's own
    /// modules aside).
    fn keeps_dtype(&self, dtype: Dtype) -> bool {
        self.prequantized || dtype != Dtype::BF16 || self.profile.is_passthrough(self.family)
    }

    /// Scheme for a resident tensor of a source gturbo quantizes itself. Only a BF16
    /// matrix is ever quantized: an F32 tensor (`e_score_correction_bias`, which
    /// MLX-LM and transformers keep in float32) and any tensor of fewer or more than
    /// two dims (biases, norms, a conv1d kernel `[C, 1, K]`) stay as the source
    /// stores them, whatever an override's pattern matches.
    pub(super) fn resident(
        &self,
        name: &str,
        layer: Option<u64>,
        dtype: Dtype,
        shape: &[u64],
    ) -> Scheme {
        if self.keeps_dtype(dtype) || shape.len() != 2 {
            return Scheme::Passthrough;
        }
        let last = shape.last().copied().unwrap_or(0);
        if self.profile.family_overrides()
            && let Some(s) = self.family.quant_override(name)
        {
            return fit(s, last);
        }
        if name.ends_with(".weight") && !self.family.never_quantize(name) {
            let s =
                self.profile
                    .rule_scheme(self.family, name, layer.unwrap_or(0), self.num_layers);
            fit(s, last)
        } else {
            Scheme::Passthrough
        }
    }

    /// Scheme for a matrix that is always eligible (an expert projection, a row table)
    /// whose rows have `cols` elements.
    pub(super) fn pool(&self, name: &str, layer: u64, dtype: Dtype, cols: u64) -> Scheme {
        if self.keeps_dtype(dtype) {
            return Scheme::Passthrough;
        }
        fit(
            self.profile
                .rule_scheme(self.family, name, layer, self.num_layers),
            cols,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a BF16 matrix is quantized: an override's pattern does not reach a tensor
    /// of three dims (a conv1d kernel `[C, 1, K]`), an F32 one, or a 1-D one, at any
    /// profile.
    #[test]
    fn overrides_and_profiles_quantize_bf16_matrices_only() {
        let family = Family::builtin("qwen3_moe").unwrap();
        for id in ["int4", "int8", "bf16", "mixed-3-6", "mixed-4-6"] {
            let policy = Policy {
                family: &family,
                profile: profile::get(id).unwrap(),
                num_layers: 2,
                prequantized: false,
                requantize: false,
            };
            let s = |dtype, shape: &[u64]| {
                policy.resident("model.layers.0.mlp.gate.weight", Some(0), dtype, shape)
            };
            assert_eq!(s(Dtype::BF16, &[8, 1, 64]), Scheme::Passthrough, "{id}");
            assert_eq!(s(Dtype::F32, &[8, 64]), Scheme::Passthrough, "{id}");
            assert_eq!(s(Dtype::BF16, &[64]), Scheme::Passthrough, "{id}");
            let bias = policy.resident(
                "model.layers.0.mlp.gate.e_score_correction_bias",
                Some(0),
                Dtype::F32,
                &[8],
            );
            assert_eq!(bias, Scheme::Passthrough, "{id}");
            let want = if id == "bf16" {
                Scheme::Passthrough
            } else {
                Scheme::Int8G64
            };
            assert_eq!(s(Dtype::BF16, &[8, 64]), want, "{id}");
        }
    }
}
