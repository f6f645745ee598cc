#!/usr/bin/env python3
"""The peer of scripts/bench/bench_gpu.sh: transformers + torch `generate` in bf16 on the GPU.

Loads a Hugging Face snapshot with AutoModelForCausalLM (bf16, on cuda), then times
prefill (one forward pass over the prompt) and greedy decode (`generate` of exactly
TOKENS new tokens, its time less the prefill's), medians of RUNS after a warm-up.
Prints one JSON line: {"prefill_tok_s", "decode_tok_s", ...}.

usage: bench_gpu_peer.py SNAPSHOT PROMPT_TOKENS TOKENS [RUNS]
"""
import json
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def main():
    snap, prompt_n, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    runs = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    model = AutoModelForCausalLM.from_pretrained(snap, dtype=torch.bfloat16).to("cuda").eval()
    vocab = model.config.vocab_size
    ids = torch.tensor([[(7 * i + 5) % (vocab - 8) for i in range(prompt_n)]], device="cuda")
    attn = torch.ones_like(ids)

    def sync_time(f):
        torch.cuda.synchronize()
        t = time.perf_counter()
        f()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    prefill, decode = [], []
    with torch.inference_mode():
        for i in range(runs + 1):
            p = sync_time(lambda: model(input_ids=ids, attention_mask=attn))
            g = sync_time(
                lambda: model.generate(
                    input_ids=ids,
                    attention_mask=attn,
                    max_new_tokens=tokens,
                    min_new_tokens=tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
            )
            if i == 0:
                continue  # warm-up
            prefill.append(prompt_n / p)
            # generate's first token comes from the prefill; the rest are decode steps.
            decode.append((tokens - 1) / max(g - p, 1e-9))
    print(
        json.dumps(
            {
                "engine": f"transformers {__import__('transformers').__version__} + torch {torch.__version__}",
                "device": torch.cuda.get_device_name(),
                "prompt_tokens": prompt_n,
                "tokens": tokens,
                "prefill_tok_s": statistics.median(prefill),
                "decode_tok_s": statistics.median(decode),
            }
        )
    )


if __name__ == "__main__":
    main()
