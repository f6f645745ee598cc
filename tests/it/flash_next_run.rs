//! `gturbo run` and `gturbo eval` on Flash-Next installs, end to end through the CLI:
//! the scaled replica at INT4 (expert slots, row cache, a prompt past the indexer
//! budget, the footer's figures, bad input), the quality rule (refused without a
//! recorded result, accepted with one `eval --record` wrote, a tampered one caught by
//! `verify-install` and `run`), and the toy's INT4 quality.

use std::path::{Path, PathBuf};
use std::process::Command;

use gturbo_testkit::replica::{self, FlashNextSpec};
use serde_json::Value;

use crate::support::cli::{self, gturbo_args, text};
use crate::support::temp_dir;

const TOY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/flashnext_toy");

/// Install the snapshot `from` as family qwen38flashnext into `out`.
fn install(from: &Path, out: &Path, extra: &[&str]) {
    cli::install("qwen38flashnext", from, out, extra);
}

fn manifest(dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap()
}

fn run_json(dir: &Path, ids: &str, extra: &[&str]) -> (Value, String) {
    let mut args = vec!["--prompt-ids", ids];
    args.extend_from_slice(extra);
    cli::run_json(dir, &args)
}

fn ids(n: usize, vocab: usize) -> String {
    (0..n)
        .map(|i| ((i * 37) % (vocab - 24) + 3).to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[test]
fn the_scaled_replica_at_int4_generates_the_same_tokens_at_2_16_slots_and_resident() {
    let tmp = temp_dir();
    let snap = tmp.path().join("snap");
    let spec = FlashNextSpec::scaled();
    replica::write_flash_next(&snap, &spec).unwrap();
    let out = tmp.path().join("flash.gturbo");
    install(&snap, &out, &[]);
    let m = manifest(&out);
    assert_eq!(m["quantized_at_install"]["scheme"], "int4_g64");
    // The real row width: 160 elements, not a multiple of the group, stays BF16.
    assert_eq!(m["row_pools"][0]["width"], 160);
    assert_eq!(m["row_pools"][0]["scheme"], "passthrough");
    assert_eq!(
        m["quantized_at_install"]["quality_gate"]["required_for_run"],
        true
    );

    // The quality rule, refusing side: a quantized install of the family, no record.
    let o = gturbo_args(&["run", out.to_str().unwrap(), "--prompt-ids", "1,2,3"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("family qwen38flashnext requires a recorded quality result before a quantized install runs")
            && err.contains("none is recorded")
            && err.contains("--allow-unmeasured"),
        "{err}"
    );

    // 100 prompt tokens: past the indexer's dense range (budget 64 + 3), so the
    // attention layer selects blocks.
    let prompt = ids(100, spec.vocab_size as usize);
    let mut tokens: Vec<Value> = Vec::new();
    let mut misses = Vec::new();
    for mode in [
        &["--expert-cache-slots", "2"][..],
        &["--expert-cache-slots", "16"],
        &["--resident-experts"],
    ] {
        let mut extra = vec!["--max-tokens", "6", "--allow-unmeasured"];
        extra.extend_from_slice(mode);
        let (doc, footer) = run_json(&out, &prompt, &extra);
        eprintln!("{mode:?}: {}", footer.trim());
        tokens.push(doc["tokens"].clone());
        misses.push(doc["expert_cache"]["misses"].as_u64().unwrap());
        assert_eq!(doc["runner"], "flash-next");
        assert_eq!(doc["prompt_tokens"], 100);
        assert!(doc["row_cache"]["misses"].as_u64().unwrap() > 0, "{doc}");
        assert!(doc["row_cache"]["hits"].as_u64().is_some(), "{doc}");
        assert!(doc["peak_rss_bytes"].as_u64().unwrap() > 0);
        assert!(doc["decode_tok_s"].as_f64().unwrap() > 0.0);
        assert_eq!(doc["quality"], Value::Null);
        // KV cache + indexer keys of the one attention layer at 105 positions, plus
        // three GDN states and one PLE state (f32, fixed size).
        let attn = 105 * (2 * 2 * 64 + 64) + 105 / 4 * 64;
        let gdn = 3 * (2 * 64 + 2 * 64 + 4 * 64) + 4 * 64 * 64;
        let ple = 2 * 8 + 9 * 4 * 256 * 4;
        assert_eq!(
            doc["state_bytes"].as_u64().unwrap(),
            (attn * 4 + 3 * gdn * 4 + ple) as u64,
            "{doc}"
        );
        for part in [
            "via flash-next",
            "peak RSS",
            "prefill",
            "decode",
            "expert cache",
            "row cache",
            "KV cache + GDN/PLE state",
            "quality: not measured",
        ] {
            assert!(footer.contains(part), "{part}: {footer}");
        }
    }
    assert_eq!(tokens[0], tokens[1], "2 vs 16 slots");
    assert_eq!(tokens[0], tokens[2], "2 slots vs resident");
    assert_eq!(tokens[0].as_array().unwrap().len(), 6);
    assert!(
        misses[0] > misses[1],
        "2 slots read more blobs than 16: {misses:?}"
    );
    assert_eq!(misses[2], 0, "resident experts are mapped");

    // Bad input through the CLI: a token id outside the vocabulary, a prompt longer
    // than max_position_embeddings; refused with a message, exit 2.
    let o = gturbo_args(&[
        "run",
        out.to_str().unwrap(),
        "--prompt-ids",
        "5,1024,7",
        "--allow-unmeasured",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr)
            .contains("input: token id 1024 is outside the vocabulary (1024)"),
        "{}",
        text(&o)
    );
    let long = ids(4097, spec.vocab_size as usize);
    let o = gturbo_args(&[
        "run",
        out.to_str().unwrap(),
        "--prompt-ids",
        &long,
        "--allow-unmeasured",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains(
            "input: a sequence of 4097 tokens (prompt and generated) exceeds the model's \
             max_position_embeddings 4096"
        ),
        "{}",
        text(&o)
    );
}

#[test]
fn the_int4_rows_variant_reads_quantized_rows_through_the_row_cache() {
    let tmp = temp_dir();
    let snap = tmp.path().join("snap");
    replica::write_flash_next(&snap, &FlashNextSpec::scaled_int4_rows()).unwrap();
    let out = tmp.path().join("flash.gturbo");
    install(&snap, &out, &[]);
    let m = manifest(&out);
    assert_eq!(m["row_pools"][0]["width"], 64);
    assert_eq!(m["row_pools"][0]["scheme"], "int4_g64");
    let (doc, _) = run_json(
        &out,
        &ids(20, 1024),
        &[
            "--max-tokens",
            "3",
            "--allow-unmeasured",
            "--row-cache-rows",
            "8",
        ],
    );
    // 16 heads × 20 tokens of row ids through an 8-row cache.
    let rc = &doc["row_cache"];
    assert!(rc["misses"].as_u64().unwrap() > 8, "{doc}");
    assert_eq!(rc["capacity_bytes"], 8 * (32 + 2 + 2));
    assert_eq!(doc["tokens"].as_array().unwrap().len(), 3);
}

fn copy_dir(src: &Path, dst: &Path) {
    let o = Command::new("cp")
        .arg("-r")
        .arg(src)
        .arg(dst)
        .output()
        .unwrap();
    assert!(o.status.success());
}

fn receipt(dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(dir.join("verified-install.json")).unwrap()).unwrap()
}

/// The toy at INT4 and at BF16 (passthrough), installed once for this test.
fn toy_pair(tmp: &Path) -> (PathBuf, PathBuf) {
    let (q, b) = (tmp.join("toy-int4.gturbo"), tmp.join("toy-bf16.gturbo"));
    install(Path::new(TOY), &q, &[]);
    install(Path::new(TOY), &b, &["--quant", "bf16"]);
    (q, b)
}

#[test]
fn eval_record_signs_a_quality_result_that_run_accepts_and_verify_install_checks() {
    let tmp = temp_dir();
    let (q, b) = toy_pair(tmp.path());
    assert_eq!(
        manifest(&b)["quantized_at_install"]["quality_gate"],
        Value::Null
    );
    // The long golden prompt's text is not needed: any text the toy tokenizer encodes.
    let txt = tmp.path().join("text.txt");
    std::fs::write(
        &txt,
        "the quick brown fox jumps over the lazy dog while the cat sleeps in the sun and \
         the birds sing of rain, of wind and of the long road home",
    )
    .unwrap();
    let o = gturbo_args(&[
        "eval",
        q.to_str().unwrap(),
        b.to_str().unwrap(),
        "--text",
        txt.to_str().unwrap(),
        "--record",
        "--json",
    ]);
    assert!(o.status.success(), "eval: {}", text(&o));
    let ev: Value = serde_json::from_slice(&o.stdout).unwrap();
    eprintln!("toy INT4 vs BF16: {ev}");
    let kl = ev["mean_kl_nats"].as_f64().unwrap();
    assert!(kl.is_finite() && kl > 0.0, "{ev}");
    // The file, and the receipt's signature over it.
    let qbytes = std::fs::read(q.join("quality.json")).unwrap();
    let qv: Value = serde_json::from_slice(&qbytes).unwrap();
    assert_eq!(qv["format"], "gturbo-quality");
    assert_eq!(qv["mean_kl_nats"].as_f64(), Some(kl));
    assert_eq!(qv["reference"]["scheme"], "passthrough");
    let r = receipt(&q);
    assert_eq!(r["quality"]["path"], "quality.json");
    assert_eq!(r["quality"]["bytes"], qbytes.len());
    assert_eq!(
        r["quality"]["sha256"],
        gturbo::format::digest::sha256_hex(&qbytes)
    );

    // The accepting side of the rule: run now runs, and the footer gives the figures.
    let o = gturbo_args(&[
        "run",
        q.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3",
        "--max-tokens",
        "2",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let footer = String::from_utf8_lossy(&o.stderr);
    assert!(
        footer.contains(&format!("quality: mean KL {kl:.4} nats"))
            && footer.contains(&format!(
                "vs {} (passthrough)",
                manifest(&b)["model_id"].as_str().unwrap()
            )),
        "{footer}"
    );
    // verify-install accepts it and keeps it in the receipt it rewrites.
    let o = gturbo_args(&["verify-install", q.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(receipt(&q)["quality"], r["quality"]);

    // A tampered result: verify-install names it, run refuses (the family requires a
    // record, and this one is not the signed one).
    let t = tmp.path().join("tampered.gturbo");
    copy_dir(&q, &t);
    let edited = String::from_utf8(qbytes.clone()).unwrap().replace(
        &format!("\"mean_kl_nats\": {kl}"),
        "\"mean_kl_nats\": 0.001",
    );
    assert_ne!(edited.as_bytes(), &qbytes[..]);
    std::fs::write(t.join("quality.json"), edited).unwrap();
    let o = gturbo_args(&["verify-install", t.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("quality.json: sha256: ")
            || String::from_utf8_lossy(&o.stderr).contains("quality.json: sha256: "),
        "{}",
        text(&o)
    );
    let o = gturbo_args(&["run", t.to_str().unwrap(), "--prompt-ids", "1,2,3"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("the recorded one was not accepted"),
        "{}",
        text(&o)
    );

    // A quality file the receipt does not list (copied into another install).
    std::fs::write(b.join("quality.json"), &qbytes).unwrap();
    let o = gturbo_args(&["verify-install", b.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("quality.json: not covered by verified-install.json"),
        "{}",
        text(&o)
    );
}

/// The gate picks the Flash-Next model by family; a manifest whose `arch.model_type`
/// is not qwen4_exp is refused by the model itself, naming the field, on `run` (the
/// registry's path) as on the library's `install::open` + `FlashModel::new`.
#[test]
fn a_flash_next_install_of_another_model_type_is_refused_naming_the_field() {
    let tmp = temp_dir();
    let b = tmp.path().join("toy-bf16.gturbo");
    install(Path::new(TOY), &b, &["--quant", "bf16"]);
    let mut m = manifest(&b);
    m["arch"]["model_type"] = Value::from("qwen3_next");
    std::fs::write(
        b.join("manifest.json"),
        serde_json::to_vec_pretty(&m).unwrap(),
    )
    .unwrap();
    let o = gturbo_args(&[
        "run",
        b.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3",
        "--max-tokens",
        "1",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains(
            "arch.model_type is \"qwen3_next\"; the Flash-Next runner runs \"qwen4_exp\""
        ),
        "{}",
        text(&o)
    );
}
