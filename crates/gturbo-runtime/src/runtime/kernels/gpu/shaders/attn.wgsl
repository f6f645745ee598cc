// Causal grouped-query attention over a GPU-side KV cache. Token i of the n new tokens
// sits at position p = pos0 + i and attends to cache rows first..=p, where first is 0,
// or max(0, p + 1 − window) with a sliding window; query head h reads KV head
// h / (heads / kv_heads). Keys and queries are qk_dim wide, values and the output
// v_dim. One workgroup per (token, head) walks the keys in blocks of WG with an online
// softmax (running max and sum, f32), so any context length fits in workgroup memory.
// Scores are q·k · scale. With sinks (one logit per query head, gpt-oss), the sink
// joins the denominator at the end: out = a / (l + e^(sink − m)), taken with the
// larger of m and the sink as the reference so neither exponential overflows.
//
// Split (`attention_part` then `attention_combine`, for long contexts): workgroup
// (token, head, c) walks positions first + c·chunk .. first + (c+1)·chunk only and
// writes its running max m_c, sum l_c and unnormalised output a_c to `part`; the
// combine takes M = max m_c and writes Σ_c e^(m_c − M) a_c / (Σ_c e^(m_c − M) l_c
// [+ e^(sink − M)]). Same arithmetic per chunk, so only the order of the sums differs
// from the one-workgroup walk.

struct Params {
    n: u32,
    heads: u32,
    kv_heads: u32,
    qk_dim: u32,
    v_dim: u32,
    pos0: u32,
    q_off: u32,
    out_off: u32,
    scale: f32,
    // Split: positions per `attention_part` workgroup, and chunks per (token, head).
    chunk: u32,
    chunks: u32,
    // Positions a query sees (0: all of them).
    window: u32,
    // 1: `sinks` holds one logit per query head; 0: no sinks (`sinks` is bound to
    // another buffer and never read).
    sinks: u32,
    // 1: values are each key head's first v_dim dims (`vc` is bound to the keys).
    v_in_k: u32,
    // The position of cache row 0: a window cache drops the rows no query sees again.
    kv_start: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
// `[capacity, kv_heads·qk_dim]` and `[capacity, kv_heads·v_dim]` (or the keys again,
// with v_in_k).
@group(0) @binding(2) var<storage, read> kc: array<f32>;
@group(0) @binding(3) var<storage, read> vc: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
// `[heads]` sink logits, read only when `p.sinks` is 1.
@group(0) @binding(6) var<storage, read> sinks: array<f32>;

const WG: u32 = 64u;
// DeepSeek-V3's latent cache reads keys of 576 (kv_lora_rank 512 + the 64-wide rope
// key) and values of 512 (the latent, inside the keys): the query sits in workgroup
// memory (4 KiB at 1024) and each lane keeps PER_LANE output values.
const MAX_HEAD_DIM: u32 = 1024u;
const PER_LANE: u32 = 8u; // values per lane: v_dim is at most WG · PER_LANE
// A finite stand-in for -inf: Metal may compile with fast math, where infinities are
// not guaranteed to compare or propagate.
const NEG_BIG: f32 = -3.0e38;

var<workgroup> qs: array<f32, MAX_HEAD_DIM>;
var<workgroup> pr: array<f32, 64>;
var<workgroup> red: array<f32, 64>;

// One workgroup's online softmax over positions lo .. hi of token `tok`'s head `h`
// (`qs` must hold the query): running max, sum and the unnormalised output for
// dimensions li + t·WG.
struct Attended {
    m: f32,
    l: f32,
    acc: array<f32, PER_LANE>,
}

fn load_query(li: u32, tok: u32, h: u32) {
    let qbase = p.q_off + (tok * p.heads + h) * p.qk_dim;
    for (var d = li; d < p.qk_dim; d += WG) { qs[d] = q[qbase + d]; }
    workgroupBarrier();
}

// The first position the query at position upto − 1 sees.
fn first_seen(upto: u32) -> u32 {
    if (p.window == 0u || upto <= p.window) { return 0u; }
    return upto - p.window;
}

// What multiplies the unnormalised output of head `h` whose walk ended with max `m`
// and sum `l`: 1 / l, or with a sink e^(m − M) / (l·e^(m − M) + e^(sink − M)), M the
// larger of m and the sink.
fn out_factor(h: u32, m: f32, l: f32) -> f32 {
    if (p.sinks == 0u) { return 1.0 / l; }
    let s = sinks[h];
    let mx = max(m, s);
    let c = exp(m - mx);
    return c / (l * c + exp(s - mx));
}

fn attend(li: u32, h: u32, lo: u32, hi: u32) -> Attended {
    let kvh = h / (p.heads / p.kv_heads);
    let hd = p.qk_dim;
    let kvw = p.kv_heads * hd;
    let vd = p.v_dim;
    var vw = p.kv_heads * vd;
    var vh = vd;
    if (p.v_in_k != 0u) {
        vw = kvw;
        vh = hd;
    }
    var m = NEG_BIG;
    var l = 0.0;
    var acc = array<f32, PER_LANE>();
    for (var j0 = lo; j0 < hi; j0 += WG) {
        let j = j0 + li;
        var sc = NEG_BIG;
        if (j < hi) {
            let kb = (j - p.kv_start) * kvw + kvh * hd;
            var dotv = 0.0;
            for (var d = 0u; d < hd; d++) { dotv += qs[d] * kc[kb + d]; }
            sc = dotv * p.scale;
        }
        let m_new = max(m, reduce_max(li, sc));
        let corr = exp(m - m_new);
        let pj = select(0.0, exp(sc - m_new), j < hi);
        pr[li] = pj;
        l = l * corr + reduce_sum(li, pj);
        let cnt = min(WG, hi - j0);
        for (var t = 0u; t < PER_LANE; t++) {
            let d = li + t * WG;
            if (d < vd) {
                var a = acc[t] * corr;
                for (var jj = 0u; jj < cnt; jj++) {
                    a += pr[jj] * vc[(j0 + jj - p.kv_start) * vw + kvh * vh + d];
                }
                acc[t] = a;
            }
        }
        m = m_new;
        workgroupBarrier();
    }
    return Attended(m, l, acc);
}

@compute @workgroup_size(64)
fn attention(@builtin(workgroup_id) wid: vec3<u32>,
             @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) li: u32) {
    let lin = wid.x + wid.y * nwg.x;
    if (lin >= p.n * p.heads) { return; }
    let tok = lin / p.heads;
    let h = lin % p.heads;
    load_query(li, tok, h);
    let upto = p.pos0 + tok + 1u;
    let r = attend(li, h, first_seen(upto), upto);
    let obase = p.out_off + (tok * p.heads + h) * p.v_dim;
    let inv = out_factor(h, r.m, r.l);
    for (var t = 0u; t < PER_LANE; t++) {
        let d = li + t * WG;
        if (d < p.v_dim) { out[obase + d] = r.acc[t] * inv; }
    }
}

// `[n · heads · chunks, 2 + v_dim]`: m, l, then the unnormalised output.
@group(0) @binding(5) var<storage, read_write> part: array<f32>;

@compute @workgroup_size(64)
fn attention_part(@builtin(workgroup_id) wid: vec3<u32>,
                  @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) li: u32) {
    let lin = wid.x + wid.y * nwg.x;
    if (lin >= p.n * p.heads * p.chunks) { return; }
    let th = lin / p.chunks;
    let c = lin % p.chunks;
    let tok = th / p.heads;
    let h = th % p.heads;
    let upto = p.pos0 + tok + 1u;
    let lo = min(first_seen(upto) + c * p.chunk, upto);
    let hi = min(lo + p.chunk, upto);
    load_query(li, tok, h);
    // A chunk past the token's last position gives m = NEG_BIG, l = 0, a = 0.
    let r = attend(li, h, lo, hi);
    let base = lin * (2u + p.v_dim);
    if (li == 0u) {
        part[base] = r.m;
        part[base + 1u] = r.l;
    }
    for (var t = 0u; t < PER_LANE; t++) {
        let d = li + t * WG;
        if (d < p.v_dim) { part[base + 2u + d] = r.acc[t]; }
    }
}

@compute @workgroup_size(64)
fn attention_combine(@builtin(workgroup_id) wid: vec3<u32>,
                     @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) li: u32) {
    let th = wid.x + wid.y * nwg.x;
    if (th >= p.n * p.heads) { return; }
    let stride = 2u + p.v_dim;
    let base = th * p.chunks * stride;
    var mx = NEG_BIG;
    for (var c = 0u; c < p.chunks; c++) { mx = max(mx, part[base + c * stride]); }
    var l = 0.0;
    var acc = array<f32, PER_LANE>();
    for (var c = 0u; c < p.chunks; c++) {
        let b = base + c * stride;
        let e = exp(part[b] - mx);
        l += e * part[b + 1u];
        for (var t = 0u; t < PER_LANE; t++) {
            let d = li + t * WG;
            if (d < p.v_dim) { acc[t] += e * part[b + 2u + d]; }
        }
    }
    let obase = p.out_off + th * p.v_dim;
    let inv = out_factor(th % p.heads, mx, l);
    for (var t = 0u; t < PER_LANE; t++) {
        let d = li + t * WG;
        if (d < p.v_dim) { out[obase + d] = acc[t] * inv; }
    }
}
