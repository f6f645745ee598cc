//! The planner's *arch* stage: the config's axes through the family's mapping, and
//! those axes against the tensors the checkpoint holds.

use std::collections::{BTreeMap, BTreeSet};

use super::classify::{Draft, DraftRole};
use super::error::PlanError;
use super::types::Arch;
use crate::family::{Family, axes as axis_rules};
use crate::format::pools::ExpertPool;

/// Config keys transformers 5 spells differently from transformers 4 (4.x key, 5.x
/// key): the RoPE fields moved into the `rope_parameters` object (which also stands
/// for 4.x's `rope_scaling`: the runtime's `RopeSpec::from_axes` reads either), and
/// `torch_dtype` became `dtype`. A family names one spelling; the other is read when
/// the config lacks it (transformers 5's `PreTrainedConfig` `standardize_rope_params`
/// moves `rope_theta` and `rope_scaling`'s fields into `rope_parameters`).
pub const CONFIG_SPELLINGS: [(&str, &str); 4] = [
    ("rope_theta", "rope_parameters.rope_theta"),
    (
        "partial_rotary_factor",
        "rope_parameters.partial_rotary_factor",
    ),
    ("rope_scaling", "rope_parameters"),
    ("torch_dtype", "dtype"),
];

/// The other spelling of `key` ([`CONFIG_SPELLINGS`]), if it has one.
fn other_spelling(key: &str) -> Option<&'static str> {
    CONFIG_SPELLINGS.iter().find_map(|&(v4, v5)| {
        if key == v4 {
            Some(v5)
        } else if key == v5 {
            Some(v4)
        } else {
            None
        }
    })
}

/// The value of `key` under `root` (a dotted key walks nested objects,
/// `rope_parameters.rope_theta`; config keys themselves never contain dots), else of
/// its other spelling; `null` counts as absent when the other spelling has a value
/// (4.x configs write `"rope_scaling": null`). Returns the key that was read.
fn lookup<'a>(
    root: &'a serde_json::Value,
    key: &'a str,
) -> Option<(&'a str, &'a serde_json::Value)> {
    let get = |k: &str| k.split('.').try_fold(root, |node, part| node.get(part));
    let own = get(key);
    if own.is_some_and(|v| !v.is_null()) {
        return own.map(|v| (key, v));
    }
    match other_spelling(key).and_then(|alt| get(alt).filter(|v| !v.is_null()).map(|v| (alt, v))) {
        Some(found) => Some(found),
        None => own.map(|v| (key, v)),
    }
}

/// The *arch* stage: the config's axes through the family's mapping, each checked by
/// the shared rules ([`axis_rules`]). Also returns each axis's config field, for errors.
pub(super) fn read_arch(
    family: &Family,
    config: &serde_json::Value,
) -> Result<(Arch, BTreeMap<String, String>), PlanError> {
    let cfg_err = |field: &str, detail: String| PlanError::Config {
        field: field.to_string(),
        detail,
    };
    let model_type = config
        .get("model_type")
        .and_then(|v| v.as_str())
        .ok_or_else(|| cfg_err("model_type", "missing or not a string".into()))?;
    if !family.file.model_types.iter().any(|m| m == model_type) {
        return Err(cfg_err(
            "model_type",
            format!(
                "`{model_type}` is not a model type of family {} (expects {})",
                family.id(),
                family.file.model_types.join(", ")
            ),
        ));
    }
    let (root, prefix) = match &family.file.config_root {
        Some(key) => (
            config
                .get(key)
                .filter(|v| v.is_object())
                .ok_or_else(|| cfg_err(key, "missing or not an object".into()))?,
            format!("{key}."),
        ),
        None => (config, String::new()),
    };
    let mut axes = BTreeMap::new();
    let mut fields = BTreeMap::new();
    for (axis, key) in &family.file.arch.axes {
        let (key, optional) = match key.strip_suffix('?') {
            Some(k) => (k, true),
            None => (key.as_str(), false),
        };
        let Some((key, v)) = lookup(root, key) else {
            if optional {
                continue;
            }
            let also = other_spelling(key)
                .map(|alt| format!("; nor `{prefix}{alt}`"))
                .unwrap_or_default();
            return Err(cfg_err(
                &format!("{prefix}{key}"),
                format!("missing (axis `{axis}`{also})"),
            ));
        };
        let field = format!("{prefix}{key}");
        axis_rules::check_value(axis, v)
            .map_err(|d| cfg_err(&field, format!("{d} (axis `{axis}`)")))?;
        fields.insert(axis.clone(), field);
        axes.insert(axis.clone(), v.clone());
    }
    // The rules across axes, the runtime's own (one function for both).
    axis_rules::check(&axes).map_err(|e| {
        let field = fields.get(&e.axis).cloned().unwrap_or(e.axis.clone());
        cfg_err(&field, format!("{} (axis `{}`)", e.detail, e.axis))
    })?;
    let arch = Arch {
        model_type: model_type.to_string(),
        axes,
        required_axes: family.file.arch.required_axes.clone(),
    };
    Ok((arch, fields))
}

/// The architecture a family reads from `config.json`, every axis checked by the
/// shared rules ([`crate::family::axes`]): the planner's first stage on its own, for
/// the fuzzer and for callers that have no headers yet.
pub fn arch_from_config(family: &Family, config: &serde_json::Value) -> Result<Arch, PlanError> {
    read_arch(family, config).map(|(arch, _)| arch)
}

/// The axes against the tensors present: `num_layers` must be the number of decoder
/// layers the main model's tensors hold (numbered `0..num_layers`), and `num_experts`
/// the experts of every main-model expert pool. A config that names a billion layers
/// over a checkpoint of four is refused here, naming the field.
pub(super) fn check_axes_against_tensors(
    arch: &Arch,
    fields: &BTreeMap<String, String>,
    drafts: &[Draft],
    pools: &[ExpertPool],
) -> Result<(), PlanError> {
    let err = |axis: &str, detail: String| PlanError::Config {
        field: fields
            .get(axis)
            .cloned()
            .unwrap_or_else(|| axis.to_string()),
        detail: format!("{detail} (axis `{axis}`)"),
    };
    let layers: BTreeSet<u64> = drafts
        .iter()
        .filter(|d| d.sidecar.is_none() && !matches!(d.role, DraftRole::Excluded { .. }))
        .filter_map(|d| d.layer)
        .collect();
    if let (Some(n), Some(&last)) = (
        arch.axes.get("num_layers").and_then(|v| v.as_u64()),
        layers.last(),
    ) && (last + 1 != n || layers.len() as u64 != n)
    {
        let missing = (0..n.min(last + 1)).find(|l| !layers.contains(l));
        let detail = match missing {
            Some(l) if last + 1 >= n => format!("{n} layers, but layer {l} has no tensors"),
            _ => format!(
                "{n} layers, but the checkpoint's tensors hold layers 0..={last} ({})",
                layers.len()
            ),
        };
        return Err(err("num_layers", detail));
    }
    if let Some(e) = arch.axes.get("num_experts").and_then(|v| v.as_u64()) {
        for p in pools.iter().filter(|p| p.sidecar.is_none()) {
            if p.experts != e {
                return Err(err(
                    "num_experts",
                    format!("{e} experts, but {} holds {}", p.file, p.experts),
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A Llama config as transformers 4 writes it, and as transformers 5.24 writes
    /// the same model: `rope_parameters` in place of `rope_theta`/`rope_scaling`,
    /// `dtype` in place of `torch_dtype`.
    fn configs() -> (serde_json::Value, serde_json::Value) {
        let mut v4 = json!({"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256,
            "vocab_size": 512, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
            "tie_word_embeddings": true});
        let mut v5 = v4.clone();
        v4["rope_theta"] = json!(500000.0);
        v4["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0});
        v4["torch_dtype"] = json!("bfloat16");
        v5["rope_parameters"] =
            json!({"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0});
        v5["dtype"] = json!("bfloat16");
        (v4, v5)
    }

    #[test]
    fn both_config_spellings_give_the_axes_the_runtime_reads() {
        let llama = Family::builtin("llama").unwrap();
        let (v4, v5) = configs();
        let a4 = arch_from_config(&llama, &v4).unwrap();
        let a5 = arch_from_config(&llama, &v5).unwrap();
        assert_eq!(a4.axes["rope_theta"], json!(500000.0));
        assert_eq!(a5.axes["rope_theta"], a4.axes["rope_theta"]);
        // 5.x's object stands for `rope_scaling` (it also carries `rope_theta`,
        // which the runtime reads first from the object).
        assert_eq!(a5.axes["rope_scaling"], v5["rope_parameters"]);
        // A 4.x `"rope_scaling": null` beside nothing else stays null (absent).
        let mut plain = v4.clone();
        plain["rope_scaling"] = serde_json::Value::Null;
        assert!(arch_from_config(&llama, &plain).unwrap().axes["rope_scaling"].is_null());
        // A family naming the 5.x key reads a 4.x config too (Flash-Next's axis is
        // `rope_parameters.rope_theta`).
        assert_eq!(
            lookup(&v4, "rope_parameters.rope_theta"),
            Some(("rope_theta", &json!(500000.0)))
        );
        assert_eq!(
            lookup(&v5, "torch_dtype"),
            Some(("dtype", &json!("bfloat16")))
        );
    }

    #[test]
    fn a_config_with_neither_spelling_names_both() {
        let llama = Family::builtin("llama").unwrap();
        let (mut v4, _) = configs();
        v4.as_object_mut().unwrap().remove("rope_theta");
        let e = arch_from_config(&llama, &v4).unwrap_err().to_string();
        assert_eq!(
            e,
            "config.json: field `rope_theta`: missing (axis `rope_theta`; nor \
             `rope_parameters.rope_theta`)"
        );
        // The 5.x field's own value is checked under its own name.
        let (_, mut v5) = configs();
        v5["rope_parameters"]["rope_theta"] = json!(-1.0);
        let e = arch_from_config(&llama, &v5).unwrap_err().to_string();
        assert!(
            e.starts_with("config.json: field `rope_parameters.rope_theta`: -1"),
            "{e}"
        );
    }
}
