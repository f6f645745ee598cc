//! How the GPU picks among its kernels: which product kernel a matrix takes, its
//! tiling, when attention splits its positions, and the environment knobs
//! (`GTURBO_GPU_*`, declared in [`crate::env`]) that override those choices for
//! benchmarks and before/after figures. Plain numbers in, choices out: the one place
//! each choice is made, so tests run both sides of it.

use crate::env;

/// Workgroups a matrix-vector product should have at least: a few per compute unit
/// of a large GPU (the H200 has 132).
pub(crate) const MIN_MATVEC_WGS: usize = 512;

/// Where `qmatvec_x24` starts paying for its pack dispatch on the H200 (docs/GPU.md):
/// from [4096 × 2048], 8 M codes, even a product that packs its own x is faster than
/// the f32 kernel (device time 10.1 against 12.7 µs); at [2048²] it is not (9.5
/// against 8.8).
pub(crate) const PACKED_X_MIN_CODES: usize = 4096 * 2048;

/// Whether a product over `n` tokens takes the tiled kernel: one place for the
/// choice, so tests cover both sides (n = 1 and n > 1).
pub(crate) fn use_tiled(n: usize) -> bool {
    n > 1
}

/// Whether the matrix-vector product of an affine matrix (`bits`-bit codes in groups
/// of `group`, codes from word `w_off`, `cols` columns) takes the 16-byte-load kernel
/// (`qmatvec_fast`): a width dividing 16 (2, 4, 8 bits), codes starting on a 16-byte
/// boundary, and each 16-byte code word inside one group (so a row is a whole number
/// of them).
pub(crate) fn qmatvec_fast_path(bits: u32, group: u32, w_off: u32, cols: usize) -> bool {
    matches!(bits, 2 | 4 | 8)
        && w_off.is_multiple_of(4)
        && group.is_multiple_of(128 / bits)
        && cols.is_multiple_of((128 / bits) as usize)
}

/// Whether the matrix-vector product of an affine matrix (as for
/// [`qmatvec_fast_path`]) can take the packed 24-bit x kernel (`qmatvec_x24`): 4-bit
/// codes from a 16-byte boundary in groups of 32, 64 or 128. Whether it does also
/// depends on its size ([`GpuContext::packed_x_takes`](super::GpuContext::packed_x_takes)).
pub(crate) fn qmatvec_x24_path(bits: u32, group: u32, w_off: u32, cols: usize) -> bool {
    bits == 4 && group.is_multiple_of(32) && w_off.is_multiple_of(4) && cols.is_multiple_of(32)
}

/// Invocations per row and rows per set of `qmatvec_fast` for `rows` rows of `row_v`
/// 16-byte words each. Lanes: about a quarter of a row's words (each lane takes ~4
/// steps, so short rows such as SmolLM2's 576 columns or an expert's 256 do not
/// leave lanes idle), 4 to 64. Rows per set: as many as keep at least
/// [`MIN_MATVEC_WGS`] workgroups, up to 4 (more rows per lane put more loads in
/// flight and share each x load; more workgroups fill more of a large GPU).
pub(crate) fn matvec_tiling(row_v: usize, rows: usize) -> (u32, u32) {
    let want = (row_v / 4).clamp(4, 64);
    let lanes = 1u32 << (usize::BITS - 1 - want.leading_zeros());
    let wgs = |rps: u32| rows.div_ceil((256 / lanes * rps) as usize);
    let rps = [4, 2]
        .into_iter()
        .find(|&r| wgs(r) >= MIN_MATVEC_WGS)
        .unwrap_or(1);
    (lanes, rps)
}

/// Whether `qmatvec_fast` can run `lanes` invocations over sets of `rows` rows: a
/// power of two from 4 to 256 lanes, 1 to 4 rows.
pub(crate) fn valid_tiling(lanes: u32, rows: u32) -> bool {
    valid_x24_lanes(lanes) && (1..=4).contains(&rows)
}

/// `qmatvec_x24`'s invocations per 4 rows for `rows` rows of `row_v` code words: the
/// power of two that makes about `MIN_MATVEC_WGS` workgroups (each has 1024 / lanes
/// rows), at most `row_v` rounded up (no lane without a word) and 4 to 256. On the H200
/// each of [4096², 8192², 16384×8192, 8192×4096, 4096×16384] was fastest at 512
/// workgroups among 32, 64 and 128 lanes (docs/GPU.md). Public for the matvec lab
/// (examples/matvec_lab.rs), which times the kernel at the runtime's choice.
pub fn x24_lanes(row_v: usize, rows: usize) -> u32 {
    let want = (MIN_MATVEC_WGS * 1024).div_ceil(rows.max(1)).clamp(4, 256);
    // The power of two nearest `want` (rounding at 1.5×), then capped by the row.
    let down = 1usize << (usize::BITS - 1 - want.leading_zeros());
    let near = if want >= down + down / 2 {
        down * 2
    } else {
        down
    };
    near.min(row_v.next_power_of_two()).clamp(4, 256) as u32
}

/// Whether `qmatvec_x24` can run `lanes` invocations per 4 rows: a power of two, 4
/// to 256.
pub(crate) fn valid_x24_lanes(lanes: u32) -> bool {
    lanes.is_power_of_two() && (4..=256).contains(&lanes)
}

/// Positions per workgroup of the split attention for `n` tokens of `heads` heads
/// whose last token attends to `upto` positions, or `None` for one workgroup per
/// (token, head): split only when those would be too few to fill a GPU (decode) and
/// the context spans more than one 64-position block. Chunks are a multiple of 32
/// positions, at most 32 per (token, head), so the combine stays short.
pub(crate) fn split_chunk(n: usize, heads: usize, upto: usize) -> Option<usize> {
    (n * heads < 256 && upto > 64).then(|| upto.div_ceil(32).next_multiple_of(32))
}

// ---------------------------------------------------------------- the knobs

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok()?.trim().parse().ok()
}

/// [`env::GTURBO_GPU_TILING`]: `qmatvec_fast`'s tiling for every product (unset or
/// malformed: chosen per shape).
pub(crate) fn forced_tiling() -> Option<(u32, u32)> {
    let v = std::env::var(env::GTURBO_GPU_TILING).ok()?;
    let (l, r) = v.trim().split_once('x')?;
    let (l, r): (u32, u32) = (l.parse().ok()?, r.parse().ok()?);
    valid_tiling(l, r).then_some((l, r))
}

/// [`env::GTURBO_GPU_X24_LANES`]: `qmatvec_x24`'s invocations per 4 rows for every
/// product (unset or not a power of two from 4 to 256: chosen per shape).
pub(crate) fn forced_x24_lanes() -> Option<u32> {
    let l: u32 = std::env::var(env::GTURBO_GPU_X24_LANES)
        .ok()?
        .trim()
        .parse()
        .ok()?;
    valid_x24_lanes(l).then_some(l)
}

/// The smallest product (in codes) that takes `qmatvec_x24` on `backend`, or `None`
/// for never. [`env::GTURBO_GPU_PACKED_X`]: `0` never, `1` every eligible product;
/// unset: on Vulkan and DX12 from [`PACKED_X_MIN_CODES`]; not on Metal, where the
/// packed dot products have no measured speed (naga may emulate them).
pub(crate) fn packed_x_min(backend: wgpu::Backend) -> Option<usize> {
    match env_usize(env::GTURBO_GPU_PACKED_X) {
        Some(0) => None,
        Some(_) => Some(0),
        None => matches!(backend, wgpu::Backend::Vulkan | wgpu::Backend::Dx12)
            .then_some(PACKED_X_MIN_CODES),
    }
}

/// [`env::GTURBO_GPU_SUBMIT_EVERY`]: dispatches per submit, when set.
pub(crate) fn submit_every() -> Option<usize> {
    env_usize(env::GTURBO_GPU_SUBMIT_EVERY)
}

/// Whether fused kernels run (gate/up/SwiGLU as one dispatch, a resident MoE layer
/// routed on the device): [`env::GTURBO_GPU_FUSE`]`=0` turns them off.
pub(crate) fn fuse() -> bool {
    env_usize(env::GTURBO_GPU_FUSE) != Some(0)
}

/// Whether decode attention over a long context may split its positions
/// ([`split_chunk`]): [`env::GTURBO_GPU_ATTN_SPLIT`]`=0` turns it off.
pub(crate) fn attn_split() -> bool {
    env_usize(env::GTURBO_GPU_ATTN_SPLIT) != Some(0)
}

/// Whether [`env::GTURBO_GPU_STATS`] asks for the figures (set, and not `0`).
pub(crate) fn profiling() -> bool {
    std::env::var_os(env::GTURBO_GPU_STATS).is_some_and(|v| v != "0")
}
