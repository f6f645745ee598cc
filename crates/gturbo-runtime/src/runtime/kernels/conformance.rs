//! The seam's contract as a test: every [`Backend`] op against a scalar f64
//! reference written from the op's documented formula, at awkward shapes (one group,
//! rows and heads that are not powers of two), at the largest shapes SmolLM2 uses
//! (`[49152 × 576]` head, `[1536 × 576]` and `[576 × 1536]` MLP, 9 heads over 3 KV heads
//! of 64), for one token and several. Generic over the backend: [`all`] runs here for
//! [`Cpu`], and a device backend's tests call it with their own backend.
//!
//! # Tolerances (what any backend may differ from the exact value by)
//! - `linear`: `2e-5 · Σ (|s·q| + |b|)·|x|` per output (float and MXFP4 weights:
//!   `Σ |w·x|`), the terms a kernel adds; the CPU's own kernel tests hold `1e-5`.
//! - `embed`: `1e-6 · (|s·q| + |b|)` per element (a device may fuse `s·q + b`).
//! - `rms_norm`, `attention`: `1e-5` of the largest `|output|` of the row (attention: of
//!   the largest `|v|`).
//! - `rope`: `1e-6` of the head's largest value; the angle is the f32 product the op
//!   defines, its sine and cosine exact.
//! - `add_bias` after `linear`: the `linear` bound plus one f32 rounding of the sum
//!   (`2⁻²³` of it).
//! - `add`: f32 rounding of the exact sum; `swiglu`: `1e-5 · |silu(g)·u|` (`exp`
//!   differs between libraries).
//! - `route`: the same experts wherever the k-th and (k+1)-th logits differ by more
//!   than twice the linear bound, exact ties to the lower id; weights within `4·e +
//!   1e-5` relative, `e` the largest logit bound (a softmax moves by at most twice
//!   its inputs' largest error).
//! - `ffn_swiglu`, `expert_ffn`: the linear bound carried through the MLP (the error of
//!   `g` and `u` times the slopes of `silu(g)·u`, then through `down`), times two.

use super::backend::{AttentionSpec, Backend, Causal, ExpertRef, NormGain};
use super::routing::{GroupLimit, Order, RouterBias, RoutingSpec, Scores, route_logits};
use super::{Cpu, FloatDtype, GROUP, MXFP4_GROUP, Matrix, bf16_at, quant_row_bytes};
use crate::format::Scheme;
use crate::format::dtype::Dtype;
use crate::format::pools::{BlobPart, ExpertPart, ExpertPool};
use crate::format::quant::{Bits, dequantize_rows, f32_to_bf16, quantize_rows};
use crate::runtime::testing::Rng;

/// SmolLM2-135M's widths.
const HIDDEN: usize = 576;
const FFN: usize = 1536;
const VOCAB: usize = 49152;
const KV: usize = 192;

/// How a test matrix is stored.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Enc {
    Int4,
    Int8,
    Bf16,
    F16,
    F32,
    /// MXFP4 (gpt-oss's experts): random codes, scales 2^-8..2^-2.
    Mxfp4,
}

/// A test matrix's bytes; the reference values are decoded a row at a time, so a
/// vocabulary-sized head costs its bytes only.
struct Weights {
    enc: Enc,
    parts: [Vec<u8>; 3],
    rows: usize,
    cols: usize,
}

impl Weights {
    fn new(enc: Enc, rows: usize, cols: usize, rng: &mut Rng) -> Weights {
        if enc == Enc::Mxfp4 {
            return Weights::mxfp4(rows, cols, rng);
        }
        // Rows with different ranges and one all-zero group, as real weights have.
        let vals: Vec<f32> = (0..rows * cols)
            .map(|i| {
                if i < GROUP.min(cols) {
                    0.0
                } else {
                    rng.unit() * (0.02 + (i / cols % 7) as f32 * 0.05)
                }
            })
            .collect();
        Weights::from_values(enc, rows, cols, &vals)
    }

    /// Random MXFP4 codes (every one of the 16) and scale exponents 119..=125, the
    /// first group of row 0 all zero codes.
    fn mxfp4(rows: usize, cols: usize, rng: &mut Rng) -> Weights {
        let mut codes: Vec<u8> = (0..rows * cols / 2).map(|_| rng.next() as u8).collect();
        codes[..MXFP4_GROUP.min(cols) / 2].fill(0);
        let scales = (0..rows * cols / MXFP4_GROUP)
            .map(|_| 119 + (rng.next() % 7) as u8)
            .collect();
        Weights {
            enc: Enc::Mxfp4,
            parts: [codes, scales, vec![]],
            rows,
            cols,
        }
    }

    fn from_values(enc: Enc, rows: usize, cols: usize, vals: &[f32]) -> Weights {
        let bf16: Vec<u16> = vals.iter().map(|&v| f32_to_bf16(v)).collect();
        let parts = match enc {
            Enc::Int4 | Enc::Int8 => {
                let bits = if enc == Enc::Int4 {
                    Bits::Four
                } else {
                    Bits::Eight
                };
                let n = rows * cols;
                let mut w = vec![0u8; n * bits.bits() as usize / 8];
                let mut s = vec![0u8; n / GROUP * 2];
                let mut b = vec![0u8; n / GROUP * 2];
                quantize_rows(&bf16, cols, bits, &mut w, &mut s, &mut b).unwrap();
                [w, s, b]
            }
            Enc::Bf16 => [
                bf16.iter().flat_map(|v| v.to_le_bytes()).collect(),
                vec![],
                vec![],
            ],
            Enc::F16 => [
                vals.iter()
                    .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                    .collect(),
                vec![],
                vec![],
            ],
            Enc::F32 => [
                vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
                vec![],
                vec![],
            ],
            Enc::Mxfp4 => unreachable!("MXFP4 test weights are drawn as codes"),
        };
        Weights {
            enc,
            parts,
            rows,
            cols,
        }
    }

    fn bits(&self) -> Option<Bits> {
        match self.enc {
            Enc::Int4 => Some(Bits::Four),
            Enc::Int8 => Some(Bits::Eight),
            _ => None,
        }
    }

    fn matrix(&self) -> Matrix<'_> {
        let (rows, cols) = (self.rows, self.cols);
        let data = &self.parts[0];
        match self.enc {
            Enc::Int4 | Enc::Int8 => Matrix::Quant {
                bits: self.bits().map_or(0, Bits::bits),
                group: GROUP,
                weights: data,
                scales: &self.parts[1],
                biases: &self.parts[2],
                rows,
                cols,
            },
            Enc::Bf16 => Matrix::Float {
                dtype: FloatDtype::Bf16,
                data,
                rows,
                cols,
            },
            Enc::F16 => Matrix::Float {
                dtype: FloatDtype::F16,
                data,
                rows,
                cols,
            },
            Enc::F32 => Matrix::Float {
                dtype: FloatDtype::F32,
                data,
                rows,
                cols,
            },
            Enc::Mxfp4 => Matrix::Mxfp4 {
                weights: data,
                scales: &self.parts[1],
                rows,
                cols,
            },
        }
    }

    /// Row `r`'s values and, per element, the part a kernel adds separately (the
    /// group's bias; 0 for float weights).
    fn row(&self, r: usize) -> (Vec<f32>, Vec<f32>) {
        let c = self.cols;
        let mut vals = vec![0f32; c];
        let mut bias = vec![0f32; c];
        if self.enc == Enc::Mxfp4 {
            let (wr, sr) = (c / 2, c / MXFP4_GROUP);
            crate::format::mxfp4::dequantize_rows(
                &self.parts[0][r * wr..(r + 1) * wr],
                &self.parts[1][r * sr..(r + 1) * sr],
                c,
                &mut vals,
            )
            .unwrap();
            return (vals, bias);
        }
        match self.bits() {
            Some(bits) => {
                let (wr, sr) = quant_row_bytes(bits.bits(), GROUP, c);
                let b = &self.parts[2][r * sr..(r + 1) * sr];
                dequantize_rows(
                    &self.parts[0][r * wr..(r + 1) * wr],
                    &self.parts[1][r * sr..(r + 1) * sr],
                    b,
                    c,
                    bits,
                    &mut vals,
                )
                .unwrap();
                for (k, o) in bias.iter_mut().enumerate() {
                    *o = bf16_at(b, k / GROUP);
                }
            }
            None => {
                let d = &self.parts[0];
                for (k, v) in vals.iter_mut().enumerate() {
                    let i = r * c + k;
                    *v = match self.enc {
                        Enc::Bf16 => bf16_at(d, i),
                        Enc::F16 => half::f16::from_le_bytes([d[2 * i], d[2 * i + 1]]).to_f32(),
                        _ => f32::from_le_bytes(d[4 * i..4 * i + 4].try_into().unwrap()),
                    };
                }
            }
        }
        (vals, bias)
    }

    /// Exact `W x` per row, with the magnitude `Σ (|w − b| + |b|)·|x|` the tolerance
    /// scales with.
    fn apply(&self, x: &[f64]) -> Vec<(f64, f64)> {
        (0..self.rows)
            .map(|r| {
                let (vals, bias) = self.row(r);
                let mut sum = 0.0;
                let mut mag = 0.0;
                for ((w, b), x) in vals.iter().zip(&bias).zip(x) {
                    sum += *w as f64 * x;
                    mag += ((*w - *b).abs() as f64 + b.abs() as f64) * x.abs();
                }
                (sum, mag)
            })
            .collect()
    }

    /// Per row, `Σ (|w − b| + |b|)·e_k` for per-input errors `e` (how an error in the
    /// input carries through the product).
    fn carry(&self, e: &[f64]) -> Vec<f64> {
        (0..self.rows)
            .map(|r| {
                let (vals, bias) = self.row(r);
                vals.iter()
                    .zip(&bias)
                    .zip(e)
                    .map(|((w, b), e)| ((*w - *b).abs() as f64 + b.abs() as f64) * e)
                    .sum()
            })
            .collect()
    }
}

fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

/// `|silu'(g)|` is below 1.1 everywhere.
const SILU_SLOPE: f64 = 1.1;

fn check(got: &[f32], want: &[f64], bound: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, ((g, w), b)) in got.iter().zip(want).zip(bound).enumerate() {
        let err = (*g as f64 - w).abs();
        assert!(
            err <= *b + 1e-30,
            "{what}: element {i}: got {g}, want {w}, error {err:e} > {b:e}"
        );
    }
}

/// Run every check on `b`.
pub(crate) fn all<B: Backend>(b: &B) {
    data(b);
    linear(b);
    bias(b);
    embed(b);
    norms(b);
    elementwise(b);
    ffn(b);
    rope(b);
    attention(b);
    route(b);
    route_specs(b);
    experts(b);
}

fn up<B: Backend>(b: &B, x: &[f32]) -> B::Buf {
    b.upload(x).unwrap()
}

fn down<B: Backend>(b: &B, x: &B::Buf) -> Vec<f32> {
    b.read(x).unwrap()
}

/// The `data` checks of [`all`].
pub(crate) fn data<B: Backend>(b: &B) {
    let mut rng = Rng(0xC0FF_0001);
    let x = rng.vec(7 * 5);
    let t = up(b, &x);
    assert_eq!(down(b, &t), x, "upload then read");
    let rows = b.copy_rows(&t, 5, 2..6).unwrap();
    assert_eq!(down(b, &rows), x[10..30], "copy_rows");
    assert_eq!(b.read_owned(rows).unwrap(), x[10..30], "read_owned");
    let mut t = t;
    b.zero(&mut t).unwrap();
    assert_eq!(down(b, &t), vec![0.0; 35], "zero");
    assert_eq!(down(b, &b.zeros(3).unwrap()), vec![0.0; 3], "zeros");
}

fn linear_bound(want: &[(f64, f64)]) -> (Vec<f64>, Vec<f64>) {
    want.iter().map(|&(w, m)| (w, 2e-5 * m)).unzip()
}

/// The `linear` checks of [`all`].
pub(crate) fn linear<B: Backend>(b: &B) {
    let mut rng = Rng(0xC0FF_0002);
    let mut cases = Vec::new();
    for enc in [
        Enc::Int4,
        Enc::Int8,
        Enc::Bf16,
        Enc::F16,
        Enc::F32,
        Enc::Mxfp4,
    ] {
        // One group; rows that are not a multiple of any tile; SmolLM2's projections.
        for (rows, cols) in [
            (1, 64),
            (37, 192),
            (KV, HIDDEN),
            (FFN, HIDDEN),
            (HIDDEN, FFN),
        ] {
            cases.push((enc, rows, cols, vec![1, 3, 8]));
        }
    }
    for enc in [Enc::Bf16, Enc::F32] {
        cases.push((enc, 5, 7, vec![1, 2]));
    }
    // The head, the largest product of a token.
    for enc in [Enc::Int4, Enc::Bf16] {
        cases.push((enc, VOCAB, HIDDEN, vec![1, 2]));
    }
    for (enc, rows, cols, ns) in cases {
        let w = Weights::new(enc, rows, cols, &mut rng);
        let bw = b.weights(w.matrix()).unwrap();
        for n in ns {
            let x = rng.vec(n * cols);
            let mut y = b.zeros(n * rows).unwrap();
            b.linear(&bw, &up(b, &x), &mut y).unwrap();
            let got = down(b, &y);
            for t in 0..n {
                let (want, bound) = linear_bound(&w.apply(&f64s(&x[t * cols..(t + 1) * cols])));
                let what = format!("linear {enc:?} {rows}x{cols} n={n} token {t}");
                check(&got[t * rows..(t + 1) * rows], &want, &bound, &what);
            }
        }
    }
}

/// The `bias` checks of [`all`]: `linear` then `add_bias` against `W x + bias`, for
/// one token and several, at a width no tile divides.
pub(crate) fn bias<B: Backend>(b: &B) {
    let mut rng = Rng(0xC0FF_000C);
    let mut cases = Vec::new();
    for enc in [Enc::Int4, Enc::Int8, Enc::Bf16, Enc::F32] {
        cases.push((enc, 37, 192));
    }
    cases.push((Enc::F16, 1, 64));
    cases.push((Enc::F32, 5, 7));
    for (enc, rows, cols) in cases {
        let w = Weights::new(enc, rows, cols, &mut rng);
        let bw = b.weights(w.matrix()).unwrap();
        let bias: Vec<f32> = rng.vec(rows).iter().map(|v| v * 2.0).collect();
        let gb = up(b, &bias);
        for n in [1, 3] {
            let x = rng.vec(n * cols);
            let mut y = b.zeros(n * rows).unwrap();
            b.linear(&bw, &up(b, &x), &mut y).unwrap();
            b.add_bias(&mut y, &gb).unwrap();
            let got = down(b, &y);
            for t in 0..n {
                let (wx, bound) = linear_bound(&w.apply(&f64s(&x[t * cols..(t + 1) * cols])));
                let want: Vec<f64> = wx.iter().zip(&bias).map(|(y, c)| y + *c as f64).collect();
                let bound: Vec<f64> = bound
                    .iter()
                    .zip(&want)
                    .map(|(e, w)| e + f32::EPSILON as f64 * w.abs())
                    .collect();
                let what = format!("linear + add_bias {enc:?} {rows}x{cols} n={n} token {t}");
                check(&got[t * rows..(t + 1) * rows], &want, &bound, &what);
            }
        }
    }
}

/// The `embed` checks of [`all`].
pub(crate) fn embed<B: Backend>(b: &B) {
    let mut rng = Rng(0xC0FF_0003);
    for enc in [Enc::Int4, Enc::Int8, Enc::Bf16, Enc::F16, Enc::F32] {
        for (rows, cols) in [(3, 64), (VOCAB, HIDDEN)] {
            let w = Weights::new(enc, rows, cols, &mut rng);
            let tokens = [0, rows as u32 - 1, rows as u32 / 2, 0];
            let mut out = b.zeros(tokens.len() * cols).unwrap();
            b.embed(&b.weights(w.matrix()).unwrap(), &tokens, &mut out)
                .unwrap();
            let got = down(b, &out);
            for (i, &t) in tokens.iter().enumerate() {
                let (vals, bias) = w.row(t as usize);
                let bound: Vec<f64> = vals
                    .iter()
                    .zip(&bias)
                    .map(|(v, b)| 1e-6 * ((v - b).abs() + b.abs()) as f64)
                    .collect();
                let what = format!("embed {enc:?} {rows}x{cols} token {t}");
                check(&got[i * cols..(i + 1) * cols], &f64s(&vals), &bound, &what);
            }
        }
    }
}

/// The `norms` checks of [`all`].
pub(crate) fn norms<B: Backend>(b: &B) {
    let mut rng = Rng(0xC0FF_0004);
    // Model width; one head (QK-norm over n·heads rows); an odd width.
    for (width, rows) in [(HIDDEN, 3), (64, 9 * 2), (100, 1)] {
        let x: Vec<f32> = rng.vec(width * rows).iter().map(|v| v * 3.0).collect();
        let w = rng.vec(width);
        for gain in [NormGain::Weight, NormGain::OnePlusWeight] {
            let eps = 1e-5;
            let mut out = b.zeros(x.len()).unwrap();
            b.rms_norm(&up(b, &x), &up(b, &w), eps, gain, &mut out)
                .unwrap();
            let got = down(b, &out);
            for r in 0..rows {
                let xr = f64s(&x[r * width..(r + 1) * width]);
                let ms = xr.iter().map(|v| v * v).sum::<f64>() / width as f64;
                let inv = 1.0 / (ms + eps as f64).sqrt();
                let want: Vec<f64> = xr
                    .iter()
                    .zip(&w)
                    .map(|(x, w)| {
                        let g = match gain {
                            NormGain::Weight => *w as f64,
                            NormGain::OnePlusWeight => 1.0 + *w as f64,
                        };
                        x * inv * g
                    })
                    .collect();
                let max = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
                let what = format!("rms_norm {gain:?} width {width} row {r}");
                let bound = vec![1e-5 * max; width];
                check(&got[r * width..(r + 1) * width], &want, &bound, &what);
            }
        }
    }
}

/// The `elementwise` checks of [`all`].
pub(crate) fn elementwise<B: Backend>(b: &B) {
    let mut rng = Rng(0xC0FF_0005);
    for len in [1, 63, 3 * FFN] {
        let g: Vec<f32> = rng.vec(len).iter().map(|v| v * 8.0).collect();
        let u = rng.vec(len);
        let mut x = up(b, &g);
        b.add(&mut x, &up(b, &u)).unwrap();
        let sum: Vec<f32> = g.iter().zip(&u).map(|(a, b)| a + b).collect();
        assert_eq!(down(b, &x), sum, "add, {len} elements");
        let mut gate = up(b, &g);
        b.swiglu(&mut gate, &up(b, &u)).unwrap();
        let want: Vec<f64> = g
            .iter()
            .zip(&u)
            .map(|(g, u)| silu(*g as f64) * *u as f64)
            .collect();
        let bound: Vec<f64> = want.iter().map(|w| 1e-5 * w.abs()).collect();
        check(&down(b, &gate), &want, &bound, &format!("swiglu {len}"));
    }
}

/// The exact MLP `down(silu(gate·x)·up·x)` of one input row, and its bound.
fn mlp_reference(
    gate: &Weights,
    upw: &Weights,
    downw: &Weights,
    x: &[f32],
) -> (Vec<f64>, Vec<f64>) {
    let x = f64s(x);
    let (g, u) = (gate.apply(&x), upw.apply(&x));
    let h: Vec<f64> = g
        .iter()
        .zip(&u)
        .map(|((g, _), (u, _))| silu(*g) * u)
        .collect();
    // The error of h: g's and u's errors times the slopes, plus its own rounding.
    let eh: Vec<f64> = g
        .iter()
        .zip(&u)
        .zip(&h)
        .map(|(((g, gm), (u, um)), h)| {
            2e-5 * (SILU_SLOPE * u.abs() * gm + silu(*g).abs() * um) + 1e-5 * h.abs()
        })
        .collect();
    let d = downw.apply(&h);
    let carried = downw.carry(&eh);
    d.iter()
        .zip(carried)
        .map(|((w, m), c)| (*w, 2.0 * (2e-5 * m + c)))
        .unzip()
}

/// The `ffn` checks of [`all`].
pub(crate) fn ffn<B: Backend>(b: &B) {
    let mut rng = Rng(0xC0FF_0006);
    for (enc, h, i) in [
        (Enc::Int4, 64, 128),
        (Enc::Int8, 192, 320),
        (Enc::Int4, HIDDEN, FFN),
        (Enc::Bf16, 100, 70),
    ] {
        let (gate, upw) = (
            Weights::new(enc, i, h, &mut rng),
            Weights::new(enc, i, h, &mut rng),
        );
        let downw = Weights::new(enc, h, i, &mut rng);
        let (bg, bu, bd) = (
            b.weights(gate.matrix()).unwrap(),
            b.weights(upw.matrix()).unwrap(),
            b.weights(downw.matrix()).unwrap(),
        );
        for n in [1, 3] {
            let x = rng.vec(n * h);
            let mut out = b.zeros(n * h).unwrap();
            b.ffn_swiglu(&bg, &bu, &bd, &up(b, &x), &mut out).unwrap();
            let got = down(b, &out);
            for t in 0..n {
                let (want, bound) = mlp_reference(&gate, &upw, &downw, &x[t * h..(t + 1) * h]);
                let what = format!("ffn_swiglu {enc:?} {h}/{i} n={n} token {t}");
                check(&got[t * h..(t + 1) * h], &want, &bound, &what);
            }
        }
    }
}

/// RoPE's frequencies as the decoder computes them.
fn inv_freq(rot: usize, theta: f64) -> Vec<f32> {
    (0..rot / 2)
        .map(|i| (1.0 / theta.powf(2.0 * i as f64 / rot as f64)) as f32)
        .collect()
}

/// The `rope` checks of [`all`].
pub(crate) fn rope<B: Backend>(b: &B) {
    let mut rng = Rng(0xC0FF_0007);
    // Full (SmolLM2: 9 heads of 64), partial (a quarter of each head), tiny heads, and
    // a scaled table as YaRN and llama3 make them (high frequencies kept, low ones
    // divided by the factor, a ramp between: the op takes any table).
    use super::RopeLayout::{HalfSplit, Interleaved};
    for (heads, hd, rot, scaled, layout) in [
        (9, 64, 64, false, HalfSplit),
        (3, 64, 16, false, HalfSplit),
        (5, 2, 2, false, HalfSplit),
        (4, 64, 64, true, HalfSplit),
        (2, 128, 64, true, HalfSplit),
        // DeepSeek-V3's rotary part: 64 dims of a 192-wide head, pairs (2j, 2j + 1).
        (3, 192, 64, true, Interleaved),
        (2, 64, 64, false, Interleaved),
    ] {
        let mut freqs = inv_freq(rot, 10_000.0);
        if scaled {
            let n = freqs.len();
            for (j, f) in freqs.iter_mut().enumerate() {
                let ramp = (j as f32 / (n - 1) as f32).clamp(0.0, 1.0);
                *f /= 1.0 + 39.0 * ramp;
            }
        }
        let table = b.rope_table(&freqs, 0..4096, layout).unwrap();
        for (pos, n) in [(0, 4), (1000, 1), (4093, 3)] {
            let x = rng.vec(n * heads * hd);
            let mut t = up(b, &x);
            b.rope(&table, &mut t, heads, hd, pos).unwrap();
            let got = down(b, &t);
            // A table of this call's positions alone (dynamic NTK's per-call table)
            // rotates as the whole one: the same f32 angles.
            let part = b.rope_table(&freqs, pos..pos + n, layout).unwrap();
            let mut t = up(b, &x);
            b.rope(&part, &mut t, heads, hd, pos).unwrap();
            assert_eq!(down(b, &t), got, "rope table from position {pos}");
            let mut want = f64s(&x);
            for (i, tok) in want.chunks_exact_mut(heads * hd).enumerate() {
                for head in tok.chunks_exact_mut(hd) {
                    for (j, f) in freqs.iter().enumerate() {
                        // The angle is the f32 product the op defines.
                        let ang = ((pos + i) as f32 * f) as f64;
                        let (s, c) = ang.sin_cos();
                        let (ia, ib) = match layout {
                            HalfSplit => (j, j + rot / 2),
                            Interleaved => (2 * j, 2 * j + 1),
                        };
                        let (a, bb) = (head[ia], head[ib]);
                        head[ia] = a * c - bb * s;
                        head[ib] = bb * c + a * s;
                    }
                }
            }
            for (r, (g, w)) in got.chunks_exact(hd).zip(want.chunks_exact(hd)).enumerate() {
                let max = w.iter().fold(0.0f64, |m, v| m.max(v.abs()));
                let what = format!("rope {layout:?} {heads}x{hd} rot {rot} pos {pos} head-row {r}");
                check(g, w, &vec![1e-6 * max; hd], &what);
            }
        }
    }
}

/// One query head's attention output as [`Backend::attention`]'s formula says, in
/// f64, written apart from any backend: the positions `first..=p` the window leaves,
/// scores `s_j = scale · q·k_j`, `m = max_j s_j`, weights `w_j = e^(s_j − m) / (Σ_j
/// e^(s_j − m) + e^(sink − m))` (no sink term without a sink) on `v_j`.
#[allow(clippy::too_many_arguments)]
fn attention_want(
    spec: &AttentionSpec,
    keys: &[f32],
    vals: &[f32],
    qh: &[f32],
    kvh: usize,
    p: usize,
    scale: f32,
    sink: Option<f32>,
) -> Vec<f64> {
    let (qd, vd) = (spec.qk_dim, spec.v_dim);
    let (kw, vw) = (spec.kv_heads * qd, spec.kv_heads * vd);
    let first = match spec.window {
        Some(w) if p + 1 > w => p + 1 - w,
        _ => 0,
    };
    let scores: Vec<f64> = (first..=p)
        .map(|j| {
            let kj = &keys[j * kw + kvh * qd..j * kw + (kvh + 1) * qd];
            let d: f64 = qh.iter().zip(kj).map(|(a, b)| *a as f64 * *b as f64).sum();
            d * scale as f64
        })
        .collect();
    let mx = scores.iter().fold(f64::MIN, |m, v| m.max(*v));
    let z: f64 = scores.iter().map(|s| (s - mx).exp()).sum::<f64>()
        + sink.map_or(0.0, |s| (s as f64 - mx).exp());
    let mut want = vec![0f64; vd];
    for (j, s) in (first..=p).zip(&scores) {
        let p = (s - mx).exp() / z;
        let vj = &vals[j * vw + kvh * vd..j * vw + (kvh + 1) * vd];
        for (w, v) in want.iter_mut().zip(vj) {
            *w += p * *v as f64;
        }
    }
    want
}

/// One layer's attention over a run of steps, each checked against
/// [`attention_want`]: `(pos, n)`, a rewind when `pos` is below the positions held.
struct AttentionCase<'c> {
    heads: usize,
    spec: AttentionSpec,
    sinks: Option<&'c [f32]>,
    steps: &'c [(usize, usize)],
    max_positions: usize,
    /// After the steps, one more decode step both on a [`Backend::copy_kv`] of the
    /// cache and on the cache itself.
    snapshot: bool,
}

impl AttentionCase<'_> {
    fn run<B: Backend>(&self, b: &B, rng: &mut Rng) {
        let (heads, spec) = (self.heads, self.spec);
        let (qd, vd) = (spec.qk_dim, spec.v_dim);
        let (kw, vw) = (spec.k_width(), spec.v_width());
        let scale = 1.0 / (qd as f32).sqrt();
        let sinks = self.sinks.map(|s| up(b, s));
        let mut kv = b.kv_cache(spec, self.max_positions).unwrap();
        // The reference cache, as the backend's should hold it.
        let (mut keys, mut vals): (Vec<f32>, Vec<f32>) = (Vec::new(), Vec::new());
        let what = format!(
            "attention {heads}/{}x{qd}/{vd} window {:?} sinks {:?} values in keys {}",
            spec.kv_heads, spec.window, self.sinks, spec.values_in_keys
        );
        let mut step = |kv: &mut B::Kv, keys: &mut Vec<f32>, vals: &mut Vec<f32>, pos, n| {
            let q: Vec<f32> = rng.vec(n * heads * qd).iter().map(|v| v * 2.0).collect();
            let k: Vec<f32> = rng.vec(n * kw).iter().map(|v| v * 2.0).collect();
            // Values in the keys: each head's value is its key's first `vd` dims, and
            // the backend is handed the keys again.
            let v: Vec<f32> = if spec.values_in_keys {
                k.chunks_exact(qd).flat_map(|h| h[..vd].to_vec()).collect()
            } else {
                rng.vec(n * vw)
            };
            let v_in = if spec.values_in_keys { &k } else { &v };
            keys.truncate(pos * kw);
            vals.truncate(pos * vw);
            keys.extend_from_slice(&k);
            vals.extend_from_slice(&v);
            let mut out = b.zeros(n * heads * vd).unwrap();
            let at = Causal { pos, heads, scale };
            b.attention(
                kv,
                &up(b, &q),
                &up(b, &k),
                &up(b, v_in),
                at,
                sinks.as_ref(),
                &mut out,
            )
            .unwrap();
            let got = down(b, &out);
            let vmax = vals.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
            for i in 0..n {
                for hh in 0..heads {
                    let kvh = hh / (heads / spec.kv_heads);
                    let qh = &q[(i * heads + hh) * qd..(i * heads + hh + 1) * qd];
                    let sink = self.sinks.map(|s| s[hh]);
                    let want = attention_want(&spec, keys, vals, qh, kvh, pos + i, scale, sink);
                    let at = (i * heads + hh) * vd;
                    let what = format!("{what} pos {pos} token {i} head {hh}");
                    check(&got[at..at + vd], &want, &vec![1e-5 * vmax; vd], &what);
                }
            }
        };
        for &(pos, n) in self.steps {
            step(&mut kv, &mut keys, &mut vals, pos, n);
        }
        if self.snapshot {
            let pos = keys.len() / kw;
            let mut copy = b.copy_kv(&kv).unwrap();
            let (mut ck, mut cv) = (keys.clone(), vals.clone());
            step(&mut copy, &mut ck, &mut cv, pos, 1);
            step(&mut kv, &mut keys, &mut vals, pos, 1);
        }
    }
}

/// The `attention` checks of [`all`], in three stages sharing one random stream.
pub(crate) fn attention<B: Backend>(b: &B) {
    let mut rng = Rng(0xC0FF_0008);
    // Prefill, decode, a short batch, then a rewind to position 3 (a failed pass).
    let steps = [(0, 5), (5, 1), (6, 2), (3, 2)];
    attention_dense(b, &mut rng, &steps);
    attention_spec_options(b, &mut rng, &steps);
    attention_long_contexts(b, &mut rng);
    attention_wide_heads(b, &mut rng);
    attention_window_slides(b, &mut rng);
}

/// A window cache over a context many windows long: a prefill past the window, 200
/// decode steps (a backend that drops what no query sees again drops it several
/// times), a batch, a rewind of two positions (a failed pass), and a snapshot.
fn attention_window_slides<B: Backend>(b: &B, rng: &mut Rng) {
    let mut steps = vec![(0, 20)];
    steps.extend((20..220).map(|p| (p, 1)));
    steps.extend([(220, 7), (225, 2)]);
    let sinks = [1.0, -2.0, 0.5, 4.0];
    AttentionCase {
        heads: 4,
        spec: AttentionSpec {
            window: Some(5),
            ..AttentionSpec::dense(2, 16)
        },
        sinks: Some(&sinks),
        steps: &steps,
        max_positions: 512,
        snapshot: true,
    }
    .run(b, rng);
}

/// Dense heads: grouped, ungrouped, one KV head.
fn attention_dense<B: Backend>(b: &B, rng: &mut Rng, steps: &[(usize, usize)]) {
    // SmolLM2 (9 over 3 of 64), multi-head without grouping, one KV head of 48.
    for (heads, kv_heads, hd) in [(9, 3, 64), (4, 4, 2), (6, 1, 48)] {
        AttentionCase {
            heads,
            spec: AttentionSpec::dense(kv_heads, hd),
            sinks: None,
            steps,
            max_positions: 64,
            snapshot: false,
        }
        .run(b, rng);
    }
}

/// Each option of the spec: sinks, a window, values wider or narrower than keys,
/// values in the keys.
fn attention_spec_options<B: Backend>(b: &B, rng: &mut Rng, steps: &[(usize, usize)]) {
    // Sinks of each sign (one joining the softmax as its largest logit, one that is
    // no weight at all), values wider than keys, a window of 3 that the prefill and
    // the decode steps cross.
    let sinks = [5.0, -1e4, 0.0, 2.0, -3.0, 8.0];
    AttentionCase {
        heads: 6,
        spec: AttentionSpec {
            kv_heads: 2,
            qk_dim: 16,
            v_dim: 40,
            window: Some(3),
            values_in_keys: false,
        },
        sinks: Some(&sinks),
        steps: &[(0, 5), (5, 1), (6, 2), (8, 1), (3, 2)],
        max_positions: 64,
        snapshot: true,
    }
    .run(b, rng);
    // MLA's shape (values narrower than keys), no window, no sinks; SmolLM2's heads
    // under a window of 4.
    let mla = AttentionSpec {
        kv_heads: 4,
        qk_dim: 48,
        v_dim: 32,
        window: None,
        values_in_keys: false,
    };
    let windowed = AttentionSpec {
        window: Some(4),
        ..AttentionSpec::dense(3, 64)
    };
    for (heads, spec) in [(4, mla), (9, windowed)] {
        AttentionCase {
            heads,
            spec,
            sinks: None,
            steps,
            max_positions: 64,
            snapshot: false,
        }
        .run(b, rng);
    }
    // Values in the keys: MLA's latent cache (one KV head, keys [c | k_pe] 80 wide,
    // values c 64 wide) with a snapshot, and two KV heads (each value its own head's).
    for (heads, kv_heads, snapshot) in [(4, 1, true), (6, 2, false)] {
        AttentionCase {
            heads,
            spec: AttentionSpec {
                kv_heads,
                qk_dim: 80,
                v_dim: 64,
                window: None,
                values_in_keys: true,
            },
            sinks: None,
            steps,
            max_positions: 64,
            snapshot,
        }
        .run(b, rng);
    }
}

/// Long contexts (the GPU's split decode and cache growth).
fn attention_long_contexts<B: Backend>(b: &B, rng: &mut Rng) {
    // Long contexts, where a GPU splits a decode step's positions across workgroups
    // (`gpu::tuning::split_chunk`: fewer than 256 (token, head) pairs, more than 64
    // positions seen) and grows its cache past the 256 positions it starts with: a
    // window of 100 after a prefill of 150 (the chunks start where the window does),
    // and the whole context with sinks and values wider than keys, snapshot included.
    let sinks4 = [3.0, -1e4, 0.5, -2.0];
    AttentionCase {
        heads: 4,
        spec: AttentionSpec {
            kv_heads: 1,
            qk_dim: 64,
            v_dim: 32,
            window: Some(100),
            values_in_keys: false,
        },
        sinks: Some(&sinks4),
        steps: &[(0, 150), (150, 1), (151, 1), (152, 3)],
        max_positions: 512,
        snapshot: false,
    }
    .run(b, rng);
    AttentionCase {
        heads: 2,
        spec: AttentionSpec {
            kv_heads: 1,
            qk_dim: 32,
            v_dim: 64,
            window: None,
            values_in_keys: false,
        },
        sinks: Some(&sinks4[..2]),
        steps: &[(0, 200), (200, 100), (300, 1), (301, 1)],
        max_positions: 512,
        snapshot: true,
    }
    .run(b, rng);
}

/// Heads wider than 256: DeepSeek-V3's latent cache (one KV head, keys `[c | k_pe]`
/// 512 + 64 = 576 wide, values the 512-wide `c` inside them) in one walk and in the
/// GPU's split decode (a 100-position prefill, then decode steps), and odd widths
/// past 256 with values in the keys and apart from them.
fn attention_wide_heads<B: Backend>(b: &B, rng: &mut Rng) {
    let latent = |kv_heads, qk_dim, v_dim| AttentionSpec {
        kv_heads,
        qk_dim,
        v_dim,
        window: None,
        values_in_keys: true,
    };
    // (query heads, spec, steps, snapshot)
    type Case<'s> = (usize, AttentionSpec, &'s [(usize, usize)], bool);
    let cases: [Case; 4] = [
        (
            4,
            latent(1, 576, 512),
            &[(0, 5), (5, 1), (6, 2), (3, 2)],
            true,
        ),
        (
            2,
            latent(1, 576, 512),
            &[(0, 100), (100, 1), (101, 1)],
            false,
        ),
        (6, latent(2, 385, 321), &[(0, 5), (5, 1), (6, 2)], false),
        (
            3,
            AttentionSpec {
                values_in_keys: false,
                ..latent(3, 577, 263)
            },
            &[(0, 5), (5, 1), (3, 2)],
            false,
        ),
    ];
    for (heads, spec, steps, snapshot) in cases {
        AttentionCase {
            heads,
            spec,
            sinks: None,
            steps,
            max_positions: 128,
            snapshot,
        }
        .run(b, rng);
    }
}

/// The `route` checks of [`all`].
pub(crate) fn route<B: Backend>(b: &B) {
    let mut rng = Rng(0xC0FF_0009);
    let mut compared = 0;
    let mut tokens = 0;
    for (experts, top_k, cols, enc) in [
        (8, 2, 64, Enc::Int8),
        (64, 4, 256, Enc::Int4),
        (60, 4, HIDDEN, Enc::Bf16),
    ] {
        let w = Weights::new(enc, experts, cols, &mut rng);
        let bw = b.weights(w.matrix()).unwrap();
        let n = 5;
        let x: Vec<f32> = rng.vec(n * cols).iter().map(|v| v * 4.0).collect();
        for renormalize in [false, true] {
            let spec = RoutingSpec::softmax_top_k(top_k, renormalize);
            let r = b.route(&bw, &up(b, &x), &spec, RouterBias::NONE).unwrap();
            assert_eq!(r.top_k, top_k);
            assert_eq!((r.experts.len(), r.weights.len()), (n * top_k, n * top_k));
            for t in 0..n {
                tokens += 1;
                let exact = w.apply(&f64s(&x[t * cols..(t + 1) * cols]));
                let logits: Vec<f64> = exact.iter().map(|v| v.0).collect();
                // The most any logit may be off by (the linear bound).
                let err = exact.iter().fold(0.0f64, |m, v| m.max(2e-5 * v.1));
                let mx = logits.iter().fold(f64::MIN, |m, v| m.max(*v));
                let z: f64 = logits.iter().map(|l| (l - mx).exp()).sum();
                let p: Vec<f64> = logits.iter().map(|l| (l - mx).exp() / z).collect();
                let mut idx: Vec<usize> = (0..experts).collect();
                idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
                if top_k < experts && logits[idx[top_k - 1]] - logits[idx[top_k]] <= 2.0 * err {
                    continue;
                }
                compared += 1;
                let got = &r.experts[t * top_k..(t + 1) * top_k];
                let want: Vec<u32> = idx[..top_k].iter().map(|&e| e as u32).collect();
                assert_eq!(got, want, "route {experts}/{top_k} token {t}");
                let sum: f64 = idx[..top_k].iter().map(|&e| p[e]).sum();
                for (j, &e) in idx[..top_k].iter().enumerate() {
                    let want = if renormalize { p[e] / sum } else { p[e] };
                    let g = r.weights[t * top_k + j] as f64;
                    // A softmax moves by at most twice its inputs' largest error,
                    // relative; renormalising by a sum of such values, twice that.
                    let bound = (4.0 * err + 1e-5) * want;
                    assert!((g - want).abs() <= bound, "route weight {g} vs {want}");
                }
            }
        }
    }
    assert!(
        compared * 10 >= tokens * 9,
        "only {compared} of {tokens} tokens had a clear top-k"
    );
    // Identical router rows: every probability ties, and the lowest ids win.
    let row = rng.vec(64);
    let vals: Vec<f32> = (0..6).flat_map(|_| row.clone()).collect();
    let w = Weights::from_values(Enc::Int4, 6, 64, &vals);
    let r = b
        .route(
            &b.weights(w.matrix()).unwrap(),
            &up(b, &rng.vec(2 * 64)),
            &RoutingSpec::softmax_top_k(3, true),
            RouterBias::NONE,
        )
        .unwrap();
    assert_eq!(r.experts, [0, 1, 2, 0, 1, 2], "ties go to the lower id");
    for g in &r.weights {
        assert!((*g as f64 - 1.0 / 3.0).abs() <= 1e-6, "tied weights {g}");
    }
}

/// The options [`route_specs`] checks: sigmoid scores with `bias` for selection, a
/// group limit and a scaling factor; top-k of the logits then a softmax over the k;
/// sigmoid scores without renormalisation; gpt-oss's router (top-k then softmax of
/// logits carrying the router linear's bias, `logit_bias`).
fn route_spec_cases<'a>(
    bias: &'a [f32],
    logit_bias: &'a [f32],
) -> [(RoutingSpec, RouterBias<'a>); 4] {
    let selection = |bias| RouterBias {
        logits: None,
        selection: Some(bias),
    };
    [
        (
            RoutingSpec {
                top_k: 4,
                scores: Scores::Sigmoid,
                order: Order::ScoreThenTopK,
                selection_bias: true,
                groups: Some(GroupLimit {
                    n_group: 4,
                    topk_group: 2,
                }),
                renormalize: true,
                scaling: 2.5,
            },
            selection(bias),
        ),
        (
            RoutingSpec {
                top_k: 2,
                scores: Scores::Softmax,
                order: Order::TopKThenSoftmax,
                selection_bias: false,
                groups: None,
                renormalize: false,
                scaling: 1.0,
            },
            RouterBias::NONE,
        ),
        (
            RoutingSpec {
                top_k: 3,
                scores: Scores::Sigmoid,
                order: Order::ScoreThenTopK,
                selection_bias: false,
                groups: None,
                renormalize: false,
                scaling: 1.0,
            },
            RouterBias::NONE,
        ),
        (
            RoutingSpec {
                top_k: 4,
                scores: Scores::Softmax,
                order: Order::TopKThenSoftmax,
                selection_bias: false,
                groups: None,
                renormalize: false,
                scaling: 1.0,
            },
            RouterBias {
                logits: Some(logit_bias),
                selection: None,
            },
        ),
    ]
}

/// The routing spec's options ([`RoutingSpec`]: sigmoid scores with a selection bias,
/// a group limit and a scaling factor; top-k of the logits then a softmax over the k)
/// against [`route_logits`] on the exact logits: the same experts wherever the choice
/// is clear by more than the product's error bound, and weights within the bound.
pub(crate) fn route_specs<B: Backend>(b: &B) {
    let mut rng = Rng(0xC0FF_0024);
    let (experts, cols, n) = (16, 128, 6);
    let bias: Vec<f32> = rng.vec(experts).iter().map(|v| v * 0.5).collect();
    // Large enough to change choices (the logits' spread is a few units).
    let logit_bias: Vec<f32> = rng.vec(experts).iter().map(|v| v * 3.0).collect();
    let specs = route_spec_cases(&bias, &logit_bias);
    let (mut compared, mut tokens) = (0, 0);
    for enc in [Enc::Int8, Enc::Bf16] {
        let w = Weights::new(enc, experts, cols, &mut rng);
        let bw = b.weights(w.matrix()).unwrap();
        let x: Vec<f32> = rng.vec(n * cols).iter().map(|v| v * 4.0).collect();
        let mut exact = Vec::new();
        let mut err = 0.0f64;
        for t in 0..n {
            for (v, mag) in w.apply(&f64s(&x[t * cols..(t + 1) * cols])) {
                exact.push(v as f32);
                err = err.max(2e-5 * mag);
            }
        }
        for (spec, bias) in &specs {
            let got = b.route(&bw, &up(b, &x), spec, *bias).unwrap();
            // The reference adds the logit bias to the exact logits (in f64, then
            // rounded once).
            let plain = exact.clone();
            let exact: Vec<f32> = match bias.logits {
                None => plain.clone(),
                Some(lb) => plain
                    .iter()
                    .enumerate()
                    .map(|(i, &v)| (f64::from(v) + f64::from(lb[i % experts])) as f32)
                    .collect(),
            };
            let want = route_logits(spec, &exact, bias.selection, experts).unwrap();
            if bias.logits.is_some() {
                // The bias is tested: without it the choice differs.
                let unbiased = route_logits(spec, &plain, bias.selection, experts).unwrap();
                assert_ne!(
                    unbiased.experts, want.experts,
                    "the logit bias changes nothing"
                );
            }
            // The logits moved apart and together by 4 × `err` (alternate signs): a
            // choice that flips under either is within the backend's rounding of a
            // tie; compare the rest.
            let moved = |s: f32| -> super::Routing {
                let l: Vec<f32> = exact
                    .iter()
                    .enumerate()
                    .map(|(i, v)| v + if i % 2 == 0 { s } else { -s } * 4.0 * err as f32)
                    .collect();
                route_logits(spec, &l, bias.selection, experts).unwrap()
            };
            let (up_, down) = (moved(1.0), moved(-1.0));
            for t in 0..n {
                tokens += 1;
                let k = spec.top_k;
                let ids = |r: &super::Routing| {
                    let mut v = r.experts[t * k..(t + 1) * k].to_vec();
                    v.sort_unstable();
                    v
                };
                if ids(&want) != ids(&up_) || ids(&want) != ids(&down) {
                    continue;
                }
                compared += 1;
                assert_eq!(ids(&got), ids(&want), "route {spec:?} token {t}");
                for j in 0..k {
                    let e = want.experts[t * k + j];
                    let at = (0..k).find(|&i| got.experts[t * k + i] == e).unwrap();
                    let (g, w) = (got.weights[t * k + at], want.weights[t * k + j]);
                    let bound = (8.0 * err as f32 + 1e-5) * w.abs().max(1.0) * spec.scaling;
                    assert!((g - w).abs() <= bound, "{spec:?} weight {g} vs {w}");
                }
            }
        }
    }
    assert!(
        compared * 10 >= tokens * 8,
        "only {compared} of {tokens} tokens had a clear choice"
    );
}

/// An expert pool of `experts` blobs (gate, up, down) and its layout.
fn pool(
    enc: Enc,
    experts: usize,
    h: usize,
    i: usize,
    rng: &mut Rng,
) -> (ExpertPool, Vec<[Weights; 3]>, Vec<Vec<u8>>) {
    let mut parts = Vec::new();
    let mut offset = 0u64;
    for (part, rows, cols) in [
        (ExpertPart::Gate, i, h),
        (ExpertPart::Up, i, h),
        (ExpertPart::Down, h, i),
    ] {
        let (weights, scales) = match enc {
            Enc::Int4 | Enc::Int8 => {
                let bits = if enc == Enc::Int4 { 4 } else { 8 };
                let (wr, sr) = quant_row_bytes(bits, GROUP, cols);
                ((rows * wr) as u64, (rows * sr) as u64)
            }
            Enc::Mxfp4 => ((rows * cols / 2) as u64, (rows * cols / MXFP4_GROUP) as u64),
            _ => ((rows * cols * 2) as u64, 0),
        };
        // MXFP4 has no biases; affine a BF16 bias per scale.
        let biases = if enc == Enc::Mxfp4 { 0 } else { scales };
        parts.push(BlobPart {
            part,
            rows: rows as u64,
            cols: cols as u64,
            offset,
            weights,
            scales,
            biases,
            scheme: None,
        });
        offset += weights + scales + biases;
    }
    let blob_bytes = offset;
    let stride = blob_bytes.next_multiple_of(crate::format::PAGE);
    let p = ExpertPool {
        file: "packed_experts/test.bin".into(),
        layer: 0,
        sidecar: None,
        experts: experts as u64,
        scheme: match enc {
            Enc::Int4 => Scheme::Int4G64,
            Enc::Int8 => Scheme::Int8G64,
            Enc::Mxfp4 => Scheme::Mxfp4,
            _ => Scheme::Passthrough,
        },
        dtype: Dtype::BF16,
        blob_bytes,
        stride,
        parts,
        file_bytes: experts as u64 * stride,
    };
    assert!(p.layout_errors().is_empty(), "{:?}", p.layout_errors());
    let mut ws = Vec::new();
    let mut blobs = Vec::new();
    for _ in 0..experts {
        let w = [
            Weights::new(enc, i, h, rng),
            Weights::new(enc, i, h, rng),
            Weights::new(enc, h, i, rng),
        ];
        blobs.push(w.iter().flat_map(|w| w.parts.concat()).collect());
        ws.push(w);
    }
    (p, ws, blobs)
}

/// The `experts` checks of [`all`].
pub(crate) fn experts<B: Backend>(b: &B) {
    let mut rng = Rng(0xC0FF_000A);
    for (enc, h, i) in [
        (Enc::Int4, 128, 192),
        (Enc::Int8, 64, 64),
        (Enc::Bf16, 64, 96),
        (Enc::Mxfp4, 96, 64),
    ] {
        let (p, ws, blobs) = pool(enc, 3, h, i, &mut rng);
        let n = 5;
        let x = rng.vec(n * h);
        // Two slots; expert 2 takes slot 0 over expert 0 (a refill), then the mapped path.
        // (expert, slot, routes)
        let uses = [
            (0, Some(0), vec![(0, 0.3), (3, 0.7)]),
            (1, Some(1), vec![(1, 0.5), (3, 0.2), (4, 1.0)]),
            (2, Some(0), vec![(0, 0.25), (2, 1.5)]),
            (1, None, vec![(2, 0.125)]),
        ];
        let slots = b.expert_slots(Some(2), &[&p]).unwrap();
        let start = rng.vec(n * h);
        let mut out = up(b, &start);
        let mut want = f64s(&start);
        let mut bound = vec![0f64; n * h];
        for (e, slot, routes) in &uses {
            let blob = ExpertRef {
                pool: &p,
                layer: 0,
                expert: *e,
                slot: *slot,
                bytes: &blobs[*e],
            };
            let ex = b.expert(&slots, blob).unwrap();
            b.expert_ffn(&ex, &up(b, &x), routes, &mut out).unwrap();
            let [g, u, d] = &ws[*e];
            for &(t, wt) in routes {
                let (y, yb) = mlp_reference(g, u, d, &x[t * h..(t + 1) * h]);
                for k in 0..h {
                    want[t * h + k] += wt as f64 * y[k];
                    bound[t * h + k] += wt as f64 * yb[k] + 1e-6 * want[t * h + k].abs();
                }
            }
        }
        check(
            &down(b, &out),
            &want,
            &bound,
            &format!("expert_ffn {enc:?} {h}/{i}"),
        );
    }
}

/// One test per group of ops on the CPU backend (two threads, native loops), so a
/// failure names its op; the portable single-thread loops run them all at once.
macro_rules! cpu_checks {
    ($($op:ident),*) => {
        mod cpu {
            $(
                #[test]
                fn $op() {
                    super::$op(&super::Cpu::new(2));
                }
            )*
        }
    };
}

cpu_checks!(
    data,
    linear,
    bias,
    embed,
    norms,
    elementwise,
    ffn,
    rope,
    attention,
    route,
    route_specs,
    experts
);

#[test]
fn the_portable_single_thread_cpu_backend_meets_the_seam_contract() {
    all(&Cpu::portable(1));
}

#[test]
fn weights_fixture_decodes_what_the_kernels_compute() {
    // The reference's own decoding agrees with the kernel row widening bit for bit, so
    // the checks above compare against the right numbers.
    let mut rng = Rng(0xC0FF_000B);
    for enc in [
        Enc::Int4,
        Enc::Int8,
        Enc::Bf16,
        Enc::F16,
        Enc::F32,
        Enc::Mxfp4,
    ] {
        let w = Weights::new(enc, 4, 128, &mut rng);
        for r in 0..4 {
            let mut out = vec![0f32; 128];
            w.matrix().widen_row(r, &mut out);
            assert_eq!(out, w.row(r).0, "{enc:?} row {r}");
        }
    }
}
