#!/usr/bin/env bash
# CPU kernel figures on SmolLM2-135M's shapes (INT4/INT8/BF16, 1 and 2 threads):
# per-shape matvec µs and GB/s, a full decode token sweep, and prefill matmul n=8/32.
# Pass --quick for fewer repetitions.
set -euo pipefail
cd "$(dirname "$0")/../.."
lscpu | grep -E "^(Model name|CPU\(s\)|Flags)" | sed -E 's/^Flags:.*/Flags: (see lscpu)/'
cargo run --release --quiet --example bench_kernels -- "$@"
