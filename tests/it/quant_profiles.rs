//! Quant profiles (issue 12 point 3): `--quant int4|int8|bf16|mixed-3-4|mixed-3-6|
//! mixed-4-6|auto`.
//!
//! - Each profile's per-tensor choice is mlx-lm's own (`scripts/peers/mlx_quant_predicate.py`
//!   runs `quantize_model` with the `mixed_*` predicate, the model's own predicate on
//!   top) on a Qwen3-MoE of 10 layers and on SmolLM2's 30.
//! - A BF16 install at `mixed-3-6` is byte for byte `mlx_lm.convert --quant-predicate
//!   mixed_3_6` (the routers, at the family's INT8, against the 8-bit conversion's),
//!   and SmolLM2's runs like mlx-lm on that conversion.
//! - The dry run predicts every profile's installed bytes exactly, and verify-install
//!   passes each.
//! - `auto` follows the RAM rule at its boundaries (RAM injected with
//!   GTURBO_TEST_RAM_BYTES) and says why; a pre-quantized source refuses a named
//!   profile, naming its quantization, unless `--requantize` is given: then it is
//!   planned as the BF16 model it dequantizes to and installed as MLX's
//!   `mx.quantize(mx.dequantize(..))`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use gturbo_testkit::replica::{Qwen3MoeSpec, write_qwen3_moe};
use gturbo_testkit::skip::require_or_skip;
use serde_json::Value;

use crate::mlx_source::{
    Tolerance, check_dry_run, compare_logits, compare_with_sources, moe_cases, smol_cases,
    source_tensors,
};
use crate::support::cli::{gturbo, install_cmd, text};
use crate::support::temp_dir;

const GIB: u64 = 1 << 30;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `gturbo -q install --from snap --family family` with `extra`; `env` set.
fn install(
    snap: &Path,
    family: &str,
    out: &Path,
    extra: &[&str],
    env: &[(&str, String)],
) -> Output {
    let mut c = install_cmd(family, snap, out, extra);
    c.arg("-q");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

/// The dry run's JSON and the whole plan at `profile`.
fn dry_plan(snap: &Path, family: &str, profile: &str) -> (Value, Value) {
    dry_plan_with(snap, family, profile, &[])
}

/// [`dry_plan`] with `extra` flags.
fn dry_plan_with(snap: &Path, family: &str, profile: &str, extra: &[&str]) -> (Value, Value) {
    let tmp = temp_dir();
    let plan_file = tmp.path().join("plan.json");
    let mut args = vec![
        "--dry-run",
        "--json",
        "--quant",
        profile,
        "--emit-plan",
        plan_file.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let o = install(snap, family, &tmp.path().join("o.gturbo"), &args, &[]);
    assert!(o.status.success(), "{profile}: {}", text(&o));
    (
        serde_json::from_slice(&o.stdout).unwrap(),
        serde_json::from_slice(&std::fs::read(&plan_file).unwrap()).unwrap(),
    )
}

/// The plan's scheme per module, under mlx-lm's module paths (a resident `P.weight` is
/// `P`; an expert pool's part is `model.layers.L.mlp.switch_mlp.{part}_proj`).
fn plan_choice(plan: &Value) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for t in plan["tensors"].as_array().unwrap() {
        let name = t["name"].as_str().unwrap();
        if t["dest"]["kind"] == "resident"
            && let Some(m) = name.strip_suffix(".weight")
        {
            out.insert(m.to_string(), t["scheme"].as_str().unwrap().to_string());
        }
    }
    for p in plan["outputs"]["expert_pools"].as_array().unwrap() {
        for part in p["parts"].as_array().unwrap() {
            let scheme = part.get("scheme").unwrap_or(&p["scheme"]);
            out.insert(
                format!(
                    "model.layers.{}.mlp.switch_mlp.{}_proj",
                    p["layer"],
                    part["part"].as_str().unwrap()
                ),
                scheme.as_str().unwrap().to_string(),
            );
        }
    }
    out
}

/// mlx-lm's choice per profile (`Err`: the skip reason).
fn mlx_choice(config: &Path, profiles: &[&str]) -> Result<Value, String> {
    let o = Command::new("python3")
        .arg(root().join("scripts/peers/mlx_quant_predicate.py"))
        .arg(config)
        .args(profiles)
        .output()
        .map_err(|e| format!("cannot run python3: {e}"))?;
    if o.status.success() {
        return Ok(serde_json::from_slice(&o.stdout).unwrap());
    }
    let err = String::from_utf8_lossy(&o.stderr);
    if err.contains("No module named") {
        return Err(format!(
            "mlx-lm is not importable ({}); scripts/venv.sh test installs it",
            err.lines().last().unwrap_or("").trim()
        ));
    }
    panic!("scripts/peers/mlx_quant_predicate.py failed: {}", text(&o));
}

const PROFILES: [&str; 5] = ["int4", "int8", "mixed-3-4", "mixed-3-6", "mixed-4-6"];

/// Every module mlx-lm can quantize gets mlx-lm's width and group from gturbo's plan,
/// and gturbo quantizes nothing mlx-lm would not.
fn check_choices(test: &str, snap: &Path, family: &str) {
    let Some(want) = require_or_skip(test, mlx_choice(&snap.join("config.json"), &PROFILES)) else {
        return;
    };
    for profile in PROFILES {
        let (_, plan) = dry_plan(snap, family, profile);
        let got = plan_choice(&plan);
        let want = want[profile].as_object().unwrap();
        let mut raised = 0;
        for (module, scheme) in want {
            assert_eq!(
                got.get(module).map(String::as_str),
                scheme.as_str(),
                "{profile}: {module}"
            );
            raised += usize::from(scheme != "int3_g64" && scheme != "int4_g64");
        }
        for (module, scheme) in &got {
            assert!(
                scheme == "passthrough" || want.contains_key(module),
                "{profile}: gturbo quantizes {module} at {scheme}; mlx-lm has no such module"
            );
        }
        eprintln!(
            "{profile}: {} modules as mlx-lm chose ({raised} not at 3 or 4 bits)",
            want.len()
        );
    }
}

#[test]
fn profiles_choose_as_mlx_lm_on_a_ten_layer_qwen3_moe() {
    let tmp = temp_dir();
    let snap = tmp.path().join("snap");
    let spec = Qwen3MoeSpec {
        num_hidden_layers: 10,
        ..Qwen3MoeSpec::tiny()
    };
    write_qwen3_moe(&snap, &spec).unwrap();
    check_choices(
        "profiles_choose_as_mlx_lm_on_a_ten_layer_qwen3_moe",
        &snap,
        "qwen3_moe",
    );
}

fn smol_snapshot() -> Result<PathBuf, String> {
    let snap = std::env::var_os("GTURBO_SMOLLM2_SNAPSHOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target/smollm2/snapshot"));
    if snap.join("config.json").is_file() {
        Ok(snap)
    } else {
        Err(format!(
            "no SmolLM2 snapshot at {} (run scripts/fetch_smollm2.sh)",
            snap.display()
        ))
    }
}

#[test]
fn profiles_choose_as_mlx_lm_on_smollm2() {
    let test = "profiles_choose_as_mlx_lm_on_smollm2";
    let Some(snap) = require_or_skip(test, smol_snapshot()) else {
        return;
    };
    check_choices(test, &snap, "llama");
}

/// A BF16 install at `mixed-3-6` holds exactly the bytes `mlx_lm.convert
/// --quant-predicate mixed_3_6` wrote (mx.quantize at 3 and 6 bits), the routers
/// (INT8 by the family's override) those of the 8-bit conversion.
#[test]
fn mixed_3_6_install_of_bf16_moe_is_mlx_lm_convert_byte_for_byte() {
    let Some(dir) = moe_cases("mixed_3_6_install_of_bf16_moe_is_mlx_lm_convert_byte_for_byte")
    else {
        return;
    };
    let tmp = temp_dir();
    let out = tmp.path().join("m.gturbo");
    let o = install(
        &dir.join("snapshot"),
        "qwen3_moe",
        &out,
        &["--quant", "mixed-3-6"],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o));
    let mut src = source_tensors(&dir.join("mixed_3_6"));
    let q8 = source_tensors(&dir.join("q8g64"));
    let mut routers = 0;
    for (k, v) in q8 {
        if k.contains(".mlp.gate.") {
            src.insert(k, v);
            routers += 1;
        }
    }
    assert_eq!(routers, 6, "2 routers × weight, scales, biases");
    let (resident, experts) = compare_with_sources(&src, &out);
    // Per layer q, k, v, o and the router, plus the embedding and lm_head.
    assert_eq!(resident, 12, "quantized resident tensors compared");
    assert_eq!(experts, 2 * 3 * 8, "expert parts compared");
    let m: Value =
        serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    let q = &m["quantized_at_install"];
    assert_eq!(q["scheme"], "int3_g64");
    assert_eq!(
        (q["bits"].as_u64(), q["group_size"].as_u64()),
        (Some(3), Some(64))
    );
    let ov = q["overrides"].as_array().unwrap();
    for want in [
        serde_json::json!(["**.mlp.gate.weight", "int8_g64"]),
        serde_json::json!(["model.layers.1.self_attn.v_proj", "int6_g64"]),
        serde_json::json!(["lm_head", "int6_g64"]),
    ] {
        assert!(ov.contains(&want), "{want} not in {ov:?}");
    }
}

/// SmolLM2 at `mixed-3-6` from BF16 is mlx-lm's `mixed_3_6` conversion byte for byte,
/// and so runs like mlx-lm on it (logits at 32 positions, greedy tokens).
#[test]
fn mixed_3_6_install_of_bf16_smollm2_is_mlx_lm_convert_and_runs_like_it() {
    let test = "mixed_3_6_install_of_bf16_smollm2_is_mlx_lm_convert_and_runs_like_it";
    let Some(dir) = smol_cases(test) else {
        return;
    };
    let Some(snap) = require_or_skip(test, smol_snapshot()) else {
        return;
    };
    let tmp = temp_dir();
    let out = tmp.path().join("s.gturbo");
    let o = install(&snap, "llama", &out, &["--quant", "mixed-3-6"], &[]);
    assert!(o.status.success(), "{}", text(&o));
    let (resident, _) = compare_with_sources(&source_tensors(&dir.join("mixed_3_6")), &out);
    // 30 layers × 7 projections, and the (tied) embedding.
    assert_eq!(resident, 30 * 7 + 1);
    compare_logits(&out, dir, "mixed_3_6", Tolerance::RelativeToPosition);
}

/// Every profile's dry run predicts its install's bytes exactly, and each install
/// verifies.
#[test]
fn dry_run_predicts_every_profiles_bytes_exactly() {
    let tmp = temp_dir();
    let snap = tmp.path().join("snap");
    let spec = Qwen3MoeSpec {
        num_hidden_layers: 9,
        ..Qwen3MoeSpec::tiny()
    };
    write_qwen3_moe(&snap, &spec).unwrap();
    let mut totals = BTreeMap::new();
    for profile in [
        "int4",
        "int8",
        "bf16",
        "mixed-3-4",
        "mixed-3-6",
        "mixed-4-6",
    ] {
        let out = tmp.path().join(format!("{profile}.gturbo"));
        let dry = install(
            &snap,
            "qwen3_moe",
            &out,
            &["--quant", profile, "--dry-run", "--json"],
            &[],
        );
        assert!(dry.status.success(), "{}", text(&dry));
        let dry: Value = serde_json::from_slice(&dry.stdout).unwrap();
        assert_eq!(dry["quant"]["profile"], profile);
        let o = install(&snap, "qwen3_moe", &out, &["--quant", profile], &[]);
        assert!(o.status.success(), "{profile}: {}", text(&o));
        check_dry_run(&dry, &out);
        let v = gturbo()
            .args(["-q", "verify-install"])
            .arg(&out)
            .output()
            .unwrap();
        assert!(v.status.success(), "{profile}: {}", text(&v));
        totals.insert(profile, dry["outputs"]["total"].as_u64().unwrap());
    }
    // The widths order the sizes.
    assert!(totals["mixed-3-4"] < totals["mixed-3-6"]);
    assert!(totals["mixed-3-6"] < totals["mixed-4-6"]);
    assert!(totals["int4"] < totals["mixed-4-6"]);
    assert!(totals["int8"] < totals["bf16"]);
    eprintln!("installed bytes per profile: {totals:?}");
}

/// `--quant auto`: ≥ 48 GiB picks int4, 32–47 GiB mixed-3-4, below 32 GiB mixed-3-4
/// with its reason; an install that fits no profile is refused; the dry run says which
/// profile and why.
#[test]
fn auto_picks_by_ram_and_says_why() {
    let tmp = temp_dir();
    let snap = tmp.path().join("snap");
    write_qwen3_moe(&snap, &Qwen3MoeSpec::tiny()).unwrap();
    let auto = |ram: u64, json: bool| {
        let mut extra = vec!["--quant", "auto", "--dry-run"];
        if json {
            extra.push("--json");
        }
        install(
            &snap,
            "qwen3_moe",
            &tmp.path().join("a.gturbo"),
            &extra,
            &[("GTURBO_TEST_RAM_BYTES", ram.to_string())],
        )
    };
    for (ram, want, why) in [
        (48 * GIB, "int4", "48.0 GiB RAM is at least 48 GiB"),
        (48 * GIB - 1, "mixed-3-4", "RAM is 32–47 GiB"),
        (32 * GIB, "mixed-3-4", "32.0 GiB RAM is 32–47 GiB"),
        (32 * GIB - 1, "mixed-3-4", "below 32 GiB"),
    ] {
        let o = auto(ram, true);
        assert!(o.status.success(), "{}", text(&o));
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        let q = &v["quant"];
        assert_eq!(q["profile"], want, "{ram}");
        assert_eq!(q["auto"]["profile"], want, "{ram}");
        assert_eq!(q["auto"]["ram_bytes"], ram);
        assert_eq!(q["auto"]["ram_source"], "GTURBO_TEST_RAM_BYTES");
        let reason = q["auto"]["reason"].as_str().unwrap();
        assert!(reason.contains(why) && reason.contains("fits"), "{reason}");
        assert_eq!(
            q["auto"]["footprint_bytes"], q["footprint_bytes"],
            "the footprint auto weighed is the plan's"
        );
        let t = auto(ram, false);
        let stdout = String::from_utf8_lossy(&t.stdout);
        assert!(
            stdout.contains(&format!("quant           {want} (auto chose it: ")),
            "{stdout}"
        );
    }
    // Smaller than the install's resident set: refused, saying what it needs.
    let o = auto(1000, true);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--quant auto")
            && err.contains("no profile fits")
            && err.contains("mixed-3-4 needs"),
        "{err}"
    );
    // A bad injected figure is named.
    let o = install(
        &snap,
        "qwen3_moe",
        &tmp.path().join("a.gturbo"),
        &["--quant", "auto", "--dry-run"],
        &[("GTURBO_TEST_RAM_BYTES", "lots".into())],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("GTURBO_TEST_RAM_BYTES=\"lots\""));
}

/// A pre-quantized source keeps its widths: a named profile is refused, naming the
/// source's quantization; auto and no --quant install it as published.
#[test]
fn prequantized_source_refuses_a_named_profile() {
    let Some(dir) = moe_cases("prequantized_source_refuses_a_named_profile") else {
        return;
    };
    let tmp = temp_dir();
    let src = dir.join("q4g64");
    for profile in ["int8", "int4", "mixed-3-6", "bf16"] {
        let o = install(
            &src,
            "qwen3_moe",
            &tmp.path().join("p.gturbo"),
            &["--quant", profile, "--dry-run"],
            &[],
        );
        assert_eq!(o.status.code(), Some(2), "{profile}: {}", text(&o));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("config.json: field `quantization`")
                && err.contains("pre-quantized (mlx: int4_g64 by default")
                && err.contains(&format!("not at --quant {profile}"))
                && err.contains("or add --requantize to dequantize and requantize it"),
            "{err}"
        );
    }
    for extra in [&["--quant", "auto"][..], &[]] {
        let mut args = vec!["--dry-run", "--json"];
        args.extend_from_slice(extra);
        let o = install(
            &src,
            "qwen3_moe",
            &tmp.path().join("p.gturbo"),
            &args,
            &[("GTURBO_TEST_RAM_BYTES", (64 * GIB).to_string())],
        );
        assert!(o.status.success(), "{}", text(&o));
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["quant"]["profile"], "source");
    }
}

/// `--requantize` plans a pre-quantized source as the BF16 model it dequantizes to:
/// at every profile, each module gets the scheme the BF16 original gets (so mlx-lm's
/// choice, by the tests above). A 4-bit g64 MoE at `mixed-3-6` is installed, every
/// byte MLX's `mx.quantize(mx.dequantize(..))` at those schemes.
#[test]
fn requantize_plans_as_the_bf16_original_and_installs_mlx_bytes() {
    let test = "requantize_plans_as_the_bf16_original_and_installs_mlx_bytes";
    let Some(dir) = moe_cases(test) else {
        return;
    };
    let src = dir.join("q4g64");
    for profile in PROFILES.iter().chain(&["bf16"]) {
        let (dry, plan) = dry_plan_with(&src, "qwen3_moe", profile, &["--requantize"]);
        let (bf16_dry, bf16_plan) = dry_plan(&dir.join("snapshot"), "qwen3_moe", profile);
        assert_eq!(plan_choice(&plan), plan_choice(&bf16_plan), "{profile}");
        // The same weight files, to the byte (config.json, copied, differs).
        for k in ["resident", "experts"] {
            assert_eq!(dry["outputs"][k], bf16_dry["outputs"][k], "{profile} {k}");
        }
        assert_eq!(dry["quant"]["profile"], *profile);
    }
    let tmp = temp_dir();
    let (out, plan_file) = (tmp.path().join("m.gturbo"), tmp.path().join("plan.json"));
    let args = ["--quant", "mixed-3-6", "--requantize", "--emit-plan"];
    let mut args = args.to_vec();
    args.push(plan_file.to_str().unwrap());
    let o = install(&src, "qwen3_moe", &out, &args, &[]);
    assert!(o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--requantize: the source is pre-quantized (mlx: int4_g64 by default")
            && err.contains("quantized again at --quant mixed-3-6"),
        "{err}"
    );
    let Some((expected, targets)) = crate::mlx_source::mlx_requantized(test, &src, &plan_file)
    else {
        return;
    };
    assert!(targets.values().any(|s| s == "int6_g64") && targets.values().any(|s| s == "int3_g64"));
    let (resident, experts) = compare_with_sources(&expected, &out);
    assert_eq!((resident, experts), (12, 2 * 3 * 8));
}

/// `--requantize` on a source that is not pre-quantized is an error naming why (not a
/// silent no-op); without `--quant` it is a usage error.
#[test]
fn requantize_on_a_bf16_source_is_refused() {
    let tmp = temp_dir();
    let snap = tmp.path().join("snap");
    write_qwen3_moe(&snap, &Qwen3MoeSpec::tiny()).unwrap();
    let out = tmp.path().join("o.gturbo");
    let o = install(
        &snap,
        "qwen3_moe",
        &out,
        &["--quant", "int8", "--requantize", "--dry-run"],
        &[],
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(
            "config.json: field `quantization`: --requantize: the source is not pre-quantized"
        ) && err.contains("leave --requantize out to quantize it at --quant int8"),
        "{err}"
    );
    let o = install(
        &snap,
        "qwen3_moe",
        &out,
        &["--requantize", "--dry-run"],
        &[],
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--quant"),
        "{}",
        text(&o)
    );
    assert!(!out.exists());
}
