//! Compute kernels: matrix-vector and matrix-matrix products over the weight
//! encodings an install stores (INT4/INT8 affine g64 in MLX's layout, BF16, F16, F32),
//! the small f32 helpers, and the [`Backend`] seam runners compute through.
//!
//! # Shape of the API
//! A [`Matrix`] borrows the bytes of one weight tensor straight from the install
//! (memory-mapped resident file or an expert-cache slot); nothing is converted ahead
//! of time. A runner never multiplies a [`Matrix`] itself: it hands it to a
//! [`Backend`] once ([`Backend::weights`]) and then calls whole operations (norms,
//! RoPE, attention with its KV cache, the FFN, routing, an expert's FFN) on tensors
//! the backend owns (`backend.rs` gives the contract). Two backends implement it:
//! [`Cpu`], whose ops (`cpu.rs`) run over the host-slice products [`Cpu::matvec`] and
//! [`Cpu::matmul`] below, and `gpu::Gpu` (wgpu, with the `gpu` feature), whose tests
//! compare it against them.
//!
//! # Arithmetic
//! Quantized products never materialise the dequantized matrix. One group of 64
//! weights is `w = s·q + b`, so its contribution is `Σ (s·q_k + b)·x_k =
//! s·Σ q_k·x_k + b·Σ x_k`: the per-group sums `Σ x_k` are computed once per input
//! vector and the inner loop is an f32 multiply-add of the integer codes against `x`.
//! Everything accumulates in f32; results agree with "dequantize the row with
//! [`crate::format::quant::dequantize_rows`], then dot" to f32 rounding (the unit
//! tests bound the difference by `1e-5 · Σ |w·x|`).
//!
//! # Speed
//! On x86-64 with AVX2 and FMA (detected at run time) the inner loops use 256-bit
//! intrinsics; elsewhere portable loops written so the compiler vectorises them.
//! Inputs are permuted once per call so that the eight u32 words of a group's codes
//! sit in the eight lanes of a register: code `s` of every word comes out with one
//! shift and one mask, with no byte shuffles. Rows are split over a rayon pool.
//!
//! # Contract
//! The hot functions ([`Cpu::matvec`], [`Cpu::matmul`], [`Cpu::row`]) may assume
//! [`Matrix::check`] passed and the slice lengths are the documented ones; they panic
//! (never read out of bounds) when that is not so. `check` itself never panics.

use crate::format::dtype::Dtype;
use crate::format::mxfp4::GROUP as MXFP4_GROUP;
use crate::format::pools::{BlobPart, ExpertPool};
use crate::format::quant::{GROUP, bf16_to_f32};
use crate::format::{Affine, Scheme};
use rayon::prelude::*;

mod backend;
#[cfg(test)]
mod conformance;
pub mod cpu;
#[cfg(feature = "gpu")]
pub mod gpu;
pub mod ops;
mod portable;
pub mod rope;
pub mod routing;
#[cfg(test)]
mod tests;
pub mod topk;

pub use backend::{
    AttentionSpec, Backend, BackendError, Causal, ExpertRef, KvRows, LayerExperts, NormGain,
    OpResult, RopeLayout, Routing, WINDOW_REWIND,
};
pub use cpu::{CpuAttnCache, CpuKv, CpuRope};
pub use ops::Ops;
#[cfg(target_arch = "aarch64")]
mod neon;
#[cfg(target_arch = "x86_64")]
mod x86;

/// A weight matrix `[rows, cols]` as stored in an install (row-major; MLX's layout for
/// quantized weights).
#[derive(Debug, Clone, Copy)]
pub enum Matrix<'a> {
    /// Affine with `bits` per code (2, 3, 4, 5, 6 or 8) in groups of `group` (32, 64
    /// or 128): `weights` holds packed little-endian u32 words `[rows, cols*bits/32]`
    /// (each row a dense little-endian bit stream), `scales` and `biases`
    /// little-endian BF16 `[rows, cols/group]`. INT4 and INT8 in groups of 64 have
    /// their own fast loops; every other layout runs a general one.
    Quant {
        /// Bits per code.
        bits: u32,
        /// Elements per group.
        group: usize,
        /// Packed codes.
        weights: &'a [u8],
        /// BF16 scale per group.
        scales: &'a [u8],
        /// BF16 bias per group.
        biases: &'a [u8],
        /// Output features.
        rows: usize,
        /// Input features, a multiple of `group`.
        cols: usize,
    },
    /// MXFP4 in MLX's `mxfp4` layout ([`crate::format::mxfp4`]): `weights` holds the
    /// E2M1 codes `[rows, cols/2]` bytes (element `j` of a row in the low nibble of
    /// byte `j/2` when `j` is even, the high nibble when odd), `scales` one E8M0 byte
    /// per group of 32 `[rows, cols/32]` (`2^(e−127)`). No biases.
    Mxfp4 {
        /// Packed E2M1 codes.
        weights: &'a [u8],
        /// E8M0 scale per group of 32.
        scales: &'a [u8],
        /// Output features.
        rows: usize,
        /// Input features, a multiple of 32.
        cols: usize,
    },
    /// Little-endian floats of `dtype`, `[rows, cols]`.
    Float {
        /// The element type.
        dtype: FloatDtype,
        /// The elements.
        data: &'a [u8],
        /// Output features.
        rows: usize,
        /// Input features.
        cols: usize,
    },
}

/// A matrix whose bytes do not agree with its declared shape.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// A quantized matrix whose width or group is not one MLX writes.
    #[error(
        "quantized matrix has {bits} bits per code in groups of {group}; MLX's layouts are 2, 3, 4, 5, 6 or 8 bits in groups of 32, 64 or 128"
    )]
    Bits {
        /// The bit width given.
        bits: u32,
        /// The group size given.
        group: usize,
    },
    /// A quantized matrix whose row width is not a positive multiple of its group.
    #[error(
        "quantized matrix row width {cols} is not a positive multiple of the group size {group}"
    )]
    Cols {
        /// The row width given.
        cols: usize,
        /// The group size.
        group: usize,
    },
    /// `rows × cols` overflows the address space.
    #[error("matrix shape {rows}x{cols} is too large")]
    TooLarge {
        /// Rows given.
        rows: usize,
        /// Columns given.
        cols: usize,
    },
    /// A byte slice has the wrong length for the shape.
    #[error("{part} holds {len} bytes; a {rows}x{cols} matrix needs {expected}")]
    Len {
        /// Which slice: `weights`, `scales`, `biases` or `data`.
        part: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The length the shape requires.
        expected: usize,
        /// Rows declared.
        rows: usize,
        /// Columns declared.
        cols: usize,
    },
}

/// The element type of a [`Matrix::Float`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloatDtype {
    /// BF16.
    Bf16,
    /// IEEE half.
    F16,
    /// f32.
    F32,
}

impl FloatDtype {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            FloatDtype::Bf16 | FloatDtype::F16 => 2,
            FloatDtype::F32 => 4,
        }
    }
}

impl<'a> Matrix<'a> {
    /// Rows `rows` as a matrix over the same bytes: every layout stores whole rows one
    /// after another (a quantized row's codes, then its scales and biases in their own
    /// arrays), so a row range is a sub-slice of each array. MLA's absorbed value
    /// projection is each head's rows of `kv_b_proj`.
    ///
    /// # Panics
    /// When `rows` reaches past the matrix (a caller bug).
    pub fn row_range(&self, rows: std::ops::Range<usize>) -> Matrix<'a> {
        assert!(
            rows.start <= rows.end && rows.end <= self.rows(),
            "rows {rows:?} of a {}-row matrix",
            self.rows()
        );
        let n = rows.len();
        match *self {
            Matrix::Quant {
                bits,
                group,
                weights,
                scales,
                biases,
                cols,
                ..
            } => {
                let code = cols * bits as usize / 8;
                let affine = cols / group * 2;
                Matrix::Quant {
                    bits,
                    group,
                    weights: &weights[rows.start * code..rows.end * code],
                    scales: &scales[rows.start * affine..rows.end * affine],
                    biases: &biases[rows.start * affine..rows.end * affine],
                    rows: n,
                    cols,
                }
            }
            Matrix::Mxfp4 {
                weights,
                scales,
                cols,
                ..
            } => {
                let (wr, sr) = (cols / 2, cols / MXFP4_GROUP);
                Matrix::Mxfp4 {
                    weights: &weights[rows.start * wr..rows.end * wr],
                    scales: &scales[rows.start * sr..rows.end * sr],
                    rows: n,
                    cols,
                }
            }
            Matrix::Float {
                dtype, data, cols, ..
            } => {
                let row = cols * dtype.bytes();
                Matrix::Float {
                    dtype,
                    data: &data[rows.start * row..rows.end * row],
                    rows: n,
                    cols,
                }
            }
        }
    }
}

impl Matrix<'_> {
    /// Output features (rows).
    pub fn rows(&self) -> usize {
        match *self {
            Matrix::Quant { rows, .. }
            | Matrix::Mxfp4 { rows, .. }
            | Matrix::Float { rows, .. } => rows,
        }
    }

    /// Input features (columns).
    pub fn cols(&self) -> usize {
        match *self {
            Matrix::Quant { cols, .. }
            | Matrix::Mxfp4 { cols, .. }
            | Matrix::Float { cols, .. } => cols,
        }
    }

    /// Bytes of weight data the matrix reads per product (codes, scales and biases for
    /// quantized matrices): the figure memory bandwidth is measured against.
    pub fn weight_bytes(&self) -> usize {
        match *self {
            Matrix::Quant {
                weights,
                scales,
                biases,
                ..
            } => weights.len() + scales.len() + biases.len(),
            Matrix::Mxfp4 {
                weights, scales, ..
            } => weights.len() + scales.len(),
            Matrix::Float { data, .. } => data.len(),
        }
    }

    /// Check that the byte lengths agree with the shape (and, for quantized matrices,
    /// that the bit width and group structure are supported). Never panics.
    pub fn check(&self) -> Result<(), KernelError> {
        let (rows, cols) = (self.rows(), self.cols());
        let elems = rows
            .checked_mul(cols)
            .ok_or(KernelError::TooLarge { rows, cols })?;
        let want = |part: &'static str, len: usize, per_elem_num: usize, per_elem_den| {
            let expected = elems
                .checked_mul(per_elem_num)
                .ok_or(KernelError::TooLarge { rows, cols })?
                / per_elem_den;
            if len == expected {
                Ok(())
            } else {
                Err(KernelError::Len {
                    part,
                    len,
                    expected,
                    rows,
                    cols,
                })
            }
        };
        match *self {
            Matrix::Quant {
                bits,
                group,
                weights,
                scales,
                biases,
                ..
            } => {
                let affine = u32::try_from(group)
                    .ok()
                    .and_then(|g| Affine::new(bits, g))
                    .ok_or(KernelError::Bits { bits, group })?;
                if !affine.fits(cols as u64) {
                    return Err(KernelError::Cols { cols, group });
                }
                let too_large = KernelError::TooLarge { rows, cols };
                let q = affine
                    .sizes(rows as u64, cols as u64)
                    .ok_or(too_large.clone())?;
                for (part, len, expected) in [
                    ("weights", weights.len(), q.weights),
                    ("scales", scales.len(), q.scales),
                    ("biases", biases.len(), q.biases),
                ] {
                    let expected = usize::try_from(expected).map_err(|_| too_large.clone())?;
                    if len != expected {
                        return Err(KernelError::Len {
                            part,
                            len,
                            expected,
                            rows,
                            cols,
                        });
                    }
                }
                Ok(())
            }
            Matrix::Mxfp4 {
                weights, scales, ..
            } => {
                if cols == 0 || !cols.is_multiple_of(MXFP4_GROUP) {
                    return Err(KernelError::Cols {
                        cols,
                        group: MXFP4_GROUP,
                    });
                }
                want("weights", weights.len(), 1, 2)?;
                want("scales", scales.len(), 1, MXFP4_GROUP)
            }
            Matrix::Float { dtype, data, .. } => want("data", data.len(), dtype.bytes(), 1),
        }
    }

    /// Whether this is a quantized matrix outside the INT4/INT8 g64 fast loops (it then
    /// runs the general loop, whatever the CPU).
    fn general_quant(&self) -> bool {
        matches!(*self, Matrix::Quant { bits, group, .. } if !(group == GROUP && (bits == 4 || bits == 8)))
    }

    /// Row `r` widened to f32 into `out` (`out.len() == cols`). A plain conversion of
    /// host bytes that needs no backend: norm weights are read once at load with it,
    /// and [`Cpu::row`] and the CPU's [`Backend::embed`] are this. Panics (never reads out of bounds) when
    /// `r` or `out` do not fit the shape.
    pub fn widen_row(&self, r: usize, out: &mut [f32]) {
        debug_assert!(self.check().is_ok());
        assert!(r < self.rows(), "row {r} of a {}-row matrix", self.rows());
        assert_eq!(out.len(), self.cols(), "row: out length");
        portable::row(&self.slice_rows(r, r + 1), out);
    }

    /// The bytes of rows `r0..r1` as a matrix of their own (a group never crosses a
    /// row, so this is a plain sub-slice of every part).
    fn slice_rows(&self, r0: usize, r1: usize) -> Matrix<'_> {
        let n = r1 - r0;
        match *self {
            Matrix::Quant {
                bits,
                group,
                weights,
                scales,
                biases,
                cols,
                ..
            } => {
                let (wr, sr) = quant_row_bytes(bits, group, cols);
                Matrix::Quant {
                    bits,
                    group,
                    weights: &weights[r0 * wr..r1 * wr],
                    scales: &scales[r0 * sr..r1 * sr],
                    biases: &biases[r0 * sr..r1 * sr],
                    rows: n,
                    cols,
                }
            }
            Matrix::Mxfp4 {
                weights,
                scales,
                cols,
                ..
            } => {
                let (wr, sr) = (cols / 2, cols / MXFP4_GROUP);
                Matrix::Mxfp4 {
                    weights: &weights[r0 * wr..r1 * wr],
                    scales: &scales[r0 * sr..r1 * sr],
                    rows: n,
                    cols,
                }
            }
            Matrix::Float {
                dtype, data, cols, ..
            } => {
                let row = cols * dtype.bytes();
                Matrix::Float {
                    dtype,
                    data: &data[r0 * row..r1 * row],
                    rows: n,
                    cols,
                }
            }
        }
    }
}

/// Which inner loops the CPU backend runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Isa {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "aarch64")]
    Neon,
}

impl Isa {
    fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        if x86::available() {
            return Isa::Avx2;
        }
        #[cfg(target_arch = "aarch64")]
        if neon::available() {
            return Isa::Neon;
        }
        Isa::Portable
    }
}

/// The CPU kernels this machine runs, by the detection the CPU backend itself makes:
/// their name (`cpu-avx2`, `cpu`) and the CPU features they use.
pub fn cpu_kernels() -> (&'static str, &'static str) {
    match Isa::detect() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => ("cpu-avx2", "AVX2, FMA, F16C"),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon if neon::dotprod() => ("cpu-neon", "NEON, dot product (sdot)"),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => ("cpu-neon", "NEON (no dot product: widening multiplies)"),
        Isa::Portable => ("cpu", "portable loops (no AVX2+FMA+F16C or NEON detected)"),
    }
}

/// How the CPU backend feeds activations to INT4 matrix-vector products.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Activations {
    /// f32 activations: results agree with the exact product to f32 rounding.
    #[default]
    F32,
    /// Activations rounded to int8 per group of 64 (`x ≈ d·xq`, `d = max|x|/127`), as
    /// llama.cpp does, so the inner loop is an integer multiply-add: about twice as
    /// fast. Each `x` moves by at most `d/2`, so a product moves by at most
    /// `Σ_g d_g/2 · Σ_k |s_g·q_k|` (under 0.4% of `Σ |s·q|·max|x|`); the bias term
    /// `b·Σx` stays exact. Applies to INT4 `matvec` and `matmul` (so prefill and decode
    /// see the same arithmetic); INT8 and float matrices stay exact.
    Int8,
}

/// The CPU backend: rows split over a rayon pool of `threads` workers.
pub struct Cpu {
    threads: usize,
    pool: Option<rayon::ThreadPool>,
    isa: Isa,
    activations: Activations,
}

impl std::fmt::Debug for Cpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cpu")
            .field("threads", &self.threads)
            .field("isa", &self.isa)
            .field("activations", &self.activations)
            .finish()
    }
}

/// Fewest rows one task takes: below this the hand-off costs more than it saves.
const MIN_ROWS_PER_TASK: usize = 32;
/// Tasks per thread: a few, so a thread descheduled on a busy host does not hold up
/// the whole product.
const TASKS_PER_THREAD: usize = 4;

impl Cpu {
    /// A backend running on `threads` threads (0 means one per available core). With
    /// one thread everything runs on the caller's thread.
    pub fn new(threads: usize) -> Self {
        Self::with_isa(threads, Isa::detect())
    }

    /// The same with the given activation handling (see [`Activations`]).
    pub fn with_activations(mut self, activations: Activations) -> Self {
        self.activations = activations;
        self
    }

    /// The same, restricted to the portable loops (tests compare the two).
    #[cfg(test)]
    fn portable(threads: usize) -> Self {
        Self::with_isa(threads, Isa::Portable)
    }

    fn with_isa(threads: usize, isa: Isa) -> Self {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        };
        let pool = (threads > 1)
            .then(|| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(|i| format!("gturbo-cpu-{i}"))
                    .build()
                    .ok()
            })
            .flatten();
        let threads = if pool.is_some() { threads } else { 1 };
        Cpu {
            threads,
            pool,
            isa,
            activations: Activations::F32,
        }
    }

    /// Threads products are split over.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Run `f` on one of the backend's worker threads. Kernel calls made from inside
    /// split their rows with a local hand-off instead of waking the pool from outside
    /// and blocking, which saves a few microseconds per call: runners wrap a whole
    /// generation in it.
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(pool) => pool.install(f),
            None => f(),
        }
    }

    /// Rows per task for a product of `rows` rows.
    fn chunk_rows(&self, rows: usize) -> usize {
        let tasks = self.threads * TASKS_PER_THREAD;
        rows.div_ceil(tasks).max(MIN_ROWS_PER_TASK)
    }

    /// Run `f(r0, out_chunk)` over chunks of `out` (`per_row` values per row), in
    /// parallel when there is a pool and more than one chunk.
    fn for_row_chunks<F>(&self, rows: usize, per_row: usize, out: &mut [f32], f: F)
    where
        F: Fn(usize, &mut [f32]) + Send + Sync,
    {
        let chunk = self.chunk_rows(rows);
        match &self.pool {
            Some(pool) if rows > chunk => pool.install(|| {
                out.par_chunks_mut(chunk * per_row)
                    .enumerate()
                    .for_each(|(i, o)| f(i * chunk, o))
            }),
            _ => f(0, out),
        }
    }

    /// `y = W x` for the rows of `w` (one task's share), single-threaded.
    fn matvec_rows(&self, w: &Matrix, prep: &Prepared, y: &mut [f32]) {
        if let Matrix::Mxfp4 { .. } = *w {
            return match self.isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => x86::matvec_mxfp4(w, &prep.x, y),
                _ => portable::matvec_mxfp4(w, &prep.x, y),
            };
        }
        if w.general_quant() {
            return portable::matvec_general(w, prep, y);
        }
        match (*w, self.isa) {
            #[cfg(target_arch = "x86_64")]
            (_, Isa::Avx2) => x86::matvec(w, prep, y),
            #[cfg(target_arch = "aarch64")]
            (_, Isa::Neon) => neon::matvec(w, prep, y),
            (_, Isa::Portable) => portable::matvec(w, prep, y),
        }
    }

    /// Row 0 of the one-row matrix `w` into `out`, in the order [`Prepared`] puts
    /// the input in.
    fn row_prepared(&self, w: &Matrix, out: &mut [f32]) {
        if w.general_quant() || matches!(*w, Matrix::Mxfp4 { .. }) {
            // The general and MXFP4 loops read the input in natural order.
            return portable::row(w, out);
        }
        match self.isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => x86::row_prepared(w, out),
            // Dequantizing is not the hot loop of a matmul (four rows per input
            // chunk): the portable loop, vectorised by the compiler, gives the bits.
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => portable::row_prepared(w, out),
            Isa::Portable => portable::row_prepared(w, out),
        }
    }

    /// `Σ a·b_j` for four `b_j`, sharing the loads of `a`.
    fn dot4(&self, a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
        match self.isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => x86::dot4(a, b),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => neon::dot4(a, b),
            Isa::Portable => b.map(|b| portable::dot(a, b)),
        }
    }

    /// `out[j] = Σ wrow·preps[j].x`.
    fn dots(&self, wrow: &[f32], preps: &[Prepared], out: &mut [f32]) {
        match self.isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                let mut oc = out.chunks_exact_mut(4);
                let mut pc = preps.chunks_exact(4);
                for (o, p) in (&mut oc).zip(&mut pc) {
                    let r = x86::dot4(wrow, [&p[0].x, &p[1].x, &p[2].x, &p[3].x]);
                    o.copy_from_slice(&r);
                }
                for (o, p) in oc.into_remainder().iter_mut().zip(pc.remainder()) {
                    *o = x86::dot(wrow, &p.x);
                }
            }
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => {
                let mut oc = out.chunks_exact_mut(4);
                let mut pc = preps.chunks_exact(4);
                for (o, p) in (&mut oc).zip(&mut pc) {
                    let r = neon::dot4(wrow, [&p[0].x, &p[1].x, &p[2].x, &p[3].x]);
                    o.copy_from_slice(&r);
                }
                for (o, p) in oc.into_remainder().iter_mut().zip(pc.remainder()) {
                    *o = neon::dot(wrow, &p.x);
                }
            }
            Isa::Portable => {
                for (o, p) in out.iter_mut().zip(preps) {
                    *o = portable::dot(wrow, &p.x);
                }
            }
        }
    }
}

/// 1.5·2^23: `(t + ROUND_BIAS) - ROUND_BIAS` rounds `t` to an integer for |t| ≤ 2^22.
const ROUND_BIAS: f32 = 12_582_912.0;

/// Sum of a slice with eight partial sums (vectorises; a plain `sum` is one serial
/// chain of additions).
fn sum8(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut c = x.chunks_exact(8);
    for v in &mut c {
        for i in 0..8 {
            acc[i] += v[i];
        }
    }
    acc.iter().sum::<f32>() + c.remainder().iter().sum::<f32>()
}

/// The input vector in the order the inner loops read it, plus per-group sums.
pub(crate) struct Prepared {
    /// For quantized matrices, `x` with each block of `8·per_word` elements permuted so
    /// that element `i·per_word + s` sits at `s·8 + i` (lane `i` of the word vector
    /// holds code `s` of word `i`); for float matrices `x` unchanged. Empty in int8
    /// mode.
    pub(crate) x: Vec<f32>,
    /// `Σ x_k` over each group of 64 (quantized matrices only; in int8 mode the sum
    /// of the original f32 values, so the bias term stays exact).
    pub(crate) group_sums: Vec<f32>,
    /// Int8 mode (INT4 only): per group of 64, the 32 even elements then the 32 odd
    /// ones (the low and high nibbles of the 32 code bytes), as int8 bytes.
    pub(crate) q8: Vec<u8>,
    /// Int8 mode: the scale `d` of each group, `x ≈ d·xq`.
    pub(crate) q8_scale: Vec<f32>,
}

impl Prepared {
    fn new(w: &Matrix, x: &[f32]) -> Prepared {
        Self::with(w, x, Activations::F32)
    }

    fn with(w: &Matrix, x: &[f32], activations: Activations) -> Prepared {
        let mut prep = Prepared {
            x: Vec::new(),
            group_sums: Vec::new(),
            q8: Vec::new(),
            q8_scale: Vec::new(),
        };
        let Matrix::Quant { bits, group, .. } = *w else {
            prep.x = x.to_vec();
            return prep;
        };
        prep.group_sums = x.chunks_exact(group).map(sum8).collect();
        if w.general_quant() {
            // The general loop unpacks a group's codes in order: no permutation.
            prep.x = x.to_vec();
            return prep;
        }
        if bits == 4 && activations == Activations::Int8 {
            prep.q8 = vec![0u8; x.len()];
            for (src, dst) in x.chunks_exact(GROUP).zip(prep.q8.chunks_exact_mut(GROUP)) {
                let max = src.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d = max / 127.0;
                let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
                for (k, v) in src.iter().enumerate() {
                    // Round to nearest (ties to even) by adding and removing 1.5·2^23:
                    // exact for |t| ≤ 2^22, and branch-free where `round` is a libm
                    // call on baseline x86-64.
                    let t = (v * inv).clamp(-127.0, 127.0);
                    let q = ((t + ROUND_BIAS) - ROUND_BIAS) as i8;
                    dst[(k % 2) * 32 + k / 2] = q as u8;
                }
                prep.q8_scale.push(d);
            }
            return prep;
        }
        let per_word = (32 / bits) as usize;
        let block = 8 * per_word;
        prep.x = vec![0.0f32; x.len()];
        for (src, dst) in x.chunks_exact(block).zip(prep.x.chunks_exact_mut(block)) {
            for i in 0..8 {
                for s in 0..per_word {
                    dst[s * 8 + i] = src[i * per_word + s];
                }
            }
        }
        prep
    }
}

/// Products on host slices: what the [`Backend`] ops of [`Cpu`] (in `cpu.rs`) are
/// built from, and what kernel benchmarks and other backends' tests compare with.
/// They may assume [`Matrix::check`] passed for `w` and panic (never read out of
/// bounds) when the slice lengths are not the documented ones.
impl Cpu {
    /// Short name for logs and footers (`"cpu-avx2"`, `"cpu"`).
    fn isa_name(&self) -> &'static str {
        match self.isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => "cpu-avx2",
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => "cpu-neon",
            Isa::Portable => "cpu",
        }
    }

    /// `y[r] = Σ_c W[r,c]·x[c]` with f32 accumulation; `x.len() == cols`,
    /// `y.len() == rows`.
    pub fn matvec(&self, w: &Matrix, x: &[f32], y: &mut [f32]) {
        debug_assert!(w.check().is_ok());
        assert_eq!(x.len(), w.cols(), "matvec: x length");
        assert_eq!(y.len(), w.rows(), "matvec: y length");
        let prep = Prepared::with(w, x, self.activations);
        self.for_row_chunks(w.rows(), 1, y, |r0, y| {
            self.matvec_rows(&w.slice_rows(r0, r0 + y.len()), &prep, y)
        });
    }

    /// `n` vectors at once (prefill): `xs` is `[n, cols]`, `ys` is `[n, rows]`. Equals
    /// `n` calls of [`Cpu::matvec`] to f32 rounding; reuses each dequantized row
    /// across the `n` vectors.
    pub fn matmul(&self, w: &Matrix, xs: &[f32], n: usize, ys: &mut [f32]) {
        debug_assert!(w.check().is_ok());
        let (rows, cols) = (w.rows(), w.cols());
        assert_eq!(xs.len(), n * cols, "matmul: xs length");
        assert_eq!(ys.len(), n * rows, "matmul: ys length");
        if n == 1 {
            return self.matvec(w, xs, ys);
        }
        // Rows are split over threads, so each task writes a contiguous `[rows, n]`
        // block of a transposed result, transposed back at the end. Each row is
        // dequantized once (in the permuted order the prepared inputs share) and
        // dotted with all `n` inputs.
        let int8 = self.activations == Activations::Int8
            && matches!(
                *w,
                Matrix::Quant {
                    bits: 4,
                    group: GROUP,
                    ..
                }
            );
        let mut yt = vec![0.0f32; rows * n];
        if int8 {
            // Int8 activations: the integer kernel, unpacking each group's codes once
            // for all the vectors.
            let preps: Vec<Prepared> = xs
                .chunks_exact(cols)
                .map(|x| Prepared::with(w, x, Activations::Int8))
                .collect();
            self.for_row_chunks(rows, n, &mut yt, |r0, yt| {
                let part = w.slice_rows(r0, r0 + yt.len() / n);
                match self.isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => x86::matmul_q8(&part, &preps, yt),
                    #[cfg(target_arch = "aarch64")]
                    Isa::Neon => neon::matmul_q8(&part, &preps, yt),
                    Isa::Portable => portable::matmul_q8(&part, &preps, yt),
                }
            });
        } else {
            let preps: Vec<Prepared> = xs.chunks_exact(cols).map(|x| Prepared::new(w, x)).collect();
            self.for_row_chunks(rows, n, &mut yt, |r0, yt| {
                // Four rows at a time, dequantized into an L1-sized scratch: each input
                // chunk is loaded once for four rows.
                let mut wrows = vec![0.0f32; 4 * cols];
                let done = r0 + yt.len() / n / 4 * 4;
                let mut blocks = yt.chunks_exact_mut(4 * n);
                for (b, out) in (&mut blocks).enumerate() {
                    let r = r0 + 4 * b;
                    for (k, wrow) in wrows.chunks_exact_mut(cols).enumerate() {
                        self.row_prepared(&w.slice_rows(r + k, r + k + 1), wrow);
                    }
                    let wr: Vec<&[f32]> = wrows.chunks_exact(cols).collect();
                    for (j, p) in preps.iter().enumerate() {
                        let v = self.dot4(&p.x, [wr[0], wr[1], wr[2], wr[3]]);
                        for (k, v) in v.into_iter().enumerate() {
                            out[k * n + j] = v;
                        }
                    }
                }
                let wrow = &mut wrows[..cols];
                for (i, out) in blocks.into_remainder().chunks_exact_mut(n).enumerate() {
                    self.row_prepared(&w.slice_rows(done + i, done + i + 1), wrow);
                    self.dots(wrow, &preps, out);
                }
            });
        }
        for (r, vals) in yt.chunks_exact(n).enumerate() {
            for (j, v) in vals.iter().enumerate() {
                ys[j * rows + r] = *v;
            }
        }
    }

    /// Row `r` of `W` as f32 (embedding lookup); `out.len() == cols`.
    pub fn row(&self, w: &Matrix, r: usize, out: &mut [f32]) {
        w.widen_row(r, out);
    }
}

/// Bytes of one row of a quantized `[_, cols]` matrix: (packed weights, scales), the
/// biases being as wide as the scales ([`Affine::row_sizes`]). A group never crosses a
/// row, so row `r` of every part starts at `r` times these. Panics unless
/// [`Matrix::check`] accepted `bits`, `group` and `cols`.
pub(super) fn quant_row_bytes(bits: u32, group: usize, cols: usize) -> (usize, usize) {
    let row = Affine::new(bits, group as u32)
        .and_then(|a| a.row_sizes(cols as u64))
        .expect("Matrix::check accepted this bit width and row width");
    (row.weights as usize, row.scales as usize)
}

/// The gate, up and down matrices of one expert blob of `pool` (its parts in blob
/// order, each at its own scheme), as views of the blob's bytes.
pub fn expert_matrices<'a>(pool: &ExpertPool, blob: &'a [u8]) -> [Matrix<'a>; 3] {
    let view = |b: &BlobPart| -> Matrix<'a> {
        let (o, w, s) = (b.offset as usize, b.weights as usize, b.scales as usize);
        let (rows, cols) = (b.rows as usize, b.cols as usize);
        match pool.part_scheme(b) {
            Scheme::Affine(a) => Matrix::Quant {
                bits: a.bits(),
                group: a.group() as usize,
                weights: &blob[o..o + w],
                scales: &blob[o + w..o + w + s],
                biases: &blob[o + w + s..o + w + 2 * s],
                rows,
                cols,
            },
            Scheme::Mxfp4 => Matrix::Mxfp4 {
                weights: &blob[o..o + w],
                scales: &blob[o + w..o + w + s],
                rows,
                cols,
            },
            Scheme::Passthrough => {
                let data = &blob[o..o + w];
                match pool.dtype {
                    Dtype::F16 => Matrix::Float {
                        dtype: FloatDtype::F16,
                        data,
                        rows,
                        cols,
                    },
                    Dtype::F32 => Matrix::Float {
                        dtype: FloatDtype::F32,
                        data,
                        rows,
                        cols,
                    },
                    _ => Matrix::Float {
                        dtype: FloatDtype::Bf16,
                        data,
                        rows,
                        cols,
                    },
                }
            }
        }
    };
    [
        view(&pool.parts[0]),
        view(&pool.parts[1]),
        view(&pool.parts[2]),
    ]
}

/// Read little-endian BF16 element `i` of `data`.
#[inline(always)]
pub(crate) fn bf16_at(data: &[u8], i: usize) -> f32 {
    bf16_to_f32(u16::from_le_bytes([data[2 * i], data[2 * i + 1]]))
}

/// `Σ a[i]·b[i]` in f32 (eight partial sums; the order differs from a sequential sum
/// by f32 rounding). Panics if the lengths differ.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        return x86::dot(a, b);
    }
    portable::dot(a, b)
}

/// `y[i] += a·x[i]`. Panics if the lengths differ.
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "axpy: lengths differ");
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// RMSNorm as Llama and Qwen define it: `out[i] = x[i] / sqrt(mean(x²) + eps) ·
/// weight[i]`, all in f32. Panics if the lengths differ.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert!(
        x.len() == weight.len() && x.len() == out.len(),
        "rms_norm: lengths differ"
    );
    let mean_sq = dot(x, x) / x.len().max(1) as f32;
    let inv = 1.0 / (mean_sq + eps).sqrt();
    for ((o, x), w) in out.iter_mut().zip(x).zip(weight) {
        *o = x * inv * w;
    }
}

/// Softmax in place, subtracting the maximum first; `-inf` entries become 0. An empty
/// slice is left alone.
pub fn softmax_inplace(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if x.is_empty() || max == f32::NEG_INFINITY {
        return;
    }
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// SwiGLU's gating: `gate[i] = silu(gate[i]) · up[i]` with `silu(g) = g / (1 + e^-g)`.
/// Panics if the lengths differ.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "silu_mul: lengths differ");
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}
