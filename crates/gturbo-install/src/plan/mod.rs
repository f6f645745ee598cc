//! What goes where: the install plan, built from the family rules, `config.json` and
//! the validated shard headers alone, before a byte of weights moves.
//!
//! The plan gives every tensor its role, scheme and output placement (resident entry,
//! expert pool slot, row pool region, or exclusion), sizes every output file exactly
//! with the [`crate::format`] types (so a dry run and a real install cannot disagree),
//! coalesces source byte ranges into large reads ([`coalesce`]), and has a fingerprint:
//! the SHA-256 of its canonical JSON.
//!
//! [`build`] runs in named stages, each a function that returns what it placed:
//! *arch* (the config's axes), *classify* (every tensor's role, as a typed draft),
//! *resident* (the resident file, entries in name order), *expert pools*, *row pools*,
//! then the *copied files*, the *census* and the *reads*. A tensor's destination is
//! set once, by the stage that places it.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::family::{Family, axes as axis_rules};
use crate::format::Scheme;
use crate::format::resident::{ResidentInput, ResidentLayout};
use crate::header::{Dtype, ShardHeader};

mod classify;
pub mod coalesce;
mod experts;
pub mod mlx;
pub mod placement;
pub mod profile;
mod rows;

use classify::{Draft, DraftRole};

pub use crate::format::pools::{BlobPart, ExpertPart, ExpertPool, RowPool, RowShard};
pub use profile::{AutoChoice, Machine, QuantMode};

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

/// Largest tokenizer or config file copied (the largest real `tokenizer.json` files
/// are tens of MB).
pub const MAX_COPIED_BYTES: u64 = 512 << 20;

/// Choices that change the plan (and so its fingerprint).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanOptions {
    /// The quant profile (`auto` is resolved by [`build`]; a plan records the profile
    /// it used).
    pub quant: QuantMode,
    /// Whether `--quant` was given (a pre-quantized source refuses a profile asked
    /// for by name). Not part of the plan.
    #[serde(skip)]
    pub quant_requested: bool,
    /// `--requantize`: a pre-quantized source's modules are dequantized (as
    /// `mx.dequantize`) and quantized again at the profile (as `mx.quantize`) instead
    /// of kept as published. Absent from the plan's JSON when not set, so plans made
    /// without it keep their fingerprints.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub requantize: bool,
    /// The machine `auto` measures against (required for `auto`). Not part of the plan.
    #[serde(skip)]
    pub machine: Option<Machine>,
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
            quant: QuantMode::default(),
            quant_requested: false,
            requantize: false,
            machine: None,
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
    /// For one of the three tensors of a pre-quantized module: which stream of the
    /// stored matrix its bytes are copied into, unchanged. Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub packed: Option<PackedPart>,
    /// For a module of a pre-quantized source installed with `--requantize`: how it
    /// was quantized and where its scales and biases are. The tensor itself is the
    /// logical `[.., out, in]` matrix (dtype that of the scales) and `src` is its
    /// packed weights; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requant: Option<Requant>,
}

impl PlannedTensor {
    /// Source bytes of one row (the last axis) as stored: the packed row of a
    /// requantized module, else the row at the tensor's dtype. Reads that split a
    /// tensor cut at multiples of this.
    pub fn src_row_bytes(&self) -> u64 {
        let cols = self.shape.last().copied().unwrap_or(1).max(1);
        match &self.requant {
            Some(r) => r
                .from
                .affine()
                .and_then(|a| a.row_sizes(cols))
                .map_or(cols * self.dtype.size(), |s| s.weights),
            None => cols * self.dtype.size(),
        }
    }
}

/// The source of a module that `--requantize` dequantizes: its layout and its scales
/// and biases, which the executor stages (they may sit anywhere in the shards) before
/// the packed weights stream through.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Requant {
    /// The source's scheme for the module (always an affine one).
    pub from: Scheme,
    /// `P.scales`.
    pub scales: SourcePart,
    /// `P.biases`.
    pub biases: SourcePart,
}

/// One source tensor that is read but not itself placed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourcePart {
    /// Name in the source.
    pub name: String,
    /// Index into `shards`.
    pub shard: usize,
    /// Dtype.
    pub dtype: Dtype,
    /// Shape as stored.
    pub shape: Vec<u64>,
    /// Absolute byte range in the shard file.
    pub src: [u64; 2],
}

/// Which part of a stored quantized matrix a pre-quantized source tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PackedPart {
    /// 0 weights, 1 scales, 2 biases.
    pub stream: u8,
    /// Columns of the logical matrix (`in`).
    pub cols: u64,
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
    /// Every other width and group (pre-quantized sources), by scheme label
    /// (`int3_g128`); absent from the plan's JSON when empty.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub other: BTreeMap<String, CensusRow>,
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
    /// How a pre-quantized source was quantized (its `config.json` block); absent for
    /// a source gturbo quantizes itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_quant: Option<mlx::SourceQuant>,
    /// How a pre-quantized source installed with `--requantize` was quantized (its
    /// `config.json` block): its modules were dequantized and quantized again at the
    /// profile. Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requantized_from: Option<mlx::SourceQuant>,
    /// What `--quant auto` chose and why (not part of the plan's canonical form: the
    /// profile it chose is, in `options.quant`).
    #[serde(skip)]
    pub auto: Option<AutoChoice>,
    /// The profile's default scheme for this family (the manifest's record); `None`
    /// for a pre-quantized source. Not part of the canonical form (every tensor's
    /// scheme is).
    #[serde(skip)]
    pub profile_default: Option<Scheme>,
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
    /// A tokenizer or config file to copy is larger than any real one.
    #[error(
        "{file}: {bytes} bytes, more than the {max} {what} may have; refusing before any weight is read"
    )]
    CopiedTooLarge {
        /// Path in the repo.
        file: String,
        /// Size from the listing.
        bytes: u64,
        /// The bound ([`copied_max_bytes`]).
        max: u64,
        /// What the bound is for.
        what: &'static str,
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

impl<'a> PlanInput<'a> {
    /// The same input under other options.
    fn with_options<'b>(&self, options: &'b PlanOptions) -> PlanInput<'b>
    where
        'a: 'b,
    {
        PlanInput {
            family: self.family,
            source: self.source.clone(),
            config: self.config,
            headers: self.headers,
            shard_sha256: self.shard_sha256,
            repo_files: self.repo_files,
            options,
        }
    }
}

/// The *arch* stage: the config's axes through the family's mapping, each checked by
/// the shared rules ([`axis_rules`]). Also returns each axis's config field, for errors.
fn read_arch(
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
fn check_axes_against_tensors(
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

fn elems(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
}

/// The quantization policy of one plan: the profile's rules, the family's overrides
/// and `never_quantize` on top, and the group fit (a matrix whose rows are not whole
/// groups of its scheme stays at its dtype, as mlx-lm leaves it).
pub(super) struct Policy<'a> {
    family: &'a Family,
    profile: &'static profile::Profile,
    num_layers: u64,
    prequantized: bool,
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

    /// Scheme for a resident tensor of a source gturbo quantizes itself.
    pub(super) fn resident(
        &self,
        name: &str,
        layer: Option<u64>,
        dtype: Dtype,
        shape: &[u64],
    ) -> Scheme {
        if self.keeps_dtype(dtype) || shape.len() < 2 {
            return Scheme::Passthrough;
        }
        let last = shape.last().copied().unwrap_or(0);
        if self.profile.family_overrides()
            && let Some(s) = self.family.quant_override(name)
        {
            return fit(s, last);
        }
        if shape.len() == 2 && name.ends_with(".weight") && !self.family.never_quantize(name) {
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

/// Tensor placements made by one stage: tensor index, scheme of its output bytes,
/// destination.
type Placed = Vec<(usize, Scheme, Dest)>;

/// Build the plan, stage by stage. `--quant auto` plans at each profile the rule
/// ([`profile::auto_rule`]) considers, against `options.machine`, and returns the
/// chosen one's plan with the choice in [`Plan::auto`].
pub fn build(input: &PlanInput<'_>) -> Result<Plan, PlanError> {
    if !input.options.quant.is_auto() {
        return build_at(input);
    }
    let quant = mlx::read_quant(input.config)?;
    if quant.is_some() && !input.options.requantize {
        // A pre-quantized source keeps its own widths; auto asks for nothing else.
        let options = PlanOptions {
            quant: QuantMode::default(),
            quant_requested: false,
            ..input.options.clone()
        };
        let mut plan = build_at(&input.with_options(&options))?;
        plan.auto = Some(AutoChoice {
            profile: "source".into(),
            reason: "the source is pre-quantized: it keeps its own widths".into(),
            ram_bytes: input.options.machine.as_ref().map_or(0, |m| m.ram_bytes),
            ram_source: input
                .options
                .machine
                .as_ref()
                .map_or_else(String::new, |m| m.ram_source.clone()),
            footprint_bytes: Some(plan.footprint()),
        });
        return Ok(plan);
    }
    let machine = input
        .options
        .machine
        .clone()
        .ok_or_else(|| PlanError::Config {
            field: "--quant auto".into(),
            detail: "this machine's RAM is not known; name a profile with --quant".into(),
        })?;
    let mut plans: BTreeMap<String, Result<Plan, PlanError>> = BTreeMap::new();
    let mut plan_at = |id: &str| -> Option<u64> {
        let r = plans.entry(id.to_string()).or_insert_with(|| {
            let options = PlanOptions {
                quant: QuantMode::new(id).map_err(|detail| PlanError::Config {
                    field: "--quant".into(),
                    detail,
                })?,
                ..input.options.clone()
            };
            build_at(&input.with_options(&options))
        });
        r.as_ref().ok().map(Plan::footprint)
    };
    let choice = profile::auto_rule(&machine, &mut plan_at);
    let choice = choice.map_err(|detail| PlanError::Config {
        field: "--quant auto".into(),
        detail,
    })?;
    let mut plan = plans
        .remove(&choice.profile)
        .expect("auto_rule chose a profile it measured")?;
    plan.auto = Some(choice);
    Ok(plan)
}

/// Build the plan at a named profile, stage by stage.
fn build_at(input: &PlanInput<'_>) -> Result<Plan, PlanError> {
    let (family, options) = (input.family, input.options);
    let (arch, fields) = read_arch(family, input.config)?;
    let shards = planned_shards(input);
    let quant = mlx::read_quant(input.config)?;
    let profile = profile::get(options.quant.as_str()).map_err(|detail| PlanError::Config {
        field: "--quant".into(),
        detail,
    })?;
    if let Some(q) = &quant
        && options.quant_requested
        && !options.requantize
    {
        let rec = q.record();
        return Err(PlanError::Config {
            field: q.key.clone(),
            detail: format!(
                "the source is pre-quantized ({}: {} by default, {} module entries); it is \
                 installed with its own widths, not at --quant {} (quantizing twice loses \
                 quality); leave --quant out to install it as published, or add \
                 --requantize to dequantize and requantize it",
                rec.format,
                rec.scheme.label(),
                rec.modules.len(),
                options.quant
            ),
        });
    }
    if quant.is_none() && options.requantize {
        // Decided: an error, not a silent no-op, so a script that meant another
        // repo finds out (docs/INSTALL.md, quant profiles).
        return Err(PlanError::Config {
            field: "quantization".into(),
            detail: format!(
                "--requantize: the source is not pre-quantized (config.json has no \
                 `quantization` block), so there is nothing to dequantize; leave \
                 --requantize out to quantize it at --quant {}",
                options.quant
            ),
        });
    }
    let requantize = quant.is_some() && options.requantize;
    let num_layers = arch.axes.get("num_layers").and_then(|v| v.as_u64());
    if profile.needs_layers() && num_layers.is_none() && (quant.is_none() || requantize) {
        return Err(PlanError::Config {
            field: "num_layers".into(),
            detail: format!(
                "--quant {} picks widths by layer, and family {} maps no `num_layers` axis",
                profile.id(),
                family.id()
            ),
        });
    }
    let sources = mlx::sources(input.headers, quant.as_ref())?;
    let policy = Policy {
        family,
        profile,
        num_layers: num_layers.unwrap_or(0),
        prequantized: quant.is_some() && !requantize,
        requantize,
    };
    let drafts = classify::classify(family, options, &policy, input.headers, sources)?;
    let (resident, resident_placed) = place_resident(&drafts)?;
    let (expert_pools, experts_placed) = experts::place(&policy, &drafts)?;
    check_axes_against_tensors(&arch, &fields, &drafts, &expert_pools)?;
    let (row_pools, rows_placed) = rows::place(&policy, &drafts)?;
    let tensors = assemble(drafts, [resident_placed, experts_placed, rows_placed]);
    let outputs = Outputs {
        resident,
        expert_pools,
        row_pools,
        copied: copied_files(input.repo_files)?,
    };
    let census = Census::count(&tensors, &outputs);
    let reads = coalesce::plan_reads(&shards, &tensors, options);
    Ok(Plan {
        schema: PLAN_SCHEMA,
        family: family.id().to_string(),
        source: input.source.clone(),
        options: options.clone(),
        arch,
        shards,
        tensors,
        reads,
        outputs,
        census,
        profile_default: (quant.is_none() || requantize).then(|| {
            match profile.is_passthrough(family) {
                true => Scheme::Passthrough,
                false => profile.default_scheme(family),
            }
        }),
        source_quant: quant.as_ref().filter(|_| !requantize).map(|q| q.record()),
        requantized_from: quant.as_ref().filter(|_| requantize).map(|q| q.record()),
        auto: None,
    })
}

/// The source shards in index order, with their published hashes.
fn planned_shards(input: &PlanInput<'_>) -> Vec<PlannedShard> {
    input
        .headers
        .iter()
        .map(|h| PlannedShard {
            path: h.shard.clone(),
            size: h.file_size,
            header_len: h.header_len,
            sha256: input.shard_sha256.get(&h.shard).cloned(),
        })
        .collect()
}

/// The *resident* stage: the resident file, entries in name order (so the layout does not depend
/// on sharding), and each resident tensor's entry.
fn place_resident(drafts: &[Draft]) -> Result<(ResidentLayout, Placed), PlanError> {
    let mut members: Vec<(usize, Scheme)> = drafts
        .iter()
        .enumerate()
        .filter_map(|(ti, d)| match d.role {
            DraftRole::Resident { scheme } => Some((ti, scheme)),
            _ => None,
        })
        .collect();
    members.sort_by(|a, b| drafts[a.0].name.cmp(&drafts[b.0].name));
    let inputs: Vec<ResidentInput> = members
        .iter()
        .map(|&(ti, scheme)| {
            let t = &drafts[ti];
            ResidentInput {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                scheme,
            }
        })
        .collect();
    let layout = ResidentLayout::place(&inputs).ok_or_else(|| PlanError::Overflow {
        what: "resident.bin".into(),
    })?;
    let placed = members
        .into_iter()
        .enumerate()
        .map(|(entry, (ti, scheme))| (ti, scheme, Dest::Resident { entry }))
        .collect();
    Ok((layout, placed))
}

/// Every draft as a planned tensor, with the scheme and destination its stage gave
/// it; excluded tensors keep their reason.
fn assemble(drafts: Vec<Draft>, stages: [Placed; 3]) -> Vec<PlannedTensor> {
    let mut placed: Vec<Option<(Scheme, Dest)>> = drafts
        .iter()
        .map(|d| match &d.role {
            DraftRole::Excluded { why } => {
                Some((Scheme::Passthrough, Dest::Excluded { why: why.clone() }))
            }
            _ => None,
        })
        .collect();
    for (ti, scheme, dest) in stages.into_iter().flatten() {
        placed[ti] = Some((scheme, dest));
    }
    let mut out = Vec::with_capacity(drafts.len());
    for (d, p) in drafts.into_iter().zip(placed) {
        let (scheme, dest) = p.expect(
            "each stage places every draft of its role or fails: the resident stage takes \
             all, a pool stage refuses a pool with a member it has no slot for",
        );
        let Some(packed) = d.packed else {
            // A requantized module: one logical matrix whose `src` is its packed
            // weights; its scales and biases are staged by the executor.
            let requant = d.requant.map(|p| {
                let [_, s, b] = p.parts.map(|part| SourcePart {
                    name: part.name,
                    shard: part.shard,
                    dtype: part.dtype,
                    shape: part.shape,
                    src: part.src,
                });
                Requant {
                    from: Scheme::Affine(p.affine),
                    scales: s,
                    biases: b,
                }
            });
            out.push(PlannedTensor {
                name: d.name,
                shard: d.shard,
                dtype: d.dtype,
                shape: d.shape,
                src: d.src,
                scheme,
                dest,
                packed: None,
                requant,
            });
            continue;
        };
        // A pre-quantized module is three source tensors, each copied into its
        // stream of the one stored matrix.
        let cols = d.shape.last().copied().unwrap_or(0);
        let stem = d
            .name
            .strip_suffix(".weight")
            .unwrap_or(&d.name)
            .to_string();
        for (stream, (part, suffix)) in packed
            .parts
            .into_iter()
            .zip(["weight", "scales", "biases"])
            .enumerate()
        {
            out.push(PlannedTensor {
                name: format!("{stem}.{suffix}"),
                shard: part.shard,
                dtype: part.dtype,
                shape: part.shape,
                src: part.src,
                scheme,
                dest: dest.clone(),
                packed: Some(PackedPart {
                    stream: stream as u8,
                    cols,
                }),
                requant: None,
            });
        }
    }
    // Reads and segments go in (shard, offset) order.
    out.sort_by_key(|t| (t.shard, t.src[0]));
    out
}

/// The largest copy of `file` accepted, and what the bound is for: `tokenizer.json` has
/// its own ([`crate::format::tokenizer::MAX_BYTES`]: the runtime loads all of it).
pub fn copied_max_bytes(file: &str) -> (u64, &'static str) {
    if file == crate::format::tokenizer::FILE_NAME {
        (crate::format::tokenizer::MAX_BYTES, "a tokenizer.json")
    } else {
        (MAX_COPIED_BYTES, "a tokenizer or config file")
    }
}

/// The *copied files* stage: the tokenizer and config files the repo has. Their sizes
/// (from the listing) are checked here, at plan time, so an absurd one is refused
/// before any weight streams rather than after.
fn copied_files(repo_files: &BTreeMap<String, u64>) -> Result<Vec<CopiedFile>, PlanError> {
    COPIED_FILES
        .iter()
        .filter_map(|f| repo_files.get(*f).map(|&bytes| (f, bytes)))
        .map(|(f, bytes)| {
            let (max, what) = copied_max_bytes(f);
            if bytes > max {
                return Err(PlanError::CopiedTooLarge {
                    file: f.to_string(),
                    bytes,
                    max,
                    what,
                });
            }
            Ok(CopiedFile {
                source: f.to_string(),
                file: format!("tokenizer/{f}"),
                bytes,
            })
        })
        .collect()
}

impl Census {
    /// The *census* stage: count every source tensor by the scheme of its output.
    fn count(tensors: &[PlannedTensor], outputs: &Outputs) -> Census {
        let mut census = Census::default();
        for t in tensors {
            // A pre-quantized module counts once, as its logical matrix.
            if t.packed.is_some_and(|p| p.stream != 0) {
                continue;
            }
            let n = match t.packed {
                Some(p) => elems(&t.shape).map_or(0, |e| {
                    e / t.shape.last().copied().unwrap_or(1).max(1) * p.cols
                }),
                None => elems(&t.shape).unwrap_or(0),
            };
            let out = match &t.dest {
                Dest::Excluded { .. } => t.src[1] - t.src[0],
                Dest::Resident { entry } => outputs.resident.index.tensors[*entry].stored_bytes(),
                Dest::ExpertsFused { pool, part } => {
                    let p = &outputs.expert_pools[*pool];
                    let per: u64 = p
                        .parts
                        .iter()
                        .filter(|bp| match part {
                            ExpertPart::GateUp => bp.part != ExpertPart::Down,
                            other => bp.part == *other,
                        })
                        .map(|bp| bp.weights + bp.scales + bp.biases)
                        .sum();
                    per * p.experts
                }
                Dest::Expert { pool, part, .. } => {
                    let bp = outputs.expert_pools[*pool]
                        .parts
                        .iter()
                        .find(|bp| bp.part == *part);
                    bp.map(|bp| bp.weights + bp.scales + bp.biases).unwrap_or(0)
                }
                Dest::Rows { pool, .. } => outputs.row_pools[*pool].row_bytes * t.shape[0],
            };
            let row = match (&t.dest, t.scheme) {
                (Dest::Excluded { .. }, _) => &mut census.excluded,
                (_, Scheme::Int4G64) => &mut census.int4,
                (_, Scheme::Int8G64) => &mut census.int8,
                (_, Scheme::Passthrough) => &mut census.passthrough,
                (_, other) => census.other.entry(other.label()).or_default(),
            };
            row.tensors += 1;
            row.params += n;
            row.bytes += out;
        }
        census
    }
}

/// Resident + working-set bytes of an install ([`Plan::footprint`]'s rule): the
/// resident file, plus `num_experts_per_tok` (every expert when the axes name none)
/// blobs of each main-model expert pool.
pub fn footprint(
    resident_bytes: u64,
    pools: &[ExpertPool],
    axes: &BTreeMap<String, serde_json::Value>,
) -> u64 {
    let k = axes.get("num_experts_per_tok").and_then(|v| v.as_u64());
    pools
        .iter()
        .filter(|p| p.sidecar.is_none())
        .map(|p| {
            k.unwrap_or(p.experts)
                .min(p.experts)
                .saturating_mul(p.stride)
        })
        .fold(resident_bytes, u64::saturating_add)
}

/// What differs between two records of [`Plan::facts`], `before` then `now`, one
/// `name: was X, now Y` per fact, `; `-separated; empty when they agree.
pub fn changed(before: &BTreeMap<String, String>, now: &BTreeMap<String, String>) -> String {
    let names: BTreeSet<&String> = before.keys().chain(now.keys()).collect();
    names
        .into_iter()
        .filter_map(|k| {
            // A flag absent from a record was not given.
            let absent = if k.starts_with("--") {
                "not set"
            } else {
                "absent"
            };
            let (a, b) = (before.get(k), now.get(k));
            (a != b).then(|| {
                format!(
                    "{k}: was {}, now {}",
                    a.map_or(absent, |s| s.as_str()),
                    b.map_or(absent, |s| s.as_str())
                )
            })
        })
        .collect::<Vec<_>>()
        .join("; ")
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
        let bytes = crate::format::json::to_compact(self).expect(
            "a Plan always serializes: derived impls (and the resident entries' infallible \
             one) over strings, integers and string-keyed maps",
        );
        crate::format::digest::sha256_hex(&bytes)
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

    /// What the plan was made from, each under the name a user knows it by (a flag,
    /// a file and field, a source shard): recorded beside a partial install, so a
    /// rerun whose fingerprint differs can say exactly what changed ([`changed`]).
    /// Everything else in the plan follows from these and gturbo's own layout rules.
    pub fn facts(&self) -> BTreeMap<String, String> {
        let none = || "none".to_string();
        let on = |b: bool| if b { "set" } else { "not set" }.to_string();
        let mut f = BTreeMap::new();
        let mut put = |k: String, v: String| {
            f.insert(k, v);
        };
        put("family".into(), self.family.clone());
        put("source repo".into(), self.source.repo.clone());
        put("revision".into(), self.source.revision.clone());
        put(
            "resolved commit".into(),
            self.source.commit.clone().unwrap_or_else(none),
        );
        put(
            "SHA-256 of model.safetensors.index.json".into(),
            self.source.index_sha256.clone().unwrap_or_else(none),
        );
        put("--quant".into(), self.options.quant.as_str().into());
        let max = self.options.coalesce_max;
        put(
            "--range-mib".into(),
            if max.is_multiple_of(1 << 20) {
                (max >> 20).to_string()
            } else {
                format!("{max} bytes")
            },
        );
        put(
            "read-through gap".into(),
            format!("{} bytes", self.options.coalesce_gap),
        );
        put("--no-verify-source".into(), on(!self.options.verify_source));
        if self.options.requantize {
            put("--requantize".into(), on(true));
        }
        for s in &self.options.skip_sidecars {
            put(format!("--skip-{s}"), on(true));
        }
        put(
            "config.json model_type".into(),
            self.arch.model_type.clone(),
        );
        for (axis, v) in &self.arch.axes {
            put(format!("config.json axis {axis}"), v.to_string());
        }
        for (i, sh) in self.shards.iter().enumerate() {
            put(
                format!("{}: published SHA-256", sh.path),
                sh.sha256.clone().unwrap_or_else(none),
            );
            put(format!("{}: size", sh.path), format!("{} bytes", sh.size));
            // The header's tensors (names, dtypes, shapes, offsets), not what the
            // plan makes of them (that follows from the flags above).
            // A requantized module's staged scales and biases are header tensors too.
            let staged = self
                .tensors
                .iter()
                .filter_map(|t| t.requant.as_ref())
                .flat_map(|r| [&r.scales, &r.biases])
                .filter(|p| p.shard == i)
                .map(|p| (p.name.as_str(), p.dtype, p.shape.as_slice(), p.src));
            let tensors: Vec<(&str, Dtype, &[u64], [u64; 2])> = self
                .tensors
                .iter()
                .filter(|t| t.shard == i)
                .map(|t| (t.name.as_str(), t.dtype, t.shape.as_slice(), t.src))
                .chain(staged)
                .collect();
            let digest = crate::format::json::to_compact(&tensors)
                .map(|b| crate::format::digest::sha256_hex(&b))
                .unwrap_or_else(|e| e.to_string());
            put(format!("{}: header (tensors)", sh.path), digest);
        }
        for c in &self.outputs.copied {
            put(format!("{}: size", c.source), format!("{} bytes", c.bytes));
        }
        f
    }

    /// The memory an installed model keeps in use, as `--quant auto` weighs it: the
    /// resident file plus its working set, the experts one token routes to
    /// (`num_experts_per_tok` blobs of each main-model expert pool; every expert when
    /// the config names no such axis).
    pub fn footprint(&self) -> u64 {
        footprint(
            self.outputs.resident.file_bytes,
            &self.outputs.expert_pools,
            &self.arch.axes,
        )
    }

    /// The modules a profile with rules put at another scheme than its default, as
    /// (module, scheme), each once (unfused experts as `experts.*`); empty for a
    /// profile without rules and for a pre-quantized source.
    pub fn profile_deviations(&self) -> Vec<(String, Scheme)> {
        let Some(default) = self.profile_default else {
            return Vec::new();
        };
        if !profile::get(self.options.quant.as_str()).is_ok_and(|p| p.has_rules()) {
            return Vec::new();
        }
        let mut out: Vec<(String, Scheme)> = Vec::new();
        for t in &self.tensors {
            if t.scheme == default
                || t.scheme == Scheme::Passthrough
                || matches!(t.dest, Dest::Excluded { .. })
            {
                continue;
            }
            let stem = t.name.strip_suffix(".weight").unwrap_or(&t.name);
            let parts: Vec<&str> = stem.split('.').collect();
            let module: Vec<&str> = parts
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let expert = i > 0 && parts[i - 1] == "experts";
                    if expert && p.bytes().all(|b| b.is_ascii_digit()) {
                        "*"
                    } else {
                        p
                    }
                })
                .collect();
            let entry = (module.join("."), t.scheme);
            if !out.contains(&entry) {
                out.push(entry);
            }
        }
        out
    }

    /// Bytes the reads fetch.
    pub fn source_bytes_read(&self) -> u64 {
        self.reads.iter().map(|r| r.end - r.start).sum()
    }
}
