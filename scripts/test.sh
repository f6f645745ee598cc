#!/usr/bin/env bash
# The project's test command (README, CI): lint, the Rust test suite with the Python
# peers required, and a bounded fuzz run. Installs the Python peers it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZ_SECONDS="${FUZZ_SECONDS:-45}"

python3 -m pip install -q --disable-pip-version-check -r scripts/requirements-ci.txt
python3 -m pip install -q --disable-pip-version-check -r scripts/requirements-check.txt

cargo fmt --all -- --check
cargo clippy --all-targets -- -D warnings

mkdir -p target/peers
if [ -f scripts/mlx_crosscheck.py ]; then
  python3 scripts/mlx_crosscheck.py target/peers/mlx_crosscheck.json
  export GTURBO_MLX_CROSSCHECK="$PWD/target/peers/mlx_crosscheck.json"
fi

# The tests that talk to Python peers fail instead of skipping when this is set.
export GTURBO_REQUIRE_PY=1
cargo test --all-targets 2>&1 | tee target/peers/cargo-test.log
# cargo test's own summary lines are per binary; print one plain total for CI.
awk '/^test result:/ { p += $4; f += $6; i += $8 } END { printf "%d passed, %d failed, %d skipped\n", p, f, i }' target/peers/cargo-test.log

if [ "$FUZZ_SECONDS" != 0 ] && [ -x scripts/fuzz.sh ]; then
  scripts/fuzz.sh "$FUZZ_SECONDS"
fi
