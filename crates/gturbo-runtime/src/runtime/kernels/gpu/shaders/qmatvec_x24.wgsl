requires packed_4x8_integer_dot_product;

// The decode product of large 4-bit matrices in integer arithmetic: x is rounded to
// 24 bits per 32 values once (`pack_x24`), and each row's 32 codes of a 16-byte code
// word meet those values in packed 4 × 8-bit dot products (`dot4I8Packed`,
// `dot4U8Packed`: one instruction each on GPUs with IDP4A or its like), one per byte
// of x. The f32 kernel (`qmatvec_fast` in qmatvec.wgsl) spends most of its time in
// the float products at these sizes; this one takes about 1.5× a plain read of the
// codes on the H200 (docs/GPU.md), the f32 kernel 2.5×.
//
// Rounding: chunk c's step is h = max |x| / (2^23 − 1) over its 32 values, x24 =
// round(x / h) in ±(2^23 − 1), so |x − h·x24| ≤ h/2 = 2^-24 of the chunk's largest
// |x|: the size of an f32 product's own rounding, which is why 24 bits and not 16
// (x rounded to 16 bits, 2^-16, flipped a near-tie of SmolLM2's greedy tokens through
// its vocabulary head). Split x24 = 65536·b2 + 256·b1 + b0 (b2 signed, b1 and b0 in
// 0..255): Σ q·x24 = 65536·Σ q·b2 + 256·Σ q·b1 + Σ q·b0, each byte's sum an exact
// integer. A group contributes s·h·Σ q·x24 + b·Σ x (Σ x in f32 from the unrounded
// x), accumulated in f32 (the GPU numerics contract in gpu/mod.rs).

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
// Packed x, for `chunks = cols / 32` chunks, in words: bytes 2 of x24 [0, 8·chunks),
// bytes 1 [8·chunks, 16·chunks), bytes 0 [16·chunks, 24·chunks), then (h, Σ x) per
// chunk [24·chunks, 26·chunks). Chunk c's 8 words of one byte: the even codes'
// values (code 8j + 2i in byte i of word j), then the odd codes' (8j + 2i + 1),
// matching how a code word splits under the masks in `packed_dot`.
@group(0) @binding(5) var<storage, read_write> packed: array<u32>;
@group(0) @binding(6) var<storage, read> px4: array<vec4<u32>>;
@group(0) @binding(7) var<storage, read> pxs: array<vec2<f32>>;

// Four invocations per 32-value chunk of x, each packing 8 consecutive values (codes
// 8j .. 8j + 7 of a code word's word j: bytes of its even and its odd word); the
// chunk's largest |x| and Σ x meet in workgroup memory (64 invocations: 16 chunks).
var<workgroup> part_max: array<f32, 64>;
var<workgroup> part_sum: array<f32, 64>;

@compute @workgroup_size(64)
fn pack_x24(@builtin(global_invocation_id) gid: vec3<u32>,
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
    let inv = select(1.0, TOP / m, m > 0.0);
    // Bytes 2 (signed), 1 and 0 of the even and the odd codes' values.
    var e2 = 0u;
    var o2 = 0u;
    var e1 = 0u;
    var o1 = 0u;
    var e0 = 0u;
    var o0 = 0u;
    for (var i = 0u; i < 4u; i++) {
        let e = u32(i32(clamp(round(v[2u * i] * inv), -TOP, TOP)));
        let o = u32(i32(clamp(round(v[2u * i + 1u] * inv), -TOP, TOP)));
        let at = 8u * i;
        e2 |= ((e >> 16u) & 0xffu) << at;
        o2 |= ((o >> 16u) & 0xffu) << at;
        e1 |= ((e >> 8u) & 0xffu) << at;
        o1 |= ((o >> 8u) & 0xffu) << at;
        e0 |= (e & 0xffu) << at;
        o0 |= (o & 0xffu) << at;
    }
    let w = c * 8u + j;
    packed[w] = e2;
    packed[w + 4u] = o2;
    packed[8u * chunks + w] = e1;
    packed[8u * chunks + w + 4u] = o1;
    packed[16u * chunks + w] = e0;
    packed[16u * chunks + w + 4u] = o0;
    if (j == 0u) {
        let sx = (part_sum[q] + part_sum[q + 1u]) + (part_sum[q + 2u] + part_sum[q + 3u]);
        packed[24u * chunks + 2u * c] = bitcast<u32>(select(1.0, m / TOP, m > 0.0));
        packed[24u * chunks + 2u * c + 1u] = bitcast<u32>(sx);
    }
}

// x24's largest magnitude: 2^23 − 1, exact in f32.
const TOP: f32 = 8388607.0;

fn bf16_at(i: u32) -> f32 {
    let w = mat[i >> 1u];
    return bitcast<f32>(((w >> ((i & 1u) * 16u)) & 0xffffu) << 16u);
}

// Chunk c's packed x: bytes 2, 1, 0 of its even and odd codes' values, and (h, Σ x).
struct Px {
    e2: vec4<u32>,
    o2: vec4<u32>,
    e1: vec4<u32>,
    o1: vec4<u32>,
    e0: vec4<u32>,
    o0: vec4<u32>,
    hs: vec2<f32>,
}

fn px_at(chunks: u32, c: u32) -> Px {
    return Px(px4[2u * c], px4[2u * c + 1u],
              px4[2u * chunks + 2u * c], px4[2u * chunks + 2u * c + 1u],
              px4[4u * chunks + 2u * c], px4[4u * chunks + 2u * c + 1u],
              pxs[12u * chunks + c]);
}

// `acc` plus Σ q·b over the 32 codes of one byte plane of x (even codes in `ev`'s
// bytes, odd ones in `od`'s; `e`, `o` their values' bytes), unsigned or signed
// (`dot4I8Packed`): one chain, each dot product added onto the sum before it, so the
// GPU can fuse the add into its dot-product-accumulate instruction (integer sums: the
// order changes nothing). On the H200 the chain was 3–5 points of HBM faster than a
// tree of adds (docs/GPU.md).
fn plane_u(acc: u32, ev: vec4<u32>, od: vec4<u32>, e: vec4<u32>, o: vec4<u32>) -> u32 {
    var a = acc + dot4U8Packed(ev.x, e.x);
    a += dot4U8Packed(od.x, o.x);
    a += dot4U8Packed(ev.y, e.y);
    a += dot4U8Packed(od.y, o.y);
    a += dot4U8Packed(ev.z, e.z);
    a += dot4U8Packed(od.z, o.z);
    a += dot4U8Packed(ev.w, e.w);
    a += dot4U8Packed(od.w, o.w);
    return a;
}

fn plane_i(ev: vec4<u32>, od: vec4<u32>, e: vec4<u32>, o: vec4<u32>) -> i32 {
    var a = dot4I8Packed(ev.x, e.x);
    a += dot4I8Packed(od.x, o.x);
    a += dot4I8Packed(ev.y, e.y);
    a += dot4I8Packed(od.y, o.y);
    a += dot4I8Packed(ev.z, e.z);
    a += dot4I8Packed(od.z, o.z);
    a += dot4I8Packed(ev.w, e.w);
    a += dot4I8Packed(od.w, o.w);
    return a;
}

// Σ q·x24 over the 32 codes of code word `w`. Byte 1's sum is scaled by 256 before
// byte 0's terms join its chain (|256·Σ q·b1 + Σ q·b0| < 2^25, exact in u32); bytes 2
// (signed) are summed on their own. Two f32 roundings (2^-24 each): the low bytes' sum
// and the final sum.
fn packed_dot(w: vec4<u32>, x: Px) -> f32 {
    let m = vec4<u32>(0x0f0f0f0fu);
    let ev = w & m;
    let od = (w >> vec4<u32>(4u)) & m;
    let hi = plane_i(ev, od, x.e2, x.o2);
    let lo = plane_u(256u * plane_u(0u, ev, od, x.e1, x.o1), ev, od, x.e0, x.o0);
    return 65536.0 * f32(hi) + f32(lo);
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
        packed_dot(w0, x),
        packed_dot(w1, x),
        packed_dot(w2, x),
        packed_dot(w3, x),
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
fn qmatvec_x24(@builtin(workgroup_id) wid: vec3<u32>,
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
