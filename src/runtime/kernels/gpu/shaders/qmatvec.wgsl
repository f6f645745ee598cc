// Affine-quantized matrix-vector (decode) and matrix-matrix (prefill) products over
// MLX's layout: row r's codes are `row_words` little-endian u32 words, code k of a word
// at bits BITS·k; BF16 scale and bias per group of GROUP codes. Each group contributes
// s·Σ q·x + b·Σ x, accumulated in f32 (`# Arithmetic` in runtime/kernels/mod.rs).
//
// BITS must divide 32 (2, 4, 8) and GROUP must be a multiple of 32/BITS; the dense
// bit streams of 3, 5 and 6 bits need their own code fetch (see the module doc).

override BITS: u32 = 4u;
override GROUP: u32 = 64u;

struct Params {
    rows: u32,
    cols: u32,
    n: u32,
    w_off: u32,
    s_off: u32,
    b_off: u32,
    x_off: u32,
    y_off: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
// The matrix buffer: codes at word `w_off`, scales and biases at half-word (BF16)
// indices `s_off` and `b_off`.
@group(0) @binding(1) var<storage, read> mat: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

fn per_word() -> u32 { return 32u / BITS; }
fn mask() -> u32 { return (1u << BITS) - 1u; }

// BF16 element `i` (a half-word index) of `mat`.
fn bf16_at(i: u32) -> f32 {
    let w = mat[i >> 1u];
    return bitcast<f32>(((w >> ((i & 1u) * 16u)) & 0xffffu) << 16u);
}

// One workgroup computes ROWS rows of one token: LANES invocations per row stride over
// the row's words (adjacent lanes read adjacent words), then a tree sum.
const LANES: u32 = 32u;
const ROWS: u32 = 8u;
var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn qmatvec(@builtin(workgroup_id) wid: vec3<u32>,
           @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) li: u32) {
    let blocks = (p.rows + ROWS - 1u) / ROWS;
    let lin = wid.x + wid.y * nwg.x;
    if (lin >= blocks * p.n) { return; }
    let tok = lin / blocks;
    let row = (lin % blocks) * ROWS + li / LANES;
    let lane = li % LANES;
    let pw = per_word();
    let row_words = p.cols / pw;
    let wpg = GROUP / pw;
    let groups = p.cols / GROUP;
    var acc = 0.0;
    if (row < p.rows) {
        let wbase = p.w_off + row * row_words;
        let xbase = p.x_off + tok * p.cols;
        for (var wi = lane; wi < row_words; wi += LANES) {
            let word = mat[wbase + wi];
            let g = row * groups + wi / wpg;
            let c0 = xbase + wi * pw;
            var dq = 0.0;
            var sx = 0.0;
            for (var k = 0u; k < pw; k++) {
                let xv = x[c0 + k];
                dq += f32((word >> (k * BITS)) & mask()) * xv;
                sx += xv;
            }
            acc += bf16_at(p.s_off + g) * dq + bf16_at(p.b_off + g) * sx;
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

// The same product reading 16 bytes of codes and of x per load: taken when the codes
// start on a 16-byte boundary and a row is a whole number of vec4 words (the host's
// `qmatvec_fast_path`), else `qmatvec` above. Needs 32/BITS to be a multiple of 4.
@group(0) @binding(4) var<storage, read> mat4: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read> x4: array<vec4<f32>>;

@compute @workgroup_size(256)
fn qmatvec4(@builtin(workgroup_id) wid: vec3<u32>,
            @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) li: u32) {
    let blocks = (p.rows + ROWS - 1u) / ROWS;
    let lin = wid.x + wid.y * nwg.x;
    if (lin >= blocks * p.n) { return; }
    let tok = lin / blocks;
    let row = (lin % blocks) * ROWS + li / LANES;
    let lane = li % LANES;
    let pw = per_word();
    let row_v = p.cols / pw / 4u;
    let wpg = GROUP / pw;
    let groups = p.cols / GROUP;
    var acc = 0.0;
    if (row < p.rows) {
        let wbase = p.w_off / 4u + row * row_v;
        let xbase = (p.x_off + tok * p.cols) / 4u;
        for (var vi = lane; vi < row_v; vi += LANES) {
            let words = mat4[wbase + vi];
            for (var j = 0u; j < 4u; j++) {
                let wi = vi * 4u + j;
                let word = words[j];
                let g = row * groups + wi / wpg;
                let c4 = xbase + wi * (pw / 4u);
                var dq = 0.0;
                var sx = 0.0;
                for (var v = 0u; v < pw / 4u; v++) {
                    let xv = x4[c4 + v];
                    let sh = v * 4u * BITS;
                    let q = vec4<f32>(
                        f32((word >> sh) & mask()),
                        f32((word >> (sh + BITS)) & mask()),
                        f32((word >> (sh + 2u * BITS)) & mask()),
                        f32((word >> (sh + 3u * BITS)) & mask()));
                    dq += dot(q, xv);
                    sx += (xv.x + xv.y) + (xv.z + xv.w);
                }
                acc += bf16_at(p.s_off + g) * dq + bf16_at(p.b_off + g) * sx;
            }
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
    let pw = per_word();
    let row_words = p.cols / pw;
    let wpg = GROUP / pw;
    let groups = p.cols / GROUP;
    var acc = 0.0;
    for (var g = 0u; g < groups; g++) {
        // Codes of the TR rows for group g.
        for (var i = li; i < TR * wpg; i += 64u) {
            let rr = i / wpg;
            let wi = i % wpg;
            let row = min(r0 + rr, p.rows - 1u);
            let word = mat[p.w_off + row * row_words + g * wpg + wi];
            for (var k = 0u; k < pw; k++) {
                wq[rr * GROUP + wi * pw + k] = f32((word >> (k * BITS)) & mask());
            }
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
