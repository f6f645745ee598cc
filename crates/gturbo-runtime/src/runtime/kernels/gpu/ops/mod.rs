//! The operations a runner calls, each recorded as one or a few dispatches. Shapes are
//! checked here, before anything is recorded, so a mismatch is an error and never an
//! out-of-bounds access on the device.

mod elementwise;
#[cfg(test)]
mod families_tests;
mod hyper;
mod launch;
mod linear_attention;
mod ngram;
mod sparse_attention;

pub use sparse_attention::GpuAttnCache;

use crate::runtime::kernels::RopeLayout;
use std::sync::Arc;

use wgpu::util::DeviceExt;

use super::context::GpuContext;
use super::error::{GpuError, Result};
use super::shaders::{
    AttnParams, ElementwiseParams, EmbedParams, FmatvecParams, Kernel, NormParams, QmatvecParams,
    QmatvecX24Params, RopeParams, Shader, SoftmaxParams,
};
use super::tensor::{
    DType, Encoding, ExpertSlots, GpuMatrix, GpuTensor, KvCache, RopeTable, Scratch,
};
use super::tuning::{self, split_chunk, use_tiled};
use crate::runtime::kernels::backend::Causal;

/// Rows one matrix-vector workgroup computes (`ROWS` in the shaders).
const MATVEC_ROWS: usize = 8;
/// Rows × tokens of one tiled matrix-matrix workgroup (`TR`, `TN`).
const TILE: usize = 8;
/// Invocations per workgroup of the one-thread-per-element kernels.
const ELEMENTWISE_WG: usize = 256;
/// Largest query and key head the attention kernel holds in workgroup memory
/// (`MAX_HEAD_DIM` in `attn.wgsl`): DeepSeek-V3's latent keys are 576 wide.
pub(crate) const MAX_HEAD_DIM: usize = 1024;
/// Largest value head the attention kernel's lanes hold (`WG · PER_LANE` in
/// `attn.wgsl`): DeepSeek-V3's latent values are 512 wide.
pub(crate) const MAX_V_DIM: usize = 512;

/// Words of packed x per 32 values of x: 8 for each of x24's three bytes, then step
/// and sum (`qmatvec_x24.wgsl`). Public for the matvec lab, which sizes its packed x
/// as the runtime does.
pub const PACKED_X_WORDS: usize = 26;

/// The experts a router chose: `[n, k]` ids (best first) and their weights.
#[derive(Debug, Clone)]
pub struct RouterOutput {
    /// Expert ids, u32.
    pub ids: GpuTensor,
    /// Routing weights, f32 (renormalised when asked).
    pub weights: GpuTensor,
}

fn shape_err(op: &'static str, message: String) -> GpuError {
    GpuError::Shape { op, message }
}

fn u32_of(op: &'static str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| shape_err(op, format!("{v} does not fit 32 bits")))
}

fn f32_tensor(op: &'static str, name: &str, t: &GpuTensor) -> Result<()> {
    if t.dtype() == DType::F32 {
        Ok(())
    } else {
        Err(shape_err(op, format!("{name} is {:?}, not F32", t.dtype())))
    }
}

fn distinct(op: &'static str, out: &GpuTensor, inputs: &[&GpuTensor]) -> Result<()> {
    if inputs.iter().any(|t| t.aliases(out)) {
        Err(shape_err(op, "the output is also an input".into()))
    } else {
        Ok(())
    }
}

/// `n` such that `len == n · width`, `n ≥ 1`.
fn rows_of(op: &'static str, name: &str, len: usize, width: usize) -> Result<usize> {
    if width == 0 || len == 0 || !len.is_multiple_of(width) {
        return Err(shape_err(
            op,
            format!("{name} has {len} elements, not a positive multiple of {width}"),
        ));
    }
    Ok(len / width)
}

/// The op name [`GpuContext::moe_resident`]'s shape errors carry.
const MOE_OP: &str = "moe";

/// What every expert pass of [`GpuContext::moe_resident`] shares.
struct MoeBufs<'a> {
    /// The layer's whole pool.
    pool: &'a wgpu::Buffer,
    /// The chosen experts' ids.
    ids: &'a wgpu::Buffer,
    /// Words from one expert to the next.
    e_stride: u32,
    /// `k`, as the kernel takes it.
    moe_k: u32,
    /// Experts per token.
    k: usize,
}

/// One expert pass: the matrix (and `up`, in the gate/up pass) with its affine
/// layout, and the pass's output rows and input columns.
struct MoePass<'a> {
    m: &'a GpuMatrix,
    up: Option<&'a GpuMatrix>,
    bits: u32,
    group: u32,
    rows: usize,
    cols: usize,
}

/// Whether the pool's matrices, `x`, `k` and `out` take the fast kernel.
fn moe_takes_fast(
    pool: &ExpertSlots,
    router: &GpuMatrix,
    x: &GpuTensor,
    k: usize,
    out: &GpuTensor,
    [gate, up, down]: [&GpuMatrix; 3],
) -> bool {
    let experts = router.rows;
    let fast = [gate, up, down].iter().all(|m| m.fast_path());
    let stride_words = pool.slot_bytes / 4;
    fast && gate.encoding == up.encoding
        && stride_words.is_multiple_of(4)
        && x.len() == router.cols
        && x.len() == gate.cols
        && out.len() == x.len()
        && pool.slots() == experts
        && k != 0
        && k <= experts
}

impl GpuContext {
    /// Whether the decode product of `w` takes the packed 24-bit x kernel.
    pub fn packed_x_takes(&self, w: &GpuMatrix) -> bool {
        w.x24_path() && self.packed_x_min().is_some_and(|m| w.rows * w.cols >= m)
    }

    /// The tiling `qmatvec_fast` takes for `w`.
    fn tiling(&self, w: &GpuMatrix) -> (u32, u32) {
        self.forced_tiling().unwrap_or_else(|| {
            let bits = match w.encoding {
                Encoding::Affine { bits, .. } => bits as usize,
                _ => 4,
            };
            tuning::matvec_tiling(w.cols * bits / 128, w.rows)
        })
    }

    /// `y = W·x` for each of the `n` rows of `x` (`x` is `[n, cols]`, `y` `[n,
    /// rows]`): the matrix-vector kernel for one token, the tiled one for more.
    pub fn matmul(&self, w: &GpuMatrix, x: &GpuTensor, y: &GpuTensor) -> Result<()> {
        const OP: &str = "matmul";
        f32_tensor(OP, "x", x)?;
        f32_tensor(OP, "y", y)?;
        distinct(OP, y, &[x])?;
        let n = rows_of(OP, "x", x.len(), w.cols)?;
        if y.len() != n * w.rows {
            return Err(shape_err(
                OP,
                format!(
                    "y has {} elements; {n} rows of a {}x{} product need {}",
                    y.len(),
                    w.rows,
                    w.cols,
                    n * w.rows
                ),
            ));
        }
        self.matmul_raw(w, &x.buf, &y.buf, n)
    }

    /// [`GpuContext::matmul`] over raw buffers holding at least `n` rows (shapes
    /// checked by the caller).
    pub(crate) fn matmul_raw(
        &self,
        w: &GpuMatrix,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        n: usize,
    ) -> Result<()> {
        const OP: &str = "matmul";
        let tiled = use_tiled(n);
        let groups = if tiled {
            w.rows.div_ceil(TILE) * n.div_ceil(TILE)
        } else {
            w.rows.div_ceil(MATVEC_ROWS) * n
        };
        let (rows, cols, n32) = (u32_of(OP, w.rows)?, u32_of(OP, w.cols)?, u32_of(OP, n)?);
        match w.encoding {
            Encoding::Affine { bits, group } => {
                let p = QmatvecParams {
                    rows,
                    cols,
                    n: n32,
                    w_off: w.w_off,
                    s_off: w.s_off,
                    b_off: w.b_off,
                    x_off: 0,
                    y_off: 0,
                    ..Default::default()
                };
                if !tiled && self.packed_x_takes(w) {
                    self.x24_matvec(w, x, y, group)
                } else if !tiled && w.fast_path() {
                    let (lanes, rps) = self.tiling(w);
                    self.fast_matvec(w, &p, x, y, lanes, rps, bits, group)
                } else {
                    self.dispatch(
                        &Kernel::qmat(bits, group, tiled),
                        &p.bytes(),
                        &[&w.buf, x, y],
                        groups,
                    )
                }
            }
            Encoding::Mxfp4 => {
                let p = QmatvecParams {
                    rows,
                    cols,
                    n: n32,
                    w_off: w.w_off,
                    s_off: w.s_off,
                    ..Default::default()
                };
                self.dispatch(
                    &Kernel::plain(Shader::Qmatvec, "mxfp4_matvec"),
                    &p.bytes(),
                    &[&w.buf, x, y],
                    w.rows.div_ceil(MATVEC_ROWS) * n,
                )
            }
            e => {
                let p = FmatvecParams {
                    rows,
                    cols,
                    n: n32,
                    d_off: w.w_off,
                    x_off: 0,
                    y_off: 0,
                };
                self.dispatch(
                    &Kernel::fmat(e.code(), tiled),
                    &p.bytes(),
                    &[&w.buf, x, y],
                    groups,
                )
            }
        }
    }

    /// `y = W·x` for one token through `qmatvec_x24`: x packed first, unless the
    /// packed buffer already holds this x (consecutive products of one x, as q, k and
    /// v are, pack it once). `w` passed [`GpuMatrix::x24_path`].
    pub(crate) fn x24_matvec(
        &self,
        w: &GpuMatrix,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        group: u32,
    ) -> Result<()> {
        const OP: &str = "matmul";
        let chunks = w.cols / 32;
        let p = QmatvecX24Params {
            rows: u32_of(OP, w.rows)?,
            cols: u32_of(OP, w.cols)?,
            w_off: w.w_off,
            s_off: w.s_off,
            b_off: w.b_off,
            x_off: 0,
            y_off: 0,
        }
        .bytes();
        let lanes = self.x24_lanes_for(chunks, w.rows);
        let need = (chunks * PACKED_X_WORDS * 4) as u64;
        self.with_packed_x(|held| {
            let buf = match &held.buf {
                Some(b) if b.size() >= need => b.clone(),
                _ => {
                    let b = self.buffer("packed x", need.next_power_of_two().max(1 << 16))?;
                    held.holds = None;
                    held.buf = Some(b.clone());
                    b
                }
            };
            let this = (x.clone(), w.cols);
            if held.holds.as_ref() != Some(&this) {
                held.holds = None;
                self.record_dispatch(
                    &Kernel::plain(Shader::QmatvecX24, "pack_x24"),
                    &p,
                    &[(3, x), (5, &buf)],
                    (chunks * 4).div_ceil(64),
                )?;
                held.holds = Some(this);
            }
            if y == x {
                held.holds = None;
            }
            self.record_dispatch(
                &Kernel::qmat_x24(group, lanes),
                &p,
                &[(1, &w.buf), (2, &w.buf), (4, y), (6, &buf), (7, &buf)],
                w.rows.div_ceil((256 / lanes * 4) as usize),
            )
        })
    }

    /// `qmatvec_fast` at a given tiling (`lanes` a power of two, 4 to 256; `rps` 1 to
    /// 4 rows per set), for `p.n` tokens.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn fast_matvec(
        &self,
        w: &GpuMatrix,
        p: &QmatvecParams,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        lanes: u32,
        rps: u32,
        bits: u32,
        group: u32,
    ) -> Result<()> {
        // The up-projection bindings of the fused SwiGLU (unused here) take `w` too.
        let per_wg = (256 / lanes * rps) as usize;
        self.dispatch_fast(
            &Kernel::qmat_fast(bits, group, lanes, rps, false),
            p,
            (w, w),
            x,
            y,
            w.rows.div_ceil(per_wg) * p.n as usize,
        )
    }

    /// Record one fast matrix-vector dispatch over `gate` (and `up`, for the fused
    /// SwiGLU kernel): the one place that knows its bindings. Codes and scales are the
    /// same buffer at two bindings each (u32 and vec4 views).
    fn dispatch_fast(
        &self,
        kernel: &Kernel,
        p: &QmatvecParams,
        (gate, up): (&GpuMatrix, &GpuMatrix),
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        workgroups: usize,
    ) -> Result<()> {
        self.dispatch_at(
            kernel,
            &p.bytes(),
            &[
                (1, &gate.buf),
                (3, y),
                (4, &gate.buf),
                (5, x),
                (6, &up.buf),
                (7, &up.buf),
                (8, &gate.buf),
            ],
            workgroups,
        )
    }

    /// `y = silu(gate·x) · (up·x)` for one token in one dispatch, when both matrices
    /// take the fast matrix-vector kernel with the same encoding and shape; `false`
    /// (nothing recorded) otherwise. Operands are checked by the caller.
    pub(crate) fn glu_raw(
        &self,
        gate: &GpuMatrix,
        up: &GpuMatrix,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
    ) -> Result<bool> {
        const OP: &str = "ffn_swiglu";
        let Encoding::Affine { bits, group } = gate.encoding else {
            return Ok(false);
        };
        if !self.fuse_glu
            || gate.encoding != up.encoding
            || (gate.rows, gate.cols) != (up.rows, up.cols)
            || !gate.fast_path()
            || !up.fast_path()
        {
            return Ok(false);
        }
        let (lanes, _) = self.tiling(gate);
        let p = QmatvecParams {
            rows: u32_of(OP, gate.rows)?,
            cols: u32_of(OP, gate.cols)?,
            n: 1,
            w_off: gate.w_off,
            s_off: gate.s_off,
            b_off: gate.b_off,
            w2_off: up.w_off,
            s2_off: up.s_off,
            b2_off: up.b_off,
            ..Default::default()
        };
        self.dispatch_fast(
            &Kernel::qmat_fast(bits, group, lanes, 2, true),
            &p,
            (gate, up),
            x,
            y,
            gate.rows.div_ceil((256 / lanes) as usize),
        )?;
        Ok(true)
    }

    /// RMSNorm of each `w.len()`-wide row of `x` into `out`:
    /// `x / sqrt(mean(x²) + eps) · w`, or `· (1 + w)` when `plus_one`.
    pub fn rms_norm(
        &self,
        x: &GpuTensor,
        w: &GpuTensor,
        eps: f32,
        plus_one: bool,
        out: &GpuTensor,
    ) -> Result<()> {
        const OP: &str = "rms_norm";
        for (name, t) in [("x", x), ("w", w), ("out", out)] {
            f32_tensor(OP, name, t)?;
        }
        distinct(OP, out, &[x, w])?;
        let d = w.len();
        let n = rows_of(OP, "x", x.len(), d)?;
        if out.len() != x.len() {
            return Err(shape_err(
                OP,
                format!("out has {} elements, x {}", out.len(), x.len()),
            ));
        }
        let p = NormParams {
            n: u32_of(OP, n)?,
            d: u32_of(OP, d)?,
            x_off: 0,
            out_off: 0,
            eps,
            add_one: u32::from(plus_one),
        };
        self.dispatch(
            &Kernel::plain(Shader::Norm, "rms_norm"),
            &p.bytes(),
            &[&x.buf, &w.buf, &out.buf],
            n,
        )
    }

    /// RoPE in place on `x` `[n, heads, head_dim]` at positions `pos0..pos0 + n`:
    /// the first `table.rot()` dims of each head rotated in the table's layout.
    pub fn rope(
        &self,
        table: &RopeTable,
        x: &GpuTensor,
        heads: usize,
        head_dim: usize,
        pos0: usize,
    ) -> Result<()> {
        const OP: &str = "rope";
        f32_tensor(OP, "x", x)?;
        let n = rows_of(OP, "x", x.len(), heads * head_dim)?;
        if table.rot > head_dim {
            return Err(shape_err(
                OP,
                format!("rotary width {} exceeds head width {head_dim}", table.rot),
            ));
        }
        if pos0 < table.first() || pos0 + n > table.positions() {
            return Err(shape_err(
                OP,
                format!(
                    "positions {pos0}..{} but the table covers {}..{}",
                    pos0 + n,
                    table.first(),
                    table.positions()
                ),
            ));
        }
        let p = RopeParams {
            n: u32_of(OP, n)?,
            heads: u32_of(OP, heads)?,
            head_dim: u32_of(OP, head_dim)?,
            rot: u32_of(OP, table.rot)?,
            // The kernel reads the table's row `pos0 + i`.
            pos0: u32_of(OP, pos0 - table.first())?,
            x_off: 0,
            interleaved: u32::from(table.layout == RopeLayout::Interleaved),
        };
        let threads = n * heads * table.rot / 2;
        self.dispatch(
            &Kernel::plain(Shader::Rope, "rope"),
            &p.bytes(),
            &[&x.buf, &table.table.buf],
            threads.div_ceil(64),
        )
    }

    /// Store the keys `[n, kv_heads·qk_dim]` and values `[n, kv_heads·v_dim]` of `n`
    /// new tokens at positions `pos0..pos0 + n` of the cache.
    pub fn kv_append(
        &self,
        cache: &KvCache,
        k: &GpuTensor,
        v: &GpuTensor,
        pos0: usize,
    ) -> Result<()> {
        const OP: &str = "kv_append";
        f32_tensor(OP, "k", k)?;
        f32_tensor(OP, "v", v)?;
        let (kw, vw) = (cache.spec.k_width(), cache.spec.stored_v_width());
        let n = rows_of(OP, "k", k.len(), kw)?;
        if vw > 0 && v.len() != n * vw {
            return Err(shape_err(
                OP,
                format!(
                    "v has {} elements for {n} rows of {vw} (k has {})",
                    v.len(),
                    k.len()
                ),
            ));
        }
        if pos0 < cache.start || pos0 - cache.start + n > cache.capacity {
            return Err(shape_err(
                OP,
                format!(
                    "positions {pos0}..{} outside the cache's {}..{}",
                    pos0 + n,
                    cache.start,
                    cache.start + cache.capacity
                ),
            ));
        }
        let row0 = pos0 - cache.start;
        for (from, to, width) in [(k, &cache.k, kw), (v, &cache.v, vw)] {
            let (at, bytes) = ((row0 * width * 4) as u64, (n * width * 4) as u64);
            if bytes > 0 {
                self.copy(&from.buf, 0, &to.buf, at, bytes);
            }
        }
        Ok(())
    }

    /// Causal attention of `q` `[n, at.heads·qk_dim]` (tokens at `at.pos..at.pos + n`,
    /// already appended to `cache`) into `out` `[n, at.heads·v_dim]`, as
    /// [`Backend::attention`](crate::runtime::kernels::Backend::attention) defines it
    /// for the cache's
    /// [`AttentionSpec`](crate::runtime::kernels::AttentionSpec) (widths, window) and `sinks` (`[at.heads]`).
    pub fn attention(
        &self,
        q: &GpuTensor,
        cache: &KvCache,
        at: Causal,
        sinks: Option<&GpuTensor>,
        out: &GpuTensor,
    ) -> Result<()> {
        const OP: &str = "attention";
        let Causal {
            pos: pos0,
            heads,
            scale,
        } = at;
        let spec = cache.spec;
        f32_tensor(OP, "q", q)?;
        f32_tensor(OP, "out", out)?;
        distinct(OP, out, &[q, &cache.k, &cache.v])?;
        let (qd, vd) = (spec.qk_dim, spec.v_dim);
        if qd == 0 || qd > MAX_HEAD_DIM {
            return Err(shape_err(
                OP,
                format!("query and key head width {qd} is not in 1..={MAX_HEAD_DIM}"),
            ));
        }
        if vd == 0 || vd > MAX_V_DIM {
            return Err(shape_err(
                OP,
                format!("value head width {vd} is not in 1..={MAX_V_DIM}"),
            ));
        }
        if spec.kv_heads == 0 || !heads.is_multiple_of(spec.kv_heads) {
            return Err(shape_err(
                OP,
                format!(
                    "{} KV heads do not divide {heads} query heads",
                    spec.kv_heads
                ),
            ));
        }
        let n = rows_of(OP, "q", q.len(), heads * qd)?;
        if out.len() != n * heads * vd
            || spec.first_seen(pos0) < cache.start
            || pos0 + n > cache.start + cache.capacity
        {
            return Err(shape_err(
                OP,
                format!(
                    "out of {} elements for q of {} ({n} tokens of {heads} heads of {vd}), \
                     positions {}..{} in a cache holding {}..{}",
                    out.len(),
                    q.len(),
                    spec.first_seen(pos0),
                    pos0 + n,
                    cache.start,
                    cache.start + cache.capacity
                ),
            ));
        }
        if let Some(s) = sinks {
            f32_tensor(OP, "sinks", s)?;
            distinct(OP, out, &[s])?;
            if s.len() != heads {
                return Err(shape_err(
                    OP,
                    format!("{} sinks for {heads} query heads", s.len()),
                ));
            }
        }
        // Without sinks the shader never reads its sinks binding, which still needs a
        // buffer: q's, read-only like it and never the output.
        let sinks_buf = sinks.map_or(&q.buf, |s| &s.buf);
        let p = AttnParams {
            n: u32_of(OP, n)?,
            heads: u32_of(OP, heads)?,
            kv_heads: u32_of(OP, spec.kv_heads)?,
            qk_dim: u32_of(OP, qd)?,
            v_dim: u32_of(OP, vd)?,
            pos0: u32_of(OP, pos0)?,
            q_off: 0,
            out_off: 0,
            scale,
            window: u32_of(OP, spec.window.unwrap_or(0))?,
            sinks: u32::from(sinks.is_some()),
            v_in_k: u32::from(spec.values_in_keys),
            kv_start: u32_of(OP, cache.start)?,
            ..Default::default()
        };
        // With values in the keys the value binding is the key rows.
        let values = if spec.values_in_keys {
            &cache.k.buf
        } else {
            &cache.v.buf
        };
        // The most positions one token sees: the chunks cover that span.
        let span = spec.window.map_or(pos0 + n, |w| w.min(pos0 + n));
        if self.attn_split
            && let Some(chunk) = split_chunk(n, heads, span)
        {
            let chunks = span.div_ceil(chunk);
            let part = self.attn_partials(n * heads * chunks * (2 + vd))?;
            let p = AttnParams {
                chunk: u32_of(OP, chunk)?,
                chunks: u32_of(OP, chunks)?,
                ..p
            };
            self.dispatch_at(
                &Kernel::plain(Shader::Attn, "attention_part"),
                &p.bytes(),
                &[(1, &q.buf), (2, &cache.k.buf), (3, values), (5, &part)],
                n * heads * chunks,
            )?;
            return self.dispatch_at(
                &Kernel::plain(Shader::Attn, "attention_combine"),
                &p.bytes(),
                &[(4, &out.buf), (5, &part), (6, sinks_buf)],
                n * heads,
            );
        }
        self.dispatch_at(
            &Kernel::plain(Shader::Attn, "attention"),
            &p.bytes(),
            &[
                (1, &q.buf),
                (2, &cache.k.buf),
                (3, values),
                (4, &out.buf),
                (6, sinks_buf),
            ],
            n * heads,
        )
    }

    fn elementwise(
        &self,
        op: &'static str,
        entry: &'static str,
        a: &GpuTensor,
        b: &GpuTensor,
    ) -> Result<()> {
        f32_tensor(op, "a", a)?;
        f32_tensor(op, "b", b)?;
        distinct(op, a, &[b])?;
        if a.len() != b.len() {
            return Err(shape_err(
                op,
                format!("lengths differ: {} and {}", a.len(), b.len()),
            ));
        }
        let p = ElementwiseParams {
            n: u32_of(op, a.len())?,
            d: 0,
            a_off: 0,
            b_off: 0,
        };
        self.dispatch(
            &Kernel::plain(Shader::Elementwise, entry),
            &p.bytes(),
            &[&a.buf, &b.buf],
            a.len().div_ceil(ELEMENTWISE_WG),
        )
    }

    /// SwiGLU's gating in place: `gate = silu(gate) · up`.
    pub fn swiglu(&self, gate: &GpuTensor, up: &GpuTensor) -> Result<()> {
        self.elementwise("swiglu", "swiglu", gate, up)
    }

    /// `x += y` (residual connections).
    pub fn add(&self, x: &GpuTensor, y: &GpuTensor) -> Result<()> {
        self.elementwise("add", "add", x, y)
    }

    /// `x[t] += bias` for each `bias.len()`-wide row of `x` (a projection's bias).
    pub fn add_bias(&self, x: &GpuTensor, bias: &GpuTensor) -> Result<()> {
        const OP: &str = "add_bias";
        f32_tensor(OP, "x", x)?;
        f32_tensor(OP, "bias", bias)?;
        distinct(OP, x, &[bias])?;
        rows_of(OP, "x", x.len(), bias.len())?;
        let p = ElementwiseParams {
            n: u32_of(OP, x.len())?,
            d: u32_of(OP, bias.len())?,
            a_off: 0,
            b_off: 0,
        };
        self.dispatch(
            &Kernel::plain(Shader::Elementwise, "add_bias"),
            &p.bytes(),
            &[&x.buf, &bias.buf],
            x.len().div_ceil(ELEMENTWISE_WG),
        )
    }

    fn softmax_params(&self, op: &'static str, x: &GpuTensor, d: usize) -> Result<SoftmaxParams> {
        f32_tensor(op, "x", x)?;
        let n = rows_of(op, "x", x.len(), d)?;
        Ok(SoftmaxParams {
            n: u32_of(op, n)?,
            d: u32_of(op, d)?,
            off: 0,
            k: 0,
            renorm: 0,
        })
    }

    /// Softmax in place over each `d`-wide row of `x`. Entries at or below `-3e38`
    /// count as masked (they become 0); a fully masked row is left alone.
    pub fn softmax(&self, x: &GpuTensor, d: usize) -> Result<()> {
        let p = self.softmax_params("softmax", x, d)?;
        self.dispatch(
            &Kernel::plain(Shader::Softmax, "softmax"),
            &p.bytes(),
            &[&x.buf],
            p.n as usize,
        )
    }

    /// MoE routing of `logits` `[n, experts]`: softmax, the `k` most probable
    /// experts (ties to the lower id), weights renormalised to sum 1 when `renorm`.
    /// `logits` is overwritten (probabilities, chosen entries marked).
    pub fn router_topk(
        &self,
        logits: &GpuTensor,
        experts: usize,
        k: usize,
        renorm: bool,
    ) -> Result<RouterOutput> {
        const OP: &str = "router_topk";
        let mut p = self.softmax_params(OP, logits, experts)?;
        if k == 0 || k > experts {
            return Err(shape_err(
                OP,
                format!("top-{k} of {experts} experts is not defined"),
            ));
        }
        p.k = u32_of(OP, k)?;
        p.renorm = u32::from(renorm);
        let n = p.n as usize;
        let out = RouterOutput {
            ids: self.zeros(&[n, k], DType::U32)?,
            weights: self.zeros(&[n, k], DType::F32)?,
        };
        self.router_topk_raw(&p, &logits.buf, &out.ids.buf, &out.weights.buf)?;
        Ok(out)
    }

    fn router_topk_raw(
        &self,
        p: &SoftmaxParams,
        logits: &wgpu::Buffer,
        ids: &wgpu::Buffer,
        weights: &wgpu::Buffer,
    ) -> Result<()> {
        self.dispatch(
            &Kernel::plain(Shader::Softmax, "router_topk"),
            &p.bytes(),
            &[logits, ids, weights],
            p.n as usize,
        )
    }

    /// The routed experts of one token on the device, with no read-back: route `x`
    /// (`[1, hidden]`) by `router`, then `out = Σ_j w_j · down_j(silu(gate_j x) ·
    /// up_j x)` over the `k` chosen experts of `pool` (a layer's whole pool on the
    /// device), the experts added in rank order. `false` (nothing recorded) when the
    /// pool's matrices do not take the fast kernel; the caller then routes on the
    /// host. `scratch` gives buffers of at least the asked length.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn moe_resident(
        &self,
        pool: &ExpertSlots,
        router: &GpuMatrix,
        x: &GpuTensor,
        k: usize,
        renorm: bool,
        out: &GpuTensor,
        scratch: &mut dyn FnMut(usize) -> Result<Arc<wgpu::Buffer>>,
    ) -> Result<bool> {
        let [gate, up, down] = pool.matrices(0)?;
        if !moe_takes_fast(pool, router, x, k, out, [&gate, &up, &down]) {
            return Ok(false);
        }
        let (h, inter) = (gate.cols, gate.rows);
        let (ids, wts) = self.moe_route(router, x, k, renorm, scratch)?;
        let hbuf = scratch(k * inter)?;
        let dbuf = scratch(k * h)?;
        let (
            Encoding::Affine { bits, group },
            Encoding::Affine {
                bits: dbits,
                group: dgroup,
            },
        ) = (gate.encoding, down.encoding)
        else {
            return Ok(false);
        };
        let e_stride = u32_of(MOE_OP, pool.slot_bytes / 4)?;
        let moe_k = u32_of(MOE_OP, k)?;
        let bufs = MoeBufs {
            pool: &pool.buf,
            ids: &ids,
            e_stride,
            moe_k,
            k,
        };
        let glu = MoePass {
            m: &gate,
            up: Some(&up),
            bits,
            group,
            rows: inter,
            cols: h,
        };
        self.moe_experts(&bufs, &glu, &x.buf, &hbuf)?;
        let down = MoePass {
            m: &down,
            up: None,
            bits: dbits,
            group: dgroup,
            rows: h,
            cols: inter,
        };
        self.moe_experts(&bufs, &down, &hbuf, &dbuf)?;
        let p = QmatvecParams {
            rows: u32_of(MOE_OP, h)?,
            n: 1,
            moe_k,
            ..Default::default()
        };
        self.dispatch_at(
            &Kernel::plain(Shader::Qmatvec, "moe_combine"),
            &p.bytes(),
            &[(2, &dbuf), (3, &out.buf), (9, &wts)],
            h.div_ceil(ELEMENTWISE_WG),
        )?;
        Ok(true)
    }

    /// Route one token: the router's logits into `experts` scratch words, then the
    /// top `k` ids and their weights.
    fn moe_route(
        &self,
        router: &GpuMatrix,
        x: &GpuTensor,
        k: usize,
        renorm: bool,
        scratch: &mut dyn FnMut(usize) -> Result<Arc<wgpu::Buffer>>,
    ) -> Result<(Arc<wgpu::Buffer>, Arc<wgpu::Buffer>)> {
        let experts = router.rows;
        let logits = scratch(experts)?;
        self.matmul_raw(router, &x.buf, &logits, 1)?;
        let ids = scratch(k)?;
        let wts = scratch(k)?;
        let sp = SoftmaxParams {
            n: 1,
            d: u32_of(MOE_OP, experts)?,
            off: 0,
            k: u32_of(MOE_OP, k)?,
            renorm: u32::from(renorm),
        };
        self.router_topk_raw(&sp, &logits, &ids, &wts)?;
        Ok((ids, wts))
    }

    /// One pass over the `k` chosen experts of the pool, `src` to `dst`: with
    /// `up`, `silu(m_j src) · up_j src` (two rows a lane group); without, `m_j src`
    /// (the tiling's rows).
    fn moe_experts(
        &self,
        bufs: &MoeBufs,
        pass: &MoePass,
        src: &wgpu::Buffer,
        dst: &wgpu::Buffer,
    ) -> Result<()> {
        let m = pass.m;
        let (lanes, rps) = self.tiling(m);
        let mut p = QmatvecParams {
            rows: u32_of(MOE_OP, pass.rows)?,
            cols: u32_of(MOE_OP, pass.cols)?,
            n: bufs.moe_k,
            w_off: m.w_off,
            s_off: m.s_off,
            b_off: m.b_off,
            moe_k: bufs.moe_k,
            e_stride: bufs.e_stride,
            ..Default::default()
        };
        let (kernel, per_group) = match pass.up {
            Some(up) => {
                (p.w2_off, p.s2_off, p.b2_off) = (up.w_off, up.s_off, up.b_off);
                let k = Kernel::qmat_moe(pass.bits, pass.group, lanes, 2, true, 1);
                (k, 256 / lanes)
            }
            None => {
                let k = Kernel::qmat_moe(pass.bits, pass.group, lanes, rps, false, 2);
                (k, 256 / lanes * rps)
            }
        };
        let b = bufs.pool;
        self.dispatch_at(
            &kernel,
            &p.bytes(),
            &[
                (1, b),
                (3, dst),
                (4, b),
                (5, src),
                (6, b),
                (7, b),
                (8, bufs.ids),
            ],
            pass.rows.div_ceil(per_group as usize) * bufs.k,
        )
    }

    /// A small read-only storage buffer made from `data` (routing lists, token ids).
    fn small_u32(&self, data: &[u32]) -> Arc<wgpu::Buffer> {
        let mut bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        bytes.resize(bytes.len().max(16), 0);
        Arc::new(
            self.device
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some("indices"),
                    contents: &bytes,
                    usage: wgpu::BufferUsages::STORAGE,
                }),
        )
    }

    /// Embedding rows of `tokens` from `table` into `out` `[tokens.len(), cols]`
    /// (ids are checked against the table's rows here).
    pub fn embed(&self, table: &GpuMatrix, tokens: &[u32], out: &GpuTensor) -> Result<()> {
        const OP: &str = "embed";
        f32_tensor(OP, "out", out)?;
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= table.rows) {
            return Err(shape_err(
                OP,
                format!("token id {t} is outside the table's {} rows", table.rows),
            ));
        }
        if tokens.is_empty() || out.len() != tokens.len() * table.cols {
            return Err(shape_err(
                OP,
                format!(
                    "out has {} elements for {} tokens of width {}",
                    out.len(),
                    tokens.len(),
                    table.cols
                ),
            ));
        }
        let (bits, group) = match table.encoding {
            Encoding::Affine { bits, group } => (bits, group),
            Encoding::Mxfp4 => {
                return Err(shape_err(
                    OP,
                    "an MXFP4 (mxfp4_g32) table has no gather kernel (only experts are \
                     stored so)"
                        .into(),
                ));
            }
            _ => (4, 64),
        };
        let p = EmbedParams {
            n: u32_of(OP, tokens.len())?,
            cols: u32_of(OP, table.cols)?,
            w_off: table.w_off,
            s_off: table.s_off,
            b_off: table.b_off,
            out_off: 0,
        };
        let ids = self.small_u32(tokens);
        self.dispatch(
            &Kernel::embed(table.encoding.code(), bits, group),
            &p.bytes(),
            &[&table.buf, &ids, &out.buf],
            out.len().div_ceil(ELEMENTWISE_WG),
        )
    }

    /// One routed expert over the tokens that chose it: `out[t] += weight ·
    /// down(silu(gate x_t) · up x_t)` for each `(tokens[r], weights[r])`, with the
    /// expert's blob in `slot` of `slots`. `x` and `out` are `[n, hidden]`; `tokens`
    /// must be distinct rows of them.
    pub fn expert_ffn(
        &self,
        slots: &ExpertSlots,
        slot: usize,
        x: &GpuTensor,
        tokens: &[u32],
        weights: &[f32],
        out: &GpuTensor,
    ) -> Result<()> {
        const OP: &str = "expert_ffn";
        f32_tensor(OP, "x", x)?;
        f32_tensor(OP, "out", out)?;
        distinct(OP, out, &[x])?;
        let h = slots.hidden;
        let n = rows_of(OP, "x", x.len(), h)?;
        let m = tokens.len();
        let mut seen = vec![false; n];
        for &t in tokens {
            let t = t as usize;
            if t >= n || std::mem::replace(&mut seen[t], true) {
                return Err(shape_err(
                    OP,
                    format!("token rows {tokens:?} are not distinct rows below {n}"),
                ));
            }
        }
        if m == 0 || weights.len() != m || out.len() != x.len() {
            return Err(shape_err(
                OP,
                format!(
                    "{m} tokens with {} weights; out of {} for x of {}",
                    weights.len(),
                    out.len(),
                    x.len()
                ),
            ));
        }
        let mats = slots.matrices(slot)?;
        let scratch = slots.scratch(self, m)?;
        self.expert_ffn_with(&mats, &scratch, x, tokens, weights, out)
    }

    /// Rows `rows` of the `width`-wide rows of `x` into `out` (`[rows.len(), width]`);
    /// operands checked by the caller.
    pub(crate) fn gather_rows(
        &self,
        x: &GpuTensor,
        out: &GpuTensor,
        rows: &[u32],
        width: usize,
    ) -> Result<()> {
        const OP: &str = "gather_rows";
        if rows.is_empty() || width == 0 {
            return Ok(());
        }
        let p = ElementwiseParams {
            n: u32_of(OP, rows.len())?,
            d: u32_of(OP, width)?,
            a_off: 0,
            b_off: 0,
        };
        self.dispatch(
            &Kernel::plain(Shader::Elementwise, "gather_rows"),
            &p.bytes(),
            &[&out.buf, &x.buf, &self.small_u32(rows)],
            (rows.len() * width).div_ceil(ELEMENTWISE_WG),
        )
    }

    /// Row `rows[r]` of `out` `+= weights[r] ·` row `r` of `x` (rows `width` wide,
    /// `rows` distinct); operands checked by the caller.
    pub(crate) fn scatter_add_rows(
        &self,
        x: &GpuTensor,
        out: &GpuTensor,
        rows: &[u32],
        weights: &[f32],
        width: usize,
    ) -> Result<()> {
        const OP: &str = "scatter_add_rows";
        if rows.is_empty() || width == 0 {
            return Ok(());
        }
        let p = ElementwiseParams {
            n: u32_of(OP, rows.len())?,
            d: u32_of(OP, width)?,
            a_off: 0,
            b_off: 0,
        };
        let wts = self.small_u32(&weights.iter().map(|w| w.to_bits()).collect::<Vec<_>>());
        self.dispatch(
            &Kernel::plain(Shader::Elementwise, "scatter_add"),
            &p.bytes(),
            &[&out.buf, &x.buf, &self.small_u32(rows), &wts],
            (rows.len() * width).div_ceil(ELEMENTWISE_WG),
        )
    }

    /// [`GpuContext::expert_ffn`] over the matrices of one expert, with `scratch` for
    /// at least `tokens.len()` rows (operands checked by the caller).
    pub(crate) fn expert_ffn_with(
        &self,
        mats: &[GpuMatrix; 3],
        scratch: &Scratch,
        x: &GpuTensor,
        tokens: &[u32],
        weights: &[f32],
        out: &GpuTensor,
    ) -> Result<()> {
        const OP: &str = "expert_ffn";
        let [gate, up, down] = mats;
        let (h, inter) = (gate.cols, gate.rows);
        let m = tokens.len();
        let rows = self.small_u32(tokens);
        let wts = self.small_u32(&weights.iter().map(|w| w.to_bits()).collect::<Vec<_>>());
        let move_params = ElementwiseParams {
            n: u32_of(OP, m)?,
            d: u32_of(OP, h)?,
            a_off: 0,
            b_off: 0,
        };
        let groups = (m * h).div_ceil(ELEMENTWISE_WG);
        self.dispatch(
            &Kernel::plain(Shader::Elementwise, "gather_rows"),
            &move_params.bytes(),
            &[&scratch.xs, &x.buf, &rows],
            groups,
        )?;
        if m != 1 || !self.glu_raw(gate, up, &scratch.xs, &scratch.g)? {
            self.matmul_raw(gate, &scratch.xs, &scratch.g, m)?;
            self.matmul_raw(up, &scratch.xs, &scratch.u, m)?;
            let glu = ElementwiseParams {
                n: u32_of(OP, m * inter)?,
                d: 0,
                a_off: 0,
                b_off: 0,
            };
            self.dispatch(
                &Kernel::plain(Shader::Elementwise, "swiglu"),
                &glu.bytes(),
                &[&scratch.g, &scratch.u],
                (m * inter).div_ceil(ELEMENTWISE_WG),
            )?;
        }
        self.matmul_raw(down, &scratch.g, &scratch.d, m)?;
        self.dispatch(
            &Kernel::plain(Shader::Elementwise, "scatter_add"),
            &move_params.bytes(),
            &[&out.buf, &scratch.d, &rows, &wts],
            groups,
        )
    }
}
