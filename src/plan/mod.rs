//! What goes where: the install plan, built from the family rules, `config.json` and
//! the validated shard headers alone, before a byte of weights moves.
//!
//! The plan gives every tensor its role, scheme and output placement (resident entry,
//! expert pool slot, row pool region, or exclusion), sizes every output file exactly
//! with the [`crate::format`] types (so a dry run and a real install cannot disagree),
//! coalesces source byte ranges into large reads ([`coalesce`]), and has a fingerprint:
//! the SHA-256 of its canonical JSON.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::family::{Family, Role};
use crate::format::resident::{ResidentInput, ResidentLayout};
use crate::format::{PAGE, QuantSizes, RowBlocks, Scheme, align_up, row_bytes};
use crate::header::{Dtype, ShardHeader};

pub mod coalesce;
pub mod placement;

pub use crate::format::pools::{BlobPart, ExpertPart, ExpertPool, RowPool, RowShard};

/// Version of the plan's canonical form (part of the fingerprint).
pub const PLAN_SCHEMA: u32 = 1;

/// Files copied verbatim into `tokenizer/` when the repo has them.
pub const COPIED_FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
];

/// Which weights get quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum QuantMode {
    /// The family's policy (INT4 g64 by default, with its overrides).
    Int4,
    /// Everything at its source dtype (a reference install for quality gates).
    Bf16,
}

/// Choices that change the plan (and so its fingerprint).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanOptions {
    /// Quantization mode.
    pub quant: QuantMode,
    /// Sidecars dropped by flags (e.g. `mtp` with `--skip-mtp`).
    pub skip_sidecars: BTreeSet<String>,
    /// Largest coalesced read.
    pub coalesce_max: u64,
    /// Largest gap between tensors read through rather than split.
    pub coalesce_gap: u64,
    /// Read every byte of each shard whose SHA-256 the source publishes, in order, and
    /// check it (`--no-verify-source` turns this off).
    pub verify_source: bool,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            quant: QuantMode::Int4,
            skip_sidecars: BTreeSet::new(),
            coalesce_max: coalesce::COALESCE_MAX,
            coalesce_gap: coalesce::COALESCE_GAP,
            verify_source: true,
        }
    }
}

/// The source, pinned.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanSource {
    /// `org/name` or a local folder name.
    pub repo: String,
    /// Revision asked for.
    pub revision: String,
    /// Resolved commit, when known.
    pub commit: Option<String>,
    /// SHA-256 of the index as fetched (`None` for a single-file repo).
    pub index_sha256: Option<String>,
}

/// One source shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedShard {
    /// File name in the repo.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// Header length; data starts at `8 + header_len`.
    pub header_len: u64,
    /// Published SHA-256, when the source gives one.
    pub sha256: Option<String>,
}

/// Where a tensor's bytes land.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Dest {
    /// Entry `entry` of the resident file.
    Resident {
        /// Index into the resident index.
        entry: usize,
    },
    /// A fused tensor holding one part of every expert of a pool.
    ExpertsFused {
        /// Index into `outputs.expert_pools`.
        pool: usize,
        /// `gate_up` or `down`.
        part: ExpertPart,
    },
    /// One expert's projection.
    Expert {
        /// Index into `outputs.expert_pools`.
        pool: usize,
        /// Expert index.
        expert: u64,
        /// Which projection.
        part: ExpertPart,
    },
    /// One shard of a row table.
    Rows {
        /// Index into `outputs.row_pools`.
        pool: usize,
        /// Shard index inside the pool.
        shard: usize,
    },
    /// Not installed.
    Excluded {
        /// Why.
        why: String,
    },
}

/// One source tensor and what happens to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedTensor {
    /// Name.
    pub name: String,
    /// Index into `shards`.
    pub shard: usize,
    /// Source dtype.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<u64>,
    /// Absolute byte range in the shard file.
    pub src: [u64; 2],
    /// Scheme of its output bytes.
    pub scheme: Scheme,
    /// Destination.
    pub dest: Dest,
}

/// A file copied verbatim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopiedFile {
    /// Path in the repo.
    pub source: String,
    /// Path in the output.
    pub file: String,
    /// Bytes.
    pub bytes: u64,
}

/// Every output file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outputs {
    /// The resident file (`resident.bin`).
    pub resident: ResidentLayout,
    /// Expert pools (main model, then sidecars).
    pub expert_pools: Vec<ExpertPool>,
    /// Row pools.
    pub row_pools: Vec<RowPool>,
    /// Tokenizer and config files.
    pub copied: Vec<CopiedFile>,
}

/// One coalesced source read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangeRead {
    /// Index into `shards`.
    pub shard: usize,
    /// First byte.
    pub start: u64,
    /// One past the last byte.
    pub end: u64,
}

/// Tensor count, parameters and output bytes for one scheme.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CensusRow {
    /// Source tensors.
    pub tensors: u64,
    /// Parameters (elements).
    pub params: u64,
    /// Output bytes (without padding).
    pub bytes: u64,
}

/// The quantization census.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Census {
    /// INT4 g64.
    pub int4: CensusRow,
    /// INT8 g64.
    pub int8: CensusRow,
    /// Source dtype kept.
    pub passthrough: CensusRow,
    /// Not installed (bytes are source bytes).
    pub excluded: CensusRow,
}

/// Architecture as read from `config.json` through the family's axes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Arch {
    /// `model_type` of the config.
    pub model_type: String,
    /// Axis values.
    pub axes: BTreeMap<String, serde_json::Value>,
    /// What a runner must implement.
    pub required_axes: Vec<String>,
}

/// The install plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Canonical-form version.
    pub schema: u32,
    /// Family id.
    pub family: String,
    /// Source pin.
    pub source: PlanSource,
    /// Options.
    pub options: PlanOptions,
    /// Architecture.
    pub arch: Arch,
    /// Shards in index order.
    pub shards: Vec<PlannedShard>,
    /// Tensors in (shard, offset) order.
    pub tensors: Vec<PlannedTensor>,
    /// Coalesced reads in (shard, offset) order.
    pub reads: Vec<RangeRead>,
    /// Output files.
    pub outputs: Outputs,
    /// Census.
    pub census: Census,
}

/// Why a plan cannot be made. Each names the tensor, file or field.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// No family rule matches a tensor.
    #[error(
        "{shard}: tensor `{tensor}` matches no rule of {family_file}; refusing to drop it silently (add a rule, or `excluded` with a reason)"
    )]
    Unmatched {
        /// Shard.
        shard: String,
        /// Tensor.
        tensor: String,
        /// Family file.
        family_file: String,
    },
    /// A tensor's dtype or shape does not fit its role.
    #[error("{shard}: tensor `{tensor}`: field `{field}`: {detail}")]
    Tensor {
        /// Shard.
        shard: String,
        /// Tensor.
        tensor: String,
        /// Field (`shape`, `dtype`).
        field: String,
        /// What is wrong.
        detail: String,
    },
    /// The same name in two shards.
    #[error("tensor `{tensor}` appears in both {first} and {second}")]
    Duplicate {
        /// Tensor.
        tensor: String,
        /// First shard.
        first: String,
        /// Second shard.
        second: String,
    },
    /// An expert or row pool is incomplete or inconsistent.
    #[error("{pool}: {detail}")]
    Pool {
        /// Pool file.
        pool: String,
        /// What is wrong.
        detail: String,
    },
    /// A config value is missing or absurd.
    #[error("config.json: field `{field}`: {detail}")]
    Config {
        /// Field path.
        field: String,
        /// What is wrong.
        detail: String,
    },
    /// Sizes overflow.
    #[error("{what}: sizes overflow 64 bits")]
    Overflow {
        /// What was being sized.
        what: String,
    },
}

/// Everything the planner reads.
pub struct PlanInput<'a> {
    /// Family.
    pub family: &'a Family,
    /// Source pin.
    pub source: PlanSource,
    /// `config.json`, parsed.
    pub config: &'a serde_json::Value,
    /// Headers, in shard order.
    pub headers: &'a [ShardHeader],
    /// Published SHA-256 per shard path, where known.
    pub shard_sha256: &'a BTreeMap<String, String>,
    /// Repo files present, with sizes, for the copied files.
    pub repo_files: &'a BTreeMap<String, u64>,
    /// Options.
    pub options: &'a PlanOptions,
}

/// Largest config value accepted for an integer axis.
const MAX_AXIS_VALUE: u64 = 1 << 40;

fn read_arch(family: &Family, config: &serde_json::Value) -> Result<Arch, PlanError> {
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
        match v {
            serde_json::Value::Number(n) => {
                if let Some(i) = n.as_i64() {
                    if i < 0 || i as u64 > MAX_AXIS_VALUE {
                        return Err(cfg_err(&field, format!("{i} is out of range 0..=2^40")));
                    }
                } else if let Some(f) = n.as_f64() {
                    if !f.is_finite() || f.abs() > 1e15 {
                        return Err(cfg_err(&field, format!("{f} is not a sane number")));
                    }
                } else {
                    return Err(cfg_err(&field, format!("{n} is out of range 0..=2^40")));
                }
            }
            serde_json::Value::Bool(_) | serde_json::Value::Null => {}
            other => {
                return Err(cfg_err(
                    &field,
                    format!("expected a number or boolean, found {other}"),
                ));
            }
        }
        axes.insert(axis.clone(), v.clone());
    }
    Ok(Arch {
        model_type: model_type.to_string(),
        axes,
        required_axes: family.file.arch.required_axes.clone(),
    })
}

fn elems(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
}

/// Scheme for a resident tensor under the family policy.
fn resident_scheme(
    family: &Family,
    options: &PlanOptions,
    name: &str,
    dtype: Dtype,
    shape: &[u64],
) -> Scheme {
    if options.quant == QuantMode::Bf16 || dtype != Dtype::BF16 {
        return Scheme::Passthrough;
    }
    let last = shape.last().copied().unwrap_or(0);
    let fits = shape.len() >= 2 && last > 0 && last % 64 == 0;
    if let Some(s) = family.quant_override(name) {
        return if fits { s } else { Scheme::Passthrough };
    }
    if shape.len() == 2 && fits && name.ends_with(".weight") && !family.never_quantize(name) {
        family.file.quant.default
    } else {
        Scheme::Passthrough
    }
}

/// Scheme for matrices that are always eligible (experts, row tables).
fn pool_scheme(family: &Family, options: &PlanOptions, dtype: Dtype, cols: &[u64]) -> Scheme {
    if options.quant == QuantMode::Bf16
        || dtype != Dtype::BF16
        || cols.iter().any(|c| *c == 0 || c % 64 != 0)
    {
        Scheme::Passthrough
    } else {
        family.file.quant.default
    }
}

/// Output bytes of a `[rows, cols]` matrix under `scheme`.
fn matrix_bytes(rows: u64, cols: u64, elem: u64, scheme: Scheme) -> Option<(u64, u64, u64)> {
    match scheme.bits() {
        Some(bits) => QuantSizes::new(rows, cols, bits).map(|q| (q.weights, q.scales, q.biases)),
        None => rows.checked_mul(cols)?.checked_mul(elem).map(|d| (d, 0, 0)),
    }
}

#[derive(Default)]
struct PoolDraft {
    /// (tensor index, part, expert) for every member.
    members: Vec<(usize, ExpertPart, Option<u64>)>,
}

/// Build the plan.
pub fn build(input: &PlanInput<'_>) -> Result<Plan, PlanError> {
    let family = input.family;
    let options = input.options;
    let arch = read_arch(family, input.config)?;

    let shards: Vec<PlannedShard> = input
        .headers
        .iter()
        .map(|h| PlannedShard {
            path: h.shard.clone(),
            size: h.file_size,
            header_len: h.header_len,
            sha256: input.shard_sha256.get(&h.shard).cloned(),
        })
        .collect();

    // Pass 1: classify every tensor.
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    let mut tensors: Vec<PlannedTensor> = Vec::new();
    let mut resident_inputs: Vec<(usize, ResidentInput)> = Vec::new();
    let mut pools: BTreeMap<(Option<String>, u64), PoolDraft> = BTreeMap::new();
    let mut rows: BTreeMap<(u64, String), Vec<(u64, usize)>> = BTreeMap::new();
    for (si, h) in input.headers.iter().enumerate() {
        for t in &h.tensors {
            if let Some(&prev) = seen.get(t.name.as_str()) {
                return Err(PlanError::Duplicate {
                    tensor: t.name.clone(),
                    first: input.headers[prev].shard.clone(),
                    second: h.shard.clone(),
                });
            }
            seen.insert(&t.name, si);
            let tensor_err = |field: &str, detail: String| PlanError::Tensor {
                shard: h.shard.clone(),
                tensor: t.name.clone(),
                field: field.to_string(),
                detail,
            };
            let m = family
                .classify(&t.name)
                .ok_or_else(|| PlanError::Unmatched {
                    shard: h.shard.clone(),
                    tensor: t.name.clone(),
                    family_file: family.origin.clone(),
                })?;
            let src = [h.data_start() + t.data.start, h.data_start() + t.data.end];
            let idx = tensors.len();
            let skipped = m
                .rule
                .sidecar
                .as_ref()
                .filter(|s| options.skip_sidecars.contains(*s));
            let (scheme, dest) = if let Some(s) = skipped {
                (
                    Scheme::Passthrough,
                    Dest::Excluded {
                        why: format!("sidecar `{s}` skipped"),
                    },
                )
            } else {
                match m.rule.role {
                    Role::Excluded => (
                        Scheme::Passthrough,
                        Dest::Excluded {
                            why: m
                                .rule
                                .why
                                .clone()
                                .unwrap_or_else(|| "excluded by the family".into()),
                        },
                    ),
                    Role::Resident => {
                        let scheme = resident_scheme(family, options, &t.name, t.dtype, &t.shape);
                        resident_inputs.push((
                            idx,
                            ResidentInput {
                                name: t.name.clone(),
                                dtype: t.dtype.name().to_string(),
                                shape: t.shape.clone(),
                                elem_bytes: t.dtype.size(),
                                scheme,
                            },
                        ));
                        (scheme, Dest::Resident { entry: 0 })
                    }
                    Role::ExpertsFused | Role::Expert => {
                        let layer = m.captures.layer.unwrap_or(0);
                        let part = match (m.rule.role, m.captures.part.as_deref()) {
                            (Role::ExpertsFused, Some("gate_up_proj")) => ExpertPart::GateUp,
                            (Role::ExpertsFused, Some("down_proj")) => ExpertPart::Down,
                            (Role::Expert, Some("gate_proj")) => ExpertPart::Gate,
                            (Role::Expert, Some("up_proj")) => ExpertPart::Up,
                            (Role::Expert, Some("down_proj")) => ExpertPart::Down,
                            (_, p) => {
                                return Err(tensor_err(
                                    "name",
                                    format!(
                                        "expert part {p:?} is not one of gate_up_proj/down_proj (fused) or gate_proj/up_proj/down_proj"
                                    ),
                                ));
                            }
                        };
                        let want_dims = if m.rule.role == Role::ExpertsFused {
                            3
                        } else {
                            2
                        };
                        if t.shape.len() != want_dims || t.shape.contains(&0) {
                            return Err(tensor_err(
                                "shape",
                                format!(
                                    "{:?}: expected {want_dims} non-zero dimensions for {:?} experts",
                                    t.shape, m.rule.role
                                ),
                            ));
                        }
                        pools
                            .entry((m.rule.sidecar.clone(), layer))
                            .or_default()
                            .members
                            .push((idx, part, m.captures.expert));
                        (Scheme::Passthrough, Dest::Excluded { why: String::new() })
                    }
                    Role::Rows => {
                        if t.shape.len() != 2 || t.shape[1] == 0 {
                            return Err(tensor_err(
                                "shape",
                                format!("{:?}: a row table must be 2-D [rows, width]", t.shape),
                            ));
                        }
                        if !matches!(t.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
                            return Err(tensor_err(
                                "dtype",
                                format!("{}: a row table must be floating point", t.dtype.name()),
                            ));
                        }
                        let layer = m.captures.layer.unwrap_or(0);
                        let name = m.rule.pool.clone().unwrap_or_else(|| "rows".into());
                        rows.entry((layer, name))
                            .or_default()
                            .push((m.captures.shard.unwrap_or(0), idx));
                        (Scheme::Passthrough, Dest::Excluded { why: String::new() })
                    }
                }
            };
            tensors.push(PlannedTensor {
                name: t.name.clone(),
                shard: si,
                dtype: t.dtype,
                shape: t.shape.clone(),
                src,
                scheme,
                dest,
            });
        }
    }

    // Resident file: entries in name order, so the layout does not depend on sharding.
    resident_inputs.sort_by(|a, b| a.1.name.cmp(&b.1.name));
    for (entry, (ti, _)) in resident_inputs.iter().enumerate() {
        tensors[*ti].dest = Dest::Resident { entry };
    }
    let resident_list: Vec<ResidentInput> = resident_inputs.into_iter().map(|(_, r)| r).collect();
    let resident = ResidentLayout::place(&resident_list).ok_or_else(|| PlanError::Overflow {
        what: "resident.bin".into(),
    })?;

    // Expert pools: main model first, then sidecars; layer order inside each.
    let mut pool_keys: Vec<(Option<String>, u64)> = pools.keys().cloned().collect();
    pool_keys.sort_by(|a, b| (a.0.is_some(), &a.0, a.1).cmp(&(b.0.is_some(), &b.0, b.1)));
    let mut expert_pools = Vec::new();
    for key in pool_keys {
        let draft = &pools[&key];
        let (sidecar, layer) = key;
        let file = match &sidecar {
            None => format!("packed_experts/layer_{layer:02}.bin"),
            Some(s) => format!("packed_experts/{s}_layer_{layer:02}.bin"),
        };
        let pool_err = |detail: String| PlanError::Pool {
            pool: file.clone(),
            detail,
        };
        let pi = expert_pools.len();
        let first = &tensors[draft.members[0].0];
        let dtype = first.dtype;
        if let Some(&(ti, _, _)) = draft.members.iter().find(|m| tensors[m.0].dtype != dtype) {
            return Err(pool_err(format!(
                "`{}` is {} but `{}` is {}",
                tensors[ti].name,
                tensors[ti].dtype.name(),
                first.name,
                dtype.name()
            )));
        }
        let fused = draft.members.iter().any(|m| m.2.is_none());
        // (experts, intermediate I, hidden H)
        let (experts, inter, hidden);
        if fused {
            let find = |p: ExpertPart| {
                draft
                    .members
                    .iter()
                    .filter(|m| m.1 == p)
                    .map(|m| m.0)
                    .collect::<Vec<_>>()
            };
            let (gu, dn) = (find(ExpertPart::GateUp), find(ExpertPart::Down));
            if gu.len() != 1 || dn.len() != 1 || draft.members.len() != 2 {
                return Err(pool_err(format!(
                    "needs exactly one fused gate_up_proj and one down_proj tensor, found {} and {}",
                    gu.len(),
                    dn.len()
                )));
            }
            let (g, d) = (&tensors[gu[0]].shape, &tensors[dn[0]].shape);
            if g[1] % 2 != 0 {
                return Err(pool_err(format!(
                    "`{}` shape {:?}: gate_up rows {} are not even",
                    tensors[gu[0]].name, g, g[1]
                )));
            }
            experts = g[0];
            inter = g[1] / 2;
            hidden = g[2];
            if d[..] != [experts, hidden, inter] {
                return Err(pool_err(format!(
                    "`{}` shape {:?} does not match gate_up_proj {:?} (expected [{experts}, {hidden}, {inter}])",
                    tensors[dn[0]].name, d, g
                )));
            }
            tensors[gu[0]].dest = Dest::ExpertsFused {
                pool: pi,
                part: ExpertPart::GateUp,
            };
            tensors[dn[0]].dest = Dest::ExpertsFused {
                pool: pi,
                part: ExpertPart::Down,
            };
        } else {
            let mut by_expert: BTreeMap<u64, BTreeMap<ExpertPart, usize>> = BTreeMap::new();
            for &(ti, part, e) in &draft.members {
                let e = e.unwrap_or(0);
                if by_expert.entry(e).or_default().insert(part, ti).is_some() {
                    return Err(pool_err(format!("expert {e} has two `{part:?}` tensors")));
                }
            }
            experts = by_expert.len() as u64;
            if by_expert.keys().next_back() != Some(&(experts - 1)) {
                let missing = (0..experts + 1)
                    .find(|e| !by_expert.contains_key(e))
                    .unwrap_or(0);
                return Err(pool_err(format!(
                    "experts are not numbered 0..{experts}: expert {missing} is missing"
                )));
            }
            let g0 = &tensors[*by_expert[&0]
                .get(&ExpertPart::Gate)
                .ok_or_else(|| pool_err("expert 0 has no gate_proj".into()))?]
            .shape;
            inter = g0[0];
            hidden = g0[1];
            for (e, parts) in &by_expert {
                for (part, want) in [
                    (ExpertPart::Gate, [inter, hidden]),
                    (ExpertPart::Up, [inter, hidden]),
                    (ExpertPart::Down, [hidden, inter]),
                ] {
                    let ti = *parts.get(&part).ok_or_else(|| {
                        pool_err(format!(
                            "expert {e} has no `{}` tensor",
                            match part {
                                ExpertPart::Gate => "gate_proj",
                                ExpertPart::Up => "up_proj",
                                _ => "down_proj",
                            }
                        ))
                    })?;
                    if tensors[ti].shape[..] != want {
                        return Err(pool_err(format!(
                            "`{}` shape {:?}, expected {:?} like expert 0",
                            tensors[ti].name, tensors[ti].shape, want
                        )));
                    }
                    tensors[ti].dest = Dest::Expert {
                        pool: pi,
                        expert: *e,
                        part,
                    };
                }
            }
        }
        let scheme = pool_scheme(family, options, dtype, &[hidden, inter]);
        let mut parts = Vec::new();
        let mut offset = 0u64;
        for (part, r, c) in [
            (ExpertPart::Gate, inter, hidden),
            (ExpertPart::Up, inter, hidden),
            (ExpertPart::Down, hidden, inter),
        ] {
            let (w, s, b) = matrix_bytes(r, c, dtype.size(), scheme)
                .ok_or_else(|| PlanError::Overflow { what: file.clone() })?;
            parts.push(BlobPart {
                part,
                rows: r,
                cols: c,
                offset,
                weights: w,
                scales: s,
                biases: b,
            });
            offset += w + s + b;
        }
        let blob_bytes = offset;
        let stride =
            align_up(blob_bytes, PAGE).ok_or_else(|| PlanError::Overflow { what: file.clone() })?;
        let file_bytes = experts
            .checked_mul(stride)
            .ok_or_else(|| PlanError::Overflow { what: file.clone() })?;
        for &(ti, _, _) in &draft.members {
            tensors[ti].scheme = scheme;
        }
        expert_pools.push(ExpertPool {
            file,
            layer,
            sidecar,
            experts,
            scheme,
            dtype,
            blob_bytes,
            stride,
            parts,
            file_bytes,
        });
    }

    // Row pools.
    let mut row_pools = Vec::new();
    for ((layer, name), mut members) in rows {
        members.sort();
        let file = format!("ple/layer_{layer:02}_{name}.bin");
        let pool_err = |detail: String| PlanError::Pool {
            pool: file.clone(),
            detail,
        };
        for (i, (s, ti)) in members.iter().enumerate() {
            if *s != i as u64 {
                return Err(pool_err(format!(
                    "row shards are not numbered 0..{}: `{}` is shard {s} at position {i}",
                    members.len(),
                    tensors[*ti].name
                )));
            }
        }
        let first = &tensors[members[0].1];
        let (width, dtype) = (first.shape[1], first.dtype);
        if let Some((_, ti)) = members
            .iter()
            .find(|(_, ti)| tensors[*ti].shape[1] != width || tensors[*ti].dtype != dtype)
        {
            return Err(pool_err(format!(
                "`{}` is {} {:?}, but `{}` is {} {:?}",
                tensors[*ti].name,
                tensors[*ti].dtype.name(),
                tensors[*ti].shape,
                first.name,
                dtype.name(),
                first.shape
            )));
        }
        let scheme = pool_scheme(family, options, dtype, &[width]);
        let rb = row_bytes(width, dtype.size(), scheme)
            .ok_or_else(|| PlanError::Overflow { what: file.clone() })?;
        let pi = row_pools.len();
        let mut offset = 0u64;
        let mut shards_out = Vec::new();
        let mut rows_per_block = 0;
        for (si, (_, ti)) in members.iter().enumerate() {
            let t = &mut tensors[*ti];
            let g = RowBlocks::new(t.shape[0], rb).ok_or_else(|| {
                pool_err(format!("a {rb}-byte row does not fit a {PAGE}-byte block"))
            })?;
            rows_per_block = g.rows_per_block;
            shards_out.push(RowShard {
                tensor: t.name.clone(),
                rows: t.shape[0],
                offset,
                blocks: g.blocks,
                region_bytes: g.region_bytes,
            });
            offset = offset
                .checked_add(g.region_bytes)
                .ok_or_else(|| PlanError::Overflow { what: file.clone() })?;
            t.scheme = scheme;
            t.dest = Dest::Rows {
                pool: pi,
                shard: si,
            };
        }
        row_pools.push(RowPool {
            file,
            layer,
            name,
            width,
            dtype,
            scheme,
            row_bytes: rb,
            rows_per_block,
            shards: shards_out,
            file_bytes: offset,
        });
    }

    let copied = COPIED_FILES
        .iter()
        .filter_map(|f| {
            input.repo_files.get(*f).map(|&bytes| CopiedFile {
                source: f.to_string(),
                file: format!("tokenizer/{f}"),
                bytes,
            })
        })
        .collect();

    // Census over source tensors.
    let mut census = Census::default();
    for t in &tensors {
        let n = elems(&t.shape).unwrap_or(0);
        let out = match &t.dest {
            Dest::Excluded { .. } => t.src[1] - t.src[0],
            Dest::Resident { entry } => {
                let e = &resident.index.tensors[*entry];
                [e.data, e.weights, e.scales, e.biases]
                    .iter()
                    .flatten()
                    .map(|s| s.len)
                    .sum()
            }
            Dest::ExpertsFused { pool, part } => {
                let p = &expert_pools[*pool];
                let per: u64 = p
                    .parts
                    .iter()
                    .filter(|bp| match part {
                        ExpertPart::GateUp => bp.part != ExpertPart::Down,
                        _ => bp.part == ExpertPart::Down,
                    })
                    .map(|bp| bp.weights + bp.scales + bp.biases)
                    .sum();
                per * p.experts
            }
            Dest::Expert { pool, part, .. } => {
                let bp = expert_pools[*pool].parts.iter().find(|bp| bp.part == *part);
                bp.map(|bp| bp.weights + bp.scales + bp.biases).unwrap_or(0)
            }
            Dest::Rows { pool, .. } => row_pools[*pool].row_bytes * t.shape[0],
        };
        let row = match (&t.dest, t.scheme) {
            (Dest::Excluded { .. }, _) => &mut census.excluded,
            (_, Scheme::Int4G64) => &mut census.int4,
            (_, Scheme::Int8G64) => &mut census.int8,
            (_, Scheme::Passthrough) => &mut census.passthrough,
        };
        row.tensors += 1;
        row.params += n;
        row.bytes += out;
    }

    let mut reads = Vec::new();
    for (si, shard) in shards.iter().enumerate() {
        let mine: Vec<&PlannedTensor> = tensors.iter().filter(|t| t.shard == si).collect();
        if options.verify_source && shard.sha256.is_some() {
            reads.extend(coalesce::cover_shard(
                si,
                shard.size,
                &mine,
                options.coalesce_max,
            ));
        } else {
            reads.extend(coalesce::coalesce(
                mine,
                options.coalesce_max,
                options.coalesce_gap,
            ));
        }
    }

    Ok(Plan {
        schema: PLAN_SCHEMA,
        family: family.id().to_string(),
        source: input.source.clone(),
        options: options.clone(),
        arch,
        shards,
        tensors,
        reads,
        outputs: Outputs {
            resident,
            expert_pools,
            row_pools,
            copied,
        },
        census,
    })
}

/// Output bytes per kind.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputTotals {
    /// `resident.bin`.
    pub resident: u64,
    /// Main-model expert pools.
    pub experts: u64,
    /// Sidecar expert pools (e.g. MTP).
    pub sidecar_experts: u64,
    /// Row pools.
    pub rows: u64,
    /// Tokenizer and config copies.
    pub copied: u64,
    /// Sum of the above.
    pub total: u64,
    /// Number of files.
    pub files: u64,
}

impl Plan {
    /// SHA-256 of the plan's canonical JSON (sorted keys, no whitespace).
    pub fn fingerprint(&self) -> String {
        // serde_json's Map is a BTreeMap (the `preserve_order` feature is off), so
        // Value serialization sorts keys: that is the canonical form.
        let value = serde_json::to_value(self).unwrap_or(serde_json::Value::Null);
        let bytes = serde_json::to_vec(&value).unwrap_or_default();
        hex::encode(Sha256::digest(&bytes))
    }

    /// Output bytes per kind.
    pub fn totals(&self) -> OutputTotals {
        let o = &self.outputs;
        let mut t = OutputTotals {
            resident: o.resident.file_bytes,
            ..Default::default()
        };
        for p in &o.expert_pools {
            if p.sidecar.is_some() {
                t.sidecar_experts += p.file_bytes;
            } else {
                t.experts += p.file_bytes;
            }
        }
        t.rows = o.row_pools.iter().map(|p| p.file_bytes).sum();
        t.copied = o.copied.iter().map(|c| c.bytes).sum();
        t.total = t.resident + t.experts + t.sidecar_experts + t.rows + t.copied;
        t.files =
            1 + o.expert_pools.len() as u64 + o.row_pools.len() as u64 + o.copied.len() as u64;
        t
    }

    /// Bytes the reads fetch.
    pub fn source_bytes_read(&self) -> u64 {
        self.reads.iter().map(|r| r.end - r.start).sum()
    }
}
