//! Pre-quantized MLX sources: what `config.json`'s `quantization` block says, and the
//! three tensors of each quantized module read as one logical matrix.
//!
//! mlx-lm's `convert` stores a quantized module `P` as `P.weight` (U32 words
//! `[.., out, in·bits/32]`), `P.scales` and `P.biases` (the model dtype,
//! `[.., out, in/group]`), and writes the widths into `config.json`:
//! `"quantization": {"bits": 4, "group_size": 64, "mode": "affine", "P": {"bits": 8,
//! "group_size": 64}, …}` (per-module entries only where a predicate chose other
//! settings, `false` where it chose none). gturbo installs those bytes unchanged: the
//! planner sees one logical `[.., out, in]` tensor at the module's [`Affine`] with
//! three source parts, and the executor copies each part into its stream of the
//! stored matrix (weights, scales, biases are laid out exactly as the format stores
//! them, see [`crate::format::sizes`]).
//!
//! Everything here is checked against the tensors before a plan exists: a width or
//! group MLX does not write, a block that disagrees with the shapes, or a packed width
//! that is not a whole number of codes is an error naming the file and the key.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::format::{Affine, Scheme};
use crate::header::{Dtype, ShardHeader, TensorHeader};

use super::error::PlanError;

/// The `quantization` block of an MLX checkpoint's `config.json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MlxQuant {
    /// The config key the block was read from (`quantization`, or
    /// `quantization_config` when only that one is present).
    pub key: String,
    /// The global width and group.
    pub global: Affine,
    /// Per-module entries: `Some` for a module at its own width and group, `None` for
    /// one the predicate left unquantized (`false`).
    pub modules: BTreeMap<String, Option<Affine>>,
}

/// How the source was quantized, as the plan and the manifest record it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceQuant {
    /// `mlx`.
    pub format: String,
    /// The global scheme (`int4_g64`).
    pub scheme: Scheme,
    /// Module path → scheme, for the modules the config names (unquantized ones as
    /// `passthrough`).
    pub modules: Vec<(String, Scheme)>,
}

impl MlxQuant {
    /// The block as the plan records it.
    pub fn record(&self) -> SourceQuant {
        SourceQuant {
            format: "mlx".into(),
            scheme: Scheme::Affine(self.global),
            modules: self
                .modules
                .iter()
                .map(|(k, v)| (k.clone(), v.map_or(Scheme::Passthrough, Scheme::Affine)))
                .collect(),
        }
    }

    /// The layout of module `path` (its own entry, under its name as stored or its
    /// normalised name, else the global one), with the config key it came from.
    fn lookup(&self, path: &str) -> (Option<Affine>, String) {
        let alt = crate::family::normalise_prefix(path);
        for p in std::iter::once(path).chain(alt.as_deref()) {
            if let Some(a) = self.modules.get(p) {
                return (*a, format!("{}.{p}", self.key));
            }
        }
        (Some(self.global), format!("{}.bits/group_size", self.key))
    }
}

fn cfg(field: String, detail: String) -> PlanError {
    PlanError::Config { field, detail }
}

/// The affine layout of one block entry (`{"bits", "group_size", "mode"?}`), `at` its
/// config path.
fn read_affine(v: &serde_json::Value, at: &str) -> Result<Affine, PlanError> {
    // mlx-lm 0.32's mixed predicates write `"group_size": null`: MLX then takes the
    // affine mode's default (`_defaults_for_mode`: 64 elements, 4 bits), as here.
    let num = |k: &str, default: u64| -> Result<u64, PlanError> {
        match v.get(k) {
            Some(serde_json::Value::Null) => Ok(default),
            Some(n) => n
                .as_u64()
                .ok_or_else(|| cfg(format!("{at}.{k}"), format!("{n} is not a whole number"))),
            None => Err(cfg(format!("{at}.{k}"), "missing".into())),
        }
    };
    if let Some(mode) = v.get("mode")
        && mode.as_str() != Some("affine")
    {
        return Err(cfg(
            format!("{at}.mode"),
            format!("{mode}; gturbo installs MLX's `affine` mode only"),
        ));
    }
    let (bits, group) = (num("bits", 4)?, num("group_size", 64)?);
    let fits = |n: u64| u32::try_from(n).ok();
    if fits(bits).is_none_or(|b| !Affine::BITS.contains(&b)) {
        return Err(cfg(
            format!("{at}.bits"),
            format!(
                "{bits} is not a width MLX writes (one of {:?})",
                Affine::BITS
            ),
        ));
    }
    if fits(group).is_none_or(|g| !Affine::GROUPS.contains(&g)) {
        return Err(cfg(
            format!("{at}.group_size"),
            format!(
                "{group} is not a group size MLX writes (one of {:?})",
                Affine::GROUPS
            ),
        ));
    }
    Ok(Affine::new(bits as u32, group as u32).expect("both checked just above"))
}

/// The `quantization` block of `config`, `None` for a source that is not
/// pre-quantized.
pub fn read_quant(config: &serde_json::Value) -> Result<Option<MlxQuant>, PlanError> {
    let Some((key, block)) = ["quantization", "quantization_config"]
        .into_iter()
        .find_map(|k| config.get(k).map(|v| (k, v)))
    else {
        return Ok(None);
    };
    let Some(obj) = block.as_object() else {
        return Err(cfg(key.into(), format!("{block} is not an object")));
    };
    // A transformers-style block (`quant_method`) is another format's: FP8
    // block-scaled sources are `super::fp8`'s, compressed-tensors INT4 ones
    // `super::int4_ct`'s, MXFP4 ones `super::mxfp4`'s, the rest are refused.
    if let Some(m) = obj.get("quant_method") {
        let theirs = ["fp8", super::int4_ct::METHOD, super::mxfp4::METHOD];
        if m.as_str().is_some_and(|m| theirs.contains(&m)) {
            return Ok(None);
        }
        return Err(cfg(
            format!("{key}.quant_method"),
            format!(
                "{m}: gturbo installs MLX-quantized sources (mlx-lm's `convert` output), \
                 FP8 e4m3 block-scaled ones (`\"fp8\"`), compressed-tensors INT4 \
                 (`\"{}\"`) and MXFP4 (`\"{}\"`) ones only",
                super::int4_ct::METHOD,
                super::mxfp4::METHOD
            ),
        ));
    }
    let global = read_affine(block, key)?;
    let mut modules = BTreeMap::new();
    for (k, v) in obj {
        if matches!(k.as_str(), "bits" | "group_size" | "mode") {
            continue;
        }
        let at = format!("{key}.{k}");
        let entry = match v {
            serde_json::Value::Bool(false) => None,
            serde_json::Value::Bool(true) => Some(global),
            serde_json::Value::Object(_) => Some(read_affine(v, &at)?),
            other => {
                return Err(cfg(
                    at,
                    format!("{other}: a module entry is {{\"bits\", \"group_size\"}} or a boolean"),
                ));
            }
        };
        modules.insert(k.clone(), entry);
    }
    Ok(Some(MlxQuant {
        key: key.into(),
        global,
        modules,
    }))
}

/// One source tensor of a pre-quantized module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct PartSrc {
    /// Name in the source.
    pub name: String,
    /// Index into the plan's shards.
    pub shard: usize,
    /// Dtype (U32 for the weights).
    pub dtype: Dtype,
    /// Shape as stored.
    pub shape: Vec<u64>,
    /// Absolute byte range in the shard file.
    pub src: [u64; 2],
}

/// A pre-quantized module: its layout and its three source tensors (weights, scales,
/// biases).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Packed {
    /// Its layout: an affine one, or MXFP4 ([`super::mxfp4`]).
    pub scheme: Scheme,
    /// Weights, scales, biases (an MXFP4 module has none: its third part repeats its
    /// scales and is never read).
    pub parts: [PartSrc; 3],
    /// A compressed-tensors module ([`super::int4_ct`]): its biases part is its
    /// scales, written as `−8 × scale` by the executor.
    pub biases_from_scales: bool,
}

/// A source tensor as the planner classifies it: a plain tensor, or the logical
/// `[.., out, in]` matrix of a pre-quantized module (named `P.weight`, dtype that of
/// its scales).
#[derive(Debug, Clone)]
pub(super) struct Source {
    /// Name in the source (`P.weight` for a module).
    pub name: String,
    /// Index into the plan's shards (the weights' for a module).
    pub shard: usize,
    /// Dtype.
    pub dtype: Dtype,
    /// Logical shape.
    pub shape: Vec<u64>,
    /// Absolute byte range (the weights' for a module).
    pub src: [u64; 2],
    /// The module's parts, when pre-quantized.
    pub packed: Option<Packed>,
    /// The block scales (`P.weight_scale_inv`) of an FP8 weight; the source is then
    /// the BF16 matrix it dequantizes to ([`super::fp8`]) and `src` its FP8 codes.
    pub fp8: Option<PartSrc>,
}

/// Every source tensor in (shard, offset) order, each quantized module of an MLX
/// source once, as its logical matrix, at the place of its weights, and each FP8
/// weight of an FP8 source once, as the BF16 matrix it dequantizes to, its
/// `weight_scale_inv` folded in.
pub(super) fn sources(
    headers: &[ShardHeader],
    quant: Option<&MlxQuant>,
    fp8: Option<&super::fp8::Fp8Quant>,
    ct: Option<&super::int4_ct::CtQuant>,
    mxfp4: Option<&super::mxfp4::Mxfp4Quant>,
) -> Result<Vec<Source>, PlanError> {
    let mut by_name: ByName<'_> = BTreeMap::new();
    for (si, h) in headers.iter().enumerate() {
        for t in &h.tensors {
            // Duplicates are the classify stage's to report, naming both shards.
            by_name.entry(t.name.as_str()).or_insert((si, t));
        }
    }
    // Modules: every `P.scales` of a pre-quantized source.
    let mut modules: BTreeMap<String, Packed> = BTreeMap::new();
    match quant {
        None => refuse_unlabelled_modules(&by_name)?,
        Some(q) => {
            for (name, &scales) in &by_name {
                let Some(path) = name.strip_suffix(".scales") else {
                    continue;
                };
                let module = Module {
                    headers,
                    by_name: &by_name,
                    path,
                    name,
                    scales,
                };
                modules.insert(path.to_string(), module.packed(q)?);
            }
        }
    }
    modules.extend(super::int4_ct::modules(headers, &by_name, ct)?);
    modules.extend(super::mxfp4::modules(headers, &by_name, mxfp4)?);
    let scaled = super::fp8::pairs(headers, &by_name, fp8)?;
    Ok(logical_sources(headers, &modules, scaled))
}

/// Every tensor of the shards by name, with its shard index (the first of a
/// duplicated name).
pub(super) type ByName<'h> = BTreeMap<&'h str, (usize, &'h TensorHeader)>;

/// Tensor `t` of shard `si` as a module part, its byte range absolute in the file.
pub(super) fn part_src(headers: &[ShardHeader], si: usize, t: &TensorHeader) -> PartSrc {
    PartSrc {
        name: t.name.clone(),
        shard: si,
        dtype: t.dtype,
        shape: t.shape.clone(),
        src: [
            headers[si].data_start() + t.data.start,
            headers[si].data_start() + t.data.end,
        ],
    }
}

/// Packed MLX modules with no block to say their widths: refused here, naming the
/// missing key, rather than later as tensors no family rule knows.
fn refuse_unlabelled_modules(by_name: &ByName<'_>) -> Result<(), PlanError> {
    let packed = by_name.keys().find_map(|name| {
        let path = name.strip_suffix(".scales")?;
        let (_, w) = by_name.get(format!("{path}.weight").as_str())?;
        (w.dtype == Dtype::U32).then_some(path)
    });
    match packed {
        Some(path) => Err(cfg(
            "quantization".into(),
            format!(
                "missing, but the source is MLX-quantized (`{path}.weight` is U32 \
                 packed codes with `{path}.scales`); a pre-quantized source needs \
                 its `quantization` block to say each module's bits and group size"
            ),
        )),
        None => Ok(()),
    }
}

/// One quantized module of a pre-quantized source, found by its `P.scales`.
struct Module<'a> {
    headers: &'a [ShardHeader],
    by_name: &'a ByName<'a>,
    /// `P`.
    path: &'a str,
    /// `P.scales`.
    name: &'a str,
    scales: (usize, &'a TensorHeader),
}

impl Module<'_> {
    fn err(&self, shard: usize, tensor: &str, field: &str, detail: String) -> PlanError {
        PlanError::Tensor {
            shard: self.headers[shard].shard.clone(),
            tensor: tensor.to_string(),
            field: field.into(),
            detail,
        }
    }

    /// The module's three tensors, checked against each other and against the widths
    /// the config's block gives it: weights, scales and biases present, the module
    /// quantized by the block, dtypes, shapes, and the packed width.
    fn packed(&self, q: &MlxQuant) -> Result<Packed, PlanError> {
        let (path, name, (si, t)) = (self.path, self.name, self.scales);
        let get = |suffix: &str| {
            self.by_name
                .get(format!("{path}.{suffix}").as_str())
                .copied()
        };
        let (Some((wsi, w)), Some((bsi, b))) = (get("weight"), get("biases")) else {
            return Err(self.err(
                si,
                name,
                "name",
                format!(
                    "a quantized module has `{path}.weight`, `{path}.scales` and \
                     `{path}.biases` ({} says affine); the source lacks one",
                    q.key
                ),
            ));
        };
        let (affine, key) = q.lookup(path);
        let Some(affine) = affine else {
            return Err(self.err(
                si,
                name,
                "name",
                format!(
                    "config.json `{key}` is false (not quantized), but the source has \
                     quantization scales for it"
                ),
            ));
        };
        self.check_dtypes((wsi, w), (bsi, b))?;
        self.check_widths(affine, &key, (wsi, w))?;
        Ok(Packed {
            scheme: Scheme::Affine(affine),
            parts: [
                part_src(self.headers, wsi, w),
                part_src(self.headers, si, t),
                part_src(self.headers, bsi, b),
            ],
            biases_from_scales: false,
        })
    }

    /// U32 packed weights, BF16 scales and biases, biases shaped as the scales.
    fn check_dtypes(
        &self,
        (wsi, w): (usize, &TensorHeader),
        (bsi, b): (usize, &TensorHeader),
    ) -> Result<(), PlanError> {
        let (path, name, (si, t)) = (self.path, self.name, self.scales);
        if w.dtype != Dtype::U32 {
            return Err(self.err(
                wsi,
                &format!("{path}.weight"),
                "dtype",
                format!(
                    "{}; a quantized module's packed weights are U32",
                    w.dtype.name()
                ),
            ));
        }
        if t.dtype != Dtype::BF16 || b.dtype != Dtype::BF16 {
            return Err(self.err(
                si,
                name,
                "dtype",
                format!(
                    "scales {} and biases {}; gturbo stores BF16 scales and biases \
                     (convert with --dtype bfloat16)",
                    t.dtype.name(),
                    b.dtype.name()
                ),
            ));
        }
        if b.shape != t.shape {
            return Err(self.err(
                bsi,
                &format!("{path}.biases"),
                "shape",
                format!("{:?}, but `{name}` is {:?}", b.shape, t.shape),
            ));
        }
        Ok(())
    }

    /// The packed weights pair with the scales (the same rows, one or more words per
    /// row), hold a whole number of `affine.bits()`-bit codes per row, and those
    /// columns are the scales' groups of `affine.group()` (config.json `key`).
    fn check_widths(
        &self,
        affine: Affine,
        key: &str,
        (wsi, w): (usize, &TensorHeader),
    ) -> Result<(), PlanError> {
        let (name, (si, t)) = (self.name, self.scales);
        let wname = format!("{}.weight", self.path);
        let (Some((&words, wlead)), Some((&groups, slead))) =
            (w.shape.split_last(), t.shape.split_last())
        else {
            return Err(self.err(
                wsi,
                &wname,
                "shape",
                "a quantized weight has at least one dimension".into(),
            ));
        };
        if wlead != slead || words == 0 {
            return Err(self.err(
                wsi,
                &wname,
                "shape",
                format!(
                    "{:?} does not pair with `{name}` {:?} (the same rows, one or more \
                     words per row)",
                    w.shape, t.shape
                ),
            ));
        }
        let bits = affine.bits() as u64;
        let Some(packed_bits) = words.checked_mul(32) else {
            return Err(self.err(wsi, &wname, "shape", format!("{:?} overflows", w.shape)));
        };
        if !packed_bits.is_multiple_of(bits) {
            return Err(self.err(
                wsi,
                &wname,
                "shape",
                format!(
                    "{words} u32 words per row are {packed_bits} bits, not a whole number \
                     of {bits}-bit codes (config.json `{key}`): the packed width is \
                     inconsistent with the bits"
                ),
            ));
        }
        let cols = packed_bits / bits;
        if groups.checked_mul(affine.group() as u64) != Some(cols) || !affine.fits(cols) {
            return Err(self.err(
                si,
                name,
                "shape",
                format!(
                    "{groups} groups of {} per row, but `{wname}` packs {cols} columns at \
                     {bits} bits: config.json `{key}` ({}) disagrees with the tensors' \
                     shapes",
                    affine.group(),
                    affine.label()
                ),
            ));
        }
        Ok(())
    }
}

/// Every tensor in (shard, offset) order as the planner sees it: a module's scales
/// and biases fold into its weights, which stand for the logical `[.., out, in]`
/// matrix (dtype that of its scales); an FP8 weight's scales (`scaled`, by the
/// weight's name) fold into it, which stands for its BF16 matrix.
fn logical_sources(
    headers: &[ShardHeader],
    modules: &BTreeMap<String, Packed>,
    mut scaled: BTreeMap<String, PartSrc>,
) -> Vec<Source> {
    let consumed = |name: &str| {
        [".weight", ".scales", ".biases"]
            .iter()
            .chain(&super::int4_ct::SUFFIXES)
            .chain(&super::mxfp4::SUFFIXES)
            .any(|s| {
                name.strip_suffix(s)
                    .is_some_and(|p| modules.contains_key(p))
            })
    };
    let scale_of = |name: &str| {
        name.strip_suffix(super::fp8::SCALE_SUFFIX)
            .is_some_and(|w| scaled.contains_key(w))
    };
    let scales: std::collections::BTreeSet<String> = headers
        .iter()
        .flat_map(|h| &h.tensors)
        .filter(|t| scale_of(&t.name))
        .map(|t| t.name.clone())
        .collect();
    let mut out = Vec::new();
    for (si, h) in headers.iter().enumerate() {
        for t in &h.tensors {
            let p = part_src(headers, si, t);
            if scales.contains(&t.name) {
                // Staged with its weight, never installed.
                continue;
            }
            if let Some(scale) = scaled.remove(&t.name) {
                out.push(Source {
                    name: p.name,
                    shard: si,
                    dtype: Dtype::BF16,
                    shape: p.shape,
                    src: p.src,
                    packed: None,
                    fp8: Some(scale),
                });
                continue;
            }
            if !consumed(&t.name) {
                out.push(Source {
                    name: p.name,
                    shard: si,
                    dtype: p.dtype,
                    shape: p.shape,
                    src: p.src,
                    packed: None,
                    fp8: None,
                });
                continue;
            }
            // A module is placed at its packed weights, named `P.weight`.
            let Some((path, packed)) = [
                ".weight",
                super::int4_ct::SUFFIXES[0],
                super::mxfp4::SUFFIXES[0],
            ]
            .iter()
            .filter_map(|s| t.name.strip_suffix(s))
            .find_map(|path| modules.get(path).map(|m| (path, m)))
            .filter(|(_, m)| m.parts[0].name == t.name) else {
                continue;
            };
            let mut shape = packed.parts[1].shape.clone();
            let groups = shape.pop().unwrap_or(0);
            shape.push(groups * packed.scheme.group().unwrap_or(0) as u64);
            out.push(Source {
                name: format!("{path}.weight"),
                shard: si,
                // The model dtype: an MLX module's scales are in it; MXFP4 modules
                // (U8 scales) come from BF16 checkpoints.
                dtype: match packed.scheme {
                    Scheme::Mxfp4 => Dtype::BF16,
                    _ => packed.parts[1].dtype,
                },
                shape,
                src: p.src,
                packed: Some(packed.clone()),
                fp8: None,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::header::TensorHeader;
    use serde_json::json;

    /// One shard holding `tensors` (name, dtype, shape), packed back to back.
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

    fn module(words: u64, groups: u64) -> Vec<ShardHeader> {
        shard(&[
            ("m.q.weight", Dtype::U32, &[8, words]),
            ("m.q.scales", Dtype::BF16, &[8, groups]),
            ("m.q.biases", Dtype::BF16, &[8, groups]),
            ("m.norm.weight", Dtype::BF16, &[64]),
        ])
    }

    fn err(config: serde_json::Value, headers: &[ShardHeader]) -> String {
        let q = match read_quant(&config) {
            Ok(q) => q,
            Err(e) => return e.to_string(),
        };
        sources(headers, q.as_ref(), None, None, None)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn a_module_is_one_logical_matrix_at_its_width() {
        let cfg = json!({"quantization": {"bits": 4, "group_size": 64, "mode": "affine",
            "m.q": {"bits": 8, "group_size": 32}}});
        let q = read_quant(&cfg).unwrap().unwrap();
        // 128 columns at 8 bits: 32 words; groups of 32: 4 scales per row.
        let s = sources(&module(32, 4), Some(&q), None, None, None).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(
            (s[0].name.as_str(), s[0].dtype),
            ("m.q.weight", Dtype::BF16)
        );
        assert_eq!(s[0].shape, vec![8, 128]);
        let p = s[0].packed.as_ref().unwrap();
        assert_eq!(p.scheme, Scheme::Affine(Affine::new(8, 32).unwrap()));
        assert_eq!(
            p.parts.each_ref().map(|p| p.name.as_str()),
            ["m.q.weight", "m.q.scales", "m.q.biases"]
        );
        assert!(s[1].packed.is_none());
        assert_eq!(
            q.record().modules,
            vec![(
                "m.q".to_string(),
                Scheme::Affine(Affine::new(8, 32).unwrap())
            )]
        );
        // mlx-lm 0.32's mixed predicates write a null group: MLX's affine default, 64.
        let cfg = json!({"quantization": {"bits": 4, "group_size": 128,
            "m.q": {"bits": 6, "group_size": null, "mode": "affine"}}});
        let q = read_quant(&cfg).unwrap().unwrap();
        let s = sources(&module(24, 2), Some(&q), None, None, None).unwrap();
        assert_eq!(
            s[0].packed.as_ref().unwrap().scheme,
            Scheme::Affine(Affine::new(6, 64).unwrap())
        );
        // No block: not pre-quantized.
        assert_eq!(read_quant(&json!({"model_type": "llama"})).unwrap(), None);
        // No block over packed modules: refused, naming the missing key.
        let e = sources(&module(8, 1), None, None, None, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("config.json: field `quantization`: missing, but the source is MLX-quantized (`m.q.weight` is U32"),
            "{e}"
        );
    }

    #[test]
    fn hostile_blocks_name_the_file_and_the_key() {
        let ok = module(8, 1);
        assert_eq!(
            err(json!({"quantization": {"bits": 7, "group_size": 64}}), &ok),
            "config.json: field `quantization.bits`: 7 is not a width MLX writes (one of [2, 3, 4, 5, 6, 8])"
        );
        assert_eq!(
            err(json!({"quantization": {"bits": 4, "group_size": 48}}), &ok),
            "config.json: field `quantization.group_size`: 48 is not a group size MLX writes (one of [32, 64, 128])"
        );
        assert_eq!(
            err(
                json!({"quantization": {"bits": 4, "group_size": 64, "m.q": {"bits": 7, "group_size": 64}}}),
                &ok
            ),
            "config.json: field `quantization.m.q.bits`: 7 is not a width MLX writes (one of [2, 3, 4, 5, 6, 8])"
        );
        assert!(
            err(json!({"quantization": {"bits": 4, "group_size": 32, "mode": "mxfp4"}}), &ok)
                .starts_with("config.json: field `quantization.mode`: \"mxfp4\"; gturbo installs MLX's `affine` mode only")
        );
        // Another format's block is refused by name; an FP8 one is not MLX's to read.
        let e = err(
            json!({"quantization_config": {"quant_method": "gptq"}}),
            &ok,
        );
        assert!(
            e.starts_with("config.json: field `quantization_config.quant_method`: \"gptq\": gturbo installs MLX-quantized sources"),
            "{e}"
        );
        assert_eq!(
            read_quant(&json!({"quantization_config": {"quant_method": "fp8"}})).unwrap(),
            None
        );
        assert_eq!(
            err(json!({"quantization": {"group_size": 64}}), &ok),
            "config.json: field `quantization.bits`: missing"
        );
        // The block says 4 bits g64: 8 words are 64 columns, but there are 2 groups.
        let e = err(
            json!({"quantization": {"bits": 4, "group_size": 64}}),
            &module(8, 2),
        );
        assert!(e.starts_with("model.safetensors: tensor `m.q.scales`: field `shape`: 2 groups of 64 per row, but `m.q.weight` packs 64 columns at 4 bits: config.json `quantization.bits/group_size` (int4_g64) disagrees with the tensors' shapes"), "{e}");
        // A per-module entry is named as the key.
        let e = err(
            json!({"quantization": {"bits": 4, "group_size": 64, "m.q": {"bits": 8, "group_size": 64}}}),
            &ok,
        );
        assert!(
            e.contains("config.json `quantization.m.q` (int8_g64) disagrees"),
            "{e}"
        );
        // 1 word per row is 32 bits: not a whole number of 3-bit codes.
        let e = err(
            json!({"quantization": {"bits": 3, "group_size": 32}}),
            &module(1, 1),
        );
        assert_eq!(
            e,
            "model.safetensors: tensor `m.q.weight`: field `shape`: 1 u32 words per row are 32 bits, not a whole number of 3-bit codes (config.json `quantization.bits/group_size`): the packed width is inconsistent with the bits"
        );
        // Packed weights that are not U32, scales without biases.
        let h = shard(&[
            ("m.q.weight", Dtype::BF16, &[8, 8]),
            ("m.q.scales", Dtype::BF16, &[8, 1]),
            ("m.q.biases", Dtype::BF16, &[8, 1]),
        ]);
        let e = err(json!({"quantization": {"bits": 4, "group_size": 64}}), &h);
        assert!(e.contains("tensor `m.q.weight`: field `dtype`: BF16; a quantized module's packed weights are U32"), "{e}");
        let h = shard(&[
            ("m.q.weight", Dtype::U32, &[8, 8]),
            ("m.q.scales", Dtype::BF16, &[8, 1]),
        ]);
        let e = err(json!({"quantization": {"bits": 4, "group_size": 64}}), &h);
        assert!(
            e.contains("tensor `m.q.scales`: field `name`: a quantized module has"),
            "{e}"
        );
        let e = err(
            json!({"quantization": {"bits": 4, "group_size": 64, "m.q": false}}),
            &ok,
        );
        assert!(e.contains("`quantization.m.q` is false"), "{e}");
    }
}
