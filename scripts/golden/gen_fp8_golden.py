#!/usr/bin/env python3
"""Regenerate tests/data/fp8_e4m3_golden.json from MLX-LM's own FP8 dequantization
(mlx-lm and mlx pinned in scripts/requirements/requirements-mlx.txt), on the CPU.

Usage: python scripts/golden/gen_fp8_golden.py OUT.json

Runs with any Python that has mlx and mlx-lm (`source scripts/venv.sh test`). The
inputs come from a seeded generator written out below (and again in the Rust test), so
with the pinned versions `gen_fp8_golden.py OUT.json && cmp OUT.json
tests/data/fp8_e4m3_golden.json` reproduces the committed file byte for byte.

One FP8 e4m3 weight of SHAPE (rows and columns both past one 128-block, so the
bottom and right edge blocks are partial: 320 = 128 + 128 + 64 rows, 192 = 128 + 64
columns) with an F32 `weight_scale_inv` of one scale per 128x128 block goes through
MLX-LM's `deepseek_v3.Model.sanitize` (the method itself, called on a stand-in `self`:
its `dequant` is `bf16(from_fp8(w) * scale_inv[block])`); the BF16 it returns is then
quantized by `mx.quantize(..., group_size=64, bits=4)`. The file keeps the small
things whole (the scales, MLX's decode of all 256 codes, samples at the block edges)
and the large ones as SHA-256 digests of their little-endian bytes, so it stays a
few KB:
  from_fp8_bf16_bits   mx.from_fp8(codes 0..255, bfloat16) as BF16 bit patterns
                       (the two NaN codes included, as MLX gives them);
  fp8_sha256           the generated codes (checks the generator's port);
  bf16_sha256          sanitize's dequantized weight, BF16, row-major;
  bf16_samples         [row, col, bits] at the corners of every block;
  int4_g64             digests of mx.quantize's packed words, scales and biases, and
                       row 0's scales and biases whole.
"""

import hashlib
import json
import sys
import types

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.models import deepseek_v3

NAME = "model.layers.0.mlp.gate_proj.weight"
SHAPE = (320, 192)
SEED = 2463534242
BLOCK = 128


def codes(n, seed):
    """xorshift32 (13, 17, 5) from `seed`; each element is the top byte of the next
    state, and an e4m3 NaN code (b & 0x7f == 0x7f) becomes b ^ 1 (±448)."""
    x = seed
    out = bytearray(n)
    for i in range(n):
        x ^= (x << 13) & 0xFFFFFFFF
        x ^= x >> 17
        x ^= (x << 5) & 0xFFFFFFFF
        b = x >> 24
        if b & 0x7F == 0x7F:
            b ^= 1
        out[i] = b
    return bytes(out)


def scale_inv(rows, cols):
    """One F32 scale per block: 1.7e-4 x (1 + 0.61 k), k the block's row-major index
    (not powers of two, so the products round)."""
    br, bc = -(-rows // BLOCK), -(-cols // BLOCK)
    k = np.arange(br * bc, dtype=np.float32).reshape(br, bc)
    return (np.float32(1.7e-4) * (np.float32(1) + np.float32(0.61) * k)).astype(np.float32)


def sha(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def bits16(a):
    return np.array(a.view(mx.uint16)).astype(np.uint16)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    rows, cols = SHAPE
    raw = codes(rows * cols, SEED)
    w = mx.array(np.frombuffer(raw, dtype=np.uint8).reshape(rows, cols))
    s = scale_inv(rows, cols)
    # `sanitize` reads only `self.args` (its expert stacking and kv_b_proj split loop
    # over the layers and find nothing to do for a dense weight).
    stand_in = types.SimpleNamespace(
        args=types.SimpleNamespace(num_hidden_layers=1, n_routed_experts=0)
    )
    out = deepseek_v3.Model.sanitize(
        stand_in, {NAME: w, NAME + "_scale_inv": mx.array(s)}
    )
    assert set(out) == {NAME}, sorted(out)
    deq = out[NAME]
    assert deq.dtype == mx.bfloat16 and deq.shape == SHAPE
    deq_bits = bits16(deq)
    q, qs, qb = mx.quantize(deq, group_size=64, bits=4)
    mx.eval(q, qs, qb)
    every = mx.array(np.arange(256, dtype=np.uint8))
    table = bits16(mx.from_fp8(every, dtype=mx.bfloat16))
    edges = sorted(
        {0, 1, BLOCK - 1, BLOCK, 2 * BLOCK - 1, 2 * BLOCK, rows - 1} & set(range(rows))
    )
    cedges = sorted({0, BLOCK - 1, BLOCK, cols - 1})
    golden = {
        "format": "FP8 e4m3 128x128 block-scaled weight dequantized by MLX-LM's "
        "deepseek_v3 Model.sanitize, then mx.quantize(group_size=64, bits=4); "
        "digests are SHA-256 of little-endian row-major bytes",
        "mlx_version": mx.__version__,
        "mlx_lm_version": mlx_lm.__version__,
        "from_fp8_bf16_bits": [int(v) for v in table],
        "tensor": NAME,
        "shape": list(SHAPE),
        "generator": "xorshift32 (13, 17, 5) from seed; code = state >> 24; "
        "a NaN code (b & 0x7f == 0x7f) becomes b ^ 1",
        "seed": SEED,
        "fp8_sha256": hashlib.sha256(raw).hexdigest(),
        "scale_inv_f32_bits": [int(v) for v in s.view(np.uint32).reshape(-1)],
        "bf16_sha256": sha(deq_bits),
        "bf16_samples": [[r, c, int(deq_bits[r, c])] for r in edges for c in cedges],
        "int4_g64": {
            "weights_sha256": sha(np.array(q).astype("<u4")),
            "scales_sha256": sha(bits16(qs)),
            "biases_sha256": sha(bits16(qb)),
            "scales_row0_bits": [int(v) for v in bits16(qs)[0]],
            "biases_row0_bits": [int(v) for v in bits16(qb)[0]],
        },
    }
    with open(sys.argv[1], "w") as f:
        json.dump(golden, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
