//! The bounds a `tokenizer.json` must keep to be installed or run: what loading it may
//! cost. The tokenizers crate compiles every `pattern` of the normalizer, the
//! pre-tokenizer and the decoder (`Split`, `Replace`, inside `Sequence`s at any depth)
//! into a regex, and the cost grows with the pattern: one 10 MB pattern took
//! `gturbo run` to 3.1 GiB of RSS and 16-21 s, a 20 MB one aborted on a failed
//! allocation. Real tokenizers have a few patterns of a few hundred bytes (Qwen's and
//! Llama's pre-tokenizer `Split` regexes are under 1 KiB), so the bounds below leave
//! two orders of magnitude of headroom and hold a hostile file to a load of a few
//! hundred milliseconds.
//!
//! [`check_bounds`] is the one check: the install runs it on the bytes it copies, and
//! `gturbo run` (and `gturbo doctor`) on the installed file before the tokenizers crate
//! sees it.

use serde::Deserialize;
use serde_json::Value;

use super::LayoutError;

/// The file's name, in a repo and under an install's `tokenizer/` folder.
pub const FILE_NAME: &str = "tokenizer.json";

/// Largest `tokenizer.json` accepted: the largest real ones are tens of MB (Gemma 3's is
/// 33 MB), and its vocabulary and merges are what the tokenizers crate holds in memory.
pub const MAX_BYTES: u64 = 64 << 20;

/// Largest regex (or literal) `pattern`, in bytes.
pub const MAX_PATTERN_BYTES: usize = 64 << 10;

/// Largest sum of every pattern's bytes.
pub const MAX_PATTERN_TOTAL_BYTES: usize = 256 << 10;

/// Most patterns in one file (each is one compiled regex).
pub const MAX_PATTERNS: usize = 64;

/// The parts of a `tokenizer.json` that hold patterns; the rest (the vocabulary, the
/// merges, the added tokens) is skipped without being kept.
#[derive(Deserialize)]
struct Parts {
    #[serde(default)]
    normalizer: Option<Value>,
    #[serde(default)]
    pre_tokenizer: Option<Value>,
    #[serde(default)]
    post_processor: Option<Value>,
    #[serde(default)]
    decoder: Option<Value>,
}

/// Check `bytes`, a `tokenizer.json`, against the bounds above. The error names the
/// field as a JSON path (`pre_tokenizer.pretokenizers[1].pattern.Regex`), or `(file)`
/// for the file's size and `(document)` for JSON that does not parse.
pub fn check_bounds(bytes: &[u8]) -> Result<(), LayoutError> {
    if bytes.len() as u64 > MAX_BYTES {
        return Err(LayoutError::new("(file)", too_large(bytes.len() as u64)));
    }
    let parts: Parts = serde_json::from_slice(bytes)
        .map_err(|e| LayoutError::new("(document)", format!("not a valid tokenizer: {e}")))?;
    let mut seen = Seen::default();
    for (name, part) in [
        ("normalizer", &parts.normalizer),
        ("pre_tokenizer", &parts.pre_tokenizer),
        ("post_processor", &parts.post_processor),
        ("decoder", &parts.decoder),
    ] {
        if let Some(v) = part {
            walk(v, name, false, &mut seen)?;
        }
    }
    Ok(())
}

/// The refusal of a file of `len` bytes.
pub fn too_large(len: u64) -> String {
    format!(
        "{len} bytes, more than the {MAX_BYTES} a {FILE_NAME} may have (loading it would cost memory in proportion)"
    )
}

#[derive(Default)]
struct Seen {
    patterns: usize,
    bytes: usize,
}

/// Every string under a `pattern` key is a pattern; the walk is as deep as the JSON
/// (serde_json's recursion limit bounds it).
fn walk(v: &Value, path: &str, in_pattern: bool, seen: &mut Seen) -> Result<(), LayoutError> {
    match v {
        Value::String(s) if in_pattern => {
            seen.patterns += 1;
            seen.bytes += s.len();
            if s.len() > MAX_PATTERN_BYTES {
                return Err(LayoutError::new(
                    path,
                    format!(
                        "a pattern of {} bytes, more than the {MAX_PATTERN_BYTES} accepted (compiling it would take memory and time in proportion)",
                        s.len()
                    ),
                ));
            }
            if seen.patterns > MAX_PATTERNS {
                return Err(LayoutError::new(
                    path,
                    format!(
                        "pattern number {}, more than the {MAX_PATTERNS} accepted",
                        seen.patterns
                    ),
                ));
            }
            if seen.bytes > MAX_PATTERN_TOTAL_BYTES {
                return Err(LayoutError::new(
                    path,
                    format!(
                        "the patterns up to this one hold {} bytes, more than the {MAX_PATTERN_TOTAL_BYTES} accepted in all",
                        seen.bytes
                    ),
                ));
            }
            Ok(())
        }
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                walk(item, &format!("{path}[{i}]"), in_pattern, seen)?;
            }
            Ok(())
        }
        Value::Object(map) => {
            for (k, item) in map {
                walk(
                    item,
                    &format!("{path}.{k}"),
                    in_pattern || k == "pattern",
                    seen,
                )?;
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(pattern: &str) -> Value {
        serde_json::json!({
            "type": "Split",
            "pattern": { "Regex": pattern },
            "behavior": "Isolated",
            "invert": false
        })
    }

    fn tokenizer(pre: Value) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "version": "1.0",
            "normalizer": null,
            "pre_tokenizer": pre,
            "model": { "type": "BPE", "vocab": { "a": 0 }, "merges": [] }
        }))
        .unwrap()
    }

    #[test]
    fn a_real_shaped_tokenizer_passes() {
        let qwen = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
        let pre = serde_json::json!({
            "type": "Sequence",
            "pretokenizers": [split(qwen), { "type": "ByteLevel", "add_prefix_space": false }]
        });
        check_bounds(&tokenizer(pre)).unwrap();
    }

    #[test]
    fn a_long_pattern_is_refused_naming_its_json_path() {
        let long = "a".repeat(MAX_PATTERN_BYTES + 1);
        let pre = serde_json::json!({
            "type": "Sequence",
            "pretokenizers": [{ "type": "ByteLevel" }, split(&long)]
        });
        let e = check_bounds(&tokenizer(pre)).unwrap_err();
        assert_eq!(e.field, "pre_tokenizer.pretokenizers[1].pattern.Regex");
        assert!(
            e.detail
                .starts_with("a pattern of 65537 bytes, more than the 65536"),
            "{e}"
        );
        // At the bound it passes.
        let at = "a".repeat(MAX_PATTERN_BYTES);
        check_bounds(&tokenizer(split(&at))).unwrap();
        // A literal pattern in a decoder counts as well.
        let doc = serde_json::json!({
            "decoder": { "type": "Replace", "pattern": { "String": long }, "content": " " }
        });
        let e = check_bounds(&serde_json::to_vec(&doc).unwrap()).unwrap_err();
        assert_eq!(e.field, "decoder.pattern.String");
    }

    #[test]
    fn many_patterns_or_many_bytes_of_them_are_refused() {
        let many: Vec<Value> = (0..=MAX_PATTERNS).map(|_| split("x")).collect();
        let pre = serde_json::json!({ "type": "Sequence", "pretokenizers": many });
        let e = check_bounds(&tokenizer(pre)).unwrap_err();
        assert_eq!(
            e.field,
            format!("pre_tokenizer.pretokenizers[{MAX_PATTERNS}].pattern.Regex")
        );
        let big = "b".repeat(MAX_PATTERN_BYTES);
        let five: Vec<Value> = (0..5).map(|_| split(&big)).collect();
        let norm = serde_json::json!({ "type": "Sequence", "normalizers": five });
        let doc = serde_json::json!({ "normalizer": norm });
        let e = check_bounds(&serde_json::to_vec(&doc).unwrap()).unwrap_err();
        assert_eq!(e.field, "normalizer.normalizers[4].pattern.Regex");
        assert!(e.detail.contains("in all"), "{e}");
    }

    #[test]
    fn size_and_syntax_are_named() {
        let e = check_bounds(&vec![b' '; MAX_BYTES as usize + 1]).unwrap_err();
        assert_eq!(e.field, "(file)");
        for bad in [&b"{\"normalizer\": "[..], b"7"] {
            let e = check_bounds(bad).unwrap_err();
            assert_eq!(e.field, "(document)");
        }
    }
}
