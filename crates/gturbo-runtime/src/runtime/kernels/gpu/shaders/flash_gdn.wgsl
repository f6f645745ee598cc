// The gated delta rule of the GDN layers, token by token (`FlashOps::gdn_recurrence`).
// The conv output rows are `[n, ch]`, channels q (nk·dk) | k (nk·dk) | v (nv·dv); the
// state is `[nv, dk, dv]`. One workgroup per value head h, which reads key head
// h / (nv / nk); each invocation owns state columns j (every dk entry of them), so the
// only sharing is the token's normalised q and k, in workgroup memory. Per token:
//   q ← q / √(Σq² + 1e-6) / scale,  k ← k / √(Σk² + 1e-6)        (scale = √dk)
//   beta = sigmoid(b),  g = −e^A_log · softplus(a + dt_bias),  S ← S · e^g
//   kv_j = Σ_i S_ij k_i,  δ_j = (v_j − kv_j) · beta,  S_ij ← S_ij + k_i δ_j
//   core_j = Σ_i S_ij q_i
// with the sums over i in ascending order, as the CPU adds them.

struct Params {
    // Tokens.
    n: u32,
    nk: u32,
    dk: u32,
    nv: u32,
    dv: u32,
    // √dk, as the host computes it.
    scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> conv: array<f32>;
@group(0) @binding(2) var<storage, read> bb: array<f32>;
@group(0) @binding(3) var<storage, read> aa: array<f32>;
@group(0) @binding(4) var<storage, read> a_log: array<f32>;
@group(0) @binding(5) var<storage, read> dt_bias: array<f32>;
@group(0) @binding(6) var<storage, read_write> state: array<f32>;
@group(0) @binding(7) var<storage, read_write> core: array<f32>;

const WG: u32 = 64u;
// dk is at most 256 (the host checks).
var<workgroup> qs: array<f32, 256>;
var<workgroup> ks: array<f32, 256>;
var<workgroup> red: array<f32, 64>;

fn sigmoid(x: f32) -> f32 {
    if (x >= 0.0) {
        return 1.0 / (1.0 + exp(-x));
    }
    let e = exp(x);
    return e / (1.0 + e);
}

// torch's softplus (threshold 20): x above it, else log(1 + e^x) with log1p's accuracy
// for small e^x (WGSL has no log1p).
fn softplus(x: f32) -> f32 {
    if (x > 20.0) { return x; }
    let e = exp(x);
    let u = 1.0 + e;
    if (u == 1.0) { return e; }
    return log(u) * (e / (u - 1.0));
}

@compute @workgroup_size(64)
fn gdn(@builtin(workgroup_id) wid: vec3<u32>,
       @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_index) li: u32) {
    let h = wid.x + wid.y * nwg.x;
    if (h >= p.nv) { return; }
    let kh = h / (p.nv / p.nk);
    let kd = p.nk * p.dk;
    let vd = p.nv * p.dv;
    let ch = 2u * kd + vd;
    let sbase = h * p.dk * p.dv;
    let a_exp = exp(a_log[h]);
    for (var t = 0u; t < p.n; t++) {
        let row = t * ch;
        var sq = 0.0;
        var sk = 0.0;
        for (var i = li; i < p.dk; i += WG) {
            let qv = conv[row + kh * p.dk + i];
            let kv = conv[row + kd + kh * p.dk + i];
            qs[i] = qv;
            ks[i] = kv;
            sq += qv * qv;
            sk += kv * kv;
        }
        let inv_q = 1.0 / sqrt(reduce_sum(li, sq) + 1e-6);
        let inv_k = 1.0 / sqrt(reduce_sum(li, sk) + 1e-6);
        for (var i = li; i < p.dk; i += WG) {
            qs[i] = qs[i] * inv_q / p.scale;
            ks[i] = ks[i] * inv_k;
        }
        workgroupBarrier();
        let beta = sigmoid(bb[t * p.nv + h]);
        let g = -a_exp * softplus(aa[t * p.nv + h] + dt_bias[h]);
        let decay = exp(g);
        for (var j = li; j < p.dv; j += WG) {
            var kv = 0.0;
            for (var i = 0u; i < p.dk; i++) {
                let at = sbase + i * p.dv + j;
                let s = state[at] * decay;
                state[at] = s;
                kv += s * ks[i];
            }
            let delta = (conv[row + 2u * kd + h * p.dv + j] - kv) * beta;
            var o = 0.0;
            for (var i = 0u; i < p.dk; i++) {
                let at = sbase + i * p.dv + j;
                let s = state[at] + ks[i] * delta;
                state[at] = s;
                o += s * qs[i];
            }
            core[t * vd + h * p.dv + j] = o;
        }
        // The next token overwrites qs and ks.
        workgroupBarrier();
    }
}
