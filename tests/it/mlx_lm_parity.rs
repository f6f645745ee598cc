//! gturbo's INT4 g64 install of a Qwen3-MoE checkpoint against `mlx_lm.convert -q
//! --q-group-size 64 --q-bits 4` of the same snapshot: `scripts/peers/mlx_lm_parity.py`
//! compares every resident tensor and every expert (vs mlx-lm's stacked
//! `switch_mlp.*[e]`) byte for byte. Skipped when mlx-lm is not importable, unless the
//! run is strict (CI, `GTURBO_REQUIRE_PY=1`): then a missing peer fails the test.

use std::path::Path;
use std::process::{Command, Output};

use gturbo_testkit::replica::{Qwen3MoeSpec, write_qwen3_moe};
use gturbo_testkit::skip::require_or_skip;
use serde_json::Value;

use crate::support::cli::{install, text};
use crate::support::temp_dir;

fn script() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/peers/mlx_lm_parity.py")
}

/// Whether `python3` can import mlx-lm; panics instead when the peer is required.
fn mlx_lm_available(test: &str) -> bool {
    require_or_skip(test, mlx_lm_probe()).is_some()
}

/// `Err(why)` when `python3` cannot import mlx-lm.
fn mlx_lm_probe() -> Result<(), String> {
    let probe = Command::new("python3")
        .args(["-c", "import numpy, mlx.core, mlx_lm"])
        .output();
    let why = match probe {
        Ok(o) if o.status.success() => return Ok(()),
        Ok(o) => format!(
            "`python3 -c \"import numpy, mlx.core, mlx_lm\"` failed: {}",
            // The traceback's last line names the missing module.
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("")
                .trim()
        ),
        Err(e) => format!("cannot run python3: {e}"),
    };
    Err(format!(
        "{why} (scripts/venv.sh test installs scripts/requirements/requirements-mlx.txt)"
    ))
}

fn run_script(snapshot: &Path, install: &Path, mlx_dir: &Path) -> Output {
    Command::new("python3")
        .arg(script())
        .arg(snapshot)
        .arg(install)
        .arg("--mlx-dir")
        .arg(mlx_dir)
        .output()
        .unwrap()
}

/// Flip bit `mask` of the byte at `offset` in `path`.
fn flip(path: &Path, offset: usize, mask: u8) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[offset] ^= mask;
    std::fs::write(path, bytes).unwrap();
}

fn num(v: &Value) -> usize {
    usize::try_from(v.as_u64().unwrap()).unwrap()
}

#[test]
fn int4_install_matches_mlx_lm_convert_for_every_tensor_and_expert() {
    const TEST: &str = "int4_install_matches_mlx_lm_convert_for_every_tensor_and_expert";
    if !mlx_lm_available(TEST) {
        return;
    }
    let tmp = temp_dir();
    let snap = tmp.path().join("snap");
    let out = tmp.path().join("out.gturbo");
    let mlx_dir = tmp.path().join("mlx");
    let spec = Qwen3MoeSpec::tiny();
    write_qwen3_moe(&snap, &spec).unwrap();

    install("qwen3_moe", &snap, &out, &[]);

    // What must be compared, from the spec: 3 projections per expert per layer; per
    // layer q/k/v/o (INT4), the router (INT8 in both tools), four norms (passthrough);
    // then embed_tokens and lm_head (INT4) and the final norm.
    let (layers, experts) = (spec.num_hidden_layers, spec.num_experts);
    let expert_tensors = layers * experts * 3;
    let (int4, int8, pass) = (2 + 4 * layers, layers, 4 * layers + 1);
    let total = expert_tensors + int4 + int8 + pass;

    let o = run_script(&snap, &out, &mlx_dir);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(
        stdout.contains(&format!(
            "compared by kind: {expert_tensors} expert int4_g64, {int4} int4_g64, \
             {int8} int8_g64, {pass} passthrough\n{total} tensors compared, 0 mismatches\n"
        )),
        "{}",
        text(&o)
    );
    assert!(!stdout.contains("skipped"), "{}", text(&o));

    // The comparison can fail: one bit in an expert's biases and one in a resident
    // tensor's packed weights are each reported where they are.
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    let pool = &manifest["expert_pools"][1];
    let up = &pool["parts"][1];
    assert_eq!(up["part"], "up");
    let at = 5 * num(&pool["stride"]) + num(&up["offset"]) + num(&up["weights"]);
    let at = at + num(&up["scales"]) + 2 * 3;
    flip(&out.join(pool["file"].as_str().unwrap()), at + 1, 0x01);

    let res = std::fs::read(out.join("resident.bin")).unwrap();
    let n = usize::try_from(u64::from_le_bytes(res[8..16].try_into().unwrap())).unwrap();
    let index: Value = serde_json::from_slice(&res[16..16 + n]).unwrap();
    let entry = index["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "model.layers.0.self_attn.q_proj.weight")
        .unwrap();
    let start = num(&manifest["resident"]["payload_start"]);
    flip(
        &out.join("resident.bin"),
        start + num(&entry["weights"]["offset"]) + 4 * 10,
        0x10,
    );

    let o = run_script(&snap, &out, &mlx_dir);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        stdout.contains(&format!("{total} tensors compared, 2 mismatches\n")),
        "{}",
        text(&o)
    );
    assert!(
        stdout.contains(
            "MISMATCH model.layers.0.self_attn.q_proj.weight\n  weights: 1 of 4096 uint32 \
             elements differ; first at flat 10 (row 0, col 10)"
        ),
        "{}",
        text(&o)
    );
    assert!(
        stdout.contains(
            "MISMATCH model.layers.1.mlp.experts.5.up_proj.weight\n  biases: 1 of 128 \
             bfloat16 elements differ; first at flat 3 (row 1, col 1)"
        ),
        "{}",
        text(&o)
    );
}
