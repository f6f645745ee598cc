#!/usr/bin/env bash
# GPU backend benchmark (issue 11), for a machine with a GPU (the figures in
# docs/BENCHMARKS.md were taken on an H200 through Vulkan):
#  1. INT4 g64 matrix-vector GB/s at [4096×4096], [8192×8192], [16384×8192] against
#     PEAK_GBS (the H200's HBM: ~4800 GB/s), from examples/bench_gpu.rs: the f32
#     kernel and the packed 24-bit x kernel (x packed once, and once per product),
#     wall clock and device time;
#  2. prefill and decode tok/s of `gturbo run` on the GPU and on the CPU backend, for
#     SmolLM2-135M's shapes and a 1.69 B qwen3_moe (random BF16 snapshots from
#     examples/bench_snapshots.rs, installed at INT4; experts resident);
#  3. the same prompts through transformers + torch `generate` in bf16 on the same GPU
#     (scripts/bench/bench_gpu_peer.py), when torch sees a GPU.
#
# Binaries: BIN (a folder with gturbo, bench_gpu, bench_snapshots built elsewhere, as
# on a machine without a Rust toolchain), else built here in release.
# Vulkan: when the loader is missing, the .debs in GL_DEBS (default .gl) are unpacked;
# VK_DRIVER_FILES defaults to NVIDIA's ICD file where it exists.
# Environment: PROMPT (128 tokens), TOKENS (64 decoded), RUNS (3), PEAK_GBS (4800),
# WORK (target/bench-gpu), RESULTS (a file the summary is appended to),
# TILINGS (matvec kernel tilings to time, e.g. auto,32x2,16x4; default auto),
# SLOTS (expert-slot counts for extra MoE GPU runs in slot mode, e.g. "2 16"),
# PROFILE (1: per-token dispatch/submit/wait/read-back counts and device time from
# GTURBO_GPU_STATS, as the difference of a 1-token and a 33-token run, with the
# kernels fused and submitted in pieces as shipped, and with neither:
# GTURBO_GPU_FUSE=0 GTURBO_GPU_SUBMIT_EVERY=4096, the previous structure),
# PEER (0: skip the transformers peer), BACKENDS (default "gpu cpu"),
# VARIANTS (extra GPU rows, resident experts, each under its own environment;
# ';'-separated, e.g. "GTURBO_GPU_ATTN_SPLIT=0; GTURBO_GPU_TILING=32x2").
set -euo pipefail
HERE="$(cd "$(dirname "$(readlink -f "$0")")" && pwd)"
cd "$HERE/../.."
PROMPT="${PROMPT:-128}"
TOKENS="${TOKENS:-64}"
RUNS="${RUNS:-3}"
PEAK_GBS="${PEAK_GBS:-4800}"
WORK="${WORK:-target/bench-gpu}"
RESULTS="${RESULTS:-/dev/null}"
GL_DEBS="${GL_DEBS:-.gl}"
TILINGS="${TILINGS:-auto}"
SLOTS="${SLOTS:-}"
PROFILE="${PROFILE:-0}"
PEER="${PEER:-1}"

if [ -z "${BIN:-}" ]; then
  cargo build -q --release --bin gturbo --example bench_gpu --example bench_snapshots --example matvec_lab
  BIN=target/release
  cp target/release/examples/bench_gpu target/release/examples/bench_snapshots target/release/examples/matvec_lab "$BIN/"
fi
if ! ldconfig -p | grep -q libvulkan.so.1 && ls "$GL_DEBS"/*.deb >/dev/null 2>&1; then
  for f in "$GL_DEBS"/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
nv_icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f "$nv_icd" ]; then
  export VK_DRIVER_FILES="$nv_icd"
fi
G="$BIN/gturbo"
say() { echo "$*" | tee -a "$RESULTS"; }

say "## adapters"
"$G" run --list-adapters | tee -a "$RESULTS"
say "## CPU: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"

say "## INT4 g64 matvec"
# Each shape in a process of its own: within one process, a shape timed after the
# 29 matrices of [4096×4096] were made and freed ran up to 3× slower through the
# runtime's path (a bind group and parameters per dispatch), while the same kernel with
# bind groups made once (matvec_lab, same process history) did not slow down
# (docs/GPU.md): the benchmark's history, not the kernel's speed.
for shape in 4096x4096 8192x8192 16384x8192; do
  "$BIN/bench_gpu" --peak-gbs "$PEAK_GBS" --runs 15 --tilings "$TILINGS" --shapes "$shape" 2>&1 | grep -v '^adapter:\|^INT4' | tee -a "$RESULTS" || true
done
# The product kernels alone (bind groups made once, no per-dispatch host work): x24 at
# the runtime's lanes and two others, and packing x before every product; the f32
# kernel; next to the diagnostic kernels that say where the time goes
# (examples/matvec_lab.rs).
if [ -x "$BIN/matvec_lab" ]; then
  "$BIN/matvec_lab" --peak-gbs "$PEAK_GBS" --shapes 8192x8192,16384x8192 --only "product x24,product f32 64x4,lab loads-only 64x4,lab math-only 64x4,stream" 2>&1 | grep -v XDG | tee -a "$RESULTS" || true
fi

rm -rf "$WORK" && mkdir -p "$WORK"
ids=$(seq 0 $((PROMPT - 1)) | awk '{ printf "%s%d", (NR > 1 ? "," : ""), (7 * $1 + 5) % 30000 }')
median() { sort -g | awk '{ a[NR] = $1 } END { if (NR % 2) print a[(NR + 1) / 2]; else print (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }

# model family snapshot-kind
for spec in "smollm2 llama smollm2" "moe qwen3_moe moe"; do
  read -r name family kind <<< "$spec"
  t0=$(date +%s)
  "$BIN/bench_snapshots" "$kind" "$WORK/$name-snap" > /dev/null
  "$G" -q install --family "$family" "local/$name" --from "$WORK/$name-snap" --out "$WORK/$name.gturbo" > /dev/null 2>&1
  say "## $name: $(du -sh "$WORK/$name-snap" | cut -f1) BF16 snapshot, $(du -sh "$WORK/$name.gturbo" | cut -f1) INT4 install (made in $(( $(date +%s) - t0 )) s)"
  say "$(printf '%-34s %12s %12s %14s' engine 'prefill t/s' 'decode t/s' 'device MiB')"
  for backend in ${BACKENDS:-gpu cpu}; do
    pre=() dec=() mem=""
    for _ in $(seq "$RUNS"); do
      if ! "$G" run "$WORK/$name.gturbo" --backend "$backend" --resident-experts --json \
        --prompt-ids "$ids" --max-tokens "$TOKENS" > "$WORK/run.json" 2> "$WORK/footer"; then
        say "gturbo --backend $backend failed: $(tail -3 "$WORK/footer")"
        continue 2
      fi
      pre+=("$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["prefill_tok_s"])' "$WORK/run.json")")
      dec+=("$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["decode_tok_s"])' "$WORK/run.json")")
      mem=$(python3 -c 'import json,sys; b=json.load(open(sys.argv[1]))["device_memory_bytes"]; print("-" if b is None else round(b/2**20))' "$WORK/run.json")
    done
    label="gturbo --backend $backend"
    [ "$backend" = cpu ] && label="gturbo --backend cpu ($(nproc) thr)"
    say "$(printf '%-34s %12.1f %12.1f %14s' "$label" "$(printf '%s\n' "${pre[@]}" | median)" "$(printf '%s\n' "${dec[@]}" | median)" "$mem")"
    say "    $(tail -1 "$WORK/footer")"
  done
  IFS=';' read -ra variants <<< "${VARIANTS:-}"
  for variant in "${variants[@]}"; do
    read -ra venv <<< "$variant"
    [ "${#venv[@]}" = 0 ] && continue
    pre=() dec=()
    for _ in $(seq "$RUNS"); do
      env "${venv[@]}" "$G" run "$WORK/$name.gturbo" --backend gpu --resident-experts --json \
        --prompt-ids "$ids" --max-tokens "$TOKENS" > "$WORK/run.json" 2> "$WORK/footer" || { say "$variant failed: $(tail -3 "$WORK/footer")"; continue 2; }
      pre+=("$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["prefill_tok_s"])' "$WORK/run.json")")
      dec+=("$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["decode_tok_s"])' "$WORK/run.json")")
    done
    say "$(printf '%-34s %12.1f %12.1f %14s' "gpu, ${venv[*]}" "$(printf '%s\n' "${pre[@]}" | median)" "$(printf '%s\n' "${dec[@]}" | median)" -)"
  done
  if [ "$name" = moe ]; then
    for slots in $SLOTS; do
      pre=() dec=()
      for _ in $(seq "$RUNS"); do
        "$G" run "$WORK/$name.gturbo" --backend gpu --expert-cache-slots "$slots" --json \
          --prompt-ids "$ids" --max-tokens "$TOKENS" > "$WORK/run.json" 2> "$WORK/footer" || { say "slots $slots failed: $(tail -3 "$WORK/footer")"; continue 2; }
        pre+=("$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["prefill_tok_s"])' "$WORK/run.json")")
        dec+=("$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["decode_tok_s"])' "$WORK/run.json")")
      done
      say "$(printf '%-34s %12.1f %12.1f %14s' "gturbo --backend gpu, $slots slots" "$(printf '%s\n' "${pre[@]}" | median)" "$(printf '%s\n' "${dec[@]}" | median)" -)"
    done
  fi
  if [ "$PROFILE" = 1 ]; then
    for variant in "shipped" "GTURBO_GPU_FUSE=0 GTURBO_GPU_SUBMIT_EVERY=4096"; do
      for n in 1 33; do
        env_args=(GTURBO_GPU_STATS=1)
        [ "$variant" != shipped ] && read -ra extra <<< "$variant" && env_args+=("${extra[@]}")
        env "${env_args[@]}" "$G" run "$WORK/$name.gturbo" --backend gpu --resident-experts \
          --prompt-ids "$ids" --max-tokens "$n" > /dev/null 2> "$WORK/stats$n" || true
        grep -h 'gturbo gpu stats' "$WORK/stats$n" > "$WORK/stats$n.line" || true
        grep -h 'gturbo gpu kernels' "$WORK/stats$n" > "$WORK/kernels$n.line" || true
      done
      say "profile ($variant), per decode token (33-token run minus 1-token run, / 32):"
      python3 - "$WORK/stats1.line" "$WORK/stats33.line" "$WORK/kernels1.line" "$WORK/kernels33.line" <<'PY' | tee -a "$RESULTS"
import re, sys
def nums(f):
    t = open(f).read()
    return [float(v) for v in re.findall(r"([0-9.]+)", t.split("stats:", 1)[1])] if t else []
a, b = nums(sys.argv[1]), nums(sys.argv[2])
names = ["dispatches", "passes", "submits", "waits", "wait ms", "read-backs", "read-back B",
         "writes", "write B", "copies", "clears", "recording ms", "device ms", "timed passes"]
if len(a) == len(b) == len(names):
    print("    " + ", ".join("%s %.2f" % (n, (y - x) / 32) for n, x, y in zip(names, a, b)))
else:
    print("    (no stats)", open(sys.argv[2]).read())
def kern(f):
    t = open(f).read()
    return {m[0]: (int(m[1]), float(m[2])) for m in re.findall(r"(\w+) (\d+)× ([0-9.]+) ms", t)}
ka, kb = kern(sys.argv[3]), kern(sys.argv[4])
rows = sorted(((n, (kb[n][0] - ka.get(n, (0, 0))[0]) / 32, (kb[n][1] - ka.get(n, (0, 0))[1]) / 32 * 1000)
               for n in kb), key=lambda r: -r[2])
if rows:
    print("    device time per decode token by kernel (each dispatch in its own timed pass): " +
          ", ".join("%s %.1f× %.1f us" % r for r in rows))
PY
    done
  fi
  if [ "$PEER" = 1 ] && python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    peer=$(python3 "$HERE/bench_gpu_peer.py" "$WORK/$name-snap" "$PROMPT" "$TOKENS" "$RUNS" 2> "$WORK/peer.err" | tail -1) || { tail -5 "$WORK/peer.err"; peer=""; }
    if [ -n "$peer" ]; then
      say "$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); print("%-34s %12.1f %12.1f %14s" % ("transformers bf16 generate", d["prefill_tok_s"], d["decode_tok_s"], "-")); print("    " + d["engine"] + " on " + d["device"])' "$peer")"
    fi
  fi
  rm -rf "$WORK/$name-snap" "$WORK/$name.gturbo"
done
