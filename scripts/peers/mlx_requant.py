#!/usr/bin/env python3
"""What MLX makes of a pre-quantized checkpoint dequantized and quantized again: the
peer of `gturbo install --requantize` (tests/it/mlx_source.rs).

Usage: mlx_requant.py MLX_DIR TARGETS_JSON OUT.safetensors

MLX_DIR is an `mlx_lm.convert` output. TARGETS_JSON maps a quantized module path of it
(`model.layers.0.self_attn.q_proj`) to the scheme gturbo's plan gives it (`int8_g64`,
`int3_g128`, or `passthrough`); a module the source left unquantized is quantized from
its own bytes. For each quantized one, with MLX on the CPU:

    w = mx.dequantize(P.weight, P.scales, P.biases, group_size, bits)   # model dtype
    P.weight, P.scales, P.biases = mx.quantize(w, group_size', bits')    # or P.weight = w

(the source's bits and group from its config.json `quantization` block, as mlx-lm reads
them), and OUT.safetensors holds the results under the source's names. Needs: pip install
-r scripts/requirements/requirements-mlx.txt
"""

import json
import sys
from pathlib import Path


def main():
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    import mlx.core as mx

    mx.set_default_device(mx.cpu)
    src, targets, out = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()), sys.argv[3]
    block = json.loads((src / "config.json").read_text())["quantization"]
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    result = {}
    for path, scheme in sorted(targets.items()):
        if f"{path}.scales" not in weights:
            # Left unquantized by the source: quantized from its own bytes.
            w = weights[f"{path}.weight"]
        else:
            own = block.get(path)
            own = own if isinstance(own, dict) else block
            bits, group = own["bits"], own.get("group_size") or 64
            w = mx.dequantize(
                weights[f"{path}.weight"],
                weights[f"{path}.scales"],
                weights[f"{path}.biases"],
                group_size=group,
                bits=bits,
            )
            if w.dtype != weights[f"{path}.scales"].dtype:
                raise SystemExit(f"{path}: mx.dequantize gave {w.dtype}, not the scales' dtype")
        if scheme == "passthrough":
            result[f"{path}.weight"] = w
            continue
        b, g = scheme.removeprefix("int").split("_g")
        q, s, z = mx.quantize(w, group_size=int(g), bits=int(b))
        result[f"{path}.weight"], result[f"{path}.scales"], result[f"{path}.biases"] = q, s, z
    mx.save_safetensors(out, result)
    print(f"{len(targets)} modules requantized into {out}")


if __name__ == "__main__":
    main()
