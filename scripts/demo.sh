#!/usr/bin/env bash
# The main job end to end on an embedded default, with no hub on the network:
# write a full-size Qwen3.8-Flash-Next replica (131 shards, ~360 GB apparent, real
# headers, sparse data), serve it from the local HF-compatible hub, and plan the
# install from shard headers alone.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${1:-target/demo}"
cargo build -q --bins
BIN=target/debug
rm -rf "$WORK" && mkdir -p "$WORK"

"$BIN/gturbo-dev" replica flash-next --full "$WORK/flash-next-full"
INDEX_SHA=$(sha256sum "$WORK/flash-next-full/model.safetensors.index.json" | cut -d' ' -f1)

# The local hub (resolve → CDN redirect → 206, as the real hub answers).
"$BIN/gturbo-dev" hub --repo "Qwen/Qwen3.8-Flash-Next=$WORK/flash-next-full" \
  --commit de4b8e4d43b917e7706784d8bb445c9af86a3540 --cdn --no-hash > "$WORK/hub.url" &
HUB=$!
trap 'kill $HUB 2>/dev/null || true' EXIT
for _ in $(seq 50); do [ -s "$WORK/hub.url" ] && break; sleep 0.1; done
URL=$(head -1 "$WORK/hub.url")

# The replica's index differs from the real repo's pin, so pin the replica's own.
"$BIN/gturbo" install qwen38flashnext --dry-run --endpoint "$URL" --index-sha256 "$INDEX_SHA" \
  --out "$WORK/qwen38flashnext.gturbo"

# A scaled replica (same tensor names and structure, real random BF16 weights) installed
# end to end from a local folder: quantized, repacked, verified, published.
"$BIN/gturbo-dev" replica flash-next --scaled "$WORK/flash-next-scaled"
SCALED_SHA=$(sha256sum "$WORK/flash-next-scaled/model.safetensors.index.json" | cut -d' ' -f1)
"$BIN/gturbo" -q install qwen38flashnext --from "$WORK/flash-next-scaled" --index-sha256 "$SCALED_SHA" \
  --out "$WORK/qwen38flashnext-scaled.gturbo"
ls -l "$WORK/qwen38flashnext-scaled.gturbo" "$WORK/qwen38flashnext-scaled.gturbo/packed_experts"
