# Shared by the install benchmarks (scripts/bench/bench_install.sh, bench_mlx_install.sh);
# sourced, not run. The caller sets `work` (its folder) and `repo` (the name the hub
# serves).

# release_binaries: builds gturbo and gturbo-dev in release (unless NO_BUILD=1) and sets
# $gturbo and $dev (exported as GTURBO_DEV) to them; the caller sets `root`. BIN_DIR=DIR
# uses the binaries in DIR as they are instead (no build; say so with the figures).
release_binaries() {
    if [ -n "${BIN_DIR:-}" ]; then
        gturbo="$(cd "$BIN_DIR" && pwd)/gturbo"
        dev="$(cd "$BIN_DIR" && pwd)/gturbo-dev"
        export GTURBO_DEV="$dev"
        return
    fi
    if [ "${NO_BUILD:-0}" != 1 ]; then
        echo "== build (release)" >&2
        nice cargo build --release -p gturbo -p gturbo-testkit --bins >&2
    fi
    gturbo="$root/target/release/gturbo"
    dev="$root/target/release/gturbo-dev"
    export GTURBO_DEV="$dev"
}

hub_pid=""
stop_hub() { if [ -n "$hub_pid" ]; then kill "$hub_pid" 2>/dev/null || true; wait "$hub_pid" 2>/dev/null || true; hub_pid=""; fi; }

# hub_ready FIFO: after a hub was started with its URL going to FIFO and its log to
# $work/hub.log, waits for the URL (sets $url), then has the hub hash every file (tens
# of seconds for 3 GB, the first time a listing needs the SHA-256s) so no timed client
# pays for it.
hub_ready() {
    local fifo="$1"
    url=""
    for _ in $(seq 1 600); do
        url=$(head -n1 "$fifo" 2>/dev/null || true)
        [ -n "$url" ] && break
        sleep 0.1
    done
    [ -n "$url" ] || { echo "hub did not start: $(cat "$work/hub.log")" >&2; exit 2; }
    curl -sf "$url/api/models/$repo/tree/main?recursive=true" >/dev/null ||
        { echo "hub listing failed: $(cat "$work/hub.log")" >&2; exit 2; }
}

# time_run LABEL CMD...: runs CMD under /usr/bin/time -v (its output to $work/LABEL.log,
# its stderr and the timing to $work/LABEL.time); sets $wall (s) and $rss (KiB).
time_run() {
    local label="$1"; shift
    /usr/bin/time -v "$@" >"$work/$label.log" 2>"$work/$label.time" || {
        echo "$label failed:" >&2; tail -n 30 "$work/$label.time" >&2; exit 2; }
    wall=$(sed -n 's/.*Elapsed (wall clock) time.*: //p' "$work/$label.time" |
        awk -F: '{ if (NF==3) print $1*3600+$2*60+$3; else print $1*60+$2 }')
    rss=$(sed -n 's/.*Maximum resident set size (kbytes): //p' "$work/$label.time")
}

# median LABEL COLUMN: the median of a column of $work/LABEL.times.
median() {
    sort -n -k"$2" "$work/$1.times" | awk -v c="$2" '{ v[NR]=$c } END { print v[int((NR+1)/2)] }'
}
