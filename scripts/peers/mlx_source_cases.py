#!/usr/bin/env python3
"""Make pre-quantized MLX checkpoints with mlx-lm, and mlx-lm's logits on them.

Usage: mlx_source_cases.py SNAPSHOT OUT_DIR PROMPT_IDS_JSON GREEDY_STEPS CASE [CASE...]

For each CASE (q4g64 | q8g64 | q3g128 | mixed_3_6) runs `mlx_lm.convert` of the Hugging
Face SNAPSHOT into OUT_DIR/CASE (4-bit g64; 8-bit g64; 3-bit g128; `--quant-predicate
mixed_3_6` at mlx-lm's default group), on the CPU, then loads the conversion with
float32 activations (its BF16 scales and biases widen exactly; gturbo computes in f32
too) and writes OUT_DIR/CASE.ref.json: `{"vocab", "prompt", "greedy"}` (GREEDY_STEPS
greedy ids after the prompt, with mlx-lm's KV cache) and OUT_DIR/CASE.logits.f32: the
logits at every prompt position, little-endian f32 `[len(prompt), vocab]`.

A case whose OUT_DIR/CASE.ref.json exists for the same prompt and steps is kept (the
cache the test suite reuses between runs). Needs: pip install -r scripts/requirements/requirements-mlx.txt
"""

import json
import shutil
import sys
from pathlib import Path

CASES = {
    "q4g64": ["-q", "--q-bits", "4", "--q-group-size", "64"],
    "q8g64": ["-q", "--q-bits", "8", "--q-group-size", "64"],
    "q3g128": ["-q", "--q-bits", "3", "--q-group-size", "128"],
    "mixed_3_6": ["-q", "--quant-predicate", "mixed_3_6"],
}


def convert(snapshot, out, args):
    import subprocess

    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(snapshot), "--mlx-path", str(out)]
    r = subprocess.run(cmd + args, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"mlx_lm convert {' '.join(args)} failed:\n{r.stderr[-2000:]}")


def reference(model_dir, prompt, steps):
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir)
    model.set_dtype(mx.float32)
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    all_logits = np.array(logits[0].astype(mx.float32), dtype="<f4")
    greedy = []
    for _ in range(steps):
        t = int(mx.argmax(logits[0, -1]).item())
        greedy.append(t)
        logits = model(mx.array([[t]]), cache=cache)
    return all_logits, greedy


def main():
    if len(sys.argv) < 6:
        raise SystemExit(__doc__)
    import mlx.core as mx

    mx.set_default_device(mx.cpu)
    snapshot, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    prompt, steps = json.loads(sys.argv[3]), int(sys.argv[4])
    out_dir.mkdir(parents=True, exist_ok=True)
    for case in sys.argv[5:]:
        if case not in CASES:
            raise SystemExit(f"unknown case {case!r}; known: {', '.join(CASES)}")
        ref_path = out_dir / f"{case}.ref.json"
        if ref_path.exists():
            old = json.loads(ref_path.read_text())
            if old.get("prompt") == prompt and len(old.get("greedy", [])) == steps:
                continue
        mlx_dir = out_dir / case
        convert(snapshot, mlx_dir, CASES[case])
        logits, greedy = reference(mlx_dir, prompt, steps)
        (out_dir / f"{case}.logits.f32").write_bytes(logits.tobytes())
        ref = {"vocab": int(logits.shape[-1]), "prompt": prompt, "greedy": greedy}
        # Written last: its presence says the case is complete.
        ref_path.write_text(json.dumps(ref))
        print(f"{case}: converted, logits [{logits.shape[0]}, {logits.shape[1]}], greedy {greedy}")


if __name__ == "__main__":
    main()
