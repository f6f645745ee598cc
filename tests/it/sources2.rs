//! The checkpoints people download (issue 25, part 2): `config.json` as transformers 5
//! writes it, the family picked from `config.json`, MTP / NextN layers dropped by
//! default (`--keep-mtp` keeps them), source dtypes kept (F32, 1-D, conv1d), and a
//! family without a runner installing but refused at run time naming its axes.
//!
//! The GLM-4.5 and Qwen3-Next snapshots here are tiny (hidden 128, 4 experts) in the
//! real repos' tensor names, dtypes and shard layout: GLM's router weight is F32 and
//! its `e_score_correction_bias` F32 (transformers' `Glm4MoeTopkRouter` makes both
//! float32), its NextN layer is `model.layers.{num_hidden_layers}.*` in the last
//! shard; Qwen3-Next's conv1d kernel is `[C, 1, K]` and its MTP module is `mtp.*`.

use std::collections::BTreeMap;
use std::path::Path;

use gturbo_testkit::replica::{LlamaSpec, write_llama};
use serde_json::{Value, json};

use crate::support::cli::{gturbo, gturbo_args, install, run_json, text, try_install};
use crate::support::temp_dir;

/// One tensor to write: name, dtype, shape.
type Def = (String, &'static str, Vec<u64>);

/// One tensor to write with its bytes: name, dtype, shape, bytes.
type StTensor = (String, &'static str, Vec<u64>, Vec<u8>);

/// Bytes of `dtype` for `n` elements: small seeded values (finite, non-zero).
fn values(dtype: &str, n: u64, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::new();
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let v = ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2 + 0.001;
        match dtype {
            "F32" => out.extend(v.to_le_bytes()),
            _ => out.extend(((v.to_bits() >> 16) as u16).to_le_bytes()),
        }
    }
    out
}

/// Write `shards` (file name → tensors) as safetensors with an index, and `config`.
fn write_snapshot(dir: &Path, shards: &[(&str, Vec<Def>)], config: &Value) {
    std::fs::create_dir_all(dir).unwrap();
    let mut weight_map = serde_json::Map::new();
    let mut total = 0u64;
    let mut seed = 1u64;
    for (file, defs) in shards {
        let mut head = serde_json::Map::new();
        head.insert("__metadata__".into(), json!({"format": "pt"}));
        let mut data = Vec::new();
        for (name, dtype, shape) in defs {
            seed += 1;
            let bytes = values(dtype, shape.iter().product(), seed);
            head.insert(
                name.clone(),
                json!({"dtype": dtype, "shape": shape,
                       "data_offsets": [data.len(), data.len() + bytes.len()]}),
            );
            data.extend(bytes);
            weight_map.insert(name.clone(), json!(file));
        }
        total += data.len() as u64;
        let mut h = serde_json::to_vec(&Value::Object(head)).unwrap();
        while !h.len().is_multiple_of(8) {
            h.push(b' ');
        }
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend(h);
        out.extend(data);
        std::fs::write(dir.join(file), out).unwrap();
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_vec_pretty(
            &json!({"metadata": {"total_size": total}, "weight_map": weight_map}),
        )
        .unwrap(),
    )
    .unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(config).unwrap(),
    )
    .unwrap();
    // The tokenizer files of a tiny Llama (an install without one does not verify).
    let llama = dir.with_extension("llama");
    write_llama(&llama, &LlamaSpec::tiny()).unwrap();
    for e in std::fs::read_dir(&llama).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        if name.starts_with("tokenizer") || name.starts_with("special_tokens") {
            std::fs::copy(&p, dir.join(&name)).unwrap();
        }
    }
}

const H: u64 = 128;
const VOCAB: u64 = 256;
const EXPERTS: u64 = 4;
const MOE_I: u64 = 64;

fn def(name: String, dtype: &'static str, shape: &[u64]) -> Def {
    (name, dtype, shape.to_vec())
}

/// One routed-expert layer of `p` (`…mlp.`): router, experts, and the shared expert
/// under `shared` (`shared_experts` for GLM, `shared_expert` for Qwen3-Next).
fn moe(out: &mut Vec<Def>, p: &str, router: &'static str, shared: &str) {
    out.push(def(format!("{p}gate.weight"), router, &[EXPERTS, H]));
    for e in 0..EXPERTS {
        for (part, shape) in [
            ("gate_proj", [MOE_I, H]),
            ("up_proj", [MOE_I, H]),
            ("down_proj", [H, MOE_I]),
        ] {
            out.push(def(format!("{p}experts.{e}.{part}.weight"), "BF16", &shape));
        }
    }
    for (part, shape) in [
        ("gate_proj", [MOE_I, H]),
        ("up_proj", [MOE_I, H]),
        ("down_proj", [H, MOE_I]),
    ] {
        out.push(def(format!("{p}{shared}.{part}.weight"), "BF16", &shape));
    }
}

/// The tiny GLM-4.5: layer 0 dense, layer 1 routed, layer 2 the NextN layer (in the
/// second shard, with its `eh_proj`, `enorm`, `hnorm` and `shared_head`).
fn write_glm(dir: &Path) {
    let (heads, kv, hd) = (2u64, 1u64, 64u64);
    let layer = |l: u64, out: &mut Vec<Def>| {
        let p = format!("model.layers.{l}.");
        out.push(def(format!("{p}input_layernorm.weight"), "BF16", &[H]));
        out.push(def(
            format!("{p}post_attention_layernorm.weight"),
            "BF16",
            &[H],
        ));
        for (n, rows) in [
            ("q_proj", heads * hd),
            ("k_proj", kv * hd),
            ("v_proj", kv * hd),
        ] {
            out.push(def(format!("{p}self_attn.{n}.weight"), "BF16", &[rows, H]));
            out.push(def(format!("{p}self_attn.{n}.bias"), "BF16", &[rows]));
        }
        out.push(def(
            format!("{p}self_attn.o_proj.weight"),
            "BF16",
            &[H, heads * hd],
        ));
        if l == 0 {
            out.push(def(format!("{p}mlp.gate_proj.weight"), "BF16", &[256, H]));
            out.push(def(format!("{p}mlp.up_proj.weight"), "BF16", &[256, H]));
            out.push(def(format!("{p}mlp.down_proj.weight"), "BF16", &[H, 256]));
        } else {
            moe(out, &format!("{p}mlp."), "F32", "shared_experts");
            out.push(def(
                format!("{p}mlp.gate.e_score_correction_bias"),
                "F32",
                &[EXPERTS],
            ));
        }
    };
    let mut first = vec![def("model.embed_tokens.weight".into(), "BF16", &[VOCAB, H])];
    layer(0, &mut first);
    layer(1, &mut first);
    first.push(def("model.norm.weight".into(), "BF16", &[H]));
    let mut last = vec![def("lm_head.weight".into(), "BF16", &[VOCAB, H])];
    layer(2, &mut last);
    let p = "model.layers.2.";
    last.push(def(format!("{p}eh_proj.weight"), "BF16", &[H, 2 * H]));
    for n in ["enorm", "hnorm", "shared_head.norm"] {
        last.push(def(format!("{p}{n}.weight"), "BF16", &[H]));
    }
    last.push(def(
        format!("{p}shared_head.head.weight"),
        "BF16",
        &[VOCAB, H],
    ));
    last.push(def(format!("{p}embed_tokens.weight"), "BF16", &[VOCAB, H]));
    let config = json!({
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
        "hidden_size": H, "num_hidden_layers": 2, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": hd, "intermediate_size": 256,
        "moe_intermediate_size": MOE_I, "n_routed_experts": EXPERTS, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0, "norm_topk_prob": true, "use_qk_norm": false,
        "attention_bias": true, "num_nextn_predict_layers": 1, "vocab_size": VOCAB,
        "partial_rotary_factor": 0.5, "rope_theta": 1_000_000, "rope_scaling": null,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": false,
        "torch_dtype": "bfloat16", "transformers_version": "4.54.0"
    });
    write_snapshot(
        dir,
        &[
            ("model-00001-of-00002.safetensors", first),
            ("model-00002-of-00002.safetensors", last),
        ],
        &config,
    );
}

/// The tiny Qwen3-Next: layer 0 Gated DeltaNet, layer 1 gated attention, both routed
/// with a gated shared expert; `mtp.*` one MTP layer. Its config is transformers 5's
/// (`rope_parameters`, `dtype`).
fn write_qwen3_next(dir: &Path) {
    let mut t = vec![def("model.embed_tokens.weight".into(), "BF16", &[VOCAB, H])];
    let attn = |p: &str, out: &mut Vec<Def>| {
        out.push(def(
            format!("{p}self_attn.q_proj.weight"),
            "BF16",
            &[256, H],
        ));
        out.push(def(format!("{p}self_attn.k_proj.weight"), "BF16", &[64, H]));
        out.push(def(format!("{p}self_attn.v_proj.weight"), "BF16", &[64, H]));
        out.push(def(
            format!("{p}self_attn.o_proj.weight"),
            "BF16",
            &[H, 128],
        ));
        out.push(def(format!("{p}self_attn.q_norm.weight"), "BF16", &[64]));
        out.push(def(format!("{p}self_attn.k_norm.weight"), "BF16", &[64]));
    };
    let norms = |p: &str, out: &mut Vec<Def>| {
        out.push(def(format!("{p}input_layernorm.weight"), "BF16", &[H]));
        out.push(def(
            format!("{p}post_attention_layernorm.weight"),
            "BF16",
            &[H],
        ));
    };
    let shared_gate = |p: &str, out: &mut Vec<Def>| {
        out.push(def(
            format!("{p}mlp.shared_expert_gate.weight"),
            "BF16",
            &[1, H],
        ));
    };
    let p = "model.layers.0.";
    norms(p, &mut t);
    for (n, dtype, shape) in [
        ("in_proj_qkvz.weight", "BF16", vec![384, H]),
        ("in_proj_ba.weight", "BF16", vec![4, H]),
        ("conv1d.weight", "BF16", vec![256, 1, 4]),
        ("A_log", "F32", vec![2]),
        ("dt_bias", "BF16", vec![2]),
        ("norm.weight", "F32", vec![64]),
        ("out_proj.weight", "BF16", vec![H, 128]),
    ] {
        t.push((format!("{p}linear_attn.{n}"), dtype, shape));
    }
    moe(&mut t, &format!("{p}mlp."), "BF16", "shared_expert");
    shared_gate(p, &mut t);
    let p = "model.layers.1.";
    norms(p, &mut t);
    attn(p, &mut t);
    moe(&mut t, &format!("{p}mlp."), "BF16", "shared_expert");
    shared_gate(p, &mut t);
    t.push(def("model.norm.weight".into(), "BF16", &[H]));
    t.push(def("lm_head.weight".into(), "BF16", &[VOCAB, H]));
    let mut mtp = vec![def("mtp.fc.weight".into(), "BF16", &[H, 2 * H])];
    for n in ["norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"] {
        mtp.push(def(format!("mtp.{n}.weight"), "BF16", &[H]));
    }
    norms("mtp.layers.0.", &mut mtp);
    attn("mtp.layers.0.", &mut mtp);
    moe(&mut mtp, "mtp.layers.0.mlp.", "BF16", "shared_expert");
    shared_gate("mtp.layers.0.", &mut mtp);
    let config = json!({
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "hidden_size": H, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 64, "intermediate_size": 256,
        "num_experts": EXPERTS, "num_experts_per_tok": 2, "moe_intermediate_size": MOE_I,
        "shared_expert_intermediate_size": MOE_I, "decoder_sparse_step": 1,
        "full_attention_interval": 2, "norm_topk_prob": true, "mlp_only_layers": [],
        "linear_num_key_heads": 1, "linear_key_head_dim": 64, "linear_num_value_heads": 2,
        "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "vocab_size": VOCAB,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000,
                            "partial_rotary_factor": 0.25},
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": false,
        "dtype": "bfloat16", "transformers_version": "5.24.0"
    });
    write_snapshot(
        dir,
        &[
            ("model-00001-of-00002.safetensors", t),
            ("model-00002-of-00002.safetensors", mtp),
        ],
        &config,
    );
}

/// `gturbo install --family FAMILY local/x --from SNAP --dry-run --json --quant Q
/// --emit-plan … EXTRA…`: the report and the plan.
fn dry(snap: &Path, family: &str, quant: &str, extra: &[&str]) -> (Value, Value) {
    let tmp = temp_dir();
    let plan_file = tmp.path().join("plan.json");
    let mut args = vec!["--dry-run", "--json", "--quant", quant, "--emit-plan"];
    args.push(plan_file.to_str().unwrap());
    args.extend_from_slice(extra);
    let o = try_install(family, snap, &tmp.path().join("o.gturbo"), &args);
    assert!(
        o.status.success(),
        "{family} {quant} {extra:?}: {}",
        text(&o)
    );
    (
        serde_json::from_slice(&o.stdout).unwrap(),
        serde_json::from_slice(&std::fs::read(&plan_file).unwrap()).unwrap(),
    )
}

/// Name → (dtype, scheme, where it goes) of every planned tensor.
fn planned(plan: &Value) -> BTreeMap<String, (String, String, String)> {
    plan["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["name"].as_str().unwrap().to_string(),
                (
                    t["dtype"].as_str().unwrap().to_string(),
                    t["scheme"].as_str().unwrap_or("").to_string(),
                    t["dest"]["kind"].as_str().unwrap().to_string(),
                ),
            )
        })
        .collect()
}

// ------------------------------------------------------------ transformers 5 configs

/// A tiny Llama whose config.json is as transformers 5.24 saves it (`rope_parameters`
/// holding `rope_theta`, `dtype`) installs and runs with the tokens of the same
/// checkpoint under its 4.x config; the manifest's axes carry the same theta.
#[test]
fn a_llama_saved_by_transformers_5_installs_and_runs_as_its_4x_twin() {
    let work = temp_dir();
    let v4 = work.path().join("v4");
    write_llama(&v4, &LlamaSpec::tiny()).unwrap();
    let v5 = work.path().join("v5");
    std::fs::create_dir_all(&v5).unwrap();
    for e in std::fs::read_dir(&v4).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, v5.join(p.file_name().unwrap())).unwrap();
    }
    let mut config: Value =
        serde_json::from_slice(&std::fs::read(v4.join("config.json")).unwrap()).unwrap();
    let o = config.as_object_mut().unwrap();
    let theta = o.remove("rope_theta").unwrap();
    o.remove("rope_scaling");
    let dtype = o.remove("torch_dtype").unwrap();
    o.insert(
        "rope_parameters".into(),
        json!({"rope_theta": theta, "rope_type": "default"}),
    );
    o.insert("dtype".into(), dtype);
    o.insert("transformers_version".into(), json!("5.24.0"));
    std::fs::write(
        v5.join("config.json"),
        serde_json::to_vec_pretty(&config).unwrap(),
    )
    .unwrap();
    let mut tokens = Vec::new();
    for snap in [&v4, &v5] {
        let out = snap.with_extension("gturbo");
        install("llama", snap, &out, &[]);
        let m: Value =
            serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
        assert_eq!(m["arch"]["axes"]["rope_theta"], theta, "{}", snap.display());
        let (doc, _) = run_json(&out, &["--prompt-ids", "1,2,3", "--max-tokens", "6"]);
        tokens.push(doc["tokens"].clone());
    }
    assert!(
        tokens[0].as_array().is_some_and(|t| !t.is_empty()),
        "{tokens:?}"
    );
    assert_eq!(tokens[0], tokens[1]);
}

// ------------------------------------------------------------ the family from config.json

/// `gturbo install --from DIR` with no target, and `gturbo install ORG/NAME` with no
/// `--family`, pick the family whose `model_types` lists config.json's `model_type`,
/// saying so on stderr and in `--json`; an unknown `model_type` is refused naming the
/// field and the known families.
#[test]
fn config_json_picks_the_family_when_no_flag_names_one() {
    let work = temp_dir();
    let snap = work.path().join("glm");
    write_glm(&snap);
    let want =
        "family glm4_moe picked by config.json model_type `glm4_moe` (--family names another)";
    for target in [None, Some("zai-org/tiny-glm")] {
        let mut c = gturbo();
        c.arg("install");
        c.args(target);
        c.args(["--dry-run", "--json", "--from"]).arg(&snap);
        let o = c.output().unwrap();
        assert!(o.status.success(), "{target:?}: {}", text(&o));
        let doc: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(doc["family"], "glm4_moe");
        assert_eq!(doc["family_picked_by"], want);
        assert!(
            String::from_utf8_lossy(&o.stderr).contains(want),
            "{}",
            text(&o)
        );
    }
    // Named by a flag, nothing is picked.
    let (doc, _) = dry(&snap, "glm4_moe", "int4", &[]);
    assert_eq!(doc["family_picked_by"], Value::Null);
    // No family lists the model type.
    let mut config: Value =
        serde_json::from_slice(&std::fs::read(snap.join("config.json")).unwrap()).unwrap();
    config["model_type"] = json!("glm5_moe");
    std::fs::write(snap.join("config.json"), config.to_string()).unwrap();
    let o = gturbo()
        .args(["install", "--dry-run", "--from"])
        .arg(&snap)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(
            "config.json: field `model_type`: `glm5_moe` (architectures \
             [\"Glm4MoeForCausalLM\"]) is not a model type of any known family ("
        ) && err.contains("glm4_moe [glm4_moe]"),
        "{err}"
    );
    // Neither a target nor --from.
    let o = gturbo_args(&["install", "--dry-run"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("name a family id or a repo ORG/NAME"),
        "{}",
        text(&o)
    );
}

// ------------------------------------------------------------ MTP / NextN layers

/// GLM's NextN layer (`model.layers.{num_hidden_layers}`) and Qwen3-Next's `mtp.*`
/// are dropped by default, said in the dry run's text and JSON; `--keep-mtp` keeps
/// them, quantized like the rest (the NextN layer's experts in the mtp pool).
#[test]
fn mtp_layers_are_dropped_by_default_and_kept_with_keep_mtp() {
    let work = temp_dir();
    let glm = work.path().join("glm");
    write_glm(&glm);
    let next = work.path().join("next");
    write_qwen3_next(&next);
    for (snap, family, mtp_tensors, pools) in [
        (&glm, "glm4_moe", 32usize, 1usize),
        (&next, "qwen3_next", 29, 2),
    ] {
        let is_mtp = |n: &str| n.starts_with("mtp.") || n.starts_with("model.layers.2.");
        let (doc, plan) = dry(snap, family, "int4", &[]);
        let sidecar = doc["sidecars"][0].as_str().unwrap();
        assert!(
            sidecar.starts_with("mtp (")
                && sidecar.contains(&format!("): skipped by default, {mtp_tensors} tensors ("))
                && sidecar.ends_with("of the source not installed; --keep-mtp keeps them"),
            "{sidecar}"
        );
        let t = planned(&plan);
        let dropped: Vec<&String> = t.keys().filter(|n| is_mtp(n)).collect();
        assert_eq!(dropped.len(), mtp_tensors, "{dropped:?}");
        assert!(
            dropped.iter().all(|n| t[*n].2 == "excluded"),
            "{family}: {dropped:?}"
        );
        assert!(
            t.iter().all(|(n, v)| is_mtp(n) || v.2 != "excluded"),
            "{family}"
        );
        assert_eq!(
            plan["outputs"]["expert_pools"].as_array().unwrap().len(),
            pools
        );
        // The text report says it too.
        let o = try_install(family, snap, &work.path().join("x"), &["--dry-run"]);
        assert!(o.status.success(), "{}", text(&o));
        assert!(
            String::from_utf8_lossy(&o.stdout).contains("--keep-mtp keeps them"),
            "{}",
            text(&o)
        );
        // Kept: installed like the rest, the routed experts in a sidecar pool.
        let (doc, plan) = dry(snap, family, "int4", &["--keep-mtp"]);
        assert!(doc["sidecars"][0].as_str().unwrap().ends_with("): carried"));
        let t = planned(&plan);
        assert!(t.values().all(|v| v.2 != "excluded"), "{family}");
        let head = if family == "glm4_moe" {
            "model.layers.2.shared_head.head.weight"
        } else {
            "mtp.fc.weight"
        };
        assert_eq!(t[head].1, "int4_g64", "{head}");
        let kept = plan["outputs"]["expert_pools"].as_array().unwrap();
        assert_eq!(kept.len(), pools + 1);
        assert_eq!(kept[pools]["sidecar"], "mtp");
        assert_eq!(doc["census"]["excluded"]["tensors"], 0);
    }
    // --skip-mtp and --keep-mtp together are refused; --keep-mtp needs an mtp sidecar.
    let o = try_install(
        "glm4_moe",
        &glm,
        &work.path().join("y"),
        &["--dry-run", "--skip-mtp", "--keep-mtp"],
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let llama = work.path().join("llama");
    write_llama(&llama, &LlamaSpec::tiny()).unwrap();
    let o = try_install(
        "llama",
        &llama,
        &work.path().join("z"),
        &["--dry-run", "--keep-mtp"],
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("--keep-mtp: family llama has no mtp sidecar"),
        "{}",
        text(&o)
    );
}

// ------------------------------------------------------------ dtypes kept

/// At every profile, an F32 tensor stays F32 (GLM's F32 router weight, which the
/// family's INT8 override names, and its `e_score_correction_bias`), every tensor of
/// fewer than two dims stays in its source dtype, and the conv1d kernel stays as it
/// is; the BF16 matrices are quantized as the profile says.
#[test]
fn f32_1d_and_conv1d_tensors_keep_their_source_dtype_at_every_profile() {
    let work = temp_dir();
    let glm = work.path().join("glm");
    write_glm(&glm);
    let next = work.path().join("next");
    write_qwen3_next(&next);
    for (snap, family) in [(&glm, "glm4_moe"), (&next, "qwen3_next")] {
        let source: BTreeMap<String, (String, Vec<u64>)> = {
            let (_, plan) = dry(snap, family, "bf16", &["--keep-mtp"]);
            plan["tensors"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| {
                    let shape = t["shape"].as_array().unwrap();
                    (
                        t["name"].as_str().unwrap().to_string(),
                        (
                            t["dtype"].as_str().unwrap().to_string(),
                            shape.iter().map(|d| d.as_u64().unwrap()).collect(),
                        ),
                    )
                })
                .collect()
        };
        for quant in ["int4", "int8", "bf16", "mixed-3-6", "mixed-4-6"] {
            let (_, plan) = dry(snap, family, quant, &["--keep-mtp"]);
            let mut quantized = 0;
            for (name, (dtype, scheme, _)) in planned(&plan) {
                let (src_dtype, shape) = &source[&name];
                assert_eq!(&dtype, src_dtype, "{family} {quant} {name}");
                let keep = dtype == "F32" || shape.len() != 2 || name.contains("conv1d");
                if keep {
                    assert_eq!(scheme, "passthrough", "{family} {quant} {name}");
                } else if scheme != "passthrough" {
                    quantized += 1;
                }
            }
            assert_eq!(quantized > 0, quant != "bf16", "{family} {quant}");
        }
    }
    let (_, plan) = dry(&glm, "glm4_moe", "int4", &[]);
    let t = planned(&plan);
    assert_eq!(
        t["model.layers.1.mlp.gate.weight"],
        ("F32".into(), "passthrough".into(), "resident".into())
    );
    assert_eq!(
        t["model.layers.1.mlp.gate.e_score_correction_bias"],
        ("F32".into(), "passthrough".into(), "resident".into())
    );
    let (_, plan) = dry(&next, "qwen3_next", "int4", &[]);
    let t = planned(&plan);
    assert_eq!(t["model.layers.0.mlp.gate.weight"].1, "int8_g64");
    assert_eq!(
        t["model.layers.0.mlp.shared_expert_gate.weight"].1,
        "int8_g64"
    );
    assert_eq!(t["model.layers.1.self_attn.q_proj.weight"].1, "int4_g64");
    assert_eq!(t["model.embed_tokens.weight"].1, "int4_g64");
    assert_eq!(t["lm_head.weight"].1, "int4_g64");
}

// ------------------------------------------------------------ GLM's synthetic snapshot

/// The synthetic GLM-4.5 installs (and verifies) without its NextN layer, and its BF16
/// install runs on the glm4_moe runner (tests/it/glm.rs checks the numbers).
#[test]
fn a_glm_install_works_and_runs() {
    let work = temp_dir();
    let snap = work.path().join("glm");
    write_glm(&snap);
    let out = work.path().join("glm.gturbo");
    install("glm4_moe", &snap, &out, &["--quant", "bf16"]);
    let o = gturbo_args(&["verify-install", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let (doc, footer) = run_json(&out, &["--prompt-ids", "1,2", "--max-tokens", "4"]);
    assert_eq!(doc["runner"], "glm4_moe", "{footer}");
    assert_eq!(doc["tokens"].as_array().unwrap().len(), 4, "{footer}");
}

/// gpt-oss's MXFP4 experts (once refused as not installed yet) are planned from the
/// headers as MXFP4 expert pools at the default profile (tests/it/mxfp4.rs checks the
/// bytes).
#[test]
fn an_mxfp4_source_plans_its_experts_as_mxfp4_pools() {
    let snap = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gptoss_mxfp4_toy");
    let (report, plan) = dry(&snap, "gpt_oss", "int4", &[]);
    let t = planned(&plan);
    assert_eq!(
        t["model.layers.0.mlp.experts.gate_up_proj_blocks"],
        ("U8".into(), "mxfp4_g32".into(), "experts_fused".into()),
        "{report}"
    );
    assert_eq!(
        t["model.layers.1.mlp.experts.down_proj_scales"],
        ("U8".into(), "mxfp4_g32".into(), "experts_fused".into())
    );
    assert_eq!(t["model.layers.0.self_attn.q_proj.weight"].1, "int4_g64");
    assert_eq!(t["model.layers.0.mlp.router.weight"].1, "int8_g64");
}

// ------------------------------------------------------------ compressed-tensors INT4

/// f32 of BF16 bits.
fn bf(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// f32 → BF16 bits, to nearest even (inputs here are finite).
fn to_bf(x: f32) -> u16 {
    let b = x.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// A BF16 matrix `[rows, cols]` as compressed-tensors `pack-quantized` stores it
/// (symmetric, group 32): I32 words (column `8k + i` of a row at bits `4i` of word
/// `k`, as `q + 8`), BF16 scales `amax / 7`.
fn to_pack_quantized(bytes: &[u8], cols: usize) -> (Vec<u8>, Vec<u8>) {
    let v: Vec<f32> = bytes
        .chunks_exact(2)
        .map(|c| bf(u16::from_le_bytes([c[0], c[1]])))
        .collect();
    let (mut words, mut scales) = (Vec::new(), Vec::new());
    for row in v.chunks_exact(cols) {
        let mut codes = Vec::new();
        for g in row.chunks_exact(32) {
            let amax = g.iter().fold(0f32, |m, x| m.max(x.abs()));
            let s = to_bf(if amax == 0.0 { 1.0 } else { amax / 7.0 });
            scales.extend(s.to_le_bytes());
            codes.extend(
                g.iter()
                    .map(|x| ((x / bf(s)).round().clamp(-8.0, 7.0) as i32 + 8) as u32),
            );
        }
        for w in codes.chunks_exact(8) {
            let word = w
                .iter()
                .enumerate()
                .fold(0u32, |a, (i, q)| a | (q << (4 * i)));
            words.extend(word.to_le_bytes());
        }
    }
    (words, scales)
}

/// A tiny Qwen3-MoE whose routed experts are compressed-tensors INT4 (as
/// Kimi-K2-Thinking ships them; each scale in the other shard from its words) installs
/// at the default profile with the packed words unchanged, the scales unchanged and
/// the biases `−8 × scale` (MLX-LM's `deepseek_v3.py` `sanitize`), verifies and runs;
/// `--quant bf16` installs `bf16_round(scale × (q − 8))`, `--quant int8` runs, and
/// `--requantize` is refused.
#[test]
fn a_compressed_tensors_int4_source_installs_losslessly_as_mlx_affine_4bit_g32() {
    use gturbo_testkit::replica::{Qwen3MoeSpec, write_qwen3_moe};
    let work = temp_dir();
    let base = work.path().join("bf16");
    write_qwen3_moe(&base, &Qwen3MoeSpec::tiny()).unwrap();
    let src = crate::mlx_source::source_tensors(&base);
    let mut shards: [Vec<StTensor>; 2] = Default::default();
    let mut converted = Vec::new();
    for (i, (name, (dtype, shape, bytes))) in src.iter().enumerate() {
        let Some(path) = name
            .strip_suffix(".weight")
            .filter(|p| p.contains(".mlp.experts."))
        else {
            let d: &'static str = if dtype == "F32" { "F32" } else { "BF16" };
            shards[i % 2].push((name.clone(), d, shape.clone(), bytes.clone()));
            continue;
        };
        let (rows, cols) = (shape[0], shape[1] as usize);
        let (words, scales) = to_pack_quantized(bytes, cols);
        let shape_bytes = [rows as i32, cols as i32]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        shards[0].push((
            format!("{path}.weight_packed"),
            "I32",
            vec![rows, cols as u64 / 8],
            words.clone(),
        ));
        shards[1].push((
            format!("{path}.weight_scale"),
            "BF16",
            vec![rows, cols as u64 / 32],
            scales.clone(),
        ));
        shards[1].push((format!("{path}.weight_shape"), "I32", vec![2], shape_bytes));
        converted.push((words, scales));
    }
    assert_eq!(converted.len(), 2 * 8 * 3);
    let snap = work.path().join("ct");
    std::fs::create_dir_all(&snap).unwrap();
    let mut weight_map = serde_json::Map::new();
    for (k, tensors) in shards.iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", k + 1);
        let mut head = serde_json::Map::new();
        let mut data: Vec<u8> = Vec::new();
        for (name, dtype, shape, bytes) in tensors {
            head.insert(
                name.clone(),
                json!({"dtype": dtype, "shape": shape,
                       "data_offsets": [data.len(), data.len() + bytes.len()]}),
            );
            data.extend(bytes);
            weight_map.insert(name.clone(), json!(file));
        }
        let mut h = serde_json::to_vec(&Value::Object(head)).unwrap();
        while !h.len().is_multiple_of(8) {
            h.push(b' ');
        }
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend(h);
        out.extend(data);
        std::fs::write(snap.join(&file), out).unwrap();
    }
    std::fs::write(
        snap.join("model.safetensors.index.json"),
        json!({"metadata": {}, "weight_map": weight_map}).to_string(),
    )
    .unwrap();
    for e in std::fs::read_dir(&base).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        if !name.ends_with(".safetensors") && !name.ends_with(".index.json") {
            std::fs::copy(&p, snap.join(&name)).unwrap();
        }
    }
    let mut config: Value =
        serde_json::from_slice(&std::fs::read(snap.join("config.json")).unwrap()).unwrap();
    config["quantization_config"] = json!({"quant_method": "compressed-tensors",
        "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null,
            "weights": {"num_bits": 4, "group_size": 32, "symmetric": true, "type": "int",
                        "strategy": "group", "dynamic": false, "observer": "minmax"}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"]});
    std::fs::write(snap.join("config.json"), config.to_string()).unwrap();

    let out = work.path().join("ct.gturbo");
    install("qwen3_moe", &snap, &out, &[]);
    let mut files = Vec::new();
    let mut stack = vec![out.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.to_string_lossy().contains("experts") {
                files.push(std::fs::read(&p).unwrap());
            }
        }
    }
    let holds = |needle: &[u8]| {
        files
            .iter()
            .any(|f| f.windows(needle.len()).any(|w| w == needle))
    };
    for (words, scales) in &converted {
        let biases: Vec<u8> = scales
            .chunks_exact(2)
            .flat_map(|c| to_bf(-8.0 * bf(u16::from_le_bytes([c[0], c[1]]))).to_le_bytes())
            .collect();
        assert!(holds(words), "packed words installed unchanged");
        assert!(holds(scales), "scales installed unchanged");
        assert!(holds(&biases), "biases are -8 x scale");
    }
    let m: Value =
        serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    let pools = m["expert_pools"].as_array().unwrap();
    assert!(
        pools.iter().all(|p| p.to_string().contains("int4_g32")),
        "{pools:?}"
    );
    let o = gturbo_args(&["verify-install", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let (doc, _) = run_json(&out, &["--prompt-ids", "1,2,3", "--max-tokens", "4"]);
    assert!(
        doc["tokens"].as_array().is_some_and(|t| !t.is_empty()),
        "{doc}"
    );
    // --quant bf16 dequantizes: `bf16_round(scale × (q − 8))`, element for element
    // (each expert part's rows lie contiguous in its pool file).
    let bf16 = work.path().join("bf16.gturbo");
    install("qwen3_moe", &snap, &bf16, &["--quant", "bf16"]);
    let mut files = Vec::new();
    let mut stack = vec![bf16.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.to_string_lossy().contains("experts") {
                files.push(std::fs::read(&p).unwrap());
            }
        }
    }
    for (words, scales) in &converted {
        // Elements: two per packed byte (byte `i / 2`'s low half for even `i`, as
        // nibble `i % 8` of word `i / 8`), 32 per scale, rows back to back.
        let n = words.len() * 2;
        assert_eq!(n, scales.len() / 2 * 32);
        let rule: Vec<u8> = (0..n)
            .flat_map(|i| {
                let q = (words[i / 2] >> (4 * (i % 2))) & 0xf;
                let g = i / 32;
                let s = bf(u16::from_le_bytes([scales[2 * g], scales[2 * g + 1]]));
                to_bf(s * (q as f32 - 8.0)).to_le_bytes()
            })
            .collect();
        assert!(
            files
                .iter()
                .any(|f| f.windows(rule.len()).any(|w| w == &rule[..])),
            "installed BF16 is bf16_round(scale x (q - 8))"
        );
    }
    let o = gturbo_args(&["verify-install", bf16.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    // Other profiles quantize what it dequantizes to; --requantize says nothing here.
    let int8 = work.path().join("int8.gturbo");
    install("qwen3_moe", &snap, &int8, &["--quant", "int8"]);
    let (doc, _) = run_json(&int8, &["--prompt-ids", "1,2,3", "--max-tokens", "4"]);
    assert!(
        doc["tokens"].as_array().is_some_and(|t| !t.is_empty()),
        "{doc}"
    );
    let o = try_install(
        "qwen3_moe",
        &snap,
        &work.path().join("b"),
        &["--dry-run", "--quant", "int8", "--requantize"],
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains(
            "config.json: field `quantization_config.quant_method`: --requantize: the source \
             is compressed-tensors INT4"
        ),
        "{}",
        text(&o)
    );
}

/// No cap on the expert count (Kimi's newest checkpoints have 896; llama.cpp capped at
/// 512): a Qwen3-MoE with 896 routed experts installs one pool of 896 blobs per layer,
/// verifies, and runs with every expert reachable by the router.
#[test]
fn a_checkpoint_with_896_experts_installs_verifies_and_runs() {
    use gturbo_testkit::replica::{Qwen3MoeSpec, write_qwen3_moe};
    let tmp = temp_dir();
    let snap = tmp.path().join("snap");
    let spec = Qwen3MoeSpec {
        num_experts: 896,
        num_experts_per_tok: 12,
        ..Qwen3MoeSpec::tiny()
    };
    write_qwen3_moe(&snap, &spec).unwrap();
    let out = tmp.path().join("e896.gturbo");
    install("qwen3_moe", &snap, &out, &["--quant", "bf16"]);
    let m: Value =
        serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    for p in m["expert_pools"].as_array().unwrap() {
        assert_eq!(p["experts"], 896, "{p}");
    }
    assert_eq!(m["arch"]["axes"]["num_experts"], 896);
    let o = gturbo_args(&["verify-install", out.to_str().unwrap()]);
    assert!(o.status.success(), "verify-install: {}", text(&o));
    let (doc, _) = run_json(&out, &["--prompt-ids", "1,2,3,4", "--max-tokens", "4"]);
    assert_eq!(doc["tokens"].as_array().unwrap().len(), 4, "{doc}");
}
