#!/usr/bin/env bash
# Flash-Next (qwen4_exp) runner benchmark: decode and prefill tok/s and peak RSS of
# `gturbo run` (footer figures, and /usr/bin/time -v's maximum resident set size) on
#  1. the scaled replica (testkit, seeded random BF16, installed at INT4) with 2 and 16
#     expert slots and resident experts;
#  2. a Flash-Next-shaped random model with more experts (EXPERTS=E,I,H,
#     default 32,256,512: 32 experts of width 256 per layer) whose expert pools are 8× the
#     16-slot budget, at 2 and 16 slots and resident.
# For each run it prints RSS against resident bytes + slot budget + row-cache capacity
# + a stated overhead (OVERHEAD_MIB, default 48: the binary, the tokenizer-free run's
# heap, activations and rayon stacks).
# The models are random: the figures compare expert modes and the memory bound, not
# quality. Quantized installs are run with --allow-unmeasured (no quality recorded).
#
# Each row is the median of REPEAT (3) runs.
# Environment: REPEAT (3), TOKENS (32), PROMPT (64 ids), THREADS (nproc), EXPERTS (32,256,512),
# OVERHEAD_MIB (48), ROWS (row-cache rows, 65536), PROFILE (release; `debug` reuses
# the test build, for a quick check only: its tok/s mean nothing), NO_BUILD (set: use
# the binaries already built).
set -euo pipefail
cd "$(dirname "$0")/../.."
TOKENS="${TOKENS:-32}"
PROMPT="${PROMPT:-64}"
THREADS="${THREADS:-$(nproc)}"
EXPERTS="${EXPERTS:-32,256,512}"
OVERHEAD_MIB="${OVERHEAD_MIB:-48}"
ROWS="${ROWS:-65536}"
REPEAT="${REPEAT:-3}"
B=target/bench-flashnext
rm -rf "$B" && mkdir -p "$B"
[ -x /usr/bin/time ] || { echo "bench_flashnext: needs /usr/bin/time (GNU time)" >&2; exit 2; }

PROFILE="${PROFILE:-release}"
if [ -n "${NO_BUILD:-}" ]; then
  :
elif [ "$PROFILE" = release ]; then
  cargo build -q --release -p gturbo -p gturbo-testkit --bins
else
  cargo build -q -p gturbo -p gturbo-testkit --bins
fi
G=target/$PROFILE/gturbo
D=target/$PROFILE/gturbo-dev

"$D" replica flash-next --scaled "$B/scaled-snap" --seed 7 > /dev/null
# shellcheck disable=SC2086
"$D" replica flash-next "$B/big-snap" --scaled --seed 8 --experts ${EXPERTS//,/ } > /dev/null
for m in scaled big; do
  "$G" -q install --family qwen38flashnext local/flash-$m --from "$B/$m-snap" \
    --out "$B/$m.gturbo" > /dev/null 2>&1
  rm -rf "$B/$m-snap"
done
# Prompt ids below the replicas' vocabulary (1024), away from the specials.
IDS=$(seq 1 "$PROMPT" | awk '{ printf "%s%d", (NR > 1 ? "," : ""), ($1 * 37) % 1000 + 3 }')

median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
json_field() { python3 -c "import json,sys; d=json.load(sys.stdin); print(eval(sys.argv[1]))" "$1"; }

printf '%-7s %-24s %9s %9s %9s %9s %9s %12s %10s\n' model mode "pre t/s" "dec t/s" \
  "RSS MiB" "bound MiB" "expert%" "row hits%" "state KiB"
for m in scaled big; do
  dir="$B/$m.gturbo"
  pools=$(du -sb "$dir/packed_experts" | cut -f1)
  for mode in "--expert-cache-slots 2" "--expert-cache-slots 16" "--resident-experts"; do
    # REPEAT runs of each mode; the row is the median of them (these machines are noisy).
    pres=() decs=() rsss=()
    for _ in $(seq "$REPEAT"); do
      # shellcheck disable=SC2086
      /usr/bin/time -v "$G" run "$dir" --prompt-ids "$IDS" --max-tokens "$TOKENS" \
        --threads "$THREADS" --row-cache-rows "$ROWS" --allow-unmeasured --json $mode \
        > "$B/out.json" 2> "$B/time.txt"
      rsss+=("$(awk -F': ' '/Maximum resident set size/ { print $2 }' "$B/time.txt")")
      pres+=("$(json_field 'd["prefill_tok_s"]' < "$B/out.json")")
      decs+=("$(json_field 'd["decode_tok_s"]' < "$B/out.json")")
    done
    rss_kb=$(median "${rsss[@]}")
    pre=$(printf '%.1f' "$(median "${pres[@]}")")
    dec=$(printf '%.1f' "$(median "${decs[@]}")")
    j=$(cat "$B/out.json")
    hit=$(json_field 'round(100 * (d["expert_cache"]["hit_rate"] or 0), 1)' <<< "$j")
    rhit=$(json_field 'round(100 * (d["row_cache"]["hit_rate"] or 0), 1)' <<< "$j")
    state=$(json_field 'round(d["state_bytes"] / 1024, 1)' <<< "$j")
    res=$(json_field 'd["resident_bytes"]' <<< "$j")
    slot=$(json_field 'd["expert_slot_bytes"]' <<< "$j")
    rowcap=$(json_field 'd["row_cache"]["capacity_bytes"]' <<< "$j")
    case "$mode" in
      *slots\ 2) budget=$((2 * slot)) ;;
      *slots\ 16) budget=$((16 * slot)) ;;
      *) budget=$pools ;;
    esac
    bound=$(( (res + budget + rowcap) / 1048576 + OVERHEAD_MIB ))
    printf '%-7s %-24s %9s %9s %9.1f %9d %9s %12s %10s\n' "$m" "${mode#--}" "$pre" "$dec" \
      "$(echo "$rss_kb / 1024" | bc -l)" "$bound" "$hit" "$rhit" "$state"
  done
  printf '        resident.bin %.1f MiB, expert pools %.1f MiB (%.1f× the 16-slot budget)\n' \
    "$(echo "$res / 1048576" | bc -l)" "$(echo "$pools / 1048576" | bc -l)" \
    "$(echo "$pools / (16 * $slot)" | bc -l)"
done
