//! FP8 e4m3 block-scaled sources (DeepSeek-V3/R1, Kimi-K2, MiniMax-M2): what
//! `config.json`'s `quantization_config` says, and each FP8 weight paired with its
//! `weight_scale_inv`.
//!
//! Such a checkpoint stores a linear weight `P.weight` as F8_E4M3 `[rows, cols]` and
//! `P.weight_scale_inv` as F32 `[ceil(rows/128), ceil(cols/128)]`, possibly in another
//! shard, under `"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
//! "weight_block_size": [128, 128]}`. The planner sees the pair as one unit, the
//! logical BF16 matrix it dequantizes to (MLX-LM's `sanitize`, see
//! [`crate::transform::fp8`]), placed like any BF16 tensor of the source: the profile
//! applies to it exactly as to a BF16 checkpoint's. The scale is staged by the
//! executor for the rows each read covers, and never installed.
//!
//! Everything here is checked against the headers before a plan exists: a block that
//! is not e4m3 at 128×128, an FP8 weight without its scale, a scale without its weight,
//! or a scale of the wrong dtype or shape is an error naming the file, the tensor and
//! the field.

use std::collections::BTreeMap;

use crate::header::{Dtype, ShardHeader, TensorHeader};
use crate::transform::fp8::{BLOCK, blocks};

use super::error::PlanError;
use super::mlx::{ByName, PartSrc, part_src};

/// The config key of the block (transformers' `quantization_config`).
pub const KEY: &str = "quantization_config";

/// The suffix of a weight's block scales (`P.weight` → `P.weight_scale_inv`).
pub const SCALE_SUFFIX: &str = "_scale_inv";

/// The spellings of e4m3 a `fmt` field takes: DeepSeek-V3 writes `e4m3`, others
/// PyTorch's dtype name.
const E4M3: [&str; 2] = ["e4m3", "float8_e4m3fn"];

/// An FP8 block-scaled source's `quantization_config` (checked: e4m3, 128×128).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fp8Quant;

fn cfg(field: &str, detail: String) -> PlanError {
    PlanError::Config {
        field: format!("{KEY}.{field}"),
        detail,
    }
}

/// The FP8 block of `config`: `None` when `quantization_config` is absent or names
/// another `quant_method` (those are [`super::mlx::read_quant`]'s to refuse).
pub fn read_fp8(config: &serde_json::Value) -> Result<Option<Fp8Quant>, PlanError> {
    let Some(block) = config.get(KEY) else {
        return Ok(None);
    };
    if block.get("quant_method").and_then(|m| m.as_str()) != Some("fp8") {
        return Ok(None);
    }
    match block.get("fmt") {
        // transformers' FineGrainedFP8Config has no `fmt`: e4m3 is its only format.
        None => {}
        Some(f) if f.as_str().is_some_and(|s| E4M3.contains(&s)) => {}
        Some(f) => {
            return Err(cfg(
                "fmt",
                format!("{f}; gturbo installs FP8 sources in e4m3 (one of {E4M3:?}) only"),
            ));
        }
    }
    match block.get("weight_block_size") {
        // FineGrainedFP8Config's default, and the only block MLX-LM's `sanitize`
        // dequantizes (`bs = 128`).
        None => {}
        Some(v) if *v == serde_json::json!([BLOCK, BLOCK]) => {}
        Some(v) => {
            return Err(cfg(
                "weight_block_size",
                format!("{v}; gturbo dequantizes blocks of [{BLOCK}, {BLOCK}] only"),
            ));
        }
    }
    Ok(Some(Fp8Quant))
}

fn tensor_err(
    headers: &[ShardHeader],
    si: usize,
    tensor: &str,
    field: &str,
    detail: String,
) -> PlanError {
    PlanError::Tensor {
        shard: headers[si].shard.clone(),
        tensor: tensor.to_string(),
        field: field.into(),
        detail,
    }
}

/// Every FP8 weight of the source with its `weight_scale_inv`, by the weight's name,
/// each pair checked; empty for a source that is not FP8.
pub(super) fn pairs(
    headers: &[ShardHeader],
    by_name: &ByName<'_>,
    quant: Option<&Fp8Quant>,
) -> Result<BTreeMap<String, PartSrc>, PlanError> {
    let mut out = BTreeMap::new();
    for (&name, &(si, s)) in by_name {
        let Some(wname) = name.strip_suffix(SCALE_SUFFIX) else {
            continue;
        };
        let Some(&(wsi, w)) = by_name.get(wname) else {
            return Err(tensor_err(
                headers,
                si,
                name,
                "name",
                format!("a block scale without its weight: the source has no `{wname}`"),
            ));
        };
        if quant.is_none() {
            return Err(unlabelled(wname, w, name));
        }
        check_pair(headers, (wsi, w), (si, s))?;
        out.insert(wname.to_string(), part_src(headers, si, s));
    }
    // Every FP8 weight comes with its scale: a code without one has no value.
    let lone = by_name
        .iter()
        .find(|(n, (_, t))| t.dtype == Dtype::F8_E4M3 && !out.contains_key(**n));
    if let (Some(_), Some((&n, &(si, _)))) = (quant, lone) {
        return Err(tensor_err(
            headers,
            si,
            n,
            "name",
            format!(
                "an FP8 e4m3 weight comes with its block scales `{n}{SCALE_SUFFIX}` \
                 (config.json `{KEY}.quant_method` is \"fp8\"); the source lacks them"
            ),
        ));
    }
    Ok(out)
}

/// Weight `wname` has block scales `name` but config.json has no FP8 block.
fn unlabelled(wname: &str, w: &TensorHeader, name: &str) -> PlanError {
    let block = r#"{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}"#;
    PlanError::Config {
        field: KEY.into(),
        detail: format!(
            "missing, but the source is FP8 block-scaled (`{wname}` is {} with `{name}`); \
             an FP8 source needs `\"{KEY}\": {block}`",
            w.dtype.name()
        ),
    }
}

/// An FP8 weight `[rows, cols]` and its F32 scales `[ceil(rows/128), ceil(cols/128)]`.
fn check_pair(
    headers: &[ShardHeader],
    (wsi, w): (usize, &TensorHeader),
    (si, s): (usize, &TensorHeader),
) -> Result<(), PlanError> {
    if w.dtype != Dtype::F8_E4M3 {
        return Err(tensor_err(
            headers,
            wsi,
            &w.name,
            "dtype",
            format!(
                "{}; a weight with block scales `{}` is F8_E4M3",
                w.dtype.name(),
                s.name
            ),
        ));
    }
    let &[rows, cols] = w.shape.as_slice() else {
        return Err(tensor_err(
            headers,
            wsi,
            &w.name,
            "shape",
            format!(
                "{:?}: an FP8 block-scaled weight is 2-D [rows, cols]",
                w.shape
            ),
        ));
    };
    if rows == 0 || cols == 0 {
        return Err(tensor_err(
            headers,
            wsi,
            &w.name,
            "shape",
            format!(
                "{:?}: an FP8 block-scaled weight has no empty axis",
                w.shape
            ),
        ));
    }
    if s.dtype != Dtype::F32 {
        return Err(tensor_err(
            headers,
            si,
            &s.name,
            "dtype",
            format!("{}; block scales are F32", s.dtype.name()),
        ));
    }
    let want = [blocks(rows), blocks(cols)];
    if s.shape != want {
        return Err(tensor_err(
            headers,
            si,
            &s.name,
            "shape",
            format!(
                "{:?}, but `{}` {:?} in blocks of {BLOCK}×{BLOCK} has {want:?}",
                s.shape, w.name, w.shape
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Shards holding `tensors` (shard, name, dtype, shape), each shard's packed back
    /// to back.
    fn shards(tensors: &[(usize, &str, Dtype, &[u64])]) -> Vec<ShardHeader> {
        let n = tensors.iter().map(|t| t.0).max().unwrap_or(0) + 1;
        (0..n)
            .map(|si| {
                let mut at = 0u64;
                let tensors: Vec<TensorHeader> = tensors
                    .iter()
                    .filter(|t| t.0 == si)
                    .map(|&(_, name, dtype, shape)| {
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
                ShardHeader {
                    shard: format!("model-{:05}-of-{n:05}.safetensors", si + 1),
                    file_size: 8 + 64 + at,
                    header_len: 64,
                    tensors,
                    metadata: BTreeMap::new(),
                }
            })
            .collect()
    }

    fn cfg() -> serde_json::Value {
        json!({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
            "activation_scheme": "dynamic", "weight_block_size": [128, 128]}})
    }

    fn run(
        config: &serde_json::Value,
        h: &[ShardHeader],
    ) -> Result<Vec<super::super::mlx::Source>, PlanError> {
        let fp8 = read_fp8(config)?;
        super::super::mlx::sources(h, None, fp8.as_ref(), None, None)
    }

    #[test]
    fn a_weight_and_its_scale_in_another_shard_are_one_bf16_unit() {
        let h = shards(&[
            (0, "m.q.weight", Dtype::F8_E4M3, &[300, 200]),
            (0, "m.norm.weight", Dtype::BF16, &[200]),
            (1, "m.q.weight_scale_inv", Dtype::F32, &[3, 2]),
            (1, "m.gate.e_score_correction_bias", Dtype::F32, &[8]),
        ]);
        let s = run(&cfg(), &h).unwrap();
        let names: Vec<&str> = s.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "m.q.weight",
                "m.norm.weight",
                "m.gate.e_score_correction_bias"
            ]
        );
        // The unit is the BF16 matrix it dequantizes to; its bytes are the FP8 codes.
        assert_eq!(
            (s[0].dtype, s[0].shape.as_slice()),
            (Dtype::BF16, &[300u64, 200][..])
        );
        assert_eq!(s[0].src[1] - s[0].src[0], 300 * 200);
        let scale = s[0].fp8.as_ref().unwrap();
        assert_eq!(
            (scale.name.as_str(), scale.shard),
            ("m.q.weight_scale_inv", 1)
        );
        assert_eq!(scale.src[1] - scale.src[0], 3 * 2 * 4);
        // F32 stays F32.
        assert_eq!(s[2].dtype, Dtype::F32);
        assert!(s[1].fp8.is_none() && s[2].fp8.is_none());
        // Other spellings of the block.
        for block in [
            json!({"quant_method": "fp8", "fmt": "float8_e4m3fn", "weight_block_size": [128, 128]}),
            json!({"quant_method": "fp8"}),
        ] {
            assert_eq!(
                read_fp8(&json!({"quantization_config": block})).unwrap(),
                Some(Fp8Quant)
            );
        }
        assert_eq!(read_fp8(&json!({"model_type": "llama"})).unwrap(), None);
    }

    #[test]
    fn hostile_fp8_sources_name_the_tensor_and_the_field() {
        let err = |c: serde_json::Value, t: &[(usize, &str, Dtype, &[u64])]| {
            run(&c, &shards(t)).unwrap_err().to_string()
        };
        let ok: &[(usize, &str, Dtype, &[u64])] = &[
            (0, "m.q.weight", Dtype::F8_E4M3, &[300, 200]),
            (0, "m.q.weight_scale_inv", Dtype::F32, &[3, 2]),
        ];
        assert_eq!(
            err(
                json!({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}),
                ok
            ),
            "config.json: field `quantization_config.fmt`: \"e5m2\"; gturbo installs FP8 sources in e4m3 (one of [\"e4m3\", \"float8_e4m3fn\"]) only"
        );
        assert_eq!(
            err(
                json!({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}),
                ok
            ),
            "config.json: field `quantization_config.weight_block_size`: [64,64]; gturbo dequantizes blocks of [128, 128] only"
        );
        let e = err(json!({}), ok);
        assert!(
            e.starts_with("config.json: field `quantization_config`: missing, but the source is FP8 block-scaled (`m.q.weight` is F8_E4M3 with `m.q.weight_scale_inv`)"),
            "{e}"
        );
        let e = err(cfg(), &[(0, "m.q.weight", Dtype::F8_E4M3, &[300, 200])]);
        assert_eq!(
            e,
            "model-00001-of-00001.safetensors: tensor `m.q.weight`: field `name`: an FP8 e4m3 weight comes with its block scales `m.q.weight_scale_inv` (config.json `quantization_config.quant_method` is \"fp8\"); the source lacks them"
        );
        let e = err(cfg(), &[(1, "m.q.weight_scale_inv", Dtype::F32, &[3, 2])]);
        assert!(
            e.starts_with("model-00002-of-00002.safetensors: tensor `m.q.weight_scale_inv`: field `name`: a block scale without its weight"),
            "{e}"
        );
        let e = err(
            cfg(),
            &[
                (0, "m.q.weight", Dtype::F8_E4M3, &[300, 200]),
                (1, "m.q.weight_scale_inv", Dtype::F32, &[2, 2]),
            ],
        );
        assert_eq!(
            e,
            "model-00002-of-00002.safetensors: tensor `m.q.weight_scale_inv`: field `shape`: [2, 2], but `m.q.weight` [300, 200] in blocks of 128×128 has [3, 2]"
        );
        let e = err(
            cfg(),
            &[
                (0, "m.q.weight", Dtype::F8_E4M3, &[300, 200]),
                (0, "m.q.weight_scale_inv", Dtype::BF16, &[3, 2]),
            ],
        );
        assert!(
            e.contains("tensor `m.q.weight_scale_inv`: field `dtype`: BF16; block scales are F32"),
            "{e}"
        );
        let e = err(
            cfg(),
            &[
                (0, "m.q.weight", Dtype::BF16, &[300, 200]),
                (0, "m.q.weight_scale_inv", Dtype::F32, &[3, 2]),
            ],
        );
        assert!(
            e.contains("tensor `m.q.weight`: field `dtype`: BF16; a weight with block scales"),
            "{e}"
        );
        let e = err(
            cfg(),
            &[
                (0, "m.q.weight", Dtype::F8_E4M3, &[2, 300, 200]),
                (0, "m.q.weight_scale_inv", Dtype::F32, &[2, 3, 2]),
            ],
        );
        assert!(e.contains("tensor `m.q.weight`: field `shape`: [2, 300, 200]: an FP8 block-scaled weight is 2-D"), "{e}");
    }
}
