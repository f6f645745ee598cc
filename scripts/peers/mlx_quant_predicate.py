#!/usr/bin/env python3
"""mlx-lm's own choice of width and group for every quantizable module of a model.

Usage: mlx_quant_predicate.py CONFIG_JSON PROFILE [PROFILE...]

Builds the model CONFIG_JSON describes (random weights: only the module tree matters),
quantizes it with mlx_lm.utils.quantize_model as `mlx_lm.convert -q` would, and prints
one JSON object on stdout: {PROFILE: {module path: "int4_g64" | "passthrough"}} for
every module that has `to_quantized` (Linear, Embedding, SwitchLinear).

PROFILE is a gturbo quant profile: int4 and int8 are `-q --q-bits 4|8 --q-group-size 64`
(the model's own quant_predicate applies, e.g. Qwen3-MoE's routers at 8 bits);
mixed-3-4, mixed-3-6 and mixed-4-6 are `--quant-predicate mixed_3_4|...` at group 64,
with the model's own quant_predicate on top (a dict it returns wins), as gturbo applies
the family's overrides on top of a profile. Needs: pip install -r scripts/requirements/requirements-mlx.txt
"""

import contextlib
import json
import sys


def main():
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.convert import mixed_quant_predicate_builder
    from mlx_lm.utils import _get_classes, quantize_model

    mx.set_default_device(mx.cpu)
    config = json.load(open(sys.argv[1]))
    out = {}
    for profile in sys.argv[2:]:
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
        own = getattr(model, "quant_predicate", None)
        if profile in ("int4", "int8"):
            bits, pred = int(profile[3:]), None
        elif profile.startswith("mixed-"):
            mixed = mixed_quant_predicate_builder(profile.replace("-", "_"), model, 64)

            def pred(path, module, mixed=mixed, own=own):
                o = own(path, module) if own is not None else True
                return o if isinstance(o, dict) else mixed(path, module)

            bits = 4
        else:
            raise SystemExit(f"unknown profile {profile}")
        quantizable = [p for p, m in model.named_modules() if hasattr(m, "to_quantized")]
        # quantize_model prints its bits per weight; stdout carries the JSON alone.
        with contextlib.redirect_stdout(sys.stderr):
            quantize_model(model, dict(config), 64, bits, quant_predicate=pred)
        modules = dict(model.named_modules())
        choice = {}
        for p in quantizable:
            m = modules[p]
            b = getattr(m, "bits", None)
            choice[p] = f"int{b}_g{m.group_size}" if b is not None else "passthrough"
        out[profile] = choice
    json.dump(out, sys.stdout, sort_keys=True)


if __name__ == "__main__":
    main()
