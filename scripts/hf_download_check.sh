#!/usr/bin/env bash
# Serve DIR with `gturbo-dev hub` and download it back with the official Python client
# (`hf download`), then compare every file byte for byte.
#
#   scripts/hf_download_check.sh DIR [--cdn]
#
# Needs a built `gturbo-dev` (cargo build -p gturbo-testkit); the hf client comes from
# target/venv/test (scripts/venv.sh).
set -euo pipefail
# shellcheck source=venv.sh
source "$(dirname "$0")/venv.sh" test
dir=${1:?usage: $0 DIR [--cdn]}
shift
bin=${GTURBO_DEV:-target/debug/gturbo-dev}
repo=gturbo-check/snapshot
work=$(mktemp -d)
trap 'kill "$hub_pid" 2>/dev/null || true; rm -rf "$work"' EXIT

"$bin" hub --repo "$repo=$dir" "$@" >"$work/url" 2>"$work/hub.log" &
hub_pid=$!
for _ in $(seq 100); do [ -s "$work/url" ] && break; sleep 0.1; done
url=$(head -n1 "$work/url")
[ -n "$url" ] || { echo "hub did not start:"; cat "$work/hub.log"; exit 2; }

client=hf
command -v hf >/dev/null || client=huggingface-cli
env -u HF_HUB_OFFLINE -u HF_TOKEN HF_ENDPOINT="$url" HF_HOME="$work/hf_home" \
    HF_HUB_DISABLE_XET=1 HF_HUB_DISABLE_TELEMETRY=1 \
    "$client" download "$repo" --revision main --local-dir "$work/out" >/dev/null

# Compare the served tree with the download (minus the client's .cache; the hub skips
# .git and .cache too).
diff -r --exclude=.cache --exclude=.git "$dir" "$work/out"
echo "ok: $(find "$work/out" -type f -not -path '*/.cache/*' | wc -l) files identical ($url)"
