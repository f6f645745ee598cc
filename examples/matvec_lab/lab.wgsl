// Diagnostic kernels of the INT4 g64 matrix-vector lab (examples/matvec_lab.rs): where
// a product kernel's time goes. The matrix as the product lays it out (codes at word
// w_off, BF16 scales and biases at half-words s_off, b_off of one buffer; Params'
// first five fields are qmatvec_x24.wgsl's), the arithmetic qmatvec_fast's exact f32
// (qmatvec.wgsl). The product kernels themselves are timed from their own files.

struct Params {
    rows: u32,
    cols: u32,
    w_off: u32,
    s_off: u32,
    b_off: u32,
    // Never true at run time (the host passes 0): keeps a result the compiler cannot
    // prove dead without making the kernel write it.
    never: u32,
    pad0: u32,
    pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> mat: array<u32>;
@group(0) @binding(2) var<storage, read> mat4: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> x4: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

override LANES: u32 = 32u;
// 0: the full product; 1: loads only (codes XORed, no x, no scales); 2: the product's
// arithmetic and x loads over synthesised codes (no code loads); 3: full product with
// two code words per row per step (more loads in flight).
override MODE: u32 = 0u;
// Groups of 4 rows per set (1 or 2): 2 puts 8 rows' code words in flight per lane and
// shares each x load among them.
override RS: u32 = 1u;

const MAGIC: u32 = 0x4B000000u;
const TWO23: f32 = 8388608.0;

fn bf16_at(i: u32) -> f32 {
    let w = mat[i >> 1u];
    return bitcast<f32>(((w >> ((i & 1u) * 16u)) & 0xffffu) << 16u);
}

// Codes 4v..4v+3 of word w (4-bit, 4 per half-word) dotted with x pre-scaled by 2^-4k.
fn qdot(w: u32, v: u32, xs: vec4<f32>) -> f32 {
    let src = select(w, w >> 16u, v >= 1u);
    let m = vec4<u32>(0xfu, 0xf0u, 0xf00u, 0xf000u);
    let f = bitcast<vec4<f32>>((vec4<u32>(src) & m) | vec4<u32>(MAGIC)) - vec4<f32>(TWO23);
    return dot(f, xs);
}

const XSCALE: vec4<f32> = vec4<f32>(1.0, 0.0625, 0.00390625, 0.000244140625);

var<workgroup> red: array<f32, 1024>;

fn word(row: u32, row_v: u32, vi: u32, r: u32) -> vec4<u32> {
    if (MODE == 2u) {
        return vec4<u32>(vi * 2654435761u + r, vi ^ r, vi + 77u * r, vi * 3u);
    }
    return mat4[p.w_off / 4u + min(row + r, p.rows - 1u) * row_v + vi];
}

fn sb(row: u32, r: u32, groups: u32, g: u32) -> vec2<f32> {
    let i = min(row + r, p.rows - 1u) * groups + g;
    return vec2<f32>(bf16_at(p.s_off + i), bf16_at(p.b_off + i));
}

// One step: code word vi of the set's 4 rows against its 32 x values.
fn step4(row0: u32, row_v: u32, groups: u32, vi: u32) -> vec4<f32> {
    let w0 = word(row0, row_v, vi, 0u);
    let w1 = word(row0, row_v, vi, 1u);
    let w2 = word(row0, row_v, vi, 2u);
    let w3 = word(row0, row_v, vi, 3u);
    var sx = 0.0;
    var dq = vec4<f32>(0.0);
    for (var j = 0u; j < 4u; j++) {
        for (var v = 0u; v < 2u; v++) {
            let xv = x4[(vi * 4u + j) * 2u + v];
            sx += (xv.x + xv.y) + (xv.z + xv.w);
            let xs = xv * XSCALE;
            dq.x += qdot(w0[j], v, xs);
            dq.y += qdot(w1[j], v, xs);
            dq.z += qdot(w2[j], v, xs);
            dq.w += qdot(w3[j], v, xs);
        }
    }
    let g = vi / 2u;
    let s0 = sb(row0, 0u, groups, g);
    let s1 = sb(row0, 1u, groups, g);
    let s2 = sb(row0, 2u, groups, g);
    let s3 = sb(row0, 3u, groups, g);
    return vec4<f32>(s0.x, s1.x, s2.x, s3.x) * dq + vec4<f32>(s0.y, s1.y, s2.y, s3.y) * sx;
}

// RPS is 4 here (the tiling the runtime picks at 8192 columns and more).
@compute @workgroup_size(256)
fn lab(@builtin(workgroup_id) wid: vec3<u32>,
       @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_index) li: u32) {
    let sets = 256u / LANES;
    let per_wg = sets * 4u * RS;
    let lin = wid.x + wid.y * nwg.x;
    if (lin * per_wg >= p.rows) { return; }
    let rset = li / LANES;
    let lane = li % LANES;
    let row0 = lin * per_wg + rset * 4u * RS;
    let row_v = p.cols / 32u;
    let groups = p.cols / 64u;
    if (MODE == 1u) {
        var a = vec4<u32>(0u);
        for (var vi = lane; vi < row_v; vi += LANES) {
            a ^= word(row0, row_v, vi, 0u) ^ word(row0, row_v, vi, 1u)
                ^ word(row0, row_v, vi, 2u) ^ word(row0, row_v, vi, 3u);
        }
        let s = a.x ^ a.y ^ a.z ^ a.w;
        if (p.never != 0u || s == 0x12345678u) { y[row0 + lane] = f32(s); }
        return;
    }
    var acc = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    if (RS == 2u) {
        for (var vi = lane; vi < row_v; vi += LANES) {
            acc += step4(row0, row_v, groups, vi);
            acc2 += step4(row0 + 4u, row_v, groups, vi);
        }
    } else if (MODE == 3u) {
        // Two steps per iteration: 8 code words in flight per lane.
        var vi = lane;
        for (; vi + LANES < row_v; vi += 2u * LANES) {
            acc += step4(row0, row_v, groups, vi) + step4(row0, row_v, groups, vi + LANES);
        }
        if (vi < row_v) { acc += step4(row0, row_v, groups, vi); }
    } else {
        for (var vi = lane; vi < row_v; vi += LANES) {
            acc += step4(row0, row_v, groups, vi);
        }
    }
    reduce4(acc, li, lane, row0);
    if (RS == 2u) {
        workgroupBarrier();
        reduce4(acc2, li, lane, row0 + 4u);
    }
}

// The set's 4 rows' partial sums (one per lane) summed over its LANES lanes and
// written to y[row0 ..].
fn reduce4(acc: vec4<f32>, li: u32, lane: u32, row0: u32) {
    red[li] = acc.x;
    red[256u + li] = acc.y;
    red[512u + li] = acc.z;
    red[768u + li] = acc.w;
    workgroupBarrier();
    for (var s = LANES / 2u; s > 0u; s >>= 1u) {
        if (lane < s) {
            red[li] += red[li + s];
            red[256u + li] += red[256u + li + s];
            red[512u + li] += red[512u + li + s];
            red[768u + li] += red[768u + li + s];
        }
        workgroupBarrier();
    }
    if (lane == 0u) {
        for (var r = 0u; r < 4u; r++) {
            if (row0 + r < p.rows) { y[row0 + r] = red[r * 256u + li]; }
        }
    }
}

// The read ceiling: every 16-byte word of the matrix once, grid-stride, XORed.
@compute @workgroup_size(256)
fn stream(@builtin(global_invocation_id) gid: vec3<u32>,
          @builtin(num_workgroups) nwg: vec3<u32>) {
    let n = p.rows * p.cols / 32u;
    let stride = nwg.x * 256u;
    var a = vec4<u32>(0u);
    for (var i = gid.x; i < n; i += stride) { a ^= mat4[p.w_off / 4u + i]; }
    let s = a.x ^ a.y ^ a.z ^ a.w;
    if (p.never != 0u || s == 0x12345678u) { y[gid.x % p.rows] = f32(s); }
}

// x in registers: lane c of a row's row_v = cols/32 lanes owns code word c of every
// row (row_v ≤ 256 dividing 256, so 256/row_v rows lie side by side), loads it and its
// 32 x values (scaled for the in-place code trick) once, and walks its workgroup's
// WG_ROWS rows 8 at a time: 8 code words in flight per lane, no x loads in the loop.
// Partials meet in workgroup memory, 8 values per lane per step.
override WG_ROWS: u32 = 32u;
var<workgroup> part8: array<f32, 2048>;
var<workgroup> part1: array<f32, 256>;

struct X8 {
    a: vec4<f32>, b: vec4<f32>, c: vec4<f32>, d: vec4<f32>,
    e: vec4<f32>, f: vec4<f32>, g: vec4<f32>, h: vec4<f32>,
}

fn wdot(w: vec4<u32>, x: X8) -> f32 {
    return ((qdot(w.x, 0u, x.a) + qdot(w.x, 1u, x.b)) + (qdot(w.y, 0u, x.c) + qdot(w.y, 1u, x.d)))
        + ((qdot(w.z, 0u, x.e) + qdot(w.z, 1u, x.f)) + (qdot(w.w, 0u, x.g) + qdot(w.w, 1u, x.h)));
}

fn hsum(v: vec4<f32>) -> f32 { return (v.x + v.y) + (v.z + v.w); }

fn col_part(row: u32, row_v: u32, groups: u32, c: u32, x: X8, sx: f32) -> f32 {
    let r = min(row, p.rows - 1u);
    let w = mat4[p.w_off / 4u + r * row_v + c];
    let i = r * groups + c / 2u;
    return bf16_at(p.s_off + i) * wdot(w, x) + bf16_at(p.b_off + i) * sx;
}

@compute @workgroup_size(256)
fn colmv(@builtin(workgroup_id) wid: vec3<u32>,
         @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) li: u32) {
    let row_v = p.cols / 32u;
    let side = 256u / row_v;
    let c = li % row_v;
    let sub = li / row_v;
    let groups = p.cols / 64u;
    let lin = wid.x + wid.y * nwg.x;
    let r_begin = lin * WG_ROWS;
    if (r_begin >= p.rows) { return; }
    let xb = c * 8u;
    let x0 = x4[xb];
    let x1 = x4[xb + 1u];
    let x2 = x4[xb + 2u];
    let x3 = x4[xb + 3u];
    let x5 = x4[xb + 5u];
    let x4_ = x4[xb + 4u];
    let x6 = x4[xb + 6u];
    let x7 = x4[xb + 7u];
    let sx = (hsum(x0) + hsum(x1) + hsum(x2) + hsum(x3)) + (hsum(x4_) + hsum(x5) + hsum(x6) + hsum(x7));
    let x = X8(x0 * XSCALE, x1 * XSCALE, x2 * XSCALE, x3 * XSCALE,
               x4_ * XSCALE, x5 * XSCALE, x6 * XSCALE, x7 * XSCALE);
    let chunk = 8u * side;
    for (var r0 = r_begin; r0 < r_begin + WG_ROWS; r0 += chunk) {
        let b = r0 + sub;
        part8[li] = col_part(b, row_v, groups, c, x, sx);
        part8[256u + li] = col_part(b + side, row_v, groups, c, x, sx);
        part8[512u + li] = col_part(b + 2u * side, row_v, groups, c, x, sx);
        part8[768u + li] = col_part(b + 3u * side, row_v, groups, c, x, sx);
        part8[1024u + li] = col_part(b + 4u * side, row_v, groups, c, x, sx);
        part8[1280u + li] = col_part(b + 5u * side, row_v, groups, c, x, sx);
        part8[1536u + li] = col_part(b + 6u * side, row_v, groups, c, x, sx);
        part8[1792u + li] = col_part(b + 7u * side, row_v, groups, c, x, sx);
        workgroupBarrier();
        // Row (k, sub) holds row_v consecutive partials at k·256 + sub·row_v: 8 of them
        // per lane, then 8 of those, then the rest (row_v/64 of them) per row.
        let o = li * 8u;
        part1[li] = ((part8[o] + part8[o + 1u]) + (part8[o + 2u] + part8[o + 3u]))
            + ((part8[o + 4u] + part8[o + 5u]) + (part8[o + 6u] + part8[o + 7u]));
        workgroupBarrier();
        if (li < 32u) {
            let q = li * 8u;
            part8[li] = ((part1[q] + part1[q + 1u]) + (part1[q + 2u] + part1[q + 3u]))
                + ((part1[q + 4u] + part1[q + 5u]) + (part1[q + 6u] + part1[q + 7u]));
        }
        workgroupBarrier();
        // 32 sums: row j (of chunk rows, in part8 order k·side + sub) has row_v/64 of
        // them, consecutive.
        let per = row_v / 64u;
        if (li < chunk) {
            var t = 0.0;
            for (var i = 0u; i < per; i++) { t += part8[li * per + i]; }
            // Entry order is k·side + sub; row = r0 + sub + side·k.
            let k = li / side;
            let s2 = li % side;
            let row = r0 + s2 + side * k;
            if (row < p.rows) { y[row] = t; }
        }
        workgroupBarrier();
    }
}
