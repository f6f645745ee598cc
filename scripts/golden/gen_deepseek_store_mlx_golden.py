#!/usr/bin/env python3
"""MLX-LM's conversion of the stored DeepSeek toys (issue 26), the bytes gturbo's install
must reproduce: MLX-LM's `deepseek_v3.Model.sanitize` (the method itself, on a stand-in
`self` whose `num_hidden_layers` is 0, so it leaves the experts unstacked and
`kv_b_proj` unsplit) run on every tensor of

  tests/data/deepseek_fp8_toy  FP8 e4m3 + `weight_scale_inv` → `bf16(from_fp8(w) × s)`
  tests/data/kimi_int4_toy     compressed-tensors INT4 experts → MLX affine 4-bit g32:
                               `weight` (the packed words as uint32), `scales`, `biases`
                               (−8 × scales)

Writes tests/data/deepseek_store_mlx_golden.json: per toy, per converted tensor, the
SHA-256 of each output's little-endian row-major bytes, with its dtype and shape.

  source scripts/venv.sh test   # mlx, mlx-lm (scripts/requirements/requirements-mlx.txt)
  python3 scripts/golden/gen_deepseek_store_mlx_golden.py [--check]
"""

import hashlib
import json
import struct
import sys
import types
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.models import deepseek_v3

ROOT = Path(__file__).resolve().parents[2]
TOYS = ["deepseek_fp8_toy", "kimi_int4_toy"]
OUT = ROOT / "tests/data/deepseek_store_mlx_golden.json"
NP = {"F8_E4M3": np.uint8, "F32": np.float32, "I32": np.int32, "BF16": np.uint16}


def read_safetensors(path: Path) -> dict:
    """Every tensor of one file as an MLX array (BF16 from its bits; F8 as the uint8
    codes `sanitize`'s `from_fp8` takes)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        arr = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=NP[t["dtype"]]).reshape(t["shape"])
        x = mx.array(arr)
        out[name] = x.view(mx.bfloat16) if t["dtype"] == "BF16" else x
    return out


def digest(x: mx.array) -> dict:
    mx.eval(x)
    raw = np.array(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x)
    return {"dtype": str(x.dtype).replace("mlx.core.", ""), "shape": list(x.shape),
            "sha256": hashlib.sha256(np.ascontiguousarray(raw).tobytes()).hexdigest()}


def convert(toy: str) -> dict:
    d = ROOT / "tests/data" / toy
    weights = {}
    for f in sorted(d.glob("model-*.safetensors")):
        weights.update(read_safetensors(f))
    stand_in = types.SimpleNamespace(args=types.SimpleNamespace(num_hidden_layers=0))
    out = deepseek_v3.Model.sanitize(stand_in, weights)
    changed = {}
    for k, v in sorted(out.items()):
        src = weights.get(k)
        if src is not None and src.dtype == v.dtype and bool(mx.array_equal(src, v)):
            continue  # passed through untouched
        changed[k] = digest(v)
    return changed


def main():
    golden = {
        "generator": "scripts/golden/gen_deepseek_store_mlx_golden.py",
        "what": "MLX-LM deepseek_v3 Model.sanitize (num_hidden_layers 0: no stacking, no "
                "kv_b_proj split) of each toy's tensors; the outputs it changed, by SHA-256 "
                "of their little-endian row-major bytes",
        "mlx_version": mx.__version__,
        "mlx_lm_version": mlx_lm.__version__,
        "toys": {t: convert(t) for t in TOYS},
    }
    text = json.dumps(golden, indent=1, sort_keys=True) + "\n"
    if "--check" in sys.argv:
        if OUT.read_text() != text:
            sys.exit(f"{OUT} differs from a fresh run")
        print("reproduced")
        return
    OUT.write_text(text)
    print({t: len(v) for t, v in golden["toys"].items()})


if __name__ == "__main__":
    main()
