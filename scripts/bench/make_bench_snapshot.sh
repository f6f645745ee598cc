#!/usr/bin/env bash
# Write the install benchmark's BF16 Qwen3-MoE snapshot (random weights, 4 shards) and
# print its directory. LAYERS=16 (default) is 3.4 GB, LAYERS=5 is 1.2 GB.
#
# Usage: scripts/bench/make_bench_snapshot.sh DIR [LAYERS]
# Reuses DIR when it already holds a snapshot of that many layers.
set -euo pipefail
dir="$1"
layers="${2:-16}"
cd "$(dirname "$0")/../.."
dev="${GTURBO_DEV:-$PWD/target/release/gturbo-dev}"
marker="$dir/.bench-layers-$layers"
if [ ! -f "$marker" ]; then
    rm -rf "$dir"
    "$dev" replica qwen3-moe --bench --layers "$layers" "$dir" >&2
    touch "$marker"
fi
echo "$dir"
