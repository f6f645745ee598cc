#!/usr/bin/env python3
"""Check a SmolLM2 snapshot (from smollm2_snapshot.py) with independent tools.

Usage: smollm2_check.py SNAPSHOT [--json OUT]

- HF `tokenizers`: "The capital of France is" encodes to [504, 3575, 282, 4649, 314].
- HF `transformers`: the ChatML prompt with an empty system message renders as expected.
- mlx-lm (BF16, CPU): greedy continuation of the plain prompt starts with " Paris"; the chat
  question (empty system message) answers a sentence naming Paris and stops at <|im_end|>;
  the mean next-token negative log-likelihood over a fixed English paragraph stays low.
  The last two catch a wrong Q/K row order, which still answers the short prompt correctly.
With --json, writes what was generated (ids and text) for the report and Rust goldens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PROMPT = "The capital of France is"
PROMPT_IDS = [504, 3575, 282, 4649, 314]
QUESTION = "What is the capital of France?"
CHAT_EMPTY_SYSTEM = (
    "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)
# A fixed paragraph of plain English: a well-converted model predicts it with a mean
# NLL near 2 nats/token; a Q/K permutation error pushes it far above.
PARAGRAPH = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889. Locally nicknamed the Iron Lady, it was constructed as the centrepiece "
    "of the 1889 World's Fair, and to crown the centennial anniversary of the French Revolution."
)
MAX_NLL = 3.0
LONG_STEPS = 32


def fail(msg: str) -> None:
    print(f"smollm2_check: FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def main() -> None:
    args = sys.argv[1:]
    out = None
    if "--json" in args:
        i = args.index("--json")
        out = Path(args[i + 1])
        del args[i : i + 2]
    if len(args) != 1:
        raise SystemExit("usage: smollm2_check.py SNAPSHOT [--json OUT]")
    snap = Path(args[0])

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(snap / "tokenizer.json"))
    ids = tok.encode(PROMPT).ids
    if ids != PROMPT_IDS:
        fail(f"tokenizers encodes {PROMPT!r} to {ids}, expected {PROMPT_IDS}")

    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(snap))
    messages = [{"role": "system", "content": ""}, {"role": "user", "content": QUESTION}]
    rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if rendered != CHAT_EMPTY_SYSTEM:
        fail(f"transformers renders the chat prompt as {rendered!r}")
    default_rendered = hf.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
    )

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    model, _ = load(str(snap))
    eos = 2

    def greedy(prompt_ids: list[int], steps: int, stop: bool) -> list[int]:
        got = []
        for token, _ in generate_step(mx.array(prompt_ids), model, max_tokens=steps, sampler=make_sampler(0.0)):
            t = int(token)
            got.append(t)
            if stop and t == eos:
                break
        return got

    plain = greedy(PROMPT_IDS, 8, False)
    plain_text = tok.decode(plain)
    if not plain_text.startswith(" Paris"):
        fail(f"mlx-lm continues {PROMPT!r} with {plain_text!r}, expected ' Paris'")

    chat_ids = tok.encode(CHAT_EMPTY_SYSTEM).ids
    chat = greedy(chat_ids, 48, True)
    chat_text = tok.decode(chat, skip_special_tokens=False)
    if not chat or chat[-1] != eos or "Paris" not in chat_text:
        fail(f"mlx-lm chat answer {chat_text!r} (ids {chat}) does not name Paris and stop at <|im_end|>")

    long_ids = tok.encode(PARAGRAPH).ids
    logits = model(mx.array(long_ids)[None])[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    nll = -float(mx.mean(mx.take_along_axis(logp[:-1], mx.array(long_ids[1:])[:, None], axis=-1)))
    if nll > MAX_NLL:
        fail(f"mean NLL over the paragraph is {nll:.3f} nats/token (> {MAX_NLL}): Q/K order or weights are wrong")
    long_gen = greedy(long_ids, LONG_STEPS, False)

    report = {
        "prompt": PROMPT,
        "prompt_ids": ids,
        "plain_greedy_ids": plain,
        "plain_greedy_text": plain_text,
        "chat_prompt_empty_system": rendered,
        "chat_prompt_default_system": default_rendered,
        "chat_prompt_ids": chat_ids,
        "chat_greedy_ids": chat,
        "chat_greedy_text": chat_text,
        "paragraph": PARAGRAPH,
        "paragraph_ids": long_ids,
        "paragraph_mean_nll": round(nll, 4),
        "paragraph_greedy_ids": long_gen,
        "paragraph_greedy_text": tok.decode(long_gen, skip_special_tokens=False),
    }
    for k in ("plain_greedy_text", "chat_greedy_text", "paragraph_mean_nll", "paragraph_greedy_text"):
        print(f"{k}: {report[k]!r}")
    if out:
        out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    print("smollm2_check: ok")


if __name__ == "__main__":
    main()
