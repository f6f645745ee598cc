#!/usr/bin/env python3
"""Convert the SmolLM2-135M-Instruct Q4_1 GGUF into a Hugging Face snapshot.

Usage: smollm2_snapshot.py GGUF DEST

Writes into DEST (created; files replaced):
  model-00001-of-0000N.safetensors ...   BF16 weights, two or more shards
  model.safetensors.index.json
  config.json                            LlamaForCausalLM, every value from the GGUF metadata
  generation_config.json
  tokenizer.json                         GPT-2 byte-level BPE rebuilt from the GGUF vocab/merges
  tokenizer_config.json                  ChatML chat template, special tokens, no BOS added
  special_tokens_map.json

Why the conversion is not a plain copy:
- llama.cpp stores Q and K rows in its own interleaved RoPE order; the HF layout
  (rotate-half RoPE) needs the inverse permutation per head, with the KV head count for K.
  A wrong order still answers a short prompt correctly and derails on longer ones, so
  scripts/peers/smollm2_check.py tests a long greedy sequence and the chat prompt.
- The weights are dequantized (Q4_1, Q8_0) to float32 and rounded to BF16 (nearest even).
- The tied LM head is `token_embd.weight`: no `lm_head.weight` is written.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

# Largest shard payload; the 135M model (~270 MB in BF16) lands in two shards.
SHARD_BYTES = 160 * 1024 * 1024


def field(reader: GGUFReader, key: str):
    f = reader.fields.get(key)
    if f is None:
        raise SystemExit(f"GGUF: missing metadata key {key}")
    return f.contents()


def f32_text(value: float) -> float:
    """The float32 metadata value as the shortest decimal that round-trips (1e-05, not 9.99e-06)."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-") if abs(value) >= 1e-3 else np.format_float_scientific(np.float32(value), unique=True))


def to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even; no NaNs occur in these weights."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K row permutation (llama.cpp interleaved -> HF rotate-half)."""
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_head
    return w.reshape(n_head, head_dim // 2, 2, in_dim).swapaxes(1, 2).reshape(out_dim, in_dim)


def hf_name(name: str) -> str:
    top = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if name in top:
        return top[name]
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[3] != "weight":
        raise SystemExit(f"GGUF: unexpected tensor {name}")
    layer = int(parts[1])
    sub = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }.get(parts[2])
    if sub is None:
        raise SystemExit(f"GGUF: unexpected tensor {name}")
    return f"model.layers.{layer}.{sub}.weight"


def tensor_f32(t) -> np.ndarray:
    # GGUF dims are [ne0 (inner), ne1, ...]; numpy (row-major) wants them reversed.
    shape = tuple(int(d) for d in reversed(t.shape))
    a = dequantize(t.data, t.tensor_type)
    return np.asarray(a, dtype=np.float32).reshape(shape)


def write_safetensors(path: Path, tensors: list[tuple[str, np.ndarray]]) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, bits in tensors:
        n = bits.nbytes
        header[name] = {"dtype": "BF16", "shape": list(bits.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)  # keep the payload 8-byte aligned
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, bits in tensors:
            f.write(bits.astype("<u2", copy=False).tobytes())
    os.replace(tmp, path)


def tokenizer_json(reader: GGUFReader) -> dict:
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type")
    merges = field(reader, "tokenizer.ggml.merges")
    model = field(reader, "tokenizer.ggml.model")
    pre = field(reader, "tokenizer.ggml.pre")
    if model != "gpt2" or pre != "smollm":
        raise SystemExit(f"GGUF: tokenizer {model}/{pre}, expected gpt2/smollm")
    # Token type 3 = control (llama.cpp): these are HF's special added tokens.
    added = [
        {
            "id": i,
            "content": tokens[i],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i in range(len(tokens))
        if int(types[i]) == 3
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        # llama.cpp's `smollm` pre-tokenizer: every digit on its own, then GPT-2's
        # byte-level regex; HF expresses it as Digits(individual) followed by ByteLevel.
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": True},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            ],
        },
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": [m.split(" ", 1) for m in merges],
        },
    }


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit("usage: smollm2_snapshot.py GGUF DEST")
    src, dest = Path(sys.argv[1]), Path(sys.argv[2])
    reader = GGUFReader(src)
    if field(reader, "general.architecture") != "llama":
        raise SystemExit("GGUF: general.architecture is not llama")
    n_layer = int(field(reader, "llama.block_count"))
    hidden = int(field(reader, "llama.embedding_length"))
    n_head = int(field(reader, "llama.attention.head_count"))
    n_kv = int(field(reader, "llama.attention.head_count_kv"))
    ffn = int(field(reader, "llama.feed_forward_length"))
    ctx = int(field(reader, "llama.context_length"))
    theta = f32_text(field(reader, "llama.rope.freq_base"))
    eps = f32_text(field(reader, "llama.attention.layer_norm_rms_epsilon"))
    head_dim = int(field(reader, "llama.rope.dimension_count"))
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = int(field(reader, "llama.vocab_size")) if "llama.vocab_size" in reader.fields else len(tokens)
    bos = int(field(reader, "tokenizer.ggml.bos_token_id"))
    eos = int(field(reader, "tokenizer.ggml.eos_token_id"))
    unk = int(field(reader, "tokenizer.ggml.unknown_token_id"))
    pad = int(field(reader, "tokenizer.ggml.padding_token_id"))
    add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token"))
    template = field(reader, "tokenizer.chat_template")
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names

    dest.mkdir(parents=True, exist_ok=True)
    # Convert in file order of the HF model: embeddings, layers, final norm.
    converted: list[tuple[str, np.ndarray]] = []
    for t in reader.tensors:
        w = tensor_f32(t)
        if t.name.endswith("attn_q.weight"):
            w = unpermute(w, n_head)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute(w, n_kv)
        converted.append((hf_name(t.name), to_bf16(w)))

    def order(item: tuple[str, np.ndarray]) -> tuple:
        n = item[0]
        if n.startswith("model.layers."):
            return (1, int(n.split(".")[2]), n)
        return (0 if "embed" in n else 2, 0, n)

    converted.sort(key=order)
    shards: list[list[tuple[str, np.ndarray]]] = [[]]
    size = 0
    for item in converted:
        if shards[-1] and size + item[1].nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item[1].nbytes
    if len(shards) < 2:  # the installer is exercised on a sharded repo by design
        raise SystemExit("internal: expected at least two shards")
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(dest / fname, shard)
        for name, bits in shard:
            weight_map[name] = fname
            total += bits.nbytes

    def dump(name: str, obj) -> None:
        tmp = dest / (name + ".tmp")
        tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
        os.replace(tmp, dest / name)

    dump("model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    dump(
        "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": hidden,
            "intermediate_size": ffn,
            "num_hidden_layers": n_layer,
            "num_attention_heads": n_head,
            "num_key_value_heads": n_kv,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": ctx,
            "rms_norm_eps": eps,
            "rope_theta": theta,
            "rope_scaling": None,
            "vocab_size": vocab,
            "tie_word_embeddings": tied,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": bos,
            "eos_token_id": eos,
            "pad_token_id": pad,
            "torch_dtype": "bfloat16",
        },
    )
    dump("generation_config.json", {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad})
    dump("tokenizer.json", tokenizer_json(reader))
    specials = {"bos_token": tokens[bos], "eos_token": tokens[eos], "pad_token": tokens[pad], "unk_token": tokens[unk]}
    dump(
        "tokenizer_config.json",
        {
            "tokenizer_class": "GPT2Tokenizer",
            "add_bos_token": add_bos,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": ctx,
            **specials,
            "additional_special_tokens": [tokens[bos], tokens[eos]],
            "chat_template": template,
        },
    )
    dump("special_tokens_map.json", {**specials, "additional_special_tokens": [tokens[bos], tokens[eos]]})
    print(f"smollm2_snapshot: {len(converted)} tensors, {total} bytes BF16, {len(shards)} shards -> {dest}")


if __name__ == "__main__":
    main()
