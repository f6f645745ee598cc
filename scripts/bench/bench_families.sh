#!/usr/bin/env bash
# The scaled benchmark shapes of issues 26 and 27 on the CPU: gturbo against llama.cpp.
#
# For each family (default: deepseek_v3 glm4_moe qwen3_next), one at a time:
#   1. scripts/bench/make_family_shape.py writes the shape (the family's real config
#      scaled in width and depth, random BF16, >= TARGET_GB at INT4);
#   2. gturbo installs it at INT4 (g64, the family's policy);
#   3. llama.cpp's convert_hf_to_gguf.py writes a BF16 GGUF of the same snapshot, the
#      snapshot is deleted, llama.cpp's quantizer (through llama-cpp-python) writes Q4_0,
#      the BF16 GGUF is deleted;
#   4. the same PROMPT_LEN prompt ids, TOKENS greedy tokens, THREADS threads, RUNS runs:
#      `gturbo run` with EXPERT_MODES (16 expert cache slots, resident experts) and
#      llama.cpp (bench_peers.py llama-ids); prefill and decode tok/s as each engine
#      reports them, peak RSS from /usr/bin/time -v; medians;
#   5. the family's data is deleted (KEEP=1 keeps it).
# Prints one table with the ratios gturbo / llama.cpp. Never run by CI (minutes per
# family; about 9 GB of disk at the peak of each).
#
# Environment: RUNS (3), PROMPT_LEN (128), TOKENS (64), THREADS (2), TARGET_GB (1.1),
# EXPERT_MODES ("slots16 resident"), LLAMA_OMP_WAIT (passive: llama.cpp's OpenMP threads
# sleep at barriers instead of spinning; on this 2-core host loaded by other builds the
# spinning default ran its decode at 1.4 tok/s against 42 passive), SHAPE_PYTHON (the generator's interpreter: torch +
# transformers; default $GOLDEN_VENV/bin/python, else python3), TOKENIZER (a folder with
# SmolLM2's tokenizer.json; default target/smollm2/snapshot, fetched when missing),
# LLAMA_SRC (llama-cpp-python's source tree, holding vendor/llama.cpp; default
# target/llama-src/llama_cpp_python-*), GTURBO_VENV_ROOT (where venv.sh keeps the llama
# venv), NO_BUILD=1 (use target/release/gturbo as it is), KEEP=1, OUT (target/bench-families),
# BACKEND (gturbo's backend: cpu, or gpu), PEER (llama, or none: gturbo alone, no converter
# or llama.cpp needed: the H200 rows), GTURBO (the gturbo binary, target/release/gturbo).
#
# Usage: scripts/bench/bench_families.sh [FAMILY...]
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
ROOT=$PWD
RUNS="${RUNS:-3}"
PROMPT_LEN="${PROMPT_LEN:-128}"
TOKENS="${TOKENS:-64}"
THREADS="${THREADS:-2}"
TARGET_GB="${TARGET_GB:-1.1}"
EXPERT_MODES="${EXPERT_MODES:-slots16 resident}"
OUT="${OUT:-target/bench-families}"
FAMILIES=("$@")
[ ${#FAMILIES[@]} -gt 0 ] || FAMILIES=(deepseek_v3 glm4_moe qwen3_next)
NEED_GB=10 # BF16 snapshot + BF16 GGUF + INT4 install of a 1.1 GB shape, with margin

if [ -n "${SHAPE_PYTHON:-}" ]; then :
elif [ -n "${GOLDEN_VENV:-}" ]; then SHAPE_PYTHON="$GOLDEN_VENV/bin/python"
else SHAPE_PYTHON=python3; fi
TOKENIZER="${TOKENIZER:-target/smollm2/snapshot}"
[ -f "$TOKENIZER/tokenizer.json" ] || scripts/fetch_smollm2.sh "$TOKENIZER"
if [ -z "${LLAMA_SRC:-}" ]; then
  LLAMA_SRC=$(ls -d target/llama-src/llama_cpp_python-* 2> /dev/null | grep -v '\.tar\.gz$' | tail -1 || true)
fi
BACKEND="${BACKEND:-cpu}"
PEER="${PEER:-llama}"
CONVERT="$LLAMA_SRC/vendor/llama.cpp/convert_hf_to_gguf.py"
[ "$PEER" = none ] || [ -f "$CONVERT" ] || { echo "no llama.cpp converter at '$CONVERT' (set LLAMA_SRC to llama-cpp-python's unpacked source)" >&2; exit 2; }
LLAMA_PY="${GTURBO_VENV_ROOT:-$ROOT/target/venv}/llama/bin/python"
# Made once (llama-cpp-python builds llama.cpp from source: many minutes); reused as is.
[ "$PEER" = none ] || [ -x "$LLAMA_PY" ] || (source scripts/venv.sh llama >&2)
if [ "${NO_BUILD:-0}" != 1 ]; then
  echo "== build (release)" >&2
  nice cargo build -q --release -p gturbo --bin gturbo >&2
fi
G="${GTURBO:-target/release/gturbo}"
TIMEV="${TIMEV:-/usr/bin/time}" # GNU time (-v -o FILE); a machine without it can name a stand-in
LLAMA_OMP_WAIT="${LLAMA_OMP_WAIT:-passive}"
mkdir -p "$OUT"

median() { sort -g | awk '{ a[NR] = $1 } END { if (NR == 0) print "nan"; else if (NR % 2) print a[(NR + 1) / 2]; else print (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
# json_field FILE KEY...: the first KEY present in FILE's JSON (the whole file: gturbo's
# --json document; else its last line: bench_peers.py's).
json_field() {
  python3 -c 'import json,sys
t = open(sys.argv[1]).read().strip()
try: d = json.loads(t)
except ValueError: d = json.loads(t.splitlines()[-1])
print(next(d[k] for k in sys.argv[2:] if k in d))' "$@"
}
free_gb() { df -BG --output=avail "$OUT" | tail -1 | tr -dc 0-9; }

# timed TAG CMD...: CMD under /usr/bin/time -v; stdout -> TAG.out, peak RSS (KiB) -> TAG.rss.
timed() {
  local tag=$1; shift
  "$TIMEV" -v -o "$tag.time" "$@" > "$tag.out" 2> "$tag.err" || { tail -5 "$tag.err" >&2; return 1; }
  awk -F: '/Maximum resident set size/ { gsub(/ /, "", $2); print $2 }' "$tag.time" > "$tag.rss"
}

# One run of row ROW (its command in CMD_<n>): RUNS rounds, each running every row of
# the family once (interleaved, so load from other work on the host falls on all rows
# alike). A command's last stdout line is JSON with prefill_tok_s or prefill_tps,
# decode_*, and the generated count; appends "ROW pre dec rss_mib n" to $TABLE.
declare -A PRE DEC RSS NGEN FAILED
run_once() { # ROW I CMD...
  local row=$1 i=$2 tag; shift 2
  tag="$W/$(tr ' /' '__' <<< "$row").$i"
  timed "$tag" "$@" || { echo "$row failed (see $tag.err)" >&2; FAILED[$row]=1; return 0; }
  PRE[$row]+="$(json_field "$tag.out" prefill_tok_s prefill_tps) "
  DEC[$row]+="$(json_field "$tag.out" decode_tok_s decode_tps) "
  NGEN[$row]=$(json_field "$tag.out" generated_tokens generated)
  RSS[$row]+="$(awk -v k="$(cat "$tag.rss")" 'BEGIN { print k / 1024 }') "
  echo "  $row run $i: prefill/decode/RSS so far: ${PRE[$row]}/ ${DEC[$row]}/ ${RSS[$row]}, ${NGEN[$row]} tokens" >&2
}
summarize() { # ROW
  local row=$1
  if [ -n "${FAILED[$row]:-}" ]; then echo "$row failed - - -" >> "$TABLE"; return; fi
  echo "$row $(tr ' ' '\n' <<< "${PRE[$row]}" | grep . | median) $(tr ' ' '\n' <<< "${DEC[$row]}" | grep . | median) $(tr ' ' '\n' <<< "${RSS[$row]}" | grep . | median) ${NGEN[$row]}" >> "$TABLE"
}

TABLE="$OUT/table.txt"
: > "$TABLE"
for fam in "${FAMILIES[@]}"; do
  W="$OUT/$fam"
  mkdir -p "$W"
  if { [ "$PEER" != none ] && [ ! -f "$W/q4_0.gguf" ]; } || [ ! -f "$W/int4.gturbo/manifest.json" ]; then
    [ "$(free_gb)" -ge "$NEED_GB" ] || { echo "$fam: $(free_gb) GB free under $OUT, $NEED_GB needed: stopping" >&2; exit 2; }
    echo "== $fam: shape" >&2
    "$SHAPE_PYTHON" scripts/bench/make_family_shape.py "$fam" "$W/snap" --target-gb "$TARGET_GB" \
      --tokenizer "$TOKENIZER" 2> "$W/shape.log" | tee "$W/shape.txt" >&2
    echo "== $fam: gturbo install (INT4)" >&2
    "$TIMEV" -v -o "$W/install.time" "$G" -q install --family "$fam" "bench/$fam-shape" --from "$W/snap" \
      --out "$W/int4.gturbo" --quant int4 --no-progress --overwrite > "$W/install.log" 2>&1
    if [ "$PEER" = none ]; then rm -rf "$W/snap"; else
    echo "== $fam: llama.cpp GGUF (BF16, then Q4_0)" >&2
    # The converter counts Qwen3-Next's `mtp.*` layer in unless told there is none.
    extra=(); [ "$fam" != qwen3_next ] || extra=(--no-mtp)
    PYTHONPATH="$LLAMA_SRC/vendor/llama.cpp/gguf-py" nice "$SHAPE_PYTHON" "$CONVERT" --outtype bf16 "${extra[@]}" \
      --outfile "$W/bf16.gguf" "$W/snap" > "$W/convert.log" 2>&1 || { tail -20 "$W/convert.log" >&2; exit 2; }
    rm -rf "$W/snap"
    "$LLAMA_PY" scripts/bench/bench_peers.py llama-quantize "$W/bf16.gguf" "$W/q4_0.gguf" q4_0 "$THREADS" > "$W/quantize.log" 2>&1 ||
      { tail -20 "$W/quantize.log" >&2; exit 2; }
    rm -f "$W/bf16.gguf"
    fi
  fi
  # Ordinary SmolLM2 token ids (past its 17 special tokens; every shape's vocabulary
  # starts with SmolLM2's 49152), the same for both engines.
  ids=$(python3 -c 'import sys; print(",".join(str(17 + (7919 * i + 13) % (49152 - 17)) for i in range(int(sys.argv[1]))))' "$PROMPT_LEN")
  echo "$ids" > "$W/prompt.ids"
  echo "== $fam: $(du -sh "$W/int4.gturbo" | cut -f1) gturbo INT4; $RUNS runs each" >&2
  rows=()
  for mode in $EXPERT_MODES; do
    case $mode in slots*|resident) rows+=("$fam gturbo-$mode") ;; *) echo "unknown expert mode $mode" >&2; exit 2 ;; esac
  done
  [ "$PEER" = none ] || rows+=("$fam llama.cpp-Q4_0")
  for i in $(seq "$RUNS"); do
    for row in "${rows[@]}"; do
      case ${row#* } in
        gturbo-slots*) flag=(--expert-cache-slots "${row##*gturbo-slots}") ;;
        gturbo-resident) flag=(--resident-experts) ;;
        *) run_once "$row" "$i" env OMP_WAIT_POLICY="$LLAMA_OMP_WAIT" "$LLAMA_PY" scripts/bench/bench_peers.py llama-ids "$W/q4_0.gguf" "$W/prompt.ids" "$TOKENS" "$THREADS"; continue ;;
      esac
      run_once "$row" "$i" "$G" run "$W/int4.gturbo" --backend "$BACKEND" --prompt-ids "$ids" --max-tokens "$TOKENS" \
        --threads "$THREADS" --allow-unmeasured --json "${flag[@]}"
    done
  done
  for row in "${rows[@]}"; do summarize "$row"; done
  sizes="$fam sizes: gturbo INT4 $(du -sh "$W/int4.gturbo" | cut -f1)"
  [ "$PEER" = none ] || sizes+=", GGUF Q4_0 $(du -sh "$W/q4_0.gguf" | cut -f1)"
  echo "$sizes" >&2
  echo "# $sizes; $(head -1 "$W/shape.txt" 2> /dev/null)" >> "$TABLE"
  [ "${KEEP:-0}" = 1 ] || rm -rf "$W/int4.gturbo" "$W/q4_0.gguf"
done

echo
echo "gturbo backend $BACKEND ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $THREADS CPU threads), prompt $PROMPT_LEN ids, $TOKENS greedy tokens, median of $RUNS runs"
printf '| %-12s | %-22s | %12s | %11s | %13s | %6s | %s |\n' family engine "prefill t/s" "decode t/s" "peak RSS MiB" tokens "vs llama.cpp (prefill / decode / RSS)"
printf '|%s|%s|%s|%s|%s|%s|%s|\n' -------------- ------------------------ -------------- ------------- --------------- -------- ----------------------------------------
for fam in "${FAMILIES[@]}"; do
  peer=$(awk -v f="$fam" '$1 == f && $2 == "llama.cpp-Q4_0" { print $3, $4, $5 }' "$TABLE")
  while read -r f engine pre dec rss n; do
    [ "$f" = "$fam" ] || continue
    ratio=""
    if [ "$engine" != llama.cpp-Q4_0 ] && [ -n "$peer" ] && [ "$pre" != failed ]; then
      read -r ppre pdec prss <<< "$peer"
      ratio=$(awk -v a="$pre" -v b="$ppre" -v c="$dec" -v d="$pdec" -v e="$rss" -v f="$prss" \
        'BEGIN { printf "%.2fx / %.2fx / %.2fx", a / b, c / d, e / f }')
    fi
    if [ "$pre" = failed ]; then
      printf '| %-12s | %-22s | %12s | %11s | %13s | %6s | %s |\n' "$fam" "$engine" failed - - - ""
    else
      printf '| %-12s | %-22s | %12.1f | %11.2f | %13.0f | %6s | %s |\n' "$fam" "$engine" "$pre" "$dec" "$rss" "$n" "$ratio"
    fi
  done < <(grep -v '^#' "$TABLE")
done
grep '^#' "$TABLE" | sed 's/^# //'
