//! What the GPU's operation families (`kernels::ops`: elementwise, hyper-connections,
//! linear attention, n-gram, sparse attention) share: their dispatch helpers and
//! operand checks. The families' kernels are WGSL
//! (`shaders/flash_*.wgsl`), so a Flash-Next token's forward pass stays on the device
//! like a decoder's: the `[n, S·H]` residual, the hyper-connection reads and
//! write-backs, the GDN conv and recurrent state, the PLE gate and conv state, the
//! indexed-attention cache (keys, values, the indexer's raw and pooled keys) are
//! device buffers.
//!
//! # What crosses to the host, and why
//! - **The indexer's block scores** (`[n, blocks]` f32 per indexed layer and call):
//!   the selection is `torch.topk`'s tie rule ([`crate::runtime::kernels::topk`]), a
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
//! conformance harness holds (`kernels::ops::conformance`) are in `docs/GPU.md`.

use wgpu::util::DeviceExt;

use crate::runtime::kernels::backend::{Backend, BackendError, OpResult};
use crate::runtime::kernels::gpu::backend::{Gpu, GpuBuf};
use crate::runtime::kernels::gpu::context::GpuContext;
use crate::runtime::kernels::gpu::error::{GpuError, Result};
use crate::runtime::kernels::gpu::shaders::{
    FlashElementwiseParams, FlashNormParams, FlashShader, Kernel, Shader,
};

/// Invocations per workgroup of the one-thread-per-element kernels.
pub(super) const WG_ELEMENTS: usize = 256;
/// Invocations per workgroup of `scores` (one per (token, block)).
pub(super) const WG_SCORES: usize = 64;
/// The widest GDN key head, indexer head and attention head the kernels hold in
/// workgroup memory.
pub(super) const MAX_WIDTH: usize = 256;
/// Positions an indexed-attention cache holds before it first grows (it doubles).
pub(super) const CACHE_START: usize = 256;

pub(super) fn kernel(shader: FlashShader, entry: &'static str) -> Kernel {
    Kernel::plain(Shader::Flash(shader), entry)
}

pub(super) fn shape(op: &'static str, message: String) -> GpuError {
    GpuError::Shape { op, message }
}

/// `Ok` when `ok`, else the shape error `message` names.
pub(super) fn need(op: &'static str, ok: bool, message: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(shape(op, message()))
    }
}

pub(super) fn u32_of(op: &'static str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| shape(op, format!("{v} does not fit 32 bits")))
}

/// `len / width` when `len` is whole rows of `width` (zero rows allowed).
pub(super) fn rows(op: &'static str, what: &str, len: usize, width: usize) -> Result<usize> {
    need(op, width > 0 && len.is_multiple_of(width), || {
        format!("{what} has {len} elements, not rows of {width}")
    })?;
    Ok(len / width)
}

pub(super) fn buf(b: &GpuBuf) -> &wgpu::Buffer {
    &b.tensor().buf
}

/// A read-only index list for one dispatch (not counted as held memory: it lives as
/// long as the recorded work that reads it).
pub(super) fn indices(ctx: &GpuContext, data: &[u32]) -> wgpu::Buffer {
    let mut bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    bytes.resize(bytes.len().max(16), 0);
    ctx.device
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("indexer selection"),
            contents: &bytes,
            usage: wgpu::BufferUsages::STORAGE,
        })
}

impl Gpu {
    pub(super) fn flash<T>(&self, op: &'static str, r: Result<T>) -> OpResult<T> {
        r.map_err(|e| BackendError::new(self.name(), op, e))
    }

    /// One dispatch of `flash_elementwise.wgsl`'s `entry` over `n` elements.
    pub(super) fn elementwise(
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

    pub(super) fn norm_kernel(
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
