// Rotary position embedding in place: in each head the first `rot` dims are rotated as
// pairs (i, i + rot/2) in the rotate-half (Hugging Face / NeoX) layout, or (2i, 2i + 1)
// interleaved (GPT-J, DeepSeek-V3's `rope_interleave`); dims past `rot` pass through
// (partial RoPE). cos and sin come from a host-built table `[positions,
// rot/2]` computed exactly as the CPU runner computes them, so the angles agree
// bit for bit (WGSL's sin and cos are only accurate to 2^-11 near ±π, and unbounded
// past it).

struct Params {
    n: u32,
    heads: u32,
    head_dim: u32,
    rot: u32,
    pos0: u32,
    x_off: u32,
    // 1: pairs (2i, 2i + 1); 0: pairs (i, i + rot/2).
    interleaved: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
// cos then sin per (position, i): element 2·(pos·rot/2 + i) is cos, the next sin.
@group(0) @binding(2) var<storage, read> table: array<f32>;

@compute @workgroup_size(64)
fn rope(@builtin(global_invocation_id) gid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let half = p.rot / 2u;
    let id = gid.x + gid.y * nwg.x * 64u;
    if (id >= p.n * p.heads * half) { return; }
    let i = id % half;
    let head = (id / half) % p.heads;
    let tok = id / (half * p.heads);
    let base = p.x_off + (tok * p.heads + head) * p.head_dim;
    let t = 2u * ((p.pos0 + tok) * half + i);
    let c = table[t];
    let s = table[t + 1u];
    var ia = base + i;
    var ib = base + half + i;
    if (p.interleaved != 0u) {
        ia = base + 2u * i;
        ib = ia + 1u;
    }
    let x1 = x[ia];
    let x2 = x[ib];
    x[ia] = x1 * c - x2 * s;
    x[ib] = x2 * c + x1 * s;
}
