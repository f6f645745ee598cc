#!/usr/bin/env python3
"""GLM-4.5 (`Glm4MoeForCausalLM`) toy checkpoint and transformers goldens.

Run it in the goldens' virtual environment (target/venv-golden: torch, transformers
5.24.0, safetensors, numpy):

    scripts/golden/golden_venv.sh scripts/golden/gen_glm_golden.py             # GLM-4.5
    scripts/golden/golden_venv.sh scripts/golden/gen_glm_golden.py --variant   # Air

CI never runs this script: it reads the committed outputs under tests/data/glm_toy/
and tests/data/glm_toy_air/.

The toy (every matrix's input dim a multiple of 64, for INT4 groups of 64), every
feature of the architecture on
-------------------------------------------------------------------------------------
hidden 128 · 3 decoder layers, the first dense (`first_k_dense_replace` 1, intermediate
128) · attention: 4 query heads over 2 KV heads of `head_dim` 64 (≠ hidden / heads),
q/k/v biases (`attention_bias`), per-head QK RMSNorm (`use_qk_norm`), RoPE θ 10000 on
the first half of each head (`partial_rotary_factor` 0.5, rotate-half) · MoE: 8 routed
experts × 64, top-2 of sigmoid scores plus `e_score_correction_bias` (random, F32 on
disk), one group (`n_group` = `topk_group` = 1, as GLM's configs), renormalised, × 2.5
(`routed_scaling_factor`, GLM-4.5's), one ungated shared expert · RMSNorm eps 1e-5 ·
vocab 512, untied lm_head · a NextN (multi-token-prediction) layer at
`model.layers.3` in the last shard, laid out as GLM-4.5's (a whole decoder layer plus
`eh_proj`, `enorm`, `hnorm`, `shared_head.norm`): transformers ignores it on load, the
install must drop it.

`--variant` writes tests/data/glm_toy_air/: GLM-4.5-Air's options, `use_qk_norm` off and
`routed_scaling_factor` 1, 2 decoder layers (the NextN layer at `model.layers.2`).

Weights are drawn with numpy from a seed per tensor name, rounded to BF16 (the
correction bias stays F32) and written in the real hub layout (per-expert names, two
HF-style shards and their index) by gen_deepseek_golden.py's helpers. Goldens
(golden/): meta.json (prompt, greedy ids, gaps, router margins), prompt.safetensors
(the prompt's logits [T, V]), greedy.safetensors (tokens, step_logits by full
recompute), from the reference reloaded with `from_pretrained`, upcast to f32 (exact),
eager attention and experts, one CPU thread. The script refuses a seed whose smallest
greedy gap is under MIN_GAP or whose top-k routing has a near tie (MIN_ROUTER_MARGIN)
anywhere in the greedy sequence.
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

import gen_deepseek_golden as ds  # noqa: E402

SEED = 1
H = 128
LAYERS = 3
DENSE = 1
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
PARTIAL = 0.5
INTER = 128
MOE_INTER = 64
EXPERTS = 8
TOP_K = 2
SCALING = 2.5
QK_NORM = True
VOCAB = 512
BOS, EOS = 1, 2
GREEDY_STEPS = 24
MIN_GAP = 1e-2
MIN_ROUTER_MARGIN = 1e-3
PROMPT_TEXT = ds.PROMPT_TEXT
OUT = "tests/data/glm_toy"

VARIANT = {"LAYERS": 2, "QK_NORM": False, "SCALING": 1.0, "OUT": "tests/data/glm_toy_air"}
VARIANT_SEED = 1


def config() -> dict:
    """config.json as GLM-4.5's hub checkpoint writes it (its fields, toy sizes)."""
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "first_k_dense_replace": DENSE,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": INTER,
        "max_position_embeddings": 256,
        "model_type": "glm4_moe",
        "moe_intermediate_size": MOE_INTER,
        "n_group": 1,
        "n_routed_experts": EXPERTS,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": HEADS,
        "num_experts_per_tok": TOP_K,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "num_nextn_predict_layers": 1,
        "partial_rotary_factor": PARTIAL,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 10000,
        "routed_scaling_factor": SCALING,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "torch_dtype": "bfloat16",
        "transformers_version": "5.24.0",
        "use_cache": True,
        "use_qk_norm": QK_NORM,
        "vocab_size": VOCAB,
    }


def layer_tensors(i: int, moe: bool) -> list:
    p = f"model.layers.{i}."
    a = p + "self_attn."
    out = [(p + "input_layernorm.weight", (H,))]
    for n, rows in (("q_proj", HEADS * HEAD_DIM), ("k_proj", KV_HEADS * HEAD_DIM),
                    ("v_proj", KV_HEADS * HEAD_DIM)):
        out += [(a + n + ".weight", (rows, H)), (a + n + ".bias", (rows,))]
    out.append((a + "o_proj.weight", (H, HEADS * HEAD_DIM)))
    if QK_NORM:
        out += [(a + "q_norm.weight", (HEAD_DIM,)), (a + "k_norm.weight", (HEAD_DIM,))]
    m = p + "mlp."
    if not moe:
        out += [(m + "gate_proj.weight", (INTER, H)), (m + "up_proj.weight", (INTER, H)),
                (m + "down_proj.weight", (H, INTER))]
    else:
        out += [(m + "gate.weight", (EXPERTS, H)), (m + "gate.e_score_correction_bias", (EXPERTS,))]
        for e in range(EXPERTS):
            q = f"{m}experts.{e}."
            out += [(q + "gate_proj.weight", (MOE_INTER, H)), (q + "up_proj.weight", (MOE_INTER, H)),
                    (q + "down_proj.weight", (H, MOE_INTER))]
        q = m + "shared_experts."
        out += [(q + "gate_proj.weight", (MOE_INTER, H)), (q + "up_proj.weight", (MOE_INTER, H)),
                (q + "down_proj.weight", (H, MOE_INTER))]
    out.append((p + "post_attention_layernorm.weight", (H,)))
    return out


def hub_tensors() -> list:
    """Every tensor of the checkpoint, by hub name and shape; the NextN layer last."""
    out: list = [("model.embed_tokens.weight", (VOCAB, H))]
    for i in range(LAYERS):
        out += layer_tensors(i, i >= DENSE)
    out += [("model.norm.weight", (H,)), ("lm_head.weight", (VOCAB, H))]
    p = f"model.layers.{LAYERS}."
    out += layer_tensors(LAYERS, True)
    out += [(p + "eh_proj.weight", (H, 2 * H)), (p + "enorm.weight", (H,)),
            (p + "hnorm.weight", (H,)), (p + "shared_head.norm.weight", (H,))]
    return out


def init_value(seed: int, name: str, shape) -> np.ndarray:
    z = ds.rng_for(seed, name).standard_normal(shape)
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * z).astype(np.float32)
    if name.endswith("e_score_correction_bias"):
        return (0.1 * z).astype(np.float32)
    if name.endswith("_proj.bias"):
        return (0.3 * z).astype(np.float32)
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
        out.append((name, t if name.endswith("e_score_correction_bias") else t.to(torch.bfloat16)))
    return out


def check_loaded(model, saved: dict) -> None:
    """Every decoder tensor arrives unchanged where transformers puts it (experts fused
    into `gate_up_proj` gate first and `down_proj`); nothing is left unfilled."""
    sd = model.state_dict()
    used = set()
    nextn = f"model.layers.{LAYERS}."
    for name, value in saved.items():
        if name.startswith(nextn):
            continue
        if ".mlp.experts." in name:
            head, rest = name.split(".mlp.experts.")
            e, w = rest.split(".")[:2]
            e = int(e)
            if w == "down_proj":
                loaded = f"{head}.mlp.experts.down_proj"
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
    def __init__(self, model):
        self.data: dict = {}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            if i >= DENSE:
                self.handles.append(layer.mlp.gate.register_forward_hook(self.hook(i)))

    def hook(self, i):
        def fn(m, args, out):
            self.data[f"layers.{i}.moe.router_logits"] = out[0].detach().float().clone()
        return fn

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
    """Per MoE layer: the smallest gap between the k-th and (k+1)-th biased key."""
    out = []
    for i in range(DENSE, LAYERS):
        s = data[f"layers.{i}.moe.router_logits"].sigmoid() + biases[i]
        keys = s.sort(dim=-1, descending=True).values
        out.append(float((keys[:, TOP_K - 1] - keys[:, TOP_K]).min()))
    return out


def generate(out: Path, seed: int) -> dict:
    import tokenizers
    import transformers
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoTokenizer, Glm4MoeForCausalLM

    transformers.utils.logging.disable_progress_bar()
    if out.exists():
        shutil.rmtree(out)
    golden = out / "golden"
    golden.mkdir(parents=True)
    ds.write_json(out / "config.json", config())
    cfg = AutoConfig.from_pretrained(out)
    rp = cfg.rope_parameters
    if rp.get("rope_type") != "default" or rp.get("partial_rotary_factor") != PARTIAL \
            or rp.get("rope_theta") != 10000 or cfg.use_qk_norm != QK_NORM:
        raise SystemExit(f"config read back with rope {rp}, use_qk_norm {cfg.use_qk_norm}")
    tensors = build_tensors(seed)
    ckpt = ds.write_checkpoint(out, tensors)
    saved = dict(tensors)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    last = f"model-{ds.SHARDS:05d}-of-{ds.SHARDS:05d}.safetensors"
    if any(f != last for k, f in index["weight_map"].items() if k.startswith(f"model.layers.{LAYERS}.")):
        raise SystemExit("the NextN layer is not all in the last shard")
    for f in ds.TOKENIZER_FILES:
        shutil.copyfile(ds.MIXTRAL_TOY / f, out / f)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    prompt = tok.encode(PROMPT_TEXT).ids
    if AutoTokenizer.from_pretrained(out)(PROMPT_TEXT).input_ids != prompt or prompt[0] != BOS:
        raise SystemExit("transformers encodes the prompt differently")

    model, info = Glm4MoeForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager",
        experts_implementation="eager", output_loading_info=True)
    model.eval()
    unexpected = [k for k in info.get("unexpected_keys", [])
                  if not k.startswith(f"model.layers.{LAYERS}.")]
    if unexpected or any(info.get(k) for k in ("missing_keys", "mismatched_keys", "error_msgs")):
        raise SystemExit(f"reference load: {info}")
    check_loaded(model, saved)
    biases = {i: saved[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] for i in range(DENSE, LAYERS)}

    rec = Recorder(model)
    pdata = forward(model, rec, prompt)
    seq = list(prompt)
    tokens, gaps, step_logits, margins = [], [], [], []
    for _ in range(GREEDY_STEPS):
        data = forward(model, rec, seq)
        last = data["logits"][-1]
        top = last.topk(2)
        tokens.append(int(top.indices[0]))
        gaps.append(float(top.values[0] - top.values[1]))
        step_logits.append(last.clone())
        seq.append(tokens[-1])
        margins = router_margins(data, biases)
    rec.close()
    step_logits = torch.stack(step_logits)
    if not torch.equal(step_logits[0], pdata["logits"][-1]):
        raise SystemExit("the first greedy step differs from the prompt's last logits")
    with torch.no_grad():
        cached = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY_STEPS,
                                do_sample=False, use_cache=True)[0, len(prompt):].tolist()
    min_gap = min(gaps)
    summary = {"seed": seed, "min_gap": min_gap, "min_router_margin": min(margins),
               "greedy": tokens, "cached_generate_agrees": cached == tokens}
    if min_gap < MIN_GAP or min(margins) < MIN_ROUTER_MARGIN or cached != tokens:
        print(json.dumps(summary), file=sys.stderr)
        raise SystemExit(f"seed {seed}: near tie or cached generate differs: pick another seed")

    ds.save_tensors(golden / "prompt.safetensors", {"logits": pdata["logits"]})
    ds.save_tensors(golden / "greedy.safetensors",
                    {"tokens": torch.tensor(tokens, dtype=torch.int64), "step_logits": step_logits})
    meta = {
        "generator": "scripts/golden/gen_glm_golden.py",
        "family": "glm4_moe",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__, "numpy": np.__version__,
                     "python": sys.version.split()[0]},
        "precision": "f32 compute from the BF16 checkpoint weights (exact upcast; the "
                     "correction bias F32 on disk); eager attention, eager experts; 1 thread; "
                     "greedy by full recompute, no cache",
        "seed": seed,
        "config": {"hidden": H, "layers": LAYERS, "first_k_dense_replace": DENSE, "heads": HEADS,
                   "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "partial_rotary_factor": PARTIAL,
                   "use_qk_norm": QK_NORM, "attention_bias": True, "intermediate": INTER,
                   "moe_intermediate": MOE_INTER, "experts": EXPERTS, "top_k": TOP_K,
                   "routed_scaling_factor": SCALING, "vocab": VOCAB, "nextn_layer": LAYERS},
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
    ds.write_json(golden / "meta.json", meta)
    for p in out.rglob("*"):
        if p.is_file():
            p.chmod(0o644)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--variant", action="store_true", help="GLM-4.5-Air's options (VARIANT)")
    args = ap.parse_args()
    if args.variant:
        globals().update(VARIANT)
    out = args.out or Path(OUT)
    seed = args.seed if args.seed is not None else (VARIANT_SEED if args.variant else SEED)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    print(json.dumps(generate(out, seed)))


if __name__ == "__main__":
    main()
