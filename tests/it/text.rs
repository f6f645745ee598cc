//! The text side of the runtime (`gturbo::runtime::text`): tokenizer, chat template,
//! stop tokens and streaming decode, on the real SmolLM2 tokenizer (from
//! `scripts/fetch_smollm2.sh`) and on the tiny replica tokenizers.

use std::path::{Path, PathBuf};
use std::process::Command;

use gturbo::runtime::text::{TextCodec, TextError};
use gturbo_testkit::replica::{LlamaSpec, Qwen3Spec, write_llama, write_qwen3};
use gturbo_testkit::skip::require_or_skip;

use crate::support::{temp_dir, write_file};

/// The SmolLM2 snapshot written by `scripts/fetch_smollm2.sh` (GTURBO_SMOLLM2_SNAPSHOT
/// overrides the default `target/smollm2/snapshot`), or `None` after recording the skip.
fn smollm2_snapshot(test: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("GTURBO_SMOLLM2_SNAPSHOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target/smollm2/snapshot"));
    if dir.join(".complete").is_file() || dir.join("tokenizer.json").is_file() {
        return Some(dir);
    }
    let why = format!(
        "no SmolLM2 snapshot at {} (run scripts/fetch_smollm2.sh)",
        dir.display()
    );
    require_or_skip(test, Err(why))
}

/// An install-shaped folder (`tokenizer/` holding the snapshot's text files), as
/// `gturbo install` lays it out.
fn install_from_snapshot(snapshot: &Path, into: &Path) {
    let tok = into.join("tokenizer");
    std::fs::create_dir_all(&tok).unwrap();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "config.json",
        "special_tokens_map.json",
    ] {
        if snapshot.join(f).is_file() {
            std::fs::copy(snapshot.join(f), tok.join(f)).unwrap();
        }
    }
}

/// transformers' rendering of one-turn chat prompts (system `None` = no system
/// message), in one Python run; `None` when transformers is missing and not required.
fn hf_chat_prompts(snapshot: &Path, turns: &[(Option<&str>, &str)]) -> Option<Vec<String>> {
    let script = r#"
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
out = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in json.loads(sys.argv[2])]
sys.stdout.write(json.dumps(out))
"#;
    let all: Vec<Vec<serde_json::Value>> = turns
        .iter()
        .map(|(system, user)| {
            let mut msgs = Vec::new();
            if let Some(s) = system {
                msgs.push(serde_json::json!({"role": "system", "content": s}));
            }
            msgs.push(serde_json::json!({"role": "user", "content": user}));
            msgs
        })
        .collect();
    let out = Command::new("python3")
        .args(["-c", script])
        .arg(snapshot)
        .arg(serde_json::to_string(&all).unwrap())
        .output();
    let out = match out {
        Ok(o) if o.status.success() => Ok(o),
        Ok(o) => Err(format!(
            "transformers comparison: apply_chat_template failed: {}",
            String::from_utf8_lossy(&o.stderr)
        )),
        Err(e) => Err(format!("transformers comparison: cannot run python3: {e}")),
    };
    require_or_skip("transformers comparison", out)
        .map(|o| serde_json::from_slice(&o.stdout).unwrap())
}

#[test]
fn smollm2_encodes_the_reference_prompt_and_stops_at_im_end() {
    let Some(snap) = smollm2_snapshot("smollm2_encodes_the_reference_prompt") else {
        return;
    };
    let dir = temp_dir();
    install_from_snapshot(&snap, dir.path());
    let codec = TextCodec::load(dir.path()).unwrap();
    assert_eq!(
        codec.encode("The capital of France is").unwrap(),
        [504, 3575, 282, 4649, 314]
    );
    // No BOS: SmolLM2's tokenizer config says add_bos_token false.
    assert_eq!(codec.bos_id(), Some(1));
    // Digits split one per token (the `smollm` pre-tokenizer), special tokens as ids.
    let ids = codec.encode("<|im_start|>2024").unwrap();
    assert_eq!(ids.len(), 5, "{ids:?}");
    assert_eq!(ids[0], 1);
    assert_eq!(codec.stop_ids(), [2]);
    assert_eq!(
        codec.decode(&[504, 3575, 282, 4649, 314], false).unwrap(),
        "The capital of France is"
    );
}

#[test]
fn smollm2_chat_prompt_matches_transformers() {
    let Some(snap) = smollm2_snapshot("smollm2_chat_prompt_matches_transformers") else {
        return;
    };
    let dir = temp_dir();
    install_from_snapshot(&snap, dir.path());
    let codec = TextCodec::load(dir.path()).unwrap();
    let q = "What is the capital of France?";
    let empty = codec.chat_prompt(Some(""), q).unwrap();
    // The exact prompt the reference answers "The capital of France is Paris." to.
    assert_eq!(
        empty,
        "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    );
    let default = codec.chat_prompt(None, q).unwrap();
    assert!(
        default.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"),
        "{default:?}"
    );
    let custom = codec.chat_prompt(Some("Answer in one word."), q).unwrap();
    let systems = [Some(""), None, Some("Answer in one word.")];
    let turns: Vec<_> = systems.iter().map(|s| (*s, q)).collect();
    if let Some(hf) = hf_chat_prompts(&snap, &turns) {
        assert_eq!([empty.clone(), default, custom], hf.as_slice());
    }
    // The rendered prompt encodes with <|im_start|> as one token, nothing added.
    let ids = codec.encode_chat(&empty).unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 3);
}

#[test]
fn stream_decoder_holds_back_partial_characters() {
    let Some(snap) = smollm2_snapshot("stream_decoder_holds_back_partial_characters") else {
        return;
    };
    let dir = temp_dir();
    install_from_snapshot(&snap, dir.path());
    let codec = TextCodec::load(dir.path()).unwrap();
    // Rare characters split into byte tokens; the stream must still reassemble the text
    // exactly, and never print a replacement character in between.
    let text = "Ünïcödé 東京 𝄞 café — 42 ok";
    let ids = codec.encode(text).unwrap();
    let mut dec = codec.stream_decoder(false);
    let mut out = String::new();
    let mut held = 0;
    for &id in &ids {
        let piece = dec.push(id).unwrap();
        assert!(
            !piece.contains('\u{FFFD}'),
            "partial character printed: {piece:?}"
        );
        if piece.is_empty() {
            held += 1;
        }
        out.push_str(&piece);
    }
    out.push_str(&dec.finish().unwrap());
    assert_eq!(out, text);
    assert!(
        held > 0,
        "expected some byte tokens to be held back ({ids:?})"
    );
}

#[test]
fn replica_tokenizers_load_render_and_round_trip() {
    // qwen3 replica: ChatML, EOS <|im_end|>, no BOS.
    let q = temp_dir();
    write_qwen3(&q.path().join("tokenizer"), &Qwen3Spec::tiny()).unwrap();
    let codec = TextCodec::load(q.path()).unwrap();
    let prompt = codec.chat_prompt(None, "hi").unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = codec.encode_chat(&prompt).unwrap();
    let im_start = ids[0];
    assert_eq!(codec.decode(&ids, false).unwrap(), prompt);
    assert!(
        codec.stop_ids().contains(&(im_start + 1)),
        "{:?}",
        codec.stop_ids()
    );
    // Without merges every byte is its own token.
    assert_eq!(codec.encode("héllo").unwrap().len(), 6);

    // llama replica: BOS added by the tokenizer config, once.
    let l = temp_dir();
    write_llama(&l.path().join("tokenizer"), &LlamaSpec::tiny()).unwrap();
    let codec = TextCodec::load(l.path()).unwrap();
    let bos = codec.bos_id().expect("llama replica has a BOS");
    let ids = codec.encode("ab").unwrap();
    assert_eq!(ids, [bos, u32::from(b'a'), u32::from(b'b')]);
    let prompt = codec.chat_prompt(Some(""), "hi").unwrap();
    assert!(
        prompt.starts_with("<|begin_of_text|><|start_header_id|>system"),
        "{prompt:?}"
    );
    // The template writes BOS itself; encode_chat adds none, so there is exactly one.
    let ids = codec.encode_chat(&prompt).unwrap();
    assert_eq!(ids.iter().filter(|&&i| i == bos).count(), 1);
    assert_eq!(ids[0], bos);
}

#[test]
fn hostile_tokenizer_files_are_errors_naming_file_and_field() {
    let base = temp_dir();
    write_qwen3(&base.path().join("tokenizer"), &Qwen3Spec::tiny()).unwrap();
    let tok = base.path().join("tokenizer");
    let good_tokenizer = std::fs::read(tok.join("tokenizer.json")).unwrap();
    let good_config = std::fs::read_to_string(tok.join("tokenizer_config.json")).unwrap();

    let case = |tokenizer: &[u8], config: &str, want: &[&str]| {
        let d = temp_dir();
        write_file(d.path(), "tokenizer/tokenizer.json", tokenizer);
        write_file(
            d.path(),
            "tokenizer/tokenizer_config.json",
            config.as_bytes(),
        );
        let err = TextCodec::load(d.path()).unwrap_err();
        let msg = err.to_string();
        for w in want {
            assert!(msg.contains(w), "{msg:?} lacks {w:?}");
        }
        err
    };
    case(
        b"{\"model\": 5",
        &good_config,
        &["tokenizer.json", "not a valid tokenizer"],
    );
    case(b"\xff\xfe garbage", &good_config, &["tokenizer.json"]);
    let mut v: serde_json::Value = serde_json::from_slice(&good_tokenizer).unwrap();
    v["model"]["merges"] = serde_json::json!([["nope", "missing"]]);
    case(
        &serde_json::to_vec(&v).unwrap(),
        &good_config,
        &["tokenizer.json"],
    );

    let mut c: serde_json::Value = serde_json::from_str(&good_config).unwrap();
    c["add_bos_token"] = serde_json::json!("yes");
    let e = case(
        &good_tokenizer,
        &c.to_string(),
        &["tokenizer_config.json", "add_bos_token"],
    );
    assert!(matches!(e, TextError::Field { .. }));
    c["add_bos_token"] = serde_json::json!(false);
    c["eos_token"] = serde_json::json!("<|not-a-token|>");
    case(
        &good_tokenizer,
        &c.to_string(),
        &["tokenizer_config.json", "eos_token"],
    );
    c["eos_token"] = serde_json::json!({"content": 3});
    case(&good_tokenizer, &c.to_string(), &["eos_token.content"]);
    c["eos_token"] = serde_json::json!("<|im_end|>");
    c["chat_template"] = serde_json::json!(7);
    case(&good_tokenizer, &c.to_string(), &["chat_template"]);
    case(
        &good_tokenizer,
        "[1, 2]",
        &["tokenizer_config.json", "JSON object"],
    );

    // eos ids that are not ids.
    let d = temp_dir();
    write_file(d.path(), "tokenizer/tokenizer.json", &good_tokenizer);
    write_file(
        d.path(),
        "tokenizer/tokenizer_config.json",
        good_config.as_bytes(),
    );
    write_file(
        d.path(),
        "tokenizer/generation_config.json",
        br#"{"eos_token_id": [-1]}"#,
    );
    let msg = TextCodec::load(d.path()).unwrap_err().to_string();
    assert!(
        msg.contains("generation_config.json") && msg.contains("eos_token_id"),
        "{msg}"
    );

    // A missing tokenizer names the file; a template that fails names the template.
    let d = temp_dir();
    let msg = TextCodec::load(d.path()).unwrap_err().to_string();
    assert!(
        msg.contains("tokenizer.json") && msg.contains("missing"),
        "{msg}"
    );
    let d = temp_dir();
    write_file(d.path(), "tokenizer/tokenizer.json", &good_tokenizer);
    let mut c: serde_json::Value = serde_json::from_str(&good_config).unwrap();
    c["chat_template"] = serde_json::json!("{{ raise_exception('no system role') }}");
    write_file(
        d.path(),
        "tokenizer/tokenizer_config.json",
        c.to_string().as_bytes(),
    );
    let codec = TextCodec::load(d.path()).unwrap();
    let msg = codec.chat_prompt(None, "hi").unwrap_err().to_string();
    assert!(
        msg.contains("no system role") && msg.contains("tokenizer_config.json"),
        "{msg}"
    );
}

#[cfg(unix)]
#[test]
fn a_symlinked_tokenizer_file_is_refused() {
    let outside = temp_dir();
    write_qwen3(outside.path(), &Qwen3Spec::tiny()).unwrap();
    let d = temp_dir();
    std::fs::create_dir_all(d.path().join("tokenizer")).unwrap();
    std::os::unix::fs::symlink(
        outside.path().join("tokenizer.json"),
        d.path().join("tokenizer/tokenizer.json"),
    )
    .unwrap();
    let msg = TextCodec::load(d.path()).unwrap_err().to_string();
    assert!(
        msg.contains("tokenizer.json") && msg.contains("not a regular file"),
        "{msg}"
    );
}

/// The converted SmolLM2 snapshot is what the `llama` family expects: it installs at
/// INT4 g64 and as a BF16 passthrough, and the independent checker (numpy + MLX) agrees
/// with every byte of both installs, tokenizer files included.
#[test]
fn smollm2_snapshot_installs_with_the_llama_family_at_int4_and_bf16() {
    let Some(snap) = smollm2_snapshot("smollm2_snapshot_installs_with_the_llama_family") else {
        return;
    };
    let checker = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/peers/check_install.py");
    let probe = Command::new("python3")
        .args(["-c", "import numpy, mlx.core"])
        .status();
    let can_check = match probe {
        Ok(s) if s.success() => Ok(()),
        _ => {
            Err("check_install.py: numpy/mlx are missing for scripts/peers/check_install.py".into())
        }
    };
    let can_check = require_or_skip("check_install.py", can_check).is_some();
    let work = temp_dir();
    for quant in ["int4", "bf16"] {
        let out = work.path().join(format!("smollm2-{quant}.gturbo"));
        let o = crate::support::cli::gturbo()
            .args([
                "install",
                "HuggingFaceTB/SmolLM2-135M-Instruct",
                "--family",
                "llama",
            ])
            .arg("--from")
            .arg(&snap)
            .args(["--quant", quant, "--no-progress", "-q", "--out"])
            .arg(&out)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "install {quant}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let manifest: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
        assert_eq!(manifest["family"], "llama", "{quant}");
        // The runtime's text side loads what the install copied.
        let codec = TextCodec::load(&out).unwrap();
        assert_eq!(codec.stop_ids(), [2]);
        if !can_check {
            continue;
        }
        let c = Command::new("python3")
            .arg(&checker)
            .arg(&snap)
            .arg(&out)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&c.stdout);
        assert!(
            c.status.success() && stdout.contains(" 0 failed"),
            "check_install {quant}:\n{stdout}\n{}",
            String::from_utf8_lossy(&c.stderr)
        );
    }
}

/// Issue 13, item 6: a chat template's work and output are bounded. Three nested
/// `range(100000)` loops (10^15 steps) are refused within seconds, with an error that
/// names the template; so is an output of many megabytes.
#[test]
fn issue13_a_runaway_chat_template_is_refused_naming_it() {
    let base = temp_dir();
    write_qwen3(&base.path().join("tokenizer"), &Qwen3Spec::tiny()).unwrap();
    let tok = base.path().join("tokenizer");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(tok.join("tokenizer_config.json")).unwrap()).unwrap();
    let cases = [
        (
            "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}{% endfor %}{% endfor %}{% endfor %}",
            "refused: the template ran 10000000 steps without finishing",
        ),
        (
            "{% for a in range(100000) %}{{ 'x' * 50000000 }}{% endfor %}",
            "refused: the template's output passed 16777216 bytes",
        ),
    ];
    for (template, want) in cases {
        cfg["chat_template"] = serde_json::json!(template);
        write_file(
            base.path(),
            "tokenizer/tokenizer_config.json",
            cfg.to_string().as_bytes(),
        );
        let codec = TextCodec::load(base.path()).unwrap();
        let t = std::time::Instant::now();
        let err = codec.chat_prompt(None, "hi").unwrap_err();
        let took = t.elapsed();
        assert!(matches!(err, TextError::Template { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(
            msg.starts_with(&format!(
                "chat template ({}): {want}",
                tok.join("tokenizer_config.json").display()
            )),
            "{msg}"
        );
        assert!(took < std::time::Duration::from_secs(30), "{took:?}");
    }
    // A template file (`chat_template.jinja`) is named by its own path.
    cfg.as_object_mut().unwrap().remove("chat_template");
    write_file(
        base.path(),
        "tokenizer/tokenizer_config.json",
        cfg.to_string().as_bytes(),
    );
    write_file(
        base.path(),
        "tokenizer/chat_template.jinja",
        cases[0].0.as_bytes(),
    );
    let err = TextCodec::load(base.path())
        .unwrap()
        .chat_prompt(None, "hi")
        .unwrap_err();
    assert!(
        err.to_string().starts_with(&format!(
            "chat template ({}): refused",
            tok.join("chat_template.jinja").display()
        )),
        "{err}"
    );
}
