//! Architecture axes: the bounds every value must meet, in one place for every reader.
//!
//! A family file maps `config.json` keys to axis names (`num_layers`, `hidden_size`, …);
//! the install copies the axes into the manifest's `arch.axes`, and the runtime sizes
//! its model from them. Both come from untrusted files, and a count read from them
//! sizes memory and loops, so [`check`] is called on the config's axes when the
//! install (or dry run) is planned, by `verify-install` on the manifest's, and by the
//! runtime on the manifest's before anything is allocated: a value refused at run time
//! is refused at install time too, with the same words.
//!
//! # The rules
//! - A count (layers, widths, heads, experts, vocabulary) is an integer from 1 to its
//!   bound ([`rule`]); `16.5`, `0`, `-1` and `10^12` are refused, naming the bound.
//! - A positive real (`rope_theta`, `rms_norm_eps`) is finite, above 0, at most its bound.
//! - A flag (`tie_word_embeddings`, `norm_topk_prob`) is a boolean.
//! - A parameter object (`rope_scaling`, `rope_parameters`) holds at most
//!   [`MAX_OBJECT_KEYS`] keys of at most 64 bytes, each a number as an unknown axis, a
//!   boolean, null, a string of at most 64 bytes (`rope_type`) or a list of at most 64
//!   such numbers; the runtime reads its fields with their own bounds.
//! - `null` is the same as absent (configs write `"head_dim": null`).
//! - An axis this table does not know is a number (finite, |x| ≤ 2^40), a boolean or
//!   null, as before any bound existed.
//! - Across axes: `num_key_value_heads` divides `num_attention_heads`; the head width
//!   (`head_dim`, else `hidden_size / num_attention_heads`) is even and non-zero
//!   (RoPE rotates pairs); `num_experts_per_tok` is at most `num_experts`.
//!
//! The bounds are far above any published model (the largest have 126 layers, width
//! 16,384, 512 experts, a 262,144-token vocabulary) and far below what would exhaust
//! memory or time when something is sized from them.

use std::collections::BTreeMap;

use serde_json::Value;

/// What kind of value an axis holds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Rule {
    /// An integer in `1..=max`.
    Count {
        /// Largest value accepted.
        max: u64,
    },
    /// A finite real in `(0, max]`.
    Positive {
        /// Largest value accepted.
        max: f64,
    },
    /// A boolean.
    Flag,
    /// An object of named parameters (RoPE scaling).
    Object,
    /// One attention kind per layer (`layer_types`): a list of at most
    /// [`MAX_LAYER_TYPES`] names from [`LAYER_TYPES`].
    LayerTypes,
    /// An axis this table does not know: a finite number, a boolean, or null.
    Other,
}

/// Most keys a parameter object axis may hold.
pub const MAX_OBJECT_KEYS: usize = 32;
/// Longest key or string in a parameter object, and most numbers in one of its lists.
const MAX_OBJECT_ITEM: usize = 64;

/// Most entries of a `layer_types` list (the `num_layers` bound).
pub const MAX_LAYER_TYPES: usize = 1024;
/// The attention kinds a `layer_types` list may name (transformers' names).
pub const LAYER_TYPES: [&str; 2] = ["sliding_attention", "full_attention"];

/// Largest magnitude of a number on an axis this table does not know.
pub const MAX_OTHER: f64 = (1u64 << 40) as f64;

/// The rule of `axis`.
pub fn rule(axis: &str) -> Rule {
    use Rule::*;
    match axis {
        "num_layers" => Count { max: 1024 },
        "hidden_size" => Count { max: 1 << 17 },
        "num_attention_heads" | "num_key_value_heads" => Count { max: 1024 },
        "head_dim" => Count { max: 4096 },
        "intermediate_size" | "moe_intermediate_size" => Count { max: 1 << 20 },
        "vocab_size" => Count { max: 1 << 24 },
        "num_experts" => Count { max: 1 << 16 },
        "num_experts_per_tok" => Count { max: 1024 },
        "max_position_embeddings" => Count { max: 1 << 28 },
        "hc_count" => Count { max: 64 },
        "hc_lowrank" => Count { max: 1 << 17 },
        "rope_theta" => Positive { max: 1e12 },
        "rms_norm_eps" => Positive { max: 1.0 },
        "tie_word_embeddings" | "norm_topk_prob" => Flag,
        "rope_scaling" | "rope_parameters" => Object,
        "layer_types" => LayerTypes,
        _ => Other,
    }
}

/// Why an axis value is refused: the axis (the caller names its file and field) and
/// what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AxisError {
    /// Axis name.
    pub axis: String,
    /// What is wrong, e.g. `1000000000 is out of range (at most 1024)`.
    pub detail: String,
}

/// Check one value against its axis's rule (`null` always passes: absent).
pub fn check_value(axis: &str, v: &Value) -> Result<(), String> {
    if v.is_null() {
        return Ok(());
    }
    match rule(axis) {
        Rule::Count { max } => match v {
            Value::Number(n) => {
                if let Some(u) = n.as_u64() {
                    if u == 0 {
                        Err("0 is out of range (at least 1)".into())
                    } else if u > max {
                        Err(format!("{u} is out of range (at most {max})"))
                    } else {
                        Ok(())
                    }
                } else if n.as_i64().is_some() {
                    Err(format!("{n} is out of range (at least 1)"))
                } else {
                    Err(format!("{n} is not an integer"))
                }
            }
            other => Err(format!("expected an integer, found {other}")),
        },
        Rule::Positive { max } => match v.as_f64() {
            Some(f) if f.is_finite() && f > 0.0 && f <= max => Ok(()),
            Some(_) if f64_is_positive(v) => Err(format!("{v} is out of range (at most {max})")),
            Some(_) => Err(format!("{v} is out of range (above 0)")),
            None => Err(format!("expected a number, found {v}")),
        },
        Rule::Flag => match v {
            Value::Bool(_) => Ok(()),
            other => Err(format!("expected true or false, found {other}")),
        },
        Rule::Object => check_object(v),
        Rule::LayerTypes => match v {
            Value::Array(a) if a.len() > MAX_LAYER_TYPES => {
                Err(format!("a list of {} (at most {MAX_LAYER_TYPES})", a.len()))
            }
            Value::Array(a) => a.iter().enumerate().try_for_each(|(i, x)| match x {
                Value::String(s) if LAYER_TYPES.contains(&s.as_str()) => Ok(()),
                other => Err(format!(
                    "entry {i} is {other}, not one of {}",
                    LAYER_TYPES.join(", ")
                )),
            }),
            other => Err(format!("expected a list of layer kinds, found {other}")),
        },
        Rule::Other => match v {
            Value::Bool(_) => Ok(()),
            Value::Number(n) => match n.as_f64() {
                Some(f) if f.is_finite() && f.abs() <= MAX_OTHER => Ok(()),
                _ => Err(format!("{n} is out of range (at most 2^40 in magnitude)")),
            },
            other => Err(format!("expected a number or boolean, found {other}")),
        },
    }
}

/// A parameter object's shape (see the module doc).
fn check_object(v: &Value) -> Result<(), String> {
    let Value::Object(map) = v else {
        return Err(format!("expected an object of parameters, found {v}"));
    };
    if map.len() > MAX_OBJECT_KEYS {
        return Err(format!("{} keys (at most {MAX_OBJECT_KEYS})", map.len()));
    }
    for (k, item) in map {
        if k.len() > MAX_OBJECT_ITEM {
            return Err(format!(
                "a key of {} bytes (at most {MAX_OBJECT_ITEM})",
                k.len()
            ));
        }
        let scalar = |x: &Value| match x {
            Value::Null | Value::Bool(_) => Ok(()),
            Value::Number(n)
                if n.as_f64()
                    .is_some_and(|f| f.is_finite() && f.abs() <= MAX_OTHER) =>
            {
                Ok(())
            }
            Value::Number(n) => Err(format!(
                "{k}: {n} is out of range (at most 2^40 in magnitude)"
            )),
            Value::String(s) if s.len() <= MAX_OBJECT_ITEM => Ok(()),
            Value::String(s) => Err(format!(
                "{k}: a string of {} bytes (at most {MAX_OBJECT_ITEM})",
                s.len()
            )),
            other => Err(format!(
                "{k}: expected a number, boolean or string, found {other}"
            )),
        };
        match item {
            Value::Array(a) if a.len() <= MAX_OBJECT_ITEM => {
                a.iter().try_for_each(|x| match x {
                    Value::Number(_) => scalar(x),
                    other => Err(format!("{k}: expected a list of numbers, found {other}")),
                })?
            }
            Value::Array(a) => Err(format!(
                "{k}: a list of {} (at most {MAX_OBJECT_ITEM})",
                a.len()
            ))?,
            other => scalar(other)?,
        }
    }
    Ok(())
}

fn f64_is_positive(v: &Value) -> bool {
    v.as_f64().is_some_and(|f| f > 0.0)
}

/// Check every axis of `axes` and the rules across them (see the module doc).
pub fn check(axes: &BTreeMap<String, Value>) -> Result<(), AxisError> {
    let err = |axis: &str, detail: String| AxisError {
        axis: axis.to_string(),
        detail,
    };
    for (axis, v) in axes {
        check_value(axis, v).map_err(|d| err(axis, d))?;
    }
    let count = |axis: &str| axes.get(axis).and_then(Value::as_u64);
    let heads = count("num_attention_heads");
    if let (Some(heads), Some(kv)) = (heads, count("num_key_value_heads"))
        && heads % kv != 0
    {
        return Err(err(
            "num_key_value_heads",
            format!("{kv} does not divide num_attention_heads {heads}"),
        ));
    }
    match (count("head_dim"), count("hidden_size"), heads) {
        (Some(d), _, _) if d % 2 != 0 => {
            return Err(err(
                "head_dim",
                format!("{d} is odd; RoPE needs an even head width"),
            ));
        }
        (None, Some(h), Some(n)) if (h / n) % 2 != 0 || h / n == 0 => {
            return Err(err(
                "num_attention_heads",
                format!(
                    "hidden_size {h} / num_attention_heads {n} gives head width {}; RoPE needs an even, non-zero head width",
                    h / n
                ),
            ));
        }
        _ => {}
    }
    if let (Some(e), Some(k)) = (count("num_experts"), count("num_experts_per_tok"))
        && k > e
    {
        return Err(err(
            "num_experts_per_tok",
            format!("{k} is more than num_experts {e}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn axes(v: Value) -> BTreeMap<String, Value> {
        serde_json::from_value(v).unwrap()
    }

    fn refusal(v: Value) -> String {
        let e = check(&axes(v)).unwrap_err();
        format!("{}: {}", e.axis, e.detail)
    }

    #[test]
    fn real_configs_pass() {
        // Qwen3-30B-A3B and Flash-Next (the published numbers).
        check(&axes(json!({
            "hidden_size": 2048, "num_layers": 48, "num_attention_heads": 32,
            "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
            "num_experts_per_tok": 8, "moe_intermediate_size": 768, "vocab_size": 151936,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "norm_topk_prob": true,
            "max_position_embeddings": 40960, "rope_scaling": null, "head_dim_extra": 3
        })))
        .unwrap();
        check(&axes(json!({
            "hidden_size": 2560, "num_layers": 48, "num_attention_heads": 24,
            "num_key_value_heads": 2, "head_dim": 256, "num_experts": 512,
            "num_experts_per_tok": 10, "moe_intermediate_size": 640, "vocab_size": 248320,
            "hc_count": 4, "hc_lowrank": 320
        })))
        .unwrap();
    }

    #[test]
    fn absurd_and_mistyped_values_are_refused_naming_the_bound() {
        assert_eq!(
            refusal(json!({"num_layers": 1_000_000_000u64})),
            "num_layers: 1000000000 is out of range (at most 1024)"
        );
        assert_eq!(
            refusal(json!({"num_experts": 1_000_000_000_000u64})),
            "num_experts: 1000000000000 is out of range (at most 65536)"
        );
        assert_eq!(
            refusal(json!({"num_experts": 16.5})),
            "num_experts: 16.5 is not an integer"
        );
        assert_eq!(
            refusal(json!({"hidden_size": 0})),
            "hidden_size: 0 is out of range (at least 1)"
        );
        assert_eq!(
            refusal(json!({"num_experts_per_tok": 0})),
            "num_experts_per_tok: 0 is out of range (at least 1)"
        );
        assert_eq!(
            refusal(json!({"num_experts": 8, "num_experts_per_tok": 99})),
            "num_experts_per_tok: 99 is more than num_experts 8"
        );
        assert_eq!(
            refusal(json!({"vocab_size": -3})),
            "vocab_size: -3 is out of range (at least 1)"
        );
        assert_eq!(
            refusal(json!({"vocab_size": "1024"})),
            "vocab_size: expected an integer, found \"1024\""
        );
        assert_eq!(
            refusal(json!({"rms_norm_eps": 0.0})),
            "rms_norm_eps: 0.0 is out of range (above 0)"
        );
        assert_eq!(
            refusal(json!({"rope_theta": 1e300})),
            "rope_theta: 1e+300 is out of range (at most 1000000000000)"
        );
        assert_eq!(
            refusal(json!({"norm_topk_prob": 1})),
            "norm_topk_prob: expected true or false, found 1"
        );
        assert_eq!(
            refusal(json!({"layer_types": ["full_attention", "linear_attention"]})),
            "layer_types: entry 1 is \"linear_attention\", not one of sliding_attention, full_attention"
        );
        assert_eq!(
            refusal(json!({"layer_types": 3})),
            "layer_types: expected a list of layer kinds, found 3"
        );
        check(&axes(
            json!({"layer_types": ["sliding_attention", "full_attention"]}),
        ))
        .unwrap();
        assert_eq!(
            refusal(json!({"some_axis": [1]})),
            "some_axis: expected a number or boolean, found [1]"
        );
        assert_eq!(
            refusal(json!({"num_attention_heads": 6, "num_key_value_heads": 4})),
            "num_key_value_heads: 4 does not divide num_attention_heads 6"
        );
        assert_eq!(
            refusal(json!({"hidden_size": 96, "num_attention_heads": 32})),
            "num_attention_heads: hidden_size 96 / num_attention_heads 32 gives head width 3; RoPE needs an even, non-zero head width"
        );
        assert_eq!(
            refusal(json!({"head_dim": 65})),
            "head_dim: 65 is odd; RoPE needs an even head width"
        );
    }

    #[test]
    fn bounds_are_inclusive_and_null_is_absent() {
        check(&axes(json!({"num_layers": 1024, "head_dim": null}))).unwrap();
        assert!(check(&axes(json!({"num_layers": 1025}))).is_err());
        check(&axes(json!({"rms_norm_eps": 1.0}))).unwrap();
    }

    #[test]
    fn rope_scaling_objects_are_bounded_parameter_lists() {
        let ok = json!({"rope_scaling": {"rope_type": "yarn", "factor": 40, "beta_fast": 32,
            "mscale_all_dim": 1.0, "truncate": false, "original_max_position_embeddings": 4096},
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [11, 11, 10]}});
        let axes: BTreeMap<String, Value> = serde_json::from_value(ok).unwrap();
        assert_eq!(check(&axes), Ok(()));
        assert_eq!(
            refusal(json!({"rope_scaling": "yarn"})),
            "rope_scaling: expected an object of parameters, found \"yarn\""
        );
        assert_eq!(
            refusal(json!({"rope_scaling": {"factor": {"deep": 1}}})),
            "rope_scaling: factor: expected a number, boolean or string, found {\"deep\":1}"
        );
        assert_eq!(
            refusal(json!({"rope_scaling": {"factor": 1e300}})),
            "rope_scaling: factor: 1e+300 is out of range (at most 2^40 in magnitude)"
        );
        let many: serde_json::Map<String, Value> =
            (0..40).map(|i| (format!("k{i}"), json!(1))).collect();
        assert_eq!(
            refusal(json!({"rope_scaling": many})),
            "rope_scaling: 40 keys (at most 32)"
        );
    }
}
