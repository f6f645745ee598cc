#!/usr/bin/env bash
# Regenerate the Flash-Next toy checkpoint and its reference goldens
# (tests/data/flashnext_toy/) in a virtual environment of their own: torch is far too
# big for CI, which only reads the committed outputs.
#   scripts/golden/gen_flashnext_golden.sh [--out DIR]
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
cd "$root"
exec "$venv/bin/python" scripts/golden/gen_flashnext_golden.py "$@"
