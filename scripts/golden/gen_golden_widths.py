#!/usr/bin/env python3
"""Regenerate tests/data/mlx_quant_widths_golden.json from MLX (pinned in
scripts/requirements/requirements-mlx.txt): affine quantization at every width and group MLX
writes (2, 3, 4, 5, 6, 8 bits x groups of 32, 64, 128), on the CPU.

Usage: python scripts/golden/gen_golden_widths.py OUT.json [--seed N]

Runs with any Python that has mlx and numpy. The inputs are drawn from a seeded
generator, so with the pinned MLX `gen_golden_widths.py OUT.json && cmp OUT.json
tests/data/mlx_quant_widths_golden.json` reproduces the committed file byte for byte.

Each case is one BF16 matrix of ROWS x COLS whose rows exercise the branches of the
affine formula at that group size: random normal weights; a row of all-zero, constant
and BF16-denormal groups; an all-negative row; a row of small weights with one huge
outlier per group; a row of |min| == |max| ties and spans under the 1e-7 scale floor;
and an exact code grid of the case's width. For each case MLX gives:
  q_u32              mx.quantize's packed words, [ROWS, COLS*bits/32] flattened;
  scales_bf16_bits,  its BF16 scales and biases, [ROWS, COLS/group] flattened;
  biases_bf16_bits
  codes              mx.dequantize(q, scales=1, biases=0): the integer codes, as MLX
                     itself unpacks them (independent of any packing rule written here);
  dequant_bf16_bits  mx.dequantize(q, scales, biases) on the BF16 arrays;
  dequant_f32_bits   mx.dequantize(q, f32(scales), f32(biases)): the f32 dequantization.
"""

import argparse
import json
import sys

import mlx.core as mx
import numpy as np

WIDTHS = (2, 3, 4, 5, 6, 8)
GROUPS = (32, 64, 128)
ROWS = 6
COLS = 256

HEADER = {
    "format": "mlx affine quantize (CPU), BF16 input; all arrays flattened row-major",
    "packing": "each row of q_u32 is one little-endian bit stream (word j holds stream bits "
    "32j..32j+31, bit 0 the word's least significant bit); element k's code occupies stream "
    "bits [bits*k, bits*k + bits), lowest bit first",
    "codes": "mx.dequantize(q, ones, zeros) as integers: MLX's own unpacking",
    "dequant_bf16_bits": "mx.dequantize on BF16 scales/biases: bf16(bf16(code*scale) + bias)",
    "dequant_f32_bits": "mx.dequantize on f32-widened scales/biases: f32(f32(code*scale) + bias)",
}


def to_bf16_bits(x):
    """float32 -> BF16 bit patterns, round to nearest even (finite inputs)."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def rows_for(bits, group, rng):
    """The ROWS x COLS input (BF16 bits) and one note per row."""
    n_groups = COLS // group
    rows, notes = [], []

    rows.append(to_bf16_bits(rng.standard_normal(COLS) * 0.05))
    notes.append("random normal, sd 0.05")

    # Groups cycle through all-zero (mixed +0/-0), constant, BF16 denormals.
    row = []
    for g in range(n_groups):
        kind = g % 3
        if kind == 0:
            row.append(np.where(rng.random(group) < 0.5, 0x0000, 0x8000).astype(np.uint16))
        elif kind == 1:
            row.append(np.full(group, to_bf16_bits(np.float32(rng.standard_normal())), np.uint16))
        else:
            d = rng.integers(1, 0x80, group).astype(np.uint16)
            d |= np.where(rng.random(group) < 0.5, 0x8000, 0).astype(np.uint16)
            row.append(d)
    rows.append(np.concatenate(row))
    notes.append("groups cycle: all zero (+0/-0), constant, BF16 denormals")

    rows.append(to_bf16_bits(-np.abs(rng.standard_normal(COLS)) * 0.3 - 1e-3))
    notes.append("all negative")

    v = rng.standard_normal(COLS) * 0.02
    for g in range(n_groups):
        v[g * group + rng.integers(group)] = rng.choice([-1, 1]) * 10.0 ** rng.uniform(1, 3)
    rows.append(to_bf16_bits(v))
    notes.append("one huge outlier per group")

    # Alternate groups: |min| == |max| (max is the edge), span below levels * 1e-7.
    row = []
    for g in range(n_groups):
        if g % 2 == 0:
            a = np.float32(abs(rng.standard_normal()) + 0.1)
            t = to_bf16_bits(rng.uniform(-a, a, group))
            t[0] = to_bf16_bits(a)
            t[1] = t[0] | 0x8000
        else:
            t = to_bf16_bits(rng.standard_normal(group) * 1e-8 + rng.choice([0.0, 1e-6, -3e-7]))
        row.append(t)
    rows.append(np.concatenate(row))
    notes.append("groups alternate: |min| == |max| tie, span under the 1e-7 scale floor")

    levels = (1 << bits) - 1
    step = 2.0 ** int(rng.integers(-6, 2))
    rows.append(to_bf16_bits((rng.integers(0, levels + 1, COLS) - levels // 3) * step))
    notes.append(f"exact grid of {levels + 1} levels, step {step}")

    return np.stack(rows), notes


def flat(a):
    return np.array(a).ravel().tolist()


def run_case(bits, group, rng):
    w_bits, notes = rows_for(bits, group, rng)
    w = mx.array(w_bits).view(mx.bfloat16)
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    assert q.dtype == mx.uint32 and q.shape == (ROWS, COLS * bits // 32)
    assert s.dtype == mx.bfloat16 and s.shape == (ROWS, COLS // group)
    ones = mx.ones(s.shape, dtype=mx.float32)
    zeros = mx.zeros(s.shape, dtype=mx.float32)
    codes = mx.dequantize(q, ones, zeros, group_size=group, bits=bits)
    dq = mx.dequantize(q, s, b, group_size=group, bits=bits)
    dq32 = mx.dequantize(
        q, s.astype(mx.float32), b.astype(mx.float32), group_size=group, bits=bits
    )
    assert dq.dtype == mx.bfloat16 and dq32.dtype == mx.float32
    codes = np.array(codes)
    assert np.all(codes == np.round(codes)) and codes.min() >= 0 and codes.max() < (1 << bits)
    return {
        "name": f"{bits}b_g{group}",
        "bits": bits,
        "group_size": group,
        "shape": [ROWS, COLS],
        "notes": notes,
        "w_bf16_bits": flat(w_bits),
        "q_u32": flat(q),
        "scales_bf16_bits": flat(s.view(mx.uint16)),
        "biases_bf16_bits": flat(b.view(mx.uint16)),
        "codes": [int(c) for c in codes.ravel()],
        "dequant_bf16_bits": flat(dq.view(mx.uint16)),
        "dequant_f32_bits": flat(dq32.view(mx.uint32)),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=20260101)
    args = ap.parse_args()

    mx.set_default_device(mx.cpu)
    rng = np.random.default_rng(args.seed)
    cases = [run_case(bits, group, rng) for bits in WIDTHS for group in GROUPS]
    doc = dict(HEADER, mlx_version=mx.__version__, seed=args.seed, cases=cases)
    with open(args.out, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {len(cases)} cases, mlx {mx.__version__} -> {args.out}")


if __name__ == "__main__":
    sys.exit(main())
