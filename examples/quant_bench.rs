//! Single-core throughput of the affine quantizer, in GB/s of BF16 input.
//!
//! `cargo run --release --example quant_bench` streams a 4096 × 8192 BF16 matrix
//! (64 MiB) through `quantize_rows_le_bytes` in tiles of 16 rows, as the install does,
//! five times per bit width, and prints the best wall-clock rate and, on Linux, the
//! rate per second of CPU time this thread actually ran (meaningful on a busy host).
//! By default it measures gturbo's own installs, INT4 and INT8 at group 64;
//! `-- --all` measures every width and group MLX writes.

use gturbo::transform::quant::{Bits, Spec, f32_to_bf16, quantize_rows_le_bytes};
use std::time::Instant;

/// Nanoseconds this thread has run on a CPU, from `/proc/thread-self/schedstat`.
fn cpu_ns() -> Option<u64> {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn main() {
    let (rows, cols, tile) = (4096usize, 8192usize, 16usize);
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let src: Vec<u8> = (0..rows * cols)
        .flat_map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let u = (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            f32_to_bf16(u * 0.1).to_le_bytes()
        })
        .collect();
    let specs: Vec<Spec> = if std::env::args().any(|a| a == "--all") {
        Spec::all().collect()
    } else {
        vec![Bits::Four.into(), Bits::Eight.into()]
    };
    for spec in specs {
        let wrow = cols * spec.bits.bits() as usize / 8;
        let srow = cols / spec.group.size() * 2;
        let mut w = vec![0u8; tile * wrow];
        let mut s = vec![0u8; tile * srow];
        let mut b = vec![0u8; tile * srow];
        let (mut wall, mut cpu) = (f64::MAX, f64::MAX);
        for _ in 0..5 {
            let (t, c0) = (Instant::now(), cpu_ns());
            for r0 in (0..rows).step_by(tile) {
                let tile_src = &src[r0 * cols * 2..(r0 + tile) * cols * 2];
                if let Err(e) = quantize_rows_le_bytes(tile_src, cols, spec, &mut w, &mut s, &mut b)
                {
                    eprintln!("quantize failed: {e}");
                    std::process::exit(1);
                }
                std::hint::black_box((&w, &s, &b));
            }
            wall = wall.min(t.elapsed().as_secs_f64());
            if let (Some(c0), Some(c1)) = (c0, cpu_ns()) {
                cpu = cpu.min((c1 - c0) as f64 / 1e9);
            }
        }
        let gb = src.len() as f64 / 1e9;
        print!("{spec}: {:.2} GB/s wall", gb / wall);
        if cpu < f64::MAX {
            print!(", {:.2} GB/s per CPU-second", gb / cpu);
        }
        println!(" ({} MiB, tiles of {tile} rows x {cols})", src.len() >> 20);
    }
}
