#!/usr/bin/env python3
"""gpt-oss (`GptOssForCausalLM`) toy checkpoint and transformers goldens.

Run it in the goldens' virtual environment (transformers 5.24.0, torch, safetensors):

    GOLDEN_VENV=target/venv-golden scripts/golden/golden_venv.sh scripts/golden/gen_gptoss_golden.py
    ... --check     # regenerate into a temp dir and compare (f32 within CHECK_F32_TOL)

CI never runs it: it reads the committed outputs under tests/data/gptoss_toy/.

The toy (every matrix input dim a multiple of 64, for INT4 groups of 64)
---------------------------------------------------------------------------
hidden 128 · 4 layers, `layer_types` sliding / full / sliding / full with
`sliding_window` 8 (the prompt and the rollout run past it) · attention: 4 query heads
over 2 KV heads of head_dim 64, biases on q, k, v and o, a learned sink per query head
(`self_attn.sinks`, drawn with scale 1 so they matter) · RoPE θ 150000 with YaRN
(factor 4, `original_max_position_embeddings` 64, β 32 / 1, `truncate` false, as
gpt-oss's config) over `max_position_embeddings` 256 · MoE on every layer: 8 experts ×
64, the router linear with a bias, top-2 of the logits then a softmax over the two;
every expert projection with a bias; the clamped SwiGLU with α 1.702 and
`swiglu_limit` 2.0 (the real model's 7.0 is rarely reached by a toy's activations; 2.0
clamps a good share of them, both sides of up and the top of gate) · RMSNorm eps 1e-5
· vocab 512 (the Mixtral toy's tokenizer), untied lm_head.

Weights are drawn with numpy from a seed per tensor name, rounded to BF16, and written
in the layout transformers saves gpt-oss in BF16: `mlp.experts.gate_up_proj`
`[E, H, 2I]` (each expert's matrix transposed, `x @ W`; gate and up interleaved on the
last axis, even gate, odd up), `gate_up_proj_bias` `[E, 2I]`, `down_proj` `[E, I, H]`,
`down_proj_bias` `[E, H]`, `mlp.router.{weight,bias}`; two shards with an index.

The reference is loaded with `from_pretrained` in f32 (exact upcast), eager attention,
eager experts, one thread. Greedy rollouts recompute the whole sequence each step (no
cache). The stored logits come from the same model in f64, which must pick the same
greedy tokens. The goldens: meta.json (prompt, greedy ids, gaps, router margins),
prompt.safetensors (`logits` [T, V]), greedy.safetensors (`tokens`, `step_logits`
[S, V]). The script refuses (exit 1) a seed whose smallest greedy gap is under MIN_GAP
or whose router has a near tie at the top-k boundary (MIN_ROUTER_MARGIN).
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

SEED = 5
H = 128
LAYERS = 4
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
WINDOW = 8
EXPERTS = 8
TOP_K = 2
INTER = 64
LIMIT = 2.0
VOCAB = mx.VOCAB
BOS, EOS = mx.BOS, mx.EOS
GREEDY_STEPS = 24
MIN_GAP = 1e-2
MIN_ROUTER_MARGIN = 1e-3
PROMPT_TEXT = mx.PROMPT_TEXT
CHECK_F32_TOL = 1e-4
LAYER_TYPES = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(LAYERS)]
ROPE_SCALING = {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 4.0,
                "original_max_position_embeddings": 64, "rope_type": "yarn", "truncate": False}


def config() -> dict:
    """config.json with gpt-oss-20b's fields, toy sizes."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "experts_per_token": TOP_K,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": H,
        "initial_context_length": 64,
        "initializer_range": 0.02,
        "intermediate_size": INTER,
        "layer_types": LAYER_TYPES,
        "max_position_embeddings": 256,
        "model_type": "gpt_oss",
        "num_attention_heads": HEADS,
        "num_experts_per_tok": TOP_K,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "num_local_experts": EXPERTS,
        "output_router_logits": False,
        "rms_norm_eps": 1e-5,
        "rope_scaling": ROPE_SCALING,
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": WINDOW,
        "swiglu_limit": LIMIT,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "5.24.0",
        "use_cache": True,
        "vocab_size": VOCAB,
    }


def hub_tensors() -> list:
    """Every tensor of the checkpoint by name and shape, layer by layer."""
    out: list = [("model.embed_tokens.weight", (VOCAB, H))]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out.append((p + "input_layernorm.weight", (H,)))
        for n, rows, cols in (("q_proj", HEADS * HEAD_DIM, H), ("k_proj", KV_HEADS * HEAD_DIM, H),
                              ("v_proj", KV_HEADS * HEAD_DIM, H), ("o_proj", H, HEADS * HEAD_DIM)):
            out += [(a + n + ".weight", (rows, cols)), (a + n + ".bias", (rows,))]
        out.append((a + "sinks", (HEADS,)))
        m = p + "mlp."
        out += [(m + "router.weight", (EXPERTS, H)), (m + "router.bias", (EXPERTS,)),
                (m + "experts.gate_up_proj", (EXPERTS, H, 2 * INTER)),
                (m + "experts.gate_up_proj_bias", (EXPERTS, 2 * INTER)),
                (m + "experts.down_proj", (EXPERTS, INTER, H)),
                (m + "experts.down_proj_bias", (EXPERTS, H))]
        out.append((p + "post_attention_layernorm.weight", (H,)))
    out += [("model.norm.weight", (H,)), ("lm_head.weight", (VOCAB, H))]
    return out


def init_value(seed: int, name: str, shape) -> np.ndarray:
    z = mx.rng_for(seed, name).standard_normal(shape)
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * z).astype(np.float32)
    if name.endswith("sinks"):
        return z.astype(np.float32)
    if name.endswith(("_bias", ".bias")):
        return (0.3 * z).astype(np.float32)
    if name.endswith("embed_tokens.weight"):
        std = 1.0
    elif name.endswith("experts.gate_up_proj"):
        std = 2.0 / math.sqrt(shape[1])  # [E, in, out]: in is axis 1
    elif name.endswith("experts.down_proj"):
        std = 2.0 / math.sqrt(shape[1])
    elif name.endswith(("o_proj.weight", "router.weight")):
        std = 2.0 / math.sqrt(shape[1])
    elif name.endswith("lm_head.weight"):
        std = 4.0 / math.sqrt(shape[1])
    else:
        std = 1.0 / math.sqrt(shape[1])
    return (std * z).astype(np.float32)


def build_tensors(seed: int) -> list:
    return [(n, torch.from_numpy(init_value(seed, n, s)).to(torch.bfloat16)) for n, s in hub_tensors()]


def check_loaded(model, saved: dict) -> None:
    """Every saved tensor arrives unchanged under its own name; nothing is left unfilled."""
    sd = model.state_dict()
    for name, value in saved.items():
        if name not in sd or not torch.equal(sd[name], value.to(sd[name].dtype)):
            raise SystemExit(f"transformers loaded {name} differently")
    extra = sorted(set(sd) - set(saved))
    if extra:
        raise SystemExit(f"the model has tensors no saved name filled: {extra}")


class RouterTap:
    """The router logits of every layer in the last forward pass."""

    def __init__(self, model):
        self.logits: dict[int, torch.Tensor] = {}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            def fn(m, args, out, i=i):
                self.logits[i] = out[0].detach().float().clone()
            self.handles.append(layer.mlp.router.register_forward_hook(fn))

    def margins(self) -> list[float]:
        out = []
        for i in sorted(self.logits):
            s = self.logits[i].sort(dim=-1, descending=True).values
            out.append(float((s[:, TOP_K - 1] - s[:, TOP_K]).min()))
        return out


def clamp_share(model, ids: list[int]) -> float:
    """The share of gate/up activations the clamp changes over the prompt (a check
    that the toy exercises it)."""
    seen, clamped = 0, 0
    handles = []

    def fn(m, args, out):
        nonlocal seen, clamped
        gate_up = args[0]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        seen += gate.numel() + up.numel()
        clamped += int((gate > LIMIT).sum() + (up.abs() > LIMIT).sum())

    for layer in model.model.layers:
        orig = layer.mlp.experts._apply_gate

        def wrapped(gate_up, orig=orig):
            fn(None, (gate_up,), None)
            return orig(gate_up)
        layer.mlp.experts._apply_gate = wrapped
        handles.append((layer.mlp.experts, orig))
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), use_cache=False)
    for experts, orig in handles:
        experts._apply_gate = orig
    return clamped / max(seen, 1)


def greedy(model, prompt: list[int], steps: int, tap: RouterTap):
    seq = list(prompt)
    tokens, gaps, step_logits, margins = [], [], [], []
    for _ in range(steps):
        with torch.no_grad():
            last = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].float()
        top = last.topk(2)
        margins += tap.margins()
        tokens.append(int(top.indices[0]))
        gaps.append(float(top.values[0] - top.values[1]))
        step_logits.append(last.clone())
        seq.append(tokens[-1])
    return tokens, gaps, torch.stack(step_logits), margins


def generate(out: Path, seed: int) -> dict:
    import transformers
    from transformers import AutoTokenizer, GptOssForCausalLM

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
    if len(prompt) <= WINDOW:
        raise SystemExit(f"the prompt ({len(prompt)} ids) does not run past the window")

    model, info = GptOssForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager",
        experts_implementation="eager", output_loading_info=True)
    model.eval()
    if any(info.get(k) for k in ("missing_keys", "mismatched_keys", "error_msgs", "unexpected_keys")):
        raise SystemExit(f"reference load: {info}")
    check_loaded(model, saved)
    c = model.config
    rp = c.rope_parameters
    if c.layer_types != LAYER_TYPES or rp.get("rope_type") != "yarn" or rp.get("truncate") is not False \
            or c.sliding_window != WINDOW or c.swiglu_limit != LIMIT:
        raise SystemExit(f"config read back as {c}")

    tap = RouterTap(model)
    with torch.no_grad():
        plogits = model(input_ids=torch.tensor([prompt]), use_cache=False).logits[0].float().clone()
    tokens, gaps, step_logits, margins = greedy(model, prompt, GREEDY_STEPS, tap)
    if not torch.equal(step_logits[0], plogits[-1]):
        raise SystemExit("the first greedy step differs from the prompt's last logits")
    with torch.no_grad():
        o = model(input_ids=torch.tensor([prompt]), use_cache=True)
        cache, cached = o.past_key_values, [o.logits[0, -1].float()]
        for t in tokens[:-1]:
            o = model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True)
            cache = o.past_key_values
            cached.append(o.logits[0, -1].float())
    cached_vs_recompute = float((torch.stack(cached) - step_logits).abs().max())
    share = clamp_share(model, prompt)

    model64 = GptOssForCausalLM.from_pretrained(
        out, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager")
    model64.eval()
    with torch.no_grad():
        seq = list(prompt) + tokens[:-1]
        l64 = model64(input_ids=torch.tensor([seq]), use_cache=False).logits[0]
    t = len(prompt)
    f32_vs_f64 = max(float((plogits.double() - l64[:t]).abs().max()),
                     float((step_logits.double() - l64[t - 1:]).abs().max()))
    plogits, step_logits = l64[:t].float().clone(), l64[t - 1:].float().clone()
    if [int(r.argmax()) for r in step_logits] != tokens:
        raise SystemExit("the f64 model picks other greedy tokens than the f32 one")

    min_gap, min_margin = min(gaps), min(margins)
    summary = {"seed": seed, "min_gap": min_gap, "min_router_margin": min_margin,
               "greedy": tokens, "cached_vs_recompute": cached_vs_recompute,
               "f32_vs_f64": f32_vs_f64, "clamped_share": share}
    if min_gap < MIN_GAP or min_margin < MIN_ROUTER_MARGIN or cached_vs_recompute > 1e-3:
        print(json.dumps(summary), file=sys.stderr)
        raise SystemExit(f"seed {seed}: gap {min_gap:.3g} or router margin {min_margin:.3g} too small")

    mx.save_tensors(golden / "prompt.safetensors", {"logits": plogits})
    mx.save_tensors(golden / "greedy.safetensors", {
        "tokens": torch.tensor(tokens, dtype=torch.int64), "step_logits": step_logits})
    meta = {
        "generator": "scripts/golden/gen_gptoss_golden.py",
        "family": "gpt_oss",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "numpy": np.__version__, "python": sys.version.split()[0]},
        "precision": "greedy ids from f32 compute (BF16 weights upcast), full recompute per "
                     "step; the stored logits from the same model in f64 (one pass over the "
                     "prompt and the rollout); eager attention and experts; 1 thread",
        "seed": seed,
        "config": {k: config()[k] for k in ("hidden_size", "num_hidden_layers", "layer_types",
                                            "sliding_window", "num_attention_heads",
                                            "num_key_value_heads", "head_dim", "rope_scaling",
                                            "num_local_experts", "num_experts_per_tok",
                                            "intermediate_size", "swiglu_limit", "vocab_size")},
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
        "clamped_share_of_prompt_activations": share,
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
    ap.add_argument("--out", type=Path, default=Path("tests/data/gptoss_toy"))
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
