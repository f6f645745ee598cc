#!/usr/bin/env python3
"""The golden of Kimi-K2's tokenizer conversion (issue 26): a tiktoken BPE file of modest
size in the format Kimi's repos ship (`tiktoken.model`: base64 token and rank per line),
the `tokenizer_config.json` that names its special tokens, a few thousand lines of mixed
text, and the ids tiktoken's own `Encoding` gives each line with Kimi's split pattern and
special tokens, as Kimi's `tokenization_kimi.py` builds it (`TikTokenTokenizer`: the
`pat_str` below, `num_reserved_special_tokens = 256` ids after the BPE ranks, named by
`added_tokens_decoder` else `<|reserved_token_{id}|>`, `encode(..., allowed_special="all")`).

The ranks: the 256 bytes, then SmolLM2-135M's byte-level BPE merges in order (each new
token gets the next rank), then tokens for common Chinese characters and words and a few
emoji (SmolLM2 has no merges for them), so every part of the split pattern meets real
merges. The real Kimi file has 163,584 ranks learned on Kimi's data; this one has ~49k.

  source scripts/venv.sh tiktoken
  python3 scripts/golden/gen_kimi_tokenizer_golden.py [--smollm2 DIR] [--check]

Writes tests/data/kimi_tiktoken/{tiktoken.model, tokenizer_config.json, golden.json}
(the ranks' source is target/smollm2/snapshot/tokenizer.json, which scripts/demo.sh
fetches). `--check` rebuilds and compares with the committed files.
"""
import argparse
import base64
import json
import os
import random
import sys

import tiktoken

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "data", "kimi_tiktoken")

# tokenization_kimi.py's `TikTokenTokenizer.pat_str` (moonshotai/Kimi-K2-Instruct and
# Kimi-K2-Thinking; transformers' Kimi2_6Tokenizer carries the same string).
PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_RESERVED = 256

# Kimi-K2's named special tokens, by offset from the first id after the ranks (163584
# in the real file): its tokenizer_config.json `added_tokens_decoder`.
K2_SPECIALS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>",
    17: "<|im_middle|>", 18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>",
    21: "<|media_pad|>", 22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}

HAN = ("的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可"
       "里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老"
       "从动两长知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正名定女问力机给"
       "模型语言数据训练推理计算量化专家注意力")
HAN_WORDS = ["中国", "我们", "模型", "语言", "数据", "训练", "推理", "计算", "量化", "专家", "注意力",
             "大模型", "人工智能", "自然语言", "你好", "世界", "时间", "问题", "没有", "知道"]
EMOJI = "😀😂🤔👍🚀🔥✨🎉❤️🌍🐍🦀"


def bytes_to_unicode():
    """GPT-2's byte ↔ printable character table (the byte-level BPE's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_ranks(smollm2):
    tok = json.load(open(os.path.join(smollm2, "tokenizer.json"), encoding="utf-8"))
    dec = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {bytes([b]): b for b in range(256)}

    def add(t):
        if t not in ranks:
            ranks[t] = len(ranks)

    for m in tok["model"]["merges"]:
        a, b = m.split(" ") if isinstance(m, str) else m
        add(bytes(dec[c] for c in a) + bytes(dec[c] for c in b))
    for ch in HAN + EMOJI:
        u = ch.encode("utf-8")
        for k in range(2, len(u) + 1):
            add(u[:k])
    for w in HAN_WORDS:
        u = w.encode("utf-8")
        for k in range(6, len(u) + 1, 3):
            add(u[:k])
    return ranks


def specials(n_ranks):
    names = {n_ranks + off: name for off, name in K2_SPECIALS.items()}
    return {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(n_ranks, n_ranks + NUM_RESERVED)}


def corpus(n_ranks, n=3000):
    """Mixed lines from a seeded stream: English, code, Chinese, emoji, numbers,
    whitespace runs, contractions and case, accents and marks, special tokens."""
    rng = random.Random(26)
    words = ("the model tokenizer expert routing latent attention cache install weights quantized "
             "layer hidden rotary position token vocabulary merge rank byte pattern split Kimi DeepSeek "
             "running install verify GPU CPU benchmark decode prefill").split()
    code = ["def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }",
            "let v: Vec<u32> = ids.iter().map(|&x| x + 1).collect();", "if (a && b || !c) { return -1; }",
            "SELECT id, name FROM users WHERE age >= 21;", "fn main() {\n\tprintln!(\"{}\", 42);\n}",
            "x = {'a': [1, 2, 3], \"b\": None}", "#include <stdio.h>\r\n", "    // TODO: fix\n\n\n",
            "<div class=\"row\">&nbsp;</div>", "$ cargo test -p gturbo --lib -- kimi"]
    extra = ["I'm", "you'LL", "He's", "THEY'RE", "we'd", "don't", "CamelCaseName", "HTTPServer",
             "naïve café", "Ångström", "straße", "e\u0301te\u0301", "Привет мир", "γειά σου", "こんにちは世界",
             "한국어", "مرحبا", "\u00a0nbsp", "tab\there", "x\u200by"]
    named = [v for v in K2_SPECIALS.values()]
    out = []
    for i in range(n):
        parts = []
        for _ in range(rng.randint(1, 8)):
            r = rng.random()
            if r < 0.3:
                w = " ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))
                parts.append(w.capitalize() if rng.random() < 0.3 else w)
            elif r < 0.42:
                parts.append(rng.choice(code))
            elif r < 0.57:
                parts.append("".join(rng.choice(HAN) for _ in range(rng.randint(1, 6)))
                             + (rng.choice(HAN_WORDS) if rng.random() < 0.6 else ""))
            elif r < 0.63:
                parts.append("".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 3))))
            elif r < 0.73:
                parts.append(str(rng.choice([rng.randint(0, 10 ** rng.randint(1, 12)), rng.random() * 1000, -rng.randint(0, 999)])))
            elif r < 0.8:
                parts.append(rng.choice([" " * rng.randint(2, 9), "\n" * rng.randint(1, 3), "\t\t", " \n ", "\r\n", "   \n\n  "]))
            elif r < 0.92:
                parts.append(rng.choice(extra))
            elif r < 0.97:
                parts.append(rng.choice(named))
            else:
                parts.append(f"<|reserved_token_{n_ranks + rng.choice([5, 8, 16, 30, 200, 253])}|>")
        out.append(rng.choice(["", " ", "\n"]).join(parts))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smollm2", default=os.path.join(ROOT, "target", "smollm2", "snapshot"))
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    ranks = build_ranks(args.smollm2)
    assert sorted(ranks.values()) == list(range(len(ranks)))
    model = "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda x: x[1]))
    sp = specials(len(ranks))
    enc = tiktoken.Encoding(name="kimi_toy", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=sp)
    config = {
        "added_tokens_decoder": {
            str(len(ranks) + off): {"content": name, "lstrip": False, "normalized": False,
                                    "rstrip": False, "single_word": False, "special": True}
            for off, name in sorted(K2_SPECIALS.items())
        },
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
    }
    lines = corpus(len(ranks))
    golden = {
        "tiktoken": tiktoken.__version__,
        "pat_str": PAT_STR,
        "num_reserved_special_tokens": NUM_RESERVED,
        "ranks": len(ranks),
        "vocab": enc.n_vocab,
        "lines": [{"text": t, "ids": enc.encode(t, allowed_special="all")} for t in lines],
    }
    files = {
        "tiktoken.model": model,
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n",
        "golden.json": json.dumps(golden, ensure_ascii=False, separators=(",", ":")) + "\n",
    }
    if args.check:
        bad = [f for f, s in files.items() if open(os.path.join(OUT, f), encoding="utf-8").read() != s]
        if bad:
            sys.exit(f"differs from the committed files: {bad}")
        print("kimi tokenizer golden: reproduced")
        return
    os.makedirs(OUT, exist_ok=True)
    for f, s in files.items():
        with open(os.path.join(OUT, f), "w", encoding="utf-8", newline="") as fh:
            fh.write(s)
    n_ids = sum(len(l["ids"]) for l in golden["lines"])
    print(f"{len(ranks)} ranks, vocab {enc.n_vocab}, {len(lines)} lines, {n_ids} ids -> {OUT}")


if __name__ == "__main__":
    main()
