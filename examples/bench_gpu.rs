//! INT4 g64 matrix-vector bandwidth of the GPU kernels (`runtime::kernels::gpu`).
//!
//! For each shape it uploads enough distinct random INT4 matrices that one pass
//! over them reads at least 256 MiB (more than any GPU's last-level cache, so the
//! figure is memory bandwidth, not cache), records `--batch` products cycling over
//! them, and times the wall clock from submitting the batch to the device going idle. Each run gives
//! `weight bytes read / time`; the median of `--runs` runs is printed, with the
//! fraction of `--peak-gbs` when given (the H200's HBM is about 4800 GB/s). Where the
//! adapter has timestamp queries each run is repeated with the batch's compute pass
//! timed on the device (first dispatch's start to last one's end, the gaps between
//! them included), printed beside the wall clock: that one leaves out wgpu's encoding
//! of the batch at submit, the submit and the host's wake-up (together about 4–5 us a
//! product at a batch of 64 on the H200).
//!
//! ```text
//! cargo run --release --example bench_gpu -- [--adapter NAME|INDEX] [--runs 15]
//!     [--batch 64] [--peak-gbs 4800] [--shapes 4096x4096,8192x8192,16384x8192]
//!     [--tilings auto,32x2,16x4] [--kernels f32,x24,x24-repack]
//! ```
//!
//! `--kernels`: `f32`, the f32 kernel (`qmatvec_fast`); `x24`, the packed 24-bit x
//! kernel (`qmatvec_x24`) with x packed once for the batch (as q, k and v share one
//! x); `x24-repack`, the same with two x taking turns, so every product packs its x
//! first (as a product whose x is new each time). Each line says which one the
//! runtime takes at that shape on this adapter.
//! `--tilings` times the f32 kernel at each `LANESxROWS` tiling (`auto`: the one the
//! runtime picks per shape), for tuning.

use std::time::Instant;

#[path = "common/mod.rs"]
mod common;
use common::{Rng, bf16_bytes, median};

use gturbo::runtime::kernels::Matrix;
use gturbo::runtime::kernels::gpu::{DType, GpuContext, GpuMatrix, GpuOptions, list_adapters};

/// One pass over the matrix set reads at least this much.
const MIN_SET_BYTES: usize = 256 << 20;

struct Args {
    adapter: Option<String>,
    runs: usize,
    batch: usize,
    peak_gbs: Option<f64>,
    shapes: Vec<(usize, usize)>,
    tilings: Vec<Option<(u32, u32)>>,
    kernels: Vec<String>,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        adapter: None,
        runs: 15,
        batch: 64,
        peak_gbs: None,
        shapes: vec![(4096, 4096), (8192, 8192), (16384, 8192)],
        tilings: vec![None],
        kernels: vec!["f32".into(), "x24".into(), "x24-repack".into()],
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--adapter" => a.adapter = Some(val()?),
            "--runs" => a.runs = val()?.parse().map_err(|e| format!("--runs: {e}"))?,
            "--batch" => a.batch = val()?.parse().map_err(|e| format!("--batch: {e}"))?,
            "--peak-gbs" => {
                a.peak_gbs = Some(val()?.parse().map_err(|e| format!("--peak-gbs: {e}"))?)
            }
            "--shapes" => {
                a.shapes = val()?
                    .split(',')
                    .map(|s| {
                        let (r, c) = s.split_once('x').ok_or(format!("shape {s}: want RxC"))?;
                        Ok((
                            r.parse().map_err(|e| format!("shape {s}: {e}"))?,
                            c.parse().map_err(|e| format!("shape {s}: {e}"))?,
                        ))
                    })
                    .collect::<Result<_, String>>()?
            }
            "--tilings" => {
                a.tilings = val()?
                    .split(',')
                    .map(|t| {
                        if t == "auto" {
                            return Ok(None);
                        }
                        let (l, r) = t.split_once('x').ok_or(format!("tiling {t}: want LxR"))?;
                        Ok(Some((
                            l.parse().map_err(|e| format!("tiling {t}: {e}"))?,
                            r.parse().map_err(|e| format!("tiling {t}: {e}"))?,
                        )))
                    })
                    .collect::<Result<_, String>>()?
            }
            "--kernels" => {
                a.kernels = val()?.split(',').map(str::to_string).collect();
                if let Some(k) = a
                    .kernels
                    .iter()
                    .find(|k| !["f32", "x24", "x24-repack"].contains(&k.as_str()))
                {
                    return Err(format!("--kernels: {k}: want f32, x24 or x24-repack"));
                }
            }
            "--list" => {
                for a in list_adapters() {
                    println!("{a}");
                }
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.runs == 0 || a.batch == 0 {
        return Err("--runs and --batch must be positive".into());
    }
    Ok(a)
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("bench_gpu: {e}");
            std::process::exit(2);
        }
    };
    let ctx = match GpuContext::new(&GpuOptions {
        adapter: args.adapter.clone(),
        pass_timestamps: true,
    }) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("bench_gpu: {e}");
            std::process::exit(1);
        }
    };
    println!("adapter: {}", ctx.adapter());
    // The runtime's own choice of kernel, before the rows below change it.
    let policy = ctx.packed_x_min();
    // One submit per timed batch: nothing may start before the clock does.
    ctx.set_submit_every(4096);
    println!(
        "INT4 g64 matvec, median of {} runs of {} products each",
        args.runs, args.batch
    );
    let mut rng = Rng(0x853c_49e6_748f_ea9b);
    // GTURBO_BENCH_KEEP=1 keeps every shape's matrices alive to the end (nothing freed
    // between shapes), for telling allocation effects from the kernel's speed.
    let keep = std::env::var_os("GTURBO_BENCH_KEEP").is_some_and(|v| v != "0");
    let mut kept = Vec::new();
    for &(rows, cols) in &args.shapes {
        if cols % 64 != 0 {
            eprintln!("bench_gpu: {rows}x{cols}: columns must be a multiple of 64");
            std::process::exit(2);
        }
        let one = rows * cols / 2 + 2 * 2 * rows * cols / 64;
        let copies = MIN_SET_BYTES.div_ceil(one).max(1);
        let mut mats = Vec::with_capacity(copies);
        for c in 0..copies {
            let weights: Vec<u8> = (0..rows * cols / 2).map(|_| rng.next() as u8).collect();
            let scales = bf16_bytes(&mut rng, rows * cols / 64, 0.02);
            let biases = bf16_bytes(&mut rng, rows * cols / 64, 0.2);
            let m = Matrix::Quant {
                group: 64,
                bits: 4,
                weights: &weights,
                scales: &scales,
                biases: &biases,
                rows,
                cols,
            };
            match GpuMatrix::upload(&ctx, &m, &format!("bench {c}")) {
                Ok(g) => mats.push(g),
                Err(e) => {
                    eprintln!("bench_gpu: {rows}x{cols}: {e}");
                    std::process::exit(1);
                }
            }
        }
        let x: Vec<f32> = (0..cols).map(|_| rng.unit()).collect();
        let x2: Vec<f32> = (0..cols).map(|_| rng.unit()).collect();
        let run = |repack: bool| -> Result<f64, String> {
            let gx = ctx.upload_f32(&[1, cols], &x).map_err(|e| e.to_string())?;
            let gx2 = ctx.upload_f32(&[1, cols], &x2).map_err(|e| e.to_string())?;
            let y = ctx
                .zeros(&[1, rows], DType::F32)
                .map_err(|e| e.to_string())?;
            ctx.flush().map_err(|e| e.to_string())?;
            // Recording is host work; the clock covers submit to idle.
            for i in 0..args.batch {
                let x = if repack && i % 2 == 1 { &gx2 } else { &gx };
                ctx.matmul(&mats[i % mats.len()], x, &y)
                    .map_err(|e| e.to_string())?;
            }
            let t = Instant::now();
            ctx.flush().map_err(|e| e.to_string())?;
            Ok(t.elapsed().as_secs_f64())
        };
        ctx.set_packed_x(policy);
        let x24_here = ctx.packed_x_takes(&mats[0]);
        let rows_to_time = args.kernels.iter().flat_map(|k| {
            let tilings = if k == "f32" {
                args.tilings.clone()
            } else {
                vec![None]
            };
            tilings.into_iter().map(move |t| (k.as_str(), t))
        });
        for (kernel, tiling) in rows_to_time {
            let x24 = kernel != "f32";
            ctx.set_packed_x(x24.then_some(0));
            if x24 && !ctx.packed_x_takes(&mats[0]) {
                println!("[{rows} x {cols}] {kernel}: not eligible");
                continue;
            }
            let repack = kernel == "x24-repack";
            if let Err(e) = ctx.set_matvec_tiling(tiling) {
                eprintln!("bench_gpu: {e}");
                std::process::exit(2);
            }
            // One untimed run compiles the pipeline and faults the buffers in.
            if let Err(e) = run(repack) {
                eprintln!("bench_gpu: {rows}x{cols}: {e}");
                std::process::exit(1);
            }
            let mut gbs = Vec::with_capacity(args.runs);
            let mut us = Vec::with_capacity(args.runs);
            let (mut dev_gbs, mut dev_us) = (Vec::new(), Vec::new());
            for _ in 0..args.runs {
                // A wall-clock run, then the same batch timed on the device.
                let timed = run(repack).and_then(|wall| {
                    ctx.set_pass_timestamps(true);
                    let before = ctx.stats().gpu_ns;
                    let r = run(repack);
                    ctx.set_pass_timestamps(false);
                    let ns = ctx.stats().gpu_ns - before;
                    r.map(|_| (wall, ns as f64 * 1e-9))
                });
                match timed {
                    Ok((secs, device)) => {
                        let per = secs / args.batch as f64;
                        us.push(per * 1e6);
                        gbs.push(one as f64 / per / 1e9);
                        if device > 0.0 {
                            let per = device / args.batch as f64;
                            dev_us.push(per * 1e6);
                            dev_gbs.push(one as f64 / per / 1e9);
                        }
                    }
                    Err(e) => {
                        eprintln!("bench_gpu: {rows}x{cols}: {e}");
                        std::process::exit(1);
                    }
                }
            }
            let fraction = |g: f64| {
                args.peak_gbs
                    .map(|p| format!(", {:.1}% of {p} GB/s", 100.0 * g / p))
                    .unwrap_or_default()
            };
            let g = median(gbs);
            let frac = fraction(g);
            let on_device = if dev_gbs.is_empty() {
                String::new()
            } else {
                let g = median(dev_gbs);
                format!(
                    "; device time {:.1} us, {g:.2} GB/s{}",
                    median(dev_us),
                    fraction(g)
                )
            };
            let taken = if x24_here == x24 && !repack {
                ", the runtime's choice"
            } else {
                ""
            };
            let label = match tiling {
                Some((l, r)) => format!(" {kernel} tiling {l}x{r}"),
                None => format!(" {kernel}{taken}"),
            };
            println!(
                "[{rows} x {cols}]{label} {:.1} MiB/product over {copies} matrices: median {:.1} us, {g:.2} GB/s{frac}{on_device}",
                one as f64 / (1 << 20) as f64,
                median(us)
            );
        }
        if keep {
            kept.push(mats);
        }
    }
}
