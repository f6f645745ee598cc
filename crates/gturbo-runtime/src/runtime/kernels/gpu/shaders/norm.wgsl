// RMSNorm of `n` rows of width `d`: out = x · (1/sqrt(mean(x²) + eps)) · w, or
// · (1 + w) when `add_one` is 1 (Gemma-style weights). One workgroup per row, f32.

struct Params {
    n: u32,
    d: u32,
    x_off: u32,
    out_off: u32,
    eps: f32,
    add_one: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

const WG: u32 = 256u;
var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn rms_norm(@builtin(workgroup_id) wid: vec3<u32>,
            @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) li: u32) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.n) { return; }
    let base = p.x_off + row * p.d;
    var acc = 0.0;
    for (var i = li; i < p.d; i += WG) {
        let v = x[base + i];
        acc += v * v;
    }
    red[li] = acc;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (li < s) { red[li] += red[li + s]; }
        workgroupBarrier();
    }
    let inv = 1.0 / sqrt(red[0] / f32(max(p.d, 1u)) + p.eps);
    let obase = p.out_off + row * p.d;
    for (var i = li; i < p.d; i += WG) {
        let wv = select(w[i], 1.0 + w[i], p.add_one != 0u);
        out[obase + i] = x[base + i] * inv * wv;
    }
}
