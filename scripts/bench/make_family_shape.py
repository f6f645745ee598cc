#!/usr/bin/env python3
"""Write a scaled benchmark shape of a family: a random BF16 checkpoint in the real hub layout.

usage: make_family_shape.py FAMILY OUT [--target-gb 1.1 | --layers N] [--hidden H]
                            [--tokenizer DIR] [--seed S] [--shard-gb 1.0] [--print-only]

FAMILY is deepseek_v3 (DeepSeek-V3), glm4_moe (GLM-4.5-Air), qwen3_next
(Qwen3-Next-80B-A3B) or gpt_oss (gpt-oss-20b). The shape is the family's real
config.json (REAL below, the published values) scaled down in width and depth:

- width: every width of the real config is divided by real_hidden / H (H: --hidden, a
  per-family default that keeps every width a multiple of 64, the INT4 group, as
  exactly as the real ratios allow) and rounded to a multiple of 64; head dims are kept
  and head counts divided (query heads rounded to a multiple of the real query/KV ratio);
  experts per layer, top-k, groups, shared experts, routing and RoPE settings are kept.
- depth: the fewest layers whose INT4 install (estimated at 4.5 bits a weight, the INT4
  g64 layout) reaches --target-gb, or --layers; the dense first layers and the full
  attention interval scale with it (at least one of each kind).
- vocabulary: the tokenizer of --tokenizer (SmolLM2's by default, with the special tokens
  the llama.cpp converter looks up for the family added), vocab_size set to match
  (rounded up to a multiple of 64).
- MTP / NextN layers: none (num_nextn_predict_layers 0): the install drops them and
  llama.cpp's converter would otherwise expect their tensors.

Parameter names and shapes come from transformers (AutoModelForCausalLM.from_config on
the meta device; the fused experts transformers 5 keeps are written per expert, as the
hub stores them, except gpt-oss, whose hub layout is the fused one). Values are seeded
random BF16 (normal, std 0.02; norms 1; e_score_correction_bias F32 zeros, as the hub
stores it in F32), written as sharded safetensors with model.safetensors.index.json.

Needs torch, transformers (5.x) and safetensors: GOLDEN_VENV here, the plain python3 on
the H200 image. Nothing in it depends on this machine's paths.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[2]
GROUP = 64  # INT4 group: widths are kept multiples of it
INT4_BYTES_PER_WEIGHT = 4.5 / 8  # 4-bit values + a BF16 scale and bias per 64
STD = 0.02

# The published config.json of each family's reference repo (the fields the runners and
# the llama.cpp converter read), before scaling.
REAL = {
    "deepseek_v3": {
        "repo": "deepseek-ai/DeepSeek-V3",
        "hidden": 896,  # 7168 / 8: every width below divides exactly
        "config": {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 61,
            "first_k_dense_replace": 3,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "n_group": 8,
            "topk_group": 4,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "moe_layer_freq": 1,
            "num_nextn_predict_layers": 1,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000,
            "rope_scaling": {
                "type": "yarn",
                "factor": 40,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            "max_position_embeddings": 163840,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "vocab_size": 129280,
        },
        "scaled": ["hidden_size", "intermediate_size", "moe_intermediate_size", "q_lora_rank", "kv_lora_rank"],
        "heads": ("num_attention_heads", "num_key_value_heads"),
        "dense_first": "first_k_dense_replace",
    },
    "glm4_moe": {
        "repo": "zai-org/GLM-4.5-Air",
        "hidden": 2048,  # 4096 / 2: the expert width 1408 / 2 = 704 stays a multiple of 64
        "config": {
            "architectures": ["Glm4MoeForCausalLM"],
            "model_type": "glm4_moe",
            "hidden_size": 4096,
            "intermediate_size": 10944,
            "moe_intermediate_size": 1408,
            "num_hidden_layers": 46,
            "first_k_dense_replace": 1,
            "num_attention_heads": 96,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "partial_rotary_factor": 0.5,
            "attention_bias": True,
            "use_qk_norm": False,
            "n_routed_experts": 128,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.0,
            "num_nextn_predict_layers": 1,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 1000000,
            "rope_scaling": None,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": False,
            "vocab_size": 151552,
        },
        "scaled": ["hidden_size", "intermediate_size", "moe_intermediate_size"],
        "heads": ("num_attention_heads", "num_key_value_heads"),
        "dense_first": "first_k_dense_replace",
        # glm4_moe's llama.cpp converter sets these special tokens by name.
        "special_tokens": ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
                           "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],
    },
    "qwen3_next": {
        "repo": "Qwen/Qwen3-Next-80B-A3B-Instruct",
        "hidden": 1024,  # 2048 / 2
        "config": {
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": "qwen3_next",
            "hidden_size": 2048,
            "intermediate_size": 5120,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "num_hidden_layers": 48,
            "full_attention_interval": 4,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "partial_rotary_factor": 0.25,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "num_experts": 512,
            "num_experts_per_tok": 10,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000000,
            "rope_scaling": None,
            "max_position_embeddings": 262144,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "vocab_size": 151936,
        },
        "scaled": ["hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"],
        "heads": ("num_attention_heads", "num_key_value_heads"),
        "linear_heads": ("linear_num_value_heads", "linear_num_key_heads"),
    },
    "gpt_oss": {
        "repo": "openai/gpt-oss-20b",
        "hidden": 1024,  # 2880 / 2.8125; the expert width follows (2880 → 1024)
        "config": {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "num_hidden_layers": 24,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
            "experts_per_token": 4,
            "sliding_window": 128,
            "attention_bias": True,
            "swiglu_limit": 7.0,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 150000,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
            },
            "max_position_embeddings": 131072,
            "initial_context_length": 4096,
            "tie_word_embeddings": False,
            "vocab_size": 201088,
        },
        "scaled": ["hidden_size", "intermediate_size"],
        "heads": ("num_attention_heads", "num_key_value_heads"),
        "alternating": "layer_types",
    },
}


def round_group(x: float) -> int:
    return max(GROUP, int(round(x / GROUP)) * GROUP)


def scaled_config(family: str, hidden: int, layers: int, vocab: int, ids: dict) -> dict:
    """The real config of FAMILY with widths divided by real_hidden / hidden, LAYERS layers."""
    spec = REAL[family]
    cfg = json.loads(json.dumps(spec["config"]))
    div = cfg["hidden_size"] / hidden
    for key in spec["scaled"]:
        cfg[key] = hidden if key == "hidden_size" else round_group(cfg[key] / div)
    q, kv = spec["heads"]
    group = cfg[q] // cfg[kv]
    cfg[kv] = max(1, round(cfg[kv] / div))
    cfg[q] = cfg[kv] * group
    if "linear_heads" in spec:
        v, k = spec["linear_heads"]
        ratio = cfg[v] // cfg[k]
        cfg[k] = max(1, round(cfg[k] / div))
        cfg[v] = cfg[k] * ratio
    real_layers = cfg["num_hidden_layers"]
    cfg["num_hidden_layers"] = layers
    if "dense_first" in spec:
        key = spec["dense_first"]
        cfg[key] = max(1, round(cfg[key] * layers / real_layers))
    if "alternating" in spec:
        cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if "num_nextn_predict_layers" in cfg:
        cfg["num_nextn_predict_layers"] = 0
    cfg["vocab_size"] = vocab
    cfg.update(ids)
    cfg["torch_dtype"] = "bfloat16"
    return cfg


def min_layers(family: str) -> int:
    cfg = REAL[family]["config"]
    if "full_attention_interval" in cfg:
        return cfg["full_attention_interval"]  # at least one full-attention layer
    if "first_k_dense_replace" in cfg:
        return 2  # a dense layer and a MoE layer
    return 2


def meta_model(cfg: dict):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    config = AutoConfig.for_model(cfg["model_type"], **fields)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def hub_tensors(family: str, model) -> list:
    """(name, shape, dtype) in the hub layout, in the model's order."""
    out = []
    for name, t in model.state_dict().items():
        shape = tuple(t.shape)
        fused = ".mlp.experts." in name and name.rsplit(".", 1)[1] in ("gate_up_proj", "down_proj")
        if fused and family != "gpt_oss":
            head = name.rsplit(".", 1)[0]
            n_exp, rows, cols = shape
            for e in range(n_exp):
                if name.endswith("gate_up_proj"):  # [E, 2I, H], gate rows first
                    out.append((f"{head}.{e}.gate_proj.weight", (rows // 2, cols), "bf16"))
                    out.append((f"{head}.{e}.up_proj.weight", (rows // 2, cols), "bf16"))
                else:
                    out.append((f"{head}.{e}.down_proj.weight", (rows, cols), "bf16"))
            continue
        out.append((name, shape, "f32" if name.endswith("e_score_correction_bias") else "bf16"))
    return out


def int4_bytes(tensors: list) -> int:
    total = 0.0
    for name, shape, _ in tensors:
        n = math.prod(shape)
        total += n * INT4_BYTES_PER_WEIGHT if len(shape) >= 2 and "norm" not in name else n * 2
    return int(total)


def value(seed: int, name: str, shape: tuple, dtype: str):
    import torch

    if dtype == "f32":  # e_score_correction_bias: zeros, F32 as the hub has it
        return torch.zeros(shape, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1)
    return (torch.randn(shape, generator=g, dtype=torch.float32) * STD).to(torch.bfloat16)


def write_shards(out: Path, tensors: list, seed: int, shard_bytes: int) -> int:
    from safetensors.torch import save_file

    groups, cur, cur_bytes = [], [], 0
    for t in tensors:
        nbytes = math.prod(t[1]) * (4 if t[2] == "f32" else 2)
        if cur and cur_bytes + nbytes > shard_bytes:
            groups.append(cur)
            cur, cur_bytes = [], 0
        cur.append(t)
        cur_bytes += nbytes
    groups.append(cur)
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        data = {name: value(seed, name, shape, dtype) for name, shape, dtype in group}
        total += sum(v.numel() * v.element_size() for v in data.values())
        save_file(data, str(out / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in data})
        print(f"  {fname}: {len(data)} tensors", file=sys.stderr)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def write_tokenizer(family: str, src: Path, out: Path) -> tuple[int, dict]:
    """Copies the tokenizer files, adds the family's special tokens; (vocab size, ids)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    extra = [t for t in REAL[family].get("special_tokens", []) if t not in tok.get_vocab()]
    if extra:
        tok.add_special_tokens({"additional_special_tokens": extra})
    tok.save_pretrained(str(out))
    vocab = -(-len(tok) // GROUP) * GROUP  # padded as the hub's vocabularies are
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
           "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id}
    return vocab, ids


def pick_layers(family: str, hidden: int, vocab: int, ids: dict, target: float) -> int:
    layers = min_layers(family)
    while True:
        cfg = scaled_config(family, hidden, layers, vocab, ids)
        if int4_bytes(hub_tensors(family, meta_model(cfg))) >= target * 1e9 or layers >= 512:
            return layers
        layers += 1


def describe(family: str, cfg: dict, tensors: list) -> str:
    keys = [k for k in cfg if isinstance(cfg[k], (int, float)) and not isinstance(cfg[k], bool)
            and k not in ("bos_token_id", "eos_token_id", "pad_token_id")]
    params = sum(math.prod(s) for _, s, _ in tensors)
    return (f"{family} shape of {REAL[family]['repo']}: " + ", ".join(f"{k} {cfg[k]}" for k in keys)
            + f"; {params / 1e9:.3f} B parameters, ~{int4_bytes(tensors) / 1e9:.2f} GB at INT4 g64")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("family", choices=sorted(REAL))
    ap.add_argument("out", type=Path)
    ap.add_argument("--target-gb", type=float, default=1.1, help="smallest INT4 install size (GB)")
    ap.add_argument("--layers", type=int, help="layer count (overrides --target-gb)")
    ap.add_argument("--hidden", type=int, help="hidden size (default: the family's)")
    ap.add_argument("--tokenizer", type=Path, default=ROOT / "target/smollm2/snapshot",
                    help="a folder with tokenizer.json and tokenizer_config.json")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-gb", type=float, default=1.0)
    ap.add_argument("--print-only", action="store_true", help="print the shape, write nothing")
    a = ap.parse_args()
    hidden = a.hidden or REAL[a.family]["hidden"]
    if hidden % GROUP:
        sys.exit(f"--hidden {hidden}: not a multiple of {GROUP}")
    if not (a.tokenizer / "tokenizer.json").is_file():
        sys.exit(f"{a.tokenizer}/tokenizer.json: missing (scripts/fetch_smollm2.sh writes SmolLM2's)")
    tmp_tok = a.out / ".tokenizer"
    if a.out.exists():
        shutil.rmtree(a.out)
    tmp_tok.mkdir(parents=True)
    vocab, ids = write_tokenizer(a.family, a.tokenizer, tmp_tok)
    layers = a.layers or pick_layers(a.family, hidden, vocab, ids, a.target_gb)
    if layers < min_layers(a.family):
        sys.exit(f"--layers {layers}: {a.family} needs at least {min_layers(a.family)}")
    cfg = scaled_config(a.family, hidden, layers, vocab, ids)
    tensors = hub_tensors(a.family, meta_model(cfg))
    print(describe(a.family, cfg, tensors))
    if a.print_only:
        shutil.rmtree(a.out)
        return
    for f in tmp_tok.iterdir():
        f.rename(a.out / f.name)
    tmp_tok.rmdir()
    (a.out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    total = write_shards(a.out, tensors, a.seed, int(a.shard_gb * 1e9))
    print(f"wrote {a.out}: {total / 1e9:.2f} GB BF16")


if __name__ == "__main__":
    main()
