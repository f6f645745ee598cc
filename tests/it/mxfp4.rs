//! MXFP4 sources (gpt-oss's routed experts, issue 25 §Formats 2) on the real layout:
//! tests/data/gptoss_mxfp4_toy (scripts/golden/gen_gptoss_mxfp4.py: transformers'
//! `GptOssConfig`, experts as `*_blocks`/`*_scales` U8, everything else BF16).
//!
//! At the default profile the experts land in the pools as the source bytes
//! rearranged (gate = the even rows of gate_up, up = the odd rows, down as is; MLX-LM
//! `gpt_oss.py` `sanitize`); at `--quant bf16` they are E2M1 × 2^(e − 127) in BF16,
//! element for element, and equal MLX's `sanitize` + `mx.dequantize(mode="mxfp4")`
//! (tests/data/mxfp4_golden.json, scripts/golden/gen_mxfp4_golden.py).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::mlx_source::source_tensors;
use crate::support::cli::{gturbo_args, install, text, try_install};
use crate::support::temp_dir;

const TOY: &str = "tests/data/gptoss_mxfp4_toy";
const GOLDEN: &str = "tests/data/mxfp4_golden.json";
const LAYERS: usize = 2;
const EXPERTS: usize = 4;

fn toy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(TOY)
}

fn sha(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// One expert's three parts as the install stores them: (weights, scales) bytes of
/// gate, up, down, read from `dir`'s pool of `layer` at the manifest's offsets.
fn pool_parts(dir: &Path, layer: usize) -> Vec<[(Vec<u8>, Vec<u8>); 3]> {
    let m: Value =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
    let pool = m["expert_pools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["layer"] == layer)
        .unwrap();
    let bytes = std::fs::read(dir.join(pool["file"].as_str().unwrap())).unwrap();
    let stride = pool["stride"].as_u64().unwrap() as usize;
    let n = |v: &Value| v.as_u64().unwrap() as usize;
    (0..EXPERTS)
        .map(|e| {
            let part = |i: usize| {
                let p = &pool["parts"][i];
                let at = e * stride + n(&p["offset"]);
                let (w, s) = (n(&p["weights"]), n(&p["scales"]));
                assert_eq!(n(&p["biases"]), 0, "MXFP4 and BF16 parts have no biases");
                (
                    bytes[at..at + w].to_vec(),
                    bytes[at + w..at + w + s].to_vec(),
                )
            };
            [part(0), part(1), part(2)]
        })
        .collect()
}

/// Source `name` of the toy: its bytes and shape.
fn src(t: &BTreeMap<String, (String, Vec<u64>, Vec<u8>)>, name: &str) -> (Vec<u8>, Vec<u64>) {
    let (dtype, shape, bytes) = &t[name];
    assert_eq!(dtype, "U8", "{name}");
    (bytes.clone(), shape.clone())
}

/// Rows `pick` (of `row` bytes each) of expert `e` of a `[E, rows, ..]` tensor.
fn rows(
    bytes: &[u8],
    e: usize,
    n_rows: usize,
    row: usize,
    pick: impl Fn(usize) -> bool,
) -> Vec<u8> {
    let ex = &bytes[e * n_rows * row..(e + 1) * n_rows * row];
    ex.chunks_exact(row)
        .enumerate()
        .filter(|(r, _)| pick(*r))
        .flat_map(|(_, c)| c.to_vec())
        .collect()
}

/// The source's (blocks, scales) of each part of expert `e` of `layer`, rearranged
/// as gpt-oss's `sanitize` does: gate = even rows of gate_up, up = odd rows.
fn expected_parts(
    t: &BTreeMap<String, (String, Vec<u64>, Vec<u8>)>,
    layer: usize,
    e: usize,
) -> [(Vec<u8>, Vec<u8>); 3] {
    let p = format!("model.layers.{layer}.mlp.experts");
    let (gub, gus) = (
        src(t, &format!("{p}.gate_up_proj_blocks")),
        src(t, &format!("{p}.gate_up_proj_scales")),
    );
    let (dnb, dns) = (
        src(t, &format!("{p}.down_proj_blocks")),
        src(t, &format!("{p}.down_proj_scales")),
    );
    let (r2, g) = (gub.1[1] as usize, gub.1[2] as usize);
    let (h, gd) = (dnb.1[1] as usize, dnb.1[2] as usize);
    let half = |k: usize| {
        (
            rows(&gub.0, e, r2, g * 16, |r| r % 2 == k),
            rows(&gus.0, e, r2, g, |r| r % 2 == k),
        )
    };
    [
        half(0),
        half(1),
        (
            rows(&dnb.0, e, h, gd * 16, |_| true),
            rows(&dns.0, e, h, gd, |_| true),
        ),
    ]
}

/// E2M1 × 2^(e − 127) as BF16 bits (every product is exact in BF16 at these scales).
fn rule_bf16(codes: &[u8], scales: &[u8], cols: usize) -> Vec<u8> {
    const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let mut out = Vec::new();
    for (r, row) in codes.chunks_exact(cols / 2).enumerate() {
        for j in 0..cols {
            let c = (row[j / 2] >> (4 * (j % 2))) & 0xf;
            let m = E2M1[(c & 7) as usize] * if c & 8 != 0 { -1.0 } else { 1.0 };
            let v = m * 2f32.powi(scales[r * cols / 32 + j / 32] as i32 - 127);
            assert_eq!(v.to_bits() & 0xffff, 0, "exact in BF16");
            out.extend(((v.to_bits() >> 16) as u16).to_le_bytes());
        }
    }
    out
}

/// At the default profile (int4) the experts are kept: every pool part is the source
/// blocks and scales rearranged, byte for byte, at `mxfp4_g32`; the expert biases
/// stay resident at BF16 under their source names; the install verifies, and a flipped
/// byte in a pool fails verification naming the file.
#[test]
fn mxfp4_experts_install_as_the_source_bytes_rearranged() {
    let t = source_tensors(&toy());
    let work = temp_dir();
    let out = work.path().join("a.gturbo");
    install("gpt_oss", &toy(), &out, &[]);
    let golden: Value = serde_json::from_slice(
        &std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join(GOLDEN)).unwrap(),
    )
    .unwrap();
    let m: Value =
        serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    for pool in m["expert_pools"].as_array().unwrap() {
        assert_eq!(pool["scheme"], "mxfp4_g32", "{pool}");
    }
    for layer in 0..LAYERS {
        let got = pool_parts(&out, layer);
        for (e, parts) in got.iter().enumerate() {
            assert!(
                parts == &expected_parts(&t, layer, e),
                "layer {layer} expert {e}: pool bytes are not the source's rearranged"
            );
        }
        // All experts of a part together are MLX-LM's `sanitize` output, whose digests
        // the golden keeps.
        for (i, part) in ["gate", "up", "down"].iter().enumerate() {
            let w: Vec<u8> = got.iter().flat_map(|p| p[i].0.clone()).collect();
            let s: Vec<u8> = got.iter().flat_map(|p| p[i].1.clone()).collect();
            let g = &golden["layers"][layer][part];
            assert_eq!(sha(&w), g["weights_sha256"], "layer {layer} {part} weights");
            assert_eq!(sha(&s), g["scales_sha256"], "layer {layer} {part} scales");
        }
    }
    let (plan_ok, plan) = dry_plan(&toy(), &[]);
    assert!(plan_ok);
    let bias = plan["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "model.layers.1.mlp.experts.gate_up_proj_bias")
        .unwrap();
    assert_eq!(
        (&bias["dtype"], &bias["scheme"], &bias["dest"]["kind"]),
        (
            &Value::from("BF16"),
            &Value::from("passthrough"),
            &Value::from("resident")
        )
    );
    assert!(
        m["quantized_at_install"]["parity_gate"]
            .as_str()
            .unwrap()
            .contains("MXFP4 experts kept as published (mxfp4_g32")
    );

    let o = gturbo_args(&["verify-install", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let pool = out.join("packed_experts/layer_01.bin");
    let mut b = std::fs::read(&pool).unwrap();
    b[100] ^= 0x10;
    std::fs::write(&pool, b).unwrap();
    let o = gturbo_args(&["verify-install", out.to_str().unwrap()]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("packed_experts/layer_01.bin"),
        "{}",
        text(&o)
    );
}

/// `--quant bf16` dequantizes: every expert part is E2M1 × 2^(e − 127) in BF16,
/// element for element, and all of them equal MLX's `mx.dequantize(mode="mxfp4")` of
/// MLX-LM's `sanitize` output (the golden's digests and samples).
#[test]
fn mxfp4_experts_at_bf16_are_the_rule_and_mlx_dequantize() {
    let t = source_tensors(&toy());
    let work = temp_dir();
    let out = work.path().join("b.gturbo");
    install("gpt_oss", &toy(), &out, &["--quant", "bf16"]);
    let golden: Value = serde_json::from_slice(
        &std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join(GOLDEN)).unwrap(),
    )
    .unwrap();
    for layer in 0..LAYERS {
        let got = pool_parts(&out, layer);
        for (i, part) in ["gate", "up", "down"].iter().enumerate() {
            let g = &golden["layers"][layer][part];
            let cols = g["shape"][2].as_u64().unwrap() as usize;
            let mut all = Vec::new();
            for (e, parts) in got.iter().enumerate() {
                let (codes, scales) = &expected_parts(&t, layer, e)[i];
                let want = rule_bf16(codes, scales, cols);
                assert!(parts[i].1.is_empty(), "a BF16 part has no scales");
                assert!(
                    parts[i].0 == want,
                    "layer {layer} expert {e} {part}: not the rule"
                );
                all.extend_from_slice(&parts[i].0);
            }
            assert_eq!(
                sha(&all),
                g["bf16_sha256"],
                "layer {layer} {part}: MLX differs"
            );
            let rows = g["shape"][1].as_u64().unwrap() as usize;
            for s in g["samples"].as_array().unwrap() {
                let n = |k: usize| s[k].as_u64().unwrap() as usize;
                let at = 2 * ((n(0) * rows + n(1)) * cols + n(2));
                let bits = u16::from_le_bytes([all[at], all[at + 1]]);
                assert_eq!(bits as u64, s[3].as_u64().unwrap(), "{part} sample {s}");
            }
        }
    }
    let o = gturbo_args(&["verify-install", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
}

/// `gturbo install --dry-run --emit-plan` of `snap`: success and the plan.
fn dry_plan(snap: &Path, extra: &[&str]) -> (bool, Value) {
    let tmp = temp_dir();
    let plan_file = tmp.path().join("plan.json");
    let mut args = vec!["--dry-run", "--emit-plan", plan_file.to_str().unwrap()];
    args.extend_from_slice(extra);
    let o = try_install("gpt_oss", snap, &tmp.path().join("o.gturbo"), &args);
    let plan = std::fs::read(&plan_file)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(Value::Null);
    (o.status.success(), plan)
}

/// A copy of the toy whose `tensor`'s byte `at` is `value`.
fn patched_toy(dir: &Path, tensor: &str, at: usize, value: u8) -> PathBuf {
    let snap = dir.join("snap");
    std::fs::create_dir_all(&snap).unwrap();
    // The checkpoint's files (not its goldens' folder).
    for e in std::fs::read_dir(toy()).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, snap.join(p.file_name().unwrap())).unwrap();
        }
    }
    let f = snap.join("model.safetensors");
    let mut b = std::fs::read(&f).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let head: Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    let start = head[tensor]["data_offsets"][0].as_u64().unwrap() as usize;
    b[8 + n + start + at] = value;
    std::fs::write(&f, b).unwrap();
    snap
}

/// A scale byte of 0xFF (E8M0's NaN) is an input error naming the tensor, kept or
/// dequantized; `--requantize` is refused naming the config field.
#[test]
fn a_nan_scale_is_refused_naming_the_tensor() {
    let work = temp_dir();
    let name = "model.layers.1.mlp.experts.down_proj_scales";
    let snap = patched_toy(work.path(), name, 5, 0xff);
    for (i, extra) in [&[][..], &["--quant", "bf16"]].into_iter().enumerate() {
        let o = try_install("gpt_oss", &snap, &work.path().join(format!("o{i}")), extra);
        assert!(!o.status.success(), "{extra:?}");
        let e = text(&o);
        assert!(
            e.contains(name) && e.contains("is 0xFF, E8M0's NaN"),
            "{extra:?}: {e}"
        );
    }
    let o = try_install(
        "gpt_oss",
        &toy(),
        &work.path().join("r.gturbo"),
        &["--quant", "int8", "--requantize"],
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains(
            "field `quantization_config.quant_method`: --requantize: the source is MXFP4"
        ),
        "{}",
        text(&o)
    );
}
