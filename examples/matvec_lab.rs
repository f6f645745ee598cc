//! Where the INT4 g64 matrix-vector kernel's time goes, on a real GPU (issue 11's
//! "say where the time goes"). Not a test and not the product: a lab that times, over
//! the same matrices and the same batch structure as `bench_gpu`,
//!
//! - the product's `qmatvec_fast` (its own WGSL file) as wgpu compiles it, and again
//!   without wgpu's injected loop counters and without its bounds checks;
//! - diagnostic kernels (examples/matvec_lab/lab.wgsl) with the product's indexing:
//!   loads only, arithmetic only (codes synthesised), the full product, and the full
//!   product with two code words per row in flight;
//! - a plain grid-stride read of the matrix, the memory ceiling;
//! - the codes against an 8-bit x through packed 4 × 8-bit integer dot products
//!   (lab.wgsl's `dp4a`): what dropping the exact f32 products would buy; and against
//!   a 16-bit x as two bytes (`dp4a 16-bit x`, `X16`), two packed products per four
//!   codes, whose rounding stays within the f32 path's 10⁻⁴ check.
//!
//! ```text
//! cargo run --release --example matvec_lab -- [--shapes 8192x8192,16384x8192] [--runs 9]
//!     [--batch 64] [--peak-gbs 4800] [--only NAME,...]
//! ```
//! Every product variant's output is compared with a CPU reference first.

// The lab times kernels without wgpu's injected guards, which only the unsafe
// `create_shader_module_trusted` allows; the product does not.
#![allow(unsafe_code)]

use std::time::Instant;

#[path = "common/mod.rs"]
mod common;
use common::{Rng, median};

use wgpu::util::DeviceExt;

const PRODUCT: &str =
    include_str!("../crates/gturbo-runtime/src/runtime/kernels/gpu/shaders/qmatvec.wgsl");
const LAB: &str = include_str!("matvec_lab/lab.wgsl");
/// The 8-bit x variant's largest difference from the f32 product (of max |y|): x's
/// rounding, not an error of the kernel.
const DP4A_TOLERANCE: f32 = 5e-2;
const MIN_SET_BYTES: usize = 256 << 20;

struct Variant {
    name: &'static str,
    source: &'static str,
    entry: &'static str,
    constants: Vec<(&'static str, f64)>,
    /// (bounds checks, loop bounding, integer-division guards); all true is wgpu's
    /// default.
    checks: (bool, bool, bool),
    /// Rows per workgroup (0: the stream kernel's fixed grid).
    rows_per_wg: u32,
    /// Whether its output is the product (checked against the CPU).
    product: bool,
    /// Bindings: the product's layout or the lab's.
    lab_layout: bool,
    /// The packed-x kernel (lab.wgsl's `dp4a`): the lab's layout plus x rounded to 8 bits.
    dp4a: bool,
    /// With `dp4a`: x rounded to 16 bits (lab.wgsl's `X16`) instead of 8.
    x16: bool,
    /// Each matrix of the set writes a y of its own: wgpu then puts a barrier (a wait
    /// for everything before it to drain) only where a y is reused, once per set,
    /// instead of between every two products. A diagnostic of that wait, not the
    /// product's structure (a decode token's products mostly depend on each other).
    own_y: bool,
}

/// wgpu's defaults, and the lab's kernels again without the loop counters and division
/// guards.
const GUARDED: [(&str, (bool, bool, bool)); 2] = [
    ("", (true, true, true)),
    (" no-loop-no-div", (true, false, false)),
];

/// A lab kernel (lab.wgsl) at `rows_per_wg`; `product`: its output is the product.
fn lab(
    name: String,
    entry: &'static str,
    constants: Vec<(&'static str, f64)>,
    checks: (bool, bool, bool),
    rows_per_wg: u32,
    product: bool,
) -> Variant {
    Variant {
        name: Box::leak(name.into_boxed_str()),
        source: LAB,
        entry,
        constants,
        checks,
        rows_per_wg,
        product,
        lab_layout: true,
        dp4a: false,
        x16: false,
        own_y: false,
    }
}

fn variants() -> Vec<Variant> {
    let mut v = Vec::new();
    for (lanes, rps) in [(64u32, 4u32), (128, 4), (32, 4)] {
        for (tag, checks) in [
            ("", (true, true, true)),
            (" no-loop-bound", (true, false, true)),
            (" no-loop-no-div", (true, false, false)),
            (" unchecked", (false, false, false)),
        ] {
            v.push(Variant {
                name: Box::leak(format!("product {lanes}x{rps}{tag}").into_boxed_str()),
                source: PRODUCT,
                entry: "qmatvec_fast",
                constants: vec![("LANES", lanes as f64), ("RPS", rps as f64)],
                checks,
                rows_per_wg: 256 / lanes * rps,
                product: true,
                lab_layout: false,
                dp4a: false,
                x16: false,
                own_y: false,
            });
        }
    }
    let modes = [
        (0u32, "lab full"),
        (1, "lab loads-only"),
        (2, "lab math-only"),
        (3, "lab 2-steps"),
    ];
    for (mode, what) in modes {
        for lanes in [64u32, 32] {
            for (tag, checks) in GUARDED {
                let name = format!("{what} {lanes}x4{tag}");
                let constants = vec![("LANES", lanes as f64), ("MODE", mode as f64)];
                let product = mode == 0 || mode == 3;
                v.push(lab(
                    name,
                    "lab",
                    constants,
                    checks,
                    256 / lanes * 4,
                    product,
                ));
            }
        }
    }
    for lanes in [64u32, 32] {
        for (tag, checks) in GUARDED {
            let name = format!("lab 8-rows {lanes}x8{tag}");
            let constants = vec![("LANES", lanes as f64), ("RS", 2.0)];
            v.push(lab(name, "lab", constants, checks, 256 / lanes * 8, true));
        }
    }
    for wg_rows in [32u32, 64] {
        for (tag, checks) in GUARDED {
            let name = format!("x-in-registers {wg_rows} rows/wg{tag}");
            let constants = vec![("WG_ROWS", wg_rows as f64)];
            v.push(lab(name, "colmv", constants, checks, wg_rows, true));
        }
    }
    for lanes in [128u32, 64, 32] {
        for (tag, checks) in GUARDED {
            let mut d = lab(
                format!("dp4a 8-bit x {lanes}x4{tag}"),
                "dp4a",
                vec![("LANES", lanes as f64)],
                checks,
                256 / lanes * 4,
                true,
            );
            d.dp4a = true;
            v.push(d);
            let mut d = lab(
                format!("dp4a 16-bit x {lanes}x4{tag}"),
                "dp4a",
                vec![("LANES", lanes as f64), ("X16", 1.0)],
                checks,
                256 / lanes * 4,
                true,
            );
            (d.dp4a, d.x16) = (true, true);
            v.push(d);
        }
    }
    v.push(lab(
        "stream (read ceiling)".into(),
        "stream",
        vec![],
        (true, true, true),
        0,
        false,
    ));
    // The same kernels with a y per matrix (`own_y`).
    let own: Vec<Variant> = v
        .iter()
        .filter(|d| {
            d.checks == (true, true, true)
                && [
                    "product 64x4",
                    "dp4a 8-bit x 128x4",
                    "dp4a 16-bit x 64x4",
                    "stream",
                ]
                .iter()
                .any(|n| d.name.starts_with(n))
        })
        .map(|d| Variant {
            name: Box::leak(format!("{} own y", d.name).into_boxed_str()),
            constants: d.constants.clone(),
            own_y: true,
            ..*d
        })
        .collect();
    v.extend(own);
    v
}

/// One matrix: codes (rows·cols/2 bytes), then scales, then biases (BF16).
fn make_matrix(rng: &mut Rng, rows: usize, cols: usize) -> Vec<u8> {
    let groups = rows * cols / 64;
    let mut b: Vec<u8> = (0..rows * cols / 2).map(|_| rng.next() as u8).collect();
    b.extend(common::bf16_bytes(rng, groups, 0.02));
    b.extend(common::bf16_bytes(rng, groups, 0.2));
    b
}

fn reference(m: &[u8], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
    let groups = cols / 64;
    let sc = rows * cols / 2;
    let half = |i: usize| f32::from_bits((u16::from_le_bytes([m[i], m[i + 1]]) as u32) << 16);
    (0..rows)
        .map(|r| {
            let mut acc = 0f64;
            for g in 0..groups {
                let (mut dq, mut sx) = (0f64, 0f64);
                for k in 0..64 {
                    let c = g * 64 + k;
                    let byte = m[r * cols / 2 + c / 2];
                    let q = if c % 2 == 0 { byte & 15 } else { byte >> 4 };
                    dq += q as f64 * x[c] as f64;
                    sx += x[c] as f64;
                }
                let s = half(sc + 2 * (r * groups + g)) as f64;
                let bi = half(sc + 2 * rows * groups + 2 * (r * groups + g)) as f64;
                acc += s * dq + bi * sx;
            }
            acc as f32
        })
        .collect()
}

/// x rounded to `bits` (8 or 16) per 32-code chunk (round to nearest, step max |x| /
/// (2^(bits-1) - 1)), packed as lab.wgsl's `dp4a` reads it: per chunk the even codes'
/// bytes, then the odd codes'; at 16 bits the signed high bytes in the first list and
/// the unsigned low bytes in the second; and per chunk (step, exact Σ x).
fn quantize_x(x: &[f32], bits: u32) -> (Vec<u32>, Vec<u32>, Vec<f32>) {
    let (mut xq, mut xl, mut xs) = (Vec::new(), Vec::new(), Vec::new());
    let top = ((1i32 << (bits - 1)) - 1) as f32;
    for c in x.chunks_exact(32) {
        let max = c.iter().fold(0f32, |m, v| m.max(v.abs()));
        let step = if max > 0.0 { max / top } else { 1.0 };
        let q = |v: f32| (v / step).round().clamp(-top, top) as i32;
        for parity in 0..2 {
            for j in 0..4 {
                let (mut hi, mut lo) = (0u32, 0u32);
                for i in 0..4 {
                    let v = q(c[8 * j + 2 * i + parity]);
                    let (h, l) = if bits == 16 {
                        (v >> 8, v & 255)
                    } else {
                        (v, 0)
                    };
                    hi |= ((h as i8) as u8 as u32) << (8 * i);
                    lo |= (l as u32) << (8 * i);
                }
                xq.push(hi);
                xl.push(lo);
            }
        }
        xs.push(step);
        xs.push(c.iter().map(|&v| v as f64).sum::<f64>() as f32);
    }
    (xq, xl, xs)
}

/// A mappable buffer's values, once the device is idle.
fn read_back<T, const N: usize>(
    device: &wgpu::Device,
    buf: &wgpu::Buffer,
    from: fn([u8; N]) -> T,
) -> Vec<T> {
    buf.slice(..).map_async(wgpu::MapMode::Read, |_| {});
    device.poll(wgpu::PollType::wait_indefinitely()).ok();
    let v = buf
        .slice(..)
        .get_mapped_range()
        .expect("mapped")
        .chunks_exact(N)
        .map(|b| from(b.try_into().expect("N bytes")))
        .collect();
    buf.unmap();
    v
}

/// A buffer's values as the little-endian bytes the GPU reads.
fn le_bytes<T: Copy, const N: usize>(v: &[T], to: fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|&e| to(e)).collect()
}

fn main() {
    let mut shapes = vec![(4096usize, 4096usize), (8192, 8192), (16384, 8192)];
    let (mut runs, mut batch, mut peak, mut only) = (9usize, 64usize, 4800f64, None::<Vec<String>>);
    let mut it = std::env::args().skip(1);
    while let Some(f) = it.next() {
        let v = it.next().unwrap_or_default();
        match f.as_str() {
            "--shapes" => {
                shapes = v
                    .split(',')
                    .filter_map(|s| {
                        let (r, c) = s.split_once('x')?;
                        Some((r.parse().ok()?, c.parse().ok()?))
                    })
                    .collect()
            }
            "--runs" => runs = v.parse().unwrap_or(runs),
            "--batch" => batch = v.parse().unwrap_or(batch),
            "--peak-gbs" => peak = v.parse().unwrap_or(peak),
            "--only" => only = Some(v.split(',').map(str::to_string).collect()),
            _ => {
                eprintln!("matvec_lab: unknown argument {f}");
                std::process::exit(2);
            }
        }
    }
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12;
    let instance = wgpu::Instance::new(desc);
    let adapter = pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
        power_preference: wgpu::PowerPreference::HighPerformance,
        ..Default::default()
    }))
    .expect("no adapter");
    let info = adapter.get_info();
    println!(
        "adapter: {} ({:?}, {})",
        info.name, info.backend, info.driver_info
    );
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("lab"),
        required_features: adapter.features() & wgpu::Features::TIMESTAMP_QUERY,
        required_limits: adapter.limits(),
        experimental_features: wgpu::ExperimentalFeatures::disabled(),
        memory_hints: wgpu::MemoryHints::Performance,
        trace: wgpu::Trace::Off,
    }))
    .expect("no device");
    let max_x = device.limits().max_compute_workgroups_per_dimension as usize;
    // The batch's device time from timestamps at its pass's start and end, where the
    // adapter has them: the wall clock also holds the submit and the wake-up.
    let stamps = device
        .features()
        .contains(wgpu::Features::TIMESTAMP_QUERY)
        .then(|| {
            let buf = |usage| {
                device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("stamps"),
                    size: 16,
                    usage,
                    mapped_at_creation: false,
                })
            };
            (
                device.create_query_set(&wgpu::QuerySetDescriptor {
                    label: Some("pass"),
                    ty: wgpu::QueryType::Timestamp,
                    count: 2,
                }),
                buf(wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC),
                buf(wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST),
                f64::from(queue.get_timestamp_period()),
            )
        });
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let vars: Vec<Variant> = variants()
        .into_iter()
        .filter(|v| {
            only.as_ref()
                .is_none_or(|o| o.iter().any(|n| v.name.contains(n.as_str())))
        })
        .collect();
    for &(rows, cols) in &shapes {
        let one = make_matrix(&mut rng, rows, cols);
        let bytes = one.len();
        let copies = MIN_SET_BYTES.div_ceil(bytes).max(1);
        let mut mats = vec![
            device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("m0"),
                contents: &one,
                usage: wgpu::BufferUsages::STORAGE,
            }),
        ];
        for c in 1..copies {
            let m = make_matrix(&mut rng, rows, cols);
            mats.push(
                device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some(&format!("m{c}")),
                    contents: &m,
                    usage: wgpu::BufferUsages::STORAGE,
                }),
            );
        }
        let x: Vec<f32> = (0..cols).map(|_| rng.unit()).collect();
        let want = reference(&one, rows, cols, &x);
        let (xq, _, xs) = quantize_x(&x, 8);
        let (xq16, xl16, xs16) = quantize_x(&x, 16);
        let init = |label: &str, contents: &[u8]| {
            device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents,
                usage: wgpu::BufferUsages::STORAGE,
            })
        };
        let xqb = init("xq", &le_bytes(&xq, u32::to_le_bytes));
        let xsb = init("xs", &le_bytes(&xs, f32::to_le_bytes));
        let xq16b = init("xq16", &le_bytes(&xq16, u32::to_le_bytes));
        let xl16b = init("xl16", &le_bytes(&xl16, u32::to_le_bytes));
        let xs16b = init("xs16", &le_bytes(&xs16, f32::to_le_bytes));
        let xb = init("x", &le_bytes(&x, f32::to_le_bytes));
        let yb = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("y"),
            size: (rows * 4) as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        // The `own_y` variants' outputs of matrices 1.. (matrix 0 writes `yb`).
        let own_ys: Vec<wgpu::Buffer> = (1..copies)
            .map(|_| {
                device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("own y"),
                    size: (rows * 4) as u64,
                    usage: wgpu::BufferUsages::STORAGE,
                    mapped_at_creation: false,
                })
            })
            .collect();
        let read = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("read"),
            size: (rows * 4) as u64,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let groups = (rows * cols / 64) as u32;
        let codes_words = (rows * cols / 8) as u32;
        let s_off = 2 * codes_words;
        let b_off = s_off + groups;
        let product_params: Vec<u32> = vec![
            rows as u32,
            cols as u32,
            1,
            0,
            s_off,
            b_off,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
        ];
        let lab_params: Vec<u32> = vec![rows as u32, cols as u32, 0, s_off, b_off, 0, 0, 0];
        let ub = |v: &[u32]| {
            device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("p"),
                contents: &le_bytes(v, u32::to_le_bytes),
                usage: wgpu::BufferUsages::UNIFORM,
            })
        };
        let (pp, lp) = (ub(&product_params), ub(&lab_params));
        println!(
            "[{rows} x {cols}] {:.1} MiB/product over {copies} matrices, median of {runs} runs of {batch}",
            bytes as f64 / (1 << 20) as f64
        );
        for v in &vars {
            let row_v = cols / 32;
            if v.entry == "colmv" && !((64..=256).contains(&row_v) && 256 % row_v == 0) {
                continue;
            }
            let checks = wgpu::ShaderRuntimeChecks {
                bounds_checks: v.checks.0,
                force_loop_bounding: v.checks.1,
                ray_query_initialization_tracking: true,
                task_shader_dispatch_tracking: true,
                mesh_shader_primitive_indices_clamp: true,
                int_div_checks: v.checks.2,
            };
            let desc = wgpu::ShaderModuleDescriptor {
                label: Some(v.name),
                source: wgpu::ShaderSource::Wgsl(v.source.into()),
            };
            // SAFETY: a lab, not the product: its kernels' loops are bounded by uniforms
            // and their indices stay within the buffers it makes (the product variant's
            // output is checked below).
            let module = unsafe { device.create_shader_module_trusted(desc, checks) };
            let pipe = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(v.name),
                layout: None,
                module: &module,
                entry_point: Some(v.entry),
                compilation_options: wgpu::PipelineCompilationOptions {
                    constants: &v.constants,
                    zero_initialize_workgroup_memory: false,
                },
                cache: None,
            });
            let layout = pipe.get_bind_group_layout(0);
            let bgs: Vec<wgpu::BindGroup> = mats
                .iter()
                .enumerate()
                .map(|(c, m)| {
                    let yb = if v.own_y && c > 0 {
                        &own_ys[c - 1]
                    } else {
                        &yb
                    };
                    fn e(b: u32, buf: &wgpu::Buffer) -> wgpu::BindGroupEntry<'_> {
                        wgpu::BindGroupEntry {
                            binding: b,
                            resource: buf.as_entire_binding(),
                        }
                    }
                    let entries: Vec<wgpu::BindGroupEntry> = if v.dp4a {
                        let (q, s) = if v.x16 {
                            (&xq16b, &xs16b)
                        } else {
                            (&xqb, &xsb)
                        };
                        vec![
                            e(0, &lp),
                            e(1, m),
                            e(2, m),
                            e(5, q),
                            e(4, yb),
                            e(6, s),
                            e(7, &xl16b),
                        ]
                    } else if v.lab_layout {
                        if v.entry == "stream" {
                            vec![e(0, &lp), e(2, m), e(4, yb)]
                        } else {
                            vec![e(0, &lp), e(1, m), e(2, m), e(3, &xb), e(4, yb)]
                        }
                    } else {
                        vec![
                            e(0, &pp),
                            e(1, m),
                            e(3, yb),
                            e(4, m),
                            e(5, &xb),
                            e(6, m),
                            e(7, m),
                            e(8, m),
                        ]
                    };
                    device.create_bind_group(&wgpu::BindGroupDescriptor {
                        label: None,
                        layout: &layout,
                        entries: &entries,
                    })
                })
                .collect();
            let wgs = if v.rows_per_wg == 0 {
                1056
            } else {
                rows.div_ceil(v.rows_per_wg as usize)
            };
            let (gx, gy) = (wgs.min(max_x) as u32, wgs.div_ceil(max_x) as u32);
            let record = |n: usize, timed: bool| {
                let mut enc = device.create_command_encoder(&Default::default());
                let stamped = stamps.as_ref().filter(|_| timed);
                {
                    let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                        label: None,
                        timestamp_writes: stamped.map(|(q, ..)| wgpu::ComputePassTimestampWrites {
                            query_set: q,
                            beginning_of_pass_write_index: Some(0),
                            end_of_pass_write_index: Some(1),
                        }),
                    });
                    pass.set_pipeline(&pipe);
                    for i in 0..n {
                        pass.set_bind_group(0, &bgs[i % bgs.len()], &[]);
                        pass.dispatch_workgroups(gx, gy, 1);
                    }
                }
                if let Some((q, resolve, back, _)) = stamped {
                    enc.resolve_query_set(q, 0..2, resolve, 0);
                    enc.copy_buffer_to_buffer(resolve, 0, back, 0, 16);
                }
                enc.finish()
            };
            // Untimed: compiles, faults in; checks the product's output.
            queue.submit([record(1, false)]);
            if v.product {
                let mut enc = device.create_command_encoder(&Default::default());
                enc.copy_buffer_to_buffer(&yb, 0, &read, 0, (rows * 4) as u64);
                queue.submit([enc.finish()]);
                let got = read_back(&device, &read, |b: [u8; 4]| f32::from_le_bytes(b));
                let scale = want.iter().fold(0f32, |a, v| a.max(v.abs())).max(1e-6);
                let err = got
                    .iter()
                    .zip(&want)
                    .fold(0f32, |a, (g, w)| a.max((g - w).abs()))
                    / scale;
                let tolerance = if v.dp4a && !v.x16 {
                    DP4A_TOLERANCE
                } else {
                    1e-4
                };
                if err.is_nan() || err >= tolerance {
                    println!("  {:<36} WRONG: max error {err:e} of max |y|", v.name);
                    continue;
                }
                if v.dp4a {
                    println!("  {:<36} x's rounding: {err:.2e} of max |y|", v.name);
                }
            }
            // A batch untimed first: the GPU's clocks drop while the host makes matrices.
            queue.submit([record(batch, false)]);
            device.poll(wgpu::PollType::wait_indefinitely()).ok();
            let (mut times, mut device_times) = (Vec::new(), Vec::new());
            for _ in 0..runs {
                let cmd = record(batch, true);
                device.poll(wgpu::PollType::wait_indefinitely()).ok();
                let t = Instant::now();
                queue.submit([cmd]);
                device.poll(wgpu::PollType::wait_indefinitely()).ok();
                times.push(t.elapsed().as_secs_f64() / batch as f64);
                if let Some((_, _, back, period)) = &stamps {
                    let ticks = read_back(&device, back, |b: [u8; 8]| u64::from_le_bytes(b));
                    let ns = ticks[1].saturating_sub(ticks[0]) as f64 * period;
                    device_times.push(ns * 1e-9 / batch as f64);
                }
            }
            let t = median(times);
            let read_bytes = if v.rows_per_wg == 0 {
                rows * cols / 2
            } else {
                bytes
            };
            let gbs = read_bytes as f64 / t / 1e9;
            let on_device = if device_times.is_empty() {
                String::new()
            } else {
                let td = median(device_times);
                let g = read_bytes as f64 / td / 1e9;
                format!(
                    " | device {:>6.1} us {:>7.1} GB/s {:>5.1}%",
                    td * 1e6,
                    g,
                    100.0 * g / peak
                )
            };
            println!(
                "  {:<36} {:>8.1} us {:>8.1} GB/s {:>5.1}% of {peak} GB/s{on_device}",
                v.name,
                t * 1e6,
                gbs,
                100.0 * gbs / peak
            );
        }
    }
}
