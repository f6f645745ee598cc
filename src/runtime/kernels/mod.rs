//! TEMPORARY scalar stand-in for wt/kernels (same API); replaced by the kernels branch
//! on merge.

/// A weight matrix view over install bytes.
#[derive(Debug, Clone, Copy)]
pub enum Matrix<'a> {
    /// Affine-quantized, group 64 (MLX layout).
    Quant {
        /// 4 or 8.
        bits: u32,
        /// Packed u32 words, little-endian.
        weights: &'a [u8],
        /// BF16 scales.
        scales: &'a [u8],
        /// BF16 biases.
        biases: &'a [u8],
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
    },
    /// BF16 row-major.
    Bf16 {
        /// Bytes.
        data: &'a [u8],
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
    },
    /// F16 row-major.
    F16 {
        /// Bytes.
        data: &'a [u8],
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
    },
    /// F32 row-major.
    F32 {
        /// Bytes.
        data: &'a [u8],
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
    },
}

impl Matrix<'_> {
    /// Rows.
    pub fn rows(&self) -> usize {
        match *self {
            Matrix::Quant { rows, .. }
            | Matrix::Bf16 { rows, .. }
            | Matrix::F16 { rows, .. }
            | Matrix::F32 { rows, .. } => rows,
        }
    }
    /// Columns.
    pub fn cols(&self) -> usize {
        match *self {
            Matrix::Quant { cols, .. }
            | Matrix::Bf16 { cols, .. }
            | Matrix::F16 { cols, .. }
            | Matrix::F32 { cols, .. } => cols,
        }
    }
}

/// Compute backend.
pub trait Backend: Send + Sync {
    /// Name.
    fn name(&self) -> &str;
    /// `y = M x`.
    fn matvec(&self, m: &Matrix, x: &[f32], y: &mut [f32]);
    /// `ys[i] = M xs[i]` for `n` rows.
    fn matmul(&self, m: &Matrix, xs: &[f32], n: usize, ys: &mut [f32]);
    /// Row `r` of `M` dequantized.
    fn row(&self, m: &Matrix, r: usize, out: &mut [f32]);
}

/// Scalar CPU backend.
pub struct Cpu;

impl Cpu {
    /// A backend using `threads` threads.
    pub fn new(_threads: usize) -> Cpu {
        Cpu
    }
}

fn bf(b: &[u8], i: usize) -> f32 {
    f32::from_bits((u16::from_le_bytes([b[2 * i], b[2 * i + 1]]) as u32) << 16)
}

impl Backend for Cpu {
    fn name(&self) -> &str {
        "cpu-scalar"
    }
    fn matvec(&self, m: &Matrix, x: &[f32], y: &mut [f32]) {
        let mut row = vec![0f32; m.cols()];
        for (r, yr) in y.iter_mut().enumerate().take(m.rows()) {
            self.row(m, r, &mut row);
            *yr = row.iter().zip(x).map(|(a, b)| a * b).sum();
        }
    }
    fn matmul(&self, m: &Matrix, xs: &[f32], n: usize, ys: &mut [f32]) {
        let (c, r) = (m.cols(), m.rows());
        for i in 0..n {
            self.matvec(m, &xs[i * c..(i + 1) * c], &mut ys[i * r..(i + 1) * r]);
        }
    }
    fn row(&self, m: &Matrix, r: usize, out: &mut [f32]) {
        match *m {
            Matrix::Quant {
                bits,
                weights,
                scales,
                biases,
                cols,
                ..
            } => {
                let per = 32 / bits as usize;
                let mask = (1u32 << bits) - 1;
                let wpr = cols / per;
                let gpr = cols / 64;
                for (j, o) in out.iter_mut().enumerate().take(cols) {
                    let wi = r * wpr + j / per;
                    let w = u32::from_le_bytes(weights[4 * wi..4 * wi + 4].try_into().unwrap());
                    let q = (w >> ((j % per) as u32 * bits)) & mask;
                    let g = r * gpr + j / 64;
                    *o = bf(scales, g) * q as f32 + bf(biases, g);
                }
            }
            Matrix::Bf16 { data, cols, .. } => {
                for (j, o) in out.iter_mut().enumerate().take(cols) {
                    *o = bf(data, r * cols + j);
                }
            }
            Matrix::F16 { data, cols, .. } => {
                for (j, o) in out.iter_mut().enumerate().take(cols) {
                    let i = r * cols + j;
                    *o = half::f16::from_le_bytes([data[2 * i], data[2 * i + 1]]).to_f32();
                }
            }
            Matrix::F32 { data, cols, .. } => {
                for (j, o) in out.iter_mut().enumerate().take(cols) {
                    let i = 4 * (r * cols + j);
                    *o = f32::from_le_bytes(data[i..i + 4].try_into().unwrap());
                }
            }
        }
    }
}
