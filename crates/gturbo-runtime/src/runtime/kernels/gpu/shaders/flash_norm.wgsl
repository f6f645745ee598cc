// Flash-Next's row reductions (`FlashOps`), one workgroup per `d`-wide piece, f32 with
// a workgroup tree sum:
// - norm_grouped: the offset RMSNorm of each `d`-wide piece of a row with that
//   piece's own offsets, `x̂ · (1 + w[(piece % (wd / d))·d + i])`;
// - gated_norm: `rms(o) · w · act(z)` per head (plain weight; act sigmoid or silu);
// - ple_gate: per (token, stream) `g = Σ key·qry / scale`, `g = sign(g)·√max(|g|, 1e-6)`,
//   `out = sigmoid(g) · value[token]`.

struct Params {
    // Pieces (workgroups).
    n: u32,
    // Piece width.
    d: u32,
    // Weight length (norm_grouped); streams S (ple_gate).
    wd: u32,
    // gated_norm: 0 sigmoid, 1 silu.
    mode: u32,
    eps: f32,
    // ple_gate: the divisor √H, as the host computes it.
    scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
// The rows normalised (norm_grouped, gated_norm: o); the keys (ple_gate).
@group(0) @binding(1) var<storage, read> x: array<f32>;
// The weight (norm_grouped, gated_norm); the values (ple_gate).
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
// The gate input z (gated_norm); the queries (ple_gate).
@group(0) @binding(4) var<storage, read> z: array<f32>;

const WG: u32 = 256u;
var<workgroup> red: array<f32, 256>;

fn sigmoid(v: f32) -> f32 {
    if (v >= 0.0) {
        return 1.0 / (1.0 + exp(-v));
    }
    let e = exp(v);
    return e / (1.0 + e);
}

fn piece(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x;
}

// 1 / √(mean(x²) + eps) of the piece at `base`.
fn inv_rms(li: u32, base: u32) -> f32 {
    var acc = 0.0;
    for (var i = li; i < p.d; i += WG) {
        let v = x[base + i];
        acc += v * v;
    }
    return 1.0 / sqrt(reduce_sum(li, acc) / f32(p.d) + p.eps);
}

@compute @workgroup_size(256)
fn norm_grouped(@builtin(workgroup_id) wid: vec3<u32>,
                @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) li: u32) {
    let pc = piece(wid, nwg);
    if (pc >= p.n) { return; }
    let base = pc * p.d;
    let inv = inv_rms(li, base);
    let wbase = (pc % (p.wd / p.d)) * p.d;
    for (var i = li; i < p.d; i += WG) {
        out[base + i] = x[base + i] * inv * (1.0 + w[wbase + i]);
    }
}

@compute @workgroup_size(256)
fn gated_norm(@builtin(workgroup_id) wid: vec3<u32>,
              @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) li: u32) {
    let pc = piece(wid, nwg);
    if (pc >= p.n) { return; }
    let base = pc * p.d;
    let inv = inv_rms(li, base);
    for (var i = li; i < p.d; i += WG) {
        let g = z[base + i];
        var a = sigmoid(g);
        if (p.mode == 1u) { a = g * a; }
        out[base + i] = w[i] * (x[base + i] * inv) * a;
    }
}

@compute @workgroup_size(256)
fn ple_gate(@builtin(workgroup_id) wid: vec3<u32>,
            @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) li: u32) {
    let pc = piece(wid, nwg);
    if (pc >= p.n) { return; }
    let base = pc * p.d;
    var acc = 0.0;
    for (var i = li; i < p.d; i += WG) {
        acc += x[base + i] * z[base + i];
    }
    let g = reduce_sum(li, acc) / p.scale;
    let mag = sqrt(max(abs(g), 1e-6));
    // sign(0) = 0, as torch.sign.
    var sg = 0.0;
    if (g > 0.0) { sg = mag; } else if (g < 0.0) { sg = -mag; }
    let gate = sigmoid(sg);
    let vbase = (pc / p.wd) * p.d;
    for (var i = li; i < p.d; i += WG) {
        out[base + i] = gate * w[vbase + i];
    }
}
