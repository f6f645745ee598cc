#!/usr/bin/env bash
# The MLX-source install benchmark (issue 12, "Benchmark"). Not part of CI.
#
#   scripts/bench/bench_mlx_install.sh [WORKDIR]          (default target/bench-mlx-install)
#
# The install benchmark's BF16 Qwen3-MoE (scripts/bench/make_bench_snapshot.sh, LAYERS=16:
# 3.4 GB; BENCH_SNAPSHOT=DIR reuses one already made) is converted once with
# `mlx_lm.convert -q --q-bits 4 --q-group-size 64`; that MLX repo is served by
# `gturbo-dev hub` over loopback, and `gturbo install` (default settings: every shard
# hashed against the hub's LFS SHA-256, no quantization to do) is timed against
# `hf download` of the same repo: medians of RUNS (3), wall s, MB/s of the repo's
# shards, peak RSS (/usr/bin/time -v), and the ratio gturbo / hf; also gturbo with
# `--no-verify-source` (what the hash costs). The "link rate" is a plain `curl` of the
# largest shard from the same hub to /dev/null. The disk bound: gturbo makes every
# read durable (fsync) before its journal line, so the repo's bytes written with
# `dd conv=fdatasync` to the same folder is the fastest a durable install can go; the
# closing lines compare gturbo with both (hf download leaves its bytes in the page
# cache, unflushed).
#
# The peers (hf, mlx_lm) come from the pinned venv `scripts/venv.sh test` under
# target/ (GTURBO_VENV_ROOT moves it). Knobs: LAYERS, RUNS, BENCH_SNAPSHOT,
# NO_BUILD=1 (use the release binaries already built).
set -euo pipefail
cd "$(dirname "$0")/../.."
root="$PWD"
work="$(mkdir -p "${1:-target/bench-mlx-install}" && cd "${1:-target/bench-mlx-install}" && pwd)"
layers="${LAYERS:-16}"
runs="${RUNS:-3}"
repo="mlx-community/bench-qwen3-moe-4bit"

# shellcheck source=bench_common.sh
source scripts/bench/bench_common.sh
release_binaries
# shellcheck source=venv.sh
source scripts/venv.sh test

snap="${BENCH_SNAPSHOT:-$(scripts/bench/make_bench_snapshot.sh "$work/snapshot-$layers" "$layers")}"
mlx="$work/mlx-q4g64-$(basename "$snap")"
if [ ! -f "$mlx/.converted" ]; then
    echo "== mlx_lm.convert -q --q-bits 4 --q-group-size 64 of $snap" >&2
    rm -rf "$mlx"
    mlx_lm.convert --hf-path "$snap" --mlx-path "$mlx" -q --q-bits 4 --q-group-size 64 >&2
    touch "$mlx/.converted"
fi
bytes=$(du -bc "$mlx"/*.safetensors | tail -n1 | cut -f1)
shards=$(ls "$mlx"/*.safetensors | wc -l)
echo "== MLX repo $mlx: $bytes bytes in $shards shards" >&2

trap stop_hub EXIT
rm -f "$work/hub.url"
"$dev" hub --repo "$repo=$mlx" --cdn >"$work/hub.url" 2>"$work/hub.log" &
hub_pid=$!
hub_ready "$work/hub.url"

# timed LABEL CMD...: appends "wall_s rss_kib" to $work/LABEL.times.
timed() {
    time_run "$@"
    echo "$wall $rss" >>"$work/$1.times"
}
row() {
    awk -v l="$1" -v w="$(median "$1" 1)" -v r="$(median "$1" 2)" -v b="$bytes" \
        -v n="$(wc -l <"$work/$1.times")" \
        'BEGIN { printf "| %-28s | %7.2f | %8.0f | %8.0f | %d |\n", l, w, b/1e6/w, r/1024, n }'
}

idx=$(sha256sum "$mlx/model.safetensors.index.json" | cut -d' ' -f1)
rm -f "$work"/*.times
big=$(ls -S "$mlx"/*.safetensors | head -n1)
big_bytes=$(stat -c %s "$big")
for i in $(seq 1 "$runs"); do
    echo "-- run $i/$runs" >&2
    # The link: one plain loopback copy of the largest shard.
    t0=$(date +%s.%N)
    curl -sfL -o /dev/null "$url/$repo/resolve/main/$(basename "$big")"
    t1=$(date +%s.%N)
    awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a, 0 }' >>"$work/curl.times"
    # The disk: the repo's size written and flushed, in 8 MiB blocks.
    t0=$(date +%s.%N)
    dd if=/dev/zero of="$work/dd.bin" bs=8M count=$(( (bytes + 8388607) / 8388608 )) conv=fdatasync status=none
    t1=$(date +%s.%N)
    rm -f "$work/dd.bin"
    awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a, 0 }' >>"$work/disk.times"
    out="$work/out.gturbo"
    rm -rf "$out" "$out".partial*
    timed "gturbo install" "$gturbo" -q install --family qwen3_moe "$repo" --endpoint "$url" \
        --index-sha256 "$idx" --out "$out" --no-progress
    grep -h "gturbo: installed" "$work/gturbo install.time" | tail -n1 >&2 || true
    rm -rf "$out"
    # The same without the whole-shard SHA-256 (what the hash costs).
    timed "gturbo --no-verify-source" "$gturbo" -q install --family qwen3_moe "$repo" \
        --endpoint "$url" --index-sha256 "$idx" --out "$out" --no-progress --no-verify-source
    rm -rf "$out"
    dest="$work/hf-download"
    rm -rf "$dest" "$work/hf-home"
    HF_HOME="$work/hf-home" HF_ENDPOINT="$url" HF_HUB_DISABLE_TELEMETRY=1 \
        timed "hf download" hf download "$repo" --local-dir "$dest"
    rm -rf "$dest" "$work/hf-home"
done
machine="$(nproc) cores, $(awk '/MemTotal/ { printf "%.0f GiB", $2/1048576 }' /proc/meminfo)"
{
    echo
    echo "Loopback, MLX 4-bit g64 Qwen3-MoE ($layers layers): $bytes B in $shards shards, $machine, medians"
    echo
    echo "| what | wall s | MB/s | peak RSS MiB | runs |"
    echo "|---|---|---|---|---|"
    row "gturbo install"
    row "gturbo --no-verify-source"
    row "hf download"
    echo
    g=$(median "gturbo install" 1); h=$(median "hf download" 1); c=$(median curl 1)
    d=$(median disk 1)
    awk -v g="$g" -v h="$h" -v c="$c" -v d="$d" -v b="$bytes" -v bb="$big_bytes" 'BEGIN {
        link = bb / c
        bs = 8388608; disk = int((b + bs - 1) / bs) * bs / d
        printf "- link rate (curl of the largest shard, %d B, to /dev/null): %.0f MB/s\n", bb, link / 1e6
        printf "- disk rate (the repo'"'"'s size by dd conv=fdatasync, same folder): %.0f MB/s\n", disk / 1e6
        printf "- gturbo / hf download, wall: %.2f\n", g / h
        printf "- gturbo MB/s / link rate: %.2f\n", (b / g) / link
        bound = link < disk ? link : disk
        printf "- gturbo MB/s / min(link, disk) rate: %.2f\n", (b / g) / bound }'
} | tee "$work/bench.md"
echo "== table: $work/bench.md" >&2
