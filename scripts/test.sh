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
# cargo test's own summary lines are per binary; one plain total closes the run.
summary=$(awk '/^test result:/ { p += $4; f += $6; i += $8 } END { printf "%d passed, %d failed, %d skipped", p, f, i }' target/peers/cargo-test.log)
echo "$summary"

if [ "$FUZZ_SECONDS" != 0 ] && [ -x scripts/fuzz.sh ]; then
  # libFuzzer is chatty: keep its log in a file and show the verdict.
  if ! scripts/fuzz.sh "$FUZZ_SECONDS" > target/peers/fuzz.log 2>&1; then
    tail -n 40 target/peers/fuzz.log
    echo "fuzz: failed (full log: target/peers/fuzz.log)" >&2
    exit 1
  fi
  grep -E "^(Done|fuzz:)|stat::number_of_executed_units" target/peers/fuzz.log || true
fi
echo "$summary"
