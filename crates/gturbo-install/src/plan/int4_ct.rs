//! Compressed-tensors INT4 sources (Kimi-K2-Thinking's routed experts): what
//! `config.json`'s `quantization_config` says, and each `P.weight_packed` found with its
//! `P.weight_scale` and `P.weight_shape` as one module kept at MLX affine 4-bit g32
//! ([`crate::transform::int4_ct`]: the words unchanged, the scales unchanged, the
//! biases `−8 × scale` written by the executor).
//!
//! Everything is checked from the headers before a plan exists: a scheme other than
//! `pack-quantized` 4-bit group-32 symmetric integers, a packed weight without its
//! scale or shape, or dtypes and shapes that do not pair are errors naming the file,
//! the tensor and the field. `P.weight_shape` holds the logical shape as data; the
//! planner takes `[rows, 8 × words]`, which the scales' `32 × groups` must equal.

use std::collections::BTreeMap;

use crate::format::{Affine, Scheme};
use crate::header::{Dtype, ShardHeader, TensorHeader};
use crate::transform::int4_ct::{BITS, GROUP, PER_WORD};

use super::error::PlanError;
use super::mlx::{ByName, Packed, part_src};

/// The config key of the block (transformers' `quantization_config`).
pub const KEY: &str = "quantization_config";
/// Its `quant_method`.
pub const METHOD: &str = "compressed-tensors";
/// The only `format` read: codes packed eight to an int32.
pub const FORMAT: &str = "pack-quantized";
/// A module's packed words, scales and logical shape: `P` + these.
pub const SUFFIXES: [&str; 3] = [".weight_packed", ".weight_scale", ".weight_shape"];

/// A compressed-tensors `pack-quantized` INT4 g32 symmetric source (checked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CtQuant;

fn cfg(field: &str, detail: String) -> PlanError {
    PlanError::Config {
        field: format!("{KEY}.{field}"),
        detail,
    }
}

/// The compressed-tensors block of `config`: `None` when `quantization_config` is
/// absent or names another `quant_method`. Every weight scheme of `config_groups`
/// must be the one gturbo keeps losslessly: 4-bit integers, group 32, symmetric.
pub fn read_ct(config: &serde_json::Value) -> Result<Option<CtQuant>, PlanError> {
    let Some(block) = config.get(KEY) else {
        return Ok(None);
    };
    if block.get("quant_method").and_then(|m| m.as_str()) != Some(METHOD) {
        return Ok(None);
    }
    match block.get("format") {
        Some(f) if f.as_str() == Some(FORMAT) => {}
        other => {
            return Err(cfg(
                "format",
                format!(
                    "{}; gturbo installs compressed-tensors `{FORMAT}` only",
                    other.map_or_else(|| "missing".to_string(), |v| v.to_string())
                ),
            ));
        }
    }
    let Some(groups) = block.get("config_groups").and_then(|g| g.as_object()) else {
        return Err(cfg("config_groups", "missing or not an object".into()));
    };
    for (g, v) in groups {
        let at = format!("config_groups.{g}.weights");
        let w = v
            .get("weights")
            .filter(|w| w.is_object())
            .ok_or_else(|| cfg(&at, "missing or not an object".into()))?;
        let want = [
            ("num_bits", serde_json::json!(BITS)),
            ("group_size", serde_json::json!(GROUP)),
            ("symmetric", serde_json::json!(true)),
            ("type", serde_json::json!("int")),
        ];
        for (k, expect) in want {
            let got = w.get(k);
            if got != Some(&expect) {
                return Err(cfg(
                    &format!("{at}.{k}"),
                    format!(
                        "{}; gturbo keeps {BITS}-bit group-{GROUP} symmetric integer \
                         codes (as MLX affine) only, expecting {expect}",
                        got.map_or_else(|| "missing".to_string(), |v| v.to_string())
                    ),
                ));
            }
        }
    }
    Ok(Some(CtQuant))
}

fn tensor_err(
    h: &[ShardHeader],
    si: usize,
    tensor: &str,
    field: &str,
    detail: String,
) -> PlanError {
    PlanError::Tensor {
        shard: h[si].shard.clone(),
        tensor: tensor.to_string(),
        field: field.into(),
        detail,
    }
}

/// Every `P.weight_packed` of the source as a module `P` (MLX affine 4-bit g32, its
/// biases derived from its scales), each checked; a packed weight in a source whose
/// config has no compressed-tensors block is refused naming the missing key.
pub(super) fn modules(
    headers: &[ShardHeader],
    by_name: &ByName<'_>,
    quant: Option<&CtQuant>,
) -> Result<BTreeMap<String, Packed>, PlanError> {
    let mut out = BTreeMap::new();
    for (&name, &(si, w)) in by_name {
        let Some(path) = name.strip_suffix(SUFFIXES[0]) else {
            continue;
        };
        if quant.is_none() {
            return Err(PlanError::Config {
                field: KEY.into(),
                detail: format!(
                    "missing or not `{METHOD}`, but `{name}` is compressed-tensors packed \
                     codes; the source needs its `{KEY}` block to say their scheme"
                ),
            });
        }
        let get = |suffix: &str| by_name.get(format!("{path}{suffix}").as_str()).copied();
        let (Some((ssi, s)), Some((hsi, shape))) = (get(SUFFIXES[1]), get(SUFFIXES[2])) else {
            return Err(tensor_err(
                headers,
                si,
                name,
                "name",
                format!(
                    "a compressed-tensors module has `{path}.weight_packed`, \
                     `{path}.weight_scale` and `{path}.weight_shape`; the source lacks one"
                ),
            ));
        };
        check(headers, name, (si, w), (ssi, s), (hsi, shape))?;
        let affine = Affine::new(BITS, GROUP as u32).expect("4-bit group 32 is an MLX layout");
        let scale = part_src(headers, ssi, s);
        out.insert(
            path.to_string(),
            Packed {
                scheme: Scheme::Affine(affine),
                parts: [part_src(headers, si, w), scale.clone(), scale],
                biases_from_scales: true,
            },
        );
    }
    Ok(out)
}

/// I32 words `[rows, words]`, BF16 scales `[rows, 8 × words / 32]`, I32 shape `[2]`.
fn check(
    headers: &[ShardHeader],
    name: &str,
    (si, w): (usize, &TensorHeader),
    (ssi, s): (usize, &TensorHeader),
    (hsi, shape): (usize, &TensorHeader),
) -> Result<(), PlanError> {
    if w.dtype != Dtype::I32 || w.shape.len() != 2 || w.shape.contains(&0) {
        return Err(tensor_err(
            headers,
            si,
            name,
            "dtype",
            format!(
                "{} {:?}; packed codes are I32 [rows, words]",
                w.dtype.name(),
                w.shape
            ),
        ));
    }
    let cols = w.shape[1] * PER_WORD as u64;
    let want = [w.shape[0], cols / GROUP as u64];
    if s.dtype != Dtype::BF16 || s.shape != want || !cols.is_multiple_of(GROUP as u64) {
        return Err(tensor_err(
            headers,
            ssi,
            &s.name,
            "shape",
            format!(
                "{} {:?}; the scales of `{name}` {:?} are BF16 {want:?} (one per {GROUP} \
                 columns)",
                s.dtype.name(),
                s.shape,
                w.shape
            ),
        ));
    }
    if shape.dtype != Dtype::I32 || shape.shape != [2] {
        return Err(tensor_err(
            headers,
            hsi,
            &shape.name,
            "shape",
            format!(
                "{} {:?}; a module's logical shape is I32 [2]",
                shape.dtype.name(),
                shape.shape
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cfg_with(weights: serde_json::Value) -> serde_json::Value {
        json!({"quantization_config": {"quant_method": METHOD, "format": FORMAT,
            "config_groups": {"group_0": {"weights": weights, "targets": ["Linear"]}}}})
    }

    fn good() -> serde_json::Value {
        json!({"num_bits": 4, "group_size": 32, "symmetric": true, "type": "int",
               "strategy": "group"})
    }

    fn shard(tensors: &[(&str, Dtype, &[u64])]) -> Vec<ShardHeader> {
        let mut at = 0u64;
        let tensors = tensors
            .iter()
            .map(|&(name, dtype, shape)| {
                let len = shape.iter().product::<u64>() * dtype.size();
                let t = TensorHeader {
                    name: name.into(),
                    dtype,
                    shape: shape.to_vec(),
                    data: at..at + len,
                };
                at += len;
                t
            })
            .collect();
        vec![ShardHeader {
            shard: "model.safetensors".into(),
            file_size: 8 + 64 + at,
            header_len: 64,
            tensors,
            metadata: BTreeMap::new(),
        }]
    }

    fn run(h: &[ShardHeader], q: Option<&CtQuant>) -> Result<BTreeMap<String, Packed>, PlanError> {
        let mut by_name: ByName<'_> = BTreeMap::new();
        for t in &h[0].tensors {
            by_name.insert(t.name.as_str(), (0, t));
        }
        modules(h, &by_name, q)
    }

    #[test]
    fn the_scheme_is_read_and_others_are_refused_naming_the_field() {
        assert_eq!(read_ct(&cfg_with(good())).unwrap(), Some(CtQuant));
        assert_eq!(read_ct(&json!({})).unwrap(), None);
        let err = |c: serde_json::Value| read_ct(&c).unwrap_err().to_string();
        let mut eight = good();
        eight["num_bits"] = json!(8);
        assert!(err(cfg_with(eight)).starts_with(
            "config.json: field `quantization_config.config_groups.group_0.weights.num_bits`: 8;"
        ));
        let mut asym = good();
        asym["symmetric"] = json!(false);
        assert!(err(cfg_with(asym)).contains("weights.symmetric`: false;"));
        let mut c = cfg_with(good());
        c["quantization_config"]["format"] = json!("marlin-24");
        assert!(err(c).starts_with(
            "config.json: field `quantization_config.format`: \"marlin-24\"; gturbo \
                 installs compressed-tensors `pack-quantized` only"
        ));
    }

    #[test]
    fn a_module_is_its_words_and_scales_checked_against_each_other() {
        let ok = shard(&[
            ("m.weight_packed", Dtype::I32, &[3, 12]),
            ("m.weight_scale", Dtype::BF16, &[3, 3]),
            ("m.weight_shape", Dtype::I32, &[2]),
        ]);
        let m = run(&ok, Some(&CtQuant)).unwrap();
        assert!(m["m"].biases_from_scales);
        assert_eq!(m["m"].scheme, Scheme::Affine(Affine::new(4, 32).unwrap()));
        let e = run(&ok, None).unwrap_err().to_string();
        assert!(
            e.contains("field `quantization_config`: missing or not"),
            "{e}"
        );
        let bad_scale = shard(&[
            ("m.weight_packed", Dtype::I32, &[3, 12]),
            ("m.weight_scale", Dtype::BF16, &[3, 2]),
            ("m.weight_shape", Dtype::I32, &[2]),
        ]);
        let e = run(&bad_scale, Some(&CtQuant)).unwrap_err().to_string();
        assert!(
            e.contains("tensor `m.weight_scale`: field `shape`: BF16 [3, 2]; the scales of"),
            "{e}"
        );
        let no_shape = shard(&[
            ("m.weight_packed", Dtype::I32, &[3, 12]),
            ("m.weight_scale", Dtype::BF16, &[3, 3]),
        ]);
        let e = run(&no_shape, Some(&CtQuant)).unwrap_err().to_string();
        assert!(e.contains("the source lacks one"), "{e}");
    }
}
