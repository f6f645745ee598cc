//! CPU kernel throughput on SmolLM2-135M's matrix shapes.
//!
//! `cargo run --release --example bench_kernels [-- --quick]` (or
//! `scripts/bench_kernels.sh`) prints, for INT4, INT8 and BF16 weights at 1 and 2
//! threads:
//! - the median µs per matvec of each shape repeated in place (the weights stay in
//!   cache for all but the head) and its effective GB/s of weight bytes;
//! - a full token sweep: 30 layers of distinct matrices plus the tied head, in decode
//!   order, so the weights stream from memory as in real decoding (median ms per
//!   token and the implied tok/s ceiling of the matrix products alone);
//! - the same sweep as prefill, `matmul` with n = 8 and 32 vectors (per-token figures).

use gturbo::runtime::kernels::{Activations, Backend, Cpu, Matrix};
use gturbo::transform::quant::{Bits, f32_to_bf16, quantize_rows};
use std::time::Instant;

const HIDDEN: usize = 576;
const KV: usize = 192;
const FFN: usize = 1536;
const VOCAB: usize = 49152;
const LAYERS: usize = 30;

/// One matrix's bytes in a given encoding.
struct Owned {
    bits: u32,
    parts: [Vec<u8>; 3],
    rows: usize,
    cols: usize,
}

impl Owned {
    fn new(enc: &str, rows: usize, cols: usize, seed: &mut u64) -> Owned {
        let src: Vec<u16> = (0..rows * cols)
            .map(|_| {
                *seed ^= *seed << 13;
                *seed ^= *seed >> 7;
                *seed ^= *seed << 17;
                f32_to_bf16(((*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1)
            })
            .collect();
        let bits = match enc {
            "int4" => Some(Bits::Four),
            "int8" => Some(Bits::Eight),
            _ => None,
        };
        match bits {
            Some(b) => {
                let n = rows * cols;
                let mut w = vec![0u8; n * b.bits() as usize / 8];
                let mut s = vec![0u8; n / 64 * 2];
                let mut z = vec![0u8; n / 64 * 2];
                quantize_rows(&src, cols, b, &mut w, &mut s, &mut z).expect("quantize");
                Owned {
                    bits: b.bits(),
                    parts: [w, s, z],
                    rows,
                    cols,
                }
            }
            None => Owned {
                bits: 16,
                parts: [
                    src.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    Vec::new(),
                    Vec::new(),
                ],
                rows,
                cols,
            },
        }
    }

    fn matrix(&self) -> Matrix<'_> {
        let (rows, cols) = (self.rows, self.cols);
        if self.bits == 16 {
            Matrix::Bf16 {
                data: &self.parts[0],
                rows,
                cols,
            }
        } else {
            Matrix::Quant {
                bits: self.bits,
                weights: &self.parts[0],
                scales: &self.parts[1],
                biases: &self.parts[2],
                rows,
                cols,
            }
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Median seconds of `f` over `reps` runs after one warm-up.
fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

/// The per-layer shapes in decode order: q, k, v, o, gate, up, down.
const LAYER_SHAPES: [(usize, usize); 7] = [
    (HIDDEN, HIDDEN),
    (KV, HIDDEN),
    (KV, HIDDEN),
    (HIDDEN, HIDDEN),
    (FFN, HIDDEN),
    (FFN, HIDDEN),
    (HIDDEN, FFN),
];

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let reps = if quick { 5 } else { 21 };
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    println!("backend: {}", Cpu::new(1).name());
    for (enc, label) in [
        ("int4", "int4"),
        ("int4", "int4, int8 activations"),
        ("int8", "int8"),
        ("bf16", "bf16"),
    ] {
        let act = if label.contains("activations") {
            Activations::Int8
        } else {
            Activations::F32
        };
        let cpus: Vec<Cpu> = [1, 2]
            .into_iter()
            .map(|t| Cpu::new(t).with_activations(act))
            .collect();
        println!("\n== {label} ==");
        // Per-shape matvec, weights hot in cache (except the head, 14+ MB).
        let shapes = [
            (HIDDEN, HIDDEN),
            (KV, HIDDEN),
            (FFN, HIDDEN),
            (HIDDEN, FFN),
            (VOCAB, HIDDEN),
        ];
        println!(
            "{:>12} {:>10} | {:>10} {:>8} | {:>10} {:>8}",
            "shape", "MB", "1T µs", "GB/s", "2T µs", "GB/s"
        );
        let mut per_shape = std::collections::HashMap::new();
        for (rows, cols) in shapes {
            let m = Owned::new(enc, rows, cols, &mut seed);
            let w = m.matrix();
            let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut y = vec![0.0f32; rows];
            let inner = if rows == VOCAB { 3 } else { 50 };
            let mut line = format!(
                "{:>12} {:>10.3}",
                format!("{rows}x{cols}"),
                w.weight_bytes() as f64 / 1e6
            );
            for cpu in &cpus {
                let t = cpu.install(|| {
                    time(reps, || {
                        for _ in 0..inner {
                            cpu.matvec(&w, &x, &mut y)
                        }
                    })
                }) / inner as f64;
                per_shape.insert((rows, cols, cpu.threads()), t);
                line += &format!(
                    " | {:>10.1} {:>8.2}",
                    t * 1e6,
                    w.weight_bytes() as f64 / t / 1e9
                );
            }
            println!("{line}");
        }
        for cpu in &cpus {
            let t = |r, c| per_shape[&(r, c, cpu.threads())];
            let layer: f64 = LAYER_SHAPES.iter().map(|&(r, c)| t(r, c)).sum();
            let tok = LAYERS as f64 * layer + t(VOCAB, HIDDEN);
            println!(
                "{}T sum of hot shapes per token: {:.3} ms",
                cpu.threads(),
                tok * 1e3
            );
        }

        // Full sweep over distinct matrices, as decoding streams them.
        let layers: Vec<Vec<Owned>> = (0..LAYERS)
            .map(|_| {
                LAYER_SHAPES
                    .iter()
                    .map(|&(r, c)| Owned::new(enc, r, c, &mut seed))
                    .collect()
            })
            .collect();
        let head = Owned::new(enc, VOCAB, HIDDEN, &mut seed);
        let total_bytes: usize = layers
            .iter()
            .flatten()
            .chain([&head])
            .map(|m| m.matrix().weight_bytes())
            .sum();
        println!(
            "token sweep: {:.1} MB of weights per token",
            total_bytes as f64 / 1e6
        );
        for n in [1usize, 8, 32] {
            for cpu in &cpus {
                let xs: Vec<f32> = (0..n * FFN).map(|i| (i as f32 * 0.11).cos()).collect();
                let mut ys = vec![0.0f32; n * VOCAB];
                let sweep = || {
                    for layer in &layers {
                        for m in layer {
                            let w = m.matrix();
                            let (r, c) = (w.rows(), w.cols());
                            if n == 1 {
                                cpu.matvec(&w, &xs[..c], &mut ys[..r]);
                            } else {
                                cpu.matmul(&w, &xs[..n * c], n, &mut ys[..n * r]);
                            }
                        }
                    }
                    let w = head.matrix();
                    if n == 1 {
                        cpu.matvec(&w, &xs[..HIDDEN], &mut ys[..VOCAB]);
                    } else {
                        cpu.matmul(&w, &xs[..n * HIDDEN], n, &mut ys[..n * VOCAB]);
                    }
                };
                let t = cpu.install(|| time(if n == 1 { reps } else { reps.min(5) }, sweep));
                let per_tok = t / n as f64;
                let label = if n == 1 {
                    "decode matvec".to_string()
                } else {
                    format!("prefill matmul n={n}")
                };
                println!(
                    "{}T {label:>20}: {:8.3} ms/token  {:7.1} tok/s  {:6.2} GB/s",
                    cpu.threads(),
                    per_tok * 1e3,
                    1.0 / per_tok,
                    total_bytes as f64 / t / 1e9
                );
            }
        }
    }
}
