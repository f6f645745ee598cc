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

# The real smoke model (SmolLM2-135M-Instruct as a BF16 HF snapshot): fetched and
# converted once, then reused (about 35 s cold, instant warm). Tests find it here.
scripts/fetch_smollm2.sh target/smollm2/snapshot
export GTURBO_SMOLLM2_SNAPSHOT="$PWD/target/smollm2/snapshot"
# mlx-lm's view of it (tokens, chat answer, greedy ids on a paragraph): an independent
# check of the conversion, and the reference tokens for the runtime's tests.
if [ ! -f target/peers/smollm2_check.json ] || [ target/smollm2/snapshot/.complete -nt target/peers/smollm2_check.json ]; then
  python3 scripts/smollm2_check.py target/smollm2/snapshot --json target/peers/smollm2_check.json
fi
export GTURBO_SMOLLM2_CHECK="$PWD/target/peers/smollm2_check.json"

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
