#!/usr/bin/env bash
# Write a fixture snapshot directory (see `gturbo-dev replica --help`):
#   scripts/make-replica.sh flash-next --full OUT      # 131 header-only shards, ~360 GB apparent
#   scripts/make-replica.sh flash-next --scaled OUT    # small, real random BF16 data
#   scripts/make-replica.sh qwen3-moe|qwen3|llama OUT [--shards N] [--seed N]
set -euo pipefail
cd "$(dirname "$0")/.."
exec cargo run --quiet --release -p gturbo-testkit --bin gturbo-dev -- replica "$@"
