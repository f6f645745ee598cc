#!/usr/bin/env bash
# Before/after decode and prefill speed of two gturbo builds on the same installs: the
# check that a change of the runtime's structure (issue 24) kept its speed. For
# SmolLM2-135M's shapes and the 1.69 B qwen3_moe bench shape (the test kit's random BF16
# snapshots from examples/bench_snapshots.rs, installed once at INT4 by AFTER, experts
# resident), each backend in BACKENDS, RUNS runs of each binary alternated (so drift of
# a noisy machine falls on both alike); prints one table of medians with after/before.
#
#   BEFORE=dir/gturbo AFTER=dir/gturbo SNAPSHOTS=dir/bench_snapshots scripts/bench/bench_ab.sh
#
# Environment: BACKENDS ("cpu"; "gpu cpu" on a machine with a GPU), MODELS ("smollm2
# moe"), PROMPT (prompt tokens, 128), TOKENS (decoded, 64), RUNS (3), THREADS (the CPU
# backend's threads, default all), WORK (target/bench-ab), RESULTS (a file the table is
# appended to). Not run by CI.
set -euo pipefail
HERE="$(cd "$(dirname "$(readlink -f "$0")")" && pwd)"
cd "$HERE/../.."
: "${BEFORE:?BEFORE=path to the gturbo built before the change}"
: "${AFTER:?AFTER=path to the gturbo built after the change}"
SNAPSHOTS="${SNAPSHOTS:-target/release/examples/bench_snapshots}"
BACKENDS="${BACKENDS:-cpu}"
MODELS="${MODELS:-smollm2 moe}"
PROMPT="${PROMPT:-128}"
TOKENS="${TOKENS:-64}"
RUNS="${RUNS:-3}"
WORK="${WORK:-target/bench-ab}"
RESULTS="${RESULTS:-/dev/null}"
threads=()
[ -n "${THREADS:-}" ] && threads=(--threads "$THREADS")

rm -rf "$WORK" && mkdir -p "$WORK"
ids=$(seq 0 $((PROMPT - 1)) | awk '{ printf "%s%d", (NR > 1 ? "," : ""), (7 * $1 + 5) % 30000 }')
median() { sort -g | awk '{ a[NR] = $1 } END { if (NR % 2) print a[(NR + 1) / 2]; else print (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
field() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"; }
say() { echo "$*" | tee -a "$RESULTS"; }

say "## before/after: $BEFORE vs $AFTER; prompt $PROMPT ids, $TOKENS tokens, medians of $RUNS"
say "## CPU: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
say "$(printf '| %-8s | %-7s | %14s | %14s | %6s | %14s | %14s | %6s |' model backend 'prefill before' 'prefill after' ratio 'decode before' 'decode after' ratio)"
say "|---|---|---:|---:|---:|---:|---:|---:|"
for name in $MODELS; do
  case $name in
    smollm2) family=llama kind=smollm2 ;;
    moe) family=qwen3_moe kind=moe ;;
    *) echo "bench_ab.sh: unknown model $name (smollm2 | moe)" >&2; exit 2 ;;
  esac
  "$SNAPSHOTS" "$kind" "$WORK/$name-snap" > /dev/null
  "$AFTER" -q install --family "$family" "local/$name" --from "$WORK/$name-snap" --out "$WORK/$name.gturbo" > /dev/null
  rm -rf "$WORK/$name-snap"
  for backend in $BACKENDS; do
    declare -A pre=() dec=()
    for i in $(seq "$RUNS"); do
      for which in before after; do
        bin=$BEFORE
        [ "$which" = after ] && bin=$AFTER
        if ! "$bin" run "$WORK/$name.gturbo" --backend "$backend" --resident-experts --json "${threads[@]}" \
          --prompt-ids "$ids" --max-tokens "$TOKENS" > "$WORK/run.json" 2> "$WORK/footer"; then
          say "$which --backend $backend failed: $(tail -3 "$WORK/footer")"
          exit 1
        fi
        pre[$which]+="$(field "$WORK/run.json" prefill_tok_s) "
        dec[$which]+="$(field "$WORK/run.json" decode_tok_s) "
        echo "  $name $backend run $i $which: $(tail -1 "$WORK/footer")" >&2
      done
    done
    m() { printf '%s\n' ${1} | median; }
    pb=$(m "${pre[before]}") pa=$(m "${pre[after]}") db=$(m "${dec[before]}") da=$(m "${dec[after]}")
    say "$(printf '| %-8s | %-7s | %14.1f | %14.1f | %6.3f | %14.1f | %14.1f | %6.3f |' "$name" "$backend" "$pb" "$pa" "$(python3 -c "print($pa/$pb)")" "$db" "$da" "$(python3 -c "print($da/$db)")")"
    unset pre dec
  done
  rm -rf "$WORK/$name.gturbo"
done
