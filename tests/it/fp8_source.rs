//! FP8 e4m3 block-scaled sources (issue 25, item 1): a tiny Llama whose 2-D linear
//! weights are stored as DeepSeek-V3 stores them (F8_E4M3 codes with an F32
//! `weight_scale_inv` per 128×128 block, one scale in the other shard, a
//! `quantization_config` of `quant_method: fp8`) installs at BF16 and at INT4 g64; the
//! installed BF16 is `bf16(f32(fp8) × scale)` element for element; one weight is the
//! golden tensor of `tests/data/fp8_e4m3_golden.json` (made by MLX-LM's own
//! `sanitize` and `mx.quantize`, `scripts/golden/gen_fp8_golden.py`) and its installed
//! BF16 and INT4 bytes are MLX's; no `*_scale_inv` is installed; `verify-install`
//! passes and `gturbo run` produces tokens. A NaN code and a non-finite scale are
//! refused naming the tensor.

use std::collections::BTreeMap;
use std::path::Path;

use gturbo::transform::quant::{Spec, quantize_rows_le_bytes};
use gturbo_testkit::replica::{LlamaSpec, write_llama};
use serde_json::{Value, json};

use crate::mlx_source::{Tensors, source_tensors};
use crate::support::cli::{
    gturbo_args, install, install_cmd, run_json, text, tree_hashes, try_install,
};
use crate::support::{sha256_hex, temp_dir};

const GOLDEN: &str = "tests/data/fp8_e4m3_golden.json";
const BLOCK: usize = 128;
/// The snapshot's shard files.
const SHARDS: [&str; 2] = [
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
];
/// The largest finite e4m3 value.
const E4M3_MAX: f32 = 448.0;

fn golden() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(GOLDEN);
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// The e4m3fn value of `b` from its definition (`None` for the NaN codes), written
/// here independently of gturbo's decoder.
fn e4m3(b: u8) -> Option<f64> {
    let (s, e, m) = (b >> 7, (b >> 3) & 15, b & 7);
    if e == 15 && m == 7 {
        return None;
    }
    let v = if e == 0 {
        2f64.powi(-6) * m as f64 / 8.0
    } else {
        2f64.powi(e as i32 - 7) * (1.0 + m as f64 / 8.0)
    };
    Some(if s == 1 { -v } else { v })
}

/// f32 → BF16 bits, to nearest even (inputs here are finite).
fn bf16(x: f32) -> u16 {
    let b = x.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// The generator of the golden file (its `generator` field).
fn xorshift_codes(n: usize, seed: u32) -> Vec<u8> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let b = (x >> 24) as u8;
            if b & 0x7f == 0x7f { b ^ 1 } else { b }
        })
        .collect()
}

/// The nearest finite e4m3 code of `v` (ties to the lower code; any codes do here).
fn encode(v: f32, table: &[(u8, f64)]) -> u8 {
    table
        .iter()
        .min_by(|a, b| {
            (a.1 - v as f64)
                .abs()
                .partial_cmp(&(b.1 - v as f64).abs())
                .unwrap()
        })
        .unwrap()
        .0
}

/// BF16 `[rows, cols]` as FP8 codes and per-block scales (amax / 448), as the FP8
/// checkpoints are made.
fn to_fp8(bytes: &[u8], rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    let table: Vec<(u8, f64)> = (0..=255u8).filter_map(|b| Some((b, e4m3(b)?))).collect();
    let v: Vec<f32> = bytes
        .chunks_exact(2)
        .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
        .collect();
    let (br, bc) = (rows.div_ceil(BLOCK), cols.div_ceil(BLOCK));
    let mut scales = vec![0f32; br * bc];
    for (i, x) in v.iter().enumerate() {
        let k = (i / cols / BLOCK) * bc + (i % cols) / BLOCK;
        scales[k] = scales[k].max(x.abs() / E4M3_MAX);
    }
    for s in &mut scales {
        if *s == 0.0 {
            *s = 1.0;
        }
    }
    let codes = v
        .iter()
        .enumerate()
        .map(|(i, x)| {
            encode(
                x / scales[(i / cols / BLOCK) * bc + (i % cols) / BLOCK],
                &table,
            )
        })
        .collect();
    (codes, scales)
}

/// The rule: `bf16(f32(fp8) × scale_inv[row / 128][col / 128])`, little-endian bytes.
fn rule(codes: &[u8], scales: &[f32], cols: usize) -> Vec<u8> {
    let bc = cols.div_ceil(BLOCK);
    codes
        .iter()
        .enumerate()
        .flat_map(|(i, &b)| {
            let s = scales[(i / cols / BLOCK) * bc + (i % cols) / BLOCK];
            bf16(e4m3(b).unwrap() as f32 * s).to_le_bytes()
        })
        .collect()
}

/// One tensor to write: name, dtype, shape, bytes.
type StTensor = (String, &'static str, Vec<u64>, Vec<u8>);

/// Write a safetensors file of `tensors`, in that order.
fn write_st(path: &Path, tensors: &[StTensor]) {
    let mut head = serde_json::Map::new();
    head.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut at = 0usize;
    for (name, dtype, shape, bytes) in tensors {
        head.insert(
            name.clone(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": [at, at + bytes.len()]}),
        );
        at += bytes.len();
    }
    let mut h = serde_json::to_vec(&Value::Object(head)).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    for t in tensors {
        out.extend(&t.3);
    }
    std::fs::write(path, out).unwrap();
}

/// One FP8 weight of the snapshot: its codes and scales.
struct Fp8 {
    cols: usize,
    codes: Vec<u8>,
    scales: Vec<f32>,
}

/// The FP8 snapshot in `dir`: the tiny Llama (hidden 192, MLP 320: every linear weight
/// has partial edge blocks) with its `*_proj.weight`s as FP8; the golden tensor's scale
/// lies in the other shard. `mutate` may edit the FP8 weights before they are written.
fn write_fp8_snapshot(
    dir: &Path,
    mutate: impl Fn(&mut BTreeMap<String, Fp8>),
) -> BTreeMap<String, Fp8> {
    let g = golden();
    let base = dir.with_extension("bf16");
    let spec = LlamaSpec {
        hidden_size: 192,
        num_attention_heads: 3,
        num_key_value_heads: 1,
        intermediate_size: 320,
        shards: 2,
        ..LlamaSpec::tiny()
    };
    write_llama(&base, &spec).unwrap();
    let index: Value =
        serde_json::from_slice(&std::fs::read(base.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let src: Tensors = source_tensors(&base);
    let gname = g["tensor"].as_str().unwrap();
    let mut fp8 = BTreeMap::new();
    for (name, (_, shape, bytes)) in &src {
        if !name.ends_with("_proj.weight") {
            continue;
        }
        let (rows, cols) = (shape[0] as usize, shape[1] as usize);
        let (codes, scales) = if name == gname {
            assert_eq!(u64s(&g["shape"]), *shape, "the golden tensor's shape");
            let codes = xorshift_codes(rows * cols, g["seed"].as_u64().unwrap() as u32);
            assert_eq!(sha256_hex(&codes), g["fp8_sha256"], "the generator's port");
            let scales = u64s(&g["scale_inv_f32_bits"])
                .into_iter()
                .map(|b| f32::from_bits(b as u32))
                .collect();
            (codes, scales)
        } else {
            to_fp8(bytes, rows, cols)
        };
        fp8.insert(
            name.clone(),
            Fp8 {
                cols,
                codes,
                scales,
            },
        );
    }
    assert!(
        fp8.contains_key(gname) && fp8.len() == 14,
        "{:?}",
        fp8.keys()
    );
    mutate(&mut fp8);
    std::fs::create_dir_all(dir).unwrap();
    let map = index["weight_map"].as_object().unwrap();
    let files: std::collections::BTreeSet<&str> =
        map.values().map(|v| v.as_str().unwrap()).collect();
    let files: Vec<&str> = files.into_iter().collect();
    assert_eq!(files.len(), 2);
    let mut shards: BTreeMap<&str, Vec<StTensor>> = BTreeMap::new();
    let mut weight_map = serde_json::Map::new();
    for (name, (dtype, shape, bytes)) in &src {
        let file = map[name].as_str().unwrap();
        let mut put = |file: &'static str, n: String, d: &'static str, s: Vec<u64>, b: Vec<u8>| {
            weight_map.insert(n.clone(), json!(file));
            shards.entry(file).or_default().push((n, d, s, b));
        };
        let (here, other) = match files.iter().position(|f| *f == file) {
            Some(0) => (SHARDS[0], SHARDS[1]),
            _ => (SHARDS[1], SHARDS[0]),
        };
        let Some(f) = fp8.get(name) else {
            assert_eq!(dtype, "BF16", "{name}");
            put(here, name.clone(), "BF16", shape.clone(), bytes.clone());
            continue;
        };
        put(
            here,
            name.clone(),
            "F8_E4M3",
            shape.clone(),
            f.codes.clone(),
        );
        let rows = shape[0] as usize;
        let scale_shape = vec![rows.div_ceil(BLOCK) as u64, f.cols.div_ceil(BLOCK) as u64];
        // The golden tensor's scale lies in the other shard.
        let scale_file = if name == gname { other } else { here };
        let sb = f.scales.iter().flat_map(|s| s.to_le_bytes()).collect();
        put(
            scale_file,
            format!("{name}_scale_inv"),
            "F32",
            scale_shape,
            sb,
        );
    }
    let mut total = 0u64;
    for (file, tensors) in &shards {
        total += tensors.iter().map(|t| t.3.len() as u64).sum::<u64>();
        write_st(&dir.join(file), tensors);
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_vec_pretty(
            &json!({"metadata": {"total_size": total}, "weight_map": weight_map}),
        )
        .unwrap(),
    )
    .unwrap();
    for e in std::fs::read_dir(&base).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        if name.ends_with(".safetensors") || name.ends_with(".index.json") {
            continue;
        }
        std::fs::copy(&p, dir.join(&name)).unwrap();
    }
    let mut config: Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    config["quantization_config"] = json!({"activation_scheme": "dynamic", "fmt": "e4m3",
        "quant_method": "fp8", "weight_block_size": [128, 128]});
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(&config).unwrap(),
    )
    .unwrap();
    fp8
}

/// The resident entries of an install: name → (entry, payload bytes).
fn resident(out: &Path) -> (BTreeMap<String, Value>, Vec<u8>, usize) {
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    let res = std::fs::read(out.join("resident.bin")).unwrap();
    let n = u64::from_le_bytes(res[8..16].try_into().unwrap()) as usize;
    let index: Value = serde_json::from_slice(&res[16..16 + n]).unwrap();
    let start = manifest["resident"]["payload_start"].as_u64().unwrap() as usize;
    let entries = index["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["name"].as_str().unwrap().to_string(), e.clone()))
        .collect();
    (entries, res, start)
}

fn span<'a>(res: &'a [u8], start: usize, s: &Value) -> &'a [u8] {
    let (o, l) = (
        s["offset"].as_u64().unwrap() as usize,
        s["len"].as_u64().unwrap() as usize,
    );
    &res[start + o..start + o + l]
}

#[test]
fn mlx_decodes_every_e4m3_code_as_the_definition_says() {
    let g = golden();
    let table = u64s(&g["from_fp8_bf16_bits"]);
    for b in 0..=255u8 {
        let mlx = table[b as usize] as u16;
        match e4m3(b) {
            Some(v) => {
                assert_eq!(mlx, bf16(v as f32), "code {b:#04x}");
                assert_eq!(gturbo::transform::fp8::e4m3_to_f32(b) as f64, v, "{b:#04x}");
            }
            None => assert!(mlx & 0x7f80 == 0x7f80 && mlx & 0x7f != 0, "{b:#04x} NaN"),
        }
    }
}

#[test]
fn an_fp8_checkpoint_installs_at_bf16_and_int4_as_mlx_lm_dequantizes_it_and_runs() {
    let work = temp_dir();
    let snap = work.path().join("fp8");
    let fp8 = write_fp8_snapshot(&snap, |_| {});
    let g = golden();
    let gname = g["tensor"].as_str().unwrap();
    for quant in ["bf16", "int4"] {
        let out = work.path().join(format!("{quant}.gturbo"));
        install("llama", &snap, &out, &["--quant", quant]);
        let (entries, res, start) = resident(&out);
        assert!(
            entries.keys().all(|n| !n.ends_with("_scale_inv")),
            "{:?}",
            entries.keys()
        );
        let mut compared = 0;
        for (name, f) in &fp8 {
            let e = &entries[name];
            let expect = rule(&f.codes, &f.scales, f.cols);
            if quant == "bf16" {
                assert_eq!(e["scheme"], "passthrough", "{name}");
                assert_eq!(e["dtype"], "BF16", "{name}");
                let got = span(&res, start, &e["data"]);
                assert!(
                    got == &expect[..],
                    "{name}: installed BF16 differs from the rule"
                );
                if name == gname {
                    assert_eq!(sha256_hex(got), g["bf16_sha256"], "MLX-LM's sanitize");
                    for s in g["bf16_samples"].as_array().unwrap() {
                        let (r, c, bits) = (
                            s[0].as_u64().unwrap() as usize,
                            s[1].as_u64().unwrap() as usize,
                            s[2].as_u64().unwrap(),
                        );
                        let at = 2 * (r * f.cols + c);
                        assert_eq!(
                            u16::from_le_bytes([got[at], got[at + 1]]) as u64,
                            bits,
                            "[{r}, {c}]"
                        );
                    }
                }
            } else {
                assert_eq!(e["scheme"], "int4_g64", "{name}");
                let parts = ["weights", "scales", "biases"].map(|k| span(&res, start, &e[k]));
                if name == gname {
                    let q = &g["int4_g64"];
                    for (k, p) in ["weights", "scales", "biases"].iter().zip(parts) {
                        assert_eq!(sha256_hex(p), q[format!("{k}_sha256")], "mx.quantize {k}");
                    }
                    let row0: Vec<u64> = parts[1][..6]
                        .chunks(2)
                        .map(|c| u16::from_le_bytes([c[0], c[1]]) as u64)
                        .collect();
                    assert_eq!(row0, u64s(&q["scales_row0_bits"]));
                }
                // The profile applies to the dequantized BF16 as to a BF16 source's.
                let rows = expect.len() / 2 / f.cols;
                let spec = Spec::from_numbers(4, 64).unwrap();
                let (mut w, mut s, mut b) = (
                    vec![0u8; parts[0].len()],
                    vec![0u8; parts[1].len()],
                    vec![0u8; parts[2].len()],
                );
                quantize_rows_le_bytes(&expect, f.cols, spec, &mut w, &mut s, &mut b).unwrap();
                assert!(
                    rows > 0 && [&w[..], &s, &b] == parts,
                    "{name}: INT4 of the rule"
                );
            }
            compared += 1;
        }
        assert_eq!(compared, 14);
        let manifest: Value =
            serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
        let gate = manifest.to_string();
        assert!(gate.contains("FP8 e4m3 source"), "{gate}");
        let v = gturbo_args(&["verify-install", out.to_str().unwrap()]);
        assert!(v.status.success(), "verify-install {quant}: {}", text(&v));
        let (doc, _) = run_json(&out, &["--prompt-ids", "1,2,3", "--max-tokens", "4"]);
        assert_eq!(doc["tokens"].as_array().map(Vec::len), Some(4), "{doc}");
        // Tiles of 1 KiB (5 rows of 192 codes: tiles start inside 128-row bands, and
        // cross them) write the same bytes.
        let small = work.path().join(format!("{quant}-tiles.gturbo"));
        install(
            "llama",
            &snap,
            &small,
            &["--quant", quant, "--tile-kib", "1"],
        );
        let same = std::fs::read(small.join("resident.bin")).unwrap();
        assert!(same == res, "{quant}: 1 KiB tiles wrote other bytes");
    }
}

#[test]
fn a_nan_code_or_a_non_finite_scale_is_refused_naming_the_tensor() {
    let work = temp_dir();
    let snap = work.path().join("nan");
    let bad = "model.layers.1.self_attn.o_proj.weight";
    write_fp8_snapshot(&snap, |f| f.get_mut(bad).unwrap().codes[777] = 0xff);
    let o = try_install("llama", &snap, &work.path().join("a.gturbo"), &["-q"]);
    assert!(!o.status.success());
    let t = text(&o);
    assert!(
        t.contains(&format!(
            "tensor `{bad}`: non-finite weight (inf or NaN) at element 777"
        )),
        "{t}"
    );
    // --requantize is MLX sources' flag: an FP8 source is always dequantized.
    let o = try_install(
        "llama",
        &snap,
        &work.path().join("c.gturbo"),
        &["-q", "--quant", "int8", "--requantize"],
    );
    assert!(!o.status.success());
    assert!(
        text(&o)
            .contains("field `quantization_config`: --requantize: the source is FP8 block-scaled"),
        "{}",
        text(&o)
    );
    let snap = work.path().join("inf");
    write_fp8_snapshot(&snap, |f| f.get_mut(bad).unwrap().scales[1] = f32::INFINITY);
    let o = try_install(
        "llama",
        &snap,
        &work.path().join("b.gturbo"),
        &["-q", "--quant", "bf16"],
    );
    assert!(!o.status.success());
    let t = text(&o);
    assert!(
        t.contains(&format!("tensor `{bad}_scale_inv`: block [0, 1] is inf")),
        "{t}"
    );
}

/// An FP8 install killed after its first journaled read (the test hook exits as a
/// kill -9 would, right after the journal line) resumes to the uninterrupted install,
/// byte for byte: the resumed read stages its block scales (one in the other shard)
/// again and rewrites the same bytes.
#[test]
fn an_fp8_install_killed_after_a_read_resumes_byte_identical() {
    let work = temp_dir();
    let snap = work.path().join("fp8");
    write_fp8_snapshot(&snap, |_| {});
    let plan_file = work.path().join("plan.json");
    let run = |out: &Path, abort: Option<&str>| {
        let mut c = install_cmd("llama", &snap, out, &["-q", "--quant", "int4"]);
        c.args(["--emit-plan", plan_file.to_str().unwrap()]);
        if let Some(n) = abort {
            c.env(gturbo::env::GTURBO_TEST_ABORT_AFTER_READS, n);
        }
        c.output().unwrap()
    };
    let reference = work.path().join("ref.gturbo");
    let o = run(&reference, None);
    assert!(o.status.success(), "{}", text(&o));
    let plan: Value = serde_json::from_slice(&std::fs::read(&plan_file).unwrap()).unwrap();
    assert!(
        plan["reads"].as_array().unwrap().len() >= 2,
        "too few reads to interrupt"
    );
    assert!(
        plan["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["fp8"]["scale_inv"]["shard"] != t["shard"]),
        "no scale in the other shard"
    );
    let out = work.path().join("resumed.gturbo");
    let killed = run(&out, Some("1"));
    assert_eq!(killed.status.code(), Some(137), "{}", text(&killed));
    let resumed = run(&out, None);
    assert!(resumed.status.success(), "{}", text(&resumed));
    assert!(
        String::from_utf8_lossy(&resumed.stderr).contains("1 kept from a previous run"),
        "{}",
        text(&resumed)
    );
    assert_eq!(tree_hashes(&out), tree_hashes(&reference));
}

/// A real `kill -9`, not the abort hook: the FP8 install runs as a child against a hub
/// whose answers each wait 100 ms; once its journal holds a completed read (a line with
/// `"read":`), the child gets SIGKILL wherever it is; the rerun keeps what was durable
/// and finishes; every output byte equals an uninterrupted install's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_fp8_install_sigkilled_mid_stream_resumes_byte_identical() {
    use std::os::unix::process::ExitStatusExt as _;
    use std::time::{Duration, Instant};

    let work = temp_dir();
    let snap = work.path().join("fp8");
    write_fp8_snapshot(&snap, |_| {});
    let config = gturbo_testkit::hub::HubConfig {
        link: gturbo_testkit::hub::LinkShape {
            latency: Duration::from_millis(100),
            ..Default::default()
        },
        ..Default::default()
    };
    let (hub, repo) = crate::support::start_hub("Org/fp8-llama", &snap, config).await;
    let cmd = |out: &Path| {
        let mut c = crate::support::cli::gturbo();
        c.args(["-q", "install", "--family", "llama", "Org/fp8-llama"])
            .args(["--endpoint", hub.url(), "--revision", &repo.commit])
            .args(["--quant", "int4", "--out"])
            .arg(out);
        c
    };
    let reference = work.path().join("ref.gturbo");
    let o = cmd(&reference).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));

    let out = work.path().join("killed.gturbo");
    let journal = work.path().join("killed.gturbo.partial.journal");
    let mut child = cmd(&out)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let reads = || {
        std::fs::read_to_string(&journal)
            .map(|s| s.lines().filter(|l| l.contains("\"read\":")).count())
            .unwrap_or(0)
    };
    while reads() < 1 {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the install ended first"
        );
        assert!(t0.elapsed() < Duration::from_secs(60), "no read journaled");
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap(); // SIGKILL
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(9), "{status:?}");
    assert!(!out.exists(), "killed before publishing");

    let o = cmd(&out).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    let kept: u64 = err
        .split(" kept from a previous run")
        .next()
        .and_then(|s| s.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(kept >= 1, "{}", text(&o));
    assert_eq!(tree_hashes(&out), tree_hashes(&reference));
}
