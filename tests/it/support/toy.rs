//! The tiny real-layout checkpoints with transformers goldens (`tests/data/*_toy`, made
//! by `scripts/golden/gen_*_golden.py`): their meta, their logits in gturbo's call
//! order, and installing them.

use std::path::Path;

use serde_json::Value;

use super::cli::{gturbo, text};
use super::f32_safetensors;

/// A golden's meta: the prompt (BOS first), its text, the greedy ids.
pub struct Meta {
    pub prompt: Vec<u32>,
    pub prompt_text: String,
    pub greedy: Vec<u32>,
}

/// A JSON array of token ids.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Token ids as `--prompt-ids` takes them.
pub fn csv(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// `toy`'s `golden/meta.json`, checked to be `family`'s.
pub fn meta_of(toy: &str, family: &str) -> Meta {
    let m: Value =
        serde_json::from_slice(&std::fs::read(Path::new(toy).join("golden/meta.json")).unwrap())
            .unwrap();
    assert_eq!(m["family"], family);
    Meta {
        prompt: ids(&m["prompt"]),
        prompt_text: m["prompt_text"].as_str().unwrap().to_string(),
        greedy: ids(&m["greedy"]),
    }
}

/// The golden logits of every position: the prompt's rows, then the decode steps
/// after the first greedy token.
pub fn golden_rows(toy: &str) -> Vec<Vec<f32>> {
    let prompt = f32_safetensors(&Path::new(toy).join("golden/prompt.safetensors"));
    let greedy = f32_safetensors(&Path::new(toy).join("golden/greedy.safetensors"));
    let (ps, pl) = &prompt["logits"];
    let (gs, gl) = &greedy["step_logits"];
    assert_eq!(ps[1], gs[1], "vocabularies");
    let vocab = ps[1];
    let mut rows: Vec<Vec<f32>> = pl.chunks_exact(vocab).map(<[f32]>::to_vec).collect();
    // Step 0 is the prompt's last position again.
    let steps: Vec<&[f32]> = gl.chunks_exact(vocab).collect();
    assert_eq!(
        steps[0],
        &rows[ps[0] - 1][..],
        "step 0 is the prompt's last row"
    );
    rows.extend(steps[1..].iter().map(|r| r.to_vec()));
    rows
}

/// `gturbo install FAMILY --from TOY --out OUT EXTRA…`, asserting success.
pub fn install_toy(family: &str, toy: &str, out: &Path, extra: &[&str]) {
    let o = gturbo()
        .args(["-q", "install", family, "--from", toy, "--out"])
        .arg(out)
        .args(extra)
        .output()
        .unwrap();
    assert!(o.status.success(), "install {extra:?}: {}", text(&o));
}

/// An install's `manifest.json`.
pub fn manifest(dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap()
}

/// KL and top-1 agreement (`gturbo eval --json`) of the quantized install `quantized` of
/// `toy` against a `--quant bf16` install of its dequantized twin (every tensor the
/// install quantized replaced by MLX's quantize-then-dequantize of it in exact F32, by
/// `scripts/peers/dequantized_twin.py`): the quantized path must compute what its
/// dequantized weights compute. `None` (the test skipped, named) when MLX cannot run.
pub fn kl_against_dequantized_twin(
    test: &str,
    family: &str,
    toy: &str,
    quantized: &Path,
    text_file: &Path,
) -> Option<(f64, f64)> {
    let tmp = quantized.parent().unwrap();
    let twin = tmp.join("dequantized-twin");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/peers/dequantized_twin.py");
    let o = std::process::Command::new("python3")
        .arg(&script)
        .arg(toy)
        .arg(quantized)
        .arg(&twin)
        .output()
        .unwrap_or_else(|e| panic!("cannot run python3: {e}"));
    if !o.status.success() {
        let err = String::from_utf8_lossy(&o.stderr);
        if err.contains("No module named") {
            let why = format!("MLX is not importable; scripts/venv.sh test installs it ({err})");
            return gturbo_testkit::skip::require_or_skip(test, Err::<(), _>(why))
                .map(|_| (0.0, 0.0));
        }
        panic!("dequantized_twin.py failed: {}", text(&o));
    }
    let twin_install = tmp.join("dequantized-twin.gturbo");
    install_toy(
        family,
        twin.to_str().unwrap(),
        &twin_install,
        &["--quant", "bf16"],
    );
    let o = gturbo()
        .arg("eval")
        .arg(quantized)
        .arg(&twin_install)
        .arg("--text")
        .arg(text_file)
        .args(["--threads", "2", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "eval: {}", text(&o));
    let ev: Value = serde_json::from_slice(&o.stdout).unwrap();
    eprintln!("{family} quantized vs its dequantized twin: {ev}");
    Some((
        ev["mean_kl_nats"].as_f64().unwrap(),
        ev["top1_agreement"].as_f64().unwrap(),
    ))
}
