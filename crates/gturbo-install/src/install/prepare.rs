//! The install's front half: resolve the source, fetch and gate the index, read
//! `config.json`, read every shard header, and build the [`Plan`]. This is everything
//! `--dry-run` does; the executor starts from the same [`Prepared`] value, so a dry run
//! and a real install plan identically.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use futures_util::{StreamExt, TryStreamExt};
use sha2::{Digest, Sha256};

use crate::family::Family;
use crate::header::{self, ShardHeader};
use crate::plan::{self, Plan, PlanOptions, PlanSource};
use crate::source::{RangeSource, ResolvedRepo, SourceError, SourceStats, check_repo_path};

use super::{
    HEADER_BUDGET, HEADER_CONCURRENCY, INDEX_FILE, InstallError, MAX_CONFIG_BYTES, MAX_INDEX_BYTES,
    SINGLE_FILE, copied, invalid,
};

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
    /// The tokenizer the install converts from a tiktoken BPE file into
    /// `tokenizer/tokenizer.json` ([`crate::tiktoken::applies`]).
    pub tiktoken: Option<crate::tiktoken::TiktokenSpec>,
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
    let pin = Pin::of(settings);
    let (index, index_sha) = fetch_index(source, &repo, &sizes, &pin, &mut warnings).await?;
    let shard_names = shard_names(&repo, &sizes, index.as_ref())?;
    let config = read_config(source, &repo, &sizes).await?;
    let before_headers = source.stats().requests;
    let headers = read_headers(source, &shard_names, &sizes, index.as_ref()).await?;
    let header_requests = source.stats().requests - before_headers;
    let sha = published_shard_hashes(source, &repo, &shard_names);
    if let Some(ix) = &index {
        check_index_covered(ix, &headers)?;
    }
    let plan = plan::build(&plan::PlanInput {
        family: &settings.family,
        source: PlanSource {
            repo: repo.repo.clone(),
            revision: repo.revision.clone(),
            commit: repo.commit.clone(),
            index_sha256: index_sha,
        },
        config: &config,
        headers: &headers,
        shard_sha256: &sha,
        repo_files: &sizes,
        options: &settings.options,
    })?;
    let copied: Vec<&str> = (plan.outputs.copied.iter())
        .map(|c| c.source.as_str())
        .collect();
    let tiktoken =
        crate::tiktoken::applies(settings.family.file.tiktoken.as_ref(), &copied).cloned();
    if !copied.contains(&"tokenizer.json") && tiktoken.is_none() {
        warnings.push(format!(
            "{repo} has no tokenizer.json; `gturbo run` will not be able to tokenize"
        ));
    }
    Ok(Prepared {
        family_overrides: family_overrides(&settings.family),
        sidecars: sidecar_states(settings),
        run_requires_recorded_quality: settings.family.file.quant.run_requires_recorded_quality,
        tiktoken,
        plan,
        stats: source.stats(),
        header_requests,
        index_total_size: index.as_ref().and_then(|i| i.total_size),
        index_pinned: pin.expected.is_some(),
        repo,
        warnings,
        elapsed: started.elapsed(),
    })
}

/// The index hash expected, and where that expectation comes from (for the error).
struct Pin {
    expected: Option<String>,
    origin: String,
}

impl Pin {
    fn of(settings: &PrepareSettings) -> Pin {
        let (expected, origin) = match &settings.index_pin {
            IndexPin::None => (None, String::new()),
            IndexPin::Family(h) => (
                Some(h.clone()),
                format!("pinned by {}", settings.family.origin),
            ),
            IndexPin::Flag(h) => (Some(h.clone()), "pinned by --index-sha256".to_string()),
        };
        Pin { expected, origin }
    }
}

/// The index, fetched, checked against its pin (an unpinned one is a warning) and
/// parsed, with its SHA-256; `None` for a single-file repo (which no pin may expect).
async fn fetch_index(
    source: &dyn RangeSource,
    repo: &ResolvedRepo,
    sizes: &BTreeMap<String, u64>,
    pin: &Pin,
    warnings: &mut Vec<String>,
) -> Result<(Option<Index>, Option<String>), InstallError> {
    if sizes.contains_key(INDEX_FILE) {
        let bytes = source.read_file(INDEX_FILE, MAX_INDEX_BYTES).await?;
        let computed = hex::encode(Sha256::digest(&bytes));
        match &pin.expected {
            Some(e) if *e != computed => {
                return Err(InstallError::IndexHashMismatch {
                    file: INDEX_FILE.into(),
                    origin: pin.origin.clone(),
                    expected: e.clone(),
                    computed,
                });
            }
            Some(_) => {}
            None => warnings.push(format!(
                "{INDEX_FILE} is not pinned (SHA-256 {computed}); pass --index-sha256 to pin it"
            )),
        }
        Ok((Some(parse_index(&bytes)?), Some(computed)))
    } else if sizes.contains_key(SINGLE_FILE) {
        if let Some(e) = &pin.expected {
            return Err(invalid(
                INDEX_FILE,
                "(file)",
                format!(
                    "the pin expects an index with SHA-256 {e}, but {repo} has only {SINGLE_FILE}"
                ),
            ));
        }
        Ok((None, None))
    } else {
        Err(invalid(
            INDEX_FILE,
            "(file)",
            format!("{repo} has neither {INDEX_FILE} nor {SINGLE_FILE}"),
        ))
    }
}

/// The shards the index names (the single file without one), each in the listing.
fn shard_names(
    repo: &ResolvedRepo,
    sizes: &BTreeMap<String, u64>,
    index: Option<&Index>,
) -> Result<Vec<String>, InstallError> {
    let shard_names: Vec<String> = match index {
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
    Ok(shard_names)
}

/// The source's `config.json` on its own (resolve, then the file, proven against the
/// source's hash), for picking the family before the install is prepared: two
/// requests on a hub, none of them per shard.
pub async fn source_config(source: &dyn RangeSource) -> Result<serde_json::Value, InstallError> {
    let repo = source.resolve().await?;
    let sizes: BTreeMap<String, u64> = repo
        .files
        .iter()
        .map(|f| (f.path.clone(), f.size))
        .collect();
    read_config(source, &repo, &sizes).await
}

/// `config.json`, proven against the source's hash before the planner reads a field
/// of it, as a JSON object.
async fn read_config(
    source: &dyn RangeSource,
    repo: &ResolvedRepo,
    sizes: &BTreeMap<String, u64>,
) -> Result<serde_json::Value, InstallError> {
    if !sizes.contains_key("config.json") {
        return Err(SourceError::MissingFile {
            repo: repo.to_string(),
            path: "config.json".into(),
        }
        .into());
    }
    let config_bytes = source.read_file("config.json", MAX_CONFIG_BYTES).await?;
    // Proven against the source's hash before the planner reads a field of it.
    copied::published(source, repo, "config.json").check("config.json", &config_bytes)?;
    let config: serde_json::Value = serde_json::from_slice(&config_bytes)
        .map_err(|e| invalid("config.json", "(document)", format!("not JSON: {e}")))?;
    if !config.is_object() {
        return Err(invalid("config.json", "(document)", "not a JSON object"));
    }
    Ok(config)
}

/// Every shard's header, [`HEADER_CONCURRENCY`] at a time within one [`HEADER_BUDGET`],
/// each checked against the index as it comes.
async fn read_headers(
    source: &dyn RangeSource,
    shard_names: &[String],
    sizes: &BTreeMap<String, u64>,
    index: Option<&Index>,
) -> Result<Vec<ShardHeader>, InstallError> {
    let budget = header::HeaderBudget::new(HEADER_BUDGET);
    let budget = &budget;
    futures_util::stream::iter(shard_names.iter().map(|s| {
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
    .await
}

/// Published shard hashes: the listing's, or what the header reads' answers carried
/// (`X-Linked-Etag`, a SHA-256 `ETag`), so a listing without `lfs.oid` still verifies.
fn published_shard_hashes(
    source: &dyn RangeSource,
    repo: &ResolvedRepo,
    shard_names: &[String],
) -> BTreeMap<String, String> {
    shard_names
        .iter()
        .filter_map(|s| {
            repo.file(s)
                .and_then(|f| f.sha256.clone())
                .or_else(|| source.published_sha256(s))
                .map(|h| (s.clone(), h))
        })
        .collect()
}

/// Every tensor the index names is in a header (each header's tensors were checked
/// against the index as it came: together they prove the two name the same tensors).
fn check_index_covered(ix: &Index, headers: &[ShardHeader]) -> Result<(), InstallError> {
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
    Ok(())
}

/// The family's quantization overrides as (pattern, scheme), for the manifest.
fn family_overrides(family: &Family) -> Vec<(String, crate::format::Scheme)> {
    family
        .file
        .quant
        .overrides
        .iter()
        .map(|o| (o.pattern.clone(), o.scheme))
        .collect()
}

/// Each sidecar of the family, `carried` or `skipped` by the options.
fn sidecar_states(settings: &PrepareSettings) -> BTreeMap<String, String> {
    settings
        .family
        .file
        .sidecars
        .keys()
        .map(|k| {
            let state = if settings.options.skips_sidecar(&settings.family, k) {
                "skipped"
            } else {
                "carried"
            };
            (k.clone(), state.to_string())
        })
        .collect()
}
