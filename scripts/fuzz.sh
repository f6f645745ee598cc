#!/usr/bin/env bash
# Run every cargo-fuzz target under fuzz/ for SECONDS each (default 60), or, with
# --total, SECONDS split evenly over the targets (CI's budget stays the same as
# targets are added); exit non-zero if any target finds a crash. Installs cargo-fuzz
# when missing; needs a nightly toolchain (`rustup toolchain install nightly`).
# The targets are built once, then fuzzed side by side, one per CPU core (libFuzzer
# runs on one thread), so each still gets a core for its whole SECONDS. --build only
# builds them (CI does it early, beside other work, in fuzz/target of its own).
#
# Usage: scripts/fuzz.sh [--total] [SECONDS] | scripts/fuzz.sh --build
#
# The seed corpora are generated here (valid safetensors headers; a valid manifest,
# resident index and resident file) rather than committed as binaries; fuzz/corpus and fuzz/artifacts are gitignored. A crash leaves its input in
# fuzz/artifacts/<target>/; turn it into a unit-test regression case before fixing.
set -euo pipefail

total=0 build_only=0
if [ "${1:-}" = --total ]; then
    total=1
    shift
elif [ "${1:-}" = --build ]; then
    build_only=1
    shift
fi
seconds="${1:-60}"
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [ "$seconds" -eq 0 ]; then
    echo "usage: $0 [--total] SECONDS (a positive integer)" >&2
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

# manifest_parse seeds: a consistent manifest (one expert pool, one row pool, a
# tokenizer), a bare resident index, and a whole resident file (head, index, page of
# padding, a 64-byte payload).
seed_manifest_parse() {
    local dir="fuzz/corpus/manifest_parse"
    mkdir -p "$dir"
    cat >"$dir/seed-manifest" <<'JSON'
{"arch":{"axes":{"hc_count":4,"hc_lowrank":64,"head_dim":64},"model_type":"qwen4_exp","required_axes":["gatedAttention","gatedDeltaNetLinearAttention"]},"excluded_tensors":33,"expert_pools":[{"blob_bytes":55296,"dtype":"BF16","experts":8,"file":"packed_experts/layer_00.bin","file_bytes":524288,"layer":0,"parts":[{"biases":1024,"cols":256,"offset":0,"part":"gate","rows":128,"scales":1024,"weights":16384},{"biases":1024,"cols":256,"offset":18432,"part":"up","rows":128,"scales":1024,"weights":16384},{"biases":1024,"cols":128,"offset":36864,"part":"down","rows":256,"scales":1024,"weights":16384}],"scheme":"int4_g64","sidecar":null,"stride":65536}],"family":"qwen38flashnext","files":[{"bytes":524288,"kind":"experts","path":"packed_experts/layer_00.bin","sha256":"6b629405b9162e1d1ca56fd00a0977b78d1f2246d0b0bf15b3383e3674c40781"},{"bytes":1802240,"kind":"rows","path":"ple/layer_01_ngram_rows.bin","sha256":"671e01490ba2df48e09ef39013e7ac48881cbae0a8812514e014003cc6261dca"},{"bytes":5980672,"kind":"resident","path":"resident.bin","sha256":"0367017b94cab14bc06443623880d6c429ef0a04ef3173f0c28c521dc2e963d3"},{"bytes":5452,"kind":"tokenizer","path":"tokenizer/tokenizer.json","sha256":"4a93e03bf8ace2a94e7cc5be83d8698756047bb99b24702b36b371fedef8f9a6"}],"format":"gturbo","minor_version":1,"model_id":"snap","plan_fingerprint":"d1ba3e963019fcb88282f789b5faf8fac1f1ef3855e2e78a552d1bc0df7a0a92","quantized_at_install":{"bits":4,"group_size":64,"overrides":[["**.mlp.gate.weight","int8_g64"],["**.mlp.shared_expert_gate.weight","int8_g64"]],"parity_gate":"bit-exact with MLX 0.32.4 mx.quantize (tests/data/mlx_q4g64_golden.json)","quality_gate":null,"scheme":"int4_g64"},"resident":{"entries":128,"file":"resident.bin","payload_start":32768},"row_pools":[{"dtype":"BF16","file":"ple/layer_01_ngram_rows.bin","file_bytes":1802240,"layer":1,"name":"ngram_rows","row_bytes":320,"rows_per_block":51,"scheme":"passthrough","shards":[{"blocks":59,"offset":0,"region_bytes":966656,"rows":3000,"tensor":"t0"},{"blocks":51,"offset":966656,"region_bytes":835584,"rows":2551,"tensor":"t1"}],"width":160}],"sidecars":{"mtp":"carried"},"source":{"commit":null,"index_sha256":"03b786beabf4ab2717420e7a9104c624344550cb2c727d10cc73cdd0a529bf18","repo":"snap","revision":"local"},"tool":{"name":"gturbo","version":"0.1.0"},"version":1}
JSON
    local index='{"format":"gturbo-resident","version":1,"tensors":[{"name":"a.weight","dtype":"BF16","shape":[2,64],"scheme":"int4_g64","weights":{"offset":0,"len":64},"scales":{"offset":64,"len":4},"biases":{"offset":128,"len":4}},{"name":"n.weight","dtype":"F32","shape":[8],"scheme":"passthrough","data":{"offset":16384,"len":32}}]}'
    printf '%s' "$index" >"$dir/seed-index"
    {
        printf 'GTRBRES1'
        le64 "${#index}"
        printf '%s' "$index"
        head -c $((16384 - 16 - ${#index})) /dev/zero
        head -c $((16384 + 64)) /dev/zero
    } >"$dir/seed-resident"
}

# config_axes seeds: a flat config (qwen3_moe), a nested one (Flash-Next's text_config),
# and a dense llama one.
seed_config_axes() {
    local dir="fuzz/corpus/config_axes"
    mkdir -p "$dir"
    printf '%s' '{"model_type":"qwen3_moe","hidden_size":128,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":64,"num_experts":8,"num_experts_per_tok":2,"moe_intermediate_size":64,"vocab_size":512,"rope_theta":1000000.0,"rms_norm_eps":1e-6,"norm_topk_prob":true,"max_position_embeddings":4096,"rope_scaling":null}' >"$dir/seed-qwen3-moe"
    printf '%s' '{"model_type":"qwen4_exp","text_config":{"hidden_size":2560,"num_hidden_layers":48,"num_attention_heads":24,"num_key_value_heads":2,"head_dim":256,"num_experts":512,"num_experts_per_tok":10,"moe_intermediate_size":640,"vocab_size":248320,"hc_count":4,"hc_lowrank":320}}' >"$dir/seed-flash-next"
    printf '%s' '{"model_type":"llama","hidden_size":576,"num_hidden_layers":30,"num_attention_heads":9,"num_key_value_heads":3,"intermediate_size":1536,"vocab_size":49152,"rope_theta":100000,"rms_norm_eps":1e-5,"tie_word_embeddings":true}' >"$dir/seed-llama"
}

# serve_request seeds: an OpenAI chat request, an Anthropic Messages request, and stop
# strings (before NUL) with text pieces (split at 0x01).
seed_serve_request() {
    local dir="fuzz/corpus/serve_request"
    mkdir -p "$dir"
    printf '%s' '{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"hi"}]}],"max_tokens":5,"temperature":0.5,"top_p":0.9,"seed":3,"stop":["a","b"],"stream":true,"stream_options":{"include_usage":true}}' >"$dir/seed-openai"
    printf '%s' '{"model":"m","max_tokens":5,"system":[{"type":"text","text":"s"}],"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":[{"type":"text","text":"yo"}]}],"temperature":1,"top_k":4,"stop_sequences":["END"]}' >"$dir/seed-anthropic"
    printf 'END\001\n\n\000Par\001is E\001ND more' >"$dir/seed-stops"
}

# The targets build with fuzz/Cargo.toml's dev profile (opt-level 1): a cold release
# build took 7.4 min and 15 CPU-minutes here, the dev one 5.7 min and 9.9, and the
# targets ran at the same rate (header_parse 252 k vs 274 k runs/s, config_axes 238 vs
# 245). FUZZ_RELEASE=1 builds optimised targets for long runs; cargo-fuzz then uses one
# codegen unit unless told, and the gturbo crate alone optimises on one core for
# minutes, so CODEGEN_UNITS (16) builds it on every core.
if [ "${FUZZ_RELEASE:-0}" = 1 ]; then
    build=(--sanitizer none --codegen-units "${CODEGEN_UNITS:-16}")
else
    build=(--dev --sanitizer none)
fi
cargo +nightly fuzz build "${build[@]}"
[ "$build_only" = 0 ] || exit 0
targets=$(cargo +nightly fuzz list)
if [ "$total" = 1 ]; then
    count=$(printf '%s\n' "$targets" | grep -c .)
    seconds=$((seconds / count))
    [ "$seconds" -ge 1 ] || seconds=1
fi
# One fuzzer per core; each target's output goes to a log of its own, shown in target
# order once all have finished.
jobs=$(nproc 2>/dev/null || echo 1)
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
declare -A pid_target=()
failed=()
reap() {
    local pid
    wait -n -p pid "${!pid_target[@]}" || failed+=("${pid_target[$pid]}")
    unset "pid_target[$pid]"
}
for target in $targets; do
    case "$target" in
    header_parse) seed_header_parse ;;
    manifest_parse) seed_manifest_parse ;;
    config_axes) seed_config_axes ;;
    serve_request) seed_serve_request ;;
    esac
    mkdir -p "fuzz/corpus/$target"
    while [ "${#pid_target[@]}" -ge "$jobs" ]; do reap; done
    echo "== fuzz $target for ${seconds}s" >&2
    cargo +nightly fuzz run "${build[@]}" "$target" -- \
        -max_total_time="$seconds" -timeout=10 -print_final_stats=1 >"$logs/$target.log" 2>&1 &
    pid_target[$!]=$target
done
while [ "${#pid_target[@]}" -gt 0 ]; do reap; done
for target in $targets; do
    echo "== fuzz $target" >&2
    cat "$logs/$target.log" >&2
done

if [ "${#failed[@]}" -ne 0 ]; then
    echo "fuzz: crash or failure in: ${failed[*]} (inputs under fuzz/artifacts/)" >&2
    exit 1
fi
echo "fuzz: no crashes in: ${targets//$'\n'/ }" >&2
