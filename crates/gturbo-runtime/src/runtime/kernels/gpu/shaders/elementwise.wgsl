// Element-wise and row-moving kernels: SwiGLU's gating, residual adds, a projection's
// bias, and the MoE gather / weighted scatter-add. One invocation per element, f32.

struct Params {
    // Elements (swiglu, add, add_bias) or rows (gather, scatter).
    n: u32,
    // Row width (add_bias: the bias's length; gather, scatter).
    d: u32,
    a_off: u32,
    b_off: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
// Gather / scatter: the row of each entry, and (scatter) its weight.
@group(0) @binding(3) var<storage, read> rows: array<u32>;
@group(0) @binding(4) var<storage, read> wts: array<f32>;

fn index(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return gid.x + gid.y * nwg.x * 256u;
}

// a = silu(a) · b with silu(g) = g / (1 + e^-g).
@compute @workgroup_size(256)
fn swiglu(@builtin(global_invocation_id) gid: vec3<u32>,
          @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n) { return; }
    let g = a[p.a_off + i];
    a[p.a_off + i] = g / (1.0 + exp(-g)) * b[p.b_off + i];
}

// a += b.
@compute @workgroup_size(256)
fn add(@builtin(global_invocation_id) gid: vec3<u32>,
       @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n) { return; }
    a[p.a_off + i] += b[p.b_off + i];
}

// a[i] += b[i % d]: the d-wide bias b added to every row of a.
@compute @workgroup_size(256)
fn add_bias(@builtin(global_invocation_id) gid: vec3<u32>,
            @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n) { return; }
    a[p.a_off + i] += b[p.b_off + i % p.d];
}

// Row r of a = row rows[r] of b.
@compute @workgroup_size(256)
fn gather_rows(@builtin(global_invocation_id) gid: vec3<u32>,
               @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n * p.d) { return; }
    let r = i / p.d;
    let c = i % p.d;
    a[p.a_off + i] = b[p.b_off + rows[r] * p.d + c];
}

// Row rows[r] of a += wts[r] · row r of b (the rows are distinct within one call).
@compute @workgroup_size(256)
fn scatter_add(@builtin(global_invocation_id) gid: vec3<u32>,
               @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n * p.d) { return; }
    let r = i / p.d;
    let c = i % p.d;
    let dst = p.a_off + rows[r] * p.d + c;
    a[dst] += wts[r] * b[p.b_off + i];
}
