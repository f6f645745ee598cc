//! `gturbo doctor [FAMILY | DIR] [--json]`: what this machine has, whether a family
//! would install and run here, and whether an install is sound, each as one check
//! that is `ok`, `warn`, `fail` or `info`; every check that is not OK says what to do
//! next. docs/DOCTOR.md documents the checks and the `--json` document.
//!
//! Everything is cheap: no weight is read. A family's size comes from its install plan
//! (shard headers from the hub or `--from`; offline, the check says so and the rest
//! still runs); an install's checks are verify-install's layout checks without hashing.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;
use serde::Serialize;

use crate::family::Family;
use crate::format::manifest::Manifest;
use crate::install::pin::{PinFlags, SourceChoice};
use crate::install::{IndexPin, InstallError, Prepared};
use crate::plan::profile::{self, Machine};
use crate::plan::{PlanOptions, QuantMode};
use crate::source::RangeSource;
use crate::verify::VerifyFailure;

use super::Failure;

/// `gturbo doctor`'s flags.
#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// A family id (will it install and run here?) or an install directory (is it
    /// sound?); neither: the machine alone.
    target: Option<String>,
    /// One JSON document on stdout instead of text (docs/DOCTOR.md).
    #[arg(long)]
    json: bool,
    /// For a family: plan from a local snapshot instead of the hub.
    #[arg(long = "from", value_name = "DIR", conflicts_with = "endpoint")]
    from: Option<PathBuf>,
    /// For a family: the hub endpoint to plan from.
    #[arg(long, env = "HF_ENDPOINT")]
    endpoint: Option<String>,
    /// For a family: where it would be installed (default `./<family>.gturbo`), for the
    /// free-space check.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// A check's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum Status {
    Ok,
    Info,
    Warn,
    Fail,
}

impl Status {
    fn word(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Info => "info",
            Status::Warn => "warn",
            Status::Fail => "FAIL",
        }
    }
}

/// One check.
#[derive(Debug, Serialize)]
struct Check {
    /// Stable id (`os`, `cpu`, `ram`, `gpu`, `auto`, `plan`, `disk`, `memory`,
    /// `manifest`, `layout`, `receipt`, `runner`, `quality`).
    id: &'static str,
    status: Status,
    /// One line.
    summary: String,
    /// What to do next; present whenever `status` is not `ok` or `info`.
    next: Option<String>,
    /// Machine-readable facts of this check.
    facts: serde_json::Value,
}

fn check(id: &'static str, status: Status, summary: String, facts: serde_json::Value) -> Check {
    Check {
        id,
        status,
        summary,
        next: None,
        facts,
    }
}

impl Check {
    fn next(mut self, what: impl Into<String>) -> Check {
        self.next = Some(what.into());
        self
    }
}

/// The `--json` document (`schema_version` 1).
#[derive(Debug, Serialize)]
struct Report {
    schema_version: u32,
    /// `machine`, `family` or `install`.
    kind: &'static str,
    target: Option<String>,
    /// No check failed.
    ok: bool,
    checks: Vec<Check>,
}

use crate::plan::profile::gib;

/// `gturbo doctor`.
pub async fn doctor_cmd(args: DoctorArgs) -> Result<(), Failure> {
    let mut checks = machine_checks();
    let machine = Machine::detect().ok().flatten();
    let kind = match args.target.as_deref() {
        None => {
            checks.push(auto_check(
                machine.as_ref(),
                None,
                "no family or install named",
            ));
            "machine"
        }
        Some(t) if Path::new(t).is_dir() => {
            install_checks(Path::new(t), machine.as_ref(), &mut checks);
            "install"
        }
        Some(t) => {
            let family = Family::builtin(t).map_err(|e| {
                Failure::usage(format!(
                    "{e}; `gturbo doctor` takes a family id or an install directory"
                ))
            })?;
            family_checks(&family, &args, machine.as_ref(), &mut checks).await;
            "family"
        }
    };
    let ok = checks.iter().all(|c| c.status != Status::Fail);
    let report = Report {
        schema_version: 1,
        kind,
        target: args.target.clone(),
        ok,
        checks,
    };
    if args.json {
        println!("{}", super::json_text(&report));
    } else {
        for c in &report.checks {
            println!("{:<4}  {:<8}  {}", c.status.word(), c.id, c.summary);
            if let Some(n) = &c.next {
                println!("{:<4}  {:<8}  -> {n}", "", "");
            }
        }
    }
    if ok {
        Ok(())
    } else {
        let failed: Vec<&str> = report
            .checks
            .iter()
            .filter(|c| c.status == Status::Fail)
            .map(|c| c.id)
            .collect();
        Err(Failure {
            code: 1,
            message: format!("doctor: {} failed", failed.join(", ")),
        })
    }
}

/// OS, CPU kernels, RAM, GPU adapters.
fn machine_checks() -> Vec<Check> {
    let mut out = Vec::new();
    let (os, arch) = (std::env::consts::OS, std::env::consts::ARCH);
    out.push(check(
        "os",
        Status::Ok,
        format!("{os} {arch}"),
        serde_json::json!({ "os": os, "arch": arch }),
    ));
    let (kernels, features) = crate::runtime::kernels::cpu_kernels();
    let cores = super::cores();
    let c = check(
        "cpu",
        if kernels == "cpu" {
            Status::Warn
        } else {
            Status::Ok
        },
        format!("{cores} cores; CPU kernels {kernels}: {features}"),
        serde_json::json!({ "cores": cores, "kernels": kernels, "features": features }),
    );
    out.push(if kernels == "cpu" {
        c.next("the portable kernels are correct but slower; a CPU with AVX2, FMA and F16C runs the fast ones")
    } else {
        c
    });
    out.push(match Machine::detect() {
        Ok(Some(m)) => check(
            "ram",
            Status::Ok,
            format!("{} ({})", gib(m.ram_bytes), m.ram_source),
            serde_json::json!({ "bytes": m.ram_bytes, "source": m.ram_source }),
        ),
        Ok(None) => check(
            "ram",
            Status::Warn,
            "unknown (no /proc/meminfo, no sysctl hw.memsize)".into(),
            serde_json::json!({ "bytes": null }),
        )
        .next("name a profile with --quant: auto needs the RAM"),
        Err(e) => check("ram", Status::Fail, e, serde_json::json!({ "bytes": null }))
            .next("unset GTURBO_TEST_RAM_BYTES (a test hook) or give it a number"),
    });
    out.push(gpu_check());
    out
}

#[cfg(feature = "gpu")]
fn gpu_check() -> Check {
    if !super::run::may_have_gpu() {
        return check(
            "gpu",
            Status::Info,
            "no GPU device node; gturbo run uses the CPU kernels".into(),
            serde_json::json!({ "adapters": [] }),
        );
    }
    let all = crate::runtime::kernels::gpu::list_adapters();
    let facts = serde_json::json!({ "adapters": all.iter().map(|a| serde_json::json!({
        "index": a.index, "name": a.name, "backend": a.backend, "device_type": a.device_type,
        "driver": a.driver, "max_buffer_bytes": a.max_buffer_bytes,
    })).collect::<Vec<_>>() });
    let hardware: Vec<String> = all
        .iter()
        .filter(|a| a.device_type != "Cpu")
        .map(|a| a.to_string())
        .collect();
    if hardware.is_empty() {
        check(
            "gpu",
            Status::Warn,
            format!(
                "no hardware GPU adapter ({} software ones); gturbo run --backend auto uses the CPU",
                all.len()
            ),
            facts,
        )
        .next("install the GPU's Vulkan (Linux), Metal (macOS) or DX12 (Windows) driver to use it")
    } else {
        check("gpu", Status::Ok, hardware.join("; "), facts)
    }
}

#[cfg(not(feature = "gpu"))]
fn gpu_check() -> Check {
    check(
        "gpu",
        Status::Info,
        "this gturbo was built without the `gpu` feature; gturbo run uses the CPU kernels".into(),
        serde_json::json!({ "adapters": null }),
    )
}

/// The profile `auto` would choose (the one rule, [`profile::auto_rule`]), against the
/// install's footprint where known.
fn auto_check(machine: Option<&Machine>, footprint: Option<u64>, why_unknown: &str) -> Check {
    let Some(m) = machine else {
        return check(
            "auto",
            Status::Warn,
            "--quant auto cannot choose: the RAM is unknown".into(),
            serde_json::json!({ "profile": null }),
        )
        .next("name a profile with --quant (int4, mixed-3-4, ...)");
    };
    match profile::auto_rule(m, |_| footprint) {
        Ok(c) => {
            let reason = if footprint.is_none() {
                format!("{} ({why_unknown})", c.reason)
            } else {
                c.reason.clone()
            };
            check(
                "auto",
                Status::Ok,
                format!("--quant auto would choose {}: {reason}", c.profile),
                serde_json::to_value(&c).expect(super::REPORT_SERIALIZES),
            )
        }
        Err(e) => check(
            "auto",
            Status::Fail,
            e,
            serde_json::json!({ "profile": null }),
        )
        .next("use a machine with more memory, or name a smaller profile with --quant"),
    }
}

/// Free bytes at `path`'s nearest existing ancestor (`GTURBO_TEST_FREE_DISK_BYTES`
/// when set, a test hook), with the folder measured.
fn free_space(path: &Path) -> Result<(u64, PathBuf), String> {
    let abs = std::path::absolute(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let at = abs
        .ancestors()
        .find(|a| a.is_dir())
        .unwrap_or(Path::new("/"))
        .to_path_buf();
    let key = crate::env::GTURBO_TEST_FREE_DISK_BYTES;
    if let Some(v) = std::env::var_os(key) {
        let v = v.to_string_lossy();
        return v
            .trim()
            .parse()
            .map(|n| (n, at))
            .map_err(|_| format!("{key}={v:?}: not a whole number of bytes"));
    }
    fs4::available_space(&at)
        .map(|n| (n, at.clone()))
        .map_err(|e| format!("{}: {e}", at.display()))
}

/// Plan the family (int4 and the profile auto would pick; headers only), then disk,
/// memory and runner.
async fn family_checks(
    family: &Family,
    args: &DoctorArgs,
    machine: Option<&Machine>,
    out: &mut Vec<Check>,
) {
    let (planned, auto_refused) = plan_with_auto_fallback(family, args, machine).await;
    let target = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("{}.gturbo", family.id())));
    match planned {
        Ok((p, describe)) => {
            plan_checks(family, &p, &describe, auto_refused, machine, &target, out)
        }
        Err(e) => unplanned_checks(family, &e, machine, out),
    }
    out.push(runner_check(family.id(), &family.file.arch.required_axes));
}

/// The source the doctor plans `family` from (`--from`'s snapshot, else the hub with
/// short waits), with the index pin the family reads it at.
fn doctor_source(
    family: &Family,
    args: &DoctorArgs,
) -> Result<(Box<dyn RangeSource>, IndexPin), String> {
    let flags = PinFlags {
        target: family.id(),
        family: None,
        family_file: None,
        revision: None,
        index_sha256: None,
    };
    let SourceChoice {
        repo,
        revision,
        index_pin,
        ..
    } = flags.source(family).map_err(|e| e.to_string())?;
    let s: Box<dyn RangeSource> = match &args.from {
        Some(dir) => {
            Box::new(crate::source::local::LocalSource::open(dir, None).map_err(|e| e.to_string())?)
        }
        None => {
            let endpoint = args
                .endpoint
                .clone()
                .unwrap_or_else(|| crate::env::DEFAULT_ENDPOINT.to_string());
            // A doctor answers quickly: one retry, short waits.
            let mut config = crate::source::http::HttpConfig::new(&endpoint, &repo, &revision);
            config.token = crate::source::token::discover();
            config.max_attempts = 2;
            config.max_retry_after = Duration::from_secs(5);
            config.progress.range_timeout = Duration::from_secs(30);
            Box::new(crate::source::http::HttpSource::new(config).map_err(|e| e.to_string())?)
        }
    };
    Ok((s, index_pin))
}

/// Why the doctor could not plan: the installer refused (`Ok`, so that auto's refusal
/// can be told apart), or the source could not be opened (`Err`, its text).
type PlanFailure = Result<InstallError, String>;

/// The family's plan at `quant` (headers only), with its source's description.
async fn prepare_at(
    family: &Family,
    args: &DoctorArgs,
    machine: Option<&Machine>,
    quant: QuantMode,
) -> Result<(Prepared, String), PlanFailure> {
    let (src, index_pin) = doctor_source(family, args).map_err(Err)?;
    let settings = crate::install::PrepareSettings {
        family: family.clone(),
        index_pin,
        options: PlanOptions {
            quant,
            machine: machine.cloned(),
            ..PlanOptions::default()
        },
    };
    crate::install::prepare(src.as_ref(), &settings)
        .await
        .map(|p| (p, src.describe()))
        .map_err(Ok)
}

/// The plan at the profile auto would choose; when auto finds none that fits, the
/// plan at int4 still gives the sizes, and auto's refusal (the second value) is its
/// own check.
async fn plan_with_auto_fallback(
    family: &Family,
    args: &DoctorArgs,
    machine: Option<&Machine>,
) -> (Result<(Prepared, String), String>, Option<String>) {
    let prepare = |quant| prepare_at(family, args, machine, quant);
    let mut auto_refused = None;
    let planned = match machine {
        Some(_) => match prepare(QuantMode::new(profile::AUTO).unwrap_or_default()).await {
            Err(Ok(InstallError::Plan(crate::plan::PlanError::Config { field, detail })))
                if field == "--quant auto" =>
            {
                auto_refused = Some(detail);
                prepare(QuantMode::default()).await
            }
            other => other,
        },
        None => prepare(QuantMode::default()).await,
    }
    .map_err(|e| match e {
        Ok(e) => e.to_string(),
        Err(e) => e,
    });
    (planned, auto_refused)
}

/// A planned family: its plan, auto's choice (or refusal), disk and memory.
fn plan_checks(
    family: &Family,
    p: &Prepared,
    describe: &str,
    auto_refused: Option<String>,
    machine: Option<&Machine>,
    target: &Path,
    out: &mut Vec<Check>,
) {
    let plan = &p.plan;
    let totals = plan.totals();
    out.push(check(
        "plan",
        Status::Ok,
        format!(
            "{} from {describe}: {} to write at {} ({} source shards)",
            family.id(),
            gib(totals.total),
            plan.options.quant,
            plan.shards.len()
        ),
        serde_json::json!({
            "source": describe, "profile": plan.options.quant.as_str(),
            "install_bytes": totals.total, "footprint_bytes": plan.footprint(),
            "fingerprint": plan.fingerprint(),
        }),
    ));
    out.push(match (&plan.auto, auto_refused) {
        (_, Some(e)) => check(
            "auto",
            Status::Fail,
            e,
            serde_json::json!({ "profile": null }),
        )
        .next("use a machine with more memory, or name a smaller profile with --quant"),
        (Some(c), None) => check(
            "auto",
            Status::Ok,
            format!("--quant auto would choose {}: {}", c.profile, c.reason),
            serde_json::to_value(c).expect(super::REPORT_SERIALIZES),
        ),
        (None, None) => auto_check(machine, Some(plan.footprint()), ""),
    });
    out.push(disk_check(target, totals.total));
    out.push(memory_check(machine, plan.footprint()));
}

/// A family that could not be planned (offline, or the hub refused): the machine's
/// checks stand; the sizes are unknown (a family pins its index's hash, not its
/// shards' headers).
fn unplanned_checks(family: &Family, e: &str, machine: Option<&Machine>, out: &mut Vec<Check>) {
    out.push(
        check(
            "plan",
            Status::Warn,
            format!(
                "cannot plan {} (its size needs the shard headers from the hub): {e}",
                family.id()
            ),
            serde_json::json!({ "error": e }),
        )
        .next(format!(
            "check the network or HF_ENDPOINT, or plan from a local snapshot: gturbo doctor {} --from DIR",
            family.id()
        )),
    );
    out.push(auto_check(
        machine,
        None,
        "the install's size is unknown without a plan",
    ));
    out.push(
        check(
            "disk",
            Status::Warn,
            "free space not checked: the install's size is unknown without a plan".into(),
            serde_json::json!({ "needed_bytes": null }),
        )
        .next("plan it first (see the plan check)"),
    );
}

/// Free space at the output location against what an install of `total` bytes needs
/// (the install's own preflight rule: its bytes plus the reserve).
fn disk_check(target: &Path, total: u64) -> Check {
    let needed = total.saturating_add(crate::install::space_reserve(total));
    match free_space(target) {
        Ok((free, at)) => {
            let facts = serde_json::json!({
                "path": at.display().to_string(), "free_bytes": free, "needed_bytes": needed,
            });
            let summary = format!(
                "{} free at {}, the install needs {} (with its reserve)",
                gib(free),
                at.display(),
                gib(needed)
            );
            if free >= needed {
                check("disk", Status::Ok, summary, facts)
            } else {
                check("disk", Status::Fail, summary, facts).next(format!(
                    "free {} there, or install elsewhere with --out DIR",
                    gib(needed - free)
                ))
            }
        }
        Err(e) => check(
            "disk",
            Status::Fail,
            format!("cannot measure free space: {e}"),
            serde_json::json!({ "needed_bytes": needed }),
        )
        .next("pass --out with a folder on the disk to install to"),
    }
}

/// The install's resident + working set against the RAM.
fn memory_check(machine: Option<&Machine>, footprint: u64) -> Check {
    let Some(m) = machine else {
        return check(
            "memory",
            Status::Warn,
            format!("{} resident + working set; RAM unknown", gib(footprint)),
            serde_json::json!({ "footprint_bytes": footprint, "ram_bytes": null }),
        )
        .next("make sure the machine has that much memory free");
    };
    let facts = serde_json::json!({ "footprint_bytes": footprint, "ram_bytes": m.ram_bytes });
    let summary = format!(
        "{} resident + working set, {} RAM",
        gib(footprint),
        gib(m.ram_bytes)
    );
    if footprint <= m.ram_bytes {
        check("memory", Status::Ok, summary, facts)
    } else {
        check("memory", Status::Fail, summary, facts).next(
            "install at a smaller profile (--quant mixed-3-4), or run with expert streaming on a machine with more memory",
        )
    }
}

/// Whether a runner implements the family's axes (the gate `gturbo run` applies).
fn runner_check(family: &str, required: &[String]) -> Check {
    match crate::runtime::gate::check(family, required) {
        Ok(r) => check(
            "runner",
            Status::Ok,
            format!("runner `{}` implements every required axis", r.name),
            serde_json::json!({ "runner": r.name }),
        ),
        Err(e) => check(
            "runner",
            Status::Warn,
            e.to_string(),
            serde_json::json!({ "runner": null }),
        )
        .next(
            "gturbo can install it and verify it, but `gturbo run` refuses it until a runner lands",
        ),
    }
}

/// An install directory: manifest, layout (no hashing), receipt, runner, quality,
/// memory, and auto's choice.
fn install_checks(dir: &Path, machine: Option<&Machine>, out: &mut Vec<Check>) {
    let verify_next = format!(
        "reinstall it (gturbo install ... --overwrite), then gturbo verify-install {}",
        dir.display()
    );
    let m = match crate::verify::open_manifest(dir) {
        Ok(m) => m,
        Err(e) => {
            out.push(
                check(
                    "manifest",
                    Status::Fail,
                    e.to_string(),
                    serde_json::json!({ "error": e }),
                )
                .next(verify_next),
            );
            out.push(auto_check(
                machine,
                None,
                "the install's manifest is unreadable",
            ));
            return;
        }
    };
    out.push(manifest_check(&m));
    let failures = crate::verify::check_layout(dir, &m);
    let layout_ok = failures.is_empty();
    out.push(layout_check(&failures, &verify_next));
    out.push(receipt_check(dir, layout_ok));
    out.push(runner_check(&m.family, &m.arch.required_axes));
    out.push(quality_check(dir, &m));
    out.push(memory_check(machine, install_footprint(&m)));
    out.push(auto_check(
        machine,
        None,
        "the RAM rule for a fresh install; this install's own fit is the memory check",
    ));
}

/// What the install's manifest says it is.
fn manifest_check(m: &Manifest) -> Check {
    check(
        "manifest",
        Status::Ok,
        format!(
            "{} install of {} ({}), {} files",
            m.family,
            m.model_id,
            m.quantized_at_install.scheme.label(),
            m.files.len()
        ),
        serde_json::json!({
            "family": m.family, "model_id": m.model_id, "version": m.version,
            "minor_version": m.minor_version, "scheme": m.quantized_at_install.scheme.label(),
            "files": m.files.len(),
        }),
    )
}

/// verify-install's layout checks (no hashing), by their `failures`.
fn layout_check(failures: &[VerifyFailure], verify_next: &str) -> Check {
    if failures.is_empty() {
        check(
            "layout",
            Status::Ok,
            "every file present at its size; the resident index and the pools agree with the manifest (not hashed)".into(),
            serde_json::json!({ "failures": [] }),
        )
    } else {
        let first = failures[0].to_string();
        check(
            "layout",
            Status::Fail,
            format!(
                "{} layout check{} failed; first: {first}",
                failures.len(),
                if failures.len() == 1 { "" } else { "s" }
            ),
            serde_json::json!({ "failures": failures }),
        )
        .next(verify_next)
    }
}

/// Whether a receipt vouches for the files as they are (only when the layout holds).
fn receipt_check(dir: &Path, layout_ok: bool) -> Check {
    let verify_hint = format!(
        "gturbo verify-install {} (hashes every byte and writes the receipt)",
        dir.display()
    );
    match crate::verify::receipt_vouches(dir) {
        Ok(true) if layout_ok => check(
            "receipt",
            Status::Ok,
            "the receipt names this manifest and every file at its size".into(),
            serde_json::json!({ "vouches": true }),
        ),
        Ok(_) => check(
            "receipt",
            Status::Warn,
            "no receipt vouches for the files as they are".into(),
            serde_json::json!({ "vouches": false }),
        )
        .next(verify_hint),
        Err(e) => check(
            "receipt",
            Status::Fail,
            e.to_string(),
            serde_json::json!({ "vouches": false, "error": e }),
        )
        .next(verify_hint),
    }
}

/// The recorded quality result, against whether the family requires one to run.
fn quality_check(dir: &Path, m: &Manifest) -> Check {
    let required = m
        .quantized_at_install
        .quality_gate
        .as_ref()
        .and_then(|g| g.get("required_for_run"))
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    match crate::verify::recorded_quality(dir) {
        Ok(Some(q)) => check(
            "quality",
            Status::Ok,
            format!(
                "mean KL {:.4} nats, top-1 agreement {:.1}% against {} ({})",
                q.mean_kl_nats,
                q.top1_agreement * 100.0,
                q.reference.model_id,
                q.reference.scheme
            ),
            serde_json::json!({ "recorded": true, "required_for_run": required,
                "mean_kl_nats": q.mean_kl_nats, "top1_agreement": q.top1_agreement }),
        ),
        Ok(None) if required => check(
            "quality",
            Status::Fail,
            "no recorded quality result, and the family requires one before gturbo run".into(),
            serde_json::json!({ "recorded": false, "required_for_run": true }),
        )
        .next(format!(
            "gturbo eval {} REFERENCE_DIR --record (REFERENCE_DIR: a --quant bf16 install)",
            dir.display()
        )),
        Ok(None) => check(
            "quality",
            Status::Info,
            "no recorded quality result (not required to run)".into(),
            serde_json::json!({ "recorded": false, "required_for_run": false }),
        ),
        Err(e) => check(
            "quality",
            Status::Fail,
            e.to_string(),
            serde_json::json!({ "recorded": false, "error": e }),
        )
        .next(format!(
            "record it again: gturbo eval {} REFERENCE_DIR --record",
            dir.display()
        )),
    }
}

/// The install's resident + working set, from its manifest.
fn install_footprint(m: &Manifest) -> u64 {
    let resident = m
        .files
        .iter()
        .filter(|f| f.kind == "resident")
        .map(|f| f.bytes)
        .sum();
    crate::plan::footprint(resident, &m.expert_pools, &m.arch.axes)
}
