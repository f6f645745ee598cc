#!/usr/bin/env bash
# The aarch64 build, checked on an x86-64 machine (CI runs it; gturbo's first users are
# on Apple silicon, where the CPU backend runs the NEON kernels and the installer the
# quantizer's portable loop):
#  1. the runtime's CPU kernel tests and the quantizer's tests (MLX goldens included)
#     cross-compiled to aarch64-unknown-linux-gnu and run under qemu-user, once on a CPU
#     with the dot-product instructions (`-cpu max`: the `sdot` loop) and the kernel
#     tests once on one without (`-cpu cortex-a72`: the widening-multiply loop);
#  2. `cargo check` of the runtime crate with the GPU feature for aarch64-apple-darwin
#     (wgpu's Metal backend type-checks without a macOS SDK; the runtime crate has no
#     TLS, whose `ring` would need a macOS C toolchain).
# Installs what it needs (the Rust targets, Debian's cross gcc and qemu-user). Timings
# under qemu mean nothing and are not reported.
#   scripts/aarch64.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
linux=aarch64-unknown-linux-gnu
mac=aarch64-apple-darwin
installed=$(rustup target list --installed)
for t in $linux $mac; do
  grep -qx "$t" <<<"$installed" || rustup target add "$t"
done
if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
fi
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
sysroot=/usr/aarch64-linux-gnu
mkdir -p target/aarch64
log=target/aarch64/tests.log
: > "$log"

# Which tests: the CPU kernels (every matrix encoding through matvec and matmul, f32
# and int8 activations, on 1–3 threads, against an f64 reference; the NEON loops' own
# test) and the quantizer (bit-exact with MLX on every width and group). The CPU
# backend's op checks (`kernels::conformance::cpu`) would add 100 s of emulation for
# ops whose NEON parts these already cover.
run() { # run CPU PACKAGE TARGET-SELECTOR -- FILTER...
  local cpu=$1 pkg=$2 sel=$3
  shift 3
  CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -cpu $cpu -L $sysroot" \
    cargo test -p "$pkg" --target $linux $sel "$@" 2>&1 | tee -a "$log" |
    grep -E "^test result|panicked|FAILED|failed" || true
}
cargo test -p gturbo-runtime --target $linux --lib --no-run 2>&1 | tail -n 1
cargo test -p gturbo-format --target $linux --lib --test quant_mlx --no-run 2>&1 | tail -n 1
echo "aarch64: qemu -cpu max (NEON + sdot)"
run max gturbo-runtime --lib -- runtime::kernels::tests runtime::kernels::neon
run max gturbo-format --lib -- quant
run max gturbo-format "--test quant_mlx"
echo "aarch64: qemu -cpu cortex-a72 (NEON, no sdot)"
run cortex-a72 gturbo-runtime --lib -- runtime::kernels::tests runtime::kernels::neon
passed=$(grep -E "^test .* ok$" "$log" | wc -l)
failed=$(grep -cE "^test .* FAILED$" "$log" || true)
echo "aarch64: $passed passed, $failed failed under qemu (log: $log)"
if [ "$failed" != 0 ] || grep -q "^error" "$log"; then
  grep -E "FAILED|panicked" "$log" | head -n 20
  exit 1
fi
[ "$passed" -gt 0 ] || { echo "aarch64: no test ran" >&2; exit 1; }

echo "aarch64: cargo check -p gturbo-runtime --features gpu --target $mac"
cargo check -p gturbo-runtime --features gpu --target $mac 2>&1 | tail -n 2
echo "aarch64: done"
