#!/usr/bin/env python3
"""gpt-oss (`GptOssForCausalLM`) toy checkpoint with MXFP4 experts, as the real repo
(openai/gpt-oss-20b) stores it.

Run it in the goldens' virtual environment (target/venv-golden: torch, transformers
5.24.0, safetensors, numpy):

    scripts/golden/golden_venv.sh scripts/golden/gen_gptoss_mxfp4.py           # regenerate
    scripts/golden/golden_venv.sh scripts/golden/gen_gptoss_mxfp4.py --check   # compare

CI never runs this script: tests/it/mxfp4.rs and tests/it/gptoss_mxfp4.rs read the
committed tests/data/gptoss_mxfp4_toy/.

The model: transformers' own `GptOssConfig` (hidden 64, 2 layers alternating sliding
(window 8) and full attention, 4 heads of 16 over 2 KV heads, 4 experts top-2,
intermediate 64, vocab 512, YaRN as the real config), weights drawn by
`GptOssForCausalLM` under torch.manual_seed(SEED) and cast to BF16. The routed experts
are drawn directly as MXFP4 (seeded numpy: uniform random code bytes, scale exponents
in 119..=125, i.e. 2^-8..2^-2) and the BF16 model's experts are set to what
transformers' own `convert_moe_packed_tensors` dequantizes them to, so the BF16 model
equals the MXFP4 checkpoint dequantized; expert biases are random (BF16).

Saved as the real repo stores it: `model.layers.L.mlp.experts.gate_up_proj_blocks` U8
[E, 2I, H/32, 16] and `_scales` U8 [E, 2I, H/32] (rows interleaved: even rows gate,
odd rows up), `down_proj_blocks` U8 [E, H, I/32, 16] and `_scales` U8 [E, H, I/32],
`gate_up_proj_bias` BF16 [E, 2I], `down_proj_bias` BF16 [E, H], everything else BF16
under transformers' names; config.json with the real `quantization_config` (quant_method
mxfp4, modules_to_not_convert as openai/gpt-oss-20b lists them). The tokenizer is the
Mixtral toy's (tests/data/mixtral_toy, vocab 512), copied.

The goldens (golden/, the files and format of scripts/golden/gen_gptoss_golden.py):
transformers reads the written checkpoint itself (`from_pretrained` with
`Mxfp4Config(dequantize=True)`: its own `convert_moe_packed_tensors` of the blocks, the
dequantized reference), eager attention and experts, one thread. The prompt (17 ids)
runs past the window of 8 and the greedy rollout (24 ids, full recompute per step) wraps
it several times. Greedy ids come from the f32 model; the stored logits (`logits` [T, V]
of the prompt, `step_logits` [S, V] of the rollout) from the same checkpoint in f64,
which must pick the same ids. meta.json records the smallest greedy gap and router
margin (refused under MIN_GAP / MIN_ROUTER_MARGIN).

`--check` regenerates into a temporary directory and compares every checkpoint file byte
for byte and the goldens (ids exact, logits within CHECK_F32_TOL), and checks that
transformers itself reads the blocks back as the BF16 model's experts
(`convert_moe_packed_tensors` of the files' bytes: [E, H, 2I] and [E, I, H], as
`GptOssExperts` stores them).
"""

from __future__ import annotations

import filecmp
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig, GptOssForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_gptoss_golden as go  # noqa: E402  (RouterTap, greedy)
import gen_mixtral_golden as mx  # noqa: E402  (tokenizer, prompt, json, safetensors)

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests/data/gptoss_mxfp4_toy"
TOKENIZER = ROOT / "tests/data/mixtral_toy"
SEED = 20261203
HIDDEN, INTER, EXPERTS, LAYERS = 64, 64, 4, 2
WINDOW = 8
GREEDY_STEPS = 24
# The smallest greedy gap (top-1 minus top-2 logit) and router margin (k-th minus
# (k+1)-th router logit) accepted: gturbo's f32 arithmetic is ~1e-5 from the reference,
# so ties closer than these could flip a token or an expert.
MIN_GAP = 1e-3
MIN_ROUTER_MARGIN = 5e-4
CHECK_F32_TOL = 1e-4
# openai/gpt-oss-20b's config.json.
NOT_CONVERTED = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
]


def config() -> GptOssConfig:
    return GptOssConfig(
        num_hidden_layers=LAYERS,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        vocab_size=512,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def mxfp4(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Random MXFP4 blocks [.., rows, cols/32, 16] and scales [.., rows, cols/32]."""
    *lead, cols = shape
    blocks = rng.integers(0, 256, size=(*lead, cols // 32, 16), dtype=np.uint8)
    scales = rng.integers(119, 126, size=(*lead, cols // 32), dtype=np.uint8)
    return blocks, scales


def build(out: Path) -> dict[str, torch.Tensor]:
    """Write the toy into `out`; returns the MXFP4 tensors written."""
    cfg = config()
    torch.manual_seed(SEED)
    model = GptOssForCausalLM(cfg).to(torch.bfloat16).eval()
    rng = np.random.default_rng(SEED)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if ".mlp.experts." in name:
            continue
        tensors[name] = t.contiguous()
    for layer, block in enumerate(model.model.layers):
        p = f"model.layers.{layer}.mlp.experts"
        experts = block.mlp.experts
        for proj, rows, cols in (("gate_up_proj", 2 * INTER, HIDDEN), ("down_proj", HIDDEN, INTER)):
            b, s = mxfp4(rng, (EXPERTS, rows, cols))
            tensors[f"{p}.{proj}_blocks"] = torch.from_numpy(b)
            tensors[f"{p}.{proj}_scales"] = torch.from_numpy(s)
            # transformers' dequantization, in its own [E, in, out] layout.
            deq = convert_moe_packed_tensors(torch.from_numpy(b), torch.from_numpy(s))
            getattr(experts, proj).data.copy_(deq)
            bias = rng.standard_normal((EXPERTS, rows)).astype(np.float32) * 0.1
            tensors[f"{p}.{proj}_bias"] = torch.from_numpy(bias).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    d = cfg.to_dict()
    d.pop("transformers_version", None)
    d["architectures"] = ["GptOssForCausalLM"]
    d["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": NOT_CONVERTED,
    }
    (out / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / f, out / f)
    return tensors


def check_transformers_reads_it(out: Path) -> None:
    """The blocks on disk, dequantized by transformers, are the experts of a model
    built from the same seed (the model the BF16 toy would be)."""
    disk = load_file(out / "model.safetensors")
    for layer in range(LAYERS):
        p = f"model.layers.{layer}.mlp.experts"
        gu = convert_moe_packed_tensors(disk[f"{p}.gate_up_proj_blocks"], disk[f"{p}.gate_up_proj_scales"])
        dn = convert_moe_packed_tensors(disk[f"{p}.down_proj_blocks"], disk[f"{p}.down_proj_scales"])
        assert tuple(gu.shape) == (EXPERTS, HIDDEN, 2 * INTER), gu.shape
        assert tuple(dn.shape) == (EXPERTS, INTER, HIDDEN), dn.shape
        assert torch.isfinite(gu.float()).all() and torch.isfinite(dn.float()).all()


def load(out: Path, dtype: torch.dtype):
    """The checkpoint as transformers reads it, its MXFP4 experts dequantized."""
    model, info = GptOssForCausalLM.from_pretrained(
        out, dtype=dtype, quantization_config=Mxfp4Config(dequantize=True),
        attn_implementation="eager", experts_implementation="eager", output_loading_info=True)
    if any(info.get(k) for k in ("missing_keys", "mismatched_keys", "error_msgs", "unexpected_keys")):
        sys.exit(f"reference load: {info}")
    return model.eval()


def goldens(out: Path) -> dict:
    """golden/{meta.json, prompt.safetensors, greedy.safetensors} of the toy in `out`."""
    import transformers
    from tokenizers import Tokenizer

    torch.set_num_threads(1)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    prompt = tok.encode(mx.PROMPT_TEXT).ids
    if len(prompt) <= WINDOW:
        sys.exit(f"the prompt ({len(prompt)} ids) does not run past the window")
    model = load(out, torch.float32)
    tap = go.RouterTap(model)
    tokens, gaps, step_logits, margins = go.greedy(model, prompt, GREEDY_STEPS, tap)
    with torch.no_grad():
        seq = list(prompt) + tokens[:-1]
        l64 = load(out, torch.float64)(input_ids=torch.tensor([seq]), use_cache=False).logits[0]
    t = len(prompt)
    f32_vs_f64 = float((step_logits.double() - l64[t - 1:]).abs().max())
    plogits, step_logits = l64[:t].float().clone(), l64[t - 1:].float().clone()
    if [int(r.argmax()) for r in step_logits] != tokens:
        sys.exit("the f64 model picks other greedy tokens than the f32 one")
    min_gap, min_margin = min(gaps), min(margins)
    if min_gap < MIN_GAP or min_margin < MIN_ROUTER_MARGIN:
        sys.exit(f"greedy gap {min_gap:.3g} or router margin {min_margin:.3g} too small")
    golden = out / "golden"
    golden.mkdir(parents=True, exist_ok=True)
    mx.save_tensors(golden / "prompt.safetensors", {"logits": plogits})
    mx.save_tensors(golden / "greedy.safetensors", {
        "tokens": torch.tensor(tokens, dtype=torch.int64), "step_logits": step_logits})
    meta = {
        "generator": "scripts/golden/gen_gptoss_mxfp4.py",
        "family": "gpt_oss",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "numpy": np.__version__, "python": sys.version.split()[0]},
        "precision": "transformers reads the MXFP4 checkpoint (Mxfp4Config(dequantize=True)); "
                     "greedy ids from f32 compute, full recompute per step; the stored logits "
                     "from the same checkpoint in f64 (one pass); eager attention and experts; "
                     "1 thread",
        "seed": SEED,
        "prompt_text": mx.PROMPT_TEXT,
        "prompt": prompt,
        "greedy": tokens,
        "gaps": gaps,
        "min_gap": min_gap,
        "min_gap_required": MIN_GAP,
        "router_min_margin": min_margin,
        "router_margin_required": MIN_ROUTER_MARGIN,
        "transformers_f32_vs_f64_logits": f32_vs_f64,
    }
    mx.write_json(golden / "meta.json", meta)
    return meta


def compare_goldens(new: Path, have: Path) -> None:
    """Ids and names exact, logits within CHECK_F32_TOL."""
    a = json.loads((new / "meta.json").read_text())
    b = json.loads((have / "meta.json").read_text())
    for k in ("prompt", "greedy", "prompt_text", "family", "seed"):
        if a[k] != b[k]:
            sys.exit(f"golden/meta.json {k}: {a[k]} vs {b[k]}")
    for f, key in (("prompt.safetensors", "logits"), ("greedy.safetensors", "step_logits")):
        x, y = load_file(new / f)[key], load_file(have / f)[key]
        d = float((x - y).abs().max())
        if x.shape != y.shape or d > CHECK_F32_TOL:
            sys.exit(f"golden/{f} {key}: differs by {d:.3g} (shape {tuple(x.shape)} vs {tuple(y.shape)})")


def main() -> None:
    if sys.argv[1:] == ["--check"]:
        with tempfile.TemporaryDirectory() as tmp:
            build(Path(tmp))
            names = sorted(p.name for p in Path(tmp).iterdir())
            have = sorted(p.name for p in OUT.iterdir() if p.name != "golden")
            if names != have:
                sys.exit(f"files differ: {names} vs {have}")
            for n in names:
                if not filecmp.cmp(Path(tmp) / n, OUT / n, shallow=False):
                    sys.exit(f"{n} differs from the committed toy")
            goldens(Path(tmp))
            compare_goldens(Path(tmp) / "golden", OUT / "golden")
        check_transformers_reads_it(OUT)
        print("gptoss_mxfp4_toy: reproduced byte for byte, goldens within "
              f"{CHECK_F32_TOL}; transformers reads its experts")
        return
    if sys.argv[1:]:
        sys.exit(__doc__)
    build(OUT)
    check_transformers_reads_it(OUT)
    meta = goldens(OUT)
    print(f"wrote {OUT}: greedy {meta['greedy']}, min gap {meta['min_gap']:.3g}, "
          f"router margin {meta['router_min_margin']:.3g}")


if __name__ == "__main__":
    main()
