#!/usr/bin/env python3
"""An independent re-implementation of the Flash-Next forward pass as
tests/data/flashnext_toy/REFERENCE_NOTES.md describes it, checked against the goldens.

It reads only the checkpoint's tensors and config.json (no transformers modules) and
uses plain tensor arithmetic, so agreement shows that the notes are complete: PLE ids,
indexer sets and router sets must be equal, logits within 1e-4 at every position of
both prompts. Run it with the golden environment's python:

    target/venv-golden/bin/python scripts/golden/check_flashnext_notes.py [tests/data/flashnext_toy]
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

torch.set_num_threads(1)
F32 = torch.float32


def load(dir_: Path):
    cfg = json.loads((dir_ / "config.json").read_text())["text_config"]
    index = json.loads((dir_ / "model.safetensors.index.json").read_text())
    w = {}
    for shard in sorted(set(index["weight_map"].values())):
        for k, v in load_file(str(dir_ / shard)).items():
            w[k] = v if v.dtype == torch.int64 else v.to(F32)
    return cfg, w


def rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def offset_norm(x, w, eps, group=None):
    if group is not None:
        shp = x.shape
        return (rms(x.reshape(*shp[:-1], -1, group), eps).reshape(shp)) * (1 + w)
    return rms(x, eps) * (1 + w)


def rope_tables(cfg, positions):
    rp = cfg["rope_parameters"]
    rd = int(cfg["head_dim"] * rp["partial_rotary_factor"])
    inv = 1.0 / (rp["rope_theta"] ** (torch.arange(0, rd, 2, dtype=F32) / rd))
    ang = positions[:, None].to(F32) * inv[None, :]
    return torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1), rd


def rope(x, cos, sin, rd):
    # x [..., T, heads, d]; cos/sin [T, rd]
    c, s = cos[:, None, :], sin[:, None, :]
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
    rot = torch.cat([-x2, x1], -1)
    return torch.cat([xr * c + rot * s, xp], -1)


def hc(w, p, x, cfg, inject=True):
    s, h, eps = cfg["hc_count"], cfg["hidden_size"], cfg["rms_norm_eps"]
    xn = offset_norm(x, w[p + "hc_norm.weight"], eps, group=h)
    a = torch.nn.functional.silu((xn @ w[p + "input_mix_weight_down.weight"].T) / s)
    m = torch.sigmoid(a @ w[p + "input_mix_weight_up.weight"].T)
    u = (m.reshape(-1, s, h) * xn.reshape(-1, s, h)).mean(1)
    if not inject:
        return u, None
    inj = 2 * torch.sigmoid((xn @ w[p + "block_inject_weight.weight"].T) / s)
    return u, inj


def ple_ids(cfg, w, p, ids):
    eos, n = cfg["eos_token_id"], cfg["ngram_size"]
    m = w[p + "ple_embedding.layer_multipliers"].tolist()
    sizes = w[p + "ple_embedding.ngram_heads_vocab_sizes"].tolist()
    offs = w[p + "ple_embedding.ngram_heads_offsets"].tolist()
    hpn = cfg["heads_per_ngram"]
    out = []
    seg_start = 0
    for t, tok in enumerate(ids):
        hist = [ids[t - s] if t - s >= seg_start else eos for s in range(n)]
        row = []
        for order in range(2, n + 1):
            mix = 0
            for s in range(order):
                mix ^= hist[s] * m[s]
            base = (order - 2) * hpn
            row += [mix % sizes[base + h] + offs[base + h] for h in range(hpn)]
        out.append(row)
        if tok == eos:
            seg_start = t + 1
    return torch.tensor(out)


def ple(cfg, w, p, x, ids):
    s, h, eps = cfg["hc_count"], cfg["hidden_size"], cfg["rms_norm_eps"]
    parts = cfg["split_ngram_parts"]
    table = torch.cat([w[f"{p}ple_embedding.ngram_embedding.shard_{i}.weight"] for i in range(parts)])
    rid = ple_ids(cfg, w, p, ids)
    e = table[rid].reshape(len(ids), -1)
    key = offset_norm(e @ w[p + "key_proj.weight"].T, w[p + "norm_key.weight"], eps, h).reshape(-1, s, h)
    val = e @ w[p + "value_proj.weight"].T
    qry = offset_norm(x, w[p + "norm_query.weight"], eps, h).reshape(-1, s, h)
    g = (key * qry).sum(-1) / math.sqrt(h)
    g = g.abs().clamp_min(1e-6).sqrt() * g.sign()
    gv = (torch.sigmoid(g)[..., None] * val[:, None, :]).reshape(len(ids), -1)
    gvn = offset_norm(gv, w[p + "norm_conv.weight"], eps, h)
    k, d = cfg["ple_conv_kernel_size"], cfg["ngram_size"]
    cw = w[p + "conv1d.weight"][:, 0, :]  # [C, K]
    c = torch.zeros_like(gvn)
    for i in range(k):
        lag = (k - 1 - i) * d
        if lag < len(ids):
            c[lag:] += cw[:, i] * gvn[: len(ids) - lag]
    return gv + torch.nn.functional.silu(c), rid


def gdn(cfg, w, p, u):
    t = u.shape[0]
    nk, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    nv, dv = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    kk = cfg["linear_conv_kernel_dim"]
    c = u @ w[p + "in_proj_qkv.weight"].T
    z = (u @ w[p + "in_proj_z.weight"].T).reshape(t, nv, dv)
    b = u @ w[p + "in_proj_b.weight"].T
    a = u @ w[p + "in_proj_a.weight"].T
    cw = w[p + "conv1d.weight"][:, 0, :]
    cc = torch.zeros_like(c)
    for i in range(kk):
        lag = kk - 1 - i
        cc[lag:] += cw[:, i] * c[: t - lag]
    cc = torch.nn.functional.silu(cc)
    q, k, v = cc.split([nk * dk, nk * dk, nv * dv], -1)
    q, k, v = q.reshape(t, nk, dk), k.reshape(t, nk, dk), v.reshape(t, nv, dv)
    rep = nv // nk
    q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
    beta = torch.sigmoid(b)
    g = -w[p + "A_log"].exp() * torch.nn.functional.softplus(a + w[p + "dt_bias"])
    l2 = lambda x: x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    q, k = l2(q) / math.sqrt(dk), l2(k)
    st = torch.zeros(nv, dk, dv)
    o = torch.zeros(t, nv, dv)
    for i in range(t):
        st = st * g[i].exp()[:, None, None]
        kv = (st * k[i][:, :, None]).sum(1)
        st = st + k[i][:, :, None] * ((v[i] - kv) * beta[i][:, None])[:, None, :]
        o[i] = (st * q[i][:, :, None]).sum(1)
    eps = cfg["rms_norm_eps"]
    gated = rms(o, eps) * w[p + "norm.weight"] * torch.sigmoid(z)
    return gated.reshape(t, -1) @ w[p + "out_proj.weight"].T


def attention(cfg, w, p, u, emulate_topk):
    t = u.shape[0]
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    pos = torch.arange(t)
    cos, sin, rd = rope_tables(cfg, pos)
    # indexer
    ni, di, cr = cfg["indexer_n_heads"], cfg["indexer_head_dim"], cfg["indexer_compress_ratio"]
    kb = cfg["indexer_budget"] // cr
    ix = p + "indexer."
    qk = u @ w[ix + "index_qk_proj.weight"].T
    qi = offset_norm(qk[:, : ni * di].reshape(t, ni, di), w[ix + "q_layernorm.weight"], eps)
    qi = rope(qi, cos, sin, rd)
    kraw = qk[:, ni * di:]
    allowed = torch.zeros(t, t, dtype=torch.bool)
    sets = []
    for q in range(t):
        n = (q + 1) // cr
        sel = []
        if n:
            pooled = kraw[: n * cr].reshape(n, cr, di).mean(1)
            kbk = offset_norm(pooled, w[ix + "k_layernorm.weight"], eps)
            starts = torch.arange(n) * cr
            c2, s2, _ = rope_tables(cfg, starts)
            kbk = rope(kbk[:, None, :], c2, s2, rd)[:, 0]
            sc = torch.relu(qi[q] @ kbk.T).sum(0) / math.sqrt(di)
            sel = sorted(emulate_topk(sc.tolist(), min(kb, n)))
        for b in sel:
            allowed[q, b * cr:(b + 1) * cr] = True
        allowed[q, n * cr: q + 1] = True
        sets.append(sel)
    qg = (u @ w[p + "q_proj.weight"].T).reshape(t, nh, 2 * d)
    query, gate = qg[..., :d], qg[..., d:]
    qh = rope(offset_norm(query, w[p + "q_norm.weight"], eps), cos, sin, rd)
    kh = rope(offset_norm((u @ w[p + "k_proj.weight"].T).reshape(t, nkv, d), w[p + "k_norm.weight"], eps), cos, sin, rd)
    vh = (u @ w[p + "v_proj.weight"].T).reshape(t, nkv, d)
    grp = nh // nkv
    out = torch.zeros(t, nh, d)
    for h in range(nh):
        s = (qh[:, h] @ kh[:, h // grp].T) / math.sqrt(d)
        s = s.masked_fill(~allowed, float("-inf"))
        out[:, h] = torch.softmax(s, -1) @ vh[:, h // grp]
    o = out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
    return o @ w[p + "o_proj.weight"].T, sets


def moe(cfg, w, p, u, emulate_topk):
    k, i_ = cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    probs = torch.softmax(u @ w[p + "gate.weight"].T, -1)
    y = torch.zeros_like(u)
    chosen = []
    for t in range(u.shape[0]):
        idx = emulate_topk(probs[t].tolist(), k)
        wt = probs[t, idx] / probs[t, idx].sum()
        chosen.append(sorted(idx))
        for e, we in zip(idx, wt):
            gu = w[p + "experts.gate_up_proj"][e]
            h = torch.nn.functional.silu(gu[:i_] @ u[t]) * (gu[i_:] @ u[t])
            y[t] += we * (w[p + "experts.down_proj"][e] @ h)
    sp = p + "shared_expert."
    sh = (torch.nn.functional.silu(u @ w[sp + "gate_proj.weight"].T) * (u @ w[sp + "up_proj.weight"].T)) @ w[sp + "down_proj.weight"].T
    return y + torch.sigmoid(u @ w[p + "shared_expert_gate.weight"].T) * sh, chosen


def forward(cfg, w, ids, emulate_topk):
    lm = "model.language_model."
    s, h = cfg["hc_count"], cfg["hidden_size"]
    x = w[lm + "embed_tokens.weight"][torch.tensor(ids)].repeat(1, s)
    extra = {"ple.ids": None, "sets": {}, "router": {}}
    layer_types = ["indexed_attention" if t in ("full_attention", "indexed_attention") else t
                   for t in cfg["layer_types"]]
    for i, kind in enumerate(layer_types):
        p = f"{lm}layers.{i}."
        if i + 1 in cfg["ple_layer_ids"]:
            add, rid = ple(cfg, w, p + "ple.", x, ids)
            x = x + add
            extra["ple.ids"] = rid
        u, inj = hc(w, p + "attn_hyper_connection.", x, cfg)
        if kind == "linear_attention":
            y = gdn(cfg, w, p + "linear_attn.", u)
        else:
            y, sets = attention(cfg, w, p + "self_attn.", u, emulate_topk)
            extra["sets"][f"layers.{i}"] = sets
        x = x + (inj[:, :, None] * y[:, None, :]).reshape(x.shape)
        u, inj = hc(w, p + "mlp_hyper_connection.", x, cfg)
        y, chosen = moe(cfg, w, p + "mlp.", u, emulate_topk)
        extra["router"][f"layers.{i}"] = chosen
        x = x + (inj[:, :, None] * y[:, None, :]).reshape(x.shape)
    u, _ = hc(w, lm + "hyper_connection_mixer.", x, cfg, inject=False)
    return u @ w["lm_head.weight"].T, extra


def main():
    dir_ = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/data/flashnext_toy")
    spec = importlib.util.spec_from_file_location("gen", Path(__file__).with_name("gen_flashnext_golden.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    cfg, w = load(dir_)
    meta = json.loads((dir_ / "golden/meta.json").read_text())
    indexer = json.loads((dir_ / "golden/indexer.json").read_text())
    ok = True
    for name in ("short", "long"):
        ids = meta["prompts"][name]["ids"]
        g = load_file(str(dir_ / f"golden/{name}.safetensors"))
        with torch.no_grad():
            logits, extra = forward(cfg, w, ids, gen.emulate_topk)
        diff = float((logits - g["logits"]).abs().max())
        ple_eq = torch.equal(extra["ple.ids"], g["layers.1.ple.ids"])
        sets_eq = all(extra["sets"][k] == v["blocks"] for k, v in indexer[name].items())
        router_eq = all(
            extra["router"][f"layers.{i}"] == [sorted(r) for r in g[f"layers.{i}.moe.topk_idx"].tolist()]
            for i in range(cfg["num_hidden_layers"])
        )
        print(f"{name}: max |Δlogit| {diff:.3e}, PLE ids equal {ple_eq}, indexer sets equal {sets_eq}, "
              f"router sets equal {router_eq}")
        ok &= diff < 1e-4 and ple_eq and sets_eq and router_eq
    if not ok:
        raise SystemExit("the notes' forward pass disagrees with the goldens")


if __name__ == "__main__":
    main()
