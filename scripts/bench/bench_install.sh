#!/usr/bin/env bash
# The install benchmark (issue 9, point 6). Not part of CI: it takes many minutes.
#
#   scripts/bench/bench_install.sh [WORKDIR]          (default target/bench-install)
#
# 1. Loopback: the generated BF16 Qwen3-MoE snapshot (scripts/bench/make_bench_snapshot.sh,
#    LAYERS=16: 3.4 GB) served by `gturbo-dev hub`; medians of RUNS (3) of gturbo
#    (default, --jobs 1, --no-verify-source), `hf download`, and `hf download` +
#    `mlx_lm.convert -q --q-bits 4 --q-group-size 64`: wall s, MB/s of source, peak RSS
#    (/usr/bin/time -v).
# 2. Capped link: the same snapshot through the hub at CONN_RATE (50 MB/s) per
#    connection with LATENCY_MS (40) to first byte, AGG_RATE (unset: no aggregate cap,
#    the hub's own shaper) or AGG_CAP (see below): gturbo --jobs 1/4/16/auto vs
#    `hf download`.
# 3. Scaling: gturbo's peak RSS at SMALL_LAYERS (5: 1.2 GB) and LAYERS.
#
# The peers (hf, mlx_lm) come from the pinned venv `scripts/venv.sh test`, under
# target/. Knobs (environment): LAYERS, SMALL_LAYERS, RUNS, CAP_RUNS (1), CONN_RATE,
# LATENCY_MS, AGG_RATE, AGG_CAP, SKIP_PEERS=1 (gturbo only), SKIP_LOOPBACK=1 (the
# capped part then judges against LOOP_RATE B/s, default unbounded), SKIP_CAPPED=1,
# SKIP_SCALING=1, NO_BUILD=1 (use the release binaries already built).
#
# AGG_CAP=BYTES/S caps the capped link's aggregate in the kernel instead: the hub runs
# in a network namespace of its own, reached over a veth pair whose hub side has a
# `tbf` qdisc at that rate; the script makes both and removes them on exit (root, `ip`
# and `tc` needed). Traffic stays on 10.203.0.0/30.
set -euo pipefail
cd "$(dirname "$0")/../.."
root="$PWD"
work="$(mkdir -p "${1:-target/bench-install}" && cd "${1:-target/bench-install}" && pwd)"
layers="${LAYERS:-16}"
small_layers="${SMALL_LAYERS:-5}"
runs="${RUNS:-3}"
cap_runs="${CAP_RUNS:-1}"
conn_rate="${CONN_RATE:-50000000}"
latency="${LATENCY_MS:-40}"
repo="bench/qwen3-moe"

# shellcheck source=bench_common.sh
source scripts/bench/bench_common.sh
release_binaries
if [ "${SKIP_PEERS:-0}" != 1 ]; then
    # shellcheck source=venv.sh
    source scripts/venv.sh test
fi

# AGG_CAP: the hub's namespace and the veth pair (names at most 15 characters).
netns="" hub_ns=() hub_bind=()
ns_name="gtb-hub-$$" veth_c="gtbc$$" veth_h="gtbh$$" ns_client=10.203.0.1 ns_hub=10.203.0.2
drop_netns() { if [ -n "$netns" ]; then ip netns del "$netns" 2>/dev/null || true; netns=""; fi; }
cleanup() { stop_hub; drop_netns; }
trap cleanup EXIT
# make_netns RATE: the hub's namespace behind a veth pair capped at RATE bytes/s (tbf on
# the hub side, so it shapes what the hub sends). Hubs started after it run inside.
make_netns() {
    local rate="$1" burst
    # The bucket must hold at least one timer tick of traffic at the rate (1 MiB floor).
    burst=$(awk -v r="$rate" 'BEGIN { b = r / 100; if (b < 1048576) b = 1048576; printf "%d", b }')
    netns="$ns_name"
    ip netns add "$netns"
    ip link add "$veth_c" type veth peer name "$veth_h"
    ip link set "$veth_h" netns "$netns"
    ip addr add "$ns_client/30" dev "$veth_c"
    ip link set "$veth_c" up
    ip -n "$netns" addr add "$ns_hub/30" dev "$veth_h"
    ip -n "$netns" link set "$veth_h" up
    ip -n "$netns" link set lo up
    tc -n "$netns" qdisc add dev "$veth_h" root tbf rate "$((rate * 8))bit" burst "$burst" latency 100ms
    hub_ns=(ip netns exec "$netns")
    hub_bind=(--bind "$ns_hub")
    echo "== aggregate cap: $(tc -n "$netns" qdisc show dev "$veth_h")" >&2
}
# start_hub SNAPSHOT [hub flags...]: sets $url.
start_hub() {
    local snap="$1"; shift
    stop_hub
    local fifo="$work/hub.url"
    rm -f "$fifo"
    "${hub_ns[@]}" "$dev" hub --repo "$repo=$snap" --cdn "${hub_bind[@]}" "$@" >"$fifo" 2>"$work/hub.log" &
    hub_pid=$!
    hub_ready "$fifo"
}

# timed LABEL CMD...: runs CMD under /usr/bin/time -v; appends "wall_s rss_kib conns
# peak_mb_s" to $work/LABEL.times (the last two from gturbo's summary line, "-" for a
# peer). Output of CMD goes to $work/LABEL.log, its stderr to $work/LABEL.time.
timed() {
    local label="$1"
    time_run "$@"
    local conns peak
    conns=$(sed -n 's/.* \([0-9]*\) connections, peak \([0-9.]*\) MB\/s.*/\1/p' "$work/$label.time" | tail -n1)
    peak=$(sed -n 's/.* \([0-9]*\) connections, peak \([0-9.]*\) MB\/s.*/\2/p' "$work/$label.time" | tail -n1)
    echo "$wall $rss ${conns:--} ${peak:--}" >>"$work/$label.times"
}

# row LABEL SOURCE_BYTES: one table line from the medians (connections and peak MB/s:
# those of the median-wall run).
row() {
    local wall rss conns peak
    wall=$(median "$1" 1); rss=$(median "$1" 2)
    conns=$(awk -v w="$wall" '$1 == w { print $3; exit }' "$work/$1.times")
    peak=$(awk -v w="$wall" '$1 == w { print $4; exit }' "$work/$1.times")
    awk -v l="$1" -v w="$wall" -v r="$rss" -v b="$2" -v n="$(wc -l <"$work/$1.times")" \
        -v c="$conns" -v p="$peak" \
        'BEGIN { printf "| %-34s | %7.2f | %8.0f | %8.0f | %s | %s | %d |\n", l, w, b/1e6/w, r/1024, c, p, n }'
}
header() {
    echo
    echo "$1"
    echo
    echo "| what | wall s | MB/s source | peak RSS MiB | connections | peak MB/s | runs |"
    echo "|---|---|---|---|---|---|---|"
}
# ratio TEXT A B TARGET CMP: "TEXT: A/B = x (target CMP TARGET: met|MISSED)".
ratio() {
    awk -v t="$1" -v a="$2" -v b="$3" -v want="$4" -v cmp="$5" 'BEGIN {
        x = a / b; ok = (cmp == "<=") ? (x <= want) : (x >= want)
        printf "- %s: %.2f (target %s %s: %s)\n", t, x, cmp, want, ok ? "met" : "MISSED" }'
}

# gturbo_install LABEL SNAP [flags...]
gturbo_install() {
    local label="$1" snap="$2"; shift 2
    local idx out
    idx=$(sha256sum "$snap/model.safetensors.index.json" | cut -d' ' -f1)
    out="$work/out-$label.gturbo"
    rm -rf "$out" "$out".partial*
    timed "$label" "$gturbo" -q install --family qwen3_moe "$repo" --endpoint "$url" \
        --index-sha256 "$idx" --out "$out" --no-progress "$@"
    grep -h "gturbo: installed" "$work/$label.time" | tail -n1 >&2 || true
    rm -rf "$out"
}

hf_download() {
    local label="$1"
    local dest="$work/hf-$label"
    rm -rf "$dest" "$work/hf-home"
    HF_HOME="$work/hf-home" HF_ENDPOINT="$url" HF_HUB_DISABLE_TELEMETRY=1 \
        timed "$label" hf download "$repo" --local-dir "$dest"
    rm -rf "$dest"
}

hf_convert() {
    local label="$1"
    local dest="$work/hf-$label" mlx="$work/mlx-$label"
    rm -rf "$dest" "$mlx" "$work/hf-home"
    cat >"$work/hf_convert.sh" <<SH
#!/usr/bin/env bash
set -euo pipefail
hf download "$repo" --local-dir "$dest" >/dev/null
mlx_lm.convert --hf-path "$dest" --mlx-path "$mlx" -q --q-bits 4 --q-group-size 64
SH
    chmod +x "$work/hf_convert.sh"
    HF_HOME="$work/hf-home" HF_ENDPOINT="$url" HF_HUB_DISABLE_TELEMETRY=1 \
        timed "$label" "$work/hf_convert.sh"
    rm -rf "$dest" "$mlx"
}

snap=$(scripts/bench/make_bench_snapshot.sh "$work/snapshot-$layers" "$layers")
bytes=$(du -bc "$snap"/*.safetensors | tail -n1 | cut -f1)
rm -f "$work"/*.times "$work"/*.md
echo "== snapshot $snap: $bytes bytes of shards" >&2
machine="$(nproc) cores, $(awk '/MemTotal/ { printf "%.0f GiB", $2/1048576 }' /proc/meminfo)"

if [ "${SKIP_LOOPBACK:-0}" != 1 ]; then
echo "== loopback" >&2
start_hub "$snap"
for i in $(seq 1 "$runs"); do
    echo "-- run $i/$runs" >&2
    gturbo_install "gturbo" "$snap"
    gturbo_install "gturbo --jobs 1" "$snap" --jobs 1
    gturbo_install "gturbo --no-verify-source" "$snap" --no-verify-source
    if [ "${SKIP_PEERS:-0}" != 1 ]; then
        hf_download "hf download"
        hf_convert "hf download + mlx_lm.convert -q"
    fi
done
{
    header "Loopback, $bytes B BF16 Qwen3-MoE ($layers layers, 4 shards), $machine, medians"
    row "gturbo" "$bytes"
    row "gturbo --jobs 1" "$bytes"
    row "gturbo --no-verify-source" "$bytes"
    if [ "${SKIP_PEERS:-0}" != 1 ]; then
        row "hf download" "$bytes"
        row "hf download + mlx_lm.convert -q" "$bytes"
    fi
    echo
    g=$(median "gturbo" 1)
    ratio "gturbo (default) / gturbo --jobs 1, wall" "$g" "$(median "gturbo --jobs 1" 1)" 1.0 "<="
    if [ "${SKIP_PEERS:-0}" != 1 ]; then
        ratio "gturbo / hf download, wall" "$g" "$(median "hf download" 1)" 0.5 "<="
        ratio "(hf download + mlx_lm.convert) / gturbo, wall" "$(median "hf download + mlx_lm.convert -q" 1)" "$g" 5 ">="
    fi
} | tee "$work/loopback.md"
loop_rate=$(awk -v b="$bytes" -v w="$(median "gturbo" 1)" 'BEGIN { print b / w }')
else
loop_rate="${LOOP_RATE:-1e18}"
fi

if [ "${SKIP_CAPPED:-0}" != 1 ]; then
    echo "== capped link" >&2
    agg=()
    [ -n "${AGG_RATE:-}" ] && agg=(--aggregate-rate "$AGG_RATE")
    aggregate="${AGG_RATE:-uncapped}"
    if [ -n "${AGG_CAP:-}" ]; then
        make_netns "$AGG_CAP"
        aggregate="$AGG_CAP B/s (tbf on a veth pair)"
    fi
    start_hub "$snap" --conn-rate "$conn_rate" --latency-ms "$latency" "${agg[@]}"
    for i in $(seq 1 "$cap_runs"); do
        for j in 1 4 16 auto; do
            gturbo_install "capped gturbo --jobs $j" "$snap" --jobs "$j"
        done
        if [ "${SKIP_PEERS:-0}" != 1 ]; then
            hf_download "capped hf download"
        fi
    done
    {
        header "Capped link: $conn_rate B/s per connection, $latency ms to first byte, aggregate $aggregate"
        for j in 1 4 16 auto; do row "capped gturbo --jobs $j" "$bytes"; done
        if [ "${SKIP_PEERS:-0}" != 1 ]; then row "capped hf download" "$bytes"; fi
        echo
        # The target: 90 % of min(aggregate cap, connections × per-connection rate),
        # and no more than the CPU-bound loopback rate of the same install.
        for j in 4 16 auto; do
            w=$(median "capped gturbo --jobs $j" 1)
            c=$(awk -v w="$w" '$1 == w { print $3; exit }' "$work/capped gturbo --jobs $j.times")
            bound=$(awk -v r="$conn_rate" -v c="$c" -v a="${AGG_RATE:-${AGG_CAP:-0}}" -v l="$loop_rate" 'BEGIN {
                b = r * c; if (a > 0 && a < b) b = a; if (l < b) b = l; print b }')
            ratio "capped --jobs $j MB/s / min(aggregate, $c × per-connection, loopback rate)" \
                "$(awk -v b="$bytes" -v w="$w" 'BEGIN { print b / w }')" "$bound" 0.9 ">="
        done
        ratio "capped --jobs auto / --jobs 16, MB/s" "$(median "capped gturbo --jobs 16" 1)" "$(median "capped gturbo --jobs auto" 1)" 0.9 ">="
    } | tee "$work/capped.md"
    stop_hub
    drop_netns
    hub_ns=() hub_bind=()
fi

if [ "${SKIP_SCALING:-0}" != 1 ]; then
    echo "== scaling" >&2
    small=$(scripts/bench/make_bench_snapshot.sh "$work/snapshot-$small_layers" "$small_layers")
    small_bytes=$(du -bc "$small"/*.safetensors | tail -n1 | cut -f1)
    start_hub "$small"
    gturbo_install "gturbo at $small_layers layers" "$small"
    start_hub "$snap"
    gturbo_install "gturbo at $layers layers" "$snap"
    {
        header "Scaling (default settings, one run each)"
        row "gturbo at $small_layers layers" "$small_bytes"
        row "gturbo at $layers layers" "$bytes"
        echo
        ratio "peak RSS at $layers / at $small_layers layers" "$(median "gturbo at $layers layers" 2)" "$(median "gturbo at $small_layers layers" 2)" 1.1 "<="
    } | tee "$work/scaling.md"
fi

{
    echo
    max_rss=$(cat "$work"/gturbo*.times "$work"/capped\ gturbo*.times 2>/dev/null | awk '$2 > m { m = $2 } END { print m / 1024 }')
    ratio "largest gturbo peak RSS, MiB / 256" "$max_rss" 256 1.0 "<="
} | tee "$work/rss.md"
cat "$work"/loopback.md "$work"/capped.md "$work"/scaling.md "$work"/rss.md 2>/dev/null >"$work/bench.md" || true  # parts skipped
echo "== all tables: $work/bench.md" >&2
