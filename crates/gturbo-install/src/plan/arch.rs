//! The planner's *arch* stage: the config's axes through the family's mapping, and
//! those axes against the tensors the checkpoint holds.

use std::collections::{BTreeMap, BTreeSet};

use super::classify::{Draft, DraftRole};
use super::error::PlanError;
use super::types::Arch;
use crate::family::{Family, axes as axis_rules};
use crate::format::pools::ExpertPool;

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
        let field = format!("{prefix}{key}");
        // A dotted key walks nested objects (`rope_parameters.rope_theta`); config keys
        // themselves never contain dots.
        let Some(v) = key.split('.').try_fold(root, |node, part| node.get(part)) else {
            if optional {
                continue;
            }
            return Err(cfg_err(&field, format!("missing (axis `{axis}`)")));
        };
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
