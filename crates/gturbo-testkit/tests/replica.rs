//! Replica fixtures: the files are parsed here with serde_json alone, independently
//! of gturbo's header parser, so these tests pin the fixtures themselves.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;

use gturbo_testkit::replica::{
    FlashNextSpec, LlamaSpec, Qwen3MoeSpec, Qwen3Spec, write_flash_next, write_llama, write_qwen3,
    write_qwen3_moe,
};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// A parsed shard header: header length and tensors in file order.
struct Shard {
    header_len: u64,
    tensors: Vec<(String, Value)>,
    file_len: u64,
}

fn read_shard(path: &Path) -> Shard {
    use std::io::Read;
    let mut f = fs::File::open(path).unwrap();
    let mut len = [0u8; 8];
    f.read_exact(&mut len).unwrap();
    let n = u64::from_le_bytes(len);
    let mut json = vec![0u8; n as usize];
    f.read_exact(&mut json).unwrap();
    // serde_json's preserve_order is off, so read the keys' order from the text.
    let map: serde_json::Map<String, Value> = serde_json::from_slice(&json).unwrap();
    let text = String::from_utf8(json.clone()).unwrap();
    let mut tensors: Vec<(String, Value)> = map
        .into_iter()
        .filter(|(k, _)| k != "__metadata__")
        .collect();
    tensors.sort_by_key(|(k, _)| text.find(&format!("\"{k}\":")).unwrap());
    assert!(text.starts_with(r#"{"__metadata__":{"format":"pt"}"#));
    assert_eq!(n % 8, 0, "{}: header length {n}", path.display());
    assert_eq!(
        text.trim_end().len() + (text.len() - text.trim_end().len()),
        text.len()
    );
    Shard {
        header_len: n,
        tensors,
        file_len: fs::metadata(path).unwrap().len(),
    }
}

fn shape(v: &Value) -> Vec<u64> {
    v["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_u64().unwrap())
        .collect()
}

fn offsets(v: &Value) -> (u64, u64) {
    let o = v["data_offsets"].as_array().unwrap();
    (o[0].as_u64().unwrap(), o[1].as_u64().unwrap())
}

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&fs::read(path).unwrap()).unwrap()
}

/// All tensors of a snapshot, checked for contiguity, dtype × shape = span, and the
/// index (if any) agreeing with the headers in both directions.
fn check_snapshot(dir: &Path) -> BTreeMap<String, (String, Value)> {
    let mut all = BTreeMap::new();
    let index = dir.join("model.safetensors.index.json");
    let shard_names: Vec<String> = if index.exists() {
        let idx = read_json(&index);
        let map = idx["weight_map"].as_object().unwrap();
        let names: BTreeSet<String> = map.values().map(|v| v.as_str().unwrap().into()).collect();
        names.into_iter().collect()
    } else {
        vec!["model.safetensors".into()]
    };
    for name in &shard_names {
        let shard = read_shard(&dir.join(name));
        let mut at = 0;
        for (t, info) in &shard.tensors {
            let (start, end) = offsets(info);
            assert_eq!(start, at, "{name}: {t} is not contiguous");
            let elem = match info["dtype"].as_str().unwrap() {
                "BF16" => 2,
                "I64" => 8,
                other => panic!("{t}: unexpected dtype {other}"),
            };
            assert_eq!(
                end - start,
                elem * shape(info).iter().product::<u64>(),
                "{t}"
            );
            at = end;
            assert!(
                all.insert(t.clone(), (name.clone(), info.clone()))
                    .is_none(),
                "{t}"
            );
        }
        assert_eq!(shard.file_len, 8 + shard.header_len + at, "{name}");
    }
    if index.exists() {
        let idx = read_json(&index);
        let map = idx["weight_map"].as_object().unwrap();
        let from_index: BTreeMap<&str, &str> = map
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str().unwrap()))
            .collect();
        let from_headers: BTreeMap<&str, &str> = all
            .iter()
            .map(|(k, (s, _))| (k.as_str(), s.as_str()))
            .collect();
        assert_eq!(from_index, from_headers);
        let total: u64 = all.values().map(|(_, v)| offsets(v).1 - offsets(v).0).sum();
        assert_eq!(idx["metadata"]["total_size"].as_u64().unwrap(), total);
    }
    all
}

fn hashes(dir: &Path) -> BTreeMap<String, String> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let bytes = fs::read(e.path()).unwrap();
            (
                e.file_name().into_string().unwrap(),
                hex::encode(Sha256::digest(&bytes)),
            )
        })
        .collect()
}

#[test]
fn full_flash_next_replica_matches_the_reference_shapes_and_is_sparse() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("flash-next");
    let summary = write_flash_next(&dir, &FlashNextSpec::full()).unwrap();

    assert_eq!(summary.shards.len(), 131);
    assert_eq!(summary.shards[0], "model-00001-of-00131.safetensors");
    assert_eq!(summary.shards[130], "model-00131-of-00131.safetensors");
    assert_eq!(summary.tensors, 1655);
    assert_eq!(summary.total_size, 359_996_670_456);
    // Within 0.001 % of the published 359,999,963,128.
    assert_eq!(359_999_963_128 - summary.total_size, 3_292_672);

    let all = check_snapshot(&dir);
    assert_eq!(all.len(), 1655);
    let idx = read_json(&dir.join("model.safetensors.index.json"));
    assert_eq!(
        idx["metadata"]["total_size"].as_u64(),
        Some(359_996_670_456)
    );
    assert_eq!(idx["weight_map"].as_object().unwrap().len(), 1655);

    let mut apparent = 0;
    let mut headers = 0;
    let mut disk = 0;
    for name in &summary.shards {
        let meta = fs::metadata(dir.join(name)).unwrap();
        apparent += meta.len();
        disk += meta.blocks() * 512;
        headers += 8 + read_shard(&dir.join(name)).header_len;
    }
    assert_eq!(apparent, summary.total_size + headers);
    assert!(disk < 64 << 20, "replica takes {disk} bytes on disk");

    let lm = "model.language_model.";
    let shape_of = |t: &str| shape(&all[t].1);
    for i in 0..48 {
        let p = format!("{lm}layers.{i}.");
        assert_eq!(
            shape_of(&format!("{p}mlp.experts.gate_up_proj")),
            [512, 1280, 2560]
        );
        assert_eq!(
            shape_of(&format!("{p}mlp.experts.down_proj")),
            [512, 2560, 640]
        );
        assert_eq!(shape_of(&format!("{p}mlp.gate.weight")), [512, 2560]);
        assert_eq!(
            shape_of(&format!(
                "{p}mlp_hyper_connection.input_mix_weight_down.weight"
            )),
            [320, 10240]
        );
        let indexed = (i + 1) % 4 == 0;
        assert_eq!(
            all.contains_key(&format!("{p}self_attn.indexer.index_qk_proj.weight")),
            indexed
        );
        assert_eq!(
            all.contains_key(&format!("{p}linear_attn.in_proj_qkv.weight")),
            !indexed
        );
    }
    assert_eq!(
        shape_of(&format!("{lm}layers.3.self_attn.q_proj.weight")),
        [12288, 2560]
    );
    assert_eq!(
        shape_of(&format!(
            "{lm}layers.3.self_attn.indexer.index_qk_proj.weight"
        )),
        [640, 2560]
    );
    assert_eq!(
        shape_of(&format!("{lm}layers.0.linear_attn.in_proj_qkv.weight")),
        [10240, 2560]
    );
    assert_eq!(
        shape_of(&format!("{lm}layers.0.linear_attn.conv1d.weight")),
        [10240, 1, 4]
    );
    for s in 0..128 {
        let t = format!("{lm}layers.1.ple.ple_embedding.ngram_embedding.shard_{s}.weight");
        assert_eq!(shape_of(&t), [2_500_012, 160]);
        assert_eq!(all[&t].1["dtype"], "BF16");
    }
    for (t, n) in [
        ("layer_multipliers", 3),
        ("ngram_heads_vocab_sizes", 16),
        ("ngram_heads_offsets", 16),
    ] {
        let info = &all[&format!("{lm}layers.1.ple.ple_embedding.{t}")].1;
        assert_eq!(info["dtype"], "I64");
        assert_eq!(shape(info), [n]);
    }
    assert_eq!(
        shape_of(&format!("{lm}embed_tokens.weight")),
        [248_320, 2560]
    );
    assert_eq!(shape_of("lm_head.weight"), [248_320, 2560]);
    assert_eq!(
        shape_of("mtp.layers.0.mlp.experts.gate_up_proj"),
        [512, 1280, 2560]
    );
    assert_eq!(
        all.keys()
            .filter(|k| k.starts_with("model.visual.blocks.") && k.ends_with("attn.qkv.weight"))
            .count(),
        27
    );
    assert!(
        !all.keys()
            .any(|k| k.contains("layernorm") && k.contains("input_layernorm"))
    );

    let config = read_json(&dir.join("config.json"));
    assert_eq!(config["model_type"], "qwen4_exp");
    let text = &config["text_config"];
    assert_eq!(text["model_type"], "qwen4_exp_text");
    assert_eq!(text["num_experts"], 512);
    assert_eq!(text["hc_lowrank"], 320);
    assert_eq!(text["eos_token_id"], 248_044);
    let types = text["layer_types"].as_array().unwrap();
    assert_eq!(types.len(), 48);
    assert_eq!(
        types.iter().filter(|t| *t == "indexed_attention").count(),
        12
    );
    assert_eq!(config["vision_config"]["depth"], 27);
    let tok = read_json(&dir.join("tokenizer.json"));
    assert_eq!(tok["model"]["vocab"]["<|im_end|>"], 248_044);
}

#[test]
fn full_replica_writes_the_ple_integer_tables() {
    let tmp = tempfile::tempdir().unwrap();
    write_flash_next(tmp.path(), &FlashNextSpec::full()).unwrap();
    let all = check_snapshot(tmp.path());
    let read_i64 = |t: &str| -> Vec<i64> {
        let (shard, info) = &all[&format!("model.language_model.layers.1.ple.ple_embedding.{t}")];
        // The shard is gigabytes of holes: read the table's bytes only.
        use std::io::{Read, Seek, SeekFrom};
        let mut f = fs::File::open(tmp.path().join(shard)).unwrap();
        let mut len = [0u8; 8];
        f.read_exact(&mut len).unwrap();
        let (a, b) = offsets(info);
        f.seek(SeekFrom::Start(8 + u64::from_le_bytes(len) + a))
            .unwrap();
        let mut bytes = vec![0u8; (b - a) as usize];
        f.read_exact(&mut bytes).unwrap();
        bytes
            .chunks(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let sizes = read_i64("ngram_heads_vocab_sizes");
    // The first 16 primes from ngram_vocab_size_base 20,000,000, as the config implies.
    assert_eq!(sizes[0], 20_000_003);
    assert!(sizes.windows(2).all(|w| w[0] < w[1]));
    assert_eq!(sizes.len(), 16);
    assert_eq!(sizes.iter().sum::<i64>(), 320_001_446);
    assert_eq!(
        (sizes.iter().sum::<i64>() as u64).div_ceil(128) * 128,
        128 * 2_500_012
    );
    let offs = read_i64("ngram_heads_offsets");
    let mut acc = 0;
    for (o, v) in offs.iter().zip(&sizes) {
        assert_eq!(*o, acc);
        acc += v;
    }
    assert!(
        read_i64("layer_multipliers")
            .iter()
            .all(|m| m % 2 == 1 && *m > 0)
    );
}

#[test]
fn scaled_replica_is_deterministic_per_seed_and_keeps_the_structure() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, c) = (
        tmp.path().join("a"),
        tmp.path().join("b"),
        tmp.path().join("c"),
    );
    let summary = write_flash_next(&a, &FlashNextSpec::scaled()).unwrap();
    write_flash_next(&b, &FlashNextSpec::scaled()).unwrap();
    write_flash_next(&c, &FlashNextSpec::scaled().with_seed(1)).unwrap();
    let (ha, hb, hc) = (hashes(&a), hashes(&b), hashes(&c));
    assert_eq!(ha.len(), summary.files.len());
    assert_eq!(ha, hb);
    for shard in &summary.shards {
        assert_ne!(ha[shard], hc[shard], "{shard} ignores the seed");
    }
    assert_eq!(ha["config.json"], hc["config.json"]);

    assert_eq!(summary.shards.len(), 6);
    let all = check_snapshot(&a);
    assert_eq!(all.len(), summary.tensors);
    let lm = "model.language_model.";
    let rows = [3107u64; 4];
    for (s, r) in rows.iter().enumerate() {
        let t = format!("{lm}layers.1.ple.ple_embedding.ngram_embedding.shard_{s}.weight");
        assert_eq!(shape(&all[&t].1), [*r, 160]);
        assert_ne!(r % 51, 0, "shard {s} ends in a full block");
    }
    assert_eq!(3107 % 51, 47);
    assert_eq!(
        shape(&all[&format!("{lm}layers.0.mlp.experts.gate_up_proj")].1),
        [8, 256, 256]
    );
    assert_eq!(
        shape(&all[&format!("{lm}layers.0.mlp.experts.down_proj")].1),
        [8, 256, 128]
    );
    assert!(all.contains_key(&format!(
        "{lm}layers.3.self_attn.indexer.index_qk_proj.weight"
    )));
    assert!(all.contains_key(&format!("{lm}layers.2.linear_attn.in_proj_qkv.weight")));
    assert_eq!(
        shape(&all["mtp.layers.0.mlp.experts.gate_up_proj"].1),
        [8, 256, 256]
    );
    // Some shard holds tensors of two different decoder layers.
    let mut layers_per_shard: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for (t, (shard, _)) in &all {
        if let Some(rest) = t.strip_prefix("model.language_model.layers.") {
            let layer = rest.split('.').next().unwrap();
            layers_per_shard.entry(shard).or_default().insert(layer);
        }
    }
    assert!(layers_per_shard.values().any(|l| l.len() >= 2));

    // Values are BF16 with a spread near the 0.02 init scale.
    let (shard, info) = &all[&format!("{lm}layers.0.mlp.experts.down_proj")];
    let bytes = fs::read(a.join(shard)).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let (s, e) = offsets(info);
    let vals: Vec<f64> = bytes[8 + n + s as usize..8 + n + e as usize]
        .chunks(2)
        .map(|c| f64::from(half::bf16::from_le_bytes([c[0], c[1]]).to_f32()))
        .collect();
    let mean = vals.iter().sum::<f64>() / vals.len() as f64;
    let std = (vals.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / vals.len() as f64).sqrt();
    assert!(mean.abs() < 0.001, "mean {mean}");
    assert!((std - 0.02).abs() < 0.001, "std {std}");
}

#[test]
fn single_file_qwen3_has_no_index_and_ties_embeddings() {
    let tmp = tempfile::tempdir().unwrap();
    let summary = write_qwen3(tmp.path(), &Qwen3Spec::tiny()).unwrap();
    assert_eq!(summary.shards, ["model.safetensors"]);
    assert_eq!(summary.index, None);
    assert!(!tmp.path().join("model.safetensors.index.json").exists());
    assert_eq!(
        summary.files,
        [
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json"
        ]
    );
    let all = check_snapshot(tmp.path());
    assert!(!all.contains_key("lm_head.weight"));
    assert_eq!(
        shape(&all["model.layers.1.self_attn.q_norm.weight"].1),
        [64]
    );
    assert_eq!(
        shape(&all["model.layers.0.mlp.down_proj.weight"].1),
        [128, 256]
    );
    // 1 embedding + 2 × 11 per layer + final norm.
    assert_eq!(all.len(), 24);
    let config = read_json(&tmp.path().join("config.json"));
    assert_eq!(config["model_type"], "qwen3");
    assert_eq!(config["tie_word_embeddings"], true);

    let untied = tmp.path().join("untied");
    let spec = Qwen3Spec {
        tie_word_embeddings: false,
        shards: 3,
        ..Qwen3Spec::tiny()
    };
    let summary = write_qwen3(&untied, &spec).unwrap();
    assert_eq!(summary.shards.len(), 3);
    assert!(check_snapshot(&untied).contains_key("lm_head.weight"));
}

#[test]
fn qwen3_moe_has_unfused_experts_and_an_index() {
    let tmp = tempfile::tempdir().unwrap();
    let summary = write_qwen3_moe(tmp.path(), &Qwen3MoeSpec::tiny()).unwrap();
    assert_eq!(
        summary.shards,
        [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors"
        ]
    );
    let all = check_snapshot(tmp.path());
    for l in 0..2 {
        assert_eq!(
            shape(&all[&format!("model.layers.{l}.mlp.gate.weight")].1),
            [8, 128]
        );
        for e in 0..8 {
            let p = format!("model.layers.{l}.mlp.experts.{e}.");
            assert_eq!(shape(&all[&format!("{p}gate_proj.weight")].1), [64, 128]);
            assert_eq!(shape(&all[&format!("{p}up_proj.weight")].1), [64, 128]);
            assert_eq!(shape(&all[&format!("{p}down_proj.weight")].1), [128, 64]);
        }
    }
    assert!(all.contains_key("lm_head.weight"));
    assert!(all.contains_key("model.norm.weight"));
    let config = read_json(&tmp.path().join("config.json"));
    assert_eq!(config["model_type"], "qwen3_moe");
    assert_eq!(config["num_experts"], 8);
    assert_eq!(config["decoder_sparse_step"], 1);
    assert_eq!(config["mlp_only_layers"], serde_json::json!([]));
    assert_eq!(config["norm_topk_prob"], true);
    let tok = read_json(&tmp.path().join("tokenizer.json"));
    assert_eq!(tok["model"]["vocab"]["<|im_end|>"], config["eos_token_id"]);
}

#[test]
fn llama_is_tied_and_has_no_qk_norm() {
    let tmp = tempfile::tempdir().unwrap();
    let summary = write_llama(tmp.path(), &LlamaSpec::tiny()).unwrap();
    assert_eq!(summary.index, None);
    let all = check_snapshot(tmp.path());
    assert!(!all.contains_key("lm_head.weight"));
    assert!(!all.keys().any(|k| k.contains("q_norm")));
    assert_eq!(
        shape(&all["model.layers.0.self_attn.k_proj.weight"].1),
        [64, 128]
    );
    let config = read_json(&tmp.path().join("config.json"));
    assert_eq!(config["model_type"], "llama");
    assert_eq!(config["bos_token_id"], 510);
    assert_eq!(config["eos_token_id"], 511);
}

#[test]
fn cli_writes_a_snapshot_and_prints_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("moe");
    let run = Command::new(env!("CARGO_BIN_EXE_gturbo-dev"))
        .args(["replica", "qwen3-moe"])
        .arg(&out)
        .args(["--shards", "3", "--seed", "5"])
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let stdout = String::from_utf8(run.stdout).unwrap();
    assert_eq!(stdout.lines().count(), 1);
    let spec = Qwen3MoeSpec {
        shards: 3,
        seed: 5,
        ..Qwen3MoeSpec::tiny()
    };
    let again = tmp.path().join("again");
    let summary = write_qwen3_moe(&again, &spec).unwrap();
    assert_eq!(
        stdout.trim_end(),
        summary
            .to_string()
            .replace(&again.display().to_string(), &out.display().to_string())
    );
    assert_eq!(hashes(&out), hashes(&again));

    let bad = Command::new(env!("CARGO_BIN_EXE_gturbo-dev"))
        .args(["replica", "flash-next"])
        .arg(tmp.path().join("x"))
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&bad.stderr)
            .starts_with("gturbo-dev replica: flash-next needs exactly one of --full, --scaled")
    );
}
