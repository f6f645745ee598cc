#!/usr/bin/env python3
"""Generate a live MLX cross-check set for gturbo's affine quantizer.

Usage: python scripts/peers/mlx_crosscheck.py OUT.json [--seed N] [--per-kind N]

Builds seeded random BF16 matrices covering the group shapes that exercise every
branch of MLX's affine quantize (constant, all-zero, all-negative, tiny ranges under
the 1e-7 scale floor, huge outliers, mixed signs, BF16 denormals, |min| == |max|
ties, exact grids, large magnitudes, random finite bit patterns, and matrices whose
groups mix all of these), quantizes each with `mx.quantize(w, group_size, bits)` on
the CPU at every width and group MLX writes (2, 3, 4, 5, 6, 8 bits x groups of 32,
64, 128), dequantizes with `mx.dequantize`, and writes inputs and outputs as integer
bit patterns to OUT.json. Runs with any Python that has mlx and numpy.

The Rust test `quant_parity::mlx_live_crosscheck` reads the file named by
GTURBO_MLX_CROSSCHECK and requires zero mismatches. Install the pinned MLX with
`pip install -r scripts/requirements/requirements-mlx.txt`.
"""

import argparse
import json
import sys

import mlx.core as mx
import numpy as np

WIDTHS = (2, 3, 4, 5, 6, 8)
groupS = (32, 64, 128)


def f32_to_bf16_bits(x):
    """Round float32 values to BF16 bit patterns, nearest-even (finite inputs)."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return b.astype(np.uint16)


def group_values(kind, rng, width, group):
    """`group` values (as BF16 bits) for one group of the given kind, for codes of
    `width` bits."""
    if kind == "normal":
        v = rng.standard_normal(group) * 10.0 ** rng.uniform(-4, 1)
    elif kind == "constant":
        v = np.full(group, rng.standard_normal() * 10.0 ** rng.uniform(-3, 2))
    elif kind == "all_zero":
        # Mix +0.0 and -0.0: both must code as 0 with bias 0.
        return np.where(rng.random(group) < 0.5, 0x0000, 0x8000).astype(np.uint16)
    elif kind == "all_negative":
        v = -np.abs(rng.standard_normal(group)) * 10.0 ** rng.uniform(-3, 1) - 1e-3
    elif kind == "tiny":
        # Spans below levels * 1e-7 (levels >= 3), so the first scale estimate hits
        # the 1e-7 floor.
        v = rng.standard_normal(group) * 1e-8 + rng.choice([0.0, 1e-6, -3e-7])
    elif kind == "huge_outlier":
        v = rng.standard_normal(group) * 0.02
        v[rng.integers(group)] = rng.choice([-1, 1]) * 10.0 ** rng.uniform(1, 4)
    elif kind == "mixed_sign":
        v = rng.uniform(-1, 1, group) * rng.choice([1e-2, 1.0, 50.0])
        v[rng.integers(group)] = -v.max() * rng.uniform(0.5, 2.0)
    elif kind == "denormal":
        # BF16 denormals: exponent field 0, random mantissa and sign, a few zeros.
        bits = rng.integers(1, 0x80, group).astype(np.uint16)
        bits |= np.where(rng.random(group) < 0.5, 0x8000, 0).astype(np.uint16)
        bits[rng.integers(group)] = 0
        return bits
    elif kind == "tie":
        # |min| == |max|: MLX takes max as the edge (strict comparison).
        a = abs(rng.standard_normal()) + 0.1
        v = rng.uniform(-a, a, group)
        v[0], v[1] = a, -a
        bits = f32_to_bf16_bits(v)
        bits[0] = f32_to_bf16_bits(np.float32(a))
        bits[1] = bits[0] | 0x8000
        return bits
    elif kind == "grid":
        step = 2.0 ** int(rng.integers(-8, 4))
        n = 1 << width
        v = (rng.integers(0, n, group) - rng.integers(0, n)) * step
    elif kind == "large":
        v = rng.standard_normal(group) * 10.0 ** rng.uniform(20, 36)
    elif kind == "random_bits":
        # Any finite BF16 with exponent field <= 0xFD, so max - min stays finite.
        exp = rng.integers(0, 0xFE, group).astype(np.uint16)
        man = rng.integers(0, 0x80, group).astype(np.uint16)
        sign = np.where(rng.random(group) < 0.5, 0x8000, 0).astype(np.uint16)
        return sign | (exp << 7) | man
    else:
        raise ValueError(kind)
    return f32_to_bf16_bits(np.asarray(v, dtype=np.float32))


KINDS = [
    "normal",
    "constant",
    "all_zero",
    "all_negative",
    "tiny",
    "huge_outlier",
    "mixed_sign",
    "denormal",
    "tie",
    "grid",
    "large",
    "random_bits",
]


def make_matrix(kind, rng, bits, group):
    rows = int(rng.integers(1, 9))
    cols = group * int(rng.integers(1, 5))
    groups = []
    for _ in range(rows * cols // group):
        k = rng.choice(KINDS) if kind == "mixed" else kind
        groups.append(group_values(k, rng, bits, group))
    return np.concatenate(groups).reshape(rows, cols)


def bits_list(a):
    return np.array(a).ravel().tolist()


def run_case(name, kind, bits, group, w_bits):
    w = mx.array(w_bits).view(mx.bfloat16)
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    dq = mx.dequantize(q, s, b, group_size=group, bits=bits)
    assert q.dtype == mx.uint32 and s.dtype == mx.bfloat16 and dq.dtype == mx.bfloat16
    return {
        "name": name,
        "kind": kind,
        "bits": bits,
        "group_size": group,
        "shape": list(w_bits.shape),
        "w_bf16_bits": bits_list(w_bits),
        "q_u32": bits_list(q),
        "scales_bf16_bits": bits_list(s.view(mx.uint16)),
        "biases_bf16_bits": bits_list(b.view(mx.uint16)),
        "dequant_bf16_bits": bits_list(dq.view(mx.uint16)),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=20250101)
    ap.add_argument(
        "--per-kind", type=int, default=3, help="matrices per kind, width and group size"
    )
    args = ap.parse_args()

    mx.set_default_device(mx.cpu)
    rng = np.random.default_rng(args.seed)
    cases = []
    for bits in WIDTHS:
        for group in groupS:
            for kind in KINDS + ["mixed"]:
                for i in range(args.per_kind):
                    w_bits = make_matrix(kind, rng, bits, group)
                    name = f"{kind}_{bits}b_g{group}_{i}"
                    cases.append(run_case(name, kind, bits, group, w_bits))
    groups = sum(len(c["scales_bf16_bits"]) for c in cases)
    doc = {
        "format": "mlx affine quantize cross-check; all arrays flattened row-major; "
        "each row of q_u32 is one little-endian bit stream, element k's code at stream bits "
        "[bits*k, bits*k+bits), stream bit i = bit i%32 of word i/32",
        "mlx_version": mx.__version__,
        "seed": args.seed,
        "cases": cases,
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    print(f"wrote {len(cases)} matrices, {groups} groups, mlx {mx.__version__} -> {args.out}")


if __name__ == "__main__":
    sys.exit(main())
