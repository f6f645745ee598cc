// The QSA indexer's device half (`FlashOps::indexer_scores`); the selection itself is
// made on the host (torch.topk's tie rule).
// - pool: block b's key from its `cr` raw keys (`[*, di]`, no norm, no RoPE):
//   `mean_f32` (rows added in order, then divided by cr), the offset RMSNorm
//   `x̂ · (1 + w)`, then RoPE at position b·cr (rotate-half over the first 2·half dims,
//   cos and sin from the host-built table, as `rope.wgsl` reads it). One workgroup
//   per new block, blocks first .. first + n.
// - scores: for each new token t (at pos0 + t) and block b below nb, with the query's
//   complete blocks nvis = (pos0 + t + 1) / cr: `Σ_h relu(q_h · key_b) / scale` for
//   b < nvis (scale = √di as the host computes it), 0 past them (the host reads only
//   the first nvis). One invocation per (token, block).

struct Params {
    // pool: new blocks; scores: new tokens.
    n: u32,
    di: u32,
    // Query heads (scores).
    ni: u32,
    cr: u32,
    // First new block (pool).
    first: u32,
    // Position of the first new token (scores).
    pos0: u32,
    // Blocks scored per token (scores): (pos0 + n) / cr.
    nb: u32,
    // Rotated pairs per key (pool).
    half: u32,
    eps: f32,
    scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> raw: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
// cos then sin per (position, pair).
@group(0) @binding(3) var<storage, read> table: array<f32>;
// Pooled block keys `[blocks, di]`.
@group(0) @binding(4) var<storage, read_write> blocks: array<f32>;
// The new tokens' queries `[n, ni, di]`, normed and rotated.
@group(0) @binding(5) var<storage, read> iq: array<f32>;
// `[n, nb]`.
@group(0) @binding(6) var<storage, read_write> sc: array<f32>;

const WG: u32 = 64u;
var<workgroup> ms: array<f32, 256>;
var<workgroup> red: array<f32, 64>;

@compute @workgroup_size(64)
fn pool(@builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let k = wid.x + wid.y * nwg.x;
    if (k >= p.n) { return; }
    let b = p.first + k;
    let base = b * p.cr * p.di;
    var ssq = 0.0;
    for (var e = li; e < p.di; e += WG) {
        var acc = 0.0;
        for (var r = 0u; r < p.cr; r++) {
            acc += raw[base + r * p.di + e];
        }
        let m = acc / f32(p.cr);
        ms[e] = m;
        ssq += m * m;
    }
    red[li] = ssq;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (li < s) { red[li] += red[li + s]; }
        workgroupBarrier();
    }
    let inv = 1.0 / sqrt(red[0] / f32(p.di) + p.eps);
    for (var e = li; e < p.di; e += WG) {
        ms[e] = ms[e] * inv * (1.0 + w[e]);
    }
    workgroupBarrier();
    let ob = b * p.di;
    let pos = b * p.cr;
    for (var i = li; i < p.half; i += WG) {
        let t = 2u * (pos * p.half + i);
        let c = table[t];
        let s = table[t + 1u];
        let x1 = ms[i];
        let x2 = ms[p.half + i];
        blocks[ob + i] = x1 * c - x2 * s;
        blocks[ob + p.half + i] = x2 * c + x1 * s;
    }
    for (var e = 2u * p.half + li; e < p.di; e += WG) {
        blocks[ob + e] = ms[e];
    }
}

@compute @workgroup_size(64)
fn scores(@builtin(global_invocation_id) gid: vec3<u32>,
          @builtin(num_workgroups) nwg: vec3<u32>) {
    let id = gid.x + gid.y * nwg.x * WG;
    if (id >= p.n * p.nb) { return; }
    let t = id / p.nb;
    let b = id % p.nb;
    let nvis = (p.pos0 + t + 1u) / p.cr;
    if (b >= nvis) {
        sc[id] = 0.0;
        return;
    }
    var s = 0.0;
    for (var h = 0u; h < p.ni; h++) {
        let qb = (t * p.ni + h) * p.di;
        var d = 0.0;
        for (var e = 0u; e < p.di; e++) {
            d += iq[qb + e] * blocks[b * p.di + e];
        }
        s += max(d, 0.0);
    }
    sc[id] = s / p.scale;
}
