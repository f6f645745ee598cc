// Row-wise softmax in place, and the MoE router: softmax over the experts, top-k
// (highest probability first, ties to the lower expert id, as the CPU path sorts),
// optionally renormalised to sum 1. f32 throughout.
//
// Softmax follows `softmax_inplace`: subtract the row maximum, exponentiate, divide by
// the sum; entries at or below -3e38 (the host's stand-in for -inf, since Metal may
// compile with fast math) become 0, and a row with no other entry is left alone.

struct Params {
    n: u32,
    d: u32,
    off: u32,
    k: u32,
    renorm: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
// Router outputs: `[n, k]` expert ids and weights.
@group(0) @binding(2) var<storage, read_write> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> wts: array<f32>;

const WG: u32 = 256u;
const NEG_BIG: f32 = -3.0e38;
var<workgroup> red: array<f32, 256>;
var<workgroup> rid: array<u32, 256>;

// Softmax of row `row` in place; false when every entry is masked (row untouched).
fn softmax_row(row: u32, li: u32) -> bool {
    let base = p.off + row * p.d;
    var mx = NEG_BIG;
    for (var i = li; i < p.d; i += WG) { mx = max(mx, x[base + i]); }
    mx = reduce_max_uniform(li, mx);
    if (mx <= NEG_BIG) { return false; }
    var sum = 0.0;
    for (var i = li; i < p.d; i += WG) {
        let v = x[base + i];
        let e = select(exp(v - mx), 0.0, v <= NEG_BIG);
        x[base + i] = e;
        sum += e;
    }
    let inv = 1.0 / reduce_sum_uniform(li, sum);
    for (var i = li; i < p.d; i += WG) { x[base + i] *= inv; }
    return true;
}

@compute @workgroup_size(256)
fn softmax(@builtin(workgroup_id) wid: vec3<u32>,
           @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) li: u32) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.n) { return; }
    _ = softmax_row(row, li);
}

// Probabilities of the chosen experts are taken out of the running by this mark.
const TAKEN: f32 = -1.0;

@compute @workgroup_size(256)
fn router_topk(@builtin(workgroup_id) wid: vec3<u32>,
               @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) li: u32) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.n) { return; }
    _ = softmax_row(row, li);
    workgroupBarrier();
    let base = p.off + row * p.d;
    for (var r = 0u; r < p.k; r++) {
        // Best (probability, id) over this invocation's experts, ties to the lower id.
        var bv = TAKEN;
        var bi = 0xffffffffu;
        for (var e = li; e < p.d; e += WG) {
            let v = x[base + e];
            if (v > bv) { bv = v; bi = e; }
        }
        red[li] = bv;
        rid[li] = bi;
        workgroupBarrier();
        for (var s = WG / 2u; s > 0u; s >>= 1u) {
            if (li < s) {
                let ov = red[li + s];
                let oi = rid[li + s];
                if (ov > red[li] || (ov == red[li] && oi < rid[li])) {
                    red[li] = ov;
                    rid[li] = oi;
                }
            }
            workgroupBarrier();
        }
        if (li == 0u) {
            let e = rid[0];
            ids[row * p.k + r] = e;
            wts[row * p.k + r] = red[0];
            x[base + e] = TAKEN;
        }
        workgroupBarrier();
    }
    if (li == 0u && p.renorm != 0u) {
        // Summed in rank order, as the CPU path sums its top-k slice.
        var sum = 0.0;
        for (var r = 0u; r < p.k; r++) { sum += wts[row * p.k + r]; }
        for (var r = 0u; r < p.k; r++) { wts[row * p.k + r] = wts[row * p.k + r] / sum; }
    }
}
