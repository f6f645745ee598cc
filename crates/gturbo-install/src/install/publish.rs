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
use crate::format::receipt::{self, Prover, Receipt, ReceiptCopied, ReceiptFile, ReceiptSource};
use crate::plan::placement::output_file_paths;
use crate::plan::{Dest, Plan};
use crate::source::{RangeSource, SourceError};

use super::nofollow;
use super::options::InstallReporter;
use super::stage::{Staging, with_suffix};
use super::{InstallError, Prepared, copied, io_err};

use crate::format::tokenizer;
use crate::plan::copied_max_bytes;

/// Copy the tokenizer and config files into the staging directory, each checked against
/// the hash its source publishes ([`copied`]) and `tokenizer.json` against the bounds
/// of what loading it may cost ([`crate::format::tokenizer`]); `record` gets the
/// receipt's entry of each. With `require_hash`, a file whose source published no hash
/// after all is refused.
pub(super) async fn copy_files(
    source: &dyn RangeSource,
    prepared: &Prepared,
    staging: &Path,
    reporter: &dyn InstallReporter,
    require_hash: bool,
    record: &mut Vec<ReceiptCopied>,
) -> Result<(), InstallError> {
    let plan = &prepared.plan;
    reporter.phase("tokenizer", &format!("{} files", plan.outputs.copied.len()));
    for c in &plan.outputs.copied {
        let bytes = source
            .read_file(&c.source, copied_max_bytes(&c.source).0)
            .await?;
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
        let published = copied::published(source, &prepared.repo, &c.source);
        published.check(&c.source, &bytes)?;
        if require_hash && !published.any() {
            return Err(InstallError::CopiedUnpublished {
                file: c.source.clone(),
            });
        }
        if c.source == tokenizer::FILE_NAME {
            tokenizer::check_bounds(&bytes).map_err(|e| InstallError::Invalid {
                file: c.source.clone(),
                field: e.field,
                detail: e.detail,
            })?;
        }
        let path = staging.join(&c.file);
        if let Some(dir) = path.parent() {
            nofollow::ensure_dirs(staging, dir)?;
        }
        nofollow::create_fresh(&path)?
            .write_all(&bytes)
            .map_err(|e| io_err(&path, e))?;
        record.push(published.record(&c.source, &c.file));
    }
    if let Some(spec) = &prepared.tiktoken {
        reporter.phase("tokenizer", &format!("converting {}", spec.file));
        crate::tiktoken::convert_staged(staging, spec).map_err(|(file, e)| {
            InstallError::Invalid {
                file,
                field: e.field,
                detail: e.detail,
            }
        })?;
    }
    Ok(())
}

/// Every file of the install with its manifest kind, in plan order; `converted`: the
/// `tokenizer.json` converted from a tiktoken file ([`copy_files`]).
fn listed_files(plan: &Plan, converted: bool) -> Vec<(String, &'static str)> {
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
    if converted {
        listed.push((format!("tokenizer/{}", tokenizer::FILE_NAME), "tokenizer"));
    }
    listed
}

/// Fsync and hash every file in the staging directory, sorted by path: the
/// manifest's `files`. Hashing is verify-install's ([`crate::verify::hash_files`]),
/// on every core; `known` holds the output files the stream hashed already (by output
/// file index, [`super::finished`]).
fn hash_listed(
    prepared: &Prepared,
    staging: &Path,
    known: &[Option<String>],
) -> Result<Vec<ManifestFile>, InstallError> {
    let listed = listed_files(&prepared.plan, prepared.tiktoken.is_some());
    let mut sizes = Vec::with_capacity(listed.len());
    for (r, _) in &listed {
        let path = staging.join(r);
        let bytes = std::fs::metadata(&path)
            .map_err(|e| io_err(&path, e))?
            .len();
        nofollow::open_read(&path)?
            .sync_all()
            .map_err(|e| io_err(&path, e))?;
        sizes.push(bytes);
    }
    let known = |i: usize| known.get(i).cloned().flatten();
    let rels: Vec<&str> = (listed.iter().enumerate())
        .filter(|&(i, _)| known(i).is_none())
        .map(|(_, (r, _))| r.as_str())
        .collect();
    let mut hashes = crate::verify::hash_files(staging, &rels, 0, None).into_iter();
    let mut files = Vec::with_capacity(listed.len());
    for (i, ((r, kind), bytes)) in listed.into_iter().zip(sizes).enumerate() {
        let hash = match known(i) {
            Some(sha) => Ok((sha, bytes)),
            None => hashes
                .next()
                .unwrap_or_else(|| Err(crate::verify::VerifyFailure::new(&r, "", "not hashed"))),
        };
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

/// Hash every file, write the manifest, then the receipt (with `copied`, what
/// [`copy_files`] recorded), and fsync the directories.
pub(super) fn finalize(
    prepared: &Prepared,
    fingerprint: &str,
    staging: &Path,
    known: &[Option<String>],
    copied: Vec<ReceiptCopied>,
    reporter: &dyn InstallReporter,
) -> Result<(), InstallError> {
    let plan = &prepared.plan;
    let early = known.iter().flatten().count();
    reporter.phase(
        "hash",
        &format!(
            "{} files ({early} hashed during the stream)",
            output_file_paths(plan).len()
                + plan.outputs.copied.len()
                + usize::from(prepared.tiktoken.is_some())
        ),
    );
    let hashed = tokio::task::block_in_place(|| hash_listed(prepared, staging, known))?;
    let manifest = build_manifest(prepared, fingerprint, hashed);
    let mpath = staging.join(manifest::FILE_NAME);
    let manifest_bytes = manifest.to_canonical_bytes();
    write_synced(&mpath, &manifest_bytes)?;
    // The receipt: this install just hashed every file it lists.
    let mut receipt = Receipt::new(
        Prover::Install,
        crate::format::digest::sha256_hex(&manifest_bytes),
        manifest.files.iter().map(ReceiptFile::from).collect(),
        plan.source.repo.clone(),
        plan.source.commit.clone(),
        source_shards(plan),
        std::time::SystemTime::now(),
    );
    receipt.source_copied = copied;
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
    // What is renamed into place is the directory this install staged, never a link
    // swapped in for it since.
    match nofollow::kind(&staging.dir)? {
        Some(t) if t.is_dir() => {}
        Some(_) => return Err(nofollow::planted(&staging.dir, "not the staging directory")),
        None => return Err(io_err(&staging.dir, std::io::ErrorKind::NotFound.into())),
    }
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
    if std::env::var_os(crate::env::GTURBO_TEST_EXIT_AFTER_PUBLISH).is_some() {
        // Test hook: a kill between the rename and the removal of the leftovers.
        std::process::exit(137);
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

/// A rerun after a kill between the publish rename and the removal of the journal and
/// the lock: when `<out>` is published by this very plan (its manifest has this plan's
/// fingerprint) and still verifies in full (every file's SHA-256, the receipt's
/// manifest hash), the leftovers are removed and the install is complete; returns
/// whether that was the case. `Ok(false)` leaves everything as it was, for
/// [`Staging::claim`] to refuse or proceed as usual.
pub(super) fn finish_interrupted(
    out: &Path,
    fingerprint: &str,
    reporter: &dyn InstallReporter,
) -> Result<bool, InstallError> {
    let journal = with_suffix(out, ".partial.journal");
    let lock_path = with_suffix(out, ".partial.lock");
    let is_dir = |p: &Path| nofollow::kind(p).map(|k| k.is_some_and(|t| t.is_dir()));
    let leftovers = nofollow::kind(&journal)?.is_some() || nofollow::kind(&lock_path)?.is_some();
    if !leftovers || !is_dir(out)? || nofollow::kind(&with_suffix(out, ".partial"))?.is_some() {
        return Ok(false);
    }
    // Held while deciding, so a concurrent install of the same output cannot race it.
    let lock = super::stage::take_lock(&lock_path)?;
    let ours = crate::verify::open_manifest(out).is_ok_and(|m| m.plan_fingerprint == fingerprint);
    if !ours {
        return Ok(false);
    }
    reporter.phase(
        "resume-check",
        &format!(
            "{} is published by this plan and its journal is left over (a run stopped during publication): verifying it",
            out.display()
        ),
    );
    let report = tokio::task::block_in_place(|| {
        crate::verify::verify(
            out,
            &crate::verify::VerifyOptions {
                write_receipt: false,
                ..Default::default()
            },
        )
    });
    if !report.ok {
        let first = report
            .failures
            .first()
            .map_or_else(|| "does not verify".to_string(), |f| f.to_string());
        return Err(InstallError::PublishedDamaged {
            path: out.display().to_string(),
            failure: first,
        });
    }
    for p in [&journal, &lock_path] {
        match std::fs::remove_file(p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(p, e)),
        }
    }
    drop(lock);
    reporter.phase(
        "publish",
        &format!(
            "{}: already installed ({}); removed the leftover journal and lock",
            out.display(),
            report.summary()
        ),
    );
    Ok(true)
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), InstallError> {
    let mut f = nofollow::create_fresh(path)?;
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

/// What the profile of an FP8 source was applied to (the manifest's parity gate);
/// empty for other sources.
fn fp8_note(plan: &crate::plan::Plan) -> &'static str {
    let mxfp4_from = |t: &crate::plan::PlannedTensor| {
        t.requant.as_ref().is_some_and(|r| r.from == Scheme::Mxfp4)
    };
    if plan.tensors.iter().any(|t| t.fp8.is_some()) {
        "; from an FP8 e4m3 source with 128×128 block scales, dequantized to BF16 as \
         MLX-LM's deepseek_v3 `sanitize`"
    } else if plan.tensors.iter().any(|t| t.scheme == Scheme::Mxfp4) {
        "; MXFP4 experts kept as published (mxfp4_g32, MLX's mxfp4 layout: bytes \
         unchanged)"
    } else if plan.tensors.iter().any(mxfp4_from) {
        "; MXFP4 experts dequantized to BF16 (E2M1 × 2^(e − 127)), then the profile \
         applied"
    } else {
        ""
    }
}

fn build_manifest(prepared: &Prepared, fingerprint: &str, files: Vec<ManifestFile>) -> Manifest {
    let plan = &prepared.plan;
    // The profile's default scheme, the family's overrides where they applied, then
    // the modules the profile's rules put elsewhere (plan.profile_deviations).
    let scheme = plan.profile_default.unwrap_or(Scheme::Int4G64);
    let bits = scheme.bits().unwrap_or(0);
    let family_overrides_applied = scheme != Scheme::Passthrough
        && crate::plan::profile::get(plan.options.quant.as_str())
            .map_or(true, |p| p.family_overrides());
    let mut overrides = if family_overrides_applied {
        prepared.family_overrides.clone()
    } else {
        Vec::new()
    };
    overrides.extend(plan.profile_deviations());
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
                quality_gate: (prepared.run_requires_recorded_quality
                    && q.scheme != Scheme::Passthrough)
                    .then(|| serde_json::json!({ "required_for_run": true })),
            },
            None => QuantizedAtInstall {
                scheme,
                bits,
                group_size: scheme.group().unwrap_or(64),
                overrides,
                parity_gate: format!(
                    "quant profile {} ({}); bit-exact with MLX 0.32.4 mx.quantize \
                     (tests/data/mlx_q4g64_golden.json, tests/data/mlx_quant_widths_golden.json){}{}",
                    plan.options.quant,
                    crate::plan::profile::PROFILES_FILE,
                    // --requantize: what the profile was applied to.
                    plan.requantized_from
                        .as_ref()
                        .map_or(String::new(), |q| format!(
                            "; requantized from a pre-quantized source ({}: {} by default), \
                         dequantized as mx.dequantize",
                            q.format,
                            q.scheme.label()
                        )),
                    fp8_note(plan)
                ),
                // FORMAT.md "quality.json": the family's requirement travels with the
                // install (a passthrough install is its own reference and needs none).
                quality_gate: (prepared.run_requires_recorded_quality
                    && scheme != Scheme::Passthrough)
                    .then(|| serde_json::json!({ "required_for_run": true })),
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
