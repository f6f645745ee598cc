// Affine-quantized matrix-vector (decode) and matrix-matrix (prefill) products over
// MLX's layout: each row's codes are a dense little-endian bit stream over u32 words
// (code k at bits BITS·k .. BITS·k + BITS of the row, so 3-, 5- and 6-bit codes
// straddle words), BF16 scale and bias per group of GROUP codes. Each group
// contributes s·Σ q·x + b·Σ x, accumulated in f32 (`# Arithmetic` in
// runtime/kernels/mod.rs).
//
// Codes become floats without an integer-to-float conversion (a slow instruction on
// many GPUs): `bitcast<f32>(0x4B000000 | v) − 2^23` is exactly v for v < 2^23.

override BITS: u32 = 4u;
override GROUP: u32 = 64u;
// `qmatvec_fast`: invocations per row set (a power of two dividing 256) and rows per
// set, so a workgroup computes (256 / LANES) · RPS rows.
override LANES: u32 = 32u;
override RPS: u32 = 2u;
// `qmatvec_fast`: 1 fuses SwiGLU: the set's two rows are row r of the gate (binding
// 4) and row r of the up projection (binding 6), and y[r] = silu(gate·x) · (up·x).
override GLU: u32 = 0u;
// `qmatvec_fast` over routed experts held in one buffer (expert e's matrix `e_stride`
// words after expert 0's): 0 off; 1: product `i` (of n·moe_k) is expert `ids[i]` on
// x row `i / moe_k` (gate/up); 2: expert `ids[i]` on x row `i` (down). Output row
// block `i` either way.
override MOE: u32 = 0u;

struct Params {
    rows: u32,
    cols: u32,
    n: u32,
    w_off: u32,
    s_off: u32,
    b_off: u32,
    x_off: u32,
    y_off: u32,
    // The second matrix of the fused SwiGLU (`GLU = 1`): codes, scales, biases.
    w2_off: u32,
    s2_off: u32,
    b2_off: u32,
    // Routed experts (`MOE`, `moe_combine`): experts per token, words between experts.
    moe_k: u32,
    e_stride: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
// The matrix buffer: codes at word `w_off`, scales and biases at half-word (BF16)
// indices `s_off` and `b_off`.
@group(0) @binding(1) var<storage, read> mat: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

const MAGIC: u32 = 0x4B000000u;
const TWO23: f32 = 8388608.0;

fn mask() -> u32 { return (1u << BITS) - 1u; }

fn code_f32(v: u32) -> f32 { return bitcast<f32>(MAGIC | v) - TWO23; }

// BF16 element `i` (a half-word index) of `mat`.
fn bf16_at(i: u32) -> f32 {
    let w = mat[i >> 1u];
    return bitcast<f32>(((w >> ((i & 1u) * 16u)) & 0xffffu) << 16u);
}

// Code `k` of the bit stream starting at word `base` of `mat` (any width).
fn code_at(base: u32, k: u32) -> u32 {
    let o = k * BITS;
    let wi = base + (o >> 5u);
    let sh = o & 31u;
    var v = mat[wi] >> sh;
    if (sh + BITS > 32u) { v |= mat[wi + 1u] << (32u - sh); }
    return v & mask();
}

var<workgroup> red: array<f32, 1024>;

// Any width and group: one row per 32 invocations, each taking 32-code chunks (BITS
// words) in turn, then a tree sum. The fallback of `qmatvec_fast`.
@compute @workgroup_size(256)
fn qmatvec(@builtin(workgroup_id) wid: vec3<u32>,
           @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) li: u32) {
    let blocks = (p.rows + 7u) / 8u;
    let lin = wid.x + wid.y * nwg.x;
    if (lin >= blocks * p.n) { return; }
    let tok = lin / blocks;
    let row = (lin % blocks) * 8u + li / 32u;
    let lane = li % 32u;
    let row_words = p.cols * BITS / 32u;
    let groups = p.cols / GROUP;
    let chunks = p.cols / 32u;
    var acc = 0.0;
    if (row < p.rows) {
        let wbase = p.w_off + row * row_words;
        let xbase = p.x_off + tok * p.cols;
        for (var c = lane; c < chunks; c += 32u) {
            let cb = wbase + c * BITS;
            let x0 = xbase + c * 32u;
            var dq = 0.0;
            var sx = 0.0;
            for (var k = 0u; k < 32u; k++) {
                let xv = x[x0 + k];
                dq += code_f32(code_at(cb, k)) * xv;
                sx += xv;
            }
            let g = row * groups + c * 32u / GROUP;
            acc += bf16_at(p.s_off + g) * dq + bf16_at(p.b_off + g) * sx;
        }
    }
    red[li] = acc;
    workgroupBarrier();
    for (var s = 16u; s > 0u; s >>= 1u) {
        if (lane < s) { red[li] += red[li + s]; }
        workgroupBarrier();
    }
    if (lane == 0u && row < p.rows) {
        y[p.y_off + tok * p.rows + row] = red[li];
    }
}

// Widths dividing 16 (2, 4, 8) whose 16-byte code words lie inside one group: each
// lane reads one 16-byte code word of each of its set's RPS rows per step (a set's
// LANES lanes read LANES consecutive words of a row, so loads coalesce), all RPS
// loads issued before any is used, and the x values of that word once for the RPS
// rows. A code is taken out of its half-word without a shift: code k of a half-word
// h is `h & (mask << BITS·k)`, which is q·2^(BITS·k) (below 2^16, so exact through
// `code_f32`), multiplied by x·2^-(BITS·k) (an exact power-of-two scaling, so the
// product is q·x unless x·2^-(BITS·k) underflows, below 2^-112 · |x|'s smallest
// normal). Everything a lane holds is a scalar or a vector indexed by constants once
// the override loops unroll (no per-lane arrays that could live in local memory).
// Partial sums meet in workgroup memory. The host's `qmatvec_fast_path` picks it.
@group(0) @binding(4) var<storage, read> mat4: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read> x4: array<vec4<f32>>;
// The up projection's buffer (`GLU = 1`; codes as vec4 words, scales as half-words).
@group(0) @binding(6) var<storage, read> up4: array<vec4<u32>>;
@group(0) @binding(7) var<storage, read> up: array<u32>;

fn up_bf16_at(i: u32) -> f32 {
    let w = up[i >> 1u];
    return bitcast<f32>(((w >> ((i & 1u) * 16u)) & 0xffffu) << 16u);
}

// The router's choice (`MOE`): `[n, moe_k]` expert ids and weights.
@group(0) @binding(8) var<storage, read> ids: array<u32>;
@group(0) @binding(9) var<storage, read> wts: array<f32>;

// Codes per half-word and 16-byte x vectors per code word (u32).
fn half_codes() -> u32 { return 16u / BITS; }
fn xv_per_word() -> u32 { return 8u / BITS; }

// Σ over codes 4v .. 4v+3 of the u32 code word `w` of q·x, where `xs` holds those
// codes' x already scaled by 2^-(BITS·k) for the code's place k in its half-word.
fn qdot(w: u32, v: u32, xs: vec4<f32>) -> f32 {
    let c = vec4<u32>(4u * v) + vec4<u32>(0u, 1u, 2u, 3u);
    let hc = vec4<u32>(half_codes());
    let src = select(vec4<u32>(w), vec4<u32>(w >> 16u), c >= hc);
    let m = vec4<u32>(mask()) << ((c % hc) * BITS);
    let f = bitcast<vec4<f32>>((src & m) | vec4<u32>(MAGIC)) - vec4<f32>(TWO23);
    return dot(f, xs);
}

// 2^-(BITS·k) for codes 4v .. 4v+3 of a word (k: place in the half-word).
fn xscale(v: u32) -> vec4<f32> {
    let c = vec4<u32>(4u * v) + vec4<u32>(0u, 1u, 2u, 3u);
    let k = c % vec4<u32>(half_codes());
    return bitcast<vec4<f32>>((vec4<u32>(127u) - k * BITS) << vec4<u32>(23u));
}

// Set row `r`'s code word `vi` (the GLU's row 1 is the up projection's row0).
fn fast_word(r: u32, row0: u32, eo: u32, row_v: u32, vi: u32) -> vec4<u32> {
    if (GLU == 1u && r == 1u) {
        return up4[(p.w2_off + eo) / 4u + row0 * row_v + vi];
    }
    let row = min(row0 + r, p.rows - 1u);
    return mat4[(p.w_off + eo) / 4u + row * row_v + vi];
}

// Set row `r`'s scale and bias for group `g`.
fn fast_sb(r: u32, row0: u32, eo: u32, groups: u32, g: u32) -> vec2<f32> {
    if (GLU == 1u && r == 1u) {
        let i = 2u * eo + row0 * groups + g;
        return vec2<f32>(up_bf16_at(p.s2_off + i), up_bf16_at(p.b2_off + i));
    }
    let i = 2u * eo + min(row0 + r, p.rows - 1u) * groups + g;
    return vec2<f32>(bf16_at(p.s_off + i), bf16_at(p.b_off + i));
}

// One u32 of each set row's code word against the x vectors it covers: Σ q·x per row
// (`dq`, rows past `rps` unused) and Σ x (`sx`).
struct Part {
    dq: vec4<f32>,
    sx: f32,
}

// x vector `v` of a u32 (at x4 index `xi`) against that u32 of each row (`a.x` is
// row 0's).
fn part(a: vec4<u32>, xi: u32, v: u32, rps: u32) -> Part {
    let xv = x4[xi];
    let xs = xv * xscale(v);
    var d = vec4<f32>(qdot(a.x, v, xs), 0.0, 0.0, 0.0);
    if (rps > 1u) { d.y = qdot(a.y, v, xs); }
    if (rps > 2u) { d.z = qdot(a.z, v, xs); }
    if (rps > 3u) { d.w = qdot(a.w, v, xs); }
    return Part(d, (xv.x + xv.y) + (xv.z + xv.w));
}

// A u32's `xv_per_word()` x vectors starting at x4 index `xi`. Written out rather
// than looped: wgpu puts a counter into every loop it translates, and with one there
// the driver no longer unrolled this (on an H200 the loops cost 30 % of the kernel's
// time: examples/matvec_lab.rs).
fn word_part(a: vec4<u32>, xi: u32, rps: u32) -> Part {
    var r = part(a, xi, 0u, rps);
    if (xv_per_word() > 1u) {
        let b = part(a, xi + 1u, 1u, rps);
        r = Part(r.dq + b.dq, r.sx + b.sx);
    }
    if (xv_per_word() > 2u) {
        let b = part(a, xi + 2u, 2u, rps);
        let c = part(a, xi + 3u, 3u, rps);
        r = Part(r.dq + (b.dq + c.dq), r.sx + (b.sx + c.sx));
    }
    return r;
}

@compute @workgroup_size(256)
fn qmatvec_fast(@builtin(workgroup_id) wid: vec3<u32>,
                @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) li: u32) {
    let sets = 256u / LANES;
    let rps = select(min(RPS, 4u), 2u, GLU == 1u);
    let out_rows = select(rps, 1u, GLU == 1u);
    let per_wg = sets * out_rows;
    let blocks = (p.rows + per_wg - 1u) / per_wg;
    let lin = wid.x + wid.y * nwg.x;
    if (lin >= blocks * p.n) { return; }
    let tok = lin / blocks;
    let rset = li / LANES;
    let lane = li % LANES;
    let row0 = (lin % blocks) * per_wg + rset * out_rows;
    let cpv = 128u / BITS;
    let row_v = p.cols / cpv;
    let groups = p.cols / GROUP;
    // Routed experts: which expert's matrix (a word offset) and which x row.
    var xrow = tok;
    var eo = 0u;
    if (MOE != 0u) {
        eo = ids[tok] * p.e_stride;
        if (MOE == 1u) { xrow = tok / p.moe_k; }
    }
    let xbase = (p.x_off + xrow * p.cols) / 4u;
    let xpw = xv_per_word();
    var acc = vec4<f32>(0.0);
    for (var vi = lane; vi < row_v; vi += LANES) {
        // Every row's code word first, so the loads are in flight together.
        let w0 = fast_word(0u, row0, eo, row_v, vi);
        var w1 = vec4<u32>(0u);
        var w2 = vec4<u32>(0u);
        var w3 = vec4<u32>(0u);
        if (rps > 1u) { w1 = fast_word(1u, row0, eo, row_v, vi); }
        if (rps > 2u) { w2 = fast_word(2u, row0, eo, row_v, vi); }
        if (rps > 3u) { w3 = fast_word(3u, row0, eo, row_v, vi); }
        let g = vi * cpv / GROUP;
        let xi = xbase + vi * 4u * xpw;
        let q0 = word_part(vec4<u32>(w0.x, w1.x, w2.x, w3.x), xi, rps);
        let q1 = word_part(vec4<u32>(w0.y, w1.y, w2.y, w3.y), xi + xpw, rps);
        let q2 = word_part(vec4<u32>(w0.z, w1.z, w2.z, w3.z), xi + 2u * xpw, rps);
        let q3 = word_part(vec4<u32>(w0.w, w1.w, w2.w, w3.w), xi + 3u * xpw, rps);
        let dq = (q0.dq + q1.dq) + (q2.dq + q3.dq);
        let sx = (q0.sx + q1.sx) + (q2.sx + q3.sx);
        let sb0 = fast_sb(0u, row0, eo, groups, g);
        acc.x += sb0.x * dq.x + sb0.y * sx;
        if (rps > 1u) {
            let sb = fast_sb(1u, row0, eo, groups, g);
            acc.y += sb.x * dq.y + sb.y * sx;
        }
        if (rps > 2u) {
            let sb = fast_sb(2u, row0, eo, groups, g);
            acc.z += sb.x * dq.z + sb.y * sx;
        }
        if (rps > 3u) {
            let sb = fast_sb(3u, row0, eo, groups, g);
            acc.w += sb.x * dq.w + sb.y * sx;
        }
    }
    // Rows named, not indexed (`acc[r]` in a loop the driver may not unroll would
    // make `acc` addressable memory for the whole kernel).
    red[li] = acc.x;
    if (rps > 1u) { red[256u + li] = acc.y; }
    if (rps > 2u) { red[512u + li] = acc.z; }
    if (rps > 3u) { red[768u + li] = acc.w; }
    workgroupBarrier();
    for (var s = LANES / 2u; s > 0u; s >>= 1u) {
        if (lane < s) {
            red[li] += red[li + s];
            if (rps > 1u) { red[256u + li] += red[256u + li + s]; }
            if (rps > 2u) { red[512u + li] += red[512u + li + s]; }
            if (rps > 3u) { red[768u + li] += red[768u + li + s]; }
        }
        workgroupBarrier();
    }
    if (lane == 0u) {
        if (GLU == 1u) {
            if (row0 < p.rows) {
                let gv = red[li];
                y[p.y_off + tok * p.rows + row0] = gv / (1.0 + exp(-gv)) * red[256u + li];
            }
        } else {
            for (var r = 0u; r < rps; r++) {
                if (row0 + r < p.rows) {
                    y[p.y_off + tok * p.rows + row0 + r] = red[r * 256u + li];
                }
            }
        }
    }
}

// The routed experts' sum: y row t = Σ_j wts[t·moe_k + j] · x row (t·moe_k + j), for
// `n` tokens of width `rows`, adding the experts in rank order.
@compute @workgroup_size(256)
fn moe_combine(@builtin(global_invocation_id) gid: vec3<u32>,
               @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= p.n * p.rows) { return; }
    let t = i / p.rows;
    let c = i % p.rows;
    var acc = 0.0;
    for (var j = 0u; j < p.moe_k; j++) {
        let pair = t * p.moe_k + j;
        acc += wts[pair] * x[p.x_off + pair * p.rows + c];
    }
    y[p.y_off + i] = acc;
}

// Tiled product for n > 1 tokens: a workgroup computes TR rows × TN tokens, one output
// per invocation, walking the columns one group at a time through workgroup memory
// (codes as f32 and the x chunk), so each code is read from memory once per tile.
const TR: u32 = 8u;
const TN: u32 = 8u;
const MAX_GROUP: u32 = 128u;
var<workgroup> wq: array<f32, 1024>; // TR × MAX_GROUP
var<workgroup> xt: array<f32, 1024>; // TN × MAX_GROUP
var<workgroup> sb: array<f32, 16>;   // TR scales then TR biases

@compute @workgroup_size(64)
fn qmatmul(@builtin(workgroup_id) wid: vec3<u32>,
           @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) li: u32) {
    let rblocks = (p.rows + TR - 1u) / TR;
    let nblocks = (p.n + TN - 1u) / TN;
    let lin = wid.x + wid.y * nwg.x;
    if (lin >= rblocks * nblocks) { return; }
    let r0 = (lin % rblocks) * TR;
    let t0 = (lin / rblocks) * TN;
    let r = li / TN;
    let t = li % TN;
    let row_words = p.cols * BITS / 32u;
    let groups = p.cols / GROUP;
    var acc = 0.0;
    for (var g = 0u; g < groups; g++) {
        // Codes of the TR rows for group g.
        for (var i = li; i < TR * GROUP; i += 64u) {
            let rr = i / GROUP;
            let k = i % GROUP;
            let row = min(r0 + rr, p.rows - 1u);
            wq[rr * GROUP + k] = code_f32(code_at(p.w_off + row * row_words, g * GROUP + k));
        }
        for (var i = li; i < TN * GROUP; i += 64u) {
            let tt = i / GROUP;
            let tok = min(t0 + tt, p.n - 1u);
            xt[i] = x[p.x_off + tok * p.cols + g * GROUP + i % GROUP];
        }
        if (li < TR) {
            let row = min(r0 + li, p.rows - 1u);
            sb[li] = bf16_at(p.s_off + row * groups + g);
            sb[TR + li] = bf16_at(p.b_off + row * groups + g);
        }
        workgroupBarrier();
        var dq = 0.0;
        var sx = 0.0;
        for (var k = 0u; k < GROUP; k++) {
            let xv = xt[t * GROUP + k];
            dq += wq[r * GROUP + k] * xv;
            sx += xv;
        }
        acc += sb[r] * dq + sb[TR + r] * sx;
        workgroupBarrier();
    }
    if (r0 + r < p.rows && t0 + t < p.n) {
        y[p.y_off + (t0 + t) * p.rows + r0 + r] = acc;
    }
}

// MXFP4 (MLX's `mxfp4` layout, gpt-oss's experts): each row's E2M1 codes are cols/2
// bytes from word `w_off` + row·cols/8 (element j in nibble j of its word, low nibble
// first), its E8M0 scales cols/32 bytes from byte `s_off` + row·cols/32 (WGSL has no
// u8: a scale byte is taken out of its word). Each group of 32 contributes
// 2^(e − 127) · Σ E2M1(q)·x, accumulated in f32, as the CPU's `matvec_mxfp4` does: E2M1
// values and power-of-two scales are exact in f32, so this agrees with "dequantize,
// then dot" to f32 rounding. One row per 32 invocations, a group per lane in turn,
// then a tree sum; every token of `n` (decode and prefill alike).

// The f32 value of E2M1 code `c` (sign in bit 3), built from its bits: magnitude
// codes 2..7 are 2^(e−1)·(1 + m/2) with e = bits 1..2, m = bit 0; code 1 is 0.5.
fn e2m1(c: u32) -> f32 {
    let e = (c >> 1u) & 3u;
    let m = c & 1u;
    let normal = ((e + 126u) << 23u) | (m << 22u);
    let sub = select(0u, 126u << 23u, m == 1u);
    return bitcast<f32>(select(sub, normal, e != 0u) | ((c & 8u) << 28u));
}

// 2^(e − 127) for scale byte e (0 is the subnormal 2^-127; 0xFF, NaN, is refused at
// install and load).
fn e8m0(e: u32) -> f32 {
    return select(bitcast<f32>(e << 23u), bitcast<f32>(1u << 22u), e == 0u);
}

@compute @workgroup_size(256)
fn mxfp4_matvec(@builtin(workgroup_id) wid: vec3<u32>,
                @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) li: u32) {
    let blocks = (p.rows + 7u) / 8u;
    let lin = wid.x + wid.y * nwg.x;
    if (lin >= blocks * p.n) { return; }
    let tok = lin / blocks;
    let row = (lin % blocks) * 8u + li / 32u;
    let lane = li % 32u;
    let groups = p.cols / 32u;
    var acc = 0.0;
    if (row < p.rows) {
        let wbase = p.w_off + row * groups * 4u;
        let sbase = p.s_off + row * groups;
        let xbase = p.x_off + tok * p.cols;
        for (var g = lane; g < groups; g += 32u) {
            var dq = 0.0;
            for (var wi = 0u; wi < 4u; wi++) {
                let w = mat[wbase + g * 4u + wi];
                let x0 = xbase + g * 32u + wi * 8u;
                for (var j = 0u; j < 8u; j++) {
                    dq += e2m1((w >> (4u * j)) & 0xfu) * x[x0 + j];
                }
            }
            let sb = sbase + g;
            acc += e8m0((mat[sb >> 2u] >> ((sb & 3u) * 8u)) & 0xffu) * dq;
        }
    }
    red[li] = acc;
    workgroupBarrier();
    for (var s = 16u; s > 0u; s >>= 1u) {
        if (lane < s) { red[li] += red[li + s]; }
        workgroupBarrier();
    }
    if (lane == 0u && row < p.rows) {
        y[p.y_off + tok * p.rows + row] = red[li];
    }
}
