#!/usr/bin/env bash
# Flash-Next on a real GPU: greedy tokens and speed of `gturbo run --backend gpu`
# against the CPU backend, with 2 expert slots and with resident experts (issue 11; run
# on the H200 with the scaled replica installed at INT4:
#   gturbo-dev replica flash-next --scaled R
#   gturbo install qwen38flashnext --from R --index-sha256 <sha256 of its index> --out fn.gturbo).
#
#   scripts/bench/flash_gpu_check.sh INSTALL        (BIN: folder with gturbo, default target/release)
# Exit status 1 when the two backends' tokens differ.
set -uo pipefail
INSTALL="${1:?usage: flash_gpu_check.sh INSTALL}"
G="${BIN:-target/release}/gturbo"
nv=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f "$nv" ]; then export VK_DRIVER_FILES="$nv"; fi
"$G" run --list-adapters
P="The capital of France is a city on the river Seine, known for the Eiffel Tower and the Louvre; its name"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
status=0
for mode in "--expert-cache-slots 2" "--resident-experts"; do
  for b in gpu cpu; do
    echo "== $b $mode"
    # shellcheck disable=SC2086
    "$G" run "$INSTALL" --allow-unmeasured --backend "$b" $mode --prompt "$P" --max-tokens 48 \
      --json > "$work/$b.json" 2> "$work/$b.err" || { tail -5 "$work/$b.err"; status=1; }
    tail -1 "$work/$b.err"
  done
  if ! python3 -c 'import json,sys; a,b=(json.load(open(f))["tokens"] for f in sys.argv[1:]); print("tokens identical:", a==b, len(a)); sys.exit(a!=b)' "$work/gpu.json" "$work/cpu.json"; then
    status=1
  fi
done
exit "$status"
