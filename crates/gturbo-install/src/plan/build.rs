//! The planner's stages, run in order by [`build`]: arch, classify, resident, expert
//! pools, row pools, copied files, census and reads.

use std::collections::BTreeMap;

use super::arch::{check_axes_against_tensors, read_arch};
use super::classify::{self, Draft, DraftRole};
use super::error::PlanError;
use super::policy::Policy;
use super::profile::{AutoChoice, QuantMode};
use super::types::{
    COPIED_FILES, Census, CopiedFile, Dest, MAX_COPIED_BYTES, Outputs, PLAN_SCHEMA, PackedPart,
    Placed, Plan, PlanInput, PlanOptions, PlannedShard, PlannedTensor, Requant, ScaledFp8,
    SourcePart,
};
use super::{coalesce, experts, fp8, int4_ct, mlx, mxfp4, profile, rows};
use crate::format::Scheme;
use crate::format::resident::{ResidentInput, ResidentLayout};

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
    let fp8 = fp8::read_fp8(input.config)?;
    let ct = int4_ct::read_ct(input.config)?;
    let mx4 = mxfp4::read_mxfp4(input.config)?;
    check_ct_flags(ct.as_ref(), mx4.as_ref(), options)?;
    check_quant_flags(quant.as_ref(), fp8.as_ref(), options)?;
    // A compressed-tensors source's INT4 modules and an MXFP4 source's experts are
    // kept at the INT4 profile and dequantized (`bf16_round(scale × (q − 8))`; E2M1 ×
    // 2^(e − 127)) at any other, as `--requantize` dequantizes an MLX source's.
    let keeps_4bit = profile.id() == KEEPS_4BIT_SOURCES;
    let requantize =
        (quant.is_some() && options.requantize) || ((ct.is_some() || mx4.is_some()) && !keeps_4bit);
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
    let sources = mlx::sources(
        input.headers,
        quant.as_ref(),
        fp8.as_ref(),
        ct.as_ref(),
        mx4.as_ref(),
    )?;
    let policy = Policy {
        family,
        profile,
        num_layers: num_layers.unwrap_or(0),
        prequantized: quant.is_some() && !requantize,
        requantize,
    };
    let drafts = classify::classify(family, &arch, options, &policy, input.headers, sources)?;
    let (resident, resident_placed) = place_resident(&drafts)?;
    let (expert_pools, experts_placed) = experts::place(&policy, &drafts)?;
    check_axes_against_tensors(&arch, &fields, &drafts, &expert_pools)?;
    let (row_pools, rows_placed) = rows::place(&policy, &drafts)?;
    let tensors = assemble(drafts, [resident_placed, experts_placed, rows_placed]);
    let outputs = Outputs {
        resident,
        expert_pools,
        row_pools,
        copied: copied_files(input.repo_files, &family.file.tokenizer_files)?,
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

/// The quant flags against the source: a profile asked for by name over a
/// pre-quantized source (without `--requantize`), and `--requantize` over a source
/// that is not MLX-quantized (an FP8 one is always dequantized), are refused.
/// The profile at which a compressed-tensors source keeps its INT4 modules as
/// published (MLX affine 4-bit g32, lossless), and an MXFP4 source its experts (MLX
/// `mxfp4`, lossless: issue 25 §5); every other dequantizes them.
const KEEPS_4BIT_SOURCES: &str = "int4";

/// `--requantize` says nothing for a compressed-tensors INT4 or an MXFP4 source: its
/// 4-bit modules are kept at `--quant int4` and dequantized at any other profile.
fn check_ct_flags(
    ct: Option<&int4_ct::CtQuant>,
    mx4: Option<&mxfp4::Mxfp4Quant>,
    options: &PlanOptions,
) -> Result<(), PlanError> {
    if !options.requantize {
        return Ok(());
    }
    let (key, what) = match (ct, mx4) {
        (Some(_), _) => (
            int4_ct::KEY,
            "compressed-tensors INT4, whose modules are kept as published (MLX affine 4-bit \
             g32, lossless)",
        ),
        (None, Some(_)) => (
            mxfp4::KEY,
            "MXFP4, whose experts are kept as published (MLX mxfp4, lossless)",
        ),
        (None, None) => return Ok(()),
    };
    Err(PlanError::Config {
        field: format!("{key}.quant_method"),
        detail: format!(
            "--requantize: the source is {what} at --quant {KEEPS_4BIT_SOURCES} and \
             dequantized at any other profile; leave --requantize out"
        ),
    })
}

fn check_quant_flags(
    quant: Option<&mlx::MlxQuant>,
    fp8: Option<&fp8::Fp8Quant>,
    options: &PlanOptions,
) -> Result<(), PlanError> {
    if let Some(q) = quant
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
    if fp8.is_some() && options.requantize {
        return Err(PlanError::Config {
            field: fp8::KEY.into(),
            detail: format!(
                "--requantize: the source is FP8 block-scaled, which is always dequantized \
                 and quantized at the profile; leave --requantize out to install it at \
                 --quant {}",
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
    Ok(())
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
/// A source tensor of a module (scales, biases, block scales) as the plan records it.
fn source_part(p: mlx::PartSrc) -> SourcePart {
    SourcePart {
        name: p.name,
        shard: p.shard,
        dtype: p.dtype,
        shape: p.shape,
        src: p.src,
    }
}

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
            let requant = d.requant.map(requant_of);
            // An FP8 weight: the BF16 matrix it dequantizes to, whose `src` is its
            // FP8 codes; its block scales are staged by the executor.
            let fp8 = d.fp8.map(|p| ScaledFp8 {
                scale_inv: source_part(p),
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
                fp8,
                transposed: d.transposed,
            });
            continue;
        };
        // A pre-quantized module is three source tensors (two for MXFP4), each copied
        // into its stream of the one stored matrix.
        let cols = d.shape.last().copied().unwrap_or(0);
        let mxfp4 = packed.scheme == Scheme::Mxfp4;
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
            // A compressed-tensors module's biases are written from its scales; an
            // MXFP4 module has none.
            .filter(|(stream, _)| !(*stream == 2 && (packed.biases_from_scales || mxfp4)))
        {
            out.push(PlannedTensor {
                // MXFP4 parts keep their source names (`P_blocks`, `P_scales`), which
                // an error about their bytes names.
                name: match mxfp4 {
                    true => part.name,
                    false => format!("{stem}.{suffix}"),
                },
                shard: part.shard,
                dtype: part.dtype,
                shape: part.shape,
                src: part.src,
                scheme,
                dest: dest.clone(),
                packed: Some(PackedPart {
                    stream: stream as u8,
                    cols,
                    biases_from_scales: stream == 1 && packed.biases_from_scales,
                }),
                requant: None,
                fp8: None,
                transposed: false,
            });
        }
    }
    // Reads and segments go in (shard, offset) order.
    out.sort_by_key(|t| (t.shard, t.src[0]));
    out
}

/// A module `--requantize` (or a profile that does not keep 4-bit sources)
/// dequantizes: its layout and the scales and biases the executor stages.
fn requant_of(p: mlx::Packed) -> Requant {
    let [_, s, b] = p.parts.map(source_part);
    Requant {
        from: p.scheme,
        scales: s,
        biases: b,
        biases_from_scales: p.biases_from_scales,
    }
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

/// The *copied files* stage: the tokenizer and config files the repo has, the standard
/// ones and those the family's `tokenizer_files` name. Their sizes (from the listing)
/// are checked here, at plan time, so an absurd one is refused before any weight
/// streams rather than after.
fn copied_files(
    repo_files: &BTreeMap<String, u64>,
    family_files: &[String],
) -> Result<Vec<CopiedFile>, PlanError> {
    let extra = family_files
        .iter()
        .map(String::as_str)
        .filter(|f| !COPIED_FILES.contains(f));
    COPIED_FILES
        .iter()
        .copied()
        .chain(extra)
        .filter_map(|f| repo_files.get(f).map(|&bytes| (f, bytes)))
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
