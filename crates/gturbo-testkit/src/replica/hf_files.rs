//! The small JSON files of a snapshot besides config.json: a tiny but valid
//! byte-level BPE `tokenizer.json` (the 256 GPT-2 byte symbols, no merges, plus the
//! special tokens at the ids the config names), `tokenizer_config.json` with a
//! ChatML-style chat template, and `generation_config.json`.

use std::io;
use std::path::Path;

use serde_json::{Map, Value, json};

use super::st::write_json;

/// Special tokens of a fixture tokenizer: `(content, id)`, ids as the config uses them.
pub(crate) struct Specials {
    pub(crate) tokens: Vec<(&'static str, u64)>,
    /// Content of the BOS token, if the family has one.
    pub(crate) bos: Option<&'static str>,
    pub(crate) eos: &'static str,
    pub(crate) pad: Option<&'static str>,
    pub(crate) tokenizer_class: &'static str,
}

impl Specials {
    fn id(&self, content: &str) -> Option<u64> {
        self.tokens
            .iter()
            .find(|(c, _)| *c == content)
            .map(|&(_, id)| id)
    }

    /// Qwen's three ChatML specials, `<|endoftext|>` at `first` (as in Qwen3:
    /// 151643, 151644, 151645), EOS `<|im_end|>`.
    pub(crate) fn chatml(first: u64) -> Self {
        Specials {
            tokens: vec![
                ("<|endoftext|>", first),
                ("<|im_start|>", first + 1),
                ("<|im_end|>", first + 2),
            ],
            bos: None,
            eos: "<|im_end|>",
            pad: Some("<|endoftext|>"),
            tokenizer_class: "Qwen2Tokenizer",
        }
    }

    /// Llama 3 style: BOS `<|begin_of_text|>` at `first`, EOS `<|end_of_text|>`.
    pub(crate) fn llama3(first: u64) -> Self {
        Specials {
            tokens: vec![("<|begin_of_text|>", first), ("<|end_of_text|>", first + 1)],
            bos: Some("<|begin_of_text|>"),
            eos: "<|end_of_text|>",
            pad: None,
            tokenizer_class: "PreTrainedTokenizerFast",
        }
    }

    /// A BOS and an EOS token at the ids the config names (the flagship replicas).
    pub(crate) fn bos_eos(
        bos: (&'static str, u64),
        eos: (&'static str, u64),
        tokenizer_class: &'static str,
    ) -> Self {
        Specials {
            tokens: vec![bos, eos],
            bos: Some(bos.0),
            eos: eos.0,
            pad: None,
            tokenizer_class,
        }
    }

    /// DeepSeek's `<｜begin▁of▁sentence｜>` and `<｜end▁of▁sentence｜>`.
    pub(crate) fn deepseek(bos: u64, eos: u64) -> Self {
        Specials::bos_eos(
            ("<｜begin▁of▁sentence｜>", bos),
            ("<｜end▁of▁sentence｜>", eos),
            "LlamaTokenizerFast",
        )
    }

    pub(crate) fn eos_id(&self) -> u64 {
        self.id(self.eos).unwrap_or(0)
    }

    pub(crate) fn bos_id(&self) -> Option<u64> {
        self.bos.and_then(|b| self.id(b))
    }

    pub(crate) fn pad_id(&self) -> Option<u64> {
        self.pad.and_then(|p| self.id(p))
    }
}

/// GPT-2's byte-to-unicode table: printable bytes map to themselves, the rest to
/// code points from U+0100 up, so every byte has a visible one-character symbol.
fn byte_symbols() -> Vec<char> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut next = 256u32;
    (0u32..256)
        .map(|b| {
            let cp = if printable(b) {
                b
            } else {
                let cp = next;
                next += 1;
                cp
            };
            char::from_u32(cp).unwrap_or('?')
        })
        .collect()
}

const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

const LLAMA3_TEMPLATE: &str = "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";

/// Write tokenizer.json, tokenizer_config.json and generation_config.json.
pub(crate) fn write_tokenizer_files(
    dir: &Path,
    specials: &Specials,
    max_length: u64,
) -> io::Result<Vec<String>> {
    let mut vocab = Map::new();
    for (id, sym) in byte_symbols().into_iter().enumerate() {
        vocab.insert(sym.to_string(), json!(id));
    }
    let mut added = Vec::new();
    for &(content, id) in &specials.tokens {
        // Listing the specials in the model vocab too keeps their ids even when they
        // are far past the 256 byte symbols (the tokenizers crate assigns added-only
        // tokens the next free id).
        vocab.insert(content.to_string(), json!(id));
        added.push(json!({
            "id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }));
    }
    let byte_level = json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true
    });
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": []
        }
    });
    write_json(&dir.join("tokenizer.json"), &tokenizer)?;
    write_config_files(dir, specials, max_length, &[])?;
    Ok(vec![
        "generation_config.json".into(),
        "tokenizer.json".into(),
        "tokenizer_config.json".into(),
    ])
}

/// `tokenizer_config.json` (with `extra` keys set on top) and `generation_config.json`.
fn write_config_files(
    dir: &Path,
    specials: &Specials,
    max_length: u64,
    extra: &[(&str, Value)],
) -> io::Result<()> {
    let template = if specials.tokenizer_class == "Qwen2Tokenizer" {
        CHATML_TEMPLATE
    } else {
        LLAMA3_TEMPLATE
    };
    let added_decoder: Map<String, Value> = specials
        .tokens
        .iter()
        .map(|&(content, id)| {
            (
                id.to_string(),
                json!({"content": content, "lstrip": false, "normalized": false,
                       "rstrip": false, "single_word": false, "special": true}),
            )
        })
        .collect();
    let mut tokenizer_config = json!({
        "add_bos_token": specials.bos.is_some(),
        "add_prefix_space": false,
        "added_tokens_decoder": added_decoder,
        "bos_token": specials.bos,
        "chat_template": template,
        "clean_up_tokenization_spaces": false,
        "eos_token": specials.eos,
        "model_max_length": max_length,
        "pad_token": specials.pad,
        "tokenizer_class": specials.tokenizer_class,
    });
    for (k, v) in extra {
        tokenizer_config[*k] = v.clone();
    }
    write_json(&dir.join("tokenizer_config.json"), &tokenizer_config)?;

    let mut generation = Map::new();
    if let Some(bos) = specials.bos_id() {
        generation.insert("bos_token_id".into(), json!(bos));
    }
    generation.insert("eos_token_id".into(), json!([specials.eos_id()]));
    if let Some(pad) = specials.pad_id() {
        generation.insert("pad_token_id".into(), json!(pad));
    }
    generation.insert("do_sample".into(), json!(true));
    generation.insert("temperature".into(), json!(0.6));
    generation.insert("top_k".into(), json!(20));
    generation.insert("top_p".into(), json!(0.95));
    generation.insert("transformers_version".into(), json!("5.17.0"));
    write_json(
        &dir.join("generation_config.json"),
        &Value::Object(generation),
    )
}

/// Kimi-K2's tokenizer files: no `tokenizer.json` but a tiktoken BPE file
/// (`tiktoken.model`: one `base64(token) rank` line per token, the format tiktoken's
/// `load_tiktoken_bpe` reads), the Python class that loads it (`tokenization_kimi.py`,
/// named by `tokenizer_config.json`'s `auto_map`), and the config files. The BPE file
/// here holds the 256 single bytes only (the real one has 163,840 ranks); the Python
/// file is a stand-in that says so, not the repo's code.
pub(crate) fn write_kimi_tokenizer_files(
    dir: &Path,
    specials: &Specials,
    max_length: u64,
) -> io::Result<Vec<String>> {
    // Standard base64 of one byte: two symbols and `==` (RFC 4648 §4).
    const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut bpe = String::new();
    for b in 0..=255u8 {
        let (hi, lo) = (B64[usize::from(b >> 2)], B64[usize::from((b & 3) << 4)]);
        bpe.push_str(&format!("{}{}== {b}\n", char::from(hi), char::from(lo)));
    }
    std::fs::write(dir.join("tiktoken.model"), bpe)?;
    std::fs::write(
        dir.join("tokenization_kimi.py"),
        "# Stand-in for Kimi-K2's tokenizer class (a gturbo test fixture): the real file\n\
         # defines TikTokenTokenizer over tiktoken.model.\n\
         class TikTokenTokenizer:\n    vocab_files_names = {\"vocab_file\": \"tiktoken.model\"}\n",
    )?;
    let auto_map = json!({"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null]});
    write_config_files(dir, specials, max_length, &[("auto_map", auto_map)])?;
    Ok(vec![
        "generation_config.json".into(),
        "tiktoken.model".into(),
        "tokenization_kimi.py".into(),
        "tokenizer_config.json".into(),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_symbols_are_distinct_and_match_gpt2() {
        let s = byte_symbols();
        let mut sorted = s.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 256);
        assert_eq!(s[b'a' as usize], 'a');
        // Space is byte 32, the 33rd non-printable byte: U+0100 + 32 = 'Ġ'.
        assert_eq!(s[b' ' as usize], 'Ġ');
        assert_eq!(s[b'\n' as usize], 'Ċ');
    }
}
