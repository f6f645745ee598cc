#!/usr/bin/env python3
"""Regenerate tests/data/mlx_q4g64_golden.json from MLX (pinned in
scripts/requirements/requirements-mlx.txt).

Usage:
  python scripts/golden/gen_golden.py OUT.json [--inputs tests/data/mlx_q4g64_golden.json]
  python scripts/golden/gen_golden.py OUT.json --fresh SEED

Every MLX-derived field (packed words, scales, biases, dequantized values and both
matvec outputs) is recomputed with MLX on the CPU. The inputs (weights `w` and the
matvec vector `x`, case names, shapes, notes) are data: by default they are read from
an existing golden file, because the random draw that first produced the committed
one is not recorded; so `gen_golden.py OUT.json && cmp OUT.json
tests/data/mlx_q4g64_golden.json` checks that the pinned MLX reproduces every output
byte for byte. `--fresh SEED` draws new inputs with the same recipe (small normal
weights plus the special rows the notes name) for a new golden set.

Output schema (compact JSON, keys in this order):
  format, mlx_version, packing, dequant, y_fp32_matvec, y_bf16_bits_mlxcpu_matvec:
    strings describing the fields;
  cases[]: name, shape [R, C], notes[], w_bf16_bits (R*C), q_u32 (R*C/8), q_shape,
    scales_bf16_bits (R*C/64), biases_bf16_bits, scales_shape, dequant_bf16_bits
    (R*C), x_bf16_bits (C), y_fp32_matvec (R floats), y_bf16_bits_mlxcpu_matvec (R).
"""

import argparse
import json
import sys

import mlx.core as mx
import numpy as np

GROUP = 64
BITS = 4

HEADER = {
    "format": "mlx affine quantize, bits=4, group_size=64, row-major; all arrays flattened row-major",
    "packing": "q_u32[row, k//8] bits [4*(k%8), 4*(k%8)+3] = nibble of element k (element 0 in "
    "lowest nibble); little-endian u32",
    "dequant": "w[r,k] = scale[r,k//64] * nib + bias[r,k//64]; MLX CPU bf16 dequant = "
    "bf16(bf16(nib*scale) + bias) (two RNE roundings)",
    "y_fp32_matvec": "y[n] = sum_k x[k] * (scale*nib + bias) in fp32 (x, scale, bias upcast from "
    "bf16), compare with tolerance ~1e-5 rel",
    "y_bf16_bits_mlxcpu_matvec": "MLX x86 CPU bf16 qmm: sequential k=0..K-1 accumulation with "
    "every op rounded to bf16 (low precision; informational only)",
}


def to_bf16_bits(x):
    """float32 -> BF16 bit patterns, round to nearest even (finite inputs)."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def bf16(bits, shape):
    return mx.array(np.asarray(bits, dtype=np.uint16).reshape(shape)).view(mx.bfloat16)


def fresh_inputs(seed):
    """New inputs with the committed file's recipe: names, shapes, notes, special rows."""
    rng = np.random.default_rng(seed)

    def normal(shape, std):
        return rng.standard_normal(shape).astype(np.float32) * std

    w0 = normal((4, 64), 0.03)
    w0[1, :] = 0.0
    w0[2, :] = -0.75
    w0[3, :] = -np.abs(normal(64, 0.01)) - 1e-3
    w1 = normal((8, 128), 0.02)
    w1[0, 64:] = 0.125
    w1[5, 64 + 7], w1[5, 64 + 30] = 3.0, -1.5
    w1[6, 3] = -2.0
    w2 = normal((3, 192), 0.02)
    w2[1, 128:] = np.linspace(0, 15, 64)
    w2[2, :64] = np.tile(np.arange(16), 4)
    specs = [
        ("case0", w0, ["row1 group0: all zeros", "row2 group0: constant -0.75",
                       "row3 group0: all negative"]),
        ("case1", w1, ["row0 group1: constant 0.125", "row5 group1: outliers +3.0 and -1.5",
                       "row6 group0: negative outlier -2.0 (|min|>|max| branch)"]),
        ("case2", w2, ["row1 group2: linspace 0..15", "row2 group0: 0..15 repeated (exact grid)"]),
    ]
    return [
        {
            "name": name,
            "shape": list(w.shape),
            "notes": notes,
            "w_bf16_bits": to_bf16_bits(w).ravel().tolist(),
            "x_bf16_bits": to_bf16_bits(normal(w.shape[1], 1.0)).ravel().tolist(),
        }
        for name, w, notes in specs
    ]


def u16_list(a):
    return np.array(a.view(mx.uint16)).ravel().tolist()


def build_case(inp):
    rows, cols = inp["shape"]
    w = bf16(inp["w_bf16_bits"], (rows, cols))
    x = bf16(inp["x_bf16_bits"], (1, cols))
    q, s, b = mx.quantize(w, group_size=GROUP, bits=BITS)
    dq = mx.dequantize(q, s, b, group_size=GROUP, bits=BITS)
    f32 = mx.float32
    # MLX's f32 quantized matmul accumulates k = 0..K-1 in f32, the order the Rust
    # test reproduces exactly.
    y32 = mx.quantized_matmul(x.astype(f32), q, s.astype(f32), b.astype(f32),
                              transpose=True, group_size=GROUP, bits=BITS)
    ybf = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=GROUP, bits=BITS)
    return {
        "name": inp["name"],
        "shape": [rows, cols],
        "notes": inp["notes"],
        "w_bf16_bits": list(inp["w_bf16_bits"]),
        "q_u32": np.array(q).ravel().tolist(),
        "q_shape": list(q.shape),
        "scales_bf16_bits": u16_list(s),
        "biases_bf16_bits": u16_list(b),
        "scales_shape": list(s.shape),
        "dequant_bf16_bits": u16_list(dq),
        "x_bf16_bits": list(inp["x_bf16_bits"]),
        "y_fp32_matvec": [float(v) for v in np.array(y32).ravel()],
        "y_bf16_bits_mlxcpu_matvec": u16_list(ybf),
    }


def main():
    ap = argparse.ArgumentParser(description="Regenerate the MLX INT4 golden vectors.")
    ap.add_argument("out")
    ap.add_argument("--inputs", default="tests/data/mlx_q4g64_golden.json",
                    help="golden file whose inputs (w, x, names, notes) are reused")
    ap.add_argument("--fresh", type=int, metavar="SEED",
                    help="draw new inputs from this seed instead of reading --inputs")
    args = ap.parse_args()

    mx.set_default_device(mx.cpu)
    if args.fresh is not None:
        inputs = fresh_inputs(args.fresh)
    else:
        with open(args.inputs) as f:
            inputs = json.load(f)["cases"]
    doc = {"format": HEADER["format"], "mlx_version": mx.__version__}
    doc.update({k: v for k, v in HEADER.items() if k != "format"})
    doc["cases"] = [build_case(i) for i in inputs]
    with open(args.out, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    print(f"wrote {len(doc['cases'])} cases, mlx {mx.__version__} -> {args.out}")


if __name__ == "__main__":
    sys.exit(main())
