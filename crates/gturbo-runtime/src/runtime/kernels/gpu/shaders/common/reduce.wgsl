// Workgroup tree reductions, written once and put in front of the shaders that use
// them (`attn`, `softmax`, `flash_attn`, `flash_gdn`, `flash_norm`; see `shaders.rs`).
// The shader declares `const WG: u32` (its workgroup size, a power of two) and
// `var<workgroup> red: array<f32, WG>`. Every invocation of the workgroup calls them
// (they hold barriers); each returns the same value to all, and `red` is free again
// on return.

fn tree_max(li: u32, v: f32) {
    red[li] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (li < s) { red[li] = max(red[li], red[li + s]); }
        workgroupBarrier();
    }
}

fn tree_sum(li: u32, v: f32) {
    red[li] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (li < s) { red[li] += red[li + s]; }
        workgroupBarrier();
    }
}

// The largest `v` of the workgroup.
fn reduce_max(li: u32, v: f32) -> f32 {
    tree_max(li, v);
    let r = red[0];
    workgroupBarrier();
    return r;
}

// The sum of `v` over the workgroup (a tree sum).
fn reduce_sum(li: u32, v: f32) -> f32 {
    tree_sum(li, v);
    let r = red[0];
    workgroupBarrier();
    return r;
}

// `reduce_max` as a uniform value, for a caller that branches on it around barriers.
fn reduce_max_uniform(li: u32, v: f32) -> f32 {
    tree_max(li, v);
    let r = workgroupUniformLoad(&red[0]);
    workgroupBarrier();
    return r;
}

// `reduce_sum` as a uniform value, for a caller that branches on it around barriers.
fn reduce_sum_uniform(li: u32, v: f32) -> f32 {
    tree_sum(li, v);
    let r = workgroupUniformLoad(&red[0]);
    workgroupBarrier();
    return r;
}
