// Flash-Next's element-wise and row-moving kernels (`FlashOps`): the activations, the
// sigmoid gates, column gathers, and the hyper-connection's expand / mix / inject over
// the `[n, S·H]` residual. One invocation per output element, f32.
//
// The sigmoid is written in its two-sided form (`e^x / (1 + e^x)` for negative x) so no
// intermediate overflows to infinity: Metal compiles with fast math, where infinities
// are not guaranteed. It equals `1 / (1 + e^-x)` up to rounding.

struct Params {
    // Elements the dispatch covers.
    n: u32,
    // Row width (gather_cols, scatter_cols, scale_rows) or stream width H (hc_*).
    d: u32,
    // Columns gathered or scattered (gather_cols, scatter_cols) or streams S (hc_*).
    s: u32,
    // First column gathered or scattered; the activation (act): 0 silu(x / c),
    // 1 sigmoid(x), 2 2·sigmoid(x / c); the bits of alpha (clamped_swiglu).
    mode: u32,
    // The activation's divisor (act); the factor (scatter_cols); the limit
    // (clamped_swiglu).
    c: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
// The output (in place for act, sigmoid_mul, scale_rows, hc_inject).
@group(0) @binding(1) var<storage, read_write> a: array<f32>;
// The first input: the gate (sigmoid_mul, scale_rows), the source (gather_cols,
// hc_expand), the mix weights (hc_mix), the block output y (hc_inject).
@group(0) @binding(2) var<storage, read> b: array<f32>;
// The second input: the normed streams (hc_mix), the inject scales (hc_inject).
@group(0) @binding(3) var<storage, read> c: array<f32>;

fn index(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return gid.x + gid.y * nwg.x * 256u;
}

fn sigmoid(x: f32) -> f32 {
    if (x >= 0.0) {
        return 1.0 / (1.0 + exp(-x));
    }
    let e = exp(x);
    return e / (1.0 + e);
}

@compute @workgroup_size(256)
fn act(@builtin(global_invocation_id) gid: vec3<u32>,
       @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n) { return; }
    let x = a[i];
    var y: f32;
    if (p.mode == 0u) {
        let u = x / p.c;
        y = u * sigmoid(u);
    } else if (p.mode == 1u) {
        y = sigmoid(x);
    } else {
        y = 2.0 * sigmoid(x / p.c);
    }
    a[i] = y;
}

// a[i] *= sigmoid(b[i]).
@compute @workgroup_size(256)
fn sigmoid_mul(@builtin(global_invocation_id) gid: vec3<u32>,
               @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n) { return; }
    a[i] = a[i] * sigmoid(b[i]);
}

// Row r (of width d) of a *= sigmoid(b[r]).
@compute @workgroup_size(256)
fn scale_rows(@builtin(global_invocation_id) gid: vec3<u32>,
              @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n) { return; }
    a[i] = a[i] * sigmoid(b[i / p.d]);
}

// a[r, j] = b[r, mode + j] for the s columns j of each d-wide row r.
@compute @workgroup_size(256)
fn gather_cols(@builtin(global_invocation_id) gid: vec3<u32>,
               @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n) { return; }
    let r = i / p.s;
    let j = i % p.s;
    a[i] = b[r * p.d + p.mode + j];
}

// a[r, mode + j] = c · b[r, j] for the s columns j of b's rows r (d-wide rows of a):
// one invocation per element of b.
@compute @workgroup_size(256)
fn scatter_cols(@builtin(global_invocation_id) gid: vec3<u32>,
                @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n) { return; }
    let r = i / p.s;
    let j = i % p.s;
    a[r * p.d + p.mode + j] = p.c * b[i];
}

// a[t, j·H + c] = b[t, c] for every stream j.
@compute @workgroup_size(256)
fn hc_expand(@builtin(global_invocation_id) gid: vec3<u32>,
             @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n) { return; }
    let t = i / (p.s * p.d);
    a[i] = b[t * p.d + i % p.d];
}

// a[t, c] = (Σ_j b[t, j·H + c] · c[t, j·H + c]) / S, the sum over j in order.
@compute @workgroup_size(256)
fn hc_mix(@builtin(global_invocation_id) gid: vec3<u32>,
          @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n) { return; }
    let t = i / p.d;
    let ch = i % p.d;
    let base = t * p.s * p.d + ch;
    var acc = 0.0;
    for (var j = 0u; j < p.s; j++) {
        acc += b[base + j * p.d] * c[base + j * p.d];
    }
    a[i] = acc / f32(p.s);
}

// a[t, j·H + c] += b[t, c] · c[t·S + j].
@compute @workgroup_size(256)
fn hc_inject(@builtin(global_invocation_id) gid: vec3<u32>,
             @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n) { return; }
    let w = p.s * p.d;
    let t = i / w;
    let j = (i % w) / p.d;
    a[i] += b[t * p.d + i % p.d] * c[t * p.s + j];
}

// gpt-oss's clamped SwiGLU in place: with g = min(a, limit), u = clamp(b, -limit,
// limit), a = (u + 1) · g · sigmoid(alpha · g); alpha is the f32 whose bits are `mode`.
@compute @workgroup_size(256)
fn clamped_swiglu(@builtin(global_invocation_id) gid: vec3<u32>,
                  @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n) { return; }
    let g = min(a[i], p.c);
    let u = clamp(b[i], -p.c, p.c);
    a[i] = (u + 1.0) * (g * sigmoid(bitcast<f32>(p.mode) * g));
}
