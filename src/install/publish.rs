//! The executor's last steps: *copy* the tokenizer and config files, *finalize* (hash
//! every file with verify-install's parallel hasher, write the manifest last, then the
//! receipt, fsync everything) and *publish* (rename the staging directory into place).
//!
//! Publication never writes into a published directory: an existing `<out>` (with
//! `--overwrite`, whose exclusive lock [`super::stage::Staging::claim`] took) is renamed
//! aside, the staging directory renamed onto `<out>`, and the old one removed.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use crate::format::Scheme;
use crate::format::manifest::{
    self, Manifest, ManifestArch, ManifestFile, ManifestResident, ManifestSource, ManifestTool,
    QuantizedAtInstall,
};
use crate::format::receipt::{self, Prover, Receipt, ReceiptFile, ReceiptSource};
use crate::plan::placement::output_file_paths;
use crate::plan::{Dest, Plan, QuantMode};
use crate::source::{RangeSource, SourceError};

use super::execute::InstallReporter;
use super::stage::{Staging, with_suffix};
use super::{InstallError, Prepared, io_err};

/// Largest tokenizer/config file copied.
const MAX_COPIED_BYTES: u64 = 512 << 20;

/// Copy the tokenizer and config files into the staging directory.
pub(super) async fn copy_files(
    source: &dyn RangeSource,
    plan: &Plan,
    staging: &Path,
    reporter: &dyn InstallReporter,
) -> Result<(), InstallError> {
    reporter.phase("tokenizer", &format!("{} files", plan.outputs.copied.len()));
    for c in &plan.outputs.copied {
        let bytes = source.read_file(&c.source, MAX_COPIED_BYTES).await?;
        if bytes.len() as u64 != c.bytes {
            return Err(SourceError::BadRange {
                path: c.source.clone(),
                range: 0..c.bytes,
                detail: format!(
                    "{} bytes arrived, the listing says {}",
                    bytes.len(),
                    c.bytes
                ),
            }
            .into());
        }
        let path = staging.join(&c.file);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
        }
        std::fs::write(&path, &bytes).map_err(|e| io_err(&path, e))?;
    }
    Ok(())
}

/// Every file of the install with its manifest kind, in plan order.
fn listed_files(plan: &Plan) -> Vec<(String, &'static str)> {
    let mut listed: Vec<(String, &'static str)> = output_file_paths(plan)
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            let kind = if i == 0 {
                "resident"
            } else if i <= plan.outputs.expert_pools.len() {
                "experts"
            } else {
                "rows"
            };
            (r, kind)
        })
        .collect();
    listed.extend(
        plan.outputs
            .copied
            .iter()
            .map(|c| (c.file.clone(), "tokenizer")),
    );
    listed
}

/// Fsync and hash every file in the staging directory, sorted by path: the
/// manifest's `files`. Hashing is verify-install's ([`crate::verify::hash_files`]),
/// on every core.
fn hash_listed(plan: &Plan, staging: &Path) -> Result<Vec<ManifestFile>, InstallError> {
    let listed = listed_files(plan);
    let mut sizes = Vec::with_capacity(listed.len());
    for (r, _) in &listed {
        let path = staging.join(r);
        let bytes = std::fs::metadata(&path)
            .map_err(|e| io_err(&path, e))?
            .len();
        File::open(&path)
            .and_then(|f| f.sync_all())
            .map_err(|e| io_err(&path, e))?;
        sizes.push(bytes);
    }
    let rels: Vec<&str> = listed.iter().map(|(r, _)| r.as_str()).collect();
    let hashes = crate::verify::hash_files(staging, &rels, 0, None);
    let mut files = Vec::with_capacity(listed.len());
    for (((r, kind), bytes), hash) in listed.into_iter().zip(sizes).zip(hashes) {
        let (sha256, _) = hash.map_err(|f| InstallError::Io {
            path: staging.join(&r).display().to_string(),
            source: std::io::Error::other(if f.at.is_empty() {
                f.detail
            } else {
                format!("{}: {}", f.at, f.detail)
            }),
        })?;
        files.push(ManifestFile {
            path: r,
            bytes,
            sha256,
            kind: kind.to_string(),
        });
    }
    files.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(files)
}

/// Hash every file, write the manifest, then the receipt, and fsync the directories.
pub(super) fn finalize(
    prepared: &Prepared,
    fingerprint: &str,
    staging: &Path,
    reporter: &dyn InstallReporter,
) -> Result<(), InstallError> {
    let plan = &prepared.plan;
    reporter.phase(
        "hash",
        &format!(
            "{} files",
            output_file_paths(plan).len() + plan.outputs.copied.len()
        ),
    );
    let hashed = tokio::task::block_in_place(|| hash_listed(plan, staging))?;
    let manifest = build_manifest(prepared, fingerprint, hashed);
    let mpath = staging.join(manifest::FILE_NAME);
    let manifest_bytes = manifest.to_canonical_bytes();
    write_synced(&mpath, &manifest_bytes)?;
    // The receipt: this install just hashed every file it lists.
    let receipt = Receipt::new(
        Prover::Install,
        crate::format::digest::sha256_hex(&manifest_bytes),
        manifest.files.iter().map(ReceiptFile::from).collect(),
        plan.source.repo.clone(),
        plan.source.commit.clone(),
        source_shards(plan),
        std::time::SystemTime::now(),
    );
    let rpath = staging.join(receipt::FILE_NAME);
    write_synced(&rpath, &receipt.to_canonical_bytes())?;
    for dir in ["packed_experts", "ple", "tokenizer", ""] {
        let d = staging.join(dir);
        if d.is_dir() {
            sync_dir(&d)?;
        }
    }
    Ok(())
}

/// Rename the staging directory into place (the old `<out>` aside first, then
/// removed), make that durable, and release the output.
pub(super) fn publish(
    staging: Staging,
    reporter: &dyn InstallReporter,
) -> Result<(), InstallError> {
    let out = &staging.out;
    reporter.phase("publish", &out.display().to_string());
    if out.exists() {
        let old = with_suffix(out, &format!(".replaced-{}", std::process::id()));
        std::fs::rename(out, &old).map_err(|e| io_err(out, e))?;
        std::fs::rename(&staging.dir, out).map_err(|e| io_err(out, e))?;
        std::fs::remove_dir_all(&old).map_err(|e| io_err(&old, e))?;
    } else {
        std::fs::rename(&staging.dir, out).map_err(|e| io_err(out, e))?;
    }
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        sync_dir(parent)?;
    }
    let _ = std::fs::remove_file(&staging.journal);
    let Staging {
        lock,
        lock_path,
        replacing,
        ..
    } = staging;
    drop(lock);
    let _ = std::fs::remove_file(&lock_path);
    drop(replacing);
    Ok(())
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), InstallError> {
    let mut f = File::create(path).map_err(|e| io_err(path, e))?;
    f.write_all(bytes).map_err(|e| io_err(path, e))?;
    f.sync_all().map_err(|e| io_err(path, e))
}

fn sync_dir(path: &Path) -> Result<(), InstallError> {
    File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_err(path, e))
}

/// The receipt's record of the source: every shard with a published SHA-256 was hashed
/// end to end by the jobs (a mismatch stops the install before this point), unless
/// `--no-verify-source`.
fn source_shards(plan: &Plan) -> Vec<ReceiptSource> {
    plan.shards
        .iter()
        .map(|s| ReceiptSource {
            path: s.path.clone(),
            sha256: s.sha256.clone(),
            verified: plan.options.verify_source && s.sha256.is_some(),
        })
        .collect()
}

fn build_manifest(prepared: &Prepared, fingerprint: &str, files: Vec<ManifestFile>) -> Manifest {
    let plan = &prepared.plan;
    let (scheme, bits) = match plan.options.quant {
        QuantMode::Int4 => (Scheme::Int4G64, 4),
        QuantMode::Bf16 => (Scheme::Passthrough, 0),
    };
    let overrides = match plan.options.quant {
        QuantMode::Bf16 => Vec::new(),
        QuantMode::Int4 => prepared.family_overrides.clone(),
    };
    Manifest {
        format: manifest::FORMAT.into(),
        version: manifest::VERSION,
        minor_version: manifest::MINOR_VERSION,
        family: plan.family.clone(),
        model_id: plan.source.repo.clone(),
        source: ManifestSource {
            repo: plan.source.repo.clone(),
            revision: plan.source.revision.clone(),
            commit: plan.source.commit.clone(),
            index_sha256: plan.source.index_sha256.clone(),
        },
        arch: ManifestArch {
            model_type: plan.arch.model_type.clone(),
            axes: plan.arch.axes.clone(),
            required_axes: plan.arch.required_axes.clone(),
        },
        plan_fingerprint: fingerprint.to_string(),
        quantized_at_install: match &plan.source_quant {
            // A pre-quantized source: nothing was quantized here; the record is the
            // source's own block, every module's bytes copied unchanged.
            Some(q) => QuantizedAtInstall {
                scheme: q.scheme,
                bits: q.scheme.bits().unwrap_or(0),
                group_size: q.scheme.group().unwrap_or(0),
                overrides: q.modules.clone(),
                parity_gate: format!(
                    "pre-quantized source ({}): packed weights, scales and biases copied \
                     unchanged",
                    q.format
                ),
                quality_gate: None,
            },
            None => QuantizedAtInstall {
                scheme,
                bits,
                group_size: 64,
                overrides,
                parity_gate:
                    "bit-exact with MLX 0.32.4 mx.quantize (tests/data/mlx_q4g64_golden.json)"
                        .into(),
                quality_gate: None,
            },
        },
        files,
        resident: ManifestResident {
            file: "resident.bin".into(),
            payload_start: plan.outputs.resident.payload_start,
            entries: plan.outputs.resident.index.tensors.len() as u64,
        },
        expert_pools: plan.outputs.expert_pools.clone(),
        row_pools: plan.outputs.row_pools.clone(),
        sidecars: prepared.sidecars.clone(),
        excluded_tensors: plan
            .tensors
            .iter()
            .filter(|t| matches!(t.dest, Dest::Excluded { .. }))
            .count() as u64,
        tool: ManifestTool {
            name: "gturbo".into(),
            version: env!("CARGO_PKG_VERSION").into(),
        },
    }
}
