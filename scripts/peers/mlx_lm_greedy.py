#!/usr/bin/env python3
"""Greedy token ids from mlx-lm for a model directory, with float32 activations.

Usage: mlx_lm_greedy.py MODEL_DIR IDS_JSON STEPS

Loads MODEL_DIR with mlx-lm (a Hugging Face snapshot or an mlx-lm conversion), casts
its floating parameters to float32 (BF16 widens exactly, so the weights are unchanged
and activations are float32 as in gturbo's runtime), and prints one JSON list: the
STEPS greedy ids after the prompt IDS_JSON (a JSON list of ids), with mlx-lm's own
KV cache (`make_prompt_cache`). Needs: pip install -r scripts/requirements/requirements-mlx.txt
"""

import json
import sys


def main():
    import mlx.core as mx
    from mlx_lm.utils import load_model

    mx.set_default_device(mx.cpu)
    model_dir, ids, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    model, _ = load_model(__import__("pathlib").Path(model_dir))
    model.set_dtype(mx.float32)
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)
    out = []
    for _ in range(steps):
        t = int(mx.argmax(logits[0, -1]).item())
        out.append(t)
        logits = model(mx.array([[t]]), cache=cache)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
