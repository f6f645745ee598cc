#!/usr/bin/env python3
"""Golden MoE routing from transformers' own routers, for `kernels::routing`.

For each family's router (DeepSeek-V3, GLM-4-MoE, Mixtral, gpt-oss, Qwen3-MoE,
Qwen3-Next) this script builds the router module transformers uses, from a tiny config,
with seeded random weights (and, where the family has one, a seeded random
`e_score_correction_bias` or linear bias), runs 8 seeded random hidden states through
it on the CPU in float32, and records
- `logits`: the router logits `[8, E]` the module returns (gpt-oss: with its linear
  bias already added, since that bias is part of the linear, not of the routing);
- `bias`: the selection bias `e_score_correction_bias`, or null;
- for a router whose linear has a bias (gpt-oss): `hidden` `[8, 32]`, `router_weight`
  `[E, 32]` and `logit_bias` `[E]`, so the backend's `route` (router matrix, hidden
  states and the logit bias) is checked against the module end to end;
- `experts` / `weights`: the chosen ids and weights `[8, k]` exactly as the module
  returns them (DeepSeek-V3 and GLM use `topk(sorted=False)`, so their order is
  torch's; the Rust test pairs ids with weights before comparing);
- the config values the routing depends on.

Routing is decided by comparisons, so a near tie at the top-k boundary would make the
golden depend on rounding. The script refuses (exit 1) to write a case whose smallest
gap between the k-th and (k+1)-th selection key (and, with groups, between the kept and
dropped group scores) is under MIN_GAP; the seeds below pass.

Usage: scripts/golden/gen_routing_golden.py [--out tests/data/routing_golden.json]
Needs torch and transformers (>= 5; the routers are the 5.x `*TopKRouter` classes).
"""

import argparse
import json
import re
import sys
from pathlib import Path

import torch
import transformers

TOKENS = 8
HIDDEN = 32
MIN_GAP = 1e-4

# name -> (module path, config class, router class, config kwargs, seed,
#          selection-bias scale or None, router linear-bias scale or None)
CASES = {
    "deepseek_v3_groups": (
        "deepseek_v3", "DeepseekV3Config", "DeepseekV3TopkRouter",
        dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
             norm_topk_prob=True, routed_scaling_factor=2.5),
        11, 0.3, None),
    "deepseek_v3_no_norm": (
        "deepseek_v3", "DeepseekV3Config", "DeepseekV3TopkRouter",
        dict(n_routed_experts=32, num_experts_per_tok=6, n_group=8, topk_group=3,
             norm_topk_prob=False, routed_scaling_factor=1.5),
        12, 0.3, None),
    "glm4_moe": (
        "glm4_moe", "Glm4MoeConfig", "Glm4MoeTopkRouter",
        dict(n_routed_experts=16, num_experts_per_tok=4, n_group=1, topk_group=1,
             norm_topk_prob=True, routed_scaling_factor=2.5),
        13, 0.3, None),
    "mixtral": (
        "mixtral", "MixtralConfig", "MixtralTopKRouter",
        dict(num_local_experts=8, num_experts_per_tok=2),
        14, None, None),
    "gpt_oss": (
        "gpt_oss", "GptOssConfig", "GptOssTopKRouter",
        dict(num_local_experts=16, num_experts_per_tok=4),
        15, None, 0.5),
    "qwen3_moe_norm": (
        "qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeTopKRouter",
        dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=True),
        16, None, None),
    "qwen3_moe_no_norm": (
        "qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeTopKRouter",
        dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=False),
        17, None, None),
    "qwen3_next": (
        "qwen3_next", "Qwen3NextConfig", "Qwen3NextTopKRouter",
        dict(num_experts=32, num_experts_per_tok=8, norm_topk_prob=True),
        18, None, None),
}


def gap_top_k(keys, k):
    """Smallest gap, over rows, between the k-th and (k+1)-th largest key."""
    if k >= keys.shape[-1]:
        return float("inf")
    s = torch.sort(keys, dim=-1, descending=True).values
    return (s[:, k - 1] - s[:, k]).min().item()


def run_case(name, module, config_cls, router_cls, kwargs, seed, sel_bias, lin_bias):
    mod = __import__(f"transformers.models.{module}.modeling_{module}", fromlist=[router_cls])
    cfg_mod = __import__(f"transformers.models.{module}.configuration_{module}", fromlist=[config_cls])
    config = getattr(cfg_mod, config_cls)(hidden_size=HIDDEN, **kwargs)
    router = getattr(mod, router_cls)(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) * 0.5)
        if sel_bias is not None:
            b = router.e_score_correction_bias
            b.copy_((torch.rand(b.shape, generator=g) * 2 - 1) * sel_bias)
        if lin_bias is not None:
            router.bias.copy_((torch.rand(router.bias.shape, generator=g) * 2 - 1) * lin_bias)
        h = torch.randn(TOKENS, HIDDEN, generator=g)
        logits, weights, experts = router(h)
    logits = logits.float()
    e = logits.shape[-1]
    k = kwargs["num_experts_per_tok"]

    # Tie guard, on the keys the module compares.
    if sel_bias is not None:
        keys = logits.sigmoid() + router.e_score_correction_bias
        n_group, topk_group = kwargs["n_group"], kwargs["topk_group"]
        gs = keys.view(TOKENS, n_group, e // n_group).topk(2, dim=-1)[0].sum(-1)
        gap = gap_top_k(gs, topk_group)
        grp = gs.topk(topk_group, dim=-1)[1]
        mask = torch.zeros_like(gs).scatter_(1, grp, 1).bool()
        mask = mask.unsqueeze(-1).expand(-1, n_group, e // n_group).reshape(TOKENS, e)
        gap = min(gap, gap_top_k(keys.masked_fill(~mask, float("-inf")), k))
        # The bias and the groups must each change some token's choice, or the golden
        # would not test them.
        plain = logits.sigmoid().topk(k, dim=-1)[1].sort(-1).values
        biased = keys.topk(k, dim=-1)[1].sort(-1).values
        chosen = experts.sort(-1).values
        bias_matters = int((plain != biased).any(-1).sum())
        groups_matter = int((biased != chosen).any(-1).sum())
    else:
        gap = gap_top_k(logits, k)
        bias_matters = groups_matter = None
    if gap < MIN_GAP:
        print(f"{name}: top-k gap {gap:.3g} < {MIN_GAP}; pick another seed", file=sys.stderr)
        sys.exit(1)
    print(f"{name}: E {e} k {k} gap {gap:.4f} bias changes {bias_matters} tokens, "
          f"groups change {groups_matter}", file=sys.stderr)

    case = dict(
        name=name,
        router=router_cls,
        config=dict(kwargs),
        n_experts=e,
        top_k=k,
        logits=logits.flatten().tolist(),
        bias=None if sel_bias is None else router.e_score_correction_bias.float().tolist(),
        experts=experts.flatten().tolist(),
        weights=weights.float().flatten().tolist(),
    )
    if lin_bias is not None:
        case.update(
            hidden=h.flatten().tolist(),
            router_weight=router.weight.float().flatten().tolist(),
            logit_bias=router.bias.float().tolist(),
        )
    return case


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/data/routing_golden.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cases = [run_case(name, *spec) for name, spec in CASES.items()]
    doc = dict(
        generator="scripts/golden/gen_routing_golden.py",
        transformers=transformers.__version__,
        torch=torch.__version__,
        tokens=TOKENS,
        cases=cases,
    )
    text = json.dumps(doc, indent=1)
    # One line per array of numbers, so the file diffs by case and field.
    text = re.sub(r"\[\s*([-0-9.e,\s]+?)\s*\]", lambda m: "[" + ",".join(m.group(1).replace(",", " ").split()) + "]", text)
    Path(args.out).write_text(text + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
