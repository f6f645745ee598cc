//! Pre-quantized MLX sources (issue 12 point 1): real `mlx_lm.convert` outputs of the
//! test kit's tiny Qwen3-MoE (4-bit g64, 8-bit, 3-bit g128, `mixed_3_6`) and of
//! SmolLM2 (4-bit g64, `mixed_3_6`), made by `scripts/peers/mlx_source_cases.py` at test time
//! and cached under `target/mlx-cases/`. Each is served by the local hub and installed
//! pinned (revision and index SHA-256, every file against its LFS hash); then every
//! quantized tensor's installed bytes equal the source's, the dry run predicted every
//! file's size, `gturbo run`'s logits are within 1e-4 of mlx-lm's at every position of
//! a 32-token prompt and its greedy tokens are mlx-lm's. Hostile `quantization` blocks
//! are refused naming the file and the key.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use gturbo::runtime::experts::ExpertMode;
use gturbo::runtime::kernels::Cpu;
use gturbo::runtime::load::{self, LoadOptions};
use gturbo::runtime::models::decoder::Model;
use gturbo_testkit::hub::HubConfig;
use gturbo_testkit::replica::{Qwen3MoeSpec, write_qwen3_moe};
use gturbo_testkit::skip::require_or_skip;
use serde_json::Value;

use crate::support::cli::{gturbo, text, tree_hashes};
use crate::support::{sha256_hex, start_hub, temp_dir};

/// Largest |gturbo − mlx-lm| logit accepted, absolute: both compute in f32 on the
/// same bytes and differ only in summation order (measured on the tiny MoE: under
/// 2e-5). SmolLM2's 30 layers and logits up to 33 put that order's noise at 1.5e-4
/// absolute (6e-6 of the position's largest logit), so there the bound is 1e-4 times
/// the position's largest |logit| (see [`Tolerance`]).
pub(crate) const LOGIT_TOLERANCE: f32 = 1e-4;

/// How a logit difference is bounded.
#[derive(Clone, Copy)]
pub(crate) enum Tolerance {
    /// `|d| <= LOGIT_TOLERANCE`.
    Absolute,
    /// `|d| <= LOGIT_TOLERANCE * max |logit| of the position`.
    RelativeToPosition,
}
/// Greedy steps compared.
const STEPS: usize = 8;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A 32-token prompt inside `vocab`.
fn prompt(vocab: u64) -> Vec<u32> {
    (0..32u64).map(|i| ((i * 37 + 11) % vocab) as u32).collect()
}

/// Run the case script for `cases` of `snapshot` into `out`; `Err` when mlx-lm cannot
/// run (the skip reason).
fn make_cases(snapshot: &Path, out: &Path, vocab: u64, cases: &[&str]) -> Result<(), String> {
    let ids = serde_json::to_string(&prompt(vocab)).unwrap();
    let o = Command::new("python3")
        .arg(root().join("scripts/peers/mlx_source_cases.py"))
        .arg(snapshot)
        .arg(out)
        .arg(&ids)
        .arg(STEPS.to_string())
        .args(cases)
        .output()
        .map_err(|e| format!("cannot run python3: {e}"))?;
    if o.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&o.stderr);
    if err.contains("No module named") {
        return Err(format!(
            "mlx-lm is not importable ({}); scripts/venv.sh test installs it",
            err.lines().last().unwrap_or("").trim()
        ));
    }
    panic!("scripts/peers/mlx_source_cases.py failed: {}", text(&o));
}

const MOE_CASES: [&str; 4] = ["q4g64", "q8g64", "q3g128", "mixed_3_6"];
const SMOL_CASES: [&str; 2] = ["q4g64", "mixed_3_6"];

/// The tiny Qwen3-MoE conversions, made once per test run; `None` after the skip.
pub(crate) fn moe_cases(test: &str) -> Option<&'static PathBuf> {
    static DIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let r = DIR.get_or_init(|| {
        let dir = root().join("target/mlx-cases/qwen3-moe-tiny");
        let snap = dir.join("snapshot");
        let spec = Qwen3MoeSpec::tiny();
        if !snap.join("config.json").is_file() {
            write_qwen3_moe(&snap, &spec).map_err(|e| e.to_string())?;
        }
        make_cases(&snap, &dir, spec.vocab_size, &MOE_CASES).map(|()| dir)
    });
    require_or_skip(test, r.clone()).map(|_| r.as_ref().unwrap())
}

/// SmolLM2's conversions (snapshot from `scripts/fetch_smollm2.sh`,
/// GTURBO_SMOLLM2_SNAPSHOT overrides `target/smollm2/snapshot`).
pub(crate) fn smol_cases(test: &str) -> Option<&'static PathBuf> {
    static DIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let r = DIR.get_or_init(|| {
        let snap = std::env::var_os("GTURBO_SMOLLM2_SNAPSHOT")
            .map(PathBuf::from)
            .unwrap_or_else(|| root().join("target/smollm2/snapshot"));
        if !snap.join("config.json").is_file() {
            return Err(format!(
                "no SmolLM2 snapshot at {} (run scripts/fetch_smollm2.sh)",
                snap.display()
            ));
        }
        let dir = root().join("target/mlx-cases/smollm2");
        make_cases(&snap, &dir, 49152, &SMOL_CASES).map(|()| dir)
    });
    require_or_skip(test, r.clone()).map(|_| r.as_ref().unwrap())
}

/// Tensors by name: (dtype, shape, bytes).
pub(crate) type Tensors = BTreeMap<String, (String, Vec<u64>, Vec<u8>)>;

/// A safetensors file's tensors: name → (dtype, shape, bytes).
fn read_st(path: &Path) -> Tensors {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let head: BTreeMap<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    head.into_iter()
        .filter(|(k, _)| k != "__metadata__")
        .map(|(k, v)| {
            let off = v["data_offsets"].as_array().unwrap();
            let (a, b) = (
                off[0].as_u64().unwrap() as usize,
                off[1].as_u64().unwrap() as usize,
            );
            let shape = v["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .collect();
            (
                k,
                (
                    v["dtype"].as_str().unwrap().to_string(),
                    shape,
                    data[a..b].to_vec(),
                ),
            )
        })
        .collect()
}

/// Every tensor of a conversion's shards.
pub(crate) fn source_tensors(mlx: &Path) -> BTreeMap<String, (String, Vec<u64>, Vec<u8>)> {
    let mut all = BTreeMap::new();
    for e in std::fs::read_dir(mlx).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            all.extend(read_st(&p));
        }
    }
    all
}

/// Install `mlx` served by the local hub as `repo`, pinned; the dry run's JSON and the
/// install's directory.
pub(crate) fn install_over_hub(mlx: &Path, family: &str, out: &Path) -> Value {
    install_over_hub_with(mlx, family, out, &[]).0
}

/// [`install_over_hub`] with `extra` flags on both the dry run and the install; the
/// dry run's JSON and the install's output.
pub(crate) fn install_over_hub_with(
    mlx: &Path,
    family: &str,
    out: &Path,
    extra: &[&str],
) -> (Value, Output) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let repo = "mlx-community/test-model";
    let (hub, r) = rt.block_on(start_hub(repo, mlx, HubConfig::default()));
    let index_sha = sha256_hex(&std::fs::read(mlx.join("model.safetensors.index.json")).unwrap());
    let args = |dry: bool| {
        let mut c = gturbo();
        c.args(["-q", "install", "--family", family, repo, "--endpoint"])
            .arg(hub.url())
            .args([
                "--revision",
                &r.commit,
                "--index-sha256",
                &index_sha,
                "--json",
            ])
            .args(extra)
            .arg("--out")
            .arg(out);
        if dry {
            c.arg("--dry-run");
        }
        c.output().unwrap()
    };
    let dry = args(true);
    assert!(dry.status.success(), "dry run: {}", text(&dry));
    let o = args(false);
    assert!(o.status.success(), "install: {}", text(&o));
    // Every source shard's SHA-256 was checked against the hub's LFS hash.
    let stdout = String::from_utf8_lossy(&o.stdout);
    let done = stdout.lines().last().unwrap_or("");
    let report: Value = serde_json::from_str(done).unwrap();
    assert_eq!(report["event"], "done", "{}", text(&o));
    let shards = std::fs::read_dir(mlx)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "safetensors")
        })
        .count() as u64;
    assert_eq!(
        find(&report, "shards_verified"),
        Some(shards),
        "{}",
        text(&o)
    );
    drop(hub);
    (serde_json::from_slice(&dry.stdout).unwrap(), o)
}

/// The first number under key `k` anywhere in `v`.
fn find(v: &Value, k: &str) -> Option<u64> {
    match v {
        Value::Object(m) => m
            .get(k)
            .and_then(Value::as_u64)
            .or_else(|| m.values().find_map(|x| find(x, k))),
        Value::Array(a) => a.iter().find_map(|x| find(x, k)),
        _ => None,
    }
}

fn num(v: &Value) -> usize {
    v.as_u64().unwrap() as usize
}

/// Every quantized tensor of the install equals the source's bytes; returns how many
/// tensors (resident entries and expert parts × experts) were compared.
fn compare_bytes(mlx: &Path, out: &Path) -> (usize, usize) {
    compare_with_sources(&source_tensors(mlx), out)
}

/// Every tensor of the install equals the bytes of its namesake in `src` (MLX names:
/// `P.weight`/`P.scales`/`P.biases`, experts as `switch_mlp`); the counts compared.
pub(crate) fn compare_with_sources(
    src: &BTreeMap<String, (String, Vec<u64>, Vec<u8>)>,
    out: &Path,
) -> (usize, usize) {
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    let res = std::fs::read(out.join("resident.bin")).unwrap();
    let n = u64::from_le_bytes(res[8..16].try_into().unwrap()) as usize;
    let index: Value = serde_json::from_slice(&res[16..16 + n]).unwrap();
    let start = num(&manifest["resident"]["payload_start"]);
    let span =
        |s: &Value| &res[start + num(&s["offset"])..start + num(&s["offset"]) + num(&s["len"])];
    let mut resident = 0;
    for e in index["tensors"].as_array().unwrap() {
        let name = e["name"].as_str().unwrap();
        let stem = name.strip_suffix(".weight").unwrap_or(name);
        if e["scheme"] == "passthrough" {
            assert_eq!(span(&e["data"]), &src[name].2[..], "{name}");
            continue;
        }
        for (k, part) in [
            ("weights", "weight"),
            ("scales", "scales"),
            ("biases", "biases"),
        ] {
            let s = &src[&format!("{stem}.{part}")];
            assert_eq!(span(&e[k]), &s.2[..], "{name} {k}");
        }
        resident += 1;
    }
    let mut experts = 0;
    for pool in manifest["expert_pools"].as_array().unwrap() {
        let bytes = std::fs::read(out.join(pool["file"].as_str().unwrap())).unwrap();
        let (layer, stride, e_n) = (
            num(&pool["layer"]),
            num(&pool["stride"]),
            num(&pool["experts"]),
        );
        for part in pool["parts"].as_array().unwrap() {
            let stem = format!(
                "model.layers.{layer}.mlp.switch_mlp.{}_proj",
                part["part"].as_str().unwrap()
            );
            let mut at = num(&part["offset"]);
            let quant = num(&part["scales"]) > 0;
            let streams: &[(&str, &str)] = if quant {
                &[
                    ("weights", "weight"),
                    ("scales", "scales"),
                    ("biases", "biases"),
                ]
            } else {
                &[("weights", "weight")]
            };
            for &(k, suffix) in streams {
                let s = &src[&format!("{stem}.{suffix}")].2;
                let per = s.len() / e_n;
                assert_eq!(per, num(&part[k]), "{stem}.{suffix} per expert");
                for e in 0..e_n {
                    let o = e * stride + at;
                    assert_eq!(
                        &bytes[o..o + per],
                        &s[e * per..(e + 1) * per],
                        "{stem}.{suffix}[{e}]"
                    );
                }
                at += per;
            }
            experts += e_n;
        }
    }
    (resident, experts)
}

/// The install's logits over the reference prompt against mlx-lm's; the worst
/// difference.
pub(crate) fn compare_logits(dir: &Path, case_dir: &Path, case: &str, tol: Tolerance) -> f32 {
    let r: Value =
        serde_json::from_slice(&std::fs::read(case_dir.join(format!("{case}.ref.json"))).unwrap())
            .unwrap();
    let want: Vec<f32> = std::fs::read(case_dir.join(format!("{case}.logits.f32")))
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let prompt: Vec<u32> = r["prompt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let install = load::open(
        dir,
        LoadOptions {
            experts: ExpertMode::Resident,
            ..Default::default()
        },
    )
    .unwrap();
    let cpu = Cpu::new(2);
    let model = Model::new(&install, &cpu).unwrap();
    let vocab = model.cfg.vocab;
    assert_eq!(vocab as u64, r["vocab"].as_u64().unwrap());
    let mut s = model.session();
    let got = model.forward(&mut s, &prompt, true).unwrap();
    assert_eq!(got.len(), want.len());
    let mut worst = (0.0f32, 0usize);
    for (p, (gp, wp)) in got
        .chunks_exact(vocab)
        .zip(want.chunks_exact(vocab))
        .enumerate()
    {
        let bound = match tol {
            Tolerance::Absolute => LOGIT_TOLERANCE,
            Tolerance::RelativeToPosition => {
                LOGIT_TOLERANCE * wp.iter().fold(1.0f32, |m, w| m.max(w.abs()))
            }
        };
        for (i, (g, w)) in gp.iter().zip(wp).enumerate() {
            let d = (g - w).abs();
            assert!(
                d <= bound,
                "{case}: position {p} token {i}: gturbo {g} vs mlx-lm {w} (bound {bound})"
            );
            if d > worst.0 {
                worst = (d, p * vocab + i);
            }
        }
    }
    eprintln!(
        "{case}: worst |logit diff| {} at position {}, token {}",
        worst.0,
        worst.1 / vocab,
        worst.1 % vocab
    );

    // Greedy tokens through `gturbo run`.
    let ids: Vec<String> = prompt.iter().map(|t| t.to_string()).collect();
    let o = gturbo()
        .args(["-q", "run"])
        .arg(dir)
        .args([
            "--prompt-ids",
            &ids.join(","),
            "--max-tokens",
            &STEPS.to_string(),
            "--json",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        v["tokens"], r["greedy"],
        "{case}: greedy tokens gturbo vs mlx-lm"
    );
    worst.0
}

/// Sum of the install's file sizes against the dry run's prediction.
pub(crate) fn check_dry_run(dry: &Value, out: &Path) {
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    let on_disk: u64 = manifest["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            std::fs::metadata(out.join(f["path"].as_str().unwrap()))
                .unwrap()
                .len()
        })
        .sum();
    assert_eq!(
        dry["outputs"]["total"].as_u64(),
        Some(on_disk),
        "dry run vs installed bytes"
    );
}

fn run_case(dir: &Path, family: &str, case: &str, tol: Tolerance) -> Value {
    let tmp = temp_dir();
    let out = tmp.path().join(format!("{case}.gturbo"));
    let dry = install_over_hub(&dir.join(case), family, &out);
    check_dry_run(&dry, &out);
    let (resident, experts) = compare_bytes(&dir.join(case), &out);
    assert!(
        resident > 0,
        "{case}: no quantized resident tensor compared"
    );
    eprintln!(
        "{case}: {resident} quantized resident tensors and {experts} expert parts equal the source"
    );
    compare_logits(&out, dir, case, tol);
    serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap()
}

#[test]
fn mlx_moe_4bit_g64_installs_unchanged_and_runs_like_mlx_lm() {
    let Some(dir) = moe_cases("mlx_moe_4bit_g64_installs_unchanged_and_runs_like_mlx_lm") else {
        return;
    };
    let m = run_case(dir, "qwen3_moe", "q4g64", Tolerance::Absolute);
    let q = &m["quantized_at_install"];
    assert_eq!(q["scheme"], "int4_g64");
    assert_eq!(
        (q["bits"].clone(), q["group_size"].clone()),
        (4.into(), 64.into())
    );
    // The routers at 8 bits, as the source's block says.
    let ov = q["overrides"].as_array().unwrap();
    assert!(
        ov.contains(&serde_json::json!(["model.layers.0.mlp.gate", "int8_g64"])),
        "{ov:?}"
    );
}

#[test]
fn mlx_moe_8bit_installs_unchanged_and_runs_like_mlx_lm() {
    let Some(dir) = moe_cases("mlx_moe_8bit_installs_unchanged_and_runs_like_mlx_lm") else {
        return;
    };
    let m = run_case(dir, "qwen3_moe", "q8g64", Tolerance::Absolute);
    assert_eq!(m["expert_pools"][0]["scheme"], "int8_g64");
}

#[test]
fn mlx_moe_3bit_g128_installs_unchanged_and_runs_like_mlx_lm() {
    let Some(dir) = moe_cases("mlx_moe_3bit_g128_installs_unchanged_and_runs_like_mlx_lm") else {
        return;
    };
    let m = run_case(dir, "qwen3_moe", "q3g128", Tolerance::Absolute);
    // gate and up [E, 64, 128] at 3 bits g128; down's rows of 64 are not a group of 128,
    // so mlx-lm left it BF16 and so does the install.
    let p = &m["expert_pools"][0];
    assert_eq!(p["scheme"], "int3_g128");
    assert_eq!(p["parts"][2]["scheme"], "passthrough");
}

#[test]
fn mlx_moe_mixed_3_6_keeps_every_module_width_and_runs_like_mlx_lm() {
    let Some(dir) = moe_cases("mlx_moe_mixed_3_6_keeps_every_module_width_and_runs_like_mlx_lm")
    else {
        return;
    };
    let m = run_case(dir, "qwen3_moe", "mixed_3_6", Tolerance::Absolute);
    // Layer 1's down projection at 6 bits next to 3-bit gate and up (mixed_3_6's
    // "more bits" layers of a 2-layer model).
    let p = &m["expert_pools"][1];
    assert_eq!(p["scheme"], "int3_g64");
    assert_eq!(p["parts"][2]["scheme"], "int6_g64");
    assert!(p["parts"][1].get("scheme").is_none());
}

#[test]
fn mlx_smollm2_4bit_installs_unchanged_and_runs_like_mlx_lm() {
    let Some(dir) = smol_cases("mlx_smollm2_4bit_installs_unchanged_and_runs_like_mlx_lm") else {
        return;
    };
    run_case(dir, "llama", "q4g64", Tolerance::RelativeToPosition);
}

#[test]
fn mlx_smollm2_mixed_3_6_installs_unchanged_and_runs_like_mlx_lm() {
    let Some(dir) = smol_cases("mlx_smollm2_mixed_3_6_installs_unchanged_and_runs_like_mlx_lm")
    else {
        return;
    };
    run_case(dir, "llama", "mixed_3_6", Tolerance::RelativeToPosition);
}

/// What `--requantize` should have written, by MLX: the source's tensors, with every
/// module the plan at `plan_file` requantizes replaced by
/// `mx.quantize(mx.dequantize(..))` at the plan's scheme for it
/// (`scripts/peers/mlx_requant.py`); `None` after the skip. Also the plan's choice, module
/// path → scheme.
pub(crate) fn mlx_requantized(
    test: &str,
    mlx: &Path,
    plan_file: &Path,
) -> Option<(Tensors, BTreeMap<String, String>)> {
    let plan: Value = serde_json::from_slice(&std::fs::read(plan_file).unwrap()).unwrap();
    let targets: BTreeMap<String, String> = plan["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| {
            let scheme = t["scheme"].as_str().unwrap().to_string();
            // A requantized module, or a tensor the source left unquantized that the
            // profile quantizes (MLX quantizes it from its BF16 bytes).
            let module = match t["requant"]["scales"]["name"].as_str() {
                Some(scales) => scales.strip_suffix(".scales").unwrap(),
                None if scheme.starts_with("int") && t["dest"]["kind"] != "excluded" => {
                    t["name"].as_str().unwrap().strip_suffix(".weight")?
                }
                None => return None,
            };
            Some((module.to_string(), scheme))
        })
        .collect();
    let dir = plan_file.parent().unwrap();
    let (targets_file, expected) = (dir.join("targets.json"), dir.join("expected.safetensors"));
    std::fs::write(&targets_file, serde_json::to_vec(&targets).unwrap()).unwrap();
    let o = Command::new("python3")
        .arg(root().join("scripts/peers/mlx_requant.py"))
        .arg(mlx)
        .arg(&targets_file)
        .arg(&expected)
        .output()
        .unwrap_or_else(|e| panic!("cannot run python3: {e}"));
    if !o.status.success() {
        let err = String::from_utf8_lossy(&o.stderr);
        let why = Err::<(), _>(format!(
            "mlx is not importable ({})",
            err.lines().last().unwrap_or("").trim()
        ));
        if err.contains("No module named") {
            require_or_skip(test, why);
            return None;
        }
        panic!("scripts/peers/mlx_requant.py failed: {}", text(&o));
    }
    let mut src = source_tensors(mlx);
    src.extend(read_st(&expected));
    Some((src, targets))
}

/// The warning `--requantize` prints, naming the source's quantization and the target.
fn assert_requant_warning(o: &Output, source: &str, profile: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(&format!(
            "warning: --requantize: the source is pre-quantized (mlx: {source} by default"
        )) && err.contains(&format!(
            "its modules are dequantized and quantized again at --quant {profile}, which \
             loses quality"
        )),
        "{err}"
    );
}

/// A 4-bit g64 MLX MoE installed with `--quant int8 --requantize` over the hub:
/// every module at INT8 g64, every installed byte what MLX's
/// `mx.quantize(mx.dequantize(..))` gives, the dry run exact, the warning printed.
#[test]
fn mlx_moe_4bit_requantized_to_int8_is_mlx_dequantize_then_quantize() {
    let test = "mlx_moe_4bit_requantized_to_int8_is_mlx_dequantize_then_quantize";
    let Some(dir) = moe_cases(test) else {
        return;
    };
    let tmp = temp_dir();
    let (src, out) = (dir.join("q4g64"), tmp.path().join("r.gturbo"));
    let plan_file = tmp.path().join("plan.json");
    let plan_arg = plan_file.to_str().unwrap();
    let (dry, o) = install_over_hub_with(
        &src,
        "qwen3_moe",
        &out,
        &["--quant", "int8", "--requantize", "--emit-plan", plan_arg],
    );
    assert_requant_warning(&o, "int4_g64", "int8");
    check_dry_run(&dry, &out);
    assert_eq!(dry["quant"]["profile"], "int8");
    let Some((expected, targets)) = mlx_requantized(test, &src, &plan_file) else {
        return;
    };
    // Every quantized module of the source (attention, routers, experts), at INT8.
    let source_modules = source_tensors(&src)
        .keys()
        .filter(|k| k.ends_with(".scales"))
        .count();
    assert_eq!(targets.len(), source_modules);
    assert!(targets.values().all(|s| s == "int8_g64"), "{targets:?}");
    let (resident, experts) = compare_with_sources(&expected, &out);
    assert!(resident > 0 && experts > 0, "{resident} {experts}");
    eprintln!("{resident} resident tensors and {experts} expert parts equal MLX's requantization");
    let m: Value =
        serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    let q = &m["quantized_at_install"];
    assert_eq!(q["scheme"], "int8_g64");
    assert!(
        q["parity_gate"]
            .as_str()
            .unwrap()
            .contains("requantized from a pre-quantized source (mlx: int4_g64 by default)"),
        "{q}"
    );
}

/// SmolLM2's 4-bit MLX conversion requantized to INT8 from a local folder, killed
/// after two journaled reads and resumed: byte for byte the uninterrupted install,
/// which is byte for byte MLX's `mx.quantize(mx.dequantize(..))`.
#[test]
fn mlx_smollm2_requantize_resumes_byte_identical_and_matches_mlx() {
    let test = "mlx_smollm2_requantize_resumes_byte_identical_and_matches_mlx";
    let Some(dir) = smol_cases(test) else {
        return;
    };
    let tmp = temp_dir();
    let src = dir.join("q4g64");
    let plan_file = tmp.path().join("plan.json");
    let install = |out: &Path, abort: Option<&str>| {
        let mut c = gturbo();
        c.args(["-q", "install", "--family", "llama", "x/smol", "--from"])
            .arg(&src)
            .args(["--quant", "int8", "--requantize", "--range-mib", "8"])
            .args(["--emit-plan", plan_file.to_str().unwrap(), "--out"])
            .arg(out);
        if let Some(n) = abort {
            c.env("GTURBO_TEST_ABORT_AFTER_READS", n);
        }
        c.output().unwrap()
    };
    let reference = tmp.path().join("ref.gturbo");
    let o = install(&reference, None);
    assert!(o.status.success(), "{}", text(&o));
    assert_requant_warning(&o, "int4_g64", "int8");
    let plan: Value = serde_json::from_slice(&std::fs::read(&plan_file).unwrap()).unwrap();
    assert!(
        plan["reads"].as_array().unwrap().len() > 2,
        "too few reads to interrupt"
    );
    let out = tmp.path().join("resumed.gturbo");
    let killed = install(&out, Some("2"));
    assert_eq!(killed.status.code(), Some(137), "{}", text(&killed));
    let resumed = install(&out, None);
    assert!(resumed.status.success(), "{}", text(&resumed));
    assert!(
        String::from_utf8_lossy(&resumed.stderr).contains("2 kept from a previous run"),
        "{}",
        text(&resumed)
    );
    assert_eq!(tree_hashes(&out), tree_hashes(&reference));
    let Some((expected, targets)) = mlx_requantized(test, &src, &plan_file) else {
        return;
    };
    assert!(!targets.is_empty());
    let (resident, _) = compare_with_sources(&expected, &out);
    assert_eq!(
        resident,
        targets.values().filter(|s| *s != "passthrough").count()
    );
}
