#!/usr/bin/env python3
"""Write the FP8 install benchmark's source: a DeepSeek-V3-shaped MoE checkpoint whose
linear weights are FP8 e4m3 with a float32 `weight_scale_inv` per 128x128 block, as
deepseek-ai/DeepSeek-V3 stores them (`quantization_config: {quant_method: fp8, fmt:
e4m3, weight_block_size: [128, 128]}`), random and seeded.

Usage: make_fp8_source.py DIR [LAYERS]   (needs numpy; the bench runs it in its venv)

LAYERS=6 (default; the first dense, the rest 64 routed experts of width 1024 at hidden
2048) is 2.3 GB. Codes are uniform over the finite e4m3 values (0x7f and 0xff, the NaN
codes, are never written); scales are uniform in [0.5, 1.5) x 2^-8. Embeddings, norms,
the router and `lm_head` are BF16, the router's correction bias F32, as in the real
checkpoint. The safetensors files are written by hand (header, then data in header
order), four shards, with an index.
"""

import json
import os
import sys

import numpy as np

H, VOCAB, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V = 2048, 32000, 16, 512, 256, 64, 32, 64
INTER, MOE_INTER, EXPERTS, TOPK = 4096, 1024, 64, 4
SHARDS = 4


def config(layers):
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": VOCAB, "hidden_size": H, "intermediate_size": INTER,
        "moe_intermediate_size": MOE_INTER, "num_hidden_layers": layers,
        "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
        "n_shared_experts": 1, "n_routed_experts": EXPERTS, "routed_scaling_factor": 2.5,
        "kv_lora_rank": KV_LORA, "q_lora_rank": Q_LORA, "qk_rope_head_dim": ROPE,
        "v_head_dim": V, "qk_nope_head_dim": NOPE, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
        "num_experts_per_tok": TOPK, "moe_layer_freq": 1, "first_k_dense_replace": 1,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0, "bos_token_id": VOCAB - 2, "eos_token_id": VOCAB - 1,
        "torch_dtype": "bfloat16",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                "quant_method": "fp8", "weight_block_size": [128, 128]},
    }


def tensors(layers):
    """(name, dtype, shape) in state-dict order."""
    out = [("model.embed_tokens.weight", "BF16", [VOCAB, H])]

    def fp8(name, r, c):
        out.append((f"{name}.weight", "F8_E4M3", [r, c]))
        out.append((f"{name}.weight_scale_inv", "F32", [-(-r // 128), -(-c // 128)]))

    def mlp(p, i):
        fp8(f"{p}.gate_proj", i, H)
        fp8(f"{p}.up_proj", i, H)
        fp8(f"{p}.down_proj", H, i)

    for layer in range(layers):
        p = f"model.layers.{layer}"
        fp8(f"{p}.self_attn.q_a_proj", Q_LORA, H)
        out.append((f"{p}.self_attn.q_a_layernorm.weight", "BF16", [Q_LORA]))
        fp8(f"{p}.self_attn.q_b_proj", HEADS * (NOPE + ROPE), Q_LORA)
        fp8(f"{p}.self_attn.kv_a_proj_with_mqa", KV_LORA + ROPE, H)
        out.append((f"{p}.self_attn.kv_a_layernorm.weight", "BF16", [KV_LORA]))
        fp8(f"{p}.self_attn.kv_b_proj", HEADS * (NOPE + V), KV_LORA)
        fp8(f"{p}.self_attn.o_proj", H, HEADS * V)
        if layer == 0:
            mlp(f"{p}.mlp", INTER)
        else:
            out.append((f"{p}.mlp.gate.weight", "BF16", [EXPERTS, H]))
            out.append((f"{p}.mlp.gate.e_score_correction_bias", "F32", [EXPERTS]))
            for e in range(EXPERTS):
                mlp(f"{p}.mlp.experts.{e}", MOE_INTER)
            mlp(f"{p}.mlp.shared_experts", MOE_INTER)
        out.append((f"{p}.input_layernorm.weight", "BF16", [H]))
        out.append((f"{p}.post_attention_layernorm.weight", "BF16", [H]))
    out.append(("model.norm.weight", "BF16", [H]))
    out.append(("lm_head.weight", "BF16", [VOCAB, H]))
    return out


SIZE = {"BF16": 2, "F32": 4, "F8_E4M3": 1}


def values(rng, name, dtype, n):
    if dtype == "F8_E4M3":
        codes = rng.integers(0, 256, size=n, dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] ^= 1  # never a NaN code
        return codes.tobytes()
    if dtype == "F32":
        if name.endswith("_scale_inv"):
            return (rng.uniform(0.5, 1.5, size=n) / 256).astype(np.float32).tobytes()
        return rng.normal(0, 0.01, size=n).astype(np.float32).tobytes()
    centre = 1.0 if "norm" in name else 0.0
    f = (rng.normal(0, 0.02, size=n) + centre).astype(np.float32)
    return (f.view(np.uint32) >> 16).astype(np.uint16).tobytes()  # BF16, truncated


def write(dir_, layers):
    os.makedirs(dir_, exist_ok=True)
    ts = tensors(layers)
    total = sum(SIZE[d] * int(np.prod(s)) for _, d, s in ts)
    rng = np.random.default_rng(0)
    weight_map, shard, cut, seen = {}, [], total / SHARDS, 0
    groups = []
    for t in ts:
        shard.append(t)
        seen += SIZE[t[1]] * int(np.prod(t[2]))
        if seen >= cut * (len(groups) + 1) and len(groups) < SHARDS - 1:
            groups.append(shard)
            shard = []
    groups.append(shard)
    for i, g in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for name, dtype, shape in g:
            n = SIZE[dtype] * int(np.prod(shape))
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = fname
        h = json.dumps(header, separators=(",", ":")).encode()
        h += b" " * (-len(h) % 8)
        with open(os.path.join(dir_, fname), "wb") as f:
            f.write(len(h).to_bytes(8, "little") + h)
            for name, dtype, shape in g:
                f.write(values(rng, name, dtype, int(np.prod(shape))))
    with open(os.path.join(dir_, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(dir_, "config.json"), "w") as f:
        json.dump(config(layers), f, indent=2)
    print(f"{dir_}: {len(ts)} tensors, {total} bytes in {len(groups)} shards", file=sys.stderr)


if __name__ == "__main__":
    write(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 6)
