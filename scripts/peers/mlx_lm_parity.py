#!/usr/bin/env python3
"""Compare a gturbo install of a Qwen3-MoE snapshot with mlx-lm's quantized conversion.

Usage: python3 scripts/peers/mlx_lm_parity.py SNAPSHOT GTURBO_DIR [--mlx-dir DIR] [--verbose]

Runs `mlx_lm.convert(SNAPSHOT, quantize=True, q_group_size=64, q_bits=4)` on the CPU
into a temporary folder, or into --mlx-dir and keeps it there (a --mlx-dir that already
holds a conversion, i.e. a config.json, is reused without converting again), then compares byte for byte, for every tensor that both sides stored with the same scheme:

- resident tensors of `GTURBO_DIR/resident.bin` quantized as `int4_g64` / `int8_g64`
  against mlx-lm's `NAME.weight`, `NAME.scales`, `NAME.biases` quantized at the same
  bits with group size 64 (its `config.json` "quantization" block gives the per-module
  bits, e.g. 8 for the MoE router `mlp.gate`);
- passthrough resident tensors against mlx-lm's unquantized arrays of the same name;
- every expert `e` of every pool `packed_experts/layer_NN.bin` (gate, up, down parts at
  `e * stride + offset`) against `model.layers.NN.mlp.switch_mlp.{part}_proj.*[e]`.

Tensors whose schemes differ, or that exist on one side only, are skipped and listed with
the reason. Prints `N tensors compared, M mismatches` last; exits 1 on any mismatch or
when nothing could be compared, 2 when an input is unreadable. The snapshot written by
`gturbo-dev replica qwen3-moe DIR` (config.json, tokenizer.json, tokenizer_config.json)
is enough for mlx-lm 0.32.2 to load: no tokenizer file has to be added.

Install the pinned tools with `pip install -r scripts/requirements/requirements-mlx.txt`.
"""

import argparse
import json
import re
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np

PAGE = 16384
RESIDENT_MAGIC = b"GTRBRES1"
SCHEME_BITS = {"int4_g64": 4, "int8_g64": 8}
PARTS = ("gate", "up", "down")


class InputError(Exception):
    """An input folder is missing something or does not follow its format."""


def align_up(n, a):
    return (n + a - 1) // a * a


# ---------------------------------------------------------------- gturbo side


def read_gturbo(root):
    """Manifest, resident index entries and resident payload of an install."""
    manifest_path = root / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
        res = (root / manifest["resident"]["file"]).read_bytes()
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{manifest_path}: cannot read the manifest or its resident file: {e}")
    if res[:8] != RESIDENT_MAGIC or len(res) < 16:
        raise InputError(f"{root}/resident.bin: magic is {res[:8]!r}, want {RESIDENT_MAGIC!r}")
    (n,) = struct.unpack("<Q", res[8:16])
    if 16 + n > len(res):
        raise InputError(f"{root}/resident.bin: index length {n} runs past the file ({len(res)} B)")
    index = json.loads(res[16 : 16 + n])
    start = align_up(16 + n, PAGE)
    if manifest["resident"].get("payload_start") != start:
        raise InputError(
            f"{manifest_path}: resident.payload_start {manifest['resident'].get('payload_start')}"
            f" != {start} computed from the index length"
        )
    return manifest, index["tensors"], memoryview(res)[start:]


def region(payload, r, what):
    off, ln = r["offset"], r["len"]
    if off + ln > len(payload):
        raise InputError(f"resident.bin: {what} [{off}, {off + ln}) runs past the payload")
    return bytes(payload[off : off + ln])


# ---------------------------------------------------------------- mlx-lm side


def run_convert(snapshot, mlx_dir):
    import mlx.core as mx
    from mlx_lm import convert

    mx.set_default_device(mx.cpu)
    convert(str(snapshot), str(mlx_dir), quantize=True, q_group_size=64, q_bits=4)


def load_mlx(mlx_dir):
    import mlx.core as mx

    arrays = {}
    files = sorted(mlx_dir.glob("*.safetensors"))
    if not files:
        raise InputError(f"{mlx_dir}: no .safetensors written by mlx_lm.convert")
    for f in files:
        arrays.update(mx.load(str(f)))
    config = json.loads((mlx_dir / "config.json").read_text())
    return arrays, config.get("quantization") or {}


def mlx_scheme(arrays, qconf, module):
    """mlx-lm's scheme for `module` (a path without `.weight`), as gturbo names them."""
    if f"{module}.scales" not in arrays:
        return "passthrough" if f"{module}.weight" in arrays else None
    per = qconf.get(module) if isinstance(qconf.get(module), dict) else qconf
    bits, group, mode = per.get("bits"), per.get("group_size"), per.get("mode", "affine")
    if group != 64 or mode != "affine":
        return f"{mode}_b{bits}_g{group}"
    return f"int{bits}_g64"


def to_bytes(a):
    """Raw little-endian bytes of an mlx array (BF16 viewed as U16 for numpy)."""
    import mlx.core as mx

    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a)).tobytes()


def dtype_name(a):
    return str(a.dtype).removeprefix("mlx.core.")


# ---------------------------------------------------------------- comparison


class Tally:
    def __init__(self, verbose):
        self.verbose = verbose
        self.compared = {}  # kind -> count
        self.mismatches = []
        self.skipped = []

    def skip(self, name, why):
        self.skipped.append((name, why))

    def compare(self, kind, name, pairs):
        """`pairs`: (label, gturbo bytes, mlx array, element dtype) per array."""
        self.compared[kind] = self.compared.get(kind, 0) + 1
        bad = []
        for label, g, m, want_dtype in pairs:
            if dtype_name(m) != want_dtype:
                bad.append(f"{label}: mlx-lm dtype {dtype_name(m)}, want {want_dtype}")
                continue
            mb = to_bytes(m)
            if g == mb:
                continue
            bad.append(f"{label}: {describe_diff(g, mb, m.shape, want_dtype)}")
        if bad:
            self.mismatches.append((name, bad))
        elif self.verbose:
            print(f"ok  {kind:10} {name}")


def describe_diff(g, m, shape, dtype):
    if len(g) != len(m):
        return f"length {len(g)} B (gturbo) vs {len(m)} B (mlx-lm), shape {list(shape)}"
    np_dt = {"uint32": "<u4", "bfloat16": "<u2", "uint8": "u1"}.get(dtype, "u1")
    ga, ma = np.frombuffer(g, np_dt), np.frombuffer(m, np_dt)
    diff = np.nonzero(ga != ma)[0]
    first = int(diff[0])
    cols = shape[-1] if len(shape) else 1
    return (
        f"{len(diff)} of {ga.size} {dtype} elements differ; first at flat {first}"
        f" (row {first // cols}, col {first % cols}): gturbo 0x{int(ga[first]):x},"
        f" mlx-lm 0x{int(ma[first]):x}"
    )


def compare_resident(tally, entries, payload, arrays, qconf, claimed):
    for t in entries:
        name, scheme = t["name"], t["scheme"]
        module = name.removesuffix(".weight")
        theirs = mlx_scheme(arrays, qconf, module) if name.endswith(".weight") else None
        if theirs is None and name in arrays:
            theirs = "passthrough"
        if theirs is None:
            tally.skip(name, f"gturbo {scheme}; absent from mlx-lm's output")
            continue
        if theirs != scheme:
            tally.skip(name, f"gturbo {scheme}, mlx-lm {theirs}")
            continue
        if scheme == "passthrough":
            claimed.add(name)
            m = arrays[name]
            want = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}.get(t["dtype"], "?")
            tally.compare(
                "passthrough", name, [("data", region(payload, t["data"], name), m, want)]
            )
            continue
        keys = [f"{module}.weight", f"{module}.scales", f"{module}.biases"]
        claimed.update(keys)
        tally.compare(
            scheme,
            name,
            [
                (k, region(payload, t[k], f"{name}.{k}"), arrays[key], dt)
                for k, key, dt in zip(
                    ("weights", "scales", "biases"), keys, ("uint32", "bfloat16", "bfloat16")
                )
            ],
        )


def compare_experts(tally, root, manifest, arrays, qconf, claimed):
    pools = manifest.get("expert_pools") or []
    for pool in pools:
        layer, scheme, sidecar = pool["layer"], pool["scheme"], pool.get("sidecar")
        label = f"{pool['file']} ({pool['experts']} experts)"
        if sidecar:
            tally.skip(label, f"sidecar {sidecar!r} pool: mlx-lm has no such layer")
            continue
        path = root / pool["file"]
        data = path.read_bytes()
        stride, n = pool["stride"], pool["experts"]
        if len(data) != n * stride:
            raise InputError(f"{path}: {len(data)} B, want experts {n} x stride {stride}")
        for part in pool["parts"]:
            pname = part["part"]
            module = f"model.layers.{layer}.mlp.switch_mlp.{pname}_proj"
            theirs = mlx_scheme(arrays, qconf, module)
            if theirs != scheme:
                tally.skip(f"{module} (layer {layer}, {n} experts)", f"gturbo {scheme}, mlx-lm {theirs}")
                continue
            keys = [f"{module}.weight", f"{module}.scales", f"{module}.biases"]
            claimed.update(keys)
            for k in keys:
                if arrays[k].shape[0] != n:
                    raise InputError(f"mlx-lm {k}: {arrays[k].shape[0]} experts, gturbo {n}")
            for e in range(n):
                off = e * stride + part["offset"]
                pairs = []
                for k, key, dt in zip(
                    ("weights", "scales", "biases"), keys, ("uint32", "bfloat16", "bfloat16")
                ):
                    ln = part[k]
                    pairs.append((k, data[off : off + ln], arrays[key][e], dt))
                    off += ln
                tally.compare(
                    f"expert {scheme}",
                    f"model.layers.{layer}.mlp.experts.{e}.{pname}_proj.weight",
                    pairs,
                )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("snapshot", type=Path)
    ap.add_argument("gturbo_dir", type=Path)
    ap.add_argument(
        "--mlx-dir", type=Path, help="convert into this folder and keep it; reuse it if converted"
    )
    ap.add_argument("--verbose", action="store_true", help="list every tensor that matched")
    args = ap.parse_args()

    try:
        manifest, entries, payload = read_gturbo(args.gturbo_dir)
        with tempfile.TemporaryDirectory(prefix="mlx_lm_parity.") as tmp:
            mlx_dir = args.mlx_dir or Path(tmp) / "mlx"
            if not (mlx_dir / "config.json").exists():
                run_convert(args.snapshot, mlx_dir)
            arrays, qconf = load_mlx(mlx_dir)
            tally = Tally(args.verbose)
            claimed = set()
            compare_resident(tally, entries, payload, arrays, qconf, claimed)
            compare_experts(tally, args.gturbo_dir, manifest, arrays, qconf, claimed)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    # mlx-lm arrays that no gturbo tensor was compared with (scheme differences already
    # listed above carry their own reason).
    skipped_modules = {re.sub(r" \(.*", "", s[0]).removesuffix(".weight") for s in tally.skipped}
    for k in sorted(set(arrays) - claimed):
        module = re.sub(r"\.(weight|scales|biases)$", "", k)
        if module not in skipped_modules and k not in skipped_modules:
            tally.skip(k, "in mlx-lm's output only")

    for name, bad in tally.mismatches:
        print(f"MISMATCH {name}")
        for b in bad:
            print(f"  {b}")
    if tally.skipped:
        print(f"skipped {len(tally.skipped)}:")
        for name, why in tally.skipped:
            print(f"  {name}: {why}")
    by_kind = ", ".join(f"{v} {k}" for k, v in sorted(tally.compared.items()))
    total = sum(tally.compared.values())
    print(f"compared by kind: {by_kind}")
    print(f"{total} tensors compared, {len(tally.mismatches)} mismatches")
    if total == 0:
        print("error: nothing was compared", file=sys.stderr)
        return 1
    return 1 if tally.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
