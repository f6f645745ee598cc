// Embedding gather: out row t = row tokens[t] of the table, decoded to f32. The table
// is affine-quantized (ENCODING 3, BITS / GROUP as in qmatvec.wgsl, any MLX width: w = s·q + b) or
// f32 / BF16 / F16 (ENCODING 0 / 1 / 2). Token ids are checked on the host.

override ENCODING: u32 = 3u;
override BITS: u32 = 4u;
override GROUP: u32 = 64u;

struct Params {
    n: u32,
    cols: u32,
    w_off: u32,
    s_off: u32,
    b_off: u32,
    out_off: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> mat: array<u32>;
@group(0) @binding(2) var<storage, read> tokens: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

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

fn half_at(i: u32) -> u32 {
    return (mat[i >> 1u] >> ((i & 1u) * 16u)) & 0xffffu;
}

fn bf16_at(i: u32) -> f32 {
    return bitcast<f32>(half_at(i) << 16u);
}

@compute @workgroup_size(256)
fn embed(@builtin(global_invocation_id) gid: vec3<u32>,
         @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= p.n * p.cols) { return; }
    let t = i / p.cols;
    let c = i % p.cols;
    let row = tokens[t];
    var v = 0.0;
    if (ENCODING == 3u) {
        // Code c of the row's little-endian bit stream (3, 5, 6 bits straddle words).
        let o = c * BITS;
        let wi = p.w_off + row * (p.cols * BITS / 32u) + (o >> 5u);
        let sh = o & 31u;
        var bitsv = mat[wi] >> sh;
        if (sh + BITS > 32u) { bitsv |= mat[wi + 1u] << (32u - sh); }
        let q = bitsv & ((1u << BITS) - 1u);
        let g = row * (p.cols / GROUP) + c / GROUP;
        v = bf16_at(p.s_off + g) * f32(q) + bf16_at(p.b_off + g);
    } else if (ENCODING == 0u) {
        v = bitcast<f32>(mat[p.w_off + row * p.cols + c]);
    } else if (ENCODING == 1u) {
        v = bf16_at(p.w_off + row * p.cols + c);
    } else {
        v = f16_to_f32(half_at(p.w_off + row * p.cols + c));
    }
    out[p.out_off + i] = v;
}
