requires packed_4x8_integer_dot_product;

// The decode product of large 4-bit matrices in integer arithmetic: x is rounded to
// 16 bits per 32 values once (`pack_x16`), and each row's 32 codes of a 16-byte code
// word meet those values in packed 4 × 8-bit dot products (`dot4I8Packed`,
// `dot4U8Packed`: one instruction each on GPUs with IDP4A or its like). The f32
// kernel (`qmatvec_fast` in qmatvec.wgsl) spends most of its time in the float
// products at these sizes; this one is bound by reading the codes.
//
// Rounding: chunk c's step is h = max |x| / 32767 over its 32 values, x16 = round(x /
// h) in [-32767, 32767], so |x − h·x16| ≤ h/2 = 2^-16 of the chunk's largest |x|.
// Split x16 = 256·hi + lo (hi signed, lo in 0..255): Σ q·x16 = 256·Σ q·hi + Σ q·lo,
// exact in i32 (|Σ| ≤ 32·15·32767 < 2^24). A group contributes s·h·Σ q·x16 + b·Σ x
// (Σ x in f32 from the unrounded x), accumulated in f32 (`# Arithmetic` in
// runtime/kernels/mod.rs says how this differs from the f32 path).

struct Params {
    rows: u32,
    cols: u32,
    w_off: u32,
    s_off: u32,
    b_off: u32,
    x_off: u32,
    y_off: u32,
}

override GROUP: u32 = 64u;
// Invocations per set of 4 rows (a power of two dividing 256).
override LANES: u32 = 32u;

@group(0) @binding(0) var<uniform> p: Params;
// The matrix: codes as 16-byte words from word `w_off`, BF16 scales and biases at
// half-words `s_off`, `b_off`.
@group(0) @binding(1) var<storage, read> mat: array<u32>;
@group(0) @binding(2) var<storage, read> mat4: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> x: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
// Packed x, for `chunks = cols / 32` chunks, in words: the high bytes [0, 8·chunks),
// the low bytes [8·chunks, 16·chunks), then (h, Σ x) per chunk [16·chunks,
// 18·chunks). Chunk c's 8 words of bytes: the even codes' values (code 8j + 2i in
// byte i of word j), then the odd codes' (8j + 2i + 1), matching how a code word
// splits under the masks in `packed_dot`.
@group(0) @binding(5) var<storage, read_write> packed: array<u32>;
@group(0) @binding(6) var<storage, read> px4: array<vec4<u32>>;
@group(0) @binding(7) var<storage, read> pxs: array<vec2<f32>>;

// Four invocations per 32-value chunk of x, each packing 8 consecutive values (codes
// 8j .. 8j + 7 of a code word's word j: bytes of its even and its odd word); the
// chunk's largest |x| and Σ x meet in workgroup memory (64 invocations: 16 chunks).
var<workgroup> part_max: array<f32, 64>;
var<workgroup> part_sum: array<f32, 64>;

@compute @workgroup_size(64)
fn pack_x16(@builtin(global_invocation_id) gid: vec3<u32>,
            @builtin(local_invocation_index) li: u32) {
    let chunks = p.cols / 32u;
    let c = gid.x / 4u;
    let j = gid.x % 4u;
    let live = c < chunks;
    let base = p.x_off + min(c, chunks - 1u) * 32u + 8u * j;
    var v: array<f32, 8>;
    var m = 0.0;
    for (var k = 0u; k < 8u; k++) {
        v[k] = x[base + k];
        m = max(m, abs(v[k]));
    }
    part_max[li] = m;
    part_sum[li] = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
    workgroupBarrier();
    let q = li & ~3u;
    m = max(max(part_max[q], part_max[q + 1u]), max(part_max[q + 2u], part_max[q + 3u]));
    if (!live) { return; }
    let inv = select(1.0, 32767.0 / m, m > 0.0);
    var he = 0u;
    var ho = 0u;
    var le = 0u;
    var lo = 0u;
    for (var i = 0u; i < 4u; i++) {
        let e = i32(clamp(round(v[2u * i] * inv), -32767.0, 32767.0));
        let o = i32(clamp(round(v[2u * i + 1u] * inv), -32767.0, 32767.0));
        he |= (u32(e >> 8u) & 0xffu) << (8u * i);
        ho |= (u32(o >> 8u) & 0xffu) << (8u * i);
        le |= (u32(e) & 0xffu) << (8u * i);
        lo |= (u32(o) & 0xffu) << (8u * i);
    }
    let w = c * 8u + j;
    packed[w] = he;
    packed[w + 4u] = ho;
    packed[8u * chunks + w] = le;
    packed[8u * chunks + w + 4u] = lo;
    if (j == 0u) {
        let sx = (part_sum[q] + part_sum[q + 1u]) + (part_sum[q + 2u] + part_sum[q + 3u]);
        packed[16u * chunks + 2u * c] = bitcast<u32>(select(1.0, m / 32767.0, m > 0.0));
        packed[16u * chunks + 2u * c + 1u] = bitcast<u32>(sx);
    }
}

fn bf16_at(i: u32) -> f32 {
    let w = mat[i >> 1u];
    return bitcast<f32>(((w >> ((i & 1u) * 16u)) & 0xffffu) << 16u);
}

// Chunk c's packed x: high and low bytes of its even and odd codes' values, and
// (h, Σ x).
struct Px {
    he: vec4<u32>,
    ho: vec4<u32>,
    le: vec4<u32>,
    lo: vec4<u32>,
    hs: vec2<f32>,
}

fn px_at(chunks: u32, c: u32) -> Px {
    return Px(px4[2u * c], px4[2u * c + 1u], px4[2u * chunks + 2u * c],
              px4[2u * chunks + 2u * c + 1u], pxs[8u * chunks + c]);
}

// Σ q·x16 over the 32 codes of code word `w`.
fn packed_dot(w: vec4<u32>, x: Px) -> i32 {
    let m = vec4<u32>(0x0f0f0f0fu);
    let ev = w & m;
    let od = (w >> vec4<u32>(4u)) & m;
    let h = ((dot4I8Packed(ev.x, x.he.x) + dot4I8Packed(od.x, x.ho.x))
        + (dot4I8Packed(ev.y, x.he.y) + dot4I8Packed(od.y, x.ho.y)))
        + ((dot4I8Packed(ev.z, x.he.z) + dot4I8Packed(od.z, x.ho.z))
        + (dot4I8Packed(ev.w, x.he.w) + dot4I8Packed(od.w, x.ho.w)));
    let l = ((dot4U8Packed(ev.x, x.le.x) + dot4U8Packed(od.x, x.lo.x))
        + (dot4U8Packed(ev.y, x.le.y) + dot4U8Packed(od.y, x.lo.y)))
        + ((dot4U8Packed(ev.z, x.le.z) + dot4U8Packed(od.z, x.lo.z))
        + (dot4U8Packed(ev.w, x.le.w) + dot4U8Packed(od.w, x.lo.w)));
    return 256 * h + i32(l);
}

var<workgroup> red: array<f32, 1024>;

// Code word c's contribution to 4 rows (indices already clamped to the matrix).
fn rows4(r: vec4<u32>, row_v: u32, groups: u32, c: u32, x: Px) -> vec4<f32> {
    let wb = p.w_off / 4u;
    let w0 = mat4[wb + r.x * row_v + c];
    let w1 = mat4[wb + r.y * row_v + c];
    let w2 = mat4[wb + r.z * row_v + c];
    let w3 = mat4[wb + r.w * row_v + c];
    let d = vec4<f32>(
        f32(packed_dot(w0, x)),
        f32(packed_dot(w1, x)),
        f32(packed_dot(w2, x)),
        f32(packed_dot(w3, x)),
    ) * x.hs.x;
    let g = c * 32u / GROUP;
    let gi = r * groups + vec4<u32>(g);
    let s = vec4<f32>(
        bf16_at(p.s_off + gi.x),
        bf16_at(p.s_off + gi.y),
        bf16_at(p.s_off + gi.z),
        bf16_at(p.s_off + gi.w),
    );
    let b = vec4<f32>(
        bf16_at(p.b_off + gi.x),
        bf16_at(p.b_off + gi.y),
        bf16_at(p.b_off + gi.z),
        bf16_at(p.b_off + gi.w),
    );
    return s * d + b * x.hs.y;
}

// A set of LANES invocations computes 4 rows; each takes one code word of each row per
// step (a set's lanes read consecutive words of a row, so loads coalesce), and the
// packed x of that word once for the 4. Partial sums meet in workgroup memory.
@compute @workgroup_size(256)
fn qmatvec_x16(@builtin(workgroup_id) wid: vec3<u32>,
               @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) li: u32) {
    let per_wg = 256u / LANES * 4u;
    let lin = wid.x + wid.y * nwg.x;
    // Whole workgroups return together, before any barrier.
    if (lin * per_wg >= p.rows) { return; }
    let lane = li % LANES;
    let row0 = lin * per_wg + li / LANES * 4u;
    let row_v = p.cols / 32u;
    let groups = p.cols / GROUP;
    let last = vec4<u32>(p.rows - 1u);
    let r = min(vec4<u32>(row0) + vec4<u32>(0u, 1u, 2u, 3u), last);
    var acc = vec4<f32>(0.0);
    for (var c = lane; c < row_v; c += LANES) {
        acc += rows4(r, row_v, groups, c, px_at(row_v, c));
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
        for (var k = 0u; k < 4u; k++) {
            if (row0 + k < p.rows) { y[p.y_off + row0 + k] = red[k * 256u + li]; }
        }
    }
}
