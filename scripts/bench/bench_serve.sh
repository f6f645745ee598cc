#!/usr/bin/env bash
# The serving benchmark (issue 29): gturbo serve against llama.cpp's server
# (llama-cpp-python's `python -m llama_cpp.server`) on SmolLM2-135M-Instruct, in one run:
#
#   gturbo serve   on a gturbo INT4 g64 install of the BF16 snapshot (scripts/fetch_smollm2.sh)
#   llama-server   on the Q4_1 GGUF the same script fetches (built from source into the
#                  `llama` venv by scripts/venv.sh)
#
# For each: time to first token after a ~4,000-token system prompt, cold (never seen)
# and cached (the same system prompt again, another question), and the aggregate
# tok/s of 1, 4 and 8 clients at once (64 tokens each, temperature 0); medians of RUNS.
# Both run on the CPU with THREADS threads. Prints a table (also in
# target/bench-serve/table.md). Never run by CI (a release build, the llama.cpp build).
#
# Environment: RUNS (3), THREADS (nproc), NO_BUILD=1 (use target/release/gturbo as is),
# GTURBO_VENV_ROOT (where the venvs live; default target/venv).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
RUNS="${RUNS:-3}"
THREADS="${THREADS:-$(nproc)}"
work="$root/target/bench-serve"
mkdir -p "$work"
SNAP=target/smollm2/snapshot
GGUF=target/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
MODEL=smollm2

scripts/fetch_smollm2.sh >&2
if [ "${NO_BUILD:-0}" != 1 ]; then
  echo "== build (release)" >&2
  nice cargo build -q --release -p gturbo --bin gturbo >&2
fi
G="$root/target/release/gturbo"
INSTALL="$work/smollm2-int4.gturbo"
if [ ! -f "$INSTALL/manifest.json" ]; then
  "$G" install HuggingFaceTB/SmolLM2-135M-Instruct --family llama --from "$SNAP" \
    --out "$INSTALL" --no-progress --overwrite -q >&2
fi
VENV="${GTURBO_VENV_ROOT:-$root/target/venv}/llama"
(export CMAKE_BUILD_PARALLEL_LEVEL="$THREADS"; source scripts/venv.sh llama >&2)
PY="$VENV/bin/python"

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

# wait_http URL LOG: until URL answers (the server is up), at most 5 minutes.
wait_http() {
  for _ in $(seq 1 3000); do
    curl -sf "$1" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "server did not come up: $(tail -n 20 "$2")" >&2
  exit 2
}

# gturbo serve: port 0, the address from its first stdout line.
fifo="$work/gturbo.addr"
rm -f "$fifo"; mkfifo "$fifo"
"$G" serve "$INSTALL" --port 0 --backend cpu --threads "$THREADS" --alias "$MODEL" \
  >"$fifo" 2>"$work/gturbo.log" &
pids+=($!)
read -r line <"$fifo"
gt_base="${line#listening on }"
wait_http "$gt_base/v1/models" "$work/gturbo.log"
echo "== gturbo serve at $gt_base: $RUNS runs" >&2
"$PY" scripts/bench/bench_serve.py "$gt_base" "$MODEL" "$RUNS" >"$work/gturbo.json"

port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# n_ctx: SmolLM2's context; the prompt cache off (its own prefix reuse, the KV of the
# last prompt, stays: that is what "cached" measures for it).
"$PY" -m llama_cpp.server --model "$GGUF" --model_alias "$MODEL" --host 127.0.0.1 \
  --port "$port" --n_ctx 8192 --n_threads "$THREADS" --n_threads_batch "$THREADS" \
  >"$work/llama.log" 2>&1 &
pids+=($!)
ll_base="http://127.0.0.1:$port"
wait_http "$ll_base/v1/models" "$work/llama.log"
echo "== llama-server at $ll_base: $RUNS runs" >&2
"$PY" scripts/bench/bench_serve.py "$ll_base" "$MODEL" "$RUNS" >"$work/llama.json"

"$PY" - "$work/gturbo.json" "$work/llama.json" "$RUNS" "$THREADS" <<'PY' | tee "$work/table.md"
import json, sys
g, l = (json.load(open(p))["median"] for p in sys.argv[1:3])
runs, threads = sys.argv[3], sys.argv[4]
print(f"SmolLM2-135M-Instruct, CPU, {threads} threads, medians of {runs}; "
      f"system prompt {int(g['prefix_tokens'])} tokens (gturbo's count), answers of 64 tokens.\n")
print("| | gturbo serve (INT4 g64) | llama-server (Q4_1 GGUF) | gturbo / llama |")
print("|---|---|---|---|")
def row(name, key, unit, fmt, better_low):
    a, b = g[key], l[key]
    ratio = a / b if b else float("nan")
    print(f"| {name} | {a:{fmt}} {unit} | {b:{fmt}} {unit} | {ratio:.2f}× |")
row("TTFT, 4k prefix cold", "cold", "s", ".3f", True)
row("TTFT, 4k prefix cached", "cached", "s", ".3f", True)
for c in (1, 4, 8):
    row(f"aggregate tok/s, {c} client{'s' if c > 1 else ''}", f"tok_s_{c}", "tok/s", ".1f", False)
PY
