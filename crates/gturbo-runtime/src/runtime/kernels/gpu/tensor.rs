//! Device-owned data: activation tensors, uploaded weight matrices, the RoPE table,
//! the KV cache and the expert slot buffer.

use crate::runtime::kernels::RopeLayout;
use std::sync::{Arc, Mutex};

use super::context::GpuContext;
use super::error::{GpuError, Result};
use super::tuning;
use crate::format::Scheme;
use crate::format::dtype::Dtype;
use crate::format::mxfp4::GROUP as MXFP4_GROUP;
use crate::format::pools::ExpertPool;
use crate::format::quant::GROUP;
use crate::runtime::kernels::{AttentionSpec, FloatDtype, Matrix};

/// Element type of a [`GpuTensor`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    /// Activations, probabilities, weights of routed experts.
    F32,
    /// Token and expert ids.
    U32,
}

/// A device buffer of f32 or u32 elements with a row-major shape.
#[derive(Debug, Clone)]
pub struct GpuTensor {
    pub(crate) buf: Arc<wgpu::Buffer>,
    shape: Vec<usize>,
    dtype: DType,
}

impl GpuTensor {
    pub(crate) fn new(buf: Arc<wgpu::Buffer>, shape: &[usize], dtype: DType) -> GpuTensor {
        GpuTensor {
            buf,
            shape: shape.to_vec(),
            dtype,
        }
    }

    /// The shape, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Elements (the product of the shape).
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of its device buffer (which a pooled buffer may make larger than the shape).
    pub fn device_bytes(&self) -> u64 {
        self.buf.size()
    }

    /// Whether two tensors share device memory.
    pub(crate) fn aliases(&self, other: &GpuTensor) -> bool {
        Arc::ptr_eq(&self.buf, &other.buf)
    }
}

/// An element type a [`GpuTensor`] holds on the device: 4 little-endian bytes.
pub(crate) trait Element: Copy {
    /// The tensor's [`DType`].
    const DTYPE: DType;
    fn to_le(self) -> [u8; 4];
    fn from_le(b: [u8; 4]) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_le(self) -> [u8; 4] {
        self.to_le_bytes()
    }
    fn from_le(b: [u8; 4]) -> f32 {
        f32::from_le_bytes(b)
    }
}

impl Element for u32 {
    const DTYPE: DType = DType::U32;
    fn to_le(self) -> [u8; 4] {
        self.to_le_bytes()
    }
    fn from_le(b: [u8; 4]) -> u32 {
        u32::from_le_bytes(b)
    }
}

fn le_bytes<T: Element>(data: &[T]) -> Vec<u8> {
    data.iter().flat_map(|v| v.to_le()).collect()
}

fn check_len(op: &'static str, shape: &[usize], len: usize) -> Result<()> {
    let n: usize = shape.iter().product();
    if n == len {
        Ok(())
    } else {
        Err(GpuError::Shape {
            op,
            message: format!("{len} values for shape {shape:?} ({n} elements)"),
        })
    }
}

/// Tensors made from host data and read back: the context moves bytes, these give
/// them a shape and an element type.
impl GpuContext {
    /// A tensor of `T` holding `data` (`data.len()` must equal the shape's product).
    fn upload<T: Element>(&self, shape: &[usize], data: &[T]) -> Result<GpuTensor> {
        check_len("upload", shape, data.len())?;
        let buf = self.upload_bytes("tensor", &le_bytes(data))?;
        Ok(GpuTensor::new(buf, shape, T::DTYPE))
    }

    /// An f32 tensor holding `data` (`data.len()` must equal the shape's product).
    pub fn upload_f32(&self, shape: &[usize], data: &[f32]) -> Result<GpuTensor> {
        self.upload(shape, data)
    }

    /// A u32 tensor holding `data`.
    pub fn upload_u32(&self, shape: &[usize], data: &[u32]) -> Result<GpuTensor> {
        self.upload(shape, data)
    }

    /// A zero-filled tensor.
    pub fn zeros(&self, shape: &[usize], dtype: DType) -> Result<GpuTensor> {
        let n: usize = shape.iter().product();
        Ok(GpuTensor::new(
            self.buffer("tensor", n as u64 * 4)?,
            shape,
            dtype,
        ))
    }

    /// Overwrite an f32 tensor with `data` (in order with the recorded work).
    pub fn write_f32(&self, t: &GpuTensor, data: &[f32]) -> Result<()> {
        check_len("write", t.shape(), data.len())?;
        self.write_bytes(&t.buf, 0, &le_bytes(data))
    }

    /// Run the recorded work and read a tensor of `T` back.
    fn download<T: Element>(&self, t: &GpuTensor) -> Result<Vec<T>> {
        let bytes = self.read_back(&t.buf, (t.len() * 4) as u64)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| T::from_le([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// Run the recorded work and read an f32 tensor back (for sampling).
    pub fn download_f32(&self, t: &GpuTensor) -> Result<Vec<f32>> {
        self.download(t)
    }

    /// Run the recorded work and read the first `n` elements of an f32 tensor back
    /// (the positions a cache holds).
    pub fn download_f32_prefix(&self, t: &GpuTensor, n: usize) -> Result<Vec<f32>> {
        if n > t.len() {
            return Err(GpuError::Shape {
                op: "download",
                message: format!("{n} values of a tensor of {}", t.len()),
            });
        }
        let bytes = self.read_back(&t.buf, (n * 4) as u64)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// Overwrite the first `data.len()` elements of an f32 tensor (in order with the
    /// recorded work).
    pub fn write_f32_prefix(&self, t: &GpuTensor, data: &[f32]) -> Result<()> {
        if data.len() > t.len() {
            return Err(GpuError::Shape {
                op: "write",
                message: format!("{} values into a tensor of {}", data.len(), t.len()),
            });
        }
        self.write_bytes(&t.buf, 0, &le_bytes(data))
    }

    /// Run the recorded work and read a u32 tensor back (expert ids).
    pub fn download_u32(&self, t: &GpuTensor) -> Result<Vec<u32>> {
        self.download(t)
    }
}

/// How a [`GpuMatrix`] stores its elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// MLX affine: packed codes, BF16 scale and bias per group.
    Affine {
        /// Bits per code.
        bits: u32,
        /// Codes per group.
        group: u32,
    },
    /// BF16 elements.
    Bf16,
    /// IEEE half elements.
    F16,
    /// f32 elements.
    F32,
    /// MXFP4 in MLX's `mxfp4` layout: E2M1 codes (two per byte, low nibble first)
    /// from word `w_off`, one E8M0 scale byte per group of 32 from byte `s_off`.
    Mxfp4,
}

impl Encoding {
    /// The encoding of a float matrix of `dtype`.
    pub(crate) fn float(dtype: FloatDtype) -> Encoding {
        match dtype {
            FloatDtype::Bf16 => Encoding::Bf16,
            FloatDtype::F16 => Encoding::F16,
            FloatDtype::F32 => Encoding::F32,
        }
    }

    /// The code the float kernels take as `DTYPE` (f32 0, BF16 1, F16 2), or 3 for
    /// affine (the embed kernel's `ENCODING`), 4 for MXFP4 (which no kernel takes as
    /// a code: its products have their own entry point and embed refuses it).
    pub(crate) fn code(self) -> u32 {
        match self {
            Encoding::F32 => 0,
            Encoding::Bf16 => 1,
            Encoding::F16 => 2,
            Encoding::Affine { .. } => 3,
            Encoding::Mxfp4 => 4,
        }
    }
}

/// A weight matrix `[rows, cols]` in device memory: its own upload, or a view into
/// an [`ExpertSlots`] slot.
#[derive(Debug, Clone)]
pub struct GpuMatrix {
    pub(crate) buf: Arc<wgpu::Buffer>,
    pub(crate) encoding: Encoding,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    /// Affine: first code word; float: first element (words for f32, half-words for
    /// 16-bit types).
    pub(crate) w_off: u32,
    /// Affine: half-word index of the first scale and the first bias. MXFP4: byte
    /// index of the first scale (`b_off` unused).
    pub(crate) s_off: u32,
    pub(crate) b_off: u32,
}

impl GpuMatrix {
    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The storage encoding.
    pub fn encoding(&self) -> Encoding {
        self.encoding
    }

    /// Whether its matrix-vector product takes the 16-byte-load kernel
    /// ([`tuning::qmatvec_fast_path`]).
    pub(crate) fn fast_path(&self) -> bool {
        match self.encoding {
            Encoding::Affine { bits, group } => {
                tuning::qmatvec_fast_path(bits, group, self.w_off, self.cols)
            }
            _ => false,
        }
    }

    /// Whether its matrix-vector product can take the packed 24-bit x kernel
    /// ([`tuning::qmatvec_x24_path`]).
    pub(crate) fn x24_path(&self) -> bool {
        match self.encoding {
            Encoding::Affine { bits, group } => {
                tuning::qmatvec_x24_path(bits, group, self.w_off, self.cols)
            }
            _ => false,
        }
    }

    /// Bytes a product reads (codes, scales, biases, or elements).
    pub fn weight_bytes(&self) -> usize {
        let n = self.rows * self.cols;
        match self.encoding {
            Encoding::Affine { bits, group } => {
                n * bits as usize / 8 + 2 * 2 * (n / group as usize)
            }
            Encoding::Bf16 | Encoding::F16 => 2 * n,
            Encoding::F32 => 4 * n,
            Encoding::Mxfp4 => n / 2 + n / MXFP4_GROUP,
        }
    }

    /// Upload `m` (checked first; never panics on a bad matrix).
    pub fn upload(ctx: &GpuContext, m: &Matrix, label: &str) -> Result<GpuMatrix> {
        m.check()?;
        let (rows, cols) = (m.rows(), m.cols());
        let (encoding, parts): (Encoding, Vec<&[u8]>) = match *m {
            Matrix::Quant {
                bits,
                group,
                weights,
                scales,
                biases,
                ..
            } => {
                // Every width and group `Matrix::check` accepts (MLX's 2, 3, 4, 5, 6
                // and 8 bits in groups of 32, 64 and 128) has a kernel; the WGSL
                // reads codes as the same dense bit stream the CPU does.
                let group32 = u32::try_from(group).unwrap_or(0);
                if !matches!(bits, 2..=6 | 8) || !matches!(group32, 32 | 64 | 128) {
                    return Err(GpuError::Shape {
                        op: "upload",
                        message: format!(
                            "{label}: int{bits}_g{group} has no GPU kernel (widths 2-6 and 8, \
                             groups 32, 64, 128); use --backend cpu"
                        ),
                    });
                }
                (
                    Encoding::Affine {
                        bits,
                        group: group32,
                    },
                    vec![weights, scales, biases],
                )
            }
            Matrix::Mxfp4 {
                weights, scales, ..
            } => (Encoding::Mxfp4, vec![weights, scales]),
            Matrix::Float { dtype, data, .. } => (Encoding::float(dtype), vec![data]),
        };
        // One buffer: codes (a whole number of words, since cols is a multiple of the
        // group and 32 codes of any width fill whole words),
        // then scales and biases addressed as half-words.
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut bytes = Vec::with_capacity(total.next_multiple_of(4));
        for p in &parts {
            bytes.extend_from_slice(p);
        }
        let buf = ctx.upload_bytes(label, &bytes)?;
        let (w_off, s_off, b_off) = match parts.as_slice() {
            [w, s, _] => (0, half_index(w.len())?, half_index(w.len() + s.len())?),
            // MXFP4: the scale bytes right after the codes (a whole number of words:
            // 16 bytes per group of 32).
            [w, _] => (0, byte_index(w.len())?, 0),
            _ => (0, 0, 0),
        };
        Ok(GpuMatrix {
            buf,
            encoding,
            rows,
            cols,
            w_off,
            s_off,
            b_off,
        })
    }
}

fn byte_index(bytes: usize) -> Result<u32> {
    u32::try_from(bytes).map_err(|_| GpuError::TooLarge {
        what: "a matrix addressed by byte index".into(),
        bytes: bytes as u64,
        limit: u64::from(u32::MAX),
    })
}

fn half_index(bytes: usize) -> Result<u32> {
    u32::try_from(bytes / 2).map_err(|_| GpuError::TooLarge {
        what: "a matrix addressed by 16-bit index".into(),
        bytes: bytes as u64,
        limit: u64::from(u32::MAX) * 2,
    })
}

/// cos and sin of every (position, frequency) pair, built on the host exactly as the
/// CPU runner builds them: `inv_freq_i = θ^(-2i/rot)` in f64 rounded to f32, then
/// `(pos as f32 · inv_freq_i).sin_cos()` in f32. It takes `positions · rot · 4`
/// bytes of device memory (SmolLM2's 8192 positions at width 64: 2 MiB).
#[derive(Debug, Clone)]
pub struct RopeTable {
    pub(crate) table: GpuTensor,
    pub(crate) rot: usize,
    /// Row 0's position.
    first: usize,
    /// The end (exclusive) of the positions covered.
    positions: usize,
    /// Which dims pair up (`ctx.rope` reads it; the Flash-Next ops, half-split only,
    /// read the table alone).
    pub(crate) layout: RopeLayout,
}

impl RopeTable {
    /// A table for rotating the first `rot` dims of each head (`rot` even; the head
    /// width for full RoPE) at positions `0..positions`.
    pub fn new(ctx: &GpuContext, rot: usize, theta: f64, positions: usize) -> Result<RopeTable> {
        if rot == 0 || !rot.is_multiple_of(2) {
            return Err(GpuError::Shape {
                op: "rope table",
                message: format!("rotary width {rot} is not a positive even number"),
            });
        }
        let half = rot / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| (1.0 / theta.powf(2.0 * i as f64 / rot as f64)) as f32)
            .collect();
        RopeTable::from_inv_freq(ctx, &inv_freq, 0..positions)
    }

    /// A table for the frequencies `inv_freq` (the first `2·inv_freq.len()` dims of
    /// each head rotate) at the absolute positions `positions` (row `i` is position
    /// `positions.start + i`).
    pub fn from_inv_freq(
        ctx: &GpuContext,
        inv_freq: &[f32],
        positions: std::ops::Range<usize>,
    ) -> Result<RopeTable> {
        let rot = 2 * inv_freq.len();
        if rot == 0 {
            return Err(GpuError::Shape {
                op: "rope table",
                message: "no frequencies".into(),
            });
        }
        let (first, rows) = (positions.start, positions.len());
        let mut t = Vec::with_capacity(rows * rot);
        for pos in positions {
            for f in inv_freq {
                let (s, c) = (pos as f32 * f).sin_cos();
                t.push(c);
                t.push(s);
            }
        }
        Ok(RopeTable {
            table: ctx.upload_f32(&[rows, inv_freq.len(), 2], &t)?,
            rot,
            first,
            positions: first + rows,
            layout: RopeLayout::HalfSplit,
        })
    }

    /// The same table rotating the pairs `layout` names.
    pub fn with_layout(self, layout: RopeLayout) -> RopeTable {
        RopeTable { layout, ..self }
    }

    /// Rotated dims per head.
    pub fn rot(&self) -> usize {
        self.rot
    }

    /// The end of the positions covered (exclusive).
    pub fn positions(&self) -> usize {
        self.positions
    }

    /// The first position covered (its row 0).
    pub fn first(&self) -> usize {
        self.first
    }
}

/// One layer's KV cache: keys `[capacity, kv_heads·qk_dim]` and values `[capacity,
/// kv_heads·v_dim]`, f32, for attention as `spec` says.
#[derive(Debug, Clone)]
pub struct KvCache {
    pub(crate) k: GpuTensor,
    pub(crate) v: GpuTensor,
    pub(crate) capacity: usize,
    pub(crate) spec: AttentionSpec,
    /// The position of row 0 (a window cache drops the rows no query sees again).
    pub(crate) start: usize,
}

impl KvCache {
    /// An empty cache for `capacity` positions.
    pub fn new(ctx: &GpuContext, capacity: usize, spec: AttentionSpec) -> Result<KvCache> {
        spec.check().map_err(|message| GpuError::Shape {
            op: "kv_cache",
            message,
        })?;
        Ok(KvCache {
            k: ctx.zeros(&[capacity, spec.k_width()], DType::F32)?,
            // Values in the keys: no value rows (one element: a buffer is never empty).
            v: if spec.values_in_keys {
                ctx.zeros(&[1], DType::F32)?
            } else {
                ctx.zeros(&[capacity, spec.v_width()], DType::F32)?
            },
            capacity,
            spec,
            start: 0,
        })
    }

    /// Positions it holds at most.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// What it was made for.
    pub fn spec(&self) -> AttentionSpec {
        self.spec
    }

    /// Copy the rows of positions `from..end` of `self` into `to` from its row 0
    /// (recorded in order), both widths; `to` then starts at `from`.
    pub(crate) fn copy_into(&self, ctx: &GpuContext, to: &mut KvCache, from: usize, end: usize) {
        for (src, into, width) in [
            (&self.k, &to.k, self.spec.k_width()),
            (&self.v, &to.v, self.spec.stored_v_width()),
        ] {
            let row = (width * 4) as u64;
            let bytes = (end - from) as u64 * row;
            if bytes > 0 {
                ctx.copy(
                    &src.buf,
                    (from - self.start) as u64 * row,
                    &into.buf,
                    0,
                    bytes,
                );
            }
        }
        to.start = from;
    }
}

/// Where one projection sits inside a blob, in the units the kernels address.
#[derive(Debug, Clone, Copy)]
struct PartView {
    rows: usize,
    cols: usize,
    /// Byte offsets inside the blob.
    offset: usize,
    weights: usize,
    scales: usize,
}

/// A device buffer of `slots` expert blobs of one pool geometry (gate, up, down as
/// [`ExpertPool`] lays them out), filled from the host's `pread` buffers.
#[derive(Debug)]
pub struct ExpertSlots {
    pub(crate) buf: Arc<wgpu::Buffer>,
    slots: usize,
    /// Bytes between slots: the blob rounded up to 256 (every offset stays a whole
    /// number of words and of elements), or the pool's stride for a whole pool.
    pub(crate) slot_bytes: usize,
    blob_bytes: usize,
    encoding: Encoding,
    parts: [PartView; 3],
    /// Expert width and model width.
    pub(crate) inter: usize,
    pub(crate) hidden: usize,
    /// Activations of the expert products, grown to the most tokens seen.
    scratch: Mutex<Option<Scratch>>,
}

impl ExpertSlots {
    /// `slots` slots for blobs of `pool`'s geometry (checked with
    /// [`ExpertPool::layout_errors`]).
    pub fn new(ctx: &GpuContext, pool: &ExpertPool, slots: usize) -> Result<ExpertSlots> {
        ExpertSlots::make(ctx, pool, slots, None)
    }

    /// A layer's whole pool file (`pool.experts` blobs, `pool.stride` apart), as
    /// mapped, uploaded once: slot `e` is expert `e` (resident experts).
    pub fn whole_pool(ctx: &GpuContext, pool: &ExpertPool, bytes: &[u8]) -> Result<ExpertSlots> {
        let experts = usize::try_from(pool.experts).unwrap_or(usize::MAX);
        if bytes.len() as u64 != pool.file_bytes {
            return Err(GpuError::Shape {
                op: "expert pool",
                message: format!(
                    "pool {}: {} bytes mapped, the manifest says {}",
                    pool.file,
                    bytes.len(),
                    pool.file_bytes
                ),
            });
        }
        ExpertSlots::make(ctx, pool, experts, Some(bytes))
    }

    fn make(
        ctx: &GpuContext,
        pool: &ExpertPool,
        slots: usize,
        whole: Option<&[u8]>,
    ) -> Result<ExpertSlots> {
        let bad = |message: String| GpuError::Shape {
            op: "expert slots",
            message: format!("pool {}: {message}", pool.file),
        };
        if let Some(e) = pool.layout_errors().first() {
            return Err(bad(e.to_string()));
        }
        if slots == 0 {
            return Err(bad("zero slots".into()));
        }
        let encoding = pool_encoding(pool).map_err(&bad)?;
        let to = |v: u64| usize::try_from(v).map_err(|_| bad(format!("{v} does not fit")));
        let mut parts = [PartView {
            rows: 0,
            cols: 0,
            offset: 0,
            weights: 0,
            scales: 0,
        }; 3];
        for (view, p) in parts.iter_mut().zip(&pool.parts) {
            *view = PartView {
                rows: to(p.rows)?,
                cols: to(p.cols)?,
                offset: to(p.offset)?,
                weights: to(p.weights)?,
                scales: to(p.scales)?,
            };
            let align = match encoding {
                Encoding::Affine { .. } | Encoding::F32 | Encoding::Mxfp4 => 4,
                Encoding::Bf16 | Encoding::F16 => 2,
            };
            if !view.offset.is_multiple_of(align) {
                return Err(bad(format!(
                    "part {:?} at byte {} is not {align}-byte aligned",
                    p.part, p.offset
                )));
            }
        }
        let (inter, hidden) = (parts[0].rows, parts[0].cols);
        if parts[1].rows != inter
            || parts[1].cols != hidden
            || parts[2].rows != hidden
            || parts[2].cols != inter
        {
            return Err(bad(format!(
                "parts of shapes {:?} are not gate/up [I, H] and down [H, I]",
                pool.parts
                    .iter()
                    .map(|p| (p.rows, p.cols))
                    .collect::<Vec<_>>()
            )));
        }
        let blob_bytes = to(pool.blob_bytes)?;
        let slot_bytes = match whole {
            // layout_errors checked that the stride is the blob rounded up to a page.
            Some(_) => to(pool.stride)?,
            None => blob_bytes.next_multiple_of(256),
        };
        let total = slot_bytes
            .checked_mul(slots)
            .ok_or_else(|| bad("slot buffer size overflows".into()))?;
        let buf = match whole {
            Some(bytes) => ctx.upload_bytes("expert pool", bytes)?,
            None => ctx.buffer("expert slots", total as u64)?,
        };
        Ok(ExpertSlots {
            buf,
            slots,
            slot_bytes,
            blob_bytes,
            encoding,
            parts,
            inter,
            hidden,
            scratch: Mutex::new(None),
        })
    }

    /// Scratch buffers for `tokens` rows (reused; dispatches that read the old ones
    /// are already recorded, and recording order is execution order).
    pub(crate) fn scratch(&self, ctx: &GpuContext, tokens: usize) -> Result<Scratch> {
        let mut s = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = s.as_ref().filter(|s| s.tokens >= tokens) {
            return Ok(s.clone());
        }
        let f = |w: usize| ctx.buffer("expert scratch", (tokens * w * 4) as u64);
        let new = Scratch {
            tokens,
            xs: f(self.hidden)?,
            g: f(self.inter)?,
            u: f(self.inter)?,
            d: f(self.hidden)?,
        };
        *s = Some(new.clone());
        Ok(new)
    }

    /// Slots in the buffer.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Copy one expert blob (as read from its pool) into `slot`. Recorded in order
    /// with the dispatches: work recorded before sees the old contents.
    pub fn fill(&self, ctx: &GpuContext, slot: usize, blob: &[u8]) -> Result<()> {
        if slot >= self.slots || blob.len() != self.blob_bytes {
            return Err(GpuError::Shape {
                op: "expert slot fill",
                message: format!(
                    "slot {slot} of {}, blob of {} bytes (the pool's are {})",
                    self.slots,
                    blob.len(),
                    self.blob_bytes
                ),
            });
        }
        ctx.write_bytes(&self.buf, (slot * self.slot_bytes) as u64, blob)
    }

    /// The gate, up and down matrices of `slot`.
    pub fn matrices(&self, slot: usize) -> Result<[GpuMatrix; 3]> {
        if slot >= self.slots {
            return Err(GpuError::Shape {
                op: "expert slot",
                message: format!("slot {slot} of {}", self.slots),
            });
        }
        let base = slot * self.slot_bytes;
        let view = |p: &PartView| -> Result<GpuMatrix> {
            let at = base + p.offset;
            let idx = |v: usize| {
                u32::try_from(v).map_err(|_| GpuError::TooLarge {
                    what: "the expert slot buffer".into(),
                    bytes: (self.slot_bytes * self.slots) as u64,
                    limit: u64::from(u32::MAX),
                })
            };
            let (w_off, s_off, b_off) = match self.encoding {
                Encoding::Affine { .. } => (
                    idx(at / 4)?,
                    idx((at + p.weights) / 2)?,
                    idx((at + p.weights + p.scales) / 2)?,
                ),
                Encoding::F32 => (idx(at / 4)?, 0, 0),
                Encoding::Bf16 | Encoding::F16 => (idx(at / 2)?, 0, 0),
                Encoding::Mxfp4 => (idx(at / 4)?, idx(at + p.weights)?, 0),
            };
            Ok(GpuMatrix {
                buf: self.buf.clone(),
                encoding: self.encoding,
                rows: p.rows,
                cols: p.cols,
                w_off,
                s_off,
                b_off,
            })
        };
        Ok([
            view(&self.parts[0])?,
            view(&self.parts[1])?,
            view(&self.parts[2])?,
        ])
    }
}

/// The one encoding of a pool's parts on the GPU (the kernels address every part of
/// a slot alike), or why there is none.
fn pool_encoding(pool: &ExpertPool) -> std::result::Result<Encoding, String> {
    let mxfp4 = pool
        .parts
        .iter()
        .filter(|p| pool.part_scheme(p) == Scheme::Mxfp4)
        .count();
    if mxfp4 != 0 && mxfp4 != pool.parts.len() {
        return Err(format!(
            "{mxfp4} of {} parts are MXFP4 (mxfp4_g32): a pool's parts share one \
             encoding on the GPU",
            pool.parts.len()
        ));
    }
    Ok(match (pool.scheme.bits(), pool.dtype) {
        _ if mxfp4 != 0 => Encoding::Mxfp4,
        (Some(bits), _) => Encoding::Affine {
            bits,
            group: pool.scheme.group().unwrap_or(GROUP as u32),
        },
        (None, Dtype::BF16) => Encoding::Bf16,
        (None, Dtype::F16) => Encoding::F16,
        (None, Dtype::F32) => Encoding::F32,
        (None, d) => return Err(format!("experts stored as {d:?} cannot be computed")),
    })
}

/// Device scratch for [`GpuContext::expert_ffn`] over up to `tokens` rows.
#[derive(Debug, Clone)]
pub(crate) struct Scratch {
    pub(crate) tokens: usize,
    pub(crate) xs: Arc<wgpu::Buffer>,
    pub(crate) g: Arc<wgpu::Buffer>,
    pub(crate) u: Arc<wgpu::Buffer>,
    pub(crate) d: Arc<wgpu::Buffer>,
}
