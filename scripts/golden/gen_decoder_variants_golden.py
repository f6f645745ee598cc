#!/usr/bin/env python3
"""Goldens for the decoder's config variants: a sliding window and dynamic NTK RoPE.

The Mixtral toy (tests/data/mixtral_toy, made by gen_mixtral_golden.py) is reloaded by
transformers with its config.json patched per variant (the weights are the toy's own,
so only the small goldens are committed), and run the way gturbo runs a session: the
prompt in one call with the KV cache on, then one token per call, greedy. That matters
for dynamic NTK: transformers' `dynamic_rope_update` recomputes the frequencies from
`seq_len = max(position_ids) + 1` of each call once it passes the pretraining context,
so an incremental generation differs from recomputing the whole sequence.

Run it through golden_venv.sh (torch + transformers 5.24, pinned):

    scripts/golden/golden_venv.sh scripts/golden/gen_decoder_variants_golden.py
    scripts/golden/golden_venv.sh scripts/golden/gen_decoder_variants_golden.py --check

Variants (the patch is written into meta.json; the Rust test applies the same patch):
- `window`: `sliding_window: 6`; the 17-token prompt and the 24 decode steps both
  cross it.
- `dynamic`: `rope_scaling: {rope_type: dynamic, factor: 2}`, `max_position_embeddings:
  24`, `rope_theta: 100` (a small base so the rotation, and so the scaling, matters in
  a 41-position toy), `head_dim: 32` spelled out (transformers' dynamic init fails on
  Mixtral's implicit one); the decode crosses position 24 at its 8th step.
- `dynamic_long`: the same with `factor: 6`, `max_position_embeddings: 8`: the prompt
  alone is past the pretraining context, so the prefill call is scaled.

Outputs (tests/data/decoder_variants/):
meta.json            versions, the prompt, per variant: the patch, the greedy ids,
                     their logit gaps, the smallest router margin, and how far the
                     variant's logits are from the same config without the feature
                     (`max_abs_delta_vs_base`: the Rust test's tolerance must be far
                     below it, or it would not test the feature).
{variant}.safetensors  prompt_logits F32 [T, V] (the prefill call, every position),
                     step_logits F32 [S, V] (the logits each greedy token was picked
                     from: the prompt's last row, then each decode call's), tokens I64 [S].

The script refuses (exit 1) a variant whose greedy gap is under MIN_GAP or whose
router top-2 margin is under MIN_ROUTER_MARGIN anywhere, or whose logits do not move
by more than MIN_EFFECT from the unpatched feature.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import MixtralForCausalLM  # noqa: E402

TOY = Path("tests/data/mixtral_toy")
OUT = Path("tests/data/decoder_variants")
STEPS = 24
TOP_K = 2
MIN_GAP = 1e-2
MIN_ROUTER_MARGIN = 1e-3
MIN_EFFECT = 0.05
CHECK_TOL = 1e-5

# transformers' dynamic NTK init reads `config.head_dim` and fails on Mixtral's null
# (implicit) one, so the dynamic variants spell it (32 = hidden / heads, unchanged).
DYNAMIC = {"rope_theta": 100.0, "head_dim": 32}
VARIANTS = {
    "window": ({"sliding_window": 6}, {"sliding_window": None}),
    "dynamic": (
        {**DYNAMIC, "max_position_embeddings": 24,
         "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
        {**DYNAMIC, "max_position_embeddings": 24, "rope_scaling": None},
    ),
    "dynamic_long": (
        {**DYNAMIC, "max_position_embeddings": 8,
         "rope_scaling": {"rope_type": "dynamic", "factor": 6.0}},
        {**DYNAMIC, "max_position_embeddings": 8, "rope_scaling": None},
    ),
}


def load(patch: dict, tmp: Path) -> MixtralForCausalLM:
    """The toy with `patch` applied to its config.json (a copy in `tmp`)."""
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(TOY, tmp, ignore=shutil.ignore_patterns("golden"))
    cfg = json.loads((tmp / "config.json").read_text())
    cfg.update(patch)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    model = MixtralForCausalLM.from_pretrained(
        tmp, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
    return model.eval()


def check_config(model, patch: dict) -> None:
    """transformers read the patch as meant (5.x moves rope_scaling into rope_parameters)."""
    c = model.config
    if "sliding_window" in patch:
        assert c.sliding_window == patch["sliding_window"], c.sliding_window
    rs = patch.get("rope_scaling")
    if rs:
        rp = c.rope_parameters
        assert rp["rope_type"] == "dynamic" and rp["factor"] == rs["factor"], rp
        assert rp["rope_theta"] == patch["rope_theta"], rp
        assert model.model.rotary_emb.rope_type == "dynamic"


def run(model, prompt: list[int], steps: int, forced: list[int] | None = None):
    """Prefill `prompt` in one call, then `steps - 1` one-token calls, greedy (or
    feeding `forced` ids), with the cache: the logits of every call, the greedy ids,
    gaps and router margins."""
    margins = []

    def call(ids, past):
        out = model(input_ids=torch.tensor([ids]), past_key_values=past, use_cache=True,
                    output_router_logits=True)
        for r in out.router_logits:
            s = r.float().sort(dim=-1, descending=True).values
            margins.append(float((s[:, TOP_K - 1] - s[:, TOP_K]).min()))
        return out.logits[0].float(), out.past_key_values

    with torch.no_grad():
        prompt_logits, past = call(prompt, None)
        last = prompt_logits[-1]
        tokens, gaps, step_logits = [], [], []
        for i in range(steps):
            top = last.topk(2)
            tokens.append(int(top.indices[0]))
            gaps.append(float(top.values[0] - top.values[1]))
            step_logits.append(last.clone())
            if i + 1 < steps:
                logits, past = call([tokens[-1] if forced is None else forced[i]], past)
                last = logits[-1]
    return prompt_logits, torch.stack(step_logits), tokens, gaps, min(margins)


def generate(out: Path) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    toy_meta = json.loads((TOY / "golden/meta.json").read_text())
    prompt = toy_meta["prompt"]
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "generator": "scripts/golden/gen_decoder_variants_golden.py",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "toy": str(TOY),
        "prompt": prompt,
        "steps": STEPS,
        "variants": {},
    }
    with tempfile.TemporaryDirectory() as td:
        for name, (patch, base) in VARIANTS.items():
            model = load(patch, Path(td) / name)
            check_config(model, patch)
            pl, sl, tokens, gaps, margin = run(model, prompt, STEPS)
            base_model = load(base, Path(td) / f"{name}-base")
            _, _, btokens, _, _ = run(base_model, prompt, STEPS)
            # The feature's effect on the same inputs: the variant's own sequence
            # through the base config.
            bpl, bsl, _, _, _ = run(base_model, prompt, STEPS, forced=tokens)
            delta = float(max((pl - bpl).abs().max(), (sl - bsl).abs().max()))
            print(f"{name}: gap {min(gaps):.4f} router margin {margin:.4f} "
                  f"delta vs base {delta:.4f} tokens differ {sum(a != b for a, b in zip(tokens, btokens))}",
                  file=sys.stderr)
            if min(gaps) < MIN_GAP or margin < MIN_ROUTER_MARGIN or delta < MIN_EFFECT:
                raise SystemExit(f"{name}: gap {min(gaps):.3g} / router margin {margin:.3g} / "
                                 f"effect {delta:.3g} below {MIN_GAP} / {MIN_ROUTER_MARGIN} / {MIN_EFFECT}")
            save_file({"prompt_logits": pl.contiguous(), "step_logits": sl.contiguous(),
                       "tokens": torch.tensor(tokens, dtype=torch.int64)},
                      str(out / f"{name}.safetensors"), metadata={"format": "pt"})
            meta["variants"][name] = {
                "patch": patch,
                "greedy": tokens,
                "min_gap": min(gaps),
                "min_router_margin": margin,
                "max_abs_delta_vs_base": delta,
                "greedy_differs_from_base": sum(a != b for a, b in zip(tokens, btokens)),
            }
    (out / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return meta


def check(out: Path) -> None:
    with tempfile.TemporaryDirectory() as td:
        new = generate(Path(td))
        old = json.loads((out / "meta.json").read_text())
        bad = []
        for name, v in new["variants"].items():
            if v["greedy"] != old["variants"][name]["greedy"]:
                bad.append(f"{name}: greedy ids differ")
            a, b = load_file(str(Path(td) / f"{name}.safetensors")), load_file(str(out / f"{name}.safetensors"))
            for k in ("prompt_logits", "step_logits"):
                d = float((a[k] - b[k]).abs().max())
                if d > CHECK_TOL:
                    bad.append(f"{name}.{k}: max |Δ| {d:.3g}")
        if bad:
            raise SystemExit("\n".join(bad))
        print("goldens reproduce", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    if a.check:
        check(a.out)
    else:
        generate(a.out)
        print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
