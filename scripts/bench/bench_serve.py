"""The serving benchmark's client (scripts/bench/bench_serve.sh): drives one
OpenAI-compatible server over HTTP with the standard library only.

    python3 bench_serve.py BASE_URL MODEL RUNS

Measures, each a median of RUNS:
- time to first token (TTFT) of a streamed answer after a ~4,000-token system prompt
  never seen before (cold), then of another question after the same system prompt
  (cached: the server may reuse the prefix);
- aggregate decode throughput with 1, 4 and 8 clients at once, each asking its own
  short question for a fixed number of tokens at temperature 0: all clients' completion
  tokens over the wall time from the first request to the last answer.
Prints one JSON document.
"""

import json
import statistics
import sys
import threading
import time
import urllib.request

PREFIX_TOKENS = 4000
ANSWER_TOKENS = 64
SENTENCE = (
    "The tutor keeps a careful record of every lesson, every question the students ask "
    "and every answer they give, so that the next lesson starts where this one ended. "
)


def post(base, path, body, stream=False):
    req = urllib.request.Request(
        base + path,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    return urllib.request.urlopen(req, timeout=600)


def chat(base, model, messages, max_tokens, stream):
    return post(
        base,
        "/v1/chat/completions",
        {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        },
    )


def prompt_tokens(base, model, system):
    with chat(base, model, [{"role": "system", "content": system},
                            {"role": "user", "content": "Hi"}], 1, False) as r:
        return json.load(r)["usage"]["prompt_tokens"]


def sentences(base, model):
    """How many SENTENCEs make a system prompt of about PREFIX_TOKENS tokens, and the
    prompt tokens that gives (measured once)."""
    n = 1
    while True:
        got = prompt_tokens(base, model, system_prompt("calibration", n))
        if got >= PREFIX_TOKENS or n > 4096:
            return n, got
        n = max(n + 1, int(n * PREFIX_TOKENS / max(got, 1)))


def system_prompt(nonce, n):
    """`n` sentences after `nonce` (so that no earlier prompt shares more than the
    template's first tokens)."""
    return f"Session {nonce}. " + SENTENCE * n


def ttft(base, model, system, question):
    """Seconds from sending a streamed request to its first content chunk."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    start = time.perf_counter()
    with chat(base, model, messages, 8, True) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = json.loads(line[6:])
            for c in doc.get("choices", []):
                if c.get("delta", {}).get("content"):
                    first = time.perf_counter() - start
                    for _ in r:  # drain
                        pass
                    return first
    return float("nan")


def throughput(base, model, clients, run):
    tokens = [0] * clients
    errors = []

    def one(i):
        q = f"Client {i} of run {run}: write a short story about the number {i * 7 + run}."
        try:
            with chat(base, model, [{"role": "user", "content": q}], ANSWER_TOKENS, False) as r:
                tokens[i] = json.load(r)["usage"]["completion_tokens"]
        except Exception as e:  # reported, not hidden
            errors.append(f"client {i}: {e}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise SystemExit("; ".join(errors))
    return sum(tokens) / wall, sum(tokens)


def main():
    base, model, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
    out = {"cold": [], "cached": [], "prefix_tokens": []}
    # Warm-up: load paths, page in the weights.
    ttft(base, model, "Warm up.", "Hi")
    n, got = sentences(base, model)
    out["prefix_tokens"].append(got)
    for i in range(runs):
        system = system_prompt(f"{time.time_ns()}-{i}", n)
        out["cold"].append(ttft(base, model, system, "What is the first thing the tutor records?"))
        out["cached"].append(ttft(base, model, system, "What does the next lesson start with?"))
    for clients in (1, 4, 8):
        rates = [throughput(base, model, clients, r) for r in range(runs)]
        out[f"tok_s_{clients}"] = [r for r, _ in rates]
        out[f"tokens_{clients}"] = [t for _, t in rates]
    med = {k: statistics.median(v) for k, v in out.items() if v}
    json.dump({"runs": out, "median": med}, sys.stdout)


if __name__ == "__main__":
    main()
