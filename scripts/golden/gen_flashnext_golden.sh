#!/usr/bin/env bash
# Regenerate the Flash-Next toy checkpoint and its reference goldens
# (tests/data/flashnext_toy/) in the goldens' own virtual environment (golden_venv.sh).
#   scripts/golden/gen_flashnext_golden.sh [--out DIR] [--check]
set -euo pipefail
exec "$(dirname "$0")/golden_venv.sh" scripts/golden/gen_flashnext_golden.py "$@"
