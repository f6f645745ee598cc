#!/usr/bin/env python3
"""DeepSeek-V3 (`DeepseekV3ForCausalLM`) toy checkpoint and transformers goldens.

Run it in the goldens' virtual environment (target/venv-golden: torch, transformers
5.24.0, safetensors, numpy):

    scripts/golden/golden_venv.sh scripts/golden/gen_deepseek_golden.py           # regenerate
    scripts/golden/golden_venv.sh scripts/golden/gen_deepseek_golden.py --check   # compare

CI never runs this script: it checks the committed outputs under
tests/data/deepseek_toy/.

The toy (every matrix's input dim a multiple of 64, for INT4 groups of 64), every
feature of the architecture on
-------------------------------------------------------------------------------------
hidden 128 · 3 layers, the first dense (`first_k_dense_replace` 1, intermediate 128) ·
multi-head latent attention: 4 heads, q LoRA (`q_lora_rank` 64, `q_a_layernorm`),
`kv_lora_rank` 64, `qk_nope_head_dim` 32, `qk_rope_head_dim` 16, `v_head_dim` 32 (≠ the
qk head's 48) · RoPE θ 10000, interleaved (`rope_interleave`), YaRN (factor 4 over 64
original positions, beta 32/1, `mscale` 1.0 ≠ `mscale_all_dim` 0.8, so cos/sin carry an
attention factor ≠ 1 and the softmax scale its own mscale²) · MoE: 8 routed experts ×
64, top-2 of sigmoid scores plus `e_score_correction_bias` (random, F32 on disk), 4
groups of 2 with 2 kept (`n_group`, `topk_group`), renormalised, × 2.5
(`routed_scaling_factor`), one ungated shared expert (`n_shared_experts` 1) · RMSNorm
eps 1e-6 · vocab 512, untied lm_head. No MTP layer: transformers' model has none to
save (`num_nextn_predict_layers` 0 here).

Weights are drawn with numpy from a seed per tensor name (sha256 of "seed:name"),
rounded to BF16 (the correction bias stays F32, as in the real checkpoints) and written
in the real hub layout: per-expert `mlp.experts.{e}.{gate,up,down}_proj`, HF-style
shards `model-0000i-of-00002.safetensors` with `model.safetensors.index.json`.
transformers 5.x fuses the experts on load; the script checks that every tensor on disk
arrives, unchanged, and that nothing is missing.

The tokenizer is the Mixtral toy's (tests/data/mixtral_toy: a Llama-shaped BPE, vocab
512, `<s>` 1, `</s>` 2), copied; the Kimi toy (`--store ct-int4`) has Kimi's tiktoken
files instead.

`--store fp8` writes tests/data/deepseek_fp8_toy/ and `--store ct-int4`
tests/data/kimi_int4_toy/: the same kind of random model saved as the real repos store
it (FP8 e4m3 with 128×128 block scales as DeepSeek-V3; a Kimi-K2-shaped model with
compressed-tensors INT4 routed experts as Kimi-K2-Thinking; see FP8 and KIMI below).
Their goldens are transformers' logits of the dequantized weights, which the install
reproduces exactly (`--quant bf16`).

Goldens (tests/data/deepseek_toy/golden/), from the reference reloaded with
`from_pretrained`, upcast to float32 (exact: the weights are BF16 on disk), eager
attention and experts, one CPU thread:
meta.json          versions, config summary, seed, `prompt` (text and ids, with BOS),
                   `greedy` (GREEDY_STEPS ids), `gaps`, router margins, file list.
prompt.safetensors the prompt's logits [T, V], and per MoE layer the router's
                   `layers.{i}.moe.topk_idx` I64 [T, 2] / `topk_w` [T, 2].
greedy.safetensors tokens I64 [S]; step_logits [S, V] (full recompute per step, no
                   cache).

`--wide` writes tests/data/deepseek_toy_wide/: the main toy's options on 2 layers with
DeepSeek-V3's latent widths (`kv_lora_rank` 512, `qk_rope_head_dim` 64: latent keys of
576, the GPU attention kernel's widest case).

`--variant` writes tests/data/deepseek_toy_variant/ instead: the other branch of every
option (VARIANT): a plain `q_proj` (`q_lora_rank` null), no group limit (`n_group` =
`topk_group` = 1, as Kimi-K2 and GLM), `norm_topk_prob` false, two shared experts, no
dense layer, the half-split rope layout (`rope_interleave` false) without scaling, 2
layers.

Random tiny models can have near ties: the script refuses (exit 1) goldens whose
smallest greedy gap is under MIN_GAP, or whose routing (group choice or top-k, on the
biased sigmoid keys) has a near tie anywhere in the greedy sequence
(MIN_ROUTER_MARGIN); SEED was picked so that neither happens.
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
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

SEED = 4  # seeds 1-3 fail the gap checks (router margins 4e-4..1e-3); 4 passes
H = 128
LAYERS = 3
DENSE = 1  # first_k_dense_replace
HEADS = 4
Q_LORA = 64
KV_LORA = 64
NOPE = 32
ROPE_D = 16
V_D = 32
QK = NOPE + ROPE_D
INTER = 128
MOE_INTER = 64
EXPERTS = 8
TOP_K = 2
N_GROUP = 4
TOPK_GROUP = 2
SCALING = 2.5
VOCAB = 512
BOS, EOS = 1, 2
SHARDS = 2
GREEDY_STEPS = 24
MIN_GAP = 1e-2
MIN_ROUTER_MARGIN = 1e-3
PROMPT_TEXT = "A café for the quick brown fox."
MIXTRAL_TOY = Path(__file__).resolve().parents[2] / "tests/data/mixtral_toy"
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
NORM_TOPK = True
SHARED = 1
ROPE_INTERLEAVE = True
ROPE_SCALING = {"beta_fast": 32, "beta_slow": 1, "factor": 4.0, "mscale": 1.0,
                "mscale_all_dim": 0.8, "original_max_position_embeddings": 64, "type": "yarn"}


# The variant's settings (`--variant`) and its seed.
VARIANT = {"LAYERS": 2, "DENSE": 0, "Q_LORA": None, "N_GROUP": 1, "TOPK_GROUP": 1,
           "NORM_TOPK": False, "SHARED": 2, "ROPE_INTERLEAVE": False, "ROPE_SCALING": None}
VARIANT_SEED = 3  # seeds 1 and 2 fail the gap checks

# The wide toy's settings (`--wide`): DeepSeek-V3's own latent widths, kv_lora_rank 512
# and qk_rope_head_dim 64, so the latent cache's keys are 576 wide (past the 256 a GPU
# attention kernel used to hold), on 2 layers; every other option as the main toy.
WIDE = {"LAYERS": 2, "KV_LORA": 512, "ROPE_D": 64, "QK": NOPE + 64}
WIDE_SEED = 1
MODE = "main"

# `--store fp8`: the main toy stored as DeepSeek-V3's hub checkpoint stores it: every
# linear weight of the decoder layers FP8 e4m3 with an F32 `weight_scale_inv` per 128×128
# block (`quantization_config` as V3's config.json has it); the router, the norms, the
# correction bias, the embeddings and lm_head stay as they are. The dense intermediate is
# 192, so some matrices have a full and a partial 128-block along each dim.
FP8 = {"INTER": 192}
FP8_SEED = 4
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
              "weight_block_size": [128, 128]}
FP8_BLOCK = 128
FP8_LINEAR = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
              "gate_proj", "up_proj", "down_proj")
# `--store ct-int4`: a Kimi-K2-shaped toy (`model_type: kimi_k2`, one expert group, YaRN
# with beta 1/1 and mscale = mscale_all_dim = 1, routed_scaling_factor 2.827, 16 experts
# with 4 per token) whose routed experts are compressed-tensors INT4 as
# Kimi-K2-Thinking ships them: `weight_packed` I32 [rows, cols/8] (column 8k + i at bits
# 4i of word k, as q + 8), `weight_scale` BF16 [rows, cols/32] (amax / 7, symmetric),
# `weight_shape` I32 [2]; every other weight BF16. Its tokenizer is Kimi's: the first
# 512 ranks of tests/data/kimi_tiktoken/tiktoken.model, 256 special tokens after them.
KIMI = {"LAYERS": 3, "DENSE": 1, "EXPERTS": 16, "TOP_K": 4, "N_GROUP": 1, "TOPK_GROUP": 1,
        "SCALING": 2.827, "VOCAB": 768, "BOS": 512, "EOS": 513,
        "ROPE_SCALING": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 64,
                         "type": "yarn"}}
KIMI_SEED = 4  # seed 1 passes with a smaller gap; 2, 3 and 5-14 fail the checks
KIMI_RANKS = 512
CT_GROUP = 32
CT_CONFIG = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                    "group_size": CT_GROUP, "num_bits": 4, "observer": "minmax",
                    "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                    "type": "int"}}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*mlp\\.gate$"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}
KIMI_TIKTOKEN = Path(__file__).resolve().parents[2] / "tests/data/kimi_tiktoken"
STORE = None


def config() -> dict:
    """config.json as DeepSeek-V3's hub checkpoint writes it (its fields, toy sizes)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "first_k_dense_replace": DENSE,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": INTER,
        "kv_lora_rank": KV_LORA,
        "max_position_embeddings": 256,
        "model_type": "deepseek_v3",
        "moe_intermediate_size": MOE_INTER,
        "moe_layer_freq": 1,
        "n_group": N_GROUP,
        "n_routed_experts": EXPERTS,
        "n_shared_experts": SHARED,
        "norm_topk_prob": NORM_TOPK,
        "num_attention_heads": HEADS,
        "num_experts_per_tok": TOP_K,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": HEADS,
        "num_nextn_predict_layers": 0,
        "q_lora_rank": Q_LORA,
        "qk_nope_head_dim": NOPE,
        "qk_rope_head_dim": ROPE_D,
        "rms_norm_eps": 1e-6,
        "rope_interleave": ROPE_INTERLEAVE,
        "rope_scaling": ROPE_SCALING,
        "rope_theta": 10000,
        "routed_scaling_factor": SCALING,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": TOPK_GROUP,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "5.24.0",
        "use_cache": True,
        "v_head_dim": V_D,
        "vocab_size": VOCAB,
    }


def hub_tensors() -> list:
    """Every tensor of the checkpoint, by hub name and shape, layer by layer."""
    out: list = [("model.embed_tokens.weight", (VOCAB, H))]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out.append((p + "input_layernorm.weight", (H,)))
        if Q_LORA is None:
            out.append((a + "q_proj.weight", (HEADS * QK, H)))
        else:
            out += [(a + "q_a_proj.weight", (Q_LORA, H)), (a + "q_a_layernorm.weight", (Q_LORA,)),
                    (a + "q_b_proj.weight", (HEADS * QK, Q_LORA))]
        out += [
            (a + "kv_a_proj_with_mqa.weight", (KV_LORA + ROPE_D, H)),
            (a + "kv_a_layernorm.weight", (KV_LORA,)),
            (a + "kv_b_proj.weight", (HEADS * (NOPE + V_D), KV_LORA)),
            (a + "o_proj.weight", (H, HEADS * V_D)),
        ]
        m = p + "mlp."
        if i < DENSE:
            out += [(m + "gate_proj.weight", (INTER, H)), (m + "up_proj.weight", (INTER, H)),
                    (m + "down_proj.weight", (H, INTER))]
        else:
            out += [(m + "gate.weight", (EXPERTS, H)),
                    (m + "gate.e_score_correction_bias", (EXPERTS,))]
            for e in range(EXPERTS):
                q = f"{m}experts.{e}."
                out += [(q + "gate_proj.weight", (MOE_INTER, H)),
                        (q + "up_proj.weight", (MOE_INTER, H)),
                        (q + "down_proj.weight", (H, MOE_INTER))]
            q = m + "shared_experts."
            si = MOE_INTER * SHARED
            out += [(q + "gate_proj.weight", (si, H)), (q + "up_proj.weight", (si, H)),
                    (q + "down_proj.weight", (H, si))]
        out.append((p + "post_attention_layernorm.weight", (H,)))
    out += [("model.norm.weight", (H,)), ("lm_head.weight", (VOCAB, H))]
    return out


def rng_for(seed: int, name: str) -> np.random.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def init_value(seed: int, name: str, shape) -> np.ndarray:
    """Unit-variance activations through every block (as the Mixtral toy's)."""
    z = rng_for(seed, name).standard_normal(shape)
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * z).astype(np.float32)
    if name.endswith("e_score_correction_bias"):
        return (0.1 * z).astype(np.float32)
    if name.endswith("embed_tokens.weight"):
        std = 1.0
    elif name.endswith(("o_proj.weight", "gate.weight")):
        std = 2.0 / math.sqrt(shape[1])
    elif name.endswith("lm_head.weight"):
        std = 4.0 / math.sqrt(shape[1])
    else:
        std = 1.0 / math.sqrt(shape[1])
    return (std * z).astype(np.float32)


def build_tensors(seed: int) -> list:
    out = []
    for name, shape in hub_tensors():
        t = torch.from_numpy(init_value(seed, name, shape))
        # The correction bias is F32 in the real checkpoints (kept so by transformers).
        out.append((name, t if name.endswith("e_score_correction_bias") else t.to(torch.bfloat16)))
    return out


def write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def write_checkpoint(out_dir: Path, tensors: list) -> dict:
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    budget = math.ceil(total / SHARDS)
    groups: list = [[]]
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > budget and len(groups) < SHARDS:
            groups.append([])
            size = 0
        groups[-1].append((name, t))
        size += nbytes
    if len(groups) != SHARDS:
        raise SystemExit(f"wrote {len(groups)} shards, wanted {SHARDS}")
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in group}, str(out_dir / fname),
                  metadata={"format": "pt"})
        for k, _ in group:
            weight_map[k] = fname
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(out_dir / "model.safetensors.index.json", index)
    return {"shards": SHARDS, "total_size": total, "tensors": len(tensors)}


def check_loaded(model, saved: dict) -> None:
    """Every hub tensor arrives unchanged where transformers' conversion puts it (the
    experts fused into `gate_up_proj` [E, 2I, H] gate first, and `down_proj`), and
    nothing in the model's state dict is left unfilled."""
    sd = model.state_dict()
    used = set()
    for name, value in saved.items():
        if ".mlp.experts." in name:
            head, rest = name.split(".mlp.experts.")
            e, w = rest.split(".")[:2]
            e = int(e)
            if w == "down_proj":
                loaded, got = f"{head}.mlp.experts.down_proj", None
                got = sd[loaded][e]
            else:
                loaded = f"{head}.mlp.experts.gate_up_proj"
                half = slice(0, MOE_INTER) if w == "gate_proj" else slice(MOE_INTER, 2 * MOE_INTER)
                got = sd[loaded][e, half]
        else:
            loaded, got = name, sd[name]
        if not torch.equal(got, value.to(got.dtype)):
            raise SystemExit(f"transformers loaded {name} differently into {loaded}")
        used.add(loaded)
    extra = sorted(set(sd) - used)
    if extra:
        raise SystemExit(f"the model has tensors no hub name filled: {extra}")


class Recorder:
    """The routers' choices of the last forward pass (batch 1)."""

    def __init__(self, model):
        self.data: dict = {}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            if i >= DENSE:
                self.hook_router(layer.mlp.gate, f"layers.{i}.moe.")

    def hook_router(self, gate, prefix):
        def fn(m, args, out):
            logits, weights, idx = out
            # transformers' topk(sorted=False) order is unspecified: sort by weight.
            w, order = weights.detach().float().sort(dim=-1, descending=True, stable=True)
            self.data[prefix + "router_logits"] = logits.detach().float().clone()
            self.data[prefix + "topk_w"] = w.clone()
            self.data[prefix + "topk_idx"] = idx.gather(1, order).to(torch.int64).clone()

        self.handles.append(gate.register_forward_hook(fn))

    def close(self):
        for h in self.handles:
            h.remove()


def forward(model, rec: Recorder, ids: list) -> dict:
    rec.data = {}
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=False)
    data = dict(rec.data)
    data["logits"] = out.logits[0].float().clone()
    return data


def router_margins(data: dict, biases: dict) -> list:
    """Per MoE layer: the smallest gap over all positions between the last kept and the
    first dropped group score, and between the k-th and (k+1)-th biased key among the
    kept groups (how far the choice is from flipping)."""
    out = []
    for i in range(DENSE, LAYERS):
        s = data[f"layers.{i}.moe.router_logits"].sigmoid() + biases[i]
        g = s.view(-1, N_GROUP, EXPERTS // N_GROUP).topk(2, dim=-1).values.sum(-1)
        gs = g.sort(dim=-1, descending=True).values
        group_gap = (float((gs[:, TOPK_GROUP - 1] - gs[:, TOPK_GROUP]).min())
                     if TOPK_GROUP < N_GROUP else math.inf)
        keep = g.topk(TOPK_GROUP, dim=-1).indices
        mask = torch.zeros_like(g).scatter_(1, keep, 1).bool()
        mask = mask.unsqueeze(-1).expand(-1, N_GROUP, EXPERTS // N_GROUP).reshape(-1, EXPERTS)
        keys = s.masked_fill(~mask, float("-inf")).sort(dim=-1, descending=True).values
        top_gap = float((keys[:, TOP_K - 1] - keys[:, TOP_K]).min())
        out.append(min(group_gap, top_gap))
    return out


def greedy(model, prompt: list, steps: int, rec):
    seq = list(prompt)
    tokens, gaps, step_logits = [], [], []
    data = {}
    for _ in range(steps):
        data = forward(model, rec, seq)
        last = data["logits"][-1]
        top = last.topk(2)
        tokens.append(int(top.indices[0]))
        gaps.append(float(top.values[0] - top.values[1]))
        step_logits.append(last.clone())
        seq.append(tokens[-1])
    return tokens, gaps, torch.stack(step_logits), data


def save_tensors(path: Path, tensors: dict) -> None:
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(path),
              metadata={"format": "pt"})


def fp8_store(name: str, w: torch.Tensor):
    """DeepSeek-V3's FP8 block scaling of one BF16 weight: per 128×128 block the scale is
    amax / 448 (F32, `weight_scale_inv`: what multiplies the codes back) and the codes
    e4m3 of w / scale; returns the stored pair and the dequantized weight the install
    makes, bf16(f32(code) × scale) (MLX-LM's `sanitize`)."""
    r, c = w.shape
    nb_r, nb_c = -(-r // FP8_BLOCK), -(-c // FP8_BLOCK)
    wf = w.float()
    scale = torch.zeros(nb_r, nb_c, dtype=torch.float32)
    for i in range(nb_r):
        for j in range(nb_c):
            blk = wf[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK]
            amax = float(blk.abs().max())
            scale[i, j] = amax / 448.0 if amax > 0 else 1.0
    full = scale.repeat_interleave(FP8_BLOCK, 0)[:r].repeat_interleave(FP8_BLOCK, 1)[:, :c]
    codes = (wf / full).to(torch.float8_e4m3fn)
    deq = (codes.float() * full).to(torch.bfloat16)
    return [(name, codes), (name + "_scale_inv", scale)], deq


def ct_store(name: str, w: torch.Tensor):
    """compressed-tensors `pack-quantized` INT4 of one BF16 weight (symmetric, group 32):
    scale bf16(amax / 7) to 5 significant bits, q = clamp(round(w / scale), −8, 7), stored
    as q + 8 eight to an int32; returns the stored triple and the dequantized weight
    (q × scale, exact in BF16)."""
    r, c = w.shape
    g = w.float().view(r, c // CT_GROUP, CT_GROUP)
    amax = g.abs().amax(-1)
    scale = torch.where(amax > 0, amax / 7.0, torch.ones_like(amax)).to(torch.bfloat16)
    # Scales rounded to 5 significant bits: q × scale (q of at most 3) then fits BF16's
    # 8, so `--quant bf16`'s bf16(q × scale) is the reference's weight exactly.
    bits = scale.view(torch.int16).to(torch.int32)
    scale = ((bits + 4) & ~7).to(torch.int16).view(torch.bfloat16)
    q = (g / scale.float().unsqueeze(-1)).round().clamp(-8, 7)
    deq = (q * scale.float().unsqueeze(-1)).view(r, c)
    if not torch.equal(deq.to(torch.bfloat16).float(), deq):
        raise SystemExit(f"{name}: q × scale is not exact in BF16")
    deq = deq.to(torch.bfloat16)
    u = (q + 8).to(torch.int64).view(r, c // 8, 8)
    words = sum(u[..., i] << (4 * i) for i in range(8))
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    base = name[: -len(".weight")]
    return [(base + ".weight_packed", words), (base + ".weight_scale", scale),
            (base + ".weight_shape", torch.tensor([r, c], dtype=torch.int32))], deq


def stored_layout(tensors: list):
    """The hub tensors as STORE keeps them, and the dequantized weights the reference
    runs (what the install reproduces)."""
    stored, reference = [], []
    for name, t in tensors:
        parts = name.split(".")
        if STORE == "fp8" and name.startswith("model.layers.") and parts[-2] in FP8_LINEAR:
            st, deq = fp8_store(name, t)
        elif STORE == "ct-int4" and ".mlp.experts." in name:
            st, deq = ct_store(name, t)
        else:
            st, deq = [(name, t)], t
        stored += st
        reference.append((name, deq))
    return stored, reference


def tiktoken_files(out: Path) -> None:
    """Kimi's tokenizer files for the Kimi toy: the first KIMI_RANKS ranks of the
    tokenizer golden's file (a BPE in their own right: every merge's halves rank
    lower), its tokenizer_config.json with the special ids moved to follow them."""
    lines = (KIMI_TIKTOKEN / "tiktoken.model").read_text().splitlines(keepends=True)
    (out / "tiktoken.model").write_text("".join(lines[:KIMI_RANKS]))
    cfg = json.loads((KIMI_TIKTOKEN / "tokenizer_config.json").read_text())
    first = min(int(k) for k in cfg["added_tokens_decoder"])
    cfg["added_tokens_decoder"] = {str(int(k) - first + KIMI_RANKS): v
                                   for k, v in cfg["added_tokens_decoder"].items()}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    write_json(out / "generation_config.json", {"bos_token_id": BOS, "eos_token_id": EOS})


class TiktokenToy:
    """tiktoken's encoding, written out (its `_byte_pair_merge`: merge the adjacent pair
    whose bytes have the lowest rank, leftmost first) with Kimi's pat_str, for the
    prompt of the Kimi toy (the goldens' venv has no tiktoken; the tokenizer golden
    checks the converted tokenizer against tiktoken itself)."""

    def __init__(self, out: Path):
        import base64
        import regex
        # The family's pattern: tokenization_kimi.py's pat_str (the tokenizer golden's
        # test checks the two are equal).
        family = Path(__file__).resolve().parents[2] / "families/deepseek_v3.json"
        pat_str = json.loads(family.read_text())["tiktoken"]["pattern"]
        self.ranks = {}
        for line in (out / "tiktoken.model").read_text().splitlines():
            b64, r = line.split()
            self.ranks[base64.b64decode(b64)] = int(r)
        self.by_id = {r: t for t, r in self.ranks.items()}
        self.pat = regex.compile(pat_str, flags=regex.V1)  # V1: `&&` is set intersection

    def encode(self, text: str) -> list:
        ids = []
        for piece in self.pat.findall(text):
            parts = [bytes([b]) for b in piece.encode()]
            while len(parts) > 1:
                best = min(range(len(parts) - 1),
                           key=lambda i: self.ranks.get(parts[i] + parts[i + 1], math.inf))
                if parts[best] + parts[best + 1] not in self.ranks:
                    break
                parts[best:best + 2] = [parts[best] + parts[best + 1]]
            ids += [self.ranks[p] for p in parts]
        return ids

    def decode(self, ids, skip_special_tokens=False) -> str:
        return b"".join(self.by_id.get(i, b"") for i in ids).decode("utf-8", "replace")


def generate(out: Path, seed: int) -> dict:
    import tokenizers
    import transformers
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoTokenizer, DeepseekV3ForCausalLM

    transformers.utils.logging.disable_progress_bar()
    if out.exists():
        shutil.rmtree(out)
    golden = out / "golden"
    golden.mkdir(parents=True)

    write_json(out / "config.json", config())
    cfg = AutoConfig.from_pretrained(out)
    rp = cfg.rope_parameters
    want_type = "yarn" if ROPE_SCALING else "default"
    if rp.get("rope_type") != want_type or cfg.rope_interleave != ROPE_INTERLEAVE \
            or cfg.q_lora_rank != Q_LORA:
        raise SystemExit(f"config read back with rope {rp}, interleave {cfg.rope_interleave}, "
                         f"q_lora_rank {cfg.q_lora_rank}")
    stored, tensors = stored_layout(build_tensors(seed))
    ckpt = write_checkpoint(out, tensors)
    saved = dict(tensors)
    if STORE == "ct-int4":
        tiktoken_files(out)
        tok = TiktokenToy(out)
        prompt = tok.encode(PROMPT_TEXT)
    else:
        for f in TOKENIZER_FILES:
            shutil.copyfile(MIXTRAL_TOY / f, out / f)
        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
        prompt = tok.encode(PROMPT_TEXT).ids
        hf_tok = AutoTokenizer.from_pretrained(out)
        if hf_tok(PROMPT_TEXT).input_ids != prompt or prompt[0] != BOS:
            raise SystemExit(f"transformers encodes the prompt as {hf_tok(PROMPT_TEXT).input_ids}, not {prompt}")

    model, info = DeepseekV3ForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager",
        experts_implementation="eager", output_loading_info=True)
    model.eval()
    if any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")):
        raise SystemExit(f"reference load: {info}")
    check_loaded(model, saved)
    attn = model.model.layers[0].self_attn
    biases = {i: saved[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] for i in range(DENSE, LAYERS)}

    rec = Recorder(model)
    pdata = forward(model, rec, prompt)
    tokens, gaps, step_logits, gdata = greedy(model, prompt, GREEDY_STEPS, rec)
    rec.close()
    if not torch.equal(step_logits[0], pdata["logits"][-1]):
        raise SystemExit("the first greedy step differs from the prompt's last logits")
    margins = router_margins(gdata, biases)
    # The cached path of transformers (the latent cache, expanded per step) must give the
    # same tokens: a check of the reference itself.
    with torch.no_grad():
        cached = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY_STEPS,
                                do_sample=False, use_cache=True)[0, len(prompt):].tolist()
    min_gap = min(gaps)
    summary = {"seed": seed, "min_gap": min_gap, "min_router_margin": min(margins),
               "greedy": tokens, "cached_generate_agrees": cached == tokens}
    if min_gap < MIN_GAP or min(margins) < MIN_ROUTER_MARGIN or cached != tokens:
        print(json.dumps(summary), file=sys.stderr)
        raise SystemExit(f"seed {seed}: smallest greedy gap {min_gap:.3g} (need {MIN_GAP}) or "
                         f"router margin {min(margins):.3g} (need {MIN_ROUTER_MARGIN}), or the "
                         "cached generate differs: pick another seed")

    if STORE:
        # The hub layout replaces the reference's shards; the goldens stay those of the
        # dequantized weights.
        for f in out.glob("model-*.safetensors"):
            f.unlink()
        ckpt = write_checkpoint(out, stored)
        ckpt["store"] = STORE
        cfg_json = config()
        if STORE == "fp8":
            cfg_json["quantization_config"] = FP8_CONFIG
        else:
            cfg_json["model_type"] = "kimi_k2"
            cfg_json["quantization_config"] = CT_CONFIG
        write_json(out / "config.json", cfg_json)
    keep = {"logits": pdata["logits"]}
    for i in range(DENSE, LAYERS):
        for k in ("topk_idx", "topk_w"):
            keep[f"layers.{i}.moe.{k}"] = pdata[f"layers.{i}.moe.{k}"]
    save_tensors(golden / "prompt.safetensors", keep)
    save_tensors(golden / "greedy.safetensors",
                 {"tokens": torch.tensor(tokens, dtype=torch.int64), "step_logits": step_logits})
    meta = {
        "generator": "scripts/golden/gen_deepseek_golden.py",
        "family": "deepseek_v3",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__, "numpy": np.__version__,
                     "python": sys.version.split()[0]},
        "precision": "f32 compute from the BF16 checkpoint weights (exact upcast; the "
                     "correction bias F32 on disk); eager attention, eager experts; 1 thread; "
                     "greedy by full recompute, no cache",
        "seed": seed,
        "config": {"hidden": H, "layers": LAYERS, "first_k_dense_replace": DENSE,
                   "norm_topk_prob": NORM_TOPK, "n_shared_experts": SHARED,
                   "heads": HEADS, "q_lora_rank": Q_LORA, "kv_lora_rank": KV_LORA,
                   "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE_D, "v_head_dim": V_D,
                   "intermediate": INTER, "moe_intermediate": MOE_INTER, "experts": EXPERTS,
                   "top_k": TOP_K, "n_group": N_GROUP, "topk_group": TOPK_GROUP,
                   "routed_scaling_factor": SCALING, "vocab": VOCAB,
                   "rope_scaling": ROPE_SCALING, "rope_interleave": ROPE_INTERLEAVE,
                   "softmax_scale": attn.scaling, "bos": BOS, "eos": EOS},
        "checkpoint": ckpt,
        "prompt_text": PROMPT_TEXT,
        "prompt": prompt,
        "greedy": tokens,
        "greedy_text": tok.decode(tokens, skip_special_tokens=False),
        "gaps": gaps,
        "min_gap": min_gap,
        "min_gap_required": MIN_GAP,
        "router_min_margin_per_moe_layer": margins,
        "router_margin_required": MIN_ROUTER_MARGIN,
        "cached_generate_agrees": True,
    }
    meta["files"] = sorted([str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()]
                           + ["golden/meta.json"])
    write_json(golden / "meta.json", meta)
    for p in out.rglob("*"):
        if p.is_file():
            p.chmod(0o644)
    return summary


CHECK_F32_TOL = 1e-4


def check(out: Path, seed: int) -> None:
    """Regenerate into a temporary directory and compare with `out`: byte for byte but
    for the goldens' f32 values (within CHECK_F32_TOL) and meta.json's floats."""
    import subprocess
    import tempfile

    from safetensors.torch import load_file

    def close_json(a, b, path=""):
        if isinstance(a, float) and isinstance(b, float):
            return [] if abs(a - b) <= CHECK_F32_TOL else [f"{path}: {a} vs {b}"]
        if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
            return [d for k in a for d in close_json(a[k], b[k], f"{path}.{k}")]
        if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            return [d for i, (x, y) in enumerate(zip(a, b)) for d in close_json(x, y, f"{path}[{i}]")]
        return [] if a == b else [f"{path}: {a!r} vs {b!r}"]

    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "toy"
        variant = {"main": [], "variant": ["--variant"], "wide": ["--wide"]}.get(MODE, [])
        variant += ["--store", STORE] if STORE else []
        subprocess.run([sys.executable, __file__, "--out", str(fresh), "--seed", str(seed)]
                       + variant, check=True, stdout=subprocess.DEVNULL)
        old = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
        new = sorted(str(p.relative_to(fresh)) for p in fresh.rglob("*") if p.is_file())
        bad = [f"{f}: only in one of the two" for f in sorted(set(old) ^ set(new))]
        for f in (f for f in new if f in old):
            a, b = (out / f).read_bytes(), (fresh / f).read_bytes()
            if a == b:
                continue
            if f.endswith(".safetensors") and f.startswith("golden/"):
                ta, tb = load_file(str(out / f)), load_file(str(fresh / f))
                for k in ta:
                    x, y = ta[k], tb.get(k)
                    if y is None or x.shape != y.shape or x.dtype != y.dtype:
                        bad.append(f"{f}:{k}: shape or dtype differs")
                    elif x.is_floating_point():
                        if float((x - y).abs().max()) > CHECK_F32_TOL:
                            bad.append(f"{f}:{k}: differs")
                    elif not torch.equal(x, y):
                        bad.append(f"{f}:{k}: integers differ")
            elif f == "golden/meta.json":
                bad += [f"{f}{d}" for d in close_json(json.loads(a), json.loads(b))]
            else:
                bad.append(f"{f}: bytes differ")
        if bad:
            raise SystemExit("regenerated files differ:\n  " + "\n  ".join(bad))
        print(f"{len(new)} files regenerate")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--variant", action="store_true",
                    help="the other branch of every option (VARIANT), in deepseek_toy_variant")
    ap.add_argument("--wide", action="store_true",
                    help="DeepSeek-V3's latent widths (WIDE: keys 512 + 64), in deepseek_toy_wide")
    ap.add_argument("--store", choices=["fp8", "ct-int4"],
                    help="the main toy in FP8 (deepseek_fp8_toy) or a Kimi-K2-shaped toy with "
                         "compressed-tensors INT4 experts (kimi_int4_toy)")
    args = ap.parse_args()
    mode = "variant" if args.variant else "wide" if args.wide else "main"
    if args.store:
        mode = args.store
    settings = {"variant": VARIANT, "wide": WIDE, "main": {}, "fp8": FP8, "ct-int4": KIMI}[mode]
    globals().update(settings, MODE=mode, STORE=args.store)
    if args.out is None:
        args.out = Path({"main": "tests/data/deepseek_toy", "variant": "tests/data/deepseek_toy_variant",
                         "wide": "tests/data/deepseek_toy_wide", "fp8": "tests/data/deepseek_fp8_toy",
                         "ct-int4": "tests/data/kimi_int4_toy"}[mode])
    if args.seed is None:
        args.seed = {"main": SEED, "variant": VARIANT_SEED, "wide": WIDE_SEED, "fp8": FP8_SEED,
                     "ct-int4": KIMI_SEED}[mode]
    if args.check:
        check(args.out, args.seed)
        return
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    print(json.dumps(generate(args.out, args.seed)))


if __name__ == "__main__":
    main()
