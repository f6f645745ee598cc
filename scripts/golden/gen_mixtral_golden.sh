#!/usr/bin/env bash
# Regenerate the Mixtral toy checkpoint and its transformers goldens
# (tests/data/mixtral_toy/) in the goldens' own virtual environment (golden_venv.sh).
#   scripts/golden/gen_mixtral_golden.sh [--out DIR] [--check]
set -euo pipefail
exec "$(dirname "$0")/golden_venv.sh" scripts/golden/gen_mixtral_golden.py "$@"
