#!/usr/bin/env python3
"""One timed greedy generation with a peer runtime, for scripts/bench/bench_run.sh.

Usage:
  bench_peers.py mlx MODEL_DIR PROMPT_FILE N        mlx-lm (CPU) on an MLX model folder
  bench_peers.py llama GGUF PROMPT_FILE N THREADS   llama.cpp (llama-cpp-python) on a GGUF
  bench_peers.py llama-ids GGUF IDS_FILE N THREADS  the same, the prompt given as comma-separated
                                                    token ids (no tokenizer: bench_families.sh)
  bench_peers.py llama-quantize SRC DST TYPE THREADS  quantize a GGUF with llama.cpp's own
                                                    quantizer (TYPE: a LLAMA_FTYPE_MOSTLY_* suffix, Q4_0)

Both feed the same prompt token ids (the SmolLM2 tokenizer, no BOS), generate exactly N
tokens greedily (end-of-sequence is not a stop, so every engine does the same work),
and print one JSON line: prompt_tokens, generated, prefill_tps (prompt tokens / time to
the first generated token), decode_tps ((N - 1) / time from the first to the last token),
and the generated ids. Peak RSS is measured outside (/usr/bin/time -v).
"""

from __future__ import annotations

import json
import sys
import time


def run_mlx(model_dir: str, prompt: str, n: int) -> dict:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    model, tok = load(model_dir)
    ids = tok.encode(prompt, add_special_tokens=False)
    got = []
    t0 = time.perf_counter()
    t_first = None
    for token, _ in generate_step(mx.array(ids), model, max_tokens=n, sampler=make_sampler(0.0)):
        got.append(int(token))
        if t_first is None:
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    return result(len(ids), got, t0, t_first, t_end)


def run_llama(gguf: str, prompt: str, n: int, threads: int, as_ids: bool = False) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
    if as_ids:
        ids = [int(x) for x in prompt.replace("\n", "").split(",") if x.strip()]
    else:
        ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
    got = []
    t0 = time.perf_counter()
    llm.eval(ids)
    tok = llm.sample(top_k=1, temp=0.0)
    got.append(int(tok))
    t_first = time.perf_counter()
    while len(got) < n:
        llm.eval([tok])
        tok = llm.sample(top_k=1, temp=0.0)
        got.append(int(tok))
    t_end = time.perf_counter()
    return result(len(ids), got, t0, t_first, t_end)


def quantize_llama(src: str, dst: str, kind: str, threads: int) -> dict:
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind.upper()}")
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize {src} -> {dst} ({kind}) failed: {rc}")
    return {"quantized": dst, "type": kind}


def result(n_prompt: int, got: list[int], t0: float, t_first: float, t_end: float) -> dict:
    return {
        "prompt_tokens": n_prompt,
        "generated": len(got),
        "prefill_tps": n_prompt / (t_first - t0),
        "decode_tps": (len(got) - 1) / (t_end - t_first) if len(got) > 1 else 0.0,
        "ids": got,
    }


def main() -> None:
    a = sys.argv[1:]
    if len(a) >= 4 and a[0] == "mlx":
        out = run_mlx(a[1], open(a[2]).read(), int(a[3]))
    elif len(a) >= 5 and a[0] in ("llama", "llama-ids"):
        out = run_llama(a[1], open(a[2]).read(), int(a[3]), int(a[4]), as_ids=a[0] == "llama-ids")
    elif len(a) >= 5 and a[0] == "llama-quantize":
        out = quantize_llama(a[1], a[2], a[3], int(a[4]))
    else:
        raise SystemExit(__doc__)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
