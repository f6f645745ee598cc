//! The GPU backend's kernels: wgpu with WGSL compute shaders, which run as Metal on
//! macOS, Vulkan on Linux and DX12 on Windows from one source.
//!
//! # Shape of the API
//! A [`GpuContext`] owns one adapter's device and queue, the compiled pipelines and a
//! batch of recorded work. Weights are uploaded once into device buffers
//! ([`GpuMatrix`], from the same [`Matrix`](super::Matrix) views the CPU backend
//! multiplies); activations live in [`GpuTensor`]s; the KV cache
//! ([`KvCache`]), the RoPE table ([`RopeTable`]) and the expert slot buffer
//! ([`ExpertSlots`]) are device buffers too. Operations ([`GpuContext::matmul`],
//! [`GpuContext::rms_norm`], [`GpuContext::attention`], …) only *record* dispatches;
//! the batch is submitted when something is read back ([`GpuContext::download_f32`],
//! for sampling or routing) or on [`GpuContext::flush`]. Host writes
//! ([`GpuContext::write_f32`], [`ExpertSlots::fill`]) are recorded in the same
//! order as the dispatches, so filling a slot between two expert products is safe.
//!
//! Outputs are written through `&GpuTensor` (device memory is not Rust memory); an
//! operation refuses an output that is also one of its inputs.
//!
//! [`Gpu`] (`backend.rs`) is the runner's [`Backend`](super::Backend) over these: the
//! seam's tensors are device buffers, reused between tokens; `docs/GPU.md` is the
//! user's view (backend choice, numerics contract, what has run where).
//!
//! # Numerics contract
//! - **Accumulation is f32** everywhere; there are no f16 arithmetic paths. 16-bit
//!   data (BF16 weights, scales and biases, F16 weights) is widened to f32 on load,
//!   exactly (BF16 by a shift, F16 by integer bit surgery, which needs no capability).
//! - **Quantized products use the CPU path's formula**: each group of 64 adds
//!   `s·Σ q·x + b·Σ x` (`# Arithmetic` in [`super`]). The GPU forms the partial sums
//!   per 16-byte word or 32-code chunk and adds them in a tree of 4 to 32 lanes; the
//!   CPU adds them in its own order. So results differ from the CPU
//!   backend by **reduction order only**, bounded like the CPU's own test bound:
//!   `|gpu − cpu| ≤ 2e-5 · Σ (|s·q| + |b|)·|x|` per output (float matrices:
//!   `Σ |w·x|`), plus the same for the products feeding later ops.
//! - **Large 4-bit decode products round x to 24 bits** (`qmatvec_x24`, on Vulkan and
//!   DX12 from 8 M codes; `GTURBO_GPU_PACKED_X=0` turns it off, `=1` on for every
//!   eligible product): x is packed once per distinct x as `round(x / h)` with `h` the
//!   largest `|x|` of each 32 values over `2^23 − 1`, and the codes meet it in exact
//!   packed integer dot products, one per byte of x. Beside reduction order this adds
//!   x's rounding, at most `h/2` per value (`2^-24` of the chunk's largest `|x|`, the
//!   size of an f32 product's own rounding): tests hold it to
//!   `2e-7 · Σ (|s·q| + |b|)·|x| + Σ (|s·q| + |b|)·(h/2 + 4e-7·|x|)` (the second term:
//!   x's rounding and the f32 quotients `h` and `1/h`), and check the packed x word
//!   for word. Rounded to 16 bits instead, a SmolLM2 greedy
//!   token flipped at a near-tie, which is why 24.
//! - **Embedding rows** are `s·q + b` per element, as [`Backend::row`](super::Backend)
//!   computes them; the GPU compiler may fuse that into one `fma`, so they agree to 1
//!   ulp (tests hold `1e-6` relative to `|s·q| + |b|`).
//! - **RMSNorm** is `x · (1/sqrt(mean(x²) + eps)) · w` (or `· (1 + w)`); the sum of
//!   squares is a tree sum. Tests hold `1e-5` relative to `max |x·w|·inv`.
//! - **RoPE** angles and their cos/sin are computed on the host, exactly as the CPU
//!   runner computes them (`pos as f32 · inv_freq`, Rust's `sin_cos`), into a
//!   [`RopeTable`]: WGSL's `sin`/`cos` are only specified to 2^-11 absolute inside
//!   [-π, π]. The rotation itself may be fused into `fma`: tests hold `1e-6` relative
//!   to the head's largest value.
//! - **Attention** uses an online softmax (running maximum and sum over blocks of 64
//!   keys), the CPU a two-pass one; both subtract the maximum first. Tests hold
//!   `1e-5` relative to `max |v|`.
//! - **Softmax, SwiGLU, the router** use the GPU's `exp`, which WGSL specifies to
//!   `3 + 2·|x|` ulp (the CPU uses libm's), and the softmax sum is a tree sum where the
//!   CPU adds sequentially. Tests hold a softmax output `p_i` of a `d`-wide row to
//!   `(8 + 2·|x_i − max| + 4·√d) · 2^-23 · p_i` (router weights the same, plus the
//!   top-k renormalisation's share), SwiGLU to `1e-5 · (|g·u| + 1e-6)`. The router
//!   picks the same experts as the CPU path whenever the k-th and (k+1)-th
//!   probabilities differ by more than that; exact ties go to the lower id on both.
//! - Masked entries are written as `-3e38` or lower, not `-inf`: wgpu compiles Metal
//!   shaders with Metal's default fast math, where infinities are not guaranteed.
//!
//! # Portability ("Metal honesty")
//! The kernels use only what WebGPU guarantees on every backend: u32/f32 storage,
//! 16 KiB of workgroup memory, 256 invocations per workgroup, `override` constants.
//! The packed 4 × 8-bit dot products of `qmatvec_x24` are WGSL's
//! `packed_4x8_integer_dot_product` language feature, which naga emits on every
//! backend (as arithmetic where the target has no such instruction); the kernel is
//! off on Metal until its speed there is measured.
//! They use neither `shader-f16` nor subgroups (a shared-memory tree sum instead), so
//! no feature check is needed; those are the speed-ups left for later, each behind
//! [`wgpu::Features`] with this path as the fallback. The unit tests translate every
//! kernel variant to MSL and HLSL with naga (no GPU needed), so a kernel that cannot
//! become Metal source fails the tests. What has run: Vulkan on Mesa llvmpipe (the
//! parity tests). What has not: any Metal or DX12 device.
//!
//! # Widths and groups
//! Bits and group size are WGSL `override` constants of one source per kernel
//! family (`shaders/qmatvec.wgsl`, `shaders/embed.wgsl`), which read each row's codes
//! as the dense little-endian bit stream MLX writes (3-, 5- and 6-bit codes straddle
//! words), so every width and group [`Matrix`](super::Matrix) carries (2, 3, 4, 5, 6,
//! 8 bits × 32, 64, 128) has kernels: the tiled product and the general
//! matrix-vector product for all of them, and the 16-byte-load matrix-vector kernel
//! (`qmatvec_fast`) for the widths dividing 16 whose 16-byte words stay inside a
//! group (all but 2 bits in groups of 32).
//!
//! # Where the time goes
//! [`GpuContext::stats`] counts dispatches, passes, submits, waits and read-backs, and
//! with `GTURBO_GPU_STATS=1` on an adapter with `TIMESTAMP_QUERY` the device time of
//! every dispatch (each in its own timed pass; the reading makes every submit wait).
//! `docs/GPU.md` has the figures.

mod backend;
mod context;
mod error;
mod ops;
mod shaders;
mod tensor;
#[cfg(test)]
mod tests;
mod tuning;

pub use backend::{Gpu, GpuBuf, GpuExpert, GpuKv, GpuRope, GpuSlots};
pub use context::{AdapterSummary, GpuContext, GpuOptions, GpuStats, list_adapters};
pub use error::{GpuError, Result};
pub use ops::{GpuAttnCache, PACKED_X_WORDS, RouterOutput};
pub use tensor::{DType, Encoding, ExpertSlots, GpuMatrix, GpuTensor, KvCache, RopeTable};
pub use tuning::x24_lanes;
