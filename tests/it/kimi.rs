//! Kimi-K2: its tokenizer ships as a tiktoken BPE file (`tiktoken.model`) with the split
//! pattern and special tokens of its `tokenization_kimi.py`; the install converts it into
//! a `tokenizer.json` the runtime loads. The golden is tiktoken's own `Encoding` with
//! Kimi's pattern and special tokens on 3,000 lines of mixed text
//! (scripts/golden/gen_kimi_tokenizer_golden.py, tests/data/kimi_tiktoken).

use std::path::{Path, PathBuf};

use gturbo::runtime::text::TextCodec;
use serde_json::Value;

use crate::support::cli::{gturbo_args, install, text};
use crate::support::temp_dir;

const TIKTOKEN_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/kimi_tiktoken");
const TOY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/deepseek_toy");

fn golden() -> Value {
    serde_json::from_slice(&std::fs::read(Path::new(TIKTOKEN_DIR).join("golden.json")).unwrap())
        .unwrap()
}

/// The DeepSeek toy's weights with Kimi's tokenizer files instead of its tokenizer.json.
fn kimi_snapshot(dir: &Path) -> PathBuf {
    let snap = dir.join("snap");
    std::fs::create_dir_all(&snap).unwrap();
    for e in std::fs::read_dir(TOY).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        if p.is_file() && !name.starts_with("tokenizer") {
            std::fs::copy(&p, snap.join(&name)).unwrap();
        }
    }
    for f in ["tiktoken.model", "tokenizer_config.json"] {
        std::fs::copy(Path::new(TIKTOKEN_DIR).join(f), snap.join(f)).unwrap();
    }
    snap
}

#[test]
fn kimi_tiktoken_is_converted_at_install_and_encodes_as_tiktoken() {
    let g = golden();
    // The family's pattern and reserved count are the ones the golden was made with.
    let family: Value =
        serde_json::from_str(include_str!("../../families/deepseek_v3.json")).unwrap();
    assert_eq!(family["tiktoken"]["pattern"], g["pat_str"]);
    assert_eq!(
        family["tiktoken"]["reserved_special_tokens"],
        g["num_reserved_special_tokens"]
    );

    let tmp = temp_dir();
    let snap = kimi_snapshot(tmp.path());
    let out = tmp.path().join("out");
    install("deepseek_v3", &snap, &out, &["--quant", "bf16"]);
    // The original stays beside the converted file, both in the manifest.
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    let listed: Vec<&str> = (manifest["files"].as_array().unwrap().iter())
        .map(|f| f["path"].as_str().unwrap())
        .collect();
    for f in ["tokenizer/tiktoken.model", "tokenizer/tokenizer.json"] {
        assert!(listed.contains(&f), "{f} not in {listed:?}");
    }
    assert_eq!(
        std::fs::read(out.join("tokenizer/tiktoken.model")).unwrap(),
        std::fs::read(Path::new(TIKTOKEN_DIR).join("tiktoken.model")).unwrap()
    );
    let o = gturbo_args(&["verify-install", out.to_str().unwrap()]);
    assert!(o.status.success(), "verify-install: {}", text(&o));

    let codec = TextCodec::load(&out).unwrap();
    let lines = g["lines"].as_array().unwrap();
    assert_eq!(lines.len(), 3000);
    let (mut specials, mut bad) = (0usize, Vec::new());
    let first_special = g["ranks"].as_u64().unwrap() as u32;
    for (i, l) in lines.iter().enumerate() {
        let text = l["text"].as_str().unwrap();
        let want: Vec<u32> = (l["ids"].as_array().unwrap().iter())
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let got = codec.encode(text).unwrap();
        specials += got.iter().filter(|&&id| id >= first_special).count();
        if got != want {
            bad.push(format!("line {i} {text:?}: {got:?} != {want:?}"));
        }
        // Ids decode back to the text, special tokens kept.
        assert_eq!(codec.decode(&got, false).unwrap(), text, "line {i}");
    }
    assert!(
        bad.is_empty(),
        "{} lines differ, first: {}",
        bad.len(),
        bad[0]
    );
    assert!(specials > 100, "{specials} special tokens in the text");
    // The named and the reserved special tokens have the ids of tokenizer_config.json.
    let enc = codec
        .encode("<|im_user|>hi<|im_end|>[EOS]<|reserved_token_49341|>")
        .unwrap();
    let n = first_special;
    assert_eq!(enc[0], n + 3);
    assert_eq!(&enc[enc.len() - 3..], &[n + 2, n + 1, n + 5]);
}

#[test]
fn a_broken_tiktoken_file_is_refused_naming_the_file_and_the_line() {
    let tmp = temp_dir();
    let snap = kimi_snapshot(tmp.path());
    let model = std::fs::read_to_string(snap.join("tiktoken.model")).unwrap();
    let mut lines: Vec<&str> = model.lines().collect();
    // Line 3 gives rank 0's token again.
    let dup = lines[0].split(' ').next().unwrap().to_string() + " 2";
    lines[2] = &dup;
    std::fs::write(snap.join("tiktoken.model"), lines.join("\n")).unwrap();
    let out = tmp.path().join("out");
    let o = crate::support::cli::try_install("deepseek_v3", &snap, &out, &["--quant", "bf16"]);
    assert!(!o.status.success());
    let e = crate::support::cli::error_line(&o);
    assert!(
        e.contains("tiktoken.model: field `line 3`: the token of rank 0 again"),
        "{e}"
    );
    assert!(!out.exists(), "nothing is published");
}
