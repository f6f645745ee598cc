#!/usr/bin/env bash
# End-to-end generation benchmark on SmolLM2-135M-Instruct, INT4, on this machine:
#   gturbo run   on a gturbo INT4 g64 install of the BF16 snapshot
#   mlx-lm       on a 4-bit g64 MLX conversion of the same snapshot (same weights)
#   llama.cpp    (llama-cpp-python, built from source into target/venv/llama by venv.sh)
#                on the original Q4_1 GGUF: the peer a CPU user actually picks
# Same prompt, same number of generated tokens (greedy, end-of-sequence not a stop),
# RUNS runs each; prints medians of prefill tok/s, decode tok/s and peak RSS side by side
# with ratios gturbo / peer. Never run by CI (the llama.cpp build alone takes minutes).
#
# Environment: TOKENS (default 32), RUNS (3), THREADS (nproc), PEERS ("gturbo mlx llama"),
# BENCH_PROMPT (the prompt text).
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
TOKENS="${TOKENS:-32}"
RUNS="${RUNS:-3}"
THREADS="${THREADS:-$(nproc)}"
PEERS="${PEERS:-gturbo mlx llama}"
B=target/bench
mkdir -p "$B"
rm -f "$B"/gturbo.* "$B"/mlx.* "$B"/llama.*

scripts/fetch_smollm2.sh target/smollm2/snapshot
SNAP=target/smollm2/snapshot
GGUF=target/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
PROMPT_FILE="$B/prompt.txt"
# About 40 tokens of plain English (BENCH_PROMPT overrides): enough prefill to time,
# short enough for mlx-lm, whose 4-bit CPU path prefills at well under 1 tok/s here.
printf '%s' "${BENCH_PROMPT:-The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. It}" > "$PROMPT_FILE"

# One measured run: "$@" under /usr/bin/time -v; stdout -> $1.out, RSS (KiB) -> $1.rss.
timed() {
  local tag=$1; shift
  /usr/bin/time -v -o "$tag.time" "$@" > "$tag.out" 2> "$tag.err" || { tail -5 "$tag.err" >&2; return 1; }
  awk -F: '/Maximum resident set size/ { gsub(/ /, "", $2); print $2 }' "$tag.time" > "$tag.rss"
}

# Median of the numbers on stdin.
median() { sort -g | awk '{ a[NR] = $1 } END { if (NR == 0) print "nan"; else if (NR % 2) print a[(NR + 1) / 2]; else print (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }

declare -A PREFILL DECODE RSS NOTE

bench_json() { # name, then the command; the command prints bench_peers.py JSON
  local name=$1; shift
  local pre=() dec=() rss=()
  for i in $(seq "$RUNS"); do
    timed "$B/$name.$i" "$@" || { NOTE[$name]="failed (see $B/$name.$i.err)"; return 0; }
    pre+=("$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])["prefill_tps"])' "$B/$name.$i.out")")
    dec+=("$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])["decode_tps"])' "$B/$name.$i.out")")
    rss+=("$(cat "$B/$name.$i.rss")")
    echo "  $name run $i: prefill ${pre[-1]} tok/s, decode ${dec[-1]} tok/s, peak RSS ${rss[-1]} KiB" >&2
  done
  PREFILL[$name]=$(printf '%s\n' "${pre[@]}" | median)
  DECODE[$name]=$(printf '%s\n' "${dec[@]}" | median)
  RSS[$name]=$(printf '%s\n' "${rss[@]}" | median)
}

for peer in $PEERS; do
  case $peer in
  gturbo)
    echo "gturbo: building and installing INT4" >&2
    cargo build -q --release --bin gturbo
    G=target/release/gturbo
    INSTALL="$B/smollm2-int4.gturbo"
    if [ ! -f "$INSTALL/manifest.json" ]; then
      "$G" install HuggingFaceTB/SmolLM2-135M-Instruct --family llama --from "$SNAP" \
        --out "$INSTALL" --no-progress --overwrite -q >&2
    fi
    if "$G" run --help > /dev/null 2>&1 && ! "$G" run "$INSTALL" --prompt "x" --max-tokens 1 2>&1 | grep -qi "not implemented"; then
      pre=() dec=() rss=()
      for i in $(seq "$RUNS"); do
        # The footer names prefill and decode rates; take the number before "tok/s" on
        # the line that names each.
        if ! timed "$B/gturbo.$i" "$G" run "$INSTALL" --prompt "$(cat "$PROMPT_FILE")" \
          --max-tokens "$TOKENS" --temperature 0; then
          NOTE[gturbo]="failed (see $B/gturbo.$i.err)"
          break
        fi
        all="$B/gturbo.$i.all"; cat "$B/gturbo.$i.out" "$B/gturbo.$i.err" > "$all"
        pre+=("$(grep -io 'prefill[^0-9]*[0-9.]* *tok/s' "$all" | tail -1 | grep -o '[0-9][0-9.]*' | tail -1)")
        dec+=("$(grep -io 'decode[^0-9]*[0-9.]* *tok/s' "$all" | tail -1 | grep -o '[0-9][0-9.]*' | tail -1)")
        rss+=("$(cat "$B/gturbo.$i.rss")")
        echo "  gturbo run $i: prefill ${pre[-1]:-?} tok/s, decode ${dec[-1]:-?} tok/s, peak RSS ${rss[-1]} KiB" >&2
      done
      if [ -z "${NOTE[gturbo]:-}" ]; then
        PREFILL[gturbo]=$(printf '%s\n' "${pre[@]}" | median)
        DECODE[gturbo]=$(printf '%s\n' "${dec[@]}" | median)
        RSS[gturbo]=$(printf '%s\n' "${rss[@]}" | median)
      fi
    else
      NOTE[gturbo]="gturbo run is not implemented in this build: skipped"
    fi
    ;;
  mlx)
    # shellcheck source=venv.sh
    source scripts/venv.sh test
    MLX4="$B/smollm2-mlx-4bit-g64"
    if [ ! -f "$MLX4/config.json" ]; then
      echo "mlx-lm: converting the snapshot to 4-bit g64" >&2
      python3 -m mlx_lm convert --hf-path "$SNAP" --mlx-path "$MLX4" -q --q-bits 4 --q-group-size 64 >&2
    fi
    echo "mlx-lm: $RUNS runs" >&2
    bench_json mlx python3 scripts/bench/bench_peers.py mlx "$MLX4" "$PROMPT_FILE" "$TOKENS"
    ;;
  llama)
    # llama-cpp-python builds llama.cpp from source on first use (minutes).
    VENV="${GTURBO_VENV_ROOT:-$PWD/target/venv}/llama"
    (export CMAKE_BUILD_PARALLEL_LEVEL="$THREADS"; source scripts/venv.sh llama >&2)
    echo "llama.cpp: $RUNS runs" >&2
    bench_json llama "$VENV/bin/python" scripts/bench/bench_peers.py llama "$GGUF" "$PROMPT_FILE" "$TOKENS" "$THREADS"
    ;;
  *) echo "unknown peer $peer" >&2; exit 2 ;;
  esac
done

echo
n_prompt=$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])["prompt_tokens"])' "$(ls "$B"/*.1.out 2> /dev/null | grep -v gturbo | head -1)" 2> /dev/null || echo "?")
echo "SmolLM2-135M-Instruct, $n_prompt prompt tokens, $TOKENS generated tokens (greedy), $THREADS threads, median of $RUNS runs"
printf '%-34s %12s %12s %14s\n' engine "prefill t/s" "decode t/s" "peak RSS MiB"
label() { case $1 in gturbo) echo "gturbo run (INT4 g64)";; mlx) echo "mlx-lm (4-bit g64, CPU)";; llama) echo "llama.cpp (Q4_1 GGUF)";; esac; }
for peer in $PEERS; do
  if [ -n "${NOTE[$peer]:-}" ]; then
    printf '%-34s %s\n' "$(label "$peer")" "${NOTE[$peer]}"
  else
    printf '%-34s %12.1f %12.1f %14.1f\n' "$(label "$peer")" "${PREFILL[$peer]}" "${DECODE[$peer]}" "$(echo "${RSS[$peer]} / 1024" | bc -l)"
  fi
done
if [ -n "${DECODE[gturbo]:-}" ]; then
  for peer in mlx llama; do
    [ -n "${DECODE[$peer]:-}" ] || continue
    printf 'gturbo / %-8s prefill %.2fx  decode %.2fx  peak RSS %.2fx\n' "$peer" \
      "$(echo "${PREFILL[gturbo]} / ${PREFILL[$peer]}" | bc -l)" \
      "$(echo "${DECODE[gturbo]} / ${DECODE[$peer]}" | bc -l)" \
      "$(echo "${RSS[gturbo]} / ${RSS[$peer]}" | bc -l)"
  done
fi
