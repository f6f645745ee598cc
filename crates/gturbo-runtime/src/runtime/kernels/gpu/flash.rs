//! [`FlashOps`] for [`Gpu`]: the Flash-Next runner's own operations as WGSL kernels
//! (`shaders/flash_*.wgsl`), so a Flash-Next token's forward pass stays on the device
//! like a decoder's: the `[n, S·H]` residual, the hyper-connection reads and
//! write-backs, the GDN conv and recurrent state, the PLE gate and conv state, the
//! indexed-attention cache (keys, values, the indexer's raw and pooled keys) are
//! device buffers.
//!
//! # What crosses to the host, and why
//! - **The indexer's block scores** (`[n, blocks]` f32 per indexed layer and call):
//!   the selection is `torch.topk`'s tie rule ([`crate::runtime::flash_next::topk`]), a
//!   line-by-line port of libstdc++'s `nth_element`/`partial_sort`; the host runs the
//!   same code as on the CPU, and the chosen block ids go back as a small index list.
//! - **The MoE routing** (the core seam's [`Backend::route`]): the host reads the chosen
//!   experts' blobs.
//! - **The PLE rows**: the n-gram row ids are exact 64-bit integer arithmetic on the
//!   host, the rows come from the row cache (`pread`), and the `[n, ple_embed_dim]`
//!   rows go up through [`Backend::upload`] each call.
//! - The logits (sampling).
//!
//! # Numerics
//! Everything accumulates in f32, as on the CPU. Sums that the CPU adds in order (the
//! hyper-connection mix over streams, the conv taps, the delta rule's sums over `dk`,
//! the indexer's block mean and its sum over heads) are added in the same order here;
//! sums the CPU adds with its SIMD `dot` (norms, the PLE gate, l2 norms, the indexer's
//! and the attention's dot products) are workgroup tree sums or sequential loops. The
//! sigmoid is the two-sided `e^x / (1 + e^x)` below zero (no infinity under Metal's
//! fast math); `exp`/`log`/`sqrt` are the GPU's. Constants the CPU derives on the host
//! (`√H`, `√dk`, `√d_i`) are computed on the host here too. The tolerances the
//! conformance harness holds (`flash_next::conformance`) are in `docs/GPU.md`.

use std::ops::Range;

use wgpu::util::DeviceExt;

use super::backend::{Gpu, GpuBuf, GpuRope};
use super::context::GpuContext;
use super::error::{GpuError, Result};
use super::shaders::{
    ConvParams, FlashAttnParams, FlashElementwiseParams, FlashNormParams, FlashShader, GdnParams,
    IndexerParams, Kernel, Shader,
};
use super::tensor::{DType, GpuTensor};
use crate::runtime::flash_next::norm::GateAct;
use crate::runtime::flash_next::seam::{Act, FlashOps, GdnDims, HcDims, IndexerDims};
use crate::runtime::kernels::backend::{Backend, BackendError, Causal, OpResult};

/// Invocations per workgroup of the one-thread-per-element kernels.
const WG_ELEMENTS: usize = 256;
/// Invocations per workgroup of `scores` (one per (token, block)).
const WG_SCORES: usize = 64;
/// The widest GDN key head, indexer head and attention head the kernels hold in
/// workgroup memory.
const MAX_WIDTH: usize = 256;
/// Positions an indexed-attention cache holds before it first grows (it doubles).
const CACHE_START: usize = 256;

fn kernel(shader: FlashShader, entry: &'static str) -> Kernel {
    Kernel::plain(Shader::Flash(shader), entry)
}

fn shape(op: &'static str, message: String) -> GpuError {
    GpuError::Shape { op, message }
}

/// `Ok` when `ok`, else the shape error `message` names.
fn need(op: &'static str, ok: bool, message: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(shape(op, message()))
    }
}

fn u32_of(op: &'static str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| shape(op, format!("{v} does not fit 32 bits")))
}

/// `len / width` when `len` is whole rows of `width` (zero rows allowed).
fn rows(op: &'static str, what: &str, len: usize, width: usize) -> Result<usize> {
    need(op, width > 0 && len.is_multiple_of(width), || {
        format!("{what} has {len} elements, not rows of {width}")
    })?;
    Ok(len / width)
}

fn buf(b: &GpuBuf) -> &wgpu::Buffer {
    &b.tensor().buf
}

/// A read-only index list for one dispatch (not counted as held memory: it lives as
/// long as the recorded work that reads it).
fn indices(ctx: &GpuContext, data: &[u32]) -> wgpu::Buffer {
    let mut bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    bytes.resize(bytes.len().max(16), 0);
    ctx.device
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("indexer selection"),
            contents: &bytes,
            usage: wgpu::BufferUsages::STORAGE,
        })
}

/// One indexed-attention layer's cache on the device: keys (after norm and RoPE) and
/// values `[capacity, kv_heads·head_dim]`, the indexer's raw keys `[capacity, d_i]`
/// and the pooled block keys `[capacity / cr + 1, d_i]`. It doubles as positions
/// arrive.
pub struct GpuAttnCache {
    k: GpuTensor,
    v: GpuTensor,
    raw: GpuTensor,
    blocks: GpuTensor,
    capacity: usize,
    /// Positions of keys and values held.
    kv_len: usize,
    /// Positions of raw indexer keys held.
    raw_len: usize,
    /// Blocks pooled.
    pooled: usize,
    kv_heads: usize,
    head_dim: usize,
    indexer: IndexerDims,
}

impl GpuAttnCache {
    fn new(
        ctx: &GpuContext,
        capacity: usize,
        kv_heads: usize,
        head_dim: usize,
        indexer: IndexerDims,
    ) -> Result<GpuAttnCache> {
        let kvw = kv_heads * head_dim;
        let di = indexer.head_dim;
        Ok(GpuAttnCache {
            k: ctx.zeros(&[capacity, kvw], DType::F32)?,
            v: ctx.zeros(&[capacity, kvw], DType::F32)?,
            raw: ctx.zeros(&[capacity, di], DType::F32)?,
            blocks: ctx.zeros(&[capacity / indexer.compress + 1, di], DType::F32)?,
            capacity,
            kv_len: 0,
            raw_len: 0,
            pooled: 0,
            kv_heads,
            head_dim,
            indexer,
        })
    }

    /// Room for `positions`, growing (by doubling) and copying what is held.
    fn reserve(&mut self, ctx: &GpuContext, positions: usize) -> Result<()> {
        if positions <= self.capacity {
            return Ok(());
        }
        let cap = (2 * self.capacity).max(positions);
        let mut grown = GpuAttnCache::new(ctx, cap, self.kv_heads, self.head_dim, self.indexer)?;
        let (kvw, di) = (self.kv_heads * self.head_dim, self.indexer.head_dim);
        let copy = |from: &GpuTensor, to: &GpuTensor, elems: usize| {
            if elems > 0 {
                ctx.copy(&from.buf, 0, &to.buf, 0, (elems * 4) as u64);
            }
        };
        copy(&self.k, &grown.k, self.kv_len * kvw);
        copy(&self.v, &grown.v, self.kv_len * kvw);
        copy(&self.raw, &grown.raw, self.raw_len * di);
        copy(&self.blocks, &grown.blocks, self.pooled * di);
        (grown.kv_len, grown.raw_len, grown.pooled) = (self.kv_len, self.raw_len, self.pooled);
        *self = grown;
        Ok(())
    }

    /// Pool the blocks up to `nb` not pooled yet, with `p`'s indexer geometry.
    fn pool_blocks(
        &mut self,
        ctx: &GpuContext,
        p: &mut IndexerParams,
        k_norm: &GpuBuf,
        table: &wgpu::Buffer,
        nb: usize,
    ) -> Result<()> {
        const OP: &str = "indexer_scores";
        if nb > self.pooled {
            p.n = u32_of(OP, nb - self.pooled)?;
            p.first = u32_of(OP, self.pooled)?;
            ctx.dispatch_at(
                &kernel(FlashShader::Indexer, "pool"),
                &p.bytes(),
                &[
                    (1, &*self.raw.buf),
                    (2, buf(k_norm)),
                    (3, table),
                    (4, &*self.blocks.buf),
                ],
                nb - self.pooled,
            )?;
            self.pooled = nb;
        }
        Ok(())
    }
}

/// The tokens of an `indexer_scores` call (`raw`'s rows), its inputs checked
/// against the cache's indexer geometry, the cached length and the rotary table
/// (`rot` wide, `positions` long).
fn indexer_tokens(
    cache: &GpuAttnCache,
    iq: &GpuBuf,
    raw: &GpuBuf,
    k_norm: &GpuBuf,
    (rot, positions): (usize, usize),
    pos: usize,
) -> Result<usize> {
    const OP: &str = "indexer_scores";
    let ix = cache.indexer;
    let (di, ni) = (ix.head_dim, ix.heads);
    let t = rows(OP, "raw", raw.len(), di)?;
    need(OP, iq.len() == t * ni * di && k_norm.len() == di, || {
        format!(
            "iq of {}, k_norm of {} for {t} tokens of {ni} heads of {di}",
            iq.len(),
            k_norm.len()
        )
    })?;
    need(OP, pos <= cache.raw_len, || {
        format!("position {pos} past the {} cached", cache.raw_len)
    })?;
    need(OP, rot <= di && pos + t <= positions, || {
        format!(
            "rotary width {rot} on heads of {di}, positions up to {} of {positions}",
            pos + t,
        )
    })?;
    Ok(t)
}

impl Gpu {
    fn flash<T>(&self, op: &'static str, r: Result<T>) -> OpResult<T> {
        r.map_err(|e| BackendError::new(self.name(), op, e))
    }

    /// One dispatch of `flash_elementwise.wgsl`'s `entry` over `n` elements.
    fn elementwise(
        &self,
        entry: &'static str,
        p: FlashElementwiseParams,
        bufs: &[(u32, &wgpu::Buffer)],
    ) -> Result<()> {
        self.context().dispatch_at(
            &kernel(FlashShader::Elementwise, entry),
            &p.bytes(),
            bufs,
            (p.n as usize).div_ceil(WG_ELEMENTS),
        )
    }

    fn norm_kernel(
        &self,
        entry: &'static str,
        p: FlashNormParams,
        bufs: &[(u32, &wgpu::Buffer)],
    ) -> Result<()> {
        self.context().dispatch_at(
            &kernel(FlashShader::Norm, entry),
            &p.bytes(),
            bufs,
            p.n as usize,
        )
    }
}

impl FlashOps for Gpu {
    type AttnCache = GpuAttnCache;

    fn norm_grouped(
        &self,
        x: &GpuBuf,
        w: &GpuBuf,
        group: usize,
        eps: f32,
        out: &mut GpuBuf,
    ) -> OpResult {
        const OP: &str = "norm_grouped";
        let run = || -> Result<()> {
            need(
                OP,
                group > 0 && w.len().is_multiple_of(group) && !w.is_empty(),
                || format!("a weight of {} is not pieces of {group}", w.len()),
            )?;
            rows(OP, "x", x.len(), w.len())?;
            need(OP, out.len() == x.len(), || {
                format!("out has {} elements, x {}", out.len(), x.len())
            })?;
            let p = FlashNormParams {
                n: u32_of(OP, x.len() / group)?,
                d: u32_of(OP, group)?,
                wd: u32_of(OP, w.len())?,
                eps,
                ..FlashNormParams::default()
            };
            self.norm_kernel(
                "norm_grouped",
                p,
                &[(1, buf(x)), (2, buf(w)), (3, buf(out))],
            )
        };
        self.flash(OP, run())
    }

    fn act(&self, x: &mut GpuBuf, act: Act) -> OpResult {
        let (mode, c) = match act {
            Act::SiluOver(d) => (0, d),
            Act::Sigmoid => (1, 1.0),
            Act::TwoSigmoidOver(d) => (2, d),
        };
        let run = || -> Result<()> {
            let p = FlashElementwiseParams {
                n: u32_of("act", x.len())?,
                mode,
                c,
                ..FlashElementwiseParams::default()
            };
            self.elementwise("act", p, &[(1, buf(x))])
        };
        self.flash("act", run())
    }

    fn sigmoid_mul(&self, x: &mut GpuBuf, gate: &GpuBuf) -> OpResult {
        const OP: &str = "sigmoid_mul";
        let run = || -> Result<()> {
            need(OP, x.len() == gate.len(), || {
                format!("lengths differ: {} and {}", x.len(), gate.len())
            })?;
            let p = FlashElementwiseParams {
                n: u32_of(OP, x.len())?,
                ..FlashElementwiseParams::default()
            };
            self.elementwise("sigmoid_mul", p, &[(1, buf(x)), (2, buf(gate))])
        };
        self.flash(OP, run())
    }

    fn scale_rows_sigmoid(&self, x: &mut GpuBuf, g: &GpuBuf) -> OpResult {
        const OP: &str = "scale_rows_sigmoid";
        let run = || -> Result<()> {
            if x.is_empty() {
                return Ok(());
            }
            rows(OP, "x", x.len(), g.len())?;
            let p = FlashElementwiseParams {
                n: u32_of(OP, x.len())?,
                d: u32_of(OP, x.len() / g.len())?,
                ..FlashElementwiseParams::default()
            };
            self.elementwise("scale_rows", p, &[(1, buf(x)), (2, buf(g))])
        };
        self.flash(OP, run())
    }

    fn gather_cols(
        &self,
        x: &GpuBuf,
        width: usize,
        cols: Range<usize>,
        out: &mut GpuBuf,
    ) -> OpResult {
        const OP: &str = "gather_cols";
        let run = || -> Result<()> {
            let n = rows(OP, "x", x.len(), width)?;
            need(OP, cols.start <= cols.end && cols.end <= width, || {
                format!("columns {cols:?} of rows of {width}")
            })?;
            need(OP, out.len() == n * cols.len(), || {
                format!("out has {} elements for {n} rows of {cols:?}", out.len())
            })?;
            let p = FlashElementwiseParams {
                n: u32_of(OP, out.len())?,
                d: u32_of(OP, width)?,
                s: u32_of(OP, cols.len())?,
                mode: u32_of(OP, cols.start)?,
                c: 0.0,
            };
            self.elementwise("gather_cols", p, &[(1, buf(out)), (2, buf(x))])
        };
        self.flash(OP, run())
    }

    fn hc_expand(&self, e: &GpuBuf, d: HcDims, out: &mut GpuBuf) -> OpResult {
        const OP: &str = "hc_expand";
        let run = || -> Result<()> {
            let n = rows(OP, "e", e.len(), d.hidden)?;
            need(OP, out.len() == n * d.width(), || {
                format!(
                    "out has {} elements for {n} rows of {}",
                    out.len(),
                    d.width()
                )
            })?;
            let p = FlashElementwiseParams {
                n: u32_of(OP, out.len())?,
                d: u32_of(OP, d.hidden)?,
                s: u32_of(OP, d.streams)?,
                ..FlashElementwiseParams::default()
            };
            self.elementwise("hc_expand", p, &[(1, buf(out)), (2, buf(e))])
        };
        self.flash(OP, run())
    }

    fn hc_mix(&self, mix: &GpuBuf, xn: &GpuBuf, d: HcDims, out: &mut GpuBuf) -> OpResult {
        const OP: &str = "hc_mix";
        let run = || -> Result<()> {
            let n = rows(OP, "mix", mix.len(), d.width())?;
            need(
                OP,
                xn.len() == mix.len() && out.len() == n * d.hidden,
                || {
                    format!(
                        "xn of {}, out of {} for mix of {}",
                        xn.len(),
                        out.len(),
                        mix.len()
                    )
                },
            )?;
            let p = FlashElementwiseParams {
                n: u32_of(OP, out.len())?,
                d: u32_of(OP, d.hidden)?,
                s: u32_of(OP, d.streams)?,
                ..FlashElementwiseParams::default()
            };
            self.elementwise("hc_mix", p, &[(1, buf(out)), (2, buf(mix)), (3, buf(xn))])
        };
        self.flash(OP, run())
    }

    fn hc_inject(&self, x: &mut GpuBuf, inject: &GpuBuf, y: &GpuBuf, d: HcDims) -> OpResult {
        const OP: &str = "hc_inject";
        let run = || -> Result<()> {
            let n = rows(OP, "y", y.len(), d.hidden)?;
            need(
                OP,
                x.len() == n * d.width() && inject.len() == n * d.streams,
                || format!("x of {}, inject of {} for {n} rows", x.len(), inject.len()),
            )?;
            let p = FlashElementwiseParams {
                n: u32_of(OP, x.len())?,
                d: u32_of(OP, d.hidden)?,
                s: u32_of(OP, d.streams)?,
                ..FlashElementwiseParams::default()
            };
            self.elementwise(
                "hc_inject",
                p,
                &[(1, buf(x)), (2, buf(y)), (3, buf(inject))],
            )
        };
        self.flash(OP, run())
    }

    fn causal_conv_silu(
        &self,
        x: &GpuBuf,
        w: &GpuBuf,
        taps: usize,
        dilation: usize,
        state: &mut GpuBuf,
        out: &mut GpuBuf,
    ) -> OpResult {
        const OP: &str = "causal_conv_silu";
        let run = |state: &mut GpuBuf| -> Result<()> {
            need(OP, taps > 0 && dilation > 0, || {
                format!("{taps} taps at dilation {dilation}")
            })?;
            let ch = rows(OP, "w", w.len(), taps)?;
            let n = rows(OP, "x", x.len(), ch)?;
            let past = (taps - 1) * dilation;
            need(OP, state.len() == past * ch && out.len() == x.len(), || {
                format!(
                    "state of {} (want {}), out of {} for x of {}",
                    state.len(),
                    past * ch,
                    out.len(),
                    x.len()
                )
            })?;
            if n == 0 {
                return Ok(());
            }
            let p = ConvParams {
                n: u32_of(OP, n)?,
                ch: u32_of(OP, ch)?,
                taps: u32_of(OP, taps)?,
                dilation: u32_of(OP, dilation)?,
                past: u32_of(OP, past)?,
            };
            let ctx = self.context();
            ctx.dispatch_at(
                &kernel(FlashShader::Conv, "conv_silu"),
                &p.bytes(),
                &[(1, buf(x)), (2, buf(w)), (3, buf(state)), (4, buf(out))],
                (n * ch).div_ceil(WG_ELEMENTS),
            )?;
            if past == 0 {
                return Ok(());
            }
            if n >= past {
                // The new state is the last `past` rows of x.
                let bytes = (past * ch * 4) as u64;
                ctx.copy(buf(x), ((n - past) * ch * 4) as u64, buf(state), 0, bytes);
                return Ok(());
            }
            // The state shifts by n rows: read the old one from a copy.
            let old = self.scratch(state.len())?;
            ctx.copy(buf(state), 0, buf(&old), 0, (state.len() * 4) as u64);
            ctx.dispatch_at(
                &kernel(FlashShader::Conv, "conv_state"),
                &p.bytes(),
                &[(1, buf(x)), (3, buf(&old)), (5, buf(state))],
                (past * ch).div_ceil(WG_ELEMENTS),
            )
        };
        self.flash(OP, run(state))
    }

    fn gdn_recurrence(
        &self,
        conv: &GpuBuf,
        b: &GpuBuf,
        a: &GpuBuf,
        a_log: &GpuBuf,
        dt_bias: &GpuBuf,
        dims: &GdnDims,
        state: &mut GpuBuf,
        core: &mut GpuBuf,
    ) -> OpResult {
        const OP: &str = "gdn_recurrence";
        let run = |state: &mut GpuBuf, core: &mut GpuBuf| -> Result<()> {
            let (nk, dk, nv, dv) = (
                dims.key_heads,
                dims.key_dim,
                dims.value_heads,
                dims.value_dim,
            );
            need(
                OP,
                nk > 0 && nv.is_multiple_of(nk) && (1..=MAX_WIDTH).contains(&dk) && dv > 0,
                || {
                    format!(
                        "{nv} value heads of {dv} over {nk} key heads of {dk} (at most {MAX_WIDTH})"
                    )
                },
            )?;
            let n = rows(OP, "conv", conv.len(), dims.channels())?;
            need(
                OP,
                b.len() == n * nv
                    && a.len() == n * nv
                    && a_log.len() == nv
                    && dt_bias.len() == nv
                    && core.len() == n * nv * dv
                    && state.len() == nv * dk * dv,
                || {
                    format!(
                        "b {}, a {}, A_log {}, dt_bias {}, core {}, state {} for {n} tokens",
                        b.len(),
                        a.len(),
                        a_log.len(),
                        dt_bias.len(),
                        core.len(),
                        state.len()
                    )
                },
            )?;
            if n == 0 {
                return Ok(());
            }
            let p = GdnParams {
                n: u32_of(OP, n)?,
                nk: u32_of(OP, nk)?,
                dk: u32_of(OP, dk)?,
                nv: u32_of(OP, nv)?,
                dv: u32_of(OP, dv)?,
                scale: (dk as f32).sqrt(),
            };
            self.context().dispatch_at(
                &kernel(FlashShader::Gdn, "gdn"),
                &p.bytes(),
                &[
                    (1, buf(conv)),
                    (2, buf(b)),
                    (3, buf(a)),
                    (4, buf(a_log)),
                    (5, buf(dt_bias)),
                    (6, buf(state)),
                    (7, buf(core)),
                ],
                nv,
            )
        };
        self.flash(OP, run(state, core))
    }

    fn gated_norm(
        &self,
        o: &GpuBuf,
        z: &GpuBuf,
        w: &GpuBuf,
        eps: f32,
        act: GateAct,
        out: &mut GpuBuf,
    ) -> OpResult {
        const OP: &str = "gated_norm";
        let run = || -> Result<()> {
            let n = rows(OP, "o", o.len(), w.len())?;
            need(OP, z.len() == o.len() && out.len() == o.len(), || {
                format!(
                    "z of {}, out of {} for o of {}",
                    z.len(),
                    out.len(),
                    o.len()
                )
            })?;
            let p = FlashNormParams {
                n: u32_of(OP, n)?,
                d: u32_of(OP, w.len())?,
                wd: u32_of(OP, w.len())?,
                mode: match act {
                    GateAct::Sigmoid => 0,
                    GateAct::Silu => 1,
                },
                eps,
                scale: 1.0,
            };
            self.norm_kernel(
                "gated_norm",
                p,
                &[(1, buf(o)), (2, buf(w)), (3, buf(out)), (4, buf(z))],
            )
        };
        self.flash(OP, run())
    }

    fn ple_gate(
        &self,
        key: &GpuBuf,
        qry: &GpuBuf,
        value: &GpuBuf,
        d: HcDims,
        out: &mut GpuBuf,
    ) -> OpResult {
        const OP: &str = "ple_gate";
        let run = || -> Result<()> {
            let t = rows(OP, "value", value.len(), d.hidden)?;
            need(
                OP,
                key.len() == t * d.width() && qry.len() == key.len() && out.len() == key.len(),
                || {
                    format!(
                        "key {}, qry {}, out {} for {t} tokens of {}",
                        key.len(),
                        qry.len(),
                        out.len(),
                        d.width()
                    )
                },
            )?;
            let p = FlashNormParams {
                n: u32_of(OP, t * d.streams)?,
                d: u32_of(OP, d.hidden)?,
                wd: u32_of(OP, d.streams)?,
                mode: 0,
                eps: 0.0,
                scale: (d.hidden as f32).sqrt(),
            };
            self.norm_kernel(
                "ple_gate",
                p,
                &[(1, buf(key)), (2, buf(value)), (3, buf(out)), (4, buf(qry))],
            )
        };
        self.flash(OP, run())
    }

    fn attn_cache(
        &self,
        kv_heads: usize,
        head_dim: usize,
        indexer: IndexerDims,
    ) -> OpResult<GpuAttnCache> {
        const OP: &str = "attn_cache";
        let run = || -> Result<GpuAttnCache> {
            need(
                OP,
                kv_heads > 0
                    && (1..=MAX_WIDTH).contains(&head_dim)
                    && (1..=MAX_WIDTH).contains(&indexer.head_dim)
                    && indexer.compress > 0,
                || {
                    format!(
                        "{kv_heads} KV heads of {head_dim}, indexer heads of {} in blocks of {} \
                         (heads at most {MAX_WIDTH} wide)",
                        indexer.head_dim, indexer.compress
                    )
                },
            )?;
            GpuAttnCache::new(self.context(), CACHE_START, kv_heads, head_dim, indexer)
        };
        self.flash(OP, run())
    }

    fn indexer_scores(
        &self,
        cache: &mut GpuAttnCache,
        iq: &GpuBuf,
        raw: &GpuBuf,
        k_norm: &GpuBuf,
        eps: f32,
        rope: &GpuRope,
        pos: usize,
    ) -> OpResult<Vec<Vec<f32>>> {
        const OP: &str = "indexer_scores";
        let run = |cache: &mut GpuAttnCache| -> Result<Vec<Vec<f32>>> {
            let ctx = self.context();
            let ix = cache.indexer;
            let (di, cr, ni) = (ix.head_dim, ix.compress, ix.heads);
            let table = rope.table();
            let (rot, positions) = (table.rot(), table.positions());
            let t = indexer_tokens(cache, iq, raw, k_norm, (rot, positions), pos)?;
            // Forget what was cached after `pos` (a failed pass leaves a clean state).
            cache.raw_len = pos;
            cache.pooled = cache.pooled.min(pos / cr);
            cache.reserve(ctx, pos + t)?;
            if t == 0 {
                return Ok(Vec::new());
            }
            ctx.copy(
                buf(raw),
                0,
                &cache.raw.buf,
                (pos * di * 4) as u64,
                (t * di * 4) as u64,
            );
            cache.raw_len = pos + t;
            let nb = (pos + t) / cr;
            let mut p = IndexerParams {
                di: u32_of(OP, di)?,
                ni: u32_of(OP, ni)?,
                cr: u32_of(OP, cr)?,
                half: u32_of(OP, table.rot() / 2)?,
                eps,
                scale: (di as f32).sqrt(),
                ..IndexerParams::default()
            };
            cache.pool_blocks(ctx, &mut p, k_norm, &table.table.buf, nb)?;
            if nb == 0 {
                return Ok(vec![Vec::new(); t]);
            }
            p.n = u32_of(OP, t)?;
            p.pos0 = u32_of(OP, pos)?;
            p.nb = u32_of(OP, nb)?;
            // Every entry is written by the kernel.
            let scores = self.scratch(t * nb)?;
            ctx.dispatch_at(
                &kernel(FlashShader::Indexer, "scores"),
                &p.bytes(),
                &[(4, &*cache.blocks.buf), (5, buf(iq)), (6, buf(&scores))],
                (t * nb).div_ceil(WG_SCORES),
            )?;
            let host = ctx.download_f32(scores.tensor())?;
            Ok(host
                .chunks_exact(nb)
                .enumerate()
                .map(|(i, row)| row[..(pos + i + 1) / cr].to_vec())
                .collect())
        };
        self.flash(OP, run(cache))
    }

    fn indexed_attention(
        &self,
        cache: &mut GpuAttnCache,
        q: &GpuBuf,
        k: &GpuBuf,
        v: &GpuBuf,
        at: Causal,
        blocks: &[Vec<usize>],
        out: &mut GpuBuf,
    ) -> OpResult {
        const OP: &str = "indexed_attention";
        let run = |cache: &mut GpuAttnCache| -> Result<()> {
            let ctx = self.context();
            let (hd, nkv, cr) = (cache.head_dim, cache.kv_heads, cache.indexer.compress);
            let kvw = nkv * hd;
            let n = rows(OP, "k", k.len(), kvw)?;
            need(OP, at.heads > 0 && at.heads.is_multiple_of(nkv), || {
                format!("{} query heads over {nkv} KV heads", at.heads)
            })?;
            need(
                OP,
                q.len() == n * at.heads * hd
                    && v.len() == k.len()
                    && out.len() == q.len()
                    && blocks.len() == n,
                || {
                    format!(
                        "q {}, v {}, out {}, {} selections for {n} tokens",
                        q.len(),
                        v.len(),
                        out.len(),
                        blocks.len()
                    )
                },
            )?;
            need(OP, at.pos <= cache.kv_len, || {
                format!("position {} past the {} cached", at.pos, cache.kv_len)
            })?;
            // The selection as an index list, each block one the query can see.
            let mut sel = Vec::new();
            let mut offs = Vec::with_capacity(n + 1);
            offs.push(0);
            for (i, bs) in blocks.iter().enumerate() {
                let visible = (at.pos + i + 1) / cr;
                if let Some(&b) = bs.iter().find(|&&b| b >= visible) {
                    return Err(shape(
                        OP,
                        format!(
                            "the query at {} selects block {b} of the {visible} it sees",
                            at.pos + i
                        ),
                    ));
                }
                sel.extend(bs.iter().map(|&b| b as u32));
                offs.push(u32_of(OP, sel.len())?);
            }
            cache.kv_len = at.pos;
            cache.reserve(ctx, at.pos + n)?;
            if n == 0 {
                return Ok(());
            }
            let (off, bytes) = ((at.pos * kvw * 4) as u64, (n * kvw * 4) as u64);
            ctx.copy(buf(k), 0, &cache.k.buf, off, bytes);
            ctx.copy(buf(v), 0, &cache.v.buf, off, bytes);
            cache.kv_len = at.pos + n;
            let p = FlashAttnParams {
                n: u32_of(OP, n)?,
                heads: u32_of(OP, at.heads)?,
                kv_heads: u32_of(OP, nkv)?,
                head_dim: u32_of(OP, hd)?,
                pos0: u32_of(OP, at.pos)?,
                cr: u32_of(OP, cr)?,
                scale: at.scale,
            };
            let (sel, offs) = (indices(ctx, &sel), indices(ctx, &offs));
            ctx.dispatch_at(
                &kernel(FlashShader::Attn, "indexed_attention"),
                &p.bytes(),
                &[
                    (1, buf(q)),
                    (2, &*cache.k.buf),
                    (3, &*cache.v.buf),
                    (4, buf(out)),
                    (5, &sel),
                    (6, &offs),
                ],
                n * at.heads,
            )
        };
        self.flash(OP, run(cache))
    }
}

/// [`FlashOps`] on the GPU against the CPU's (`flash_next::conformance`, which states
/// the tolerances), one test per group of ops. They need an adapter (Mesa's llvmpipe is
/// enough); without one they are reported as skipped, and fail under
/// `GTURBO_REQUIRE_GPU=1` or in a strict run (CI).
#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::flash_next::conformance;
    use crate::runtime::kernels::gpu::tests::gpu_backend as gpu;

    macro_rules! flash_checks {
        ($($group:ident),*) => {
            $(
                #[test]
                fn $group() {
                    let Some(g) = gpu(concat!("flash::", stringify!($group))) else {
                        return;
                    };
                    conformance::$group(g);
                }
            )*
        };
    }

    flash_checks!(elementwise, norms, conv, gdn, indexer);

    /// Operands that do not fit are errors naming the op, never device reads out of
    /// bounds (and never panics).
    #[test]
    fn bad_operands_are_errors_not_panics() {
        let Some(g) = gpu("flash::bad_operands_are_errors_not_panics") else {
            return;
        };
        let d = HcDims {
            streams: 3,
            hidden: 8,
            lowrank: 0,
            eps: 1e-6,
        };
        let (mix, xn) = (g.zeros(48).unwrap(), g.zeros(47).unwrap());
        let mut out = g.zeros(16).unwrap();
        let e = g.hc_mix(&mix, &xn, d, &mut out).unwrap_err().to_string();
        assert!(e.contains("hc_mix") && e.contains("xn of 47"), "{e}");
        let x = g.zeros(40).unwrap();
        let e = g
            .gather_cols(&x, 8, 4..9, &mut out)
            .unwrap_err()
            .to_string();
        assert!(e.contains("gather_cols") && e.contains("4..9"), "{e}");
        // A selection naming a block the query cannot see yet.
        let ix = IndexerDims {
            heads: 1,
            head_dim: 8,
            budget: 8,
            compress: 4,
        };
        let mut cache = g.attn_cache(1, 8, ix).unwrap();
        let (q, k) = (g.zeros(8).unwrap(), g.zeros(8).unwrap());
        let mut o = g.zeros(8).unwrap();
        let at = Causal {
            pos: 0,
            heads: 1,
            scale: 1.0,
        };
        let e = g
            .indexed_attention(&mut cache, &q, &k, &k, at, &[vec![0]], &mut o)
            .unwrap_err()
            .to_string();
        assert!(e.contains("selects block 0 of the 0 it sees"), "{e}");
        // A position past what the cache holds.
        let at = Causal { pos: 3, ..at };
        let e = g
            .indexed_attention(&mut cache, &q, &k, &k, at, &[vec![]], &mut o)
            .unwrap_err()
            .to_string();
        assert!(e.contains("position 3 past the 0 cached"), "{e}");
        g.finish().unwrap();
    }
}
