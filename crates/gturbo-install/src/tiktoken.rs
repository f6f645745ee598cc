//! A tokenizer shipped as a tiktoken BPE file instead of a `tokenizer.json` (Kimi-K2:
//! `tiktoken.model` and the `TikTokenTokenizer` of its `tokenization_kimi.py`), converted
//! at install into a `tokenizer.json` the runtime loads with the tokenizers crate. The
//! original file stays beside it.
//!
//! The mapping is the one transformers' `TikTokenConverter` makes
//! (`convert_slow_tokenizer.py`): a byte-level BPE whose vocabulary is every rank's bytes
//! in GPT-2's byte-to-character alphabet, whose merges are every split of a token into
//! two tokens (ordered by the merged token's rank, then the halves' ranks), with
//! `ignore_merges` (a piece that is a token whole is that token, as tiktoken does), a
//! `Split` of the family's pattern (`pat_str`) before a byte-level step without its own
//! regex. The special tokens follow `TikTokenTokenizer.__init__`: the
//! `reserved_special_tokens` ids right after the ranks, each named by the repo's
//! `tokenizer_config.json` `added_tokens_decoder` or else `<|reserved_token_{id}|>`;
//! tiktoken encodes them in text (`allowed_special="all"`), so every one is an added
//! token matched in the text.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use base64::Engine;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::format::LayoutError;
use crate::format::tokenizer;

/// How a family's tiktoken tokenizer is read (family data: the constants of the Python
/// class that wraps the file).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TiktokenSpec {
    /// The BPE file in the repo (`tiktoken.model`).
    pub file: String,
    /// The split pattern (`pat_str`).
    pub pattern: String,
    /// Special-token ids after the ranks (`num_reserved_special_tokens`).
    pub reserved_special_tokens: u32,
    /// Where the facts come from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
}

/// The repo file that names the special tokens (`added_tokens_decoder`).
pub const CONFIG_FILE: &str = "tokenizer_config.json";

/// Largest rank count accepted: the real Kimi file has 163,584; the bound keeps a
/// hostile file's vocabulary within what a `tokenizer.json` may hold.
pub const MAX_RANKS: usize = 1 << 20;

/// Whether an install whose copied files are `copied` converts a tokenizer: the family
/// has a tiktoken spec, the repo ships its file and no `tokenizer.json`.
pub fn applies<'a>(spec: Option<&'a TiktokenSpec>, copied: &[&str]) -> Option<&'a TiktokenSpec> {
    spec.filter(|s| copied.contains(&s.file.as_str()) && !copied.contains(&tokenizer::FILE_NAME))
}

/// Convert the staged `tokenizer/<spec.file>` (and `tokenizer/tokenizer_config.json`
/// when present) into `tokenizer/tokenizer.json` under `staging`. Errors name the file
/// and the field (`line N`, `added_tokens_decoder.ID`).
pub fn convert_staged(staging: &Path, spec: &TiktokenSpec) -> Result<(), (String, LayoutError)> {
    let dir = staging.join("tokenizer");
    let read = |name: &str| {
        std::fs::read(dir.join(name))
            .map_err(|e| (name.to_string(), LayoutError::new("(file)", e.to_string())))
    };
    let model = read(&spec.file)?;
    let config = match dir.join(CONFIG_FILE).exists() {
        true => Some(read(CONFIG_FILE)?),
        false => None,
    };
    let out = convert(&model, config.as_deref(), spec)?;
    let path = dir.join(tokenizer::FILE_NAME);
    std::fs::write(&path, out).map_err(|e| {
        let file = tokenizer::FILE_NAME.to_string();
        (file, LayoutError::new("(file)", e.to_string()))
    })
}

/// The `tokenizer.json` of a tiktoken BPE file `model` with the special-token names of
/// `config` (a `tokenizer_config.json`). The error is (file, field and detail).
pub fn convert(
    model: &[u8],
    config: Option<&[u8]>,
    spec: &TiktokenSpec,
) -> Result<Vec<u8>, (String, LayoutError)> {
    let ranks = parse_ranks(model).map_err(|e| (spec.file.clone(), e))?;
    let n = ranks.len() as u64;
    let names = match config {
        Some(c) => special_names(c, n, spec.reserved_special_tokens)
            .map_err(|e| (CONFIG_FILE.to_string(), e))?,
        None => BTreeMap::new(),
    };
    let alphabet = byte_alphabet();
    let text = |b: &[u8]| -> String { b.iter().map(|&x| alphabet[x as usize]).collect() };
    let vocab: serde_json::Map<String, Value> = (ranks.iter().enumerate())
        .map(|(r, t)| (text(t), json!(r)))
        .collect();
    let merges: Vec<Value> = merges(&ranks)
        .into_iter()
        .map(|(l, r)| json!([text(&ranks[l]), text(&ranks[r])]))
        .collect();
    let added: Vec<Value> = (n..n + u64::from(spec.reserved_special_tokens))
        .map(|id| {
            let content =
                (names.get(&id).cloned()).unwrap_or_else(|| format!("<|reserved_token_{id}|>"));
            json!({ "id": id, "content": content, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": true })
        })
        .collect();
    let doc = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": { "type": "Sequence", "pretokenizers": [
            { "type": "Split", "pattern": { "Regex": spec.pattern }, "behavior": "Isolated", "invert": false },
            { "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false }
        ]},
        "post_processor": { "type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true },
        "decoder": { "type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true },
        "model": { "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                   "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                   "ignore_merges": true, "vocab": vocab, "merges": merges }
    });
    let bytes = serde_json::to_vec(&doc).expect("a JSON value serializes");
    tokenizer::check_bounds(&bytes).map_err(|e| (tokenizer::FILE_NAME.to_string(), e))?;
    Ok(bytes)
}

/// The tokens of a tiktoken file by rank: one `BASE64 RANK` per line (tiktoken's
/// `load_tiktoken_bpe`), blank lines skipped. The ranks must be 0..n, each once, and
/// the tokens distinct: the special ids start at n (`len(mergeable_ranks)`).
fn parse_ranks(model: &[u8]) -> Result<Vec<Vec<u8>>, LayoutError> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut by_rank: Vec<Option<Vec<u8>>> = Vec::new();
    let mut seen: HashMap<Vec<u8>, usize> = HashMap::new();
    for (i, line) in model.split(|&b| b == b'\n').enumerate() {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let at = || format!("line {}", i + 1);
        let text =
            std::str::from_utf8(line).map_err(|_| LayoutError::new(at(), "not ASCII text"))?;
        let mut parts = text.split_ascii_whitespace();
        let (Some(token), Some(rank), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(LayoutError::new(at(), "not `BASE64 RANK`"));
        };
        let token = b64
            .decode(token)
            .map_err(|e| LayoutError::new(at(), format!("token: {e}")))?;
        let rank: usize = rank
            .parse()
            .ok()
            .filter(|&r| r < MAX_RANKS && !token.is_empty())
            .ok_or_else(|| {
                LayoutError::new(
                    at(),
                    format!("rank `{rank}`: not an integer below {MAX_RANKS}, or an empty token"),
                )
            })?;
        if by_rank.len() <= rank {
            by_rank.resize(rank + 1, None);
        }
        if by_rank[rank].is_some() {
            return Err(LayoutError::new(at(), format!("rank {rank} given twice")));
        }
        if let Some(prev) = seen.insert(token.clone(), rank) {
            return Err(LayoutError::new(
                at(),
                format!("the token of rank {prev} again"),
            ));
        }
        by_rank[rank] = Some(token);
    }
    let missing = by_rank.iter().position(Option::is_none);
    if let Some(r) = missing {
        return Err(LayoutError::new(
            "(ranks)",
            format!(
                "rank {r} is missing: the ranks must be 0..{}",
                by_rank.len()
            ),
        ));
    }
    Ok(by_rank.into_iter().flatten().collect())
}

/// Every split of every token into two tokens, as (left rank, right rank), ordered by
/// the merged token's rank, then the left's, then the right's.
fn merges(ranks: &[Vec<u8>]) -> Vec<(usize, usize)> {
    let index: HashMap<&[u8], usize> = (ranks.iter().enumerate())
        .map(|(r, t)| (t.as_slice(), r))
        .collect();
    let mut out = Vec::new();
    let mut local = Vec::new();
    for t in ranks {
        local.clear();
        for cut in 1..t.len() {
            if let (Some(&l), Some(&r)) = (index.get(&t[..cut]), index.get(&t[cut..])) {
                local.push((l, r));
            }
        }
        local.sort_unstable();
        out.extend_from_slice(&local);
    }
    out
}

/// The special-token names `tokenizer_config.json` gives the ids n..n + count
/// (`added_tokens_decoder`: id → `{ "content": … }`); ids outside are not special
/// tokens of the tiktoken encoding and are left out, as `TikTokenTokenizer` does.
fn special_names(config: &[u8], n: u64, count: u32) -> Result<BTreeMap<u64, String>, LayoutError> {
    #[derive(Deserialize)]
    struct Config {
        #[serde(default)]
        added_tokens_decoder: BTreeMap<String, Added>,
    }
    #[derive(Deserialize)]
    struct Added {
        content: String,
    }
    let c: Config = serde_json::from_slice(config).map_err(|e| {
        LayoutError::new(
            "added_tokens_decoder",
            format!("not valid JSON of the expected shape: {e}"),
        )
    })?;
    let mut out = BTreeMap::new();
    for (id, added) in c.added_tokens_decoder {
        let field = || format!("added_tokens_decoder.{id}");
        let id: u64 = id
            .parse()
            .map_err(|_| LayoutError::new(field(), "not a token id"))?;
        if (n..n + u64::from(count)).contains(&id) {
            if added.content.is_empty() {
                return Err(LayoutError::new(field(), "an empty content"));
            }
            out.insert(id, added.content);
        }
    }
    Ok(out)
}

/// GPT-2's byte-level alphabet: the printable bytes stand for themselves, the others
/// (controls, space, 127-160, 173) for 256 + their order.
fn byte_alphabet() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut out = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        out[b as usize] = if printable(b) {
            char::from(b)
        } else {
            next += 1;
            char::from_u32(next - 1).expect("below 324 is a char")
        };
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> TiktokenSpec {
        TiktokenSpec {
            file: "tiktoken.model".into(),
            pattern: r"\s+|\S+".into(),
            reserved_special_tokens: 4,
            why: None,
        }
    }

    fn line(token: &[u8], rank: usize) -> String {
        format!(
            "{} {rank}\n",
            base64::engine::general_purpose::STANDARD.encode(token)
        )
    }

    #[test]
    fn the_alphabet_is_gpt2s() {
        let a = byte_alphabet();
        assert_eq!(a[b' ' as usize], 'Ġ');
        assert_eq!(a[b'\n' as usize], 'Ċ');
        assert_eq!(a[b'a' as usize], 'a');
        assert_eq!(a[0], 'Ā');
        assert_eq!(a[0xAD], 'Ń');
    }

    #[test]
    fn merges_are_every_split_in_rank_order() {
        let ranks: Vec<Vec<u8>> = [&b"a"[..], b"b", b"ab", b"aba", b"ba"]
            .iter()
            .map(|t| t.to_vec())
            .collect();
        // "aba" splits as a|ba and ab|a; "ba" comes later but is a token, so it counts.
        assert_eq!(merges(&ranks), vec![(0, 1), (0, 4), (2, 0), (1, 0)]);
    }

    #[test]
    fn a_bad_file_is_refused_naming_the_line() {
        let mut model = line(b"a", 0) + &line(b"b", 1);
        let bad = |m: &str| parse_ranks(m.as_bytes()).unwrap_err();
        assert_eq!(bad(&(model.clone() + "YQ== 2\n")).field, "line 3");
        assert!(
            bad(&(model.clone() + "YQ== 2\n"))
                .detail
                .contains("rank 0 again")
        );
        assert_eq!(
            bad(&(model.clone() + "Yw== 1\n")).detail,
            "rank 1 given twice"
        );
        assert_eq!(bad(&(model.clone() + "Yw== x\n")).field, "line 3");
        assert_eq!(bad(&(model.clone() + "%%% 2\n")).field, "line 3");
        assert_eq!(bad(&(model.clone() + "Yw==\n")).detail, "not `BASE64 RANK`");
        assert!(
            bad(&(model.clone() + "Yw== 3\n"))
                .detail
                .starts_with("rank 2 is missing")
        );
        model += "\n";
        assert_eq!(parse_ranks(model.as_bytes()).unwrap().len(), 2);
    }

    #[test]
    fn special_tokens_follow_the_ranks_named_by_the_config() {
        let model = line(b"a", 0) + &line(b"b", 1) + &line(b"ab", 2);
        let config = br#"{"added_tokens_decoder": {"3": {"content": "[BOS]"}, "5": {"content": "<|im_end|>"}, "99": {"content": "far"}}}"#;
        let out = convert(model.as_bytes(), Some(config), &spec()).unwrap();
        let doc: Value = serde_json::from_slice(&out).unwrap();
        let added: Vec<(u64, &str)> = (doc["added_tokens"].as_array().unwrap().iter())
            .map(|t| (t["id"].as_u64().unwrap(), t["content"].as_str().unwrap()))
            .collect();
        assert_eq!(
            added,
            vec![
                (3, "[BOS]"),
                (4, "<|reserved_token_4|>"),
                (5, "<|im_end|>"),
                (6, "<|reserved_token_6|>")
            ]
        );
        assert_eq!(doc["model"]["merges"], json!([["a", "b"]]));
        let e = convert(
            model.as_bytes(),
            Some(br#"{"added_tokens_decoder": {"x": {"content": "y"}}}"#),
            &spec(),
        )
        .unwrap_err();
        assert_eq!(
            (e.0.as_str(), e.1.field.as_str()),
            ("tokenizer_config.json", "added_tokens_decoder.x")
        );
    }
}
