#!/usr/bin/env python3
"""RoPE goldens for `runtime::layers::rope` from transformers' own code.

For each case below (the RoPE of a published config: plain, linear, dynamic NTK, YaRN
as DeepSeek-V3, gpt-oss and Qwen3 ship it, llama3, partial rotary as GLM-4.5 and
Qwen3-Next ship it) the script builds the family's transformers config from the
config.json values and records
- `inv_freq`: `ROPE_INIT_FUNCTIONS[rope_type](config, seq_len=...)` (the model's
  `compute_default_rope_parameters` for plain RoPE), checked equal to the buffer of
  the family's RotaryEmbedding module;
- `attention_factor`: the factor that module puts on cos/sin;
- `softmax_scale`: for DeepSeek-V3, `yarn_apply_mscale(rope_parameters, 1/sqrt(qk_head_dim))`,
  the scale its attention uses;
- for some cases, `apply`: random q rotated at a few positions by the family's
  RotaryEmbedding forward and `apply_rotary_pos_emb` (DeepSeek-V3's interleaved
  variant's output re-interleaved, see rope.rs), all in float32.
The `axes` of a case are the config.json values a manifest carries; the Rust test
(`cargo test -p gturbo-runtime --lib -- rope`) reads them with `RopeSpec::from_axes`
and compares. Dynamic NTK is recorded twice: with an int `seq_len` (Python-float base)
and through the module's forward (tensor `seq_len`, float32 base), as transformers
runs it.

Environment (CI only reads the committed tests/data/rope_golden.json): a virtual
environment with the pins of scripts/requirements/requirements-golden.txt
(torch 2.15.0, transformers 5.24.0, numpy; CPU is enough):
    python3 -m venv target/venv-golden
    target/venv-golden/bin/pip install -r scripts/requirements/requirements-golden.txt
    target/venv-golden/bin/python scripts/golden/gen_rope_golden.py

Usage: gen_rope_golden.py [--out tests/data/rope_golden.json]
"""

import argparse
import json
import math
from pathlib import Path

import torch
import transformers
from transformers import (
    DeepseekV3Config,
    Glm4MoeConfig,
    GptOssConfig,
    LlamaConfig,
    Qwen3Config,
    Qwen3NextConfig,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds
from transformers.models.glm4_moe import modeling_glm4_moe as glm
from transformers.models.gpt_oss import modeling_gpt_oss as oss
from transformers.models.llama import modeling_llama as llama
from transformers.models.qwen3 import modeling_qwen3 as qwen3
from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

# Positions at which `apply` cases rotate (first, second, past 4096, far out).
APPLY_POSITIONS = [0, 1, 4096, 100_000]
APPLY_HEADS = 1
SEED = 24

# name -> (config class, config.json values, rotary module, apply fn, rotated head width,
#          seq_len for ROPE_INIT_FUNCTIONS, whether to record `apply`)
CASES = {
    "default_smollm2": (
        LlamaConfig,
        dict(hidden_size=576, num_attention_heads=9, head_dim=64, rope_theta=10000.0,
             max_position_embeddings=8192),
        llama.LlamaRotaryEmbedding, llama.apply_rotary_pos_emb, 64, None, True,
    ),
    "default_qwen3": (
        Qwen3Config,
        dict(hidden_size=1024, num_attention_heads=16, head_dim=128, rope_theta=1000000.0,
             max_position_embeddings=40960),
        qwen3.Qwen3RotaryEmbedding, qwen3.apply_rotary_pos_emb, 128, None, False,
    ),
    "linear_4": (
        LlamaConfig,
        dict(hidden_size=4096, num_attention_heads=32, head_dim=128, rope_theta=10000.0,
             max_position_embeddings=16384,
             rope_scaling={"rope_type": "linear", "factor": 4.0}),
        llama.LlamaRotaryEmbedding, llama.apply_rotary_pos_emb, 128, None, False,
    ),
    "dynamic_2": (
        LlamaConfig,
        dict(hidden_size=4096, num_attention_heads=32, head_dim=128, rope_theta=10000.0,
             max_position_embeddings=4096,
             rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
        llama.LlamaRotaryEmbedding, llama.apply_rotary_pos_emb, 128, 10000, False,
    ),
    "yarn_deepseek_v3": (
        DeepseekV3Config,
        dict(hidden_size=7168, num_attention_heads=128, qk_rope_head_dim=64,
             qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=163840,
             rope_theta=10000,
             rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                           "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                           "type": "yarn"}),
        ds.DeepseekV3RotaryEmbedding, ds.apply_rotary_pos_emb_interleave, 64, None, True,
    ),
    # Not a published config: mscale ≠ mscale_all_dim, so the attention factor is a
    # ratio other than 1 and the softmax correction differs from it.
    "yarn_mscale_ratio": (
        DeepseekV3Config,
        dict(hidden_size=7168, num_attention_heads=128, qk_rope_head_dim=64,
             qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=163840,
             rope_theta=10000,
             rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                           "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                           "rope_type": "yarn"}),
        ds.DeepseekV3RotaryEmbedding, ds.apply_rotary_pos_emb_interleave, 64, None, False,
    ),
    "yarn_gpt_oss": (
        GptOssConfig,
        dict(hidden_size=2880, num_attention_heads=64, head_dim=64, rope_theta=150000,
             max_position_embeddings=131072,
             rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                           "original_max_position_embeddings": 4096, "rope_type": "yarn",
                           "truncate": False}),
        oss.GptOssRotaryEmbedding, oss.apply_rotary_pos_emb, 64, None, True,
    ),
    # Qwen3's documented YaRN setting: factor 4 over 32768 while max_position_embeddings
    # is 40960 (transformers 4.5x took max/original = 1.25 as the factor here).
    "yarn_qwen3": (
        Qwen3Config,
        dict(hidden_size=1024, num_attention_heads=16, head_dim=128, rope_theta=1000000.0,
             max_position_embeddings=40960,
             rope_scaling={"rope_type": "yarn", "factor": 4.0,
                           "original_max_position_embeddings": 32768}),
        qwen3.Qwen3RotaryEmbedding, qwen3.apply_rotary_pos_emb, 128, None, False,
    ),
    "llama3_8": (
        LlamaConfig,
        dict(hidden_size=4096, num_attention_heads=32, head_dim=128, rope_theta=500000.0,
             max_position_embeddings=131072,
             rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
        llama.LlamaRotaryEmbedding, llama.apply_rotary_pos_emb, 128, None, True,
    ),
    "partial_half_glm45": (
        Glm4MoeConfig,
        dict(hidden_size=5120, num_attention_heads=96, head_dim=128, partial_rotary_factor=0.5,
             rope_theta=1000000, max_position_embeddings=131072),
        glm.Glm4MoeRotaryEmbedding, glm.apply_rotary_pos_emb, 128, None, True,
    ),
    "partial_quarter_qwen3_next": (
        Qwen3NextConfig,
        dict(hidden_size=2048, num_attention_heads=16, head_dim=256, partial_rotary_factor=0.25,
             rope_theta=10000000, max_position_embeddings=262144),
        qwen3_next.Qwen3NextRotaryEmbedding, qwen3_next.apply_rotary_pos_emb, 256, None, False,
    ),
}

# The config.json keys a manifest's axes carry for RoPE.
AXES = ["rope_theta", "head_dim", "partial_rotary_factor", "max_position_embeddings",
        "rope_scaling", "original_max_position_embeddings"]


def floats(t):
    """Exact: each f32 as the shortest decimal of its f64 value."""
    return [float(v) for v in t.reshape(-1).tolist()]


def short(t):
    """Each f32 as its shortest f32 decimal (the `apply` values, compared with a
    tolerance): a third of the bytes."""
    return [float(str(v)) for v in t.reshape(-1).numpy()]


def apply_case(module, apply_fn, head_dim, interleaved):
    g = torch.Generator().manual_seed(SEED)
    t = len(APPLY_POSITIONS)
    q = torch.randn(1, APPLY_HEADS, t, head_dim, generator=g, dtype=torch.float32)
    pos = torch.tensor([APPLY_POSITIONS])
    cos, sin = module(q, pos)
    out, _ = apply_fn(q, q.clone(), cos, sin)
    if interleaved:
        # apply_rotary_pos_emb_interleave writes evens then odds; put the pairs back.
        half = head_dim // 2
        back = torch.empty_like(out)
        back[..., 0::2] = out[..., :half]
        back[..., 1::2] = out[..., half:]
        out = back
    # [1, heads, tokens, d] -> [tokens, heads, d], as the Rust side lays tokens out.
    return {
        "heads": APPLY_HEADS,
        "positions": APPLY_POSITIONS,
        "x": short(q[0].transpose(0, 1)),
        "out": short(out[0].transpose(0, 1)),
    }


def main():
    ap = argparse.ArgumentParser()
    root = Path(__file__).resolve().parents[2]
    ap.add_argument("--out", type=Path, default=root / "tests/data/rope_golden.json")
    args = ap.parse_args()
    torch.set_num_threads(1)

    cases = []
    for name, (cls, values, rotary, apply_fn, head_dim, seq_len, with_apply) in CASES.items():
        config = cls(**values)
        rope_type = config.rope_parameters["rope_type"]
        module = rotary(config)
        if rope_type == "default":
            inv_freq, factor = rotary.compute_default_rope_parameters(config)
        else:
            inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)
        if seq_len is None:
            assert torch.equal(inv_freq, module.inv_freq), name
            assert factor == module.attention_scaling, name
        case = {
            "name": name,
            "rope_type": rope_type,
            "head_dim": head_dim,
            "axes": {k: values[k] for k in AXES if k in values},
            "seq_len": seq_len or 0,
            "inv_freq": floats(inv_freq),
            "attention_factor": float(factor),
        }
        if cls is DeepseekV3Config:
            case["axes"]["rope_interleave"] = config.rope_interleave
            qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
            case["softmax_scale_base"] = qk_head_dim ** -0.5
            case["softmax_scale"] = ds.yarn_apply_mscale(
                config.rope_parameters, qk_head_dim ** -0.5
            )
        if with_apply:
            case["apply"] = apply_case(
                module, apply_fn, head_dim, cls is DeepseekV3Config and config.rope_interleave
            )
        cases.append(case)
        if rope_type == "dynamic":
            # The forward path: the wrapper recomputes with a tensor seq_len.
            x = torch.zeros(1, 1, seq_len, head_dim)
            module(x, torch.arange(seq_len)[None])
            tensor_case = dict(case, name=name + "_forward", inv_freq=floats(module.inv_freq))
            diff = (module.inv_freq - inv_freq).abs() / inv_freq.abs()
            print(f"{name}: forward (tensor seq_len) vs int seq_len: max rel {diff.max().item():.3g}")
            cases.append(tensor_case)

    out = {
        "generator": "scripts/golden/gen_rope_golden.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "cases": cases,
    }
    # One case per line: small, and a diff names the case that changed.
    body = ",\n".join(json.dumps(c) for c in cases)
    meta = json.dumps({k: v for k, v in out.items() if k != "cases"})[:-1]
    args.out.write_text(f'{meta}, "cases": [\n{body}\n]}}\n')
    print(f"wrote {args.out} ({len(cases)} cases, transformers {transformers.__version__})")


if __name__ == "__main__":
    main()
