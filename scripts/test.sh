#!/usr/bin/env bash
# The project's test command (README, CI): lint, the Rust test suite of the whole
# workspace with its Python peers, and a bounded fuzz run. The peers run in
# target/venv/test (scripts/venv.sh, pinned), never in the system interpreter.
#
# A test that cannot run here (a peer, the SmolLM2 snapshot, root for a tmpfs) is
# reported as skipped, by name and reason, and counted in the closing line; in a strict
# run (CI=true or GTURBO_REQUIRE_PY=1, as .ci/run sets) it fails instead.
set -euo pipefail
cd "$(dirname "$0")/.."
# The whole fuzz budget, split over the targets (three since issue 13: 30 s each, the
# 90 s two targets had before).
FUZZ_SECONDS="${FUZZ_SECONDS:-90}"
# Seconds since the run began, for the stage lines (.ci/run passes its own start).
T0="${CI_T0:-0}"
stage() { echo "test.sh: $1 done at $((SECONDS + T0)) s"; }

# shellcheck source=venv.sh
source scripts/venv.sh test

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
stage lint

# The Python peers (mlx, mlx-lm) and the test build share nothing: the peers run
# beside the build and have finished before any test that reads their output starts.
mkdir -p target/peers
peers() {
  if [ -f scripts/peers/mlx_crosscheck.py ]; then
    python3 scripts/peers/mlx_crosscheck.py target/peers/mlx_crosscheck.json
  fi
  # The real smoke model (SmolLM2-135M-Instruct as a BF16 HF snapshot): fetched and
  # converted once, then reused (about 35 s cold, instant warm; scripts/demo.sh shares
  # it). Tests find it here.
  scripts/fetch_smollm2.sh target/smollm2/snapshot
  # mlx-lm's view of it (tokens, chat answer, greedy ids on a paragraph): an independent
  # check of the conversion (the script fails on a wrong answer); its JSON is kept for reports.
  if [ ! -f target/peers/smollm2_check.json ] || [ target/smollm2/snapshot/.complete -nt target/peers/smollm2_check.json ]; then
    python3 scripts/peers/smollm2_check.py target/smollm2/snapshot --json target/peers/smollm2_check.json
  fi
}
peers > target/peers/peers.log 2>&1 &
PEERS=$!
trap 'kill $PEERS 2>/dev/null || true' EXIT
[ ! -f scripts/peers/mlx_crosscheck.py ] || export GTURBO_MLX_CROSSCHECK="$PWD/target/peers/mlx_crosscheck.json"
export GTURBO_SMOLLM2_SNAPSHOT="$PWD/target/smollm2/snapshot"
cargo test --workspace --all-targets --no-run
if ! wait $PEERS; then
  cat target/peers/peers.log
  echo "test.sh: a Python peer failed (log: target/peers/peers.log)" >&2
  exit 1
fi
trap - EXIT
cat target/peers/peers.log

# Tests append `GTURBO-SKIP <test>: <reason>` here (gturbo_testkit::skip).
export GTURBO_SKIP_LOG="$PWD/target/peers/skips.log"
: > "$GTURBO_SKIP_LOG"
stage peers
status=0
cargo test --workspace --all-targets 2>&1 | tee target/peers/cargo-test.log || status=$?

# cargo test's own summary lines are per binary, and count a skipped test as passed;
# one plain total closes the run. A test is skipped when it logged a skip and passed
# (one that failed after a partial skip stays failed); ignored tests are skipped too.
summary=$(awk -v skips="$GTURBO_SKIP_LOG" '
  BEGIN {
    while ((getline line < skips) > 0) {
      sub(/^GTURBO-SKIP /, "", line)
      name = substr(line, 1, index(line, ": ") - 1)
      if (!(name in why)) why[name] = substr(line, index(line, ": ") + 2)
    }
  }
  /^test result:/ { p += $4; f += $6; i += $8 }
  /^test .* \.\.\. ok$/ { if ($2 in why && !($2 in seen)) { seen[$2] = 1; s++; list = list "  skipped " $2 ": " why[$2] "\n" } }
  END {
    printf "%s", list
    printf "%d passed, %d failed, %d skipped\n", p - s, f, s + i
  }' target/peers/cargo-test.log)
echo "$summary"
stage "cargo test"
[ "$status" = 0 ] || exit "$status"

if [ "$FUZZ_SECONDS" != 0 ] && [ -x scripts/fuzz.sh ]; then
  # libFuzzer is chatty: keep its log in a file and show the verdict.
  if ! scripts/fuzz.sh --total "$FUZZ_SECONDS" > target/peers/fuzz.log 2>&1; then
    tail -n 40 target/peers/fuzz.log
    echo "fuzz: failed (full log: target/peers/fuzz.log)" >&2
    exit 1
  fi
  grep -E "^(Done|fuzz:)|stat::number_of_executed_units" target/peers/fuzz.log || true
  stage fuzz
fi
echo "$summary" | tail -n 1
