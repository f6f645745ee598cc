//! Every kernel path against a scalar f64 reference built from
//! `transform::quant::dequantize_rows`, with weights quantized by the install's own
//! `quantize_rows`, so the byte layout under test is the real one.
//!
//! Tolerance: a product may differ from the exact sum by `1e-5 · M`, where `M` is
//! the sum of the magnitudes of the terms the kernel actually adds: `Σ |w·x|` for float
//! matrices, and `Σ (|s·q| + |b|)·|x|` for quantized ones (the kernel adds `s·Σq·x`
//! and `b·Σx` separately). f32 accumulation over ≤ 1536 terms stays well inside that.

use super::*;
use crate::format::quant::{Bits, Spec, dequantize_rows, f32_to_bf16, quantize_rows};
use crate::runtime::testing::Rng;

const TOL: f64 = 1e-5;

/// Bytes placed at an odd offset inside a larger buffer, so loads are unaligned.
struct Odd(Vec<u8>);

impl Odd {
    fn new(bytes: &[u8]) -> Odd {
        let mut v = vec![0xAAu8];
        v.extend_from_slice(bytes);
        Odd(v)
    }
    fn get(&self) -> &[u8] {
        &self.0[1..]
    }
}

/// A test matrix: its encoded bytes (at an odd offset) plus the f32 values the
/// encoding stands for and, for quantized ones, the per-element bias.
struct Fixture {
    kind: &'static str,
    bits: u32,
    group: usize,
    parts: Vec<Odd>,
    rows: usize,
    cols: usize,
    dense: Vec<f32>,
    bias: Vec<f32>,
}

impl Fixture {
    fn quant(spec: impl Into<Spec>, rows: usize, cols: usize, rng: &mut Rng) -> Fixture {
        let spec = spec.into();
        let (bits, group) = (spec.bits, spec.group.size());
        // Rows with different ranges, and one all-zero group, as real weights have.
        let mut src: Vec<u16> = (0..rows * cols)
            .map(|i| f32_to_bf16(rng.unit() * (0.02 + (i / cols % 7) as f32 * 0.05)))
            .collect();
        src[..group].fill(0);
        let n = rows * cols;
        let mut w = vec![0u8; n * bits.bits() as usize / 8];
        let mut s = vec![0u8; n / group * 2];
        let mut b = vec![0u8; n / group * 2];
        quantize_rows(&src, cols, spec, &mut w, &mut s, &mut b).unwrap();
        let mut dense = vec![0.0f32; n];
        dequantize_rows(&w, &s, &b, cols, spec, &mut dense).unwrap();
        let bias = (0..n).map(|i| bf16_at(&b, i / group)).collect();
        Fixture {
            kind: "quant",
            bits: bits.bits(),
            group,
            parts: vec![Odd::new(&w), Odd::new(&s), Odd::new(&b)],
            rows,
            cols,
            dense,
            bias,
        }
    }

    /// MXFP4 (`mxfp4_g32`): random codes; scales mostly 2^-8..2^-2, with an all-zero
    /// group, and the smallest (2^-127, subnormal) and a large (2^20) exponent in
    /// play. The reference is the format's own decode.
    fn mxfp4(rows: usize, cols: usize, rng: &mut Rng) -> Fixture {
        let n = rows * cols;
        let mut w: Vec<u8> = (0..n / 2).map(|_| rng.next() as u8).collect();
        w[..16].fill(0);
        let mut s: Vec<u8> = (0..n / 32).map(|_| 119 + (rng.next() % 7) as u8).collect();
        if s.len() > 2 {
            s[1] = 0;
            s[2] = 147;
        }
        let mut dense = vec![0.0f32; n];
        crate::format::mxfp4::dequantize_rows(&w, &s, cols, &mut dense).unwrap();
        Fixture {
            kind: "mxfp4",
            bits: 4,
            group: 32,
            parts: vec![Odd::new(&w), Odd::new(&s)],
            rows,
            cols,
            bias: vec![0.0; n],
            dense,
        }
    }

    fn float(kind: &'static str, rows: usize, cols: usize, rng: &mut Rng) -> Fixture {
        let vals = rng.vec(rows * cols);
        let (bytes, dense): (Vec<u8>, Vec<f32>) = match kind {
            "bf16" => {
                let b: Vec<u16> = vals.iter().map(|&v| f32_to_bf16(v)).collect();
                (
                    b.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    b.iter().map(|&v| bf16_to_f32(v)).collect(),
                )
            }
            "f16" => {
                let h: Vec<half::f16> = vals.iter().map(|&v| half::f16::from_f32(v)).collect();
                (
                    h.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    h.iter().map(|v| v.to_f32()).collect(),
                )
            }
            _ => (vals.iter().flat_map(|v| v.to_le_bytes()).collect(), vals),
        };
        Fixture {
            kind,
            bits: 0,
            group: 0,
            parts: vec![Odd::new(&bytes)],
            rows,
            cols,
            bias: vec![0.0; dense.len()],
            dense,
        }
    }

    fn matrix(&self) -> Matrix<'_> {
        let (rows, cols) = (self.rows, self.cols);
        let data = self.parts[0].get();
        match self.kind {
            "quant" => Matrix::Quant {
                bits: self.bits,
                group: self.group,
                weights: data,
                scales: self.parts[1].get(),
                biases: self.parts[2].get(),
                rows,
                cols,
            },
            "mxfp4" => Matrix::Mxfp4 {
                weights: data,
                scales: self.parts[1].get(),
                rows,
                cols,
            },
            "bf16" => Matrix::Float {
                dtype: FloatDtype::Bf16,
                data,
                rows,
                cols,
            },
            "f16" => Matrix::Float {
                dtype: FloatDtype::F16,
                data,
                rows,
                cols,
            },
            _ => Matrix::Float {
                dtype: FloatDtype::F32,
                data,
                rows,
                cols,
            },
        }
    }

    /// Exact `W x` (f64) and the magnitude the tolerance scales with, per row.
    fn reference(&self, x: &[f32]) -> Vec<(f64, f64)> {
        (0..self.rows)
            .map(|r| {
                let row = &self.dense[r * self.cols..(r + 1) * self.cols];
                let bias = &self.bias[r * self.cols..(r + 1) * self.cols];
                let mut sum = 0.0f64;
                let mut mag = 0.0f64;
                for ((w, b), x) in row.iter().zip(bias).zip(x) {
                    sum += *w as f64 * *x as f64;
                    mag += ((*w - *b).abs() as f64 + b.abs() as f64) * x.abs() as f64;
                }
                (sum, mag)
            })
            .collect()
    }
}

fn assert_close(got: &[f32], want: &[(f64, f64)], what: &str) {
    assert_eq!(got.len(), want.len());
    for (r, (g, (w, mag))) in got.iter().zip(want).enumerate() {
        let err = (*g as f64 - w).abs();
        assert!(
            err <= TOL * mag + 1e-30,
            "{what}: row {r}: got {g}, want {w}, error {err:e} > {TOL:e} x {mag:e}"
        );
    }
}

fn backends() -> Vec<(String, Cpu)> {
    let mut v = Vec::new();
    for threads in [1, 2, 3] {
        v.push((format!("portable/{threads}"), Cpu::portable(threads)));
        v.push((format!("native/{threads}"), Cpu::new(threads)));
    }
    v
}

fn fixtures(rng: &mut Rng) -> Vec<Fixture> {
    let mut f = Vec::new();
    for bits in [Bits::Four, Bits::Eight] {
        for (rows, cols) in [(1, 64), (37, 192), (130, 576), (67, 1536)] {
            f.push(Fixture::quant(bits, rows, cols, rng));
        }
    }
    // Every width and group MLX writes (the general loop, and the fast ones at g64).
    for spec in Spec::all() {
        for (rows, cols) in [(1, 128), (37, 384)] {
            f.push(Fixture::quant(spec, rows, cols, rng));
        }
    }
    // gpt-oss's MXFP4 experts (one group, odd row counts, gpt-oss-20b's width 2880).
    for (rows, cols) in [(1, 32), (37, 96), (130, 576), (9, 2880)] {
        f.push(Fixture::mxfp4(rows, cols, rng));
    }
    for kind in ["bf16", "f16", "f32"] {
        for (rows, cols) in [(1, 1), (5, 7), (33, 100), (70, 129), (19, 576)] {
            f.push(Fixture::float(kind, rows, cols, rng));
        }
    }
    f
}

#[test]
fn matvec_matches_the_scalar_reference_on_every_path() {
    let mut rng = Rng(0x5EED_0001);
    let fx = fixtures(&mut rng);
    for (name, cpu) in backends() {
        for f in &fx {
            let m = f.matrix();
            m.check().unwrap();
            // x starts one float into its buffer: not 32-byte aligned.
            let xbuf = rng.vec(f.cols + 1);
            let x = &xbuf[1..];
            let mut y = vec![f32::NAN; f.rows];
            cpu.matvec(&m, x, &mut y);
            let what = format!(
                "{name} {} bits={} g{} {}x{}",
                f.kind, f.bits, f.group, f.rows, f.cols
            );
            assert_close(&y, &f.reference(x), &what);
        }
    }
}

#[test]
fn matmul_equals_n_matvecs_and_the_reference() {
    let mut rng = Rng(0x5EED_0002);
    let fx = fixtures(&mut rng);
    for (name, cpu) in backends() {
        for f in &fx {
            let m = f.matrix();
            for n in 1..=5 {
                let xs = rng.vec(n * f.cols);
                let mut ys = vec![f32::NAN; n * f.rows];
                cpu.matmul(&m, &xs, n, &mut ys);
                for j in 0..n {
                    let x = &xs[j * f.cols..(j + 1) * f.cols];
                    let got = &ys[j * f.rows..(j + 1) * f.rows];
                    let what =
                        format!("{name} {} bits={} g{} n={n} j={j}", f.kind, f.bits, f.group);
                    let want = f.reference(x);
                    assert_close(got, &want, &what);
                    let mut y1 = vec![0.0f32; f.rows];
                    cpu.matvec(&m, x, &mut y1);
                    // Both within TOL of the exact value, so within 2·TOL of each other.
                    for (r, ((a, b), (_, mag))) in got.iter().zip(&y1).zip(&want).enumerate() {
                        let d = (*a as f64 - *b as f64).abs();
                        assert!(d <= 2.0 * TOL * mag + 1e-30, "{what}: row {r}: {a} vs {b}");
                    }
                }
            }
        }
    }
}

#[test]
fn row_is_the_dequantized_row_bit_for_bit() {
    let mut rng = Rng(0x5EED_0003);
    let fx = fixtures(&mut rng);
    for (name, cpu) in backends() {
        for f in &fx {
            let m = f.matrix();
            for r in [0, f.rows / 2, f.rows - 1] {
                let mut out = vec![f32::NAN; f.cols];
                cpu.row(&m, r, &mut out);
                let want = &f.dense[r * f.cols..(r + 1) * f.cols];
                let same = out
                    .iter()
                    .zip(want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{name} {} bits={} g{} row {r}",
                    f.kind, f.bits, f.group
                );
            }
        }
    }
}

#[test]
fn prepared_rows_are_the_dequantized_row_in_input_order() {
    // The matmul path dequantizes into the permuted order `Prepared` gives `x`; the
    // values must be the reference values, each exactly once, in that order.
    let mut rng = Rng(0x5EED_0004);
    for f in fixtures(&mut rng) {
        let m = f.matrix();
        let r = f.rows - 1;
        let natural = &f.dense[r * f.cols..(r + 1) * f.cols];
        let want = Prepared::new(&m, natural).x;
        for (name, cpu) in backends() {
            let mut out = vec![f32::NAN; f.cols];
            cpu.row_prepared(&m.slice_rows(r, r + 1), &mut out);
            let same = out
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{name} {} bits={}", f.kind, f.bits);
        }
    }
}

#[test]
fn check_refuses_shapes_the_bytes_do_not_hold() {
    let b = [0u8; 64];
    let quant = |bits, w: &'static [u8], rows, cols| Matrix::Quant {
        bits,
        group: 64,
        weights: w,
        scales: &[0; 4],
        biases: &[0; 4],
        rows,
        cols,
    };
    static W64: [u8; 64] = [0; 64];
    assert_eq!(quant(4, &W64[..64], 2, 64).check(), Ok(()));
    assert_eq!(
        quant(7, &W64, 2, 64).check(),
        Err(KernelError::Bits { bits: 7, group: 64 })
    );
    assert_eq!(
        quant(4, &W64, 2, 96).check(),
        Err(KernelError::Cols {
            cols: 96,
            group: 64
        })
    );
    assert_eq!(
        quant(4, &W64, 0, 0).check(),
        Err(KernelError::Cols { cols: 0, group: 64 })
    );
    let err = quant(8, &W64, 2, 64).check().unwrap_err();
    assert_eq!(
        err.to_string(),
        "weights holds 64 bytes; a 2x64 matrix needs 128"
    );
    let err = Matrix::Float {
        dtype: FloatDtype::Bf16,
        data: &b[..63],
        rows: 4,
        cols: 8,
    }
    .check()
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "data holds 63 bytes; a 4x8 matrix needs 64"
    );
    let f32m = Matrix::Float {
        dtype: FloatDtype::F32,
        data: &b,
        rows: 4,
        cols: 4,
    };
    assert_eq!(f32m.check(), Ok(()));
    assert_eq!((f32m.rows(), f32m.cols(), f32m.weight_bytes()), (4, 4, 64));
    // Shapes whose byte counts overflow are refused, not wrapped.
    let huge = Matrix::Float {
        dtype: FloatDtype::F32,
        data: &b,
        rows: usize::MAX / 2,
        cols: 2,
    };
    assert!(matches!(huge.check(), Err(KernelError::TooLarge { .. })));
    let huge = quant(8, &W64, usize::MAX / 64, 64);
    assert!(matches!(huge.check(), Err(KernelError::TooLarge { .. })));
}

#[test]
fn helpers_match_their_definitions() {
    let mut rng = Rng(0x5EED_0005);
    for n in [1, 7, 64, 577] {
        let a = rng.vec(n);
        let b = rng.vec(n);
        let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        let mag: f64 = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (*x as f64 * *y as f64).abs())
            .sum();
        assert!((dot(&a, &b) as f64 - exact).abs() <= TOL * mag, "dot n={n}");
        assert!((portable::dot(&a, &b) as f64 - exact).abs() <= TOL * mag);

        let mut y = b.clone();
        axpy(0.5, &a, &mut y);
        for i in 0..n {
            assert_eq!(y[i], b[i] + 0.5 * a[i]);
        }

        let mut out = vec![0.0; n];
        rms_norm(&a, &b, 1e-5, &mut out);
        let ms: f64 = a.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / n as f64;
        for i in 0..n {
            let want = a[i] as f64 / (ms + 1e-5).sqrt() * b[i] as f64;
            assert!(
                (out[i] as f64 - want).abs() <= 1e-5 * want.abs().max(1e-3),
                "rms_norm"
            );
        }

        let mut p: Vec<f32> = a.iter().map(|v| v * 30.0).collect();
        let mx = p.iter().copied().fold(f32::MIN, f32::max) as f64;
        let z: f64 = p.iter().map(|v| (*v as f64 - mx).exp()).sum();
        let want: Vec<f64> = p.iter().map(|v| (*v as f64 - mx).exp() / z).collect();
        softmax_inplace(&mut p);
        for (g, w) in p.iter().zip(&want) {
            assert!((*g as f64 - w).abs() <= 1e-6, "softmax {g} vs {w}");
        }

        let mut g: Vec<f32> = a.iter().map(|v| v * 8.0).collect();
        let g0 = g.clone();
        silu_mul(&mut g, &b);
        for i in 0..n {
            let x = g0[i] as f64;
            let want = x / (1.0 + (-x).exp()) * b[i] as f64;
            assert!(
                (g[i] as f64 - want).abs() <= 1e-6 * want.abs().max(1e-3),
                "silu"
            );
        }
    }
    let mut masked = [0.0, f32::NEG_INFINITY, 0.0];
    softmax_inplace(&mut masked);
    assert_eq!(masked, [0.5, 0.0, 0.5]);
}

#[test]
fn int8_activations_stay_within_their_stated_bound() {
    // Each activation moves by at most d/2 (d = max|x_g|/127), so the product moves by
    // at most Σ_k |s·q_k|·d_g/2; on top of that, the f32 tolerance.
    let mut rng = Rng(0x5EED_0006);
    let mut fx = Vec::new();
    for (rows, cols) in [(1, 64), (37, 192), (130, 576), (67, 1536)] {
        fx.push(Fixture::quant(Bits::Four, rows, cols, &mut rng));
    }
    let cpus = [
        Cpu::portable(1).with_activations(Activations::Int8),
        Cpu::portable(2).with_activations(Activations::Int8),
        Cpu::new(1).with_activations(Activations::Int8),
        Cpu::new(3).with_activations(Activations::Int8),
    ];
    for f in &fx {
        let m = f.matrix();
        let xbuf = rng.vec(f.cols + 1);
        let x = &xbuf[1..];
        let d: Vec<f64> = x
            .chunks_exact(GROUP)
            .map(|g| g.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64 / 127.0)
            .collect();
        let want = f.reference(x);
        let mut exact_rows = 0;
        for cpu in &cpus {
            let mut y = vec![f32::NAN; f.rows];
            cpu.matvec(&m, x, &mut y);
            // Prefill sees the same arithmetic: row j of a matmul whose other inputs
            // differ equals the matvec to f32 rounding.
            for n in [2, 5] {
                let mut xs = rng.vec(n * f.cols);
                let j = n - 1;
                xs[j * f.cols..].copy_from_slice(x);
                let mut ys = vec![f32::NAN; n * f.rows];
                cpu.matmul(&m, &xs, n, &mut ys);
                for (r, (a, b)) in ys[j * f.rows..].iter().zip(&y).enumerate() {
                    let tol = 2.0 * TOL * want[r].1 + 1e-30;
                    assert!(
                        (*a as f64 - *b as f64).abs() <= tol,
                        "{cpu:?} n={n} row {r}"
                    );
                }
            }
            for (r, (g, (w, mag))) in y.iter().zip(&want).enumerate() {
                let span = r * f.cols..(r + 1) * f.cols;
                let bound: f64 = f.dense[span.clone()]
                    .iter()
                    .zip(&f.bias[span])
                    .enumerate()
                    .map(|(k, (w, b))| (w - b).abs() as f64 * d[k / GROUP] / 2.0)
                    .sum();
                let err = (*g as f64 - w).abs();
                assert!(
                    err <= bound + TOL * mag,
                    "{cpu:?} {}x{} row {r}: error {err:e} > {bound:e}",
                    f.rows,
                    f.cols
                );
                exact_rows += usize::from(err <= TOL * mag);
            }
        }
        // The mode is in effect: not every row is exact to f32 rounding (the 1x64
        // fixture is one all-zero group, which is).
        if f.cols > GROUP {
            assert!(exact_rows < cpus.len() * f.rows, "{}x{}", f.rows, f.cols);
        }
    }
}
