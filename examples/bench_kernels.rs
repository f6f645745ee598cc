//! CPU kernel throughput on SmolLM2-135M's matrix shapes.
//!
//! `cargo run --release --example bench_kernels [-- --quick]` (or
//! `scripts/bench/bench_kernels.sh`) prints, for INT4, INT8 and BF16 weights at 1 and 2
//! threads:
//! - the median µs per matvec of each shape repeated in place (the weights stay in
//!   cache for all but the head) and its effective GB/s of weight bytes;
//! - a full token sweep: 30 layers of distinct matrices plus the tied head, in decode
//!   order, so the weights stream from memory as in real decoding (median ms per
//!   token and the implied tok/s ceiling of the matrix products alone);
//! - the same sweep as prefill, `matmul` with n = 8 and 32 vectors (per-token figures).

use gturbo::runtime::kernels::{Activations, Backend, Cpu, FloatDtype, Matrix};
use gturbo::transform::quant::{Bits, f32_to_bf16, quantize_rows};
use std::time::Instant;

const HIDDEN: usize = 576;
const KV: usize = 192;
const FFN: usize = 1536;
const VOCAB: usize = 49152;
const LAYERS: usize = 30;
/// Seconds per timed repetition: the CPU-time counters advance in 4 ms ticks.
const REP_SECONDS: f64 = 0.2;

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
            Matrix::Float {
                dtype: FloatDtype::Bf16,
                data: &self.parts[0],
                rows,
                cols,
            }
        } else {
            Matrix::Quant {
                bits: self.bits,
                group: 64,
                weights: &self.parts[0],
                scales: &self.parts[1],
                biases: &self.parts[2],
                rows,
                cols,
            }
        }
    }
}

/// Nanoseconds all threads of this process have run on a CPU, summed from
/// `/proc/self/task/*/schedstat` (Linux): on a busy host, the cost that excludes time
/// spent descheduled. With one thread it is that thread's time; with a pool it
/// includes the workers (spinning included).
fn cpu_ns() -> Option<u64> {
    let mut total = 0;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let stat = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
        total += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(total)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Median wall-clock seconds of `f` over `reps` runs after one warm-up, and the
/// median seconds of CPU time the calling thread ran (NaN where not available).
fn time(reps: usize, mut f: impl FnMut()) -> (f64, f64) {
    f();
    let (wall, cpu): (Vec<f64>, Vec<f64>) = (0..reps)
        .map(|_| {
            let c = cpu_ns();
            let t = Instant::now();
            f();
            let wall = t.elapsed().as_secs_f64();
            let cpu = match (c, cpu_ns()) {
                (Some(a), Some(b)) => (b - a) as f64 / 1e9,
                _ => f64::NAN,
            };
            (wall, cpu)
        })
        .unzip();
    (median(wall), median(cpu))
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
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    // `--only int4|int4q8|int8|bf16` runs one encoding.
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1).cloned());
    let reps = if quick { 5 } else { 21 };
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    println!("backend: {}", Cpu::new(1).name());
    // What splitting a product over two threads costs: a matvec small enough that the
    // hand-off dominates (64 rows → 2 tasks of 32 rows).
    {
        let m = Owned::new("int4", 64, HIDDEN, &mut seed);
        let w = m.matrix();
        let x = vec![0.5f32; HIDDEN];
        let mut y = vec![0.0f32; 64];
        let mut line = "dispatch: 64x576 int4 matvec, µs:".to_string();
        for t in [1, 2] {
            let cpu = Cpu::new(t);
            let (wall, cpu_s) = cpu.install(|| {
                time(reps, || {
                    for _ in 0..5000 {
                        cpu.matvec(&w, &x, &mut y)
                    }
                })
            });
            line += &format!(" {t}T {:.2} (cpu {:.2})", wall * 200.0, cpu_s * 200.0);
        }
        println!("{line}");
    }
    for (enc, key, label) in [
        ("int4", "int4", "int4"),
        ("int4", "int4q8", "int4, int8 activations"),
        ("int8", "int8", "int8"),
        ("bf16", "bf16", "bf16"),
    ] {
        if only.as_deref().is_some_and(|o| o != key) {
            continue;
        }
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
            "{:>12} {:>8} | {:>8} {:>6} {:>8} {:>6} | {:>8} {:>6} {:>8}",
            "shape", "MB", "1T µs", "GB/s", "1T cpu", "GB/s", "2T µs", "GB/s", "2T cpu"
        );
        let mut per_shape = std::collections::HashMap::new();
        for (rows, cols) in shapes {
            let m = Owned::new(enc, rows, cols, &mut seed);
            let w = m.matrix();
            let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut y = vec![0.0f32; rows];
            // Repetitions long enough (≥ 200 ms) for the scheduler's CPU-time counters,
            // which advance in whole ticks (4 ms).
            let t1 = {
                let t = Instant::now();
                cpus[0].matvec(&w, &x, &mut y);
                t.elapsed().as_secs_f64()
            };
            let inner = ((REP_SECONDS / t1.max(1e-7)) as usize).clamp(1, 100_000);
            let mut line = format!(
                "{:>12} {:>8.3}",
                format!("{rows}x{cols}"),
                w.weight_bytes() as f64 / 1e6
            );
            for cpu in &cpus {
                let (t, c) = cpu.install(|| {
                    time(reps, || {
                        for _ in 0..inner {
                            cpu.matvec(&w, &x, &mut y)
                        }
                    })
                });
                let (t, c) = (t / inner as f64, c / inner as f64);
                per_shape.insert((rows, cols, cpu.threads()), t);
                let gbs = |t: f64| w.weight_bytes() as f64 / t / 1e9;
                line += &format!(" | {:>8.1} {:>6.2}", t * 1e6, gbs(t));
                if cpu.threads() == 1 {
                    line += &format!(" {:>8.1} {:>6.2}", c * 1e6, gbs(c));
                } else {
                    line += &format!(" {:>8.1}", c * 1e6);
                }
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
                let mut sweep = || {
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
                let t1 = {
                    let t = Instant::now();
                    sweep();
                    t.elapsed().as_secs_f64()
                };
                let inner = ((REP_SECONDS / t1) as usize).max(1);
                let (t, c) = cpu.install(|| {
                    time(reps.min(7), || {
                        for _ in 0..inner {
                            sweep()
                        }
                    })
                });
                let (t, c) = (t / inner as f64, c / inner as f64);
                let per_tok = t / n as f64;
                let label = if n == 1 {
                    "decode matvec".to_string()
                } else {
                    format!("prefill matmul n={n}")
                };
                let cpu_note = format!("  (cpu time: {:.3} ms/token)", c / n as f64 * 1e3);
                println!(
                    "{}T {label:>20}: {:8.3} ms/token  {:7.1} tok/s  {:6.2} GB/s{cpu_note}",
                    cpu.threads(),
                    per_tok * 1e3,
                    1.0 / per_tok,
                    total_bytes as f64 / t / 1e9
                );
            }
        }
    }
}
