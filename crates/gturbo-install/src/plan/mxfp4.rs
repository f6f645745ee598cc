//! MXFP4 sources (gpt-oss's routed experts): what `config.json`'s
//! `quantization_config` says, and each `P_blocks` found with its `P_scales` as one
//! module kept in MLX's `mxfp4` layout ([`crate::format::Scheme::Mxfp4`]).
//!
//! gpt-oss stores a projection `P` of every expert as `P_blocks` U8 `[.., rows,
//! cols / 32, 16]` (32 E2M1 codes in 16 bytes per group, low nibble first) and
//! `P_scales` U8 `[.., rows, cols / 32]` (E8M0), under `"quantization_config":
//! {"quant_method": "mxfp4", "modules_to_not_convert": [...]}` (transformers'
//! `Mxfp4Config`). MLX-LM's `gpt_oss.py` `sanitize` views the blocks as U32 and
//! flattens the last two axes (`v.view(mx.uint32).flatten(-2)`): the bytes are MLX's
//! `mxfp4` weights unchanged, and the scales are its scales. So the planner sees one
//! logical `[.., rows, cols]` matrix `P.weight` at `mxfp4_g32` whose two source parts
//! are copied as they are (no requantization, no loss), and whose third stream
//! (biases) does not exist. At a profile that does not keep 4-bit sources the module
//! is dequantized instead ([`crate::format::mxfp4`]) and the profile applies to the
//! BF16 it gives.
//!
//! Everything is checked from the headers before a plan exists: blocks without scales
//! (or the reverse), dtypes other than U8, and shapes that do not pair are errors
//! naming the file, the tensor and the field. Scale bytes of `0xFF` (E8M0's NaN) are
//! found by the executor as the bytes stream, naming the tensor.

use std::collections::BTreeMap;

use crate::format::Scheme;
use crate::format::sizes::MXFP4_GROUP;
use crate::header::{Dtype, ShardHeader, TensorHeader};

use super::error::PlanError;
use super::mlx::{ByName, Packed, part_src};

/// The config key of the block (transformers' `quantization_config`).
pub const KEY: &str = "quantization_config";
/// Its `quant_method`.
pub const METHOD: &str = "mxfp4";
/// A module's codes and scales: `P` + these.
pub const SUFFIXES: [&str; 2] = ["_blocks", "_scales"];
/// Bytes of one group of codes: 32 four-bit codes.
const GROUP_BYTES: u64 = MXFP4_GROUP / 2;

/// An MXFP4 source's `quantization_config` (checked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mxfp4Quant {
    /// `modules_to_not_convert`: the modules the checkpoint keeps in BF16 (recorded;
    /// which modules are MXFP4 is read from the tensors themselves).
    pub not_converted: Vec<String>,
}

fn cfg(field: &str, detail: String) -> PlanError {
    PlanError::Config {
        field: format!("{KEY}.{field}"),
        detail,
    }
}

/// The MXFP4 block of `config`: `None` when `quantization_config` is absent or names
/// another `quant_method`. `modules_to_not_convert`, when present, is a list of
/// strings.
pub fn read_mxfp4(config: &serde_json::Value) -> Result<Option<Mxfp4Quant>, PlanError> {
    let Some(block) = config.get(KEY) else {
        return Ok(None);
    };
    if block.get("quant_method").and_then(|m| m.as_str()) != Some(METHOD) {
        return Ok(None);
    }
    let not_converted = match block.get("modules_to_not_convert") {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(serde_json::Value::Array(v)) => v
            .iter()
            .map(|m| m.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                cfg(
                    "modules_to_not_convert",
                    "a list of module names (strings)".into(),
                )
            })?,
        Some(other) => {
            return Err(cfg(
                "modules_to_not_convert",
                format!("{other}: a list of module names (strings)"),
            ));
        }
    };
    Ok(Some(Mxfp4Quant { not_converted }))
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

/// Every `P_blocks` of the source as a module `P` at `mxfp4_g32`, each checked; blocks
/// in a source whose config has no MXFP4 block are refused naming the missing key.
/// The blocks part is seen as `[.., rows, cols / 2]` bytes (its last two axes
/// flattened, as MLX-LM's `sanitize` does), so one part row is one matrix row.
pub(super) fn modules(
    headers: &[ShardHeader],
    by_name: &ByName<'_>,
    quant: Option<&Mxfp4Quant>,
) -> Result<BTreeMap<String, Packed>, PlanError> {
    let mut out = BTreeMap::new();
    for (&name, &(si, b)) in by_name {
        let Some(path) = name.strip_suffix(SUFFIXES[0]) else {
            continue;
        };
        if quant.is_none() {
            return Err(PlanError::Config {
                field: KEY.into(),
                detail: format!(
                    "missing or not `{METHOD}`, but `{name}` looks like MXFP4 codes; the \
                     source needs `\"{KEY}\": {{\"quant_method\": \"{METHOD}\"}}` to say so"
                ),
            });
        }
        let Some(&(ssi, s)) = by_name.get(format!("{path}{}", SUFFIXES[1]).as_str()) else {
            return Err(tensor_err(
                headers,
                si,
                name,
                "name",
                format!(
                    "an MXFP4 module has `{path}{}` and `{path}{}`; the source lacks the \
                     scales",
                    SUFFIXES[0], SUFFIXES[1]
                ),
            ));
        };
        check(headers, (si, b), (ssi, s))?;
        let mut blocks = part_src(headers, si, b);
        let groups = blocks.shape[blocks.shape.len() - 2];
        blocks.shape.truncate(blocks.shape.len() - 2);
        blocks.shape.push(groups * GROUP_BYTES);
        let scales = part_src(headers, ssi, s);
        out.insert(
            path.to_string(),
            Packed {
                scheme: Scheme::Mxfp4,
                parts: [blocks, scales.clone(), scales],
                biases_from_scales: false,
            },
        );
    }
    // Scales without blocks: codes missing, not a tensor to install on its own.
    if quant.is_some()
        && let Some((&n, &(si, _))) = by_name.iter().find(|(n, _)| {
            n.strip_suffix(SUFFIXES[1])
                .is_some_and(|p| !out.contains_key(p))
        })
    {
        return Err(tensor_err(
            headers,
            si,
            n,
            "name",
            format!(
                "MXFP4 scales without their codes: the source has no `{}{}`",
                n.trim_end_matches(SUFFIXES[1]),
                SUFFIXES[0]
            ),
        ));
    }
    Ok(out)
}

/// U8 blocks `[.., rows, groups, 16]` and U8 scales `[.., rows, groups]`, no empty axis.
fn check(
    headers: &[ShardHeader],
    (si, b): (usize, &TensorHeader),
    (ssi, s): (usize, &TensorHeader),
) -> Result<(), PlanError> {
    let n = b.shape.len();
    if b.dtype != Dtype::U8 || n < 3 || b.shape[n - 1] != GROUP_BYTES || b.shape.contains(&0) {
        return Err(tensor_err(
            headers,
            si,
            &b.name,
            "shape",
            format!(
                "{} {:?}; MXFP4 codes are U8 [.., rows, cols / {MXFP4_GROUP}, {GROUP_BYTES}]",
                b.dtype.name(),
                b.shape
            ),
        ));
    }
    if s.dtype != Dtype::U8 || s.shape[..] != b.shape[..n - 1] {
        return Err(tensor_err(
            headers,
            ssi,
            &s.name,
            "shape",
            format!(
                "{} {:?}; the scales of `{}` {:?} are U8 {:?} (one per {MXFP4_GROUP} \
                 columns)",
                s.dtype.name(),
                s.shape,
                b.name,
                b.shape,
                &b.shape[..n - 1]
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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

    fn run(
        h: &[ShardHeader],
        q: Option<&Mxfp4Quant>,
    ) -> Result<BTreeMap<String, Packed>, PlanError> {
        let mut by_name: ByName<'_> = BTreeMap::new();
        for t in &h[0].tensors {
            by_name.insert(t.name.as_str(), (0, t));
        }
        modules(h, &by_name, q)
    }

    #[test]
    fn the_block_is_read_and_its_list_checked() {
        let c = json!({"quantization_config": {"quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}});
        assert_eq!(
            read_mxfp4(&c).unwrap().unwrap().not_converted,
            ["model.layers.*.self_attn", "lm_head"]
        );
        assert_eq!(read_mxfp4(&json!({})).unwrap(), None);
        assert_eq!(
            read_mxfp4(&json!({"quantization_config": {"quant_method": "fp8"}})).unwrap(),
            None
        );
        let bad = json!({"quantization_config": {"quant_method": "mxfp4",
            "modules_to_not_convert": "lm_head"}});
        assert!(read_mxfp4(&bad).unwrap_err().to_string().starts_with(
            "config.json: field `quantization_config.modules_to_not_convert`: \"lm_head\""
        ));
    }

    #[test]
    fn a_module_is_its_blocks_and_scales_checked_against_each_other() {
        let q = Mxfp4Quant {
            not_converted: vec![],
        };
        let ok = shard(&[
            ("e.gate_up_proj_blocks", Dtype::U8, &[4, 6, 2, 16]),
            ("e.gate_up_proj_scales", Dtype::U8, &[4, 6, 2]),
        ]);
        let m = run(&ok, Some(&q)).unwrap();
        let p = &m["e.gate_up_proj"];
        assert_eq!(p.scheme, Scheme::Mxfp4);
        assert_eq!(p.parts[0].shape, [4, 6, 32], "last two axes flattened");
        assert_eq!(p.parts[1].shape, [4, 6, 2]);
        let e = run(&ok, None).unwrap_err().to_string();
        assert!(
            e.contains("field `quantization_config`: missing or not `mxfp4`"),
            "{e}"
        );
        let bad = shard(&[
            ("e.p_blocks", Dtype::U8, &[4, 6, 2, 16]),
            ("e.p_scales", Dtype::U8, &[4, 6, 3]),
        ]);
        let e = run(&bad, Some(&q)).unwrap_err().to_string();
        assert!(
            e.contains("tensor `e.p_scales`: field `shape`: U8 [4, 6, 3]; the scales of"),
            "{e}"
        );
        let wide = shard(&[
            ("e.p_blocks", Dtype::U8, &[4, 6, 2, 32]),
            ("e.p_scales", Dtype::U8, &[4, 6, 2]),
        ]);
        let e = run(&wide, Some(&q)).unwrap_err().to_string();
        assert!(
            e.contains("MXFP4 codes are U8 [.., rows, cols / 32, 16]"),
            "{e}"
        );
        let lone = shard(&[("e.p_blocks", Dtype::U8, &[4, 6, 2, 16])]);
        let e = run(&lone, Some(&q)).unwrap_err().to_string();
        assert!(e.contains("the source lacks the scales"), "{e}");
        let orphan = shard(&[("e.p_scales", Dtype::U8, &[4, 6, 2])]);
        let e = run(&orphan, Some(&q)).unwrap_err().to_string();
        assert!(e.contains("has no `e.p_blocks`"), "{e}");
    }
}
