#!/usr/bin/env bash
# Run a golden generator in the pinned virtual environment the transformers goldens
# share (target/venv-golden, pinned by scripts/requirements/requirements-golden.txt),
# building it first when it is missing or the pins changed: torch is far too big for
# CI, which only reads the committed outputs.
#   scripts/golden/golden_venv.sh SCRIPT.py [ARGS...]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${GOLDEN_VENV:-$root/target/venv-golden}"
req="$root/scripts/requirements/requirements-golden.txt"
stamp="$venv/.requirements.sha256"
want="$(sha256sum "$req" | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --disable-pip-version-check -r "$req"
    echo "$want" > "$stamp"
fi
script="$1"
shift
cd "$root"
exec "$venv/bin/python" "$script" "$@"
