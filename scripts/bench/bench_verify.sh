#!/usr/bin/env bash
# Benchmark: `gturbo verify-install` against `sha256sum` run sequentially over the
# same files, on one install of at least 3 GB, in one run. Prints medians of REPS
# repetitions each (warm page cache: one untimed pass of each first) and the ratio.
#
# Usage: scripts/bench/bench_verify.sh [WORKDIR] [REPS]    (defaults: target/bench-verify, 3)
#
# The install: the scaled Flash-Next replica installed by gturbo, then its five expert
# pools widened to EXPERTS (default 9216) experts of random bytes each (file
# size = experts × stride, manifest sizes and hashes rewritten, receipt dropped). The
# layout stays consistent, so verify-install does every check it does on a real
# install; the weights are noise, not a model. 5 × 9216 × 64 KiB = 3.02 GB.
set -euo pipefail

work="${1:-target/bench-verify}"
reps="${2:-3}"
experts="${EXPERTS:-9216}"
cd "$(dirname "$0")/../.."

echo "== build (release)" >&2
nice cargo build --release -p gturbo -p gturbo-testkit --bins >&2
gturbo="$PWD/target/release/gturbo"
dev="$PWD/target/release/gturbo-dev"

mkdir -p "$work"
inst="$work/bench.gturbo"
marker="$work/.generated-$experts-experts"
if [ ! -f "$marker" ] || [ ! -f "$inst/manifest.json" ]; then
    echo "== generate the install ($experts experts per pool)" >&2
    rm -rf "$work/snapshot" "$inst"
    "$dev" replica flash-next --scaled "$work/snapshot" >/dev/null
    index_sha=$(sha256sum "$work/snapshot/model.safetensors.index.json" | cut -d' ' -f1)
    "$gturbo" -qq install qwen38flashnext --from "$work/snapshot" \
        --index-sha256 "$index_sha" --out "$inst" >/dev/null
    python3 - "$inst" "$experts" <<'PY'
import hashlib, json, os, sys
inst, experts = sys.argv[1], int(sys.argv[2])
mpath = os.path.join(inst, "manifest.json")
m = json.load(open(mpath))
sizes = {}
for p in m["expert_pools"]:
    p["experts"] = experts
    p["file_bytes"] = experts * p["stride"]
    h = hashlib.sha256()
    with open(os.path.join(inst, p["file"]), "wb") as f:
        left = p["file_bytes"]
        while left:
            n = min(left, 8 << 20)
            b = os.urandom(n)
            f.write(b)
            h.update(b)
            left -= n
    sizes[p["file"]] = (p["file_bytes"], h.hexdigest())
for f in m["files"]:
    if f["path"] in sizes:
        f["bytes"], f["sha256"] = sizes[f["path"]]
# Canonical form, as install writes it: sorted keys, two-space indent, newline.
with open(mpath, "w") as out:
    out.write(json.dumps(m, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
os.remove(os.path.join(inst, "verified-install.json"))
PY
    touch "$marker"
fi

mapfile -t files < <(python3 -c '
import json, sys
m = json.load(open(sys.argv[1] + "/manifest.json"))
print(sys.argv[1] + "/manifest.json")
for f in m["files"]:
    print(sys.argv[1] + "/" + f["path"])
' "$inst")
bytes=$(du -cb "${files[@]}" | tail -1 | cut -f1)
echo "== install: ${#files[@]} files, $bytes bytes, $(nproc) cores" >&2

now() { date +%s.%N; }
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

# Warm the page cache, check the install verifies, write its receipt.
"$gturbo" -q verify-install "$inst" >&2
sha256sum "${files[@]}" >/dev/null

gt=()
ss=()
for i in $(seq "$reps"); do
    t0=$(now)
    "$gturbo" -q verify-install --no-receipt "$inst" >/dev/null
    t1=$(now)
    sha256sum "${files[@]}" >/dev/null
    t2=$(now)
    gt+=("$(echo "$t1 - $t0" | bc -l)")
    ss+=("$(echo "$t2 - $t1" | bc -l)")
    echo "rep $i: verify-install ${gt[-1]} s, sha256sum ${ss[-1]} s" >&2
done
g=$(printf '%s\n' "${gt[@]}" | median)
s=$(printf '%s\n' "${ss[@]}" | median)
printf '%-28s %10s %10s\n' "" "median s" "MB/s"
printf '%-28s %10.2f %10.0f\n' "gturbo verify-install" "$g" "$(echo "$bytes / $g / 1000000" | bc -l)"
printf '%-28s %10.2f %10.0f\n' "sha256sum (sequential)" "$s" "$(echo "$bytes / $s / 1000000" | bc -l)"
printf 'ratio (sha256sum / verify-install): %.2fx over %s bytes, %s reps, %s cores\n' \
    "$(echo "$s / $g" | bc -l)" "$bytes" "$reps" "$(nproc)"
