#!/usr/bin/env python3
"""Golden logits for `gturbo run`'s decoder, from mlx-lm on the same INT4 g64 weights.

For each tiny random family (qwen3, qwen3_moe) this script
1. writes the snapshot with `gturbo-dev replica FAMILY DIR --seed SEED` (the Rust test
   rebuilds the very same bytes from `Qwen3Spec::tiny()` / `Qwen3MoeSpec::tiny()` with
   that seed);
2. converts it with `mlx_lm.convert(quantize=True, q_group_size=64, q_bits=4)`, whose
   bytes equal gturbo's INT4 install (tests/it/mlx_lm_parity.rs proves that per
   tensor; mlx-lm puts the qwen3_moe router `mlp.gate` at 8 bits as gturbo's family
   policy does);
3. loads the converted model and casts its floating parameters (BF16 scales, biases
   and norms; widening is exact) to float32 so activations are float32 as in gturbo
   (mlx-lm would otherwise compute in BF16, ~1e-2 relative noise);
4. runs a fixed 32-token prompt of token ids and records the logits at every
   position, then 32 greedy tokens (full recompute per step, no KV cache, so the
   reference shares no cache logic with gturbo).

Random-init tiny models can have near-tie logits, which would make greedy tokens
depend on rounding. The script records the gap between the best and second-best
logit at every greedy step and refuses (exit 1) to write a golden whose smallest gap
is under MIN_GAP; the seeds below were picked so that does not happen.

Usage: scripts/golden/gen_runtime_golden.py [--gturbo-dev PATH] [--out-dir tests/data]
Needs: pip install -r scripts/requirements/requirements-mlx.txt
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

FAMILIES = {
    # family id -> (replica kind, seed)
    "qwen3": ("qwen3", 7),
    "qwen3_moe": ("qwen3-moe", 7),
}
PROMPT_LEN = 32
GREEDY_STEPS = 32
MIN_GAP = 2e-3


def prompt_ids(vocab):
    """32 deterministic ids below the ChatML specials (which take the last 3 ids)."""
    x, out = 12345, []
    for _ in range(PROMPT_LEN):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(x % (vocab - 3))
    return out


def main():
    ap = argparse.ArgumentParser()
    root = Path(__file__).resolve().parents[2]
    ap.add_argument("--gturbo-dev", default=str(root / "target/debug/gturbo-dev"))
    ap.add_argument("--out-dir", type=Path, default=root / "tests/data")
    ap.add_argument("--only", choices=sorted(FAMILIES))
    args = ap.parse_args()

    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm import convert
    from mlx_lm.utils import load_model

    mx.set_default_device(mx.cpu)
    for family, (kind, seed) in FAMILIES.items():
        if args.only and family != args.only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            snap, conv = Path(tmp) / "snap", Path(tmp) / "mlx"
            subprocess.run([args.gturbo_dev, "replica", kind, str(snap), "--seed", str(seed)], check=True)
            convert(str(snap), str(conv), quantize=True, q_group_size=64, q_bits=4)
            qconf = json.loads((conv / "config.json").read_text()).get("quantization", {})
            model, config = load_model(conv)
            model.set_dtype(mx.float32)
            vocab = config["vocab_size"]
            ids = prompt_ids(vocab)
            logits = model(mx.array([ids]))[0].astype(mx.float32)
            mx.eval(logits)
            seq, greedy, gaps = list(ids), [], []
            for _ in range(GREEDY_STEPS):
                last = model(mx.array([seq]))[0, -1].astype(mx.float32)
                top2 = sorted(last.tolist(), reverse=True)[:2]
                t = int(mx.argmax(last).item())
                greedy.append(t)
                gaps.append(top2[0] - top2[1])
                seq.append(t)
            if min(gaps) < MIN_GAP:
                print(f"{family}: seed {seed} has a greedy near-tie (gap {min(gaps):.2e}); pick another seed",
                      file=sys.stderr)
                return 1
            router_bits = sorted({v.get("bits") for k, v in qconf.items()
                                  if isinstance(v, dict) and k.endswith("mlp.gate")})
            doc = {
                "what": f"mlx-lm logits and greedy tokens for the tiny {family} replica at INT4 g64 "
                        "(float32 activations); written by scripts/golden/gen_runtime_golden.py",
                "family": family,
                "replica": kind,
                "seed": seed,
                "mlx_lm_quantization": {"group_size": qconf.get("group_size"), "bits": qconf.get("bits"),
                                         "router_bits": router_bits},
                "vocab_size": vocab,
                "prompt": ids,
                "logits": [[round(v, 6) for v in row] for row in logits.tolist()],
                "greedy": greedy,
                "min_greedy_gap": min(gaps),
            }
            out = args.out_dir / f"runtime_golden_{family}.json"
            out.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
            print(f"{out}: {len(ids)} positions, greedy {greedy[:8]}..., min gap {min(gaps):.3g}, "
                  f"router bits {router_bits}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
