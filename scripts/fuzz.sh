#!/usr/bin/env bash
# Run every cargo-fuzz target under fuzz/ for SECONDS each (default 60); exit non-zero
# if any target finds a crash. Installs cargo-fuzz when missing; needs a nightly
# toolchain (`rustup toolchain install nightly`).
#
# Usage: scripts/fuzz.sh [SECONDS]
#
# The seed corpus is generated here from valid headers rather than committed as
# binaries; fuzz/corpus and fuzz/artifacts are gitignored. A crash leaves its input in
# fuzz/artifacts/<target>/; turn it into a unit-test regression case before fixing.
set -euo pipefail

seconds="${1:-60}"
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [ "$seconds" -eq 0 ]; then
    echo "usage: $0 SECONDS (a positive integer)" >&2
    exit 2
fi

cd "$(dirname "$0")/.."

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "installing cargo-fuzz" >&2
    cargo install cargo-fuzz --locked
fi

# 8 little-endian bytes of $1.
le64() {
    local n="$1" i
    for i in 0 1 2 3 4 5 6 7; do
        # shellcheck disable=SC2059
        printf "\\x$(printf %02x $(((n >> (8 * i)) & 255)))"
    done
}

# One header_parse input: [claimed file size u64][header length u64][json], where the
# file size makes the data section exactly `data_len` bytes.
header_seed() {
    local json="$1" data_len="$2"
    local len=${#json}
    le64 $((8 + len + data_len))
    le64 "$len"
    printf '%s' "$json"
}

seed_header_parse() {
    local dir="fuzz/corpus/header_parse"
    mkdir -p "$dir"
    header_seed '{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}' 16 >"$dir/seed-one"
    header_seed '{"__metadata__":{"format":"pt"},"b":{"dtype":"BF16","shape":[4],"data_offsets":[24,32]},"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"e":{"dtype":"I64","shape":[0,5],"data_offsets":[32,32]}}    ' 32 >"$dir/seed-many"
    header_seed '{}' 0 >"$dir/seed-empty"
}

targets=$(cargo +nightly fuzz list)
failed=()
for target in $targets; do
    if [ "$target" = header_parse ]; then
        seed_header_parse
    fi
    mkdir -p "fuzz/corpus/$target"
    echo "== fuzz $target for ${seconds}s" >&2
    if ! cargo +nightly fuzz run --sanitizer none "$target" -- \
        -max_total_time="$seconds" -timeout=10 -print_final_stats=1; then
        failed+=("$target")
    fi
done

if [ "${#failed[@]}" -ne 0 ]; then
    echo "fuzz: crash or failure in: ${failed[*]} (inputs under fuzz/artifacts/)" >&2
    exit 1
fi
echo "fuzz: no crashes in: $targets" >&2
