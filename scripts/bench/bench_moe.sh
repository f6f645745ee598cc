#!/usr/bin/env bash
# MoE expert-streaming benchmark: decode and prefill tok/s and peak RSS of `gturbo run`
# on a tiny random qwen3_moe install (testkit replica, INT4) with 2 cache slots, 16
# slots and resident experts (pools memory-mapped), in one run; medians of RUNS.
# The model is random and tiny: the figures compare the three expert modes with each
# other, not with another engine.
#
# Environment: RUNS (3), TOKENS (32), THREADS (nproc).
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS="${RUNS:-3}"
TOKENS="${TOKENS:-32}"
THREADS="${THREADS:-$(nproc)}"
B=target/bench-moe
rm -rf "$B" && mkdir -p "$B"

cargo build -q --release -p gturbo -p gturbo-testkit --bins
G=target/release/gturbo
target/release/gturbo-dev replica qwen3-moe "$B/snap" --seed 3 > /dev/null
"$G" -q install --family qwen3_moe test/qwen3-moe-tiny --from "$B/snap" --out "$B/moe.gturbo" > /dev/null 2>&1
IDS=5,17,200,33,9,48,310,2,77,120,64,1,250,19,8,400

median() { sort -g | awk '{ a[NR] = $1 } END { if (NR % 2) print a[(NR + 1) / 2]; else print (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }

printf '%-22s %12s %12s %13s %10s\n' mode "prefill t/s" "decode t/s" "peak RSS MiB" "hit rate"
for mode in "--expert-cache-slots 2" "--expert-cache-slots 16" "--resident-experts"; do
  pre=() dec=() rss=() hit=""
  for _ in $(seq "$RUNS"); do
    # shellcheck disable=SC2086
    "$G" run "$B/moe.gturbo" --prompt-ids "$IDS" --max-tokens "$TOKENS" --threads "$THREADS" \
      $mode > /dev/null 2> "$B/footer"
    line=$(tail -1 "$B/footer")
    pre+=("$(sed -E 's/.*prefill ([0-9.]+) tok\/s.*/\1/' <<< "$line")")
    dec+=("$(sed -E 's/.*decode ([0-9.]+) tok\/s.*/\1/' <<< "$line")")
    rss+=("$(sed -E 's/.*peak RSS ([0-9.]+) MiB.*/\1/' <<< "$line")")
    hit=$(sed -E 's/.*; (expert cache [^;]*)$/\1/' <<< "$line")
  done
  printf '%-22s %12s %12s %13s   %s\n' "${mode#--}" \
    "$(printf '%s\n' "${pre[@]}" | median)" "$(printf '%s\n' "${dec[@]}" | median)" \
    "$(printf '%s\n' "${rss[@]}" | median)" "$hit"
done
du -sh "$B/moe.gturbo/packed_experts" | awk '{ print "expert pools on disk: " $1 }'
