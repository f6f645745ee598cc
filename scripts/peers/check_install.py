#!/usr/bin/env python3
"""Independent, non-streaming checker of a `.gturbo` install.

Usage:
    python scripts/peers/check_install.py SNAPSHOT_DIR GTURBO_DIR [--sample-experts N] [--all]
                                    [--seed N] [--max-mismatches N]

Recomputes, without any of gturbo's Rust code, what every region of the install must
hold (see `manifests/FORMAT.md`) and compares bytes:

- source tensors are read with numpy straight from the safetensors shards named by
  `model.safetensors.index.json` (or a single `model.safetensors`);
- quantized regions are recomputed with MLX itself (`mx.quantize(w, group_size=64,
  bits=4|8)` on the BF16 source), whose packed U32 weights and BF16 scales and biases
  are the truth; passthrough regions must be the source bytes unchanged;
- `resident.bin`: magic, index length, index vs an independent placement of its
  entries and vs the source tensors, every entry's bytes, zero gaps;
- `packed_experts/*.bin`: every layer; all experts with `--all`, else the first, the
  last and N random ones (`--sample-experts`, default 3); zero slack after each blob;
- `ple/*.bin`: every row of every shard region (or, for regions over 512 MiB without
  `--all`, the first, second, last and N random blocks), block slack zero;
- `tokenizer/*` equal to the snapshot's files; every file's size and SHA-256 as listed
  in the manifest; file sizes vs the manifest's geometry.

Prints one line per check group and `N checks passed, M failed`; exits 1 on any
mismatch, naming the first mismatches (file, byte offset, tensor, what).

Needs numpy and the pinned MLX: `pip install -r scripts/requirements/requirements-check.txt`.
"""

import argparse
import hashlib
import json
import os
import random
import re
import sys
import time

import mlx.core as mx
import numpy as np

PAGE = 16384
SUBREGION_ALIGN = 64
GROUP = 64
RES_MAGIC = b"GTRBRES1"
TOKENIZER_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
]
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
SCHEME_BITS = {"int4_g64": 4, "int8_g64": 8, "passthrough": None}
# Regions larger than this are sampled by block unless --all.
ROW_FULL_LIMIT = 512 << 20
# Rows quantized per MLX call (bounds memory on big tables).
QUANT_CHUNK_ELEMS = 1 << 24


def quantized_at_install(man):
    """The quantization record: `quantized_at_install` since manifest 1.1, the 1.0
    spelling `quantizedAtInstall` before (manifests/FORMAT.md, manifest.json, Versions)."""
    return man["quantized_at_install"] if man.get("minor_version", 0) >= 1 else man["quantizedAtInstall"]


def align_up(n, a):
    return (n + a - 1) // a * a


def prod(xs):
    p = 1
    for x in xs:
        p *= int(x)
    return p


class Report:
    """Counts checks per group and keeps the first mismatches."""

    def __init__(self, limit):
        self.limit = limit
        self.passed = 0
        self.failed = 0
        self.mismatches = []

    def ok(self, n=1):
        self.passed += n

    def fail(self, file, offset, tensor, what):
        self.failed += 1
        if len(self.mismatches) < self.limit:
            self.mismatches.append((file, offset, tensor, what))

    def check(self, cond, file, offset, tensor, what):
        if cond:
            self.ok()
        else:
            self.fail(file, offset, tensor, what)
        return cond


# ----------------------------------------------------------------------------- source


class Snapshot:
    """Safetensors tensors of a snapshot directory, read with numpy memmaps."""

    def __init__(self, root):
        self.root = root
        index = os.path.join(root, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index, "rb") as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        elif os.path.exists(os.path.join(root, "model.safetensors")):
            weight_map = None
            files = ["model.safetensors"]
        else:
            raise SystemExit(f"{root}: no model.safetensors.index.json or model.safetensors")
        self.tensors = {}  # name -> (file, dtype, shape, abs_start, abs_end)
        self.maps = {}
        for fname in files:
            path = os.path.join(root, fname)
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            base = 8 + n
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                if weight_map is not None and weight_map.get(name) != fname:
                    # The index is the authority on which shard holds a tensor.
                    continue
                s, e = meta["data_offsets"]
                self.tensors[name] = (fname, meta["dtype"], [int(d) for d in meta["shape"]],
                                      base + s, base + e)
        if weight_map is not None:
            missing = [n for n in weight_map if n not in self.tensors]
            if missing:
                raise SystemExit(f"index names tensors missing from their shards: {missing[:5]}")

    def _map(self, fname):
        if fname not in self.maps:
            self.maps[fname] = np.memmap(os.path.join(self.root, fname), dtype=np.uint8, mode="r")
        return self.maps[fname]

    def raw(self, name):
        fname, _, _, s, e = self.tensors[name]
        return self._map(fname)[s:e]

    def dtype(self, name):
        return self.tensors[name][1]

    def shape(self, name):
        return self.tensors[name][2]

    def u16(self, name):
        """BF16/F16 tensor as its uint16 bit patterns, in its shape."""
        return self.raw(name).view(np.uint16).reshape(self.shape(name))


# ----------------------------------------------------------------------------- quant


def mx_bf16(bits_u16, src_dtype):
    """An MLX BF16 array from source bit patterns (BF16, or F16/F32 cast by MLX)."""
    if src_dtype == "BF16":
        return mx.array(np.ascontiguousarray(bits_u16, dtype=np.uint16)).view(mx.bfloat16)
    if src_dtype == "F16":
        return mx.array(np.ascontiguousarray(bits_u16).view(np.float16)).astype(mx.bfloat16)
    if src_dtype == "F32":
        return mx.array(np.ascontiguousarray(bits_u16).view(np.float32)).astype(mx.bfloat16)
    raise ValueError(f"cannot quantize source dtype {src_dtype}")


def quantize_rows(src, src_dtype, bits):
    """MLX affine quantization of a [rows, cols] matrix (source bit patterns).

    Returns (weights, scales, biases) as uint8 arrays of shape [rows, bytes_per_row].
    Groups never cross rows, so quantizing in row chunks gives the same bytes.
    """
    rows, cols = src.shape
    step = max(1, QUANT_CHUNK_ELEMS // max(cols, 1))
    ws, ss, bs = [], [], []
    for r0 in range(0, rows, step):
        chunk = src[r0:r0 + step]
        w, s, b = mx.quantize(mx_bf16(chunk, src_dtype), group_size=GROUP, bits=bits)
        ws.append(np.array(w, copy=True).view(np.uint8).reshape(chunk.shape[0], -1))
        ss.append(np.array(s.view(mx.uint16), copy=True).view(np.uint8).reshape(chunk.shape[0], -1))
        bs.append(np.array(b.view(mx.uint16), copy=True).view(np.uint8).reshape(chunk.shape[0], -1))
    if not ws:
        z = np.zeros((0, 0), np.uint8)
        return z, z, z
    return np.concatenate(ws), np.concatenate(ss), np.concatenate(bs)


def src_matrix(snap, name, elem_view=np.uint16):
    """A tensor as [prod(shape[:-1]), shape[-1]] source elements (2-byte dtypes)."""
    shape = snap.shape(name)
    cols = shape[-1] if shape else 1
    rows = prod(shape[:-1]) if shape else 1
    return snap.raw(name).view(elem_view).reshape(rows, cols)


# ----------------------------------------------------------------------------- compare


def compare(rep, file, base, actual, expected, segments, tensor):
    """Compare bytes; on mismatch name the first differing segment and offset.

    segments: list of (start, length, label) inside `expected`; bytes outside them
    are padding that must be zero.
    """
    if actual.shape == expected.shape and np.array_equal(actual, expected):
        rep.ok()
        return True
    if actual.shape != expected.shape:
        rep.fail(file, base, tensor, f"region truncated: {actual.size} bytes on disk, {expected.size} expected")
        return False
    diff = np.flatnonzero(actual != expected)
    first = int(diff[0])
    label = "zero padding"
    for s, ln, lab in segments:
        if s <= first < s + ln:
            label = f"{lab} (byte {first - s} of {ln})"
            break
    bad = []
    for s, ln, lab in segments:
        if not np.array_equal(actual[s:s + ln], expected[s:s + ln]):
            bad.append(lab)
    pad_bad = diff.size > sum(
        int(np.count_nonzero(actual[s:s + ln] != expected[s:s + ln])) for s, ln, _ in segments)
    if pad_bad:
        bad.append("padding")
    rep.fail(file, base + first, tensor,
             f"{label}: got 0x{int(actual[first]):02x} want 0x{int(expected[first]):02x}; "
             f"{diff.size} bytes differ in [{', '.join(bad)}]")
    return False


class FileMaps:
    def __init__(self, root):
        self.root = root
        self.maps = {}

    def get(self, rel):
        if rel not in self.maps:
            path = os.path.join(self.root, rel)
            if not os.path.exists(path):
                self.maps[rel] = None
            elif os.path.getsize(path) == 0:
                self.maps[rel] = np.zeros(0, np.uint8)
            else:
                self.maps[rel] = np.memmap(path, dtype=np.uint8, mode="r")
        return self.maps[rel]


def zero_gaps(rep, file, data, spans, lo, hi, what):
    """Bytes of data[lo:hi] outside `spans` (absolute (start, end)) must be zero."""
    cursor = lo
    gaps = 0
    for s, e in sorted(spans) + [(hi, hi)]:
        if s > cursor:
            seg = data[cursor:s]
            nz = np.flatnonzero(seg)
            if nz.size:
                rep.fail(file, cursor + int(nz[0]), what,
                         f"gap [{cursor}, {s}) not zero ({nz.size} nonzero bytes)")
                return
            gaps += 1
        cursor = max(cursor, e)
    rep.ok()


# ----------------------------------------------------------------------------- resident


def place_resident(entries):
    """Independent placement of resident entries (FORMAT.md): offsets and end cursor."""
    cursor = 0
    placed = []
    for t in entries:
        start = align_up(cursor, PAGE)
        shape = t["shape"]
        elems = prod(shape)
        bits = SCHEME_BITS.get(t["scheme"], "bad")
        if bits is None:
            ln = elems * DTYPE_BYTES.get(t["dtype"], 0)
            placed.append({"data": {"offset": start, "len": ln}})
            cursor = start + ln
        else:
            cols = shape[-1] if shape else 1
            rows = elems // max(cols, 1)
            wl = rows * cols * bits // 8
            sl = rows * (cols // GROUP) * 2
            so = align_up(start + wl, SUBREGION_ALIGN)
            bo = align_up(so + sl, SUBREGION_ALIGN)
            placed.append({"weights": {"offset": start, "len": wl},
                           "scales": {"offset": so, "len": sl},
                           "biases": {"offset": bo, "len": sl}})
            cursor = bo + sl
    return placed, cursor


def glob_to_re(pattern):
    """Family match patterns: `**` any, `{a|b}` alternatives, `{x}` one name segment."""
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "{":
            j = pattern.index("}", i)
            body = pattern[i + 1:j]
            if ":" in body:
                body = body.split(":", 1)[1]
            out += "(" + body + ")" if "|" in body else "[^.]+"
            i = j + 1
        elif pattern[i] == "*":
            out += "[^.]*"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile("^" + out + "$")


def check_resident(rep, snap, man, gdir, maps, pooled, family_rules):
    fname = man["resident"]["file"]
    data = maps.get(fname)
    if data is None:
        rep.fail(fname, 0, "-", "file missing")
        return "resident: file missing"
    n_fail0 = rep.failed
    if not rep.check(bytes(data[:8]) == RES_MAGIC, fname, 0, "-", f"magic {bytes(data[:8])!r}"):
        return "resident: bad magic"
    n = int.from_bytes(bytes(data[8:16]), "little")
    try:
        index = json.loads(bytes(data[16:16 + n]))
        rep.ok()
    except ValueError as e:
        rep.fail(fname, 16, "-", f"index JSON does not parse: {e}")
        return "resident: bad index"
    payload = align_up(16 + n, PAGE)
    rep.check(payload == man["resident"]["payload_start"], fname, 8, "-",
              f"payload_start {payload} (from index length {n}) != manifest {man['resident']['payload_start']}")
    rep.check(index.get("format") == "gturbo-resident" and index.get("version") == 1, fname, 16, "-",
              f"index format/version {index.get('format')!r}/{index.get('version')!r}")
    entries = index.get("tensors", [])
    rep.check(len(entries) == man["resident"]["entries"], fname, 16, "-",
              f"index has {len(entries)} entries, manifest says {man['resident']['entries']}")
    names = [t["name"] for t in entries]
    rep.check(names == sorted(names), fname, 16, "-", "entries not in tensor-name order")
    rep.check(len(set(names)) == len(names), fname, 16, "-", "duplicate entry names")

    # Entries vs source and the manifest's accounting of every source tensor.
    for t in entries:
        nm = t["name"]
        if nm not in snap.tensors:
            rep.fail(fname, 16, nm, "entry names no source tensor")
            continue
        rep.check(t["dtype"] == snap.dtype(nm) and t["shape"] == snap.shape(nm), fname, 16, nm,
                  f"entry dtype/shape {t['dtype']}{t['shape']} != source {snap.dtype(nm)}{snap.shape(nm)}")
        if nm in pooled:
            rep.fail(fname, 16, nm, "tensor is both resident and in a pool")
    resident_names = set(names)
    unaccounted = [n_ for n_ in snap.tensors if n_ not in resident_names and n_ not in pooled]
    rep.check(len(unaccounted) == man["excluded_tensors"], "manifest.json", 0, "excluded_tensors",
              f"{len(unaccounted)} source tensors neither resident nor pooled, manifest says "
              f"excluded_tensors={man['excluded_tensors']} (e.g. {sorted(unaccounted)[:3]})")

    # Scheme policy from the family file, when the repo's families/ has it.
    # The manifest's applied overrides win over the family file's; a passthrough
    # (`--quant bf16`) install stores everything at its source dtype.
    qa = quantized_at_install(man)
    if qa["scheme"] == "passthrough":
        for t in entries:
            rep.check(t["scheme"] == "passthrough", fname, 16, t["name"],
                      f"{t['scheme']} in a passthrough install")
    elif family_rules is not None:
        never = family_rules.get("never_quantize_name_contains", [])
        if qa.get("overrides"):
            overrides = [(glob_to_re(pat), sch) for pat, sch in qa["overrides"]]
        else:
            overrides = [(glob_to_re(o["match"]), o["scheme"]) for o in family_rules.get("overrides", [])]
        for t in entries:
            nm, sch = t["name"], t["scheme"]
            cols = t["shape"][-1] if t["shape"] else 0
            if any(w in nm for w in never):
                rep.check(sch == "passthrough", fname, 16, nm, f"never-quantize name stored as {sch}")
            elif SCHEME_BITS.get(sch) is not None:
                want = next((s for r, s in overrides if r.match(nm)), None)
                rep.check(cols % GROUP == 0 and (want is None or want == sch), fname, 16, nm,
                          f"scheme {sch} (cols {cols}, override {want})")
            else:
                want = next((s for r, s in overrides if r.match(nm)), None)
                rep.check(want in (None, "passthrough"), fname, 16, nm,
                          f"stored passthrough but override says {want}")

    # Offsets vs an independent placement.
    placed, cursor = place_resident(entries)
    for t, p in zip(entries, placed):
        got = {k: t.get(k) for k in ("data", "weights", "scales", "biases") if t.get(k) is not None}
        rep.check(got == p, fname, 16, t["name"], f"spans {got} != expected {p}")
    want_size = payload + align_up(cursor, SUBREGION_ALIGN) if entries else payload
    rep.check(data.size == want_size, fname, data.size, "-",
              f"file is {data.size} bytes, layout implies {want_size}")

    # Bytes.
    spans = [(0, 16 + n)]
    ok_entries = 0
    for t in entries:
        nm = t["name"]
        if nm not in snap.tensors:
            continue
        bits = SCHEME_BITS.get(t["scheme"], "bad")
        if bits is None:
            sp = t["data"]
            a = payload + sp["offset"]
            exp = np.asarray(snap.raw(nm))
            got = data[a:a + sp["len"]]
            ok = compare(rep, fname, a, got, exp, [(0, exp.size, "data")], nm)
            spans.append((a, a + sp["len"]))
        elif bits == "bad":
            rep.fail(fname, 16, nm, f"unknown scheme {t['scheme']}")
            continue
        else:
            try:
                m = src_matrix(snap, nm)
                w, s, b = quantize_rows(m, snap.dtype(nm), bits)
            except ValueError as e:
                rep.fail(fname, 16, nm, str(e))
                continue
            ok = True
            for key, arr in (("weights", w), ("scales", s), ("biases", b)):
                sp = t[key]
                a = payload + sp["offset"]
                exp = arr.reshape(-1)
                ok &= compare(rep, fname, a, data[a:a + sp["len"]], exp, [(0, exp.size, key)], nm)
                spans.append((a, a + sp["len"]))
        ok_entries += ok
    zero_gaps(rep, fname, data, spans, 0, data.size, "resident gaps")
    state = "ok" if rep.failed == n_fail0 else f"{rep.failed - n_fail0} FAILED"
    return f"resident: {ok_entries}/{len(entries)} entries ok, payload_start {payload} ({state})"


# ----------------------------------------------------------------------------- experts


def expert_sources(snap, layer, sidecar):
    """Source tensors of one MoE layer: ('fused', gate_up, down) or ('unfused', {e: (g,u,d)})."""
    pat = re.compile(r"(^|\.)layers\." + str(layer) + r"\.mlp\.experts\.(.+)$")
    found = {}
    for name in snap.tensors:
        is_mtp = name.startswith("mtp.")
        if sidecar is None and is_mtp:
            continue
        if sidecar is not None and not name.startswith(f"{sidecar}.layers.{layer}.mlp.experts"):
            continue
        m = pat.search(name)
        if m:
            found[m.group(2)] = name
    if "gate_up_proj" in found and "down_proj" in found:
        return "fused", found["gate_up_proj"], found["down_proj"]
    unfused = {}
    for rest, name in found.items():
        m = re.match(r"^(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", rest)
        if m:
            unfused.setdefault(int(m.group(1)), {})[m.group(2)] = name
    return "unfused", unfused, None


def check_experts(rep, snap, man, maps, args, pooled):
    lines = []
    rng = random.Random(args.seed)
    for pool in man["expert_pools"]:
        f0 = rep.failed
        fname, layer, side = pool["file"], pool["layer"], pool["sidecar"]
        label = f"experts {side + ' ' if side else ''}layer {layer}"
        want_name = f"packed_experts/{side + '_' if side else ''}layer_{layer:02d}.bin"
        rep.check(fname == want_name, fname, 0, "-", f"file name, spec says {want_name}")
        kind, a, b = expert_sources(snap, layer, side)
        E = pool["experts"]
        if kind == "fused":
            pooled.update([a, b])
            Eg, I2, H = snap.shape(a)
            Ed, Hd, I = snap.shape(b)
            if not rep.check(Eg == E and Ed == E and I2 == 2 * I and Hd == H, fname, 0, a,
                             f"fused shapes {snap.shape(a)} {snap.shape(b)} vs {E} experts"):
                lines.append(f"{label}: bad source shapes")
                continue
            dtype = snap.dtype(a)

            def mats(e, a=a, b=b, I=I):
                gu = snap.raw(a).view(np.uint16).reshape(snap.shape(a))[e]
                return gu[:I], gu[I:], snap.raw(b).view(np.uint16).reshape(snap.shape(b))[e]
        else:
            parts = a
            for d in parts.values():
                pooled.update(d.values())
            complete = sorted(e for e, d in parts.items() if len(d) == 3)
            if not rep.check(complete == list(range(E)) and len(parts) == E, fname, 0,
                             f"layers.{layer}.mlp.experts",
                             f"source has {len(complete)} complete experts, pool says {E}"):
                lines.append(f"{label}: source experts missing")
                continue
            I, H = snap.shape(parts[0]["gate_proj"])
            dtype = snap.dtype(parts[0]["gate_proj"])

            def mats(e, parts=parts):
                return tuple(src_matrix(snap, parts[e][p]) for p in ("gate_proj", "up_proj", "down_proj"))

        scheme = pool["scheme"]
        bits = SCHEME_BITS.get(scheme)
        rep.check(pool["dtype"] == dtype, fname, 0, "-", f"pool dtype {pool['dtype']} != source {dtype}")
        # Independent blob geometry.
        geo = []
        off = 0
        for part, r, c in (("gate", I, H), ("up", I, H), ("down", H, I)):
            if bits is None:
                w, s = r * c * DTYPE_BYTES[dtype], 0
            else:
                w, s = r * c * bits // 8, r * (c // GROUP) * 2
            geo.append({"part": part, "rows": r, "cols": c, "offset": off,
                        "weights": w, "scales": s, "biases": s})
            off += w + 2 * s
        blob = off
        stride = align_up(blob, PAGE)
        rep.check(pool["parts"] == geo, fname, 0, "-", f"manifest parts {pool['parts']} != {geo}")
        rep.check(pool["blob_bytes"] == blob and pool["stride"] == stride and
                  pool["file_bytes"] == E * stride, fname, 0, "-",
                  f"blob/stride/file_bytes {pool['blob_bytes']}/{pool['stride']}/{pool['file_bytes']}"
                  f" != {blob}/{stride}/{E * stride}")
        data = maps.get(fname)
        if data is None:
            rep.fail(fname, 0, "-", "file missing")
            lines.append(f"{label}: file missing")
            continue
        rep.check(data.size == E * stride, fname, data.size, "-",
                  f"file is {data.size} bytes, expected {E} * {stride}")
        if args.all or E <= 2 + args.sample_experts:
            sample = list(range(E))
        else:
            sample = sorted({0, E - 1} | set(rng.sample(range(1, E - 1), args.sample_experts)))
        ok = 0
        for e in sample:
            g, u, d = mats(e)
            segs = []
            chunks = []
            pos = 0
            for part, m in (("gate", g), ("up", u), ("down", d)):
                if bits is None:
                    pieces = [("", np.ascontiguousarray(m).view(np.uint8).reshape(-1))]
                else:
                    w, s, bb = quantize_rows(m, dtype, bits)
                    pieces = [(".weights", w.reshape(-1)), (".scales", s.reshape(-1)),
                              (".biases", bb.reshape(-1))]
                for suf, arr in pieces:
                    segs.append((pos, arr.size, part + suf))
                    chunks.append(arr)
                    pos += arr.size
            exp = np.zeros(stride, np.uint8)
            exp[:pos] = np.concatenate(chunks)
            base = e * stride
            ok += compare(rep, fname, base, data[base:base + stride], exp, segs,
                          f"layer {layer} expert {e}")
        state = "ok" if rep.failed == f0 else f"{rep.failed - f0} FAILED"
        lines.append(f"{label}: {ok}/{len(sample)} of {E} {'checked' if len(sample) == E else 'sampled'} "
                     f"ok ({kind}, {scheme}, stride {stride}) ({state})")
    return lines


# ----------------------------------------------------------------------------- rows


def check_rows(rep, snap, man, maps, args, pooled):
    lines = []
    rng = random.Random(args.seed + 1)
    global_scheme = quantized_at_install(man)["scheme"]
    for pool in man["row_pools"]:
        f0 = rep.failed
        fname = pool["file"]
        label = f"rows {fname}"
        want_name = f"ple/layer_{pool['layer']:02d}_{pool['name']}.bin"
        rep.check(fname == want_name, fname, 0, "-", f"file name, spec says {want_name}")
        width, scheme = pool["width"], pool["scheme"]
        bits = SCHEME_BITS.get(scheme)
        if width % GROUP == 0 and global_scheme != "passthrough":
            rep.check(bits == 4, fname, 0, "-", f"width {width} is a multiple of 64 but rows are {scheme}")
        elif width % GROUP != 0:
            rep.check(bits is None, fname, 0, "-", f"width {width} is not a multiple of 64 but rows are {scheme}")
        esz = DTYPE_BYTES.get(pool["dtype"], 0)
        row_bytes = width * esz if bits is None else width * bits // 8 + width // GROUP * 4
        rpb = PAGE // row_bytes
        rep.check(pool["row_bytes"] == row_bytes and pool["rows_per_block"] == rpb, fname, 0, "-",
                  f"row_bytes/rows_per_block {pool['row_bytes']}/{pool['rows_per_block']} != {row_bytes}/{rpb}")
        data = maps.get(fname)
        if data is None:
            rep.fail(fname, 0, "-", "file missing")
            lines.append(f"{label}: file missing")
            continue
        off = 0
        rows_total = 0
        shards_ok = 0
        sampled = False
        for sh in pool["shards"]:
            tname, rows = sh["tensor"], sh["rows"]
            pooled.add(tname)
            blocks = -(-rows // rpb)
            geo_ok = rep.check(
                sh["offset"] == off and sh["blocks"] == blocks and sh["region_bytes"] == blocks * PAGE,
                fname, off, tname,
                f"shard geometry offset/blocks/region {sh['offset']}/{sh['blocks']}/{sh['region_bytes']}"
                f" != {off}/{blocks}/{blocks * PAGE}")
            if tname not in snap.tensors:
                rep.fail(fname, off, tname, "shard names no source tensor")
                off += blocks * PAGE
                continue
            shape = snap.shape(tname)
            rep.check(shape == [rows, width] and snap.dtype(tname) == pool["dtype"], fname, off, tname,
                      f"source {snap.dtype(tname)}{shape} vs pool [{rows}, {width}] {pool['dtype']}")
            src = snap.raw(tname).reshape(rows, width * esz)
            region = off
            if args.all or blocks * PAGE <= ROW_FULL_LIMIT:
                block_list = list(range(blocks))
            else:
                sampled = True
                picks = {0, 1, blocks - 1} | {rng.randrange(blocks) for _ in range(args.sample_experts)}
                block_list = sorted(b for b in picks if 0 <= b < blocks)
            shard_ok = True
            # Compare in runs of consecutive blocks.
            runs = []
            for b_ in block_list:
                if runs and runs[-1][1] == b_ and runs[-1][1] - runs[-1][0] < 4096:
                    runs[-1][1] = b_ + 1
                else:
                    runs.append([b_, b_ + 1])
            for b0, b1 in runs:
                r0, r1 = b0 * rpb, min(rows, b1 * rpb)
                seg = src[r0:r1]
                if bits is None:
                    rb = np.asarray(seg)
                else:
                    w, s, bb = quantize_rows(seg.view(np.uint16), pool["dtype"], bits)
                    rb = np.concatenate([w, s, bb], axis=1)
                padded = np.zeros(((b1 - b0) * rpb, row_bytes), np.uint8)
                padded[:r1 - r0] = rb
                exp = np.zeros((b1 - b0, PAGE), np.uint8)
                exp[:, :rpb * row_bytes] = padded.reshape(b1 - b0, rpb * row_bytes)
                exp = exp.reshape(-1)
                a = region + b0 * PAGE
                got = data[a:a + exp.size]
                if got.shape == exp.shape and np.array_equal(got, exp):
                    rep.ok()
                    continue
                shard_ok = False
                if got.shape != exp.shape:
                    rep.fail(fname, a, tname, f"blocks {b0}..{b1} truncated")
                    continue
                first = int(np.flatnonzero(got != exp)[0])
                blk, inb = divmod(first, PAGE)
                if inb < rpb * row_bytes:
                    r = (b0 + blk) * rpb + inb // row_bytes
                    where = f"row {r} byte {inb % row_bytes}" + ("" if r < rows else " (past last row: must be zero)")
                else:
                    where = f"block {b0 + blk} slack byte {inb - rpb * row_bytes}"
                rep.fail(fname, a + first, tname,
                         f"{where}: got 0x{int(got[first]):02x} want 0x{int(exp[first]):02x}")
            shards_ok += shard_ok and geo_ok
            rows_total += rows
            off += blocks * PAGE
        rep.check(pool["file_bytes"] == off and data.size == off, fname, data.size, "-",
                  f"file is {data.size} bytes, manifest file_bytes {pool['file_bytes']}, regions sum to {off}")
        state = "ok" if rep.failed == f0 else f"{rep.failed - f0} FAILED"
        lines.append(f"{label}: {shards_ok}/{len(pool['shards'])} shards ok, {rows_total} rows, "
                     f"{row_bytes} B rows, {rpb}/block{' (blocks sampled)' if sampled else ''} ({state})")
    return lines


# ----------------------------------------------------------------------------- files


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            buf = f.read(8 << 20)
            if not buf:
                break
            h.update(buf)
    return h.hexdigest()


def kind_of(path):
    if path == "resident.bin":
        return "resident"
    if path.startswith("packed_experts/"):
        return "experts"
    if path.startswith("ple/"):
        return "rows"
    if path.startswith("tokenizer/"):
        return "tokenizer"
    return "?"


def check_files(rep, snap_dir, gdir, man):
    lines = []
    f0 = rep.failed
    listed = man["files"]
    paths = [f["path"] for f in listed]
    rep.check(paths == sorted(paths), "manifest.json", 0, "files", "files not sorted by path")
    on_disk = set()
    for root, _, names in os.walk(gdir):
        for nm in names:
            rel = os.path.relpath(os.path.join(root, nm), gdir).replace(os.sep, "/")
            on_disk.add(rel)
    extra = sorted(p for p in on_disk - set(paths) if p not in ("manifest.json", "verified-install.json"))
    rep.check(not extra, extra[0] if extra else "-", 0, "-", f"files on disk not in manifest: {extra[:5]}")
    ok = 0
    for f in listed:
        p = os.path.join(gdir, f["path"])
        if not os.path.exists(p):
            rep.fail(f["path"], 0, "-", "listed in manifest, missing on disk")
            continue
        good = rep.check(os.path.getsize(p) == f["bytes"], f["path"], 0, "-",
                         f"size {os.path.getsize(p)} != manifest {f['bytes']}")
        good &= rep.check(sha256_file(p) == f["sha256"], f["path"], 0, "-", "SHA-256 differs from manifest")
        good &= rep.check(f["kind"] == kind_of(f["path"]), f["path"], 0, "-",
                          f"kind {f['kind']!r}, expected {kind_of(f['path'])!r}")
        ok += good
    # Every pool/resident file is listed.
    want = {man["resident"]["file"]} | {p["file"] for p in man["expert_pools"]} | {p["file"] for p in man["row_pools"]}
    missing = sorted(want - set(paths))
    rep.check(not missing, "manifest.json", 0, "files", f"data files not in files list: {missing}")
    state = "ok" if rep.failed == f0 else f"{rep.failed - f0} FAILED"
    lines.append(f"files: {ok}/{len(listed)} sizes and SHA-256 ok ({state})")

    f0 = rep.failed
    tok_ok = 0
    present = [n for n in TOKENIZER_FILES if os.path.exists(os.path.join(snap_dir, n))]
    for n in present:
        p = os.path.join(gdir, "tokenizer", n)
        if not os.path.exists(p):
            rep.fail(f"tokenizer/{n}", 0, "-", "snapshot has it, install does not")
            continue
        with open(p, "rb") as a, open(os.path.join(snap_dir, n), "rb") as b:
            tok_ok += rep.check(a.read() == b.read(), f"tokenizer/{n}", 0, "-", "differs from snapshot")
    tok_extra = sorted(p for p in on_disk if p.startswith("tokenizer/") and p[len("tokenizer/"):] not in present)
    rep.check(not tok_extra, "tokenizer", 0, "-", f"unexpected tokenizer files {tok_extra}")
    state = "ok" if rep.failed == f0 else f"{rep.failed - f0} FAILED"
    lines.append(f"tokenizer: {tok_ok}/{len(present)} files equal to snapshot ({state})")
    return lines


def check_manifest(rep, gdir, man, raw):
    f0 = rep.failed
    rep.check(man.get("format") == "gturbo" and man.get("version") == 1, "manifest.json", 0, "-",
              f"format/version {man.get('format')!r}/{man.get('version')!r}")
    canon = json.dumps(man, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    if canon.encode() != raw:
        # serde_json and Python format floats differently (1e-6 vs 1e-06, 0.00001 vs
        # 1e-05); only flag differences that survive writing every float value (a
        # number with a fraction or exponent at the end of a line) as Python's repr.
        norm = re.compile(r"(?m)(?<=: )(-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)(?=,?$)")

        def floats(text):
            return norm.sub(lambda m: repr(float(m.group(1))) if any(c in m.group(1) for c in ".eE") else m.group(1), text)

        same = floats(canon) == floats(raw.decode("utf-8", "replace"))
        rep.check(same, "manifest.json", 0, "-", "not canonical JSON (sorted keys, 2-space indent, newline)")
    else:
        rep.ok()
    state = "ok" if rep.failed == f0 else f"{rep.failed - f0} FAILED"
    return f"manifest: {man.get('family')} {man.get('model_id')}, {len(man['files'])} files, " \
           f"{len(man['expert_pools'])} expert pools, {len(man['row_pools'])} row pools ({state})"


def load_family_rules(family):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "families", f"{family}.json")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return json.load(f).get("quant")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("snapshot")
    ap.add_argument("gturbo")
    ap.add_argument("--sample-experts", type=int, default=3, metavar="N",
                    help="random experts per layer besides the first and last (default 3)")
    ap.add_argument("--all", action="store_true", help="check every expert and every row block")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    ap.add_argument("--max-mismatches", type=int, default=20, help="mismatches to name (default 20)")
    args = ap.parse_args(argv)

    t0 = time.time()
    mx.set_default_device(mx.cpu)
    rep = Report(args.max_mismatches)
    with open(os.path.join(args.gturbo, "manifest.json"), "rb") as f:
        raw = f.read()
    man = json.loads(raw)
    snap = Snapshot(args.snapshot)
    maps = FileMaps(args.gturbo)
    pooled = set()

    out = [check_manifest(rep, args.gturbo, man, raw)]
    out += check_files(rep, args.snapshot, args.gturbo, man)
    for line in out:
        print(line, flush=True)
    for line in check_experts(rep, snap, man, maps, args, pooled):
        print(line, flush=True)
    for line in check_rows(rep, snap, man, maps, args, pooled):
        print(line, flush=True)
    print(check_resident(rep, snap, man, args.gturbo, maps, pooled, load_family_rules(man.get("family", ""))),
          flush=True)

    if rep.mismatches:
        print(f"first {len(rep.mismatches)} mismatches:")
        for file, off, tensor, what in rep.mismatches:
            print(f"  {file} @ {off} [{tensor}]: {what}")
    print(f"{rep.passed} checks passed, {rep.failed} failed ({time.time() - t0:.1f} s)")
    return 1 if rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
