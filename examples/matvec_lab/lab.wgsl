// Diagnostic kernels of the INT4 g64 matrix-vector lab (examples/matvec_lab.rs): where
// the fast kernel's time goes. Same layout as qmatvec.wgsl (codes at word w_off,
// BF16 scales and biases at half-words s_off, b_off of one buffer).

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
    if (RS == 2u) {
        workgroupBarrier();
        red[li] = acc2.x;
        red[256u + li] = acc2.y;
        red[512u + li] = acc2.z;
        red[768u + li] = acc2.w;
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
                if (row0 + 4u + r < p.rows) { y[row0 + 4u + r] = red[r * 256u + li]; }
            }
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
