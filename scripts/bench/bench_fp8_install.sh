#!/usr/bin/env bash
# The FP8 install benchmark (issue 25). Not part of CI.
#
#   scripts/bench/bench_fp8_install.sh [WORKDIR]        (default target/bench-fp8-install)
#
# A generated DeepSeek-V3-shaped FP8 source (scripts/bench/make_fp8_source.py, LAYERS=6:
# 2.3 GB of e4m3 weights with their 128x128 float32 `weight_scale_inv`) is installed at
# INT4 g64 in one run, side by side:
#   gturbo    `gturbo install --from SRC` (default profile: INT4 g64, routers INT8),
#             dequantizing each FP8 tile in memory;
#   two-step  what users run today: FP8 -> BF16 with MLX-LM's dequantization
#             (`mlx_lm.convert --dtype bfloat16`, whose deepseek_v3 `sanitize` applies
#             `weight_scale_inv`), then `mlx_lm.convert -q --q-bits 4 --q-group-size 64`
#             of that BF16 copy.
# Each step under /usr/bin/time -v: wall s, peak RSS, bytes written (its "File system
# outputs" x 512), and the largest amount of data on disk beside the source (the BF16
# copy for the two-step route). It checks the free disk first (needs ~9 GB: the source,
# the BF16 copy, both outputs) and deletes everything it made at the end (KEEP=1 keeps).
#
# Knobs: LAYERS (6), NO_BUILD=1 (use target/release/gturbo as built), PEER_VENV=DIR
# (a venv holding mlx_lm and numpy to use as is, instead of scripts/venv.sh test).
set -euo pipefail
cd "$(dirname "$0")/../.."
root="$PWD"
work="$(mkdir -p "${1:-target/bench-fp8-install}" && cd "${1:-target/bench-fp8-install}" && pwd)"
layers="${LAYERS:-6}"

need_kb=$((9 * 1024 * 1024))
free_kb=$(df -Pk "$work" | awk 'NR==2 { print $4 }')
if [ "$free_kb" -lt "$need_kb" ]; then
    echo "bench_fp8_install: $((free_kb / 1024)) MiB free under $work, needs 9 GiB; not starting" >&2
    exit 2
fi

# shellcheck source=bench_common.sh
source scripts/bench/bench_common.sh
release_binaries
if [ -n "${PEER_VENV:-}" ]; then
    PATH="$PEER_VENV/bin:$PATH"
else
    # shellcheck source=venv.sh
    source scripts/venv.sh test
fi

cleanup() { [ "${KEEP:-0}" = 1 ] || rm -rf "$work/src" "$work/bf16" "$work/mlx-q4" "$work/gturbo.gturbo" "$work/tok"; }
trap cleanup EXIT

src="$work/src"
rm -rf "$src" "$work/bf16" "$work/mlx-q4" "$work/gturbo.gturbo" "$work/tok"
python3 scripts/bench/make_fp8_source.py "$src" "$layers"
# A small tokenizer (mlx_lm.convert loads one; gturbo copies it).
"$dev" replica llama "$work/tok" >/dev/null
cp "$work/tok"/tokenizer.json "$work/tok"/tokenizer_config.json "$src"/
src_bytes=$(du -bc "$src"/*.safetensors | tail -n1 | cut -f1)
sync

# step LABEL CMD...: one timed step; prints its row and keeps wall/rss/written.
declare -A W R D
step() {
    local label="$1"; shift
    sync; echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true
    time_run "$label" "$@"
    local blocks
    blocks=$(sed -n 's/.*File system outputs: //p' "$work/$label.time")
    W[$label]=$wall; R[$label]=$rss; D[$label]=$((blocks * 512))
    printf '  %-22s %8.1f s  %8d MiB RSS  %8d MB written\n' "$label" "$wall" $((rss / 1024)) $((blocks * 512 / 1000000)) >&2
}

echo "== source: $src_bytes bytes of FP8 safetensors ($layers layers)" >&2
step gturbo "$gturbo" -q install --from "$src" --family deepseek_v3 --out "$work/gturbo.gturbo"
g_out=$(du -sb "$work/gturbo.gturbo" | cut -f1)
rm -rf "$work/gturbo.gturbo"
step mlx_dequant_bf16 mlx_lm.convert --hf-path "$src" --mlx-path "$work/bf16" --dtype bfloat16
bf16_bytes=$(du -sb "$work/bf16" | cut -f1)
step mlx_quantize_q4 mlx_lm.convert --hf-path "$work/bf16" --mlx-path "$work/mlx-q4" -q --q-bits 4 --q-group-size 64
m_out=$(du -sb "$work/mlx-q4" | cut -f1)

two_wall=$(echo "${W[mlx_dequant_bf16]} + ${W[mlx_quantize_q4]}" | bc)
two_rss=$(( R[mlx_dequant_bf16] > R[mlx_quantize_q4] ? R[mlx_dequant_bf16] : R[mlx_quantize_q4] ))
two_disk=$(( D[mlx_dequant_bf16] + D[mlx_quantize_q4] ))
echo
echo "FP8 source: $src_bytes B ($layers layers, DeepSeek-V3-shaped), INT4 g64"
printf '%-30s %10s %12s %16s %18s\n' route "wall s" "peak RSS MiB" "written MB" "BF16 copy on disk"
printf '%-30s %10.1f %12d %16d %18s\n' "gturbo install (FP8 direct)" "${W[gturbo]}" $((R[gturbo] / 1024)) $((D[gturbo] / 1000000)) "none"
printf '%-30s %10.1f %12d %16d %18s\n' "mlx_lm FP8->BF16 + convert -q" "$two_wall" $((two_rss / 1024)) $((two_disk / 1000000)) "$bf16_bytes B"
echo "outputs: gturbo $g_out B, mlx_lm $m_out B; gturbo / two-step wall: $(echo "scale=2; ${W[gturbo]} / $two_wall" | bc)"
