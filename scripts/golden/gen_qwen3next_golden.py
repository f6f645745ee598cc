#!/usr/bin/env python3
"""Qwen3-Next (`Qwen3NextForCausalLM`) toy checkpoint and transformers goldens.

Run it in the goldens' virtual environment (transformers 5.24.0, torch, safetensors):

    GOLDEN_VENV=target/venv-golden scripts/golden/golden_venv.sh scripts/golden/gen_qwen3next_golden.py
    ... --check     # regenerate into a temp dir and compare (f32 within CHECK_F32_TOL)

CI never runs it: it reads the committed outputs under tests/data/qwen3next_toy/.

The toy (every matrix input dim a multiple of 64, for INT4 groups of 64)
---------------------------------------------------------------------------
hidden 128 · 4 layers, `full_attention_interval` 2 (layers 1 and 3 gated full
attention, 0 and 2 gated DeltaNet: two of each, so two K/V caches and two recurrent
states travel through a snapshot) · attention: 4 query heads, 2 KV heads, head_dim 32,
partial_rotary_factor 0.25 (8 rotated dims), RoPE θ 10000 · DeltaNet: 2 key heads of 32,
4 value heads of 32 (two value heads per key head, so `in_proj_qkvz`'s per-key-head
grouping matters), conv kernel 4 · MoE on every layer: 8 experts × 64, top-2, softmax
over all then renormalised (`norm_topk_prob` true), shared expert 64 gated by
`shared_expert_gate` · RMSNorm eps 1e-6 · vocab 512 (the Mixtral toy's tokenizer:
`gen_mixtral_golden.write_tokenizer`), untied lm_head.

Weights are drawn with numpy from a seed per tensor name, rounded to BF16, and written
in the hub layout: per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`,
`mlp.gate.weight`, `mlp.shared_expert.*`, `mlp.shared_expert_gate.weight`,
`linear_attn.{in_proj_qkvz,in_proj_ba,conv1d,norm,out_proj}.weight`,
`linear_attn.{A_log,dt_bias}`, `self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`, and an
`mtp.*` module (its own experts included) that transformers ignores
(`_keys_to_ignore_on_load_unexpected`) and the install drops by default; two shards
with `model.safetensors.index.json`. The zero-centred norms (`Qwen3NextRMSNorm`,
applied as `1 + w`) are drawn near 0, the gated norm (`Qwen3NextRMSNormGated`, applied
as `w`) near 1.

The reference is loaded with `from_pretrained` in f32 (exact upcast), eager attention,
eager experts, one thread. No `fla` or `causal-conv1d` kernels exist on the CPU (and the
hub kernel loader is offline), so transformers runs its torch fallbacks
(`torch_chunk_gated_delta_rule`, the `F.conv1d` causal conv); the script asserts that.
Greedy rollouts recompute the whole sequence each step (no cache), in f32. The stored
logits come from the same model in f64 (the f32 reference is ~9e-5 from it, most of the
tests' 1e-4 budget), which must pick the same greedy tokens. The goldens: meta.json
(prompt, greedy ids, gaps, router margins), prompt.safetensors (`logits` [T, V]),
greedy.safetensors (`tokens`, `step_logits` [S, V]). The script refuses
(exit 1) a seed whose smallest greedy gap is under MIN_GAP or whose router has a near
tie at the top-k boundary (MIN_ROUTER_MARGIN) anywhere in the greedy sequence.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import gen_mixtral_golden as mx  # noqa: E402  (tokenizer, shards, rng, json, check)

SEED = 1
H = 128
LAYERS = 4
INTERVAL = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32
PARTIAL_ROTARY = 0.25
NK, DK, NV, DV = 2, 32, 4, 32
CONV_K = 4
EXPERTS = 8
TOP_K = 2
MOE_INTER = 64
SHARED_INTER = 64
VOCAB = mx.VOCAB
BOS, EOS = mx.BOS, mx.EOS
GREEDY_STEPS = 24
MIN_GAP = 1e-2
MIN_ROUTER_MARGIN = 1e-3
PROMPT_TEXT = mx.PROMPT_TEXT
CHECK_F32_TOL = 1e-4


def config() -> dict:
    """config.json with Qwen3-Next-80B-A3B-Instruct's fields, toy sizes."""
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS,
        "decoder_sparse_step": 1,
        "eos_token_id": EOS,
        "full_attention_interval": INTERVAL,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": 256,
        "linear_conv_kernel_dim": CONV_K,
        "linear_key_head_dim": DK,
        "linear_num_key_heads": NK,
        "linear_num_value_heads": NV,
        "linear_value_head_dim": DV,
        "max_position_embeddings": 4096,
        "mlp_only_layers": [],
        "model_type": "qwen3_next",
        "moe_intermediate_size": MOE_INTER,
        "norm_topk_prob": True,
        "num_attention_heads": HEADS,
        "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "output_router_logits": False,
        "partial_rotary_factor": PARTIAL_ROTARY,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": SHARED_INTER,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "5.24.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    }


def is_full(layer: int) -> bool:
    return (layer + 1) % INTERVAL == 0


def moe_tensors(p: str) -> list:
    out = [(p + "mlp.gate.weight", (EXPERTS, H))]
    for e in range(EXPERTS):
        q = f"{p}mlp.experts.{e}."
        out += [(q + "down_proj.weight", (H, MOE_INTER)), (q + "gate_proj.weight", (MOE_INTER, H)),
                (q + "up_proj.weight", (MOE_INTER, H))]
    out += [(p + "mlp.shared_expert.down_proj.weight", (H, SHARED_INTER)),
            (p + "mlp.shared_expert.gate_proj.weight", (SHARED_INTER, H)),
            (p + "mlp.shared_expert.up_proj.weight", (SHARED_INTER, H)),
            (p + "mlp.shared_expert_gate.weight", (1, H))]
    return out


def hub_tensors() -> list:
    """Every tensor of the checkpoint by hub name and shape, layer by layer, then MTP."""
    r = NV // NK
    out: list = [("model.embed_tokens.weight", (VOCAB, H))]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out.append((p + "input_layernorm.weight", (H,)))
        if is_full(i):
            out += [(p + "self_attn.k_norm.weight", (HEAD_DIM,)),
                    (p + "self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, H)),
                    (p + "self_attn.o_proj.weight", (H, HEADS * HEAD_DIM)),
                    (p + "self_attn.q_norm.weight", (HEAD_DIM,)),
                    (p + "self_attn.q_proj.weight", (2 * HEADS * HEAD_DIM, H)),
                    (p + "self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, H))]
        else:
            c = 2 * NK * DK + NV * DV
            out += [(p + "linear_attn.A_log", (NV,)),
                    (p + "linear_attn.conv1d.weight", (c, 1, CONV_K)),
                    (p + "linear_attn.dt_bias", (NV,)),
                    (p + "linear_attn.in_proj_ba.weight", (2 * NV, H)),
                    (p + "linear_attn.in_proj_qkvz.weight", (NK * (2 * DK + 2 * r * DV), H)),
                    (p + "linear_attn.norm.weight", (DV,)),
                    (p + "linear_attn.out_proj.weight", (H, NV * DV))]
        out += moe_tensors(p)
        out.append((p + "post_attention_layernorm.weight", (H,)))
    out += [("model.norm.weight", (H,)), ("lm_head.weight", (VOCAB, H))]
    # The MTP module as the hub stores it (a fc over [embed; hidden], one layer, norms).
    m = "mtp."
    out += [(m + "fc.weight", (H, 2 * H)), (m + "norm.weight", (H,)),
            (m + "pre_fc_norm_embedding.weight", (H,)), (m + "pre_fc_norm_hidden.weight", (H,)),
            (m + "layers.0.input_layernorm.weight", (H,)),
            (m + "layers.0.post_attention_layernorm.weight", (H,))]
    out += moe_tensors(m + "layers.0.")
    return out


def init_value(seed: int, name: str, shape) -> np.ndarray:
    z = mx.rng_for(seed, name).standard_normal(shape)
    if name.endswith("linear_attn.norm.weight"):
        return (1.0 + 0.1 * z).astype(np.float32)  # the gated norm: plain weight
    if name.endswith("norm.weight") or "norm_" in name:
        return (0.1 * z).astype(np.float32)  # zero-centred: applied as 1 + w
    if name.endswith("A_log"):
        u = mx.rng_for(seed, name).uniform(0.5, 4.0, shape)
        return np.log(u).astype(np.float32)
    if name.endswith("dt_bias"):
        return (0.5 * z).astype(np.float32)
    if name.endswith("conv1d.weight"):
        return (z / math.sqrt(CONV_K)).astype(np.float32)
    if name.endswith("embed_tokens.weight"):
        std = 1.0
    elif name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "mlp.gate.weight")):
        std = 2.0 / math.sqrt(shape[1])
    elif name.endswith("lm_head.weight"):
        std = 4.0 / math.sqrt(shape[1])
    else:
        std = 1.0 / math.sqrt(shape[1])
    return (std * z).astype(np.float32)


def build_tensors(seed: int) -> list:
    return [(n, torch.from_numpy(init_value(seed, n, s)).to(torch.bfloat16)) for n, s in hub_tensors()]


class RouterTap:
    """The router logits of every MoE layer in the last forward pass."""

    def __init__(self, model):
        self.logits: dict[int, torch.Tensor] = {}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            def fn(m, args, out, i=i):
                self.logits[i] = out[0].detach().float().clone()
            self.handles.append(layer.mlp.gate.register_forward_hook(fn))

    def margins(self) -> list[float]:
        out = []
        for i in sorted(self.logits):
            s = self.logits[i].sort(dim=-1, descending=True).values
            out.append(float((s[:, TOP_K - 1] - s[:, TOP_K]).min()))
        return out


def check_loaded(model, saved: dict) -> None:
    """Every non-MTP hub tensor arrives unchanged (experts fused into transformers'
    `gate_up_proj` / `down_proj`), and nothing in the model is left unfilled."""
    sd = model.state_dict()
    used = set()
    for name, value in saved.items():
        if name.startswith("mtp."):
            continue
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
        elif name.endswith("mlp.gate.weight"):
            loaded = name
            got = sd[loaded]
        else:
            loaded = name
            got = sd[loaded]
        if not torch.equal(got, value.to(got.dtype).reshape(got.shape)):
            raise SystemExit(f"transformers loaded {name} differently into {loaded}")
        used.add(loaded)
    extra = sorted(set(sd) - used)
    if extra:
        raise SystemExit(f"the model has tensors no hub name filled: {extra}")


def check_fallbacks(model) -> None:
    """The linear attention runs transformers' torch code, not a hub kernel."""
    from transformers.models.qwen3_next import modeling_qwen3_next as mq

    for fn in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
        f = getattr(mq, fn)
        mod = getattr(f, "__module__", "")
        if mod != mq.__name__:
            raise SystemExit(f"{fn} resolves to {mod}, not transformers' torch fallback")


def greedy(model, prompt, steps, tap):
    seq = list(prompt)
    tokens, gaps, step_logits, margins = [], [], [], []
    for _ in range(steps):
        with torch.no_grad():
            last = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].float()
        if tap is not None:
            margins.append(min(tap.margins()))
        top = last.topk(2)
        tokens.append(int(top.indices[0]))
        gaps.append(float(top.values[0] - top.values[1]))
        step_logits.append(last.clone())
        seq.append(tokens[-1])
    return tokens, gaps, torch.stack(step_logits), margins


def seq_all(prompt: list[int], tokens: list[int]) -> list[int]:
    """The prompt and every greedy token but the last: the last step's input."""
    return list(prompt) + tokens[:-1]


def generate(out: Path, seed: int) -> dict:
    import transformers
    from transformers import AutoTokenizer, Qwen3NextForCausalLM

    transformers.utils.logging.disable_progress_bar()
    if out.exists():
        shutil.rmtree(out)
    golden = out / "golden"
    golden.mkdir(parents=True)
    mx.write_json(out / "config.json", config())
    tensors = build_tensors(seed)
    ckpt = mx.write_checkpoint(out, tensors)
    saved = dict(tensors)
    tok = mx.write_tokenizer(out)
    prompt = tok.encode(PROMPT_TEXT).ids
    if AutoTokenizer.from_pretrained(out)(PROMPT_TEXT).input_ids != prompt:
        raise SystemExit("transformers encodes the prompt differently")

    model, info = Qwen3NextForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager",
        experts_implementation="eager", output_loading_info=True)
    model.eval()
    if any(info.get(k) for k in ("missing_keys", "mismatched_keys", "error_msgs")):
        raise SystemExit(f"reference load: {info}")
    unexpected = [k for k in info.get("unexpected_keys", []) if not k.startswith("mtp.")]
    if unexpected:
        raise SystemExit(f"reference load: unexpected {unexpected}")
    check_loaded(model, saved)
    check_fallbacks(model)
    types = model.config.layer_types
    if types != ["full_attention" if is_full(i) else "linear_attention" for i in range(LAYERS)]:
        raise SystemExit(f"layer_types {types}")

    tap = RouterTap(model)
    with torch.no_grad():
        plogits = model(input_ids=torch.tensor([prompt]), use_cache=False).logits[0].float().clone()
    tokens, gaps, step_logits, margins = greedy(model, prompt, GREEDY_STEPS, tap)
    if not torch.equal(step_logits[0], plogits[-1]):
        raise SystemExit("the first greedy step differs from the prompt's last logits")
    # Cached decode in transformers (recurrent rule, conv update) agrees with the
    # recompute: information, and a check that both paths are the same model.
    with torch.no_grad():
        o = model(input_ids=torch.tensor([prompt]), use_cache=True)
        cache, cached = o.past_key_values, [o.logits[0, -1].float()]
        for t in tokens[:-1]:
            o = model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True)
            cache = o.past_key_values
            cached.append(o.logits[0, -1].float())
    cached_vs_recompute = float((torch.stack(cached) - step_logits).abs().max())

    # The logits the goldens keep: the same model in f64 (the f32 reference is itself
    # ~9e-5 from it: its chunked delta rule and sums round differently from gturbo's,
    # so an f32 golden would spend most of a 1e-4 budget on its own rounding). One f64
    # pass over the prompt and the rollout gives every position (causal).
    model64 = Qwen3NextForCausalLM.from_pretrained(
        out, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager")
    model64.eval()
    with torch.no_grad():
        l64 = model64(input_ids=torch.tensor([seq_all(prompt, tokens)]), use_cache=False).logits[0]
    t = len(prompt)
    f32_vs_f64 = max(float((plogits.double() - l64[:t]).abs().max()),
                     float((step_logits.double() - l64[t - 1:]).abs().max()))
    plogits, step_logits = l64[:t].float().clone(), l64[t - 1:].float().clone()
    if [int(r.argmax()) for r in step_logits] != tokens:
        raise SystemExit("the f64 model picks other greedy tokens than the f32 one")

    min_gap, min_margin = min(gaps), min(margins)
    summary = {"seed": seed, "min_gap": min_gap, "min_router_margin": min_margin,
               "greedy": tokens, "cached_vs_recompute": cached_vs_recompute,
               "f32_vs_f64": f32_vs_f64}
    if min_gap < MIN_GAP or min_margin < MIN_ROUTER_MARGIN:
        print(json.dumps(summary), file=sys.stderr)
        raise SystemExit(f"seed {seed}: gap {min_gap:.3g} or router margin {min_margin:.3g} too small")

    mx.save_tensors(golden / "prompt.safetensors", {"logits": plogits})
    mx.save_tensors(golden / "greedy.safetensors", {
        "tokens": torch.tensor(tokens, dtype=torch.int64), "step_logits": step_logits})
    meta = {
        "generator": "scripts/golden/gen_qwen3next_golden.py",
        "family": "qwen3_next",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "numpy": np.__version__, "python": sys.version.split()[0]},
        "precision": "greedy ids from f32 compute (BF16 weights upcast), full recompute per "
                     "step; the stored logits from the same model in f64 (one pass over the "
                     "prompt and the rollout); eager attention and experts; torch fallbacks "
                     "for the DeltaNet; 1 thread",
        "seed": seed,
        "config": {k: config()[k] for k in ("hidden_size", "num_hidden_layers",
                                            "full_attention_interval", "num_attention_heads",
                                            "num_key_value_heads", "head_dim",
                                            "partial_rotary_factor", "linear_num_key_heads",
                                            "linear_num_value_heads", "num_experts",
                                            "num_experts_per_tok", "vocab_size")},
        "checkpoint": ckpt,
        "prompt_text": PROMPT_TEXT,
        "prompt": prompt,
        "greedy": tokens,
        "greedy_text": tok.decode(tokens, skip_special_tokens=False),
        "gaps": gaps,
        "min_gap": min_gap,
        "min_gap_required": MIN_GAP,
        "router_min_margin": min_margin,
        "router_margin_required": MIN_ROUTER_MARGIN,
        "transformers_cached_vs_recompute": cached_vs_recompute,
        "transformers_f32_vs_f64_logits": f32_vs_f64,
    }
    meta["files"] = sorted([str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()]
                           + ["golden/meta.json"])
    mx.write_json(golden / "meta.json", meta)
    for p in out.rglob("*"):
        if p.is_file():
            p.chmod(0o644)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("tests/data/qwen3next_toy"))
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--check", action="store_true",
                    help="regenerate into a temporary directory and compare with --out")
    args = ap.parse_args()
    if args.check:
        mx.CHECK_F32_TOL = CHECK_F32_TOL
        mx.__file__ = __file__  # check() re-runs this script
        mx.check(args.out, args.seed)
        return
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    print(json.dumps(generate(args.out, args.seed)))


if __name__ == "__main__":
    main()
