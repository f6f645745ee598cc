// Float matrix-vector (decode) and matrix-matrix (prefill) products: the matrix is
// f32, BF16 or IEEE half, read from u32 words (WGSL has no 16-bit storage type without
// `shader-f16`, so 16-bit elements are unpacked from their word with integer ops). f32 accumulation.

// 0: f32, 1: BF16, 2: F16.
override DTYPE: u32 = 1u;

struct Params {
    rows: u32,
    cols: u32,
    n: u32,
    d_off: u32,
    x_off: u32,
    y_off: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
// Elements at index `d_off` on: words for f32, half-words for BF16 and F16.
@group(0) @binding(1) var<storage, read> mat: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

// IEEE half bits to f32, exactly, with integer operations only: `unpack2x16float`
// needs naga's FLOAT16_IN_FLOAT32 capability, which not every backend reports.
fn f16_to_f32(h: u32) -> f32 {
    let sign = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    if (e == 0u) {
        // Zero and subnormals: m · 2^-24, exact in f32.
        let v = f32(m) * 5.9604644775390625e-8;
        return bitcast<f32>(bitcast<u32>(v) | sign);
    }
    if (e == 31u) {
        return bitcast<f32>(sign | 0x7f800000u | (m << 13u));
    }
    return bitcast<f32>(sign | ((e + 112u) << 23u) | (m << 13u));
}

fn elem(i: u32) -> f32 {
    if (DTYPE == 0u) {
        return bitcast<f32>(mat[i]);
    }
    let h = (mat[i >> 1u] >> ((i & 1u) * 16u)) & 0xffffu;
    if (DTYPE == 1u) {
        return bitcast<f32>(h << 16u);
    }
    return f16_to_f32(h);
}

const LANES: u32 = 32u;
const ROWS: u32 = 8u;
var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn fmatvec(@builtin(workgroup_id) wid: vec3<u32>,
           @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) li: u32) {
    let blocks = (p.rows + ROWS - 1u) / ROWS;
    let lin = wid.x + wid.y * nwg.x;
    if (lin >= blocks * p.n) { return; }
    let tok = lin / blocks;
    let row = (lin % blocks) * ROWS + li / LANES;
    let lane = li % LANES;
    var acc = 0.0;
    if (row < p.rows) {
        let base = p.d_off + row * p.cols;
        let xbase = p.x_off + tok * p.cols;
        for (var c = lane; c < p.cols; c += LANES) {
            acc += elem(base + c) * x[xbase + c];
        }
    }
    red[li] = acc;
    workgroupBarrier();
    for (var s = LANES / 2u; s > 0u; s >>= 1u) {
        if (lane < s) { red[li] += red[li + s]; }
        workgroupBarrier();
    }
    if (lane == 0u && row < p.rows) {
        y[p.y_off + tok * p.rows + row] = red[li];
    }
}

// Tiled product for n > 1 tokens: TR rows × TN tokens per workgroup, columns walked in
// chunks of KC through workgroup memory.
const TR: u32 = 8u;
const TN: u32 = 8u;
const KC: u32 = 64u;
var<workgroup> wt: array<f32, 512>; // TR × KC
var<workgroup> xt: array<f32, 512>; // TN × KC

@compute @workgroup_size(64)
fn fmatmul(@builtin(workgroup_id) wid: vec3<u32>,
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
    var acc = 0.0;
    for (var c0 = 0u; c0 < p.cols; c0 += KC) {
        for (var i = li; i < TR * KC; i += 64u) {
            let row = min(r0 + i / KC, p.rows - 1u);
            let c = c0 + i % KC;
            wt[i] = select(0.0, elem(p.d_off + row * p.cols + min(c, p.cols - 1u)), c < p.cols);
            let tok = min(t0 + i / KC, p.n - 1u);
            xt[i] = select(0.0, x[p.x_off + tok * p.cols + min(c, p.cols - 1u)], c < p.cols);
        }
        workgroupBarrier();
        for (var k = 0u; k < KC; k++) {
            acc += wt[r * KC + k] * xt[t * KC + k];
        }
        workgroupBarrier();
    }
    if (r0 + r < p.rows && t0 + t < p.n) {
        y[p.y_off + (t0 + t) * p.rows + r0 + r] = acc;
    }
}
