//! The install pipeline's front half: resolve the source, fetch and gate the index,
//! read `config.json`, read every shard header, and build the [`Plan`].
//!
//! This is everything `--dry-run` does; the streaming executor (a later stage) starts
//! from the same [`Prepared`] value, so a dry run and a real install plan identically.

mod autojobs;
pub mod copied;
pub mod execute;
mod finished;
mod journal;
pub use crate::format::lock;
mod nofollow;
pub mod pin;
mod publish;
mod resume;
pub mod source_hash;
mod stage;
mod stream;

/// Free space an install keeps beyond its bytes (its preflight's rule; `gturbo doctor`
/// checks the same).
pub use stage::space_reserve;
pub use stream::bound_malloc_arenas;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use futures_util::{StreamExt, TryStreamExt};
use sha2::{Digest, Sha256};

use crate::family::{Family, FamilyError};
use crate::header::{self, ShardError, ShardHeader};
use crate::plan::{self, Plan, PlanError, PlanOptions, PlanSource};
use crate::source::{RangeSource, ResolvedRepo, SourceError, SourceStats, check_repo_path};

/// The index file of a sharded repo.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The single file of an unsharded repo.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Largest index accepted (Flash-Next's is 171 KB).
pub const MAX_INDEX_BYTES: u64 = 64 << 20;
/// Largest `config.json` accepted.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;
/// Header reads in flight at once (fewer when their headers are large: [`HEADER_BUDGET`]).
pub const HEADER_CONCURRENCY: usize = 16;
/// The install's memory budget: its peak RSS at any `--jobs` (issue 9), headers
/// included (issue 22). Its shares: the reorder window's (192 MiB, `WINDOW_BUDGET`)
/// while data streams, [`HEADER_BUDGET`] while headers are read.
pub const MEMORY_BUDGET: u64 = 256 << 20;
/// What the header reads in flight may hold together ([`header::HeaderBudget`]): the
/// reorder window's share of [`MEMORY_BUDGET`], since every header is read and parsed
/// before the first window place is made, and the rest of the budget (the runtime,
/// HTTP buffers) is there in both phases.
pub const HEADER_BUDGET: u64 = stream::WINDOW_BUDGET;

/// Where the expected index hash comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IndexPin {
    /// No pin: the index is trusted as fetched (a warning says so).
    None,
    /// The family file's pin.
    Family(String),
    /// `--index-sha256`.
    Flag(String),
}

/// What to prepare.
#[derive(Debug, Clone)]
pub struct PrepareSettings {
    /// The family.
    pub family: Family,
    /// Expected index hash.
    pub index_pin: IndexPin,
    /// Plan options.
    pub options: PlanOptions,
}

/// A prepared install: the plan and what it cost to make.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The plan.
    pub plan: Plan,
    /// The resolved snapshot.
    pub repo: ResolvedRepo,
    /// Source counters after resolving, the index, the config and the headers.
    pub stats: SourceStats,
    /// Requests spent on shard headers alone.
    pub header_requests: u64,
    /// `metadata.total_size` from the index, when present.
    pub index_total_size: Option<u64>,
    /// Whether the index hash was checked against a pin.
    pub index_pinned: bool,
    /// Things the user should know (unpinned index, overridden pin).
    pub warnings: Vec<String>,
    /// Wall time.
    pub elapsed: Duration,
    /// The family's quantization overrides as (pattern, scheme), for the manifest.
    pub family_overrides: Vec<(String, crate::format::Scheme)>,
    /// Sidecar name → `carried` or `skipped`.
    pub sidecars: BTreeMap<String, String>,
    /// The family asks `gturbo run` for a recorded quality result before it runs a
    /// quantized install (its quant policy's `run_requires_recorded_quality`).
    pub run_requires_recorded_quality: bool,
}

/// Why an install cannot be planned.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// Source failure.
    #[error(transparent)]
    Source(#[from] SourceError),
    /// A shard header failed.
    #[error(transparent)]
    Shard(#[from] ShardError),
    /// The plan could not be made.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// Family problem.
    #[error(transparent)]
    Family(#[from] FamilyError),
    /// The index does not hash to the pin: the hard gate.
    #[error(
        "{file}: SHA-256 mismatch ({origin})\n  Expected: {expected}\n  Computed: {computed}\n\nhint: the repo changed or this is not the pinned snapshot; pass `--index-sha256 {computed}` only if you trust this index"
    )]
    IndexHashMismatch {
        /// The index file.
        file: String,
        /// Where the expectation came from.
        origin: String,
        /// Expected hash.
        expected: String,
        /// Computed hash.
        computed: String,
    },
    /// Local I/O on the output.
    #[error("{path}: {source}")]
    Io {
        /// File or directory.
        path: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// A weight is inf or NaN.
    #[error(
        "{shard}: tensor `{tensor}`: non-finite weight (inf or NaN) at element {element}; refusing to install a defective checkpoint"
    )]
    NonFinite {
        /// The source shard holding it.
        shard: String,
        /// Tensor.
        tensor: String,
        /// Flat element index.
        element: u64,
    },
    /// A transform failed.
    #[error("tensor `{tensor}`: {detail}")]
    Transform {
        /// Tensor.
        tensor: String,
        /// What.
        detail: String,
    },
    /// The partial install was made by another plan.
    #[error(
        "{journal}: the partial install was planned with fingerprint {theirs}, this plan is {ours} ({changed}); refusing to mix them\n\nhint: rerun with the original flags to resume, or pass --discard-partial to start over"
    )]
    PlanChanged {
        /// Journal path.
        journal: String,
        /// Fingerprint in the journal.
        theirs: String,
        /// This plan's fingerprint.
        ours: String,
        /// What differs between the two plans' inputs, by name.
        changed: String,
    },
    /// A source shard's bytes do not hash to the published SHA-256.
    #[error(
        "{shard}: source SHA-256 mismatch: the bytes read are not the published file\n  Expected: {expected}\n  Computed: {computed}\n\nhint: what came from this shard is discarded; rerun to fetch it again"
    )]
    SourceHashMismatch {
        /// Shard.
        shard: String,
        /// Published hash.
        expected: String,
        /// Hash of the bytes read.
        computed: String,
    },
    /// A file copied from the source (config, tokenizer, chat template) does not hash to
    /// what the source published for it.
    #[error(
        "{file}: source {what} mismatch: the bytes read are not the published file\n  Expected: {expected}\n  Computed: {computed}\n\nhint: the source serves other bytes than the ones it publishes a hash for; nothing of them is installed"
    )]
    CopiedHashMismatch {
        /// Path in the repo.
        file: String,
        /// `git blob id` or `SHA-256`.
        what: &'static str,
        /// Published hash.
        expected: String,
        /// Hash of the bytes read.
        computed: String,
    },
    /// `--require-source-hash`, and a copied file whose source published no hash after
    /// all (an answer said the file is in LFS, so the listing's `oid` names its pointer).
    #[error(
        "{file}: no published hash (git blob id or SHA-256) to verify it against (--require-source-hash)"
    )]
    CopiedUnpublished {
        /// Path in the repo.
        file: String,
    },
    /// The output filesystem cannot hold the rest of the install (checked before writing).
    #[error(
        "{path}: not enough free space: the rest of the install needs {needed} bytes (with a reserve), {available} are available\n\nhint: free space or choose another --out; the partial install is kept and resumes"
    )]
    NotEnoughSpace {
        /// Staging directory.
        path: String,
        /// Bytes needed.
        needed: u64,
        /// Bytes available.
        available: u64,
    },
    /// The disk filled up while writing.
    #[error(
        "{path}: no space left on device\n\nhint: the partial install is kept: free space and rerun the same command to resume"
    )]
    NoSpace {
        /// File being written.
        path: String,
    },
    /// The output exists.
    #[error("{path} already exists; pass --overwrite to replace it")]
    OutputExists {
        /// Output path.
        path: String,
    },
    /// `--overwrite` of something gturbo did not make: only a published `.gturbo`
    /// install (its manifest and receipt say so, and every file in it is one the
    /// manifest lists) is ever replaced.
    #[error(
        "{path}: {why}; --overwrite replaces only a .gturbo install that gturbo made, so it is left as it is (it holds {holds})\n\nhint: choose another --out, or move it away yourself"
    )]
    NotOurs {
        /// The output path.
        path: String,
        /// Why it is not gturbo's.
        why: String,
        /// What is in it (a few names and a count).
        holds: String,
    },
    /// The output is the `--from` folder, holds it or lies inside it.
    #[error(
        "--out {out} {how} the source folder --from {from}; refusing (an install there would {harm})\n\nhint: choose an --out outside {from}"
    )]
    OutputOverlapsSource {
        /// The output path (or its staging directory) as given.
        out: String,
        /// `is`, `holds` or `lies inside`.
        how: &'static str,
        /// The source folder, canonical.
        from: String,
        /// What would happen.
        harm: &'static str,
    },
    /// An interrupted run published the output, but it no longer verifies.
    #[error(
        "{path} already exists: a run of this plan published it but stopped before cleaning up, and it does not verify ({failure})\n\nhint: pass --overwrite to install it again"
    )]
    PublishedDamaged {
        /// Output path.
        path: String,
        /// The first failure of the verification.
        failure: String,
    },
    /// Another install holds the lock.
    #[error("{path} is locked by another gturbo install into the same output")]
    Locked {
        /// Lock path.
        path: String,
    },
    /// `--overwrite` of an install that a running model (or a verify) has open.
    #[error(
        "{path}: {}; --overwrite never replaces an install that is in use\n\nhint: let it finish (or stop it), then rerun this command",
        lock::IN_USE
    )]
    InUse {
        /// The published output directory.
        path: String,
    },
    /// The partial install's journal is in a format this build does not read.
    #[error(
        "{journal}: written in journal format {found}, this gturbo reads \"gturbo-install\" version 1; refusing to guess at it\n\nhint: pass --discard-partial to start over"
    )]
    JournalFormat {
        /// Journal path.
        journal: String,
        /// The head's `journal` and `version`.
        found: String,
    },
    /// A link (or another file type) stands where the install creates its own path
    /// beside or inside the output: never followed, never written through.
    #[error(
        "{path}: {what}, where gturbo creates its own file or directory of the install; refusing to follow or write through it\n\nhint: remove it (or choose another --out) and rerun"
    )]
    Planted {
        /// The path.
        path: String,
        /// What stands there (`a symbolic link`, `a FIFO (named pipe)`, …).
        what: String,
    },
    /// A bug.
    #[error("internal error: {0}")]
    Internal(String),
    /// The index or config does not parse or is inconsistent with the shards.
    #[error("{file}: field `{field}`: {detail}")]
    Invalid {
        /// File.
        file: String,
        /// Field.
        field: String,
        /// What is wrong.
        detail: String,
    },
}

impl InstallError {
    /// True when gturbo ran and refused (a hash or pin gate), as opposed to not
    /// being able to run at all. Decides exit code 1 vs 2.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            InstallError::IndexHashMismatch { .. }
                | InstallError::PlanChanged { .. }
                | InstallError::NonFinite { .. }
                | InstallError::SourceHashMismatch { .. }
                | InstallError::CopiedHashMismatch { .. }
                | InstallError::CopiedUnpublished { .. }
        )
    }
}

/// An I/O error on `path`; a full disk becomes [`InstallError::NoSpace`].
fn io_err(path: &std::path::Path, e: std::io::Error) -> InstallError {
    if e.kind() == std::io::ErrorKind::StorageFull || e.raw_os_error() == Some(28) {
        return InstallError::NoSpace {
            path: path.display().to_string(),
        };
    }
    InstallError::Io {
        path: path.display().to_string(),
        source: e,
    }
}

fn invalid(file: &str, field: &str, detail: impl Into<String>) -> InstallError {
    InstallError::Invalid {
        file: file.to_string(),
        field: field.to_string(),
        detail: detail.into(),
    }
}

/// The parsed index: shard order and the tensor → shard map.
struct Index {
    shards: Vec<String>,
    weight_map: BTreeMap<String, String>,
    total_size: Option<u64>,
}

/// Every tensor of `h` is in the index, under `h`'s shard.
fn check_against_index(ix: &Index, h: &ShardHeader) -> Result<(), InstallError> {
    for t in &h.tensors {
        match ix.weight_map.get(&t.name) {
            Some(f) if *f == h.shard => {}
            Some(f) => {
                return Err(invalid(
                    INDEX_FILE,
                    &format!("weight_map.{}", t.name),
                    format!("says {f}, but the tensor is in {}", h.shard),
                ));
            }
            None => {
                return Err(invalid(
                    INDEX_FILE,
                    "weight_map",
                    format!("has no entry for `{}`, which {} holds", t.name, h.shard),
                ));
            }
        }
    }
    Ok(())
}

fn parse_index(bytes: &[u8]) -> Result<Index, InstallError> {
    let v: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| invalid(INDEX_FILE, "(document)", format!("not JSON: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| invalid(INDEX_FILE, "weight_map", "missing or not an object"))?;
    let total_size = match v.get("metadata").and_then(|m| m.get("total_size")) {
        None => None,
        Some(t) => Some(t.as_u64().ok_or_else(|| {
            invalid(
                INDEX_FILE,
                "metadata.total_size",
                format!("{t} is not a non-negative integer"),
            )
        })?),
    };
    let mut weight_map = BTreeMap::new();
    let mut shards = BTreeSet::new();
    for (name, file) in map {
        let file = file.as_str().ok_or_else(|| {
            invalid(
                INDEX_FILE,
                &format!("weight_map.{name}"),
                "value is not a file name string",
            )
        })?;
        check_repo_path(&format!("{INDEX_FILE} weight_map[{name:?}]"), file)?;
        shards.insert(file.to_string());
        weight_map.insert(name.clone(), file.to_string());
    }
    if weight_map.is_empty() {
        return Err(invalid(INDEX_FILE, "weight_map", "is empty"));
    }
    Ok(Index {
        shards: shards.into_iter().collect(),
        weight_map,
        total_size,
    })
}

/// Resolve, gate the index, read config and headers, and plan.
pub async fn prepare(
    source: &dyn RangeSource,
    settings: &PrepareSettings,
) -> Result<Prepared, InstallError> {
    let started = Instant::now();
    let mut warnings = Vec::new();
    let repo = source.resolve().await?;
    let sizes: BTreeMap<String, u64> = repo
        .files
        .iter()
        .map(|f| (f.path.clone(), f.size))
        .collect();

    let (expected, origin) = match &settings.index_pin {
        IndexPin::None => (None, String::new()),
        IndexPin::Family(h) => (
            Some(h.clone()),
            format!("pinned by {}", settings.family.origin),
        ),
        IndexPin::Flag(h) => (Some(h.clone()), "pinned by --index-sha256".to_string()),
    };
    let (index, index_sha) = if sizes.contains_key(INDEX_FILE) {
        let bytes = source.read_file(INDEX_FILE, MAX_INDEX_BYTES).await?;
        let computed = hex::encode(Sha256::digest(&bytes));
        match &expected {
            Some(e) if *e != computed => {
                return Err(InstallError::IndexHashMismatch {
                    file: INDEX_FILE.into(),
                    origin,
                    expected: e.clone(),
                    computed,
                });
            }
            Some(_) => {}
            None => warnings.push(format!(
                "{INDEX_FILE} is not pinned (SHA-256 {computed}); pass --index-sha256 to pin it"
            )),
        }
        (Some(parse_index(&bytes)?), Some(computed))
    } else if sizes.contains_key(SINGLE_FILE) {
        if let Some(e) = &expected {
            return Err(invalid(
                INDEX_FILE,
                "(file)",
                format!(
                    "the pin expects an index with SHA-256 {e}, but {repo} has only {SINGLE_FILE}"
                ),
            ));
        }
        (None, None)
    } else {
        return Err(invalid(
            INDEX_FILE,
            "(file)",
            format!("{repo} has neither {INDEX_FILE} nor {SINGLE_FILE}"),
        ));
    };
    let shard_names: Vec<String> = match &index {
        Some(ix) => ix.shards.clone(),
        None => vec![SINGLE_FILE.to_string()],
    };
    for s in &shard_names {
        if !sizes.contains_key(s) {
            return Err(SourceError::MissingFile {
                repo: repo.to_string(),
                path: s.clone(),
            }
            .into());
        }
    }

    if !sizes.contains_key("config.json") {
        return Err(SourceError::MissingFile {
            repo: repo.to_string(),
            path: "config.json".into(),
        }
        .into());
    }
    let config_bytes = source.read_file("config.json", MAX_CONFIG_BYTES).await?;
    // Proven against the source's hash before the planner reads a field of it.
    copied::published(source, &repo, "config.json").check("config.json", &config_bytes)?;
    let config: serde_json::Value = serde_json::from_slice(&config_bytes)
        .map_err(|e| invalid("config.json", "(document)", format!("not JSON: {e}")))?;
    if !config.is_object() {
        return Err(invalid("config.json", "(document)", "not a JSON object"));
    }

    let before_headers = source.stats().requests;
    let budget = header::HeaderBudget::new(HEADER_BUDGET);
    let budget = &budget;
    let index = &index;
    let headers: Vec<ShardHeader> = futures_util::stream::iter(shard_names.iter().map(|s| {
        let size = sizes[s];
        async move {
            let mut h = header::read_header(source, s, size, budget).await?;
            // What is kept of each header until the plan is made must be bounded too
            // (issue 22): its tensors are checked against the index as it comes, so
            // no header keeps more tensors than the index names, and `__metadata__`
            // (validated, never used by the plan) is not kept: 24 headers of 100 MB
            // of it kept 2.4 GB.
            if let Some(ix) = index {
                check_against_index(ix, &h)?;
            }
            h.metadata = BTreeMap::new();
            Ok::<_, InstallError>(h)
        }
    }))
    .buffered(HEADER_CONCURRENCY)
    .try_collect()
    .await?;
    let header_requests = source.stats().requests - before_headers;
    // Published shard hashes: the listing's, or what the header reads' answers carried
    // (`X-Linked-Etag`, a SHA-256 `ETag`), so a listing without `lfs.oid` still verifies.
    let sha: BTreeMap<String, String> = shard_names
        .iter()
        .filter_map(|s| {
            repo.file(s)
                .and_then(|f| f.sha256.clone())
                .or_else(|| source.published_sha256(s))
                .map(|h| (s.clone(), h))
        })
        .collect();

    if let Some(ix) = &index {
        let in_headers: usize = headers.iter().map(|h| h.tensors.len()).sum();
        if in_headers != ix.weight_map.len() {
            let present: BTreeSet<&str> = headers
                .iter()
                .flat_map(|h| h.tensors.iter().map(|t| t.name.as_str()))
                .collect();
            let missing = ix
                .weight_map
                .iter()
                .find(|(n, _)| !present.contains(n.as_str()));
            if let Some((n, f)) = missing {
                return Err(invalid(
                    INDEX_FILE,
                    &format!("weight_map.{n}"),
                    format!("names {f}, whose header has no such tensor"),
                ));
            }
        }
    }

    let plan_source = PlanSource {
        repo: repo.repo.clone(),
        revision: repo.revision.clone(),
        commit: repo.commit.clone(),
        index_sha256: index_sha,
    };
    let plan = plan::build(&plan::PlanInput {
        family: &settings.family,
        source: plan_source,
        config: &config,
        headers: &headers,
        shard_sha256: &sha,
        repo_files: &sizes,
        options: &settings.options,
    })?;
    if !plan
        .outputs
        .copied
        .iter()
        .any(|c| c.source == "tokenizer.json")
    {
        warnings.push(format!(
            "{repo} has no tokenizer.json; `gturbo run` will not be able to tokenize"
        ));
    }
    let family_overrides = settings
        .family
        .file
        .quant
        .overrides
        .iter()
        .map(|o| (o.pattern.clone(), o.scheme))
        .collect();
    let sidecars = settings
        .family
        .file
        .sidecars
        .keys()
        .map(|k| {
            let state = if settings.options.skip_sidecars.contains(k) {
                "skipped"
            } else {
                "carried"
            };
            (k.clone(), state.to_string())
        })
        .collect();
    Ok(Prepared {
        family_overrides,
        sidecars,
        run_requires_recorded_quality: settings.family.file.quant.run_requires_recorded_quality,
        plan,
        stats: source.stats(),
        header_requests,
        index_total_size: index.as_ref().and_then(|i| i.total_size),
        index_pinned: expected.is_some(),
        repo,
        warnings,
        elapsed: started.elapsed(),
    })
}
