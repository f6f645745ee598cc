//! Dry runs of the flagship MoE checkpoints at full size (issue 25): each header-only
//! replica (the test kit's `replica::write_flagship`: DeepSeek-V3 FP8, Kimi-K2-Thinking
//! compressed-tensors INT4, GLM-4.5-Air scattered, Qwen3-Next-80B-A3B, MiniMax-M2 FP8,
//! gpt-oss-120b MXFP4) served by the test hub, `gturbo install ORG/NAME --dry-run
//! --json`: the output bytes equal a total this file computes on its own from the
//! shard headers (read here, not through gturbo) and the documented layout
//! (manifests/FORMAT.md: INT4/INT8 g64 sizes, the resident index and its page
//! alignment, 16 KiB expert strides), at most two requests per shard, MTP layers said
//! dropped, and files the index does not name never fetched.

use std::collections::BTreeMap;
use std::path::Path;

use gturbo_testkit::hub::HubConfig;
use gturbo_testkit::replica::{Flagship, write_flagship};
use serde_json::Value;

use crate::support::cli::{gturbo, text};
use crate::support::{start_hub, temp_dir};

const PAGE: u64 = 16384;
const SUB: u64 = 64;

fn align(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// One tensor of a shard header: name, dtype, shape.
type Header = (String, String, Vec<u64>);

/// Every tensor of every shard, read from the files' own headers.
fn headers(dir: &Path) -> Vec<Header> {
    let index: Value =
        serde_json::from_slice(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let mut shards: Vec<&str> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap())
        .collect();
    shards.sort_unstable();
    shards.dedup();
    let mut out = Vec::new();
    for s in shards {
        use std::io::Read as _;
        let mut f = std::fs::File::open(dir.join(s)).unwrap();
        let mut n = [0u8; 8];
        f.read_exact(&mut n).unwrap();
        let mut h = vec![0u8; u64::from_le_bytes(n) as usize];
        f.read_exact(&mut h).unwrap();
        let h: serde_json::Map<String, Value> = serde_json::from_slice(&h).unwrap();
        for (name, t) in h {
            if name == "__metadata__" {
                continue;
            }
            let shape = t["shape"].as_array().unwrap().iter();
            let shape = shape.map(|d| d.as_u64().unwrap()).collect();
            out.push((name, t["dtype"].as_str().unwrap().to_string(), shape));
        }
    }
    out
}

/// The family facts the expected total needs, written out here (the family files say
/// the same in their own terms).
struct Rules {
    /// Prefix of the MTP / NextN tensors (dropped by default).
    mtp: &'static str,
    /// Router weights (INT8 g64 when BF16 and 2-D).
    routers: &'static [&'static str],
    /// Name parts never quantized.
    never: &'static [&'static str],
}

fn rules(f: Flagship) -> Rules {
    let gate: &[&str] = &[".mlp.gate.weight"];
    match f {
        Flagship::DeepSeekV3 => Rules {
            mtp: "model.layers.61.",
            routers: gate,
            never: &["norm"],
        },
        Flagship::Glm45Air => Rules {
            mtp: "model.layers.46.",
            routers: gate,
            never: &["norm"],
        },
        Flagship::Qwen3Next80b => Rules {
            mtp: "mtp.",
            routers: &[".mlp.gate.weight", ".mlp.shared_expert_gate.weight"],
            never: &["norm", "conv"],
        },
        Flagship::MiniMaxM2 => Rules {
            mtp: "mtp.",
            routers: &[".block_sparse_moe.gate.weight"],
            never: &["norm"],
        },
        Flagship::KimiK2Thinking => Rules {
            mtp: "model.layers.61.",
            routers: gate,
            never: &["norm"],
        },
        Flagship::GptOss120b => Rules {
            mtp: "mtp.",
            routers: &[".mlp.router.weight"],
            never: &["norm", "_bias", "sinks"],
        },
    }
}

/// Bytes of weights, scales, biases of an affine matrix `[r, c]`.
fn affine(r: u64, c: u64, bits: u64, group: u64) -> [u64; 3] {
    [r * c * bits / 8, r * (c / group) * 2, r * (c / group) * 2]
}

/// What the install writes, computed from the headers and the rules alone.
#[derive(Debug, Default)]
struct Expected {
    resident: u64,
    experts: u64,
    pools: u64,
    mtp_units: u64,
}

/// A resident entry: name, dtype label, shape, spans (`data`, or the three affine ones).
type Entry = (String, String, Vec<u64>, Option<&'static str>, Vec<u64>);

fn resident_bytes(mut entries: Vec<Entry>) -> u64 {
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    let (mut cursor, mut json) = (0u64, Vec::new());
    for (name, dtype, shape, scheme, lens) in entries {
        let start = align(cursor, PAGE);
        let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
        let head = format!(
            r#"{{"name":"{name}","dtype":"{dtype}","shape":[{}],"#,
            dims.join(",")
        );
        let body = match scheme {
            None => {
                cursor = start + lens[0];
                format!(
                    r#""scheme":"passthrough","data":{{"offset":{start},"len":{}}}}}"#,
                    lens[0]
                )
            }
            Some(s) => {
                let so = align(start + lens[0], SUB);
                let bo = align(so + lens[1], SUB);
                cursor = bo + lens[2];
                format!(
                    r#""scheme":"{s}","weights":{{"offset":{start},"len":{}}},"scales":{{"offset":{so},"len":{}}},"biases":{{"offset":{bo},"len":{}}}}}"#,
                    lens[0], lens[1], lens[2]
                )
            }
        };
        json.push(head + &body);
    }
    let index = format!(
        r#"{{"format":"gturbo-resident","version":1,"tensors":[{}]}}"#,
        json.join(",")
    );
    align(16 + index.len() as u64, PAGE) + align(cursor, SUB)
}

/// The routed-expert unit of a name (`….experts.{e}.{part}…` → (layer prefix, e)).
fn expert_of(name: &str) -> Option<(String, u64)> {
    let (layer, rest) = name.split_once(".experts.")?;
    let e = rest.split('.').next()?.parse().ok()?;
    Some((layer.to_string(), e))
}

/// The layer of a gpt-oss MXFP4 expert tensor (`….mlp.experts.{gate_up,down}_proj_{blocks,scales}`).
fn mxfp4_expert_layer(name: &str) -> Option<String> {
    let (layer, rest) = name.split_once(".experts.")?;
    [
        "gate_up_proj_blocks",
        "gate_up_proj_scales",
        "down_proj_blocks",
        "down_proj_scales",
    ]
    .contains(&rest)
    .then(|| layer.to_string())
}

fn expected(f: Flagship, tensors: &[Header]) -> Expected {
    let r = rules(f);
    let mut ex = Expected::default();
    let mut blobs: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let mut entries = Vec::new();
    let consumed = ["_scale_inv", ".weight_scale", ".weight_shape"];
    for (name, dtype, shape) in tensors {
        if consumed.iter().any(|s| name.ends_with(s)) {
            continue;
        }
        if name.starts_with(r.mtp) {
            ex.mtp_units += 1;
            continue;
        }
        let (rows, cols) = (shape[0], shape.iter().skip(1).product::<u64>());
        if let Some(layer) = mxfp4_expert_layer(name) {
            // gpt-oss: `[E, rows, cols/32, 16]` blocks and `[E, rows, cols/32]` E8M0
            // scales, kept as they are (`mxfp4_g32`: the words are the block bytes,
            // one scale byte per 32, no biases); gate and up are split out of the
            // fused rows, which moves no byte between experts.
            let b = blobs.entry(layer).or_default();
            b.0 = b.0.max(shape[0]);
            b.1 += cols;
            continue;
        }
        if let Some((layer, e)) = expert_of(name) {
            // FP8 / BF16 parts become INT4 g64; compressed-tensors parts stay 4-bit g32
            // (`weight_packed` holds cols / 8 words per row).
            let lens = if name.ends_with(".weight_packed") {
                affine(rows, shape[1] * 8, 4, 32)
            } else {
                affine(rows, cols, 4, 64)
            };
            let b = blobs.entry(layer).or_default();
            b.0 = b.0.max(e + 1);
            if e == 0 {
                b.1 += lens.iter().sum::<u64>();
            }
            continue;
        }
        let label = if dtype == "F8_E4M3" {
            "BF16"
        } else {
            dtype.as_str()
        };
        let matrix = shape.len() == 2 && label == "BF16" && cols % 64 == 0;
        let bits = if r.never.iter().any(|n| name.contains(n)) || !matrix {
            0
        } else if r.routers.iter().any(|s| name.ends_with(s)) {
            8
        } else {
            4
        };
        let (scheme, lens) = match bits {
            0 => (
                None,
                vec![shape.iter().product::<u64>() * dtype_size(dtype)],
            ),
            4 => (Some("int4_g64"), affine(rows, cols, 4, 64).to_vec()),
            _ => (Some("int8_g64"), affine(rows, cols, 8, 64).to_vec()),
        };
        entries.push((name.clone(), label.to_string(), shape.clone(), scheme, lens));
    }
    for (experts, blob) in blobs.values() {
        ex.experts += experts * align(*blob, PAGE);
    }
    ex.pools = blobs.len() as u64;
    ex.resident = resident_bytes(entries);
    ex
}

fn dtype_size(d: &str) -> u64 {
    match d {
        "U8" | "F8_E4M3" => 1,
        "BF16" => 2,
        "F32" | "I32" => 4,
        _ => 8,
    }
}

/// The files copied into `tokenizer/` that the replica has (manifests/FORMAT.md's
/// list, and Kimi-K2's tiktoken tokenizer, which its family names).
fn copied_bytes(dir: &Path, f: Flagship) -> u64 {
    let mut names = vec![
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ];
    if f == Flagship::KimiK2Thinking {
        names.extend(["tiktoken.model", "tokenization_kimi.py"]);
    }
    names
        .iter()
        .filter_map(|n| std::fs::metadata(dir.join(n)).ok())
        .map(|m| m.len())
        .sum()
}

/// Write `f`'s replica, serve it, dry-run it: (report, replica dir, hub stats, output).
async fn dry_run(
    f: Flagship,
) -> (
    Value,
    tempfile::TempDir,
    gturbo_testkit::hub::HubStats,
    String,
) {
    let dir = temp_dir();
    write_flagship(dir.path(), f).unwrap();
    // No hashing of hundreds of GB of holes on listing; no CDN hop, so that each
    // request the hub counts is one read.
    let config = HubConfig {
        hash_on_listing: false,
        ..HubConfig::default()
    };
    let (hub, repo) = start_hub(f.repo(), dir.path(), config).await;
    let url = hub.url().to_string();
    let o = tokio::task::spawn_blocking(move || {
        gturbo()
            .args([
                "install",
                f.repo(),
                "--dry-run",
                "--json",
                "--endpoint",
                &url,
            ])
            .args(["--revision", &repo.commit])
            .env("HF_HOME", "/nonexistent-gturbo-test-home")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let doc = if o.status.success() {
        serde_json::from_slice(&o.stdout).unwrap()
    } else {
        Value::Null
    };
    (doc, dir, hub.stats(), text(&o))
}

async fn check(f: Flagship) {
    let (d, dir, stats, out) = dry_run(f).await;
    assert!(!d.is_null(), "{f:?}: {out}");
    let tensors = headers(dir.path());
    let ex = expected(f, &tensors);
    let o = &d["outputs"];
    assert_eq!(o["resident"].as_u64(), Some(ex.resident), "{f:?} resident");
    assert_eq!(o["experts"].as_u64(), Some(ex.experts), "{f:?} experts");
    assert_eq!(o["sidecar_experts"], 0, "{f:?}");
    let copied = copied_bytes(dir.path(), f);
    assert_eq!(o["copied"].as_u64(), Some(copied), "{f:?} copied");
    assert_eq!(
        o["total"].as_u64(),
        Some(ex.resident + ex.experts + copied),
        "{f:?} total"
    );
    let files: u64 = d["expert_pools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["files"].as_u64().unwrap())
        .sum();
    assert_eq!(files, ex.pools, "{f:?} pool files");
    // The MTP layer is said dropped, with its count of planned tensors (gpt-oss has none).
    let sidecar = d["sidecars"][0].as_str().unwrap_or("");
    assert!(
        f == Flagship::GptOss120b
            || (sidecar.contains(&format!("skipped by default, {} tensors (", ex.mtp_units))
                && sidecar.ends_with("--keep-mtp keeps them")),
        "{f:?}: {sidecar}"
    );
    // At most two requests per shard (the header's speculative read, and one more when
    // the header is longer), and what the report counts is what the hub saw.
    let index: Value = serde_json::from_slice(
        &std::fs::read(dir.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let mut shards: Vec<&str> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap())
        .collect();
    shards.sort_unstable();
    shards.dedup();
    let mut sum = 0;
    for s in &shards {
        let fs = stats.file(f.repo(), s);
        let n = fs.resolve + fs.cdn;
        assert!((1..=2).contains(&n), "{f:?} {s}: {n} requests");
        sum += n;
    }
    assert_eq!(d["requests"]["headers"].as_u64(), Some(sum), "{f:?}");
    assert_eq!(d["shards"]["count"].as_u64(), Some(shards.len() as u64));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deepseek_v3_full_size_dry_run_is_exact_from_headers() {
    check(Flagship::DeepSeekV3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kimi_k2_thinking_full_size_dry_run_is_exact_from_headers() {
    check(Flagship::KimiK2Thinking).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn glm_4_5_air_full_size_dry_run_is_exact_from_headers() {
    check(Flagship::Glm45Air).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen3_next_80b_full_size_dry_run_is_exact_from_headers() {
    check(Flagship::Qwen3Next80b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn minimax_m2_full_size_dry_run_is_exact_from_headers() {
    check(Flagship::MiniMaxM2).await;
}

/// gpt-oss-120b keeps its MXFP4 experts as they are (the pools hold the block and
/// scale bytes), its dry run exact like the others; the `original/` and `metal/` copies
/// beside the weights are never asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpt_oss_120b_full_size_dry_run_is_exact_and_reads_no_other_copy() {
    let f = Flagship::GptOss120b;
    check(f).await;
    let (_, dir, stats, _) = dry_run(f).await;
    assert!(dir.path().join("metal/model.bin").exists());
    for (path, fs) in &stats.files {
        assert!(
            !path.contains("/original/") && !path.contains("/metal/"),
            "{path}: {fs:?}"
        );
    }
}

// ------------------------------------------------------------ Kimi-K2's tokenizer

const DEEPSEEK_TOY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/deepseek_toy");

/// The git blob id of `bytes` (`git hash-object`), computed here, not by gturbo.
fn git_blob_sha1(bytes: &[u8]) -> String {
    use sha1::Digest as _;
    let mut h = sha1::Sha1::new();
    h.update(format!("blob {}\0", bytes.len()));
    h.update(bytes);
    hex::encode(h.finalize())
}

/// Kimi-K2 ships `tiktoken.model` and `tokenization_kimi.py` instead of a
/// `tokenizer.json`; the `deepseek_v3` family names them (`tokenizer_files`), so an
/// install from the hub copies them verified against their published git blob ids,
/// records them in the receipt, and verify-install accepts `tiktoken.model` as the
/// tokenizer. Other bytes served for `tiktoken.model` are refused naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kimi_k2_tiktoken_files_are_copied_verified_and_recorded() {
    let tmp = temp_dir();
    let snap = tmp.path().join("kimi");
    std::fs::create_dir_all(&snap).unwrap();
    gturbo_testkit::replica::write_kimi_tokenizer(&snap).unwrap();
    for f in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "generation_config.json",
    ] {
        std::fs::copy(Path::new(DEEPSEEK_TOY).join(f), snap.join(f)).unwrap();
    }
    let mut config: Value = serde_json::from_slice(
        &std::fs::read(Path::new(DEEPSEEK_TOY).join("config.json")).unwrap(),
    )
    .unwrap();
    config["model_type"] = "kimi_k2".into();
    std::fs::write(snap.join("config.json"), config.to_string()).unwrap();
    let (hub, repo) = start_hub("moonshotai/kimi-toy", &snap, HubConfig::default()).await;
    let install = |out: &Path| {
        gturbo()
            .args([
                "-q",
                "install",
                "moonshotai/kimi-toy",
                "--endpoint",
                hub.url(),
            ])
            .args(["--revision", &repo.commit, "--quant", "bf16", "--out"])
            .arg(out)
            .output()
            .unwrap()
    };
    let out = tmp.path().join("kimi.gturbo");
    let o = install(&out);
    assert!(o.status.success(), "{}", text(&o));
    let receipt: Value =
        serde_json::from_slice(&std::fs::read(out.join("verified-install.json")).unwrap()).unwrap();
    for f in [
        "tiktoken.model",
        "tokenization_kimi.py",
        "tokenizer_config.json",
    ] {
        let bytes = std::fs::read(snap.join(f)).unwrap();
        assert_eq!(
            std::fs::read(out.join("tokenizer").join(f)).unwrap(),
            bytes,
            "{f}"
        );
        let c = receipt["source_copied"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["path"] == f)
            .unwrap_or_else(|| panic!("{f} not in the receipt"));
        assert_eq!(c["git_oid"], git_blob_sha1(&bytes).as_str(), "{c}");
        assert_eq!(c["verified"], true, "{c}");
    }
    let o = gturbo().arg("verify-install").arg(&out).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));

    // Other bytes of the same length for tiktoken.model: refused, naming it.
    let mut bad = std::fs::read(snap.join("tiktoken.model")).unwrap();
    bad[0] ^= 1;
    hub.faults().push(
        gturbo_testkit::hub::Fault::new(gturbo_testkit::hub::FaultKind::SwappedBody(bad))
            .path("tiktoken.model")
            .always(),
    );
    let out2 = tmp.path().join("bad.gturbo");
    let o = install(&out2);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains(
            "tiktoken.model: source git blob id mismatch: the bytes read are not the published file"
        ),
        "{}",
        text(&o)
    );
    assert!(!out2.exists());
}
