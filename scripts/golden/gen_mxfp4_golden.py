#!/usr/bin/env python3
"""Regenerate tests/data/mxfp4_golden.json from MLX-LM's gpt-oss `sanitize` and MLX's
own MXFP4 dequantization, on the CPU, for the experts of tests/data/gptoss_mxfp4_toy.

Usage: python scripts/golden/gen_mxfp4_golden.py OUT.json

Runs with any Python that has mlx and mlx-lm (`source scripts/venv.sh test`; pinned
in scripts/requirements/requirements-mlx.txt). With the pinned versions
`gen_mxfp4_golden.py OUT.json && cmp OUT.json tests/data/mxfp4_golden.json` reproduces
the committed file byte for byte.

The toy's expert tensors (`*_blocks`, `*_scales` as gpt-oss stores them) go through
`mlx_lm.models.gpt_oss.Model.sanitize` (the method itself: it views the blocks as
uint32, flattens the last two axes and splits gate_up's even rows (gate) from its odd
rows (up)). For every layer and part (gate, up, down) of every expert the file keeps:
  weights_sha256   sanitize's U32 words, little-endian, row-major [E, rows, cols/8];
  scales_sha256    sanitize's U8 scales [E, rows, cols/32];
  bf16_sha256      mx.dequantize(w, scales, group_size=32, bits=4, mode="mxfp4") as
                   BF16 bits, row-major [E, rows, cols];
  samples          [expert, row, col, bf16 bits] at the corners and one inner point;
and `mx.quantize(..., mode="mxfp4")`'s shapes and dtypes on the same BF16, so the
layout gturbo stores (U32 [rows, cols/8], U8 [rows, cols/32], no biases) is MLX's.
"""

import hashlib
import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.models import gpt_oss

TOY = Path(__file__).resolve().parents[2] / "tests/data/gptoss_mxfp4_toy/model.safetensors"


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    raw = mx.load(str(TOY))
    experts = {k: v for k, v in raw.items() if ".mlp.experts." in k and "bias" not in k}
    # `sanitize` reads no attribute of `self` on this path.
    clean = gpt_oss.Model.sanitize(None, experts)
    layers = sorted({int(k.split(".")[2]) for k in clean})
    out = {
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "source": "tests/data/gptoss_mxfp4_toy/model.safetensors",
        "layers": [],
    }
    for layer in layers:
        row = {}
        for part in ("gate_proj", "up_proj", "down_proj"):
            p = f"model.layers.{layer}.mlp.experts.{part}"
            w, s = clean[f"{p}.weight"], clean[f"{p}.scales"]
            deq = mx.dequantize(w, s, group_size=32, bits=4, mode="mxfp4")
            bits = np.array(deq.astype(mx.bfloat16).view(mx.uint16))
            e, r, c = bits.shape
            points = [(0, 0, 0), (e - 1, r - 1, c - 1), (0, r - 1, 0), (e - 1, 0, c - 1), (1, 3, 37)]
            wq, sq = mx.quantize(deq[0], group_size=32, bits=4, mode="mxfp4")
            row[part.removesuffix("_proj")] = {
                "shape": [e, r, c],
                "weights_sha256": sha(np.array(w)),
                "scales_sha256": sha(np.array(s)),
                "bf16_sha256": sha(bits),
                "samples": [[a, b, d, int(bits[a, b, d])] for a, b, d in points],
                "mx_quantize": {
                    "weights": [str(wq.dtype), list(wq.shape)],
                    "scales": [str(sq.dtype), list(sq.shape)],
                },
            }
        out["layers"].append(row)
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
