#!/usr/bin/env python3
"""Write the dequantized twin of a BF16 snapshot: every tensor an install quantized,
replaced by MLX's own quantize-then-dequantize of it, stored as exact F32.

Usage: dequantized_twin.py SNAPSHOT_DIR INSTALL_DIR OUT_DIR

The install (a `.gturbo` directory made from SNAPSHOT_DIR) says which tensors it
quantized and how: each resident entry's `scheme` in `resident.bin`'s index and each
expert pool's `scheme` in `manifest.json` (`int{bits}_g{group}`). For each such BF16
matrix the twin holds `scale * q + bias` computed in f32 from `mx.quantize`'s codes,
scales and biases (the install is bit-exact with `mx.quantize`: tests/data/
mlx_q4g64_golden.json), so a `--quant bf16` install of the twin keeps those tensors in
F32 and runs the function the quantized install claims to run, with no rounding of the
dequantized weights. Every other tensor keeps its bytes. Needs MLX (scripts/venv.sh test).
"""

import json
import os
import re
import shutil
import sys

import mlx.core as mx
import numpy as np

SCHEME = re.compile(r"^int(\d+)_g(\d+)$")
EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.\d+\.")


def install_schemes(install):
    """(resident tensor name → scheme, expert-pool layer → scheme) from the install."""
    with open(os.path.join(install, "resident.bin"), "rb") as f:
        head = f.read(16)
        index = json.loads(f.read(int.from_bytes(head[8:16], "little")))
    resident = {t["name"]: t["scheme"] for t in index["tensors"]}
    with open(os.path.join(install, "manifest.json")) as f:
        man = json.load(f)
    pools = {p["layer"]: p["scheme"] for p in man["expert_pools"] if p["sidecar"] is None}
    return resident, pools


def dequantized_f32(bits_u16, scheme):
    """`scale * q + bias` in f32 for MLX's quantization of a BF16 matrix."""
    bits, group = (int(x) for x in SCHEME.match(scheme).groups())
    w = mx.array(bits_u16).view(mx.bfloat16)
    packed, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    one = mx.ones(scales.shape, dtype=mx.float32)
    zero = mx.zeros(biases.shape, dtype=mx.float32)
    codes = np.array(mx.dequantize(packed, one, zero, group_size=group, bits=bits))
    s = np.repeat(np.array(scales.astype(mx.float32)), group, axis=-1)
    b = np.repeat(np.array(biases.astype(mx.float32)), group, axis=-1)
    return (codes * s + b).astype(np.float32)


def rewrite_shard(path, scheme_of):
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out_header, blobs, offset, changed = {}, [], 0, 0
    for name, t in header.items():
        if name == "__metadata__":
            out_header[name] = t
            continue
        start, end = t["data_offsets"]
        data, dtype = raw[base + start:base + end], t["dtype"]
        scheme = scheme_of(name)
        if dtype == "BF16" and len(t["shape"]) == 2 and scheme and SCHEME.match(scheme):
            u16 = np.frombuffer(data, dtype=np.uint16).reshape(t["shape"])
            data, dtype = dequantized_f32(u16, scheme).tobytes(), "F32"
            changed += 1
        out_header[name] = {"dtype": dtype, "shape": t["shape"], "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(out_header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for b in blobs:
            f.write(b)
    return changed


def main():
    snapshot, install, out = sys.argv[1:4]
    resident, pools = install_schemes(install)

    def scheme_of(name):
        if name in resident:
            return resident[name]
        m = EXPERT.match(name)
        return pools.get(int(m.group(1))) if m else None

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(snapshot, out)
    changed = sum(rewrite_shard(os.path.join(out, f), scheme_of)
                  for f in sorted(os.listdir(out)) if f.endswith(".safetensors"))
    print(json.dumps({"dequantized_tensors": changed}))


if __name__ == "__main__":
    main()
