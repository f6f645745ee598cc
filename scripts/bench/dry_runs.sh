#!/usr/bin/env bash
# The six full-size dry runs of issue 25: each flagship's header-only replica
# (`gturbo-dev replica NAME DIR`: sparse shards at full apparent size) served by the
# local hub (`gturbo-dev hub --no-hash`, resolve -> CDN as the real hub answers; CDN=0:
# no CDN hop, so that each request is one ranged read, as tests/it/flagships.rs counts), then
# `gturbo install ORG/NAME --dry-run --json` (family picked from config.json). Prints one
# row per model: shards, tensors, output bytes, requests (total / header reads), wall
# time; gpt-oss-120b's MXFP4 experts are refused until MXFP4 installs land, which the
# row says. Not part of CI.
#
#   scripts/bench/dry_runs.sh [WORKDIR]       (default target/dry-runs; deleted after)
#
# Knobs: NO_BUILD=1 (use the release binaries as built), KEEP=1 (keep the replicas,
# ~430 MB on disk).
set -euo pipefail
cd "$(dirname "$0")/../.."
root="$PWD"
work="$(mkdir -p "${1:-target/dry-runs}" && cd "${1:-target/dry-runs}" && pwd)"
# shellcheck source=bench_common.sh
source scripts/bench/bench_common.sh
release_binaries

models=(
    "deepseek-v3 deepseek-ai/DeepSeek-V3"
    "kimi-k2-thinking moonshotai/Kimi-K2-Thinking"
    "gpt-oss-120b openai/gpt-oss-120b"
    "glm-4.5-air zai-org/GLM-4.5-Air"
    "qwen3-next-80b Qwen/Qwen3-Next-80B-A3B-Instruct"
    "minimax-m2 MiniMaxAI/MiniMax-M2"
)
cleanup() { stop_hub; [ "${KEEP:-0}" = 1 ] || rm -rf "$work"; }
trap cleanup EXIT

hub_args=()
for m in "${models[@]}"; do
    read -r name repo <<<"$m"
    "$dev" replica "$name" "$work/$name" >&2
    hub_args+=(--repo "$repo=$work/$name")
done
cdn=(--cdn)
[ "${CDN:-1}" = 1 ] || cdn=()
"$dev" hub "${hub_args[@]}" "${cdn[@]}" --no-hash >"$work/hub.url" 2>"$work/hub.log" &
hub_pid=$!
for _ in $(seq 100); do [ -s "$work/hub.url" ] && break; sleep 0.1; done
url=$(head -n1 "$work/hub.url")

printf '%-34s %7s %8s %18s %16s %9s %8s %s\n' repo shards tensors "output B" "apparent src B" requests "wall s" note
for m in "${models[@]}"; do
    read -r name repo <<<"$m"
    apparent=$(du -cb --apparent-size "$work/$name"/*.safetensors | tail -n1 | cut -f1)
    start=$(date +%s.%N)
    if "$gturbo" install "$repo" --dry-run --json --endpoint "$url" >"$work/$name.json" 2>"$work/$name.err"; then
        wall=$(echo "$(date +%s.%N) - $start" | bc)
        python3 - "$work/$name.json" "$repo" "$apparent" "$wall" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
side = (d.get("sidecars") or [""])[0]
note = side.split(": ", 1)[-1].split(" of the source")[0] if "skipped" in side else ""
print(f"{sys.argv[2]:<34} {d['shards']['count']:>7} {d['tensors']:>8} {d['outputs']['total']:>18,} "
      f"{int(sys.argv[3]):>16,} {d['requests']['total']:>4}/{d['requests']['headers']:<4} "
      f"{float(sys.argv[4]):>8.2f} mtp {note}")
EOF
    else
        wall=$(echo "$(date +%s.%N) - $start" | bc)
        printf '%-34s %7s %8s %18s %16s %9s %8.2f %s\n' "$repo" - - - "$apparent" - "$wall" \
            "refused: $(grep -o 'MXFP4[^,;]*' "$work/$name.err" | head -n1)"
    fi
done
