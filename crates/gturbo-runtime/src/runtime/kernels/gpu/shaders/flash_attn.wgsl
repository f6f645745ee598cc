// Attention over the indexer's selection (`FlashOps::indexed_attention`). Token i of
// the n new ones sits at p = pos0 + i; it reads the tokens of its selected blocks
// (`sel[offs[i] .. offs[i + 1]]`, ascending block ids), then its incomplete tail block
// `nb·cr ..= p` (nb = (p + 1) / cr), in that order; query head h reads KV head
// h / (heads / kv_heads). One workgroup per (token, head) walks those keys in chunks of
// WG with an online softmax (running max and sum, f32), as `attn.wgsl` does over a
// contiguous range. Scores are q·k · scale. A query with no key at all (nothing
// selected and no tail) gets zeros, as the CPU's empty softmax does.

struct Params {
    n: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    pos0: u32,
    cr: u32,
    scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
// `[capacity, kv_heads·head_dim]` each.
@group(0) @binding(2) var<storage, read> kc: array<f32>;
@group(0) @binding(3) var<storage, read> vc: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
// Selected blocks of every token, flattened, and where each token's start (`[n + 1]`).
@group(0) @binding(5) var<storage, read> sel: array<u32>;
@group(0) @binding(6) var<storage, read> offs: array<u32>;

const WG: u32 = 64u;
const PER_LANE: u32 = 4u; // the largest head (256) / WG
// A finite stand-in for -inf (Metal's fast math does not guarantee infinities).
const NEG_BIG: f32 = -3.0e38;

var<workgroup> qs: array<f32, 256>;
var<workgroup> pr: array<f32, 64>;
var<workgroup> kpos: array<u32, 64>;
var<workgroup> red: array<f32, 64>;

@compute @workgroup_size(64)
fn indexed_attention(@builtin(workgroup_id) wid: vec3<u32>,
                     @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) li: u32) {
    let lin = wid.x + wid.y * nwg.x;
    if (lin >= p.n * p.heads) { return; }
    let tok = lin / p.heads;
    let h = lin % p.heads;
    let kvh = h / (p.heads / p.kv_heads);
    let hd = p.head_dim;
    let kvw = p.kv_heads * hd;
    let qbase = (tok * p.heads + h) * hd;
    for (var d = li; d < hd; d += WG) { qs[d] = q[qbase + d]; }
    workgroupBarrier();
    let pos = p.pos0 + tok;
    let tail = (pos + 1u) / p.cr * p.cr;
    let s0 = offs[tok];
    let picked = (offs[tok + 1u] - s0) * p.cr;
    let count = picked + pos + 1u - tail;
    var m = NEG_BIG;
    var l = 0.0;
    var acc = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
    for (var j0 = 0u; j0 < count; j0 += WG) {
        let j = j0 + li;
        var sc = NEG_BIG;
        if (j < count) {
            var kp: u32;
            if (j < picked) {
                kp = sel[s0 + j / p.cr] * p.cr + j % p.cr;
            } else {
                kp = tail + (j - picked);
            }
            kpos[li] = kp;
            let kb = kp * kvw + kvh * hd;
            var dotv = 0.0;
            for (var d = 0u; d < hd; d++) { dotv += qs[d] * kc[kb + d]; }
            sc = dotv * p.scale;
        }
        let m_new = max(m, reduce_max(li, sc));
        let corr = exp(m - m_new);
        let pj = select(0.0, exp(sc - m_new), j < count);
        pr[li] = pj;
        l = l * corr + reduce_sum(li, pj);
        let cnt = min(WG, count - j0);
        for (var t = 0u; t < PER_LANE; t++) {
            let d = li + t * WG;
            if (d < hd) {
                var a = acc[t] * corr;
                for (var jj = 0u; jj < cnt; jj++) {
                    a += pr[jj] * vc[kpos[jj] * kvw + kvh * hd + d];
                }
                acc[t] = a;
            }
        }
        m = m_new;
        workgroupBarrier();
    }
    let obase = (tok * p.heads + h) * hd;
    var inv = 0.0;
    if (l > 0.0) { inv = 1.0 / l; }
    for (var t = 0u; t < PER_LANE; t++) {
        let d = li + t * WG;
        if (d < hd) { out[obase + d] = acc[t] * inv; }
    }
}
