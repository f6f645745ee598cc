// matvec_lab: INT4 g64 codes against an 8-bit x through packed 4 × 8-bit dot products
// (`dot4I8Packed`: one instruction for four products where the GPU has it, as NVIDIA's
// IDP4A). Not the product's arithmetic: x is rounded to 8 bits per 32-code chunk (on
// the host here), so the result differs from the f32 product by x's rounding; the lab
// prints that difference beside the time.
//
// A code word (u32) holds codes 0..7 at bits 4k: `w & 0x0f0f0f0f` has codes 0, 2, 4, 6
// in its bytes and `(w >> 4) & 0x0f0f0f0f` codes 1, 3, 5, 7, so x comes packed the
// same way: per 32-code chunk, one vec4 of the even codes' x bytes, one of the odd.
requires packed_4x8_integer_dot_product;

struct Params {
    rows: u32,
    cols: u32,
    w_off: u32,
    s_off: u32,
    b_off: u32,
    never: u32,
    pad0: u32,
    pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> mat: array<u32>;
@group(0) @binding(2) var<storage, read> mat4: array<vec4<u32>>;
// Chunk c: xq[2c] the even codes' x, xq[2c + 1] the odd codes', 4 signed bytes a word.
@group(0) @binding(3) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
// Chunk c: (the step x was rounded to, the exact Σ x).
@group(0) @binding(5) var<storage, read> xs: array<vec2<f32>>;

override LANES: u32 = 32u;

fn bf16_at(i: u32) -> f32 {
    let w = mat[i >> 1u];
    return bitcast<f32>(((w >> ((i & 1u) * 16u)) & 0xffffu) << 16u);
}

// Σ q·xq over the 32 codes of `w` (integers, exact).
fn wdot(w: vec4<u32>, e: vec4<u32>, o: vec4<u32>) -> i32 {
    let m = vec4<u32>(0x0f0f0f0fu);
    let lo = w & m;
    let hi = (w >> vec4<u32>(4u)) & m;
    return ((dot4I8Packed(lo.x, e.x) + dot4I8Packed(hi.x, o.x))
        + (dot4I8Packed(lo.y, e.y) + dot4I8Packed(hi.y, o.y)))
        + ((dot4I8Packed(lo.z, e.z) + dot4I8Packed(hi.z, o.z))
        + (dot4I8Packed(lo.w, e.w) + dot4I8Packed(hi.w, o.w)));
}

fn word(row: u32, row_v: u32, vi: u32) -> vec4<u32> {
    return mat4[p.w_off / 4u + min(row, p.rows - 1u) * row_v + vi];
}

fn sb(row: u32, groups: u32, g: u32) -> vec2<f32> {
    let i = min(row, p.rows - 1u) * groups + g;
    return vec2<f32>(bf16_at(p.s_off + i), bf16_at(p.b_off + i));
}

var<workgroup> red: array<f32, 1024>;

// As the product's qmatvec_fast at RPS 4: a set of LANES lanes computes 4 rows, each
// lane one 16-byte code word of each row per step.
@compute @workgroup_size(256)
fn dp4a(@builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let sets = 256u / LANES;
    let per_wg = sets * 4u;
    let blocks = (p.rows + per_wg - 1u) / per_wg;
    let lin = wid.x + wid.y * nwg.x;
    if (lin >= blocks) { return; }
    let rset = li / LANES;
    let lane = li % LANES;
    let row0 = lin * per_wg + rset * 4u;
    let row_v = p.cols / 32u;
    let groups = p.cols / 64u;
    var acc = vec4<f32>(0.0);
    for (var vi = lane; vi < row_v; vi += LANES) {
        let w0 = word(row0, row_v, vi);
        let w1 = word(row0 + 1u, row_v, vi);
        let w2 = word(row0 + 2u, row_v, vi);
        let w3 = word(row0 + 3u, row_v, vi);
        let e = xq[2u * vi];
        let o = xq[2u * vi + 1u];
        let c = xs[vi];
        let g = vi / 2u;
        let d = vec4<f32>(
            f32(wdot(w0, e, o)),
            f32(wdot(w1, e, o)),
            f32(wdot(w2, e, o)),
            f32(wdot(w3, e, o)),
        ) * c.x;
        let s0 = sb(row0, groups, g);
        let s1 = sb(row0 + 1u, groups, g);
        let s2 = sb(row0 + 2u, groups, g);
        let s3 = sb(row0 + 3u, groups, g);
        acc += vec4<f32>(s0.x, s1.x, s2.x, s3.x) * d + vec4<f32>(s0.y, s1.y, s2.y, s3.y) * c.y;
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
        if (row0 < p.rows) { y[row0] = red[li]; }
        if (row0 + 1u < p.rows) { y[row0 + 1u] = red[256u + li]; }
        if (row0 + 2u < p.rows) { y[row0 + 2u] = red[512u + li]; }
        if (row0 + 3u < p.rows) { y[row0 + 3u] = red[768u + li]; }
    }
}
