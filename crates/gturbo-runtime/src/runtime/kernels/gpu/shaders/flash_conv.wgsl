// The depthwise causal (dilated) conv with SiLU that the GDN (dilation 1) and the PLE
// block (dilation ngram_size) run over `ch`-channel rows, continuing from a state of
// the `past = (taps − 1)·dilation` rows before the new ones (oldest first). Row r of the
// extended sequence `state ++ x` is state row r for r < past, else x row r − past.
// - conv_silu: out[t, c] = silu(Σ_i w[c·taps + i] · ext[t + past − (taps − 1 − i)·dilation, c]),
//   the taps added in order;
// - conv_state: the new state, the last `past` rows of `ext`.
// Both read the old state from a copy (`old`), so the state can be rewritten in place
// of itself without one invocation reading what another wrote.

struct Params {
    // New rows.
    n: u32,
    ch: u32,
    taps: u32,
    dilation: u32,
    past: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read> old: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read_write> state: array<f32>;

fn index(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return gid.x + gid.y * nwg.x * 256u;
}

fn ext(r: u32, c: u32) -> f32 {
    if (r < p.past) {
        return old[r * p.ch + c];
    }
    return x[(r - p.past) * p.ch + c];
}

@compute @workgroup_size(256)
fn conv_silu(@builtin(global_invocation_id) gid: vec3<u32>,
             @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n * p.ch) { return; }
    let t = i / p.ch;
    let c = i % p.ch;
    var acc = 0.0;
    for (var k = 0u; k < p.taps; k++) {
        acc += w[c * p.taps + k] * ext(t + p.past - (p.taps - 1u - k) * p.dilation, c);
    }
    // silu, in the two-sided form (no infinity under fast math).
    var s: f32;
    if (acc >= 0.0) {
        s = 1.0 / (1.0 + exp(-acc));
    } else {
        let e = exp(acc);
        s = e / (1.0 + e);
    }
    out[i] = acc * s;
}

@compute @workgroup_size(256)
fn conv_state(@builtin(global_invocation_id) gid: vec3<u32>,
              @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.past * p.ch) { return; }
    state[i] = ext(i / p.ch + p.n, i % p.ch);
}
