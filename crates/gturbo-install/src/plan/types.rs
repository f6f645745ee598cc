//! The plan's types: what a plan is made from ([`PlanInput`], [`PlanOptions`]), what it
//! says ([`Plan`] and its parts) and why one cannot be made lives in `error.rs`.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::mlx;
use super::profile::{AutoChoice, Machine, QuantMode};
use crate::family::Family;
use crate::format::Scheme;
use crate::format::pools::{ExpertPart, ExpertPool, RowPool};
use crate::format::resident::ResidentLayout;
use crate::header::{Dtype, ShardHeader};

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

/// Largest coalesced read: 64 MiB (the seed installer's range size, which streamed
/// Flash-Next at ≈ 39 MB/s with one range in flight; smaller ranges cost more
/// requests against hub rate limits, larger ones lose more on a dropped connection).
pub const COALESCE_MAX: u64 = 64 << 20;

/// Largest gap read through: 1 MiB.
pub const COALESCE_GAP: u64 = 1 << 20;

/// Choices that change the plan (and so its fingerprint).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanOptions {
    /// The quant profile (`auto` is resolved by [`build`](super::build()); a plan
    /// records the profile it used).
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
    /// Sidecars the family skips by default that flags keep (`mtp` with
    /// `--keep-mtp`). Absent from the plan's JSON when empty, so plans made before it
    /// keep their fingerprints.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub keep_sidecars: BTreeSet<String>,
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
            keep_sidecars: BTreeSet::new(),
            coalesce_max: COALESCE_MAX,
            coalesce_gap: COALESCE_GAP,
            verify_source: true,
        }
    }
}

impl PlanOptions {
    /// Whether the install drops `family`'s sidecar `name`: asked to (`--skip-<name>`),
    /// or skipped by the family's default and not kept (`--keep-<name>`).
    pub fn skips_sidecar(&self, family: &crate::family::Family, name: &str) -> bool {
        self.skip_sidecars.contains(name)
            || (family
                .file
                .sidecars
                .get(name)
                .is_some_and(|s| s.skipped_by_default())
                && !self.keep_sidecars.contains(name))
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
        /// A `gate_up` whose rows alternate gate, up (the family rule's
        /// `gate_up_interleaved`); absent from the plan's JSON when false, so other
        /// plans keep their fingerprints.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        interleaved: bool,
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
    /// For an FP8 e4m3 block-scaled weight: its block scales. The tensor itself is
    /// the BF16 matrix it dequantizes to (dtype BF16, [`crate::transform::fp8`]) and
    /// `src` its FP8 codes, one byte per element; absent otherwise (so plans of other
    /// sources keep their fingerprints).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8: Option<ScaledFp8>,
    /// Fused experts stored transposed (gpt-oss): `shape` is the logical `[E, out,
    /// in]` the pool receives, the source holds each expert as `[in, out]` (a
    /// `gate_up` part's columns interleaving gate and up), and a source row is a whole
    /// expert ([`PlannedTensor::src_row_bytes`]). Absent otherwise (so other plans keep
    /// their fingerprints).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub transposed: bool,
}

impl PlannedTensor {
    /// Logical rows per source row: 1, or for transposed experts one expert's
    /// `out` rows (the source's unit is a whole expert).
    pub fn rows_per_src_row(&self) -> u64 {
        match (self.transposed, &self.shape[..]) {
            (true, [_, out, _]) => (*out).max(1),
            _ => 1,
        }
    }

    /// Source bytes of one row (the last axis) as stored: the packed row of a
    /// requantized module, else the row at the tensor's dtype. Reads that split a
    /// tensor cut at multiples of this.
    pub fn src_row_bytes(&self) -> u64 {
        let cols = self.shape.last().copied().unwrap_or(1).max(1);
        if self.transposed {
            // A whole expert: the transpose needs all of its columns.
            return self.rows_per_src_row() * cols * self.dtype.size();
        }
        if self.fp8.is_some() {
            // One e4m3 code per element.
            return cols;
        }
        match &self.requant {
            Some(r) => r
                .from
                .row_sizes(cols, self.dtype.size())
                .filter(|_| r.from.is_quantized())
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
    /// The source's scheme for the module (an affine one, or MXFP4: then `scales` is
    /// its E8M0 scales and `biases` repeats them, never read).
    pub from: Scheme,
    /// `P.scales`.
    pub scales: SourcePart,
    /// `P.biases`.
    pub biases: SourcePart,
    /// A compressed-tensors module: no biases are read, the words dequantize as
    /// `bf16_round(scale × (q − 8))` ([`crate::transform::int4_ct::dequantize_rows`]).
    /// Absent from the plan's JSON when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub biases_from_scales: bool,
}

/// The source of an FP8 weight: its `weight_scale_inv` (F32, one scale per 128×128
/// block), which the executor stages (it may sit in any shard) for the rows each read
/// covers before the FP8 codes stream through.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScaledFp8 {
    /// `P.weight_scale_inv`.
    pub scale_inv: SourcePart,
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
    /// The scales of a compressed-tensors module, which also write its biases stream
    /// as `−8 × scale` ([`crate::transform::int4_ct::mlx_biases`]; the module has no
    /// biases tensor).
    /// Absent from the plan's JSON when false, so other plans keep their fingerprints.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub biases_from_scales: bool,
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
    pub(super) fn with_options<'b>(&self, options: &'b PlanOptions) -> PlanInput<'b>
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

/// Tensor placements made by one stage: tensor index, scheme of its output bytes,
/// destination.
pub(super) type Placed = Vec<(usize, Scheme, Dest)>;

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
