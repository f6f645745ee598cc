//! Where the INT4 g64 matrix-vector kernels' time goes, on a real GPU (issue 11's
//! "say where the time goes"). Not a test and not the product: a lab that times, over
//! the same matrices and the same batch structure as `bench_gpu`,
//!
//! - the product's decode kernels from their own WGSL files, bound as the runtime binds
//!   them: `qmatvec_x24` (`product x24`: a `pack_x24` dispatch rounds x to 24 bits,
//!   then the packed dot products) at the lanes the runtime picks for the shape
//!   ([`x24_lanes`]) and at 32, 64 and 128, and at the runtime's lanes again with x
//!   packed before every product (`repack`, as when each product has an x of its
//!   own); and the f32 kernel `qmatvec_fast` (`product f32`, which the runtime takes
//!   for products below `PACKED_X_MIN_CODES` (gpu/tuning.rs) and off Vulkan and DX12)
//!   as wgpu compiles it, and again without wgpu's injected loop counters and
//!   without its bounds checks;
//! - diagnostic kernels (examples/matvec_lab/lab.wgsl) with the f32 kernel's indexing:
//!   loads only, arithmetic only (codes synthesised), the full product, and the full
//!   product with two code words per row in flight;
//! - a plain grid-stride read of the matrix, the memory ceiling.
//!
//! ```text
//! cargo run --release --example matvec_lab -- [--shapes 8192x8192,16384x8192] [--runs 9]
//!     [--batch 64] [--peak-gbs 4800] [--only NAME,...]
//! ```
//! Every variant whose output is the product is compared with a CPU reference first
//! (its largest difference, of max |y|, is printed beside its time).

// The lab times kernels without wgpu's injected guards, which only the unsafe
// `create_shader_module_trusted` allows; the product does not.
#![allow(unsafe_code)]

use std::time::Instant;

#[path = "common/mod.rs"]
mod common;
use common::{Rng, median};

use gturbo::runtime::kernels::gpu::{PACKED_X_WORDS, x24_lanes};
use wgpu::util::DeviceExt;

const PRODUCT_F32: &str =
    include_str!("../crates/gturbo-runtime/src/runtime/kernels/gpu/shaders/qmatvec.wgsl");
const PRODUCT_X24: &str =
    include_str!("../crates/gturbo-runtime/src/runtime/kernels/gpu/shaders/qmatvec_x24.wgsl");
const LAB: &str = include_str!("matvec_lab/lab.wgsl");
/// The largest difference from the CPU reference (of max |y|) a product variant may
/// have: the f32 kernels' summation order, and x24's rounding of x (2^-24 of each
/// 32-value chunk's largest |x|), are far below it.
const TOLERANCE: f32 = 1e-4;
const MIN_SET_BYTES: usize = 256 << 20;
/// The group size of the matrices (INT4 g64).
const GROUP: u32 = 64;

/// Which kernel file a variant runs and so which bindings it takes.
#[derive(Clone, Copy, PartialEq)]
enum Layout {
    /// qmatvec.wgsl's `qmatvec_fast`, bound as the runtime's `dispatch_fast` binds it.
    F32,
    /// qmatvec_x24.wgsl: `pack_x24` then `qmatvec_x24`, bound as the runtime's
    /// `x24_matvec` binds them. `repack`: x packed before every product; otherwise
    /// once per batch (as consecutive products of one x, q, k and v, share it).
    X24 { repack: bool },
    /// lab.wgsl's diagnostics.
    Lab,
}

impl Layout {
    fn source(self) -> &'static str {
        match self {
            Layout::F32 => PRODUCT_F32,
            Layout::X24 { .. } => PRODUCT_X24,
            Layout::Lab => LAB,
        }
    }
}

struct Variant {
    name: &'static str,
    layout: Layout,
    entry: &'static str,
    constants: Vec<(&'static str, f64)>,
    /// (bounds checks, loop bounding, integer-division guards); all true is wgpu's
    /// default.
    checks: (bool, bool, bool),
    /// Rows per workgroup (0: the stream kernel's fixed grid).
    rows_per_wg: u32,
    /// Whether its output is the product (checked against the CPU).
    product: bool,
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
        layout: Layout::Lab,
        entry,
        constants,
        checks,
        rows_per_wg,
        product,
        own_y: false,
    }
}

/// `qmatvec_x24` at `lanes` invocations per 4 rows, as the runtime runs it.
fn x24(name: String, lanes: u32, repack: bool) -> Variant {
    Variant {
        name: Box::leak(name.into_boxed_str()),
        layout: Layout::X24 { repack },
        entry: "qmatvec_x24",
        constants: vec![("GROUP", GROUP as f64), ("LANES", lanes as f64)],
        checks: (true, true, true),
        rows_per_wg: 256 / lanes * 4,
        product: true,
        own_y: false,
    }
}

/// The variants at `rows` × `cols` (the x24 lanes the runtime picks depend on the
/// shape).
fn variants(rows: usize, cols: usize) -> Vec<Variant> {
    let mut v = Vec::new();
    let runtime_lanes = x24_lanes(cols / 32, rows);
    let mut lanes = vec![runtime_lanes];
    lanes.extend([32u32, 64, 128].into_iter().filter(|&l| l != runtime_lanes));
    for l in lanes {
        v.push(x24(format!("product x24 {l}x4"), l, false));
    }
    v.push(x24(
        format!("product x24 {runtime_lanes}x4 repack"),
        runtime_lanes,
        true,
    ));
    for (lanes, rps) in [(64u32, 4u32), (128, 4), (32, 4)] {
        for (tag, checks) in [
            ("", (true, true, true)),
            (" no-loop-bound", (true, false, true)),
            (" no-loop-no-div", (true, false, false)),
            (" unchecked", (false, false, false)),
        ] {
            v.push(Variant {
                name: Box::leak(format!("product f32 {lanes}x{rps}{tag}").into_boxed_str()),
                layout: Layout::F32,
                entry: "qmatvec_fast",
                constants: vec![("LANES", lanes as f64), ("RPS", rps as f64)],
                checks,
                rows_per_wg: 256 / lanes * rps,
                product: true,
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
    v.push(lab(
        "stream (read ceiling)".into(),
        "stream",
        vec![],
        (true, true, true),
        0,
        false,
    ));
    // The same kernels with a y per matrix (`own_y`): the runtime's x24, the f32
    // kernel at 64x4 and the read ceiling.
    let runtime_x24 = format!("product x24 {runtime_lanes}x4");
    let own: Vec<Variant> = v
        .iter()
        .filter(|d| d.name == runtime_x24 || d.name == "product f32 64x4" || d.entry == "stream")
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
    for &(rows, cols) in &shapes {
        let vars: Vec<Variant> = variants(rows, cols)
            .into_iter()
            .filter(|v| {
                only.as_ref()
                    .is_none_or(|o| o.iter().any(|n| v.name.contains(n.as_str())))
            })
            .collect();
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
        let xb = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("x"),
            contents: &le_bytes(&x, f32::to_le_bytes),
            usage: wgpu::BufferUsages::STORAGE,
        });
        // x as `pack_x24` writes it and `qmatvec_x24` reads it.
        let chunks = cols / 32;
        let packed = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("packed x"),
            size: (chunks * PACKED_X_WORDS * 4) as u64,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        let yb = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("y"),
            size: (rows * 4) as u64,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
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
        // `QmatvecX24Params`: rows, cols, w_off, s_off, b_off, x_off, y_off (and a
        // word of padding).
        let x24_params: Vec<u32> = vec![rows as u32, cols as u32, 0, s_off, b_off, 0, 0, 0];
        let ub = |v: &[u32]| {
            device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("p"),
                contents: &le_bytes(v, u32::to_le_bytes),
                usage: wgpu::BufferUsages::UNIFORM,
            })
        };
        let (pp, lp, xp) = (ub(&product_params), ub(&lab_params), ub(&x24_params));
        println!(
            "[{rows} x {cols}] {:.1} MiB/product over {copies} matrices, median of {runs} runs of {batch}; the runtime's x24 lanes: {}",
            bytes as f64 / (1 << 20) as f64,
            x24_lanes(chunks, rows)
        );
        for v in &vars {
            let row_v = cols / 32;
            if v.entry == "colmv" && !((64..=256).contains(&row_v) && 256 % row_v == 0) {
                println!(
                    "  {:<40} skipped: needs cols / 32 in 64..=256 dividing 256",
                    v.name
                );
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
                source: wgpu::ShaderSource::Wgsl(v.layout.source().into()),
            };
            // SAFETY: a lab, not the product: its kernels' loops are bounded by uniforms
            // and their indices stay within the buffers it makes (the product variant's
            // output is checked below).
            let module = unsafe { device.create_shader_module_trusted(desc, checks) };
            let pipeline = |entry: &str, constants: &[(&str, f64)]| {
                device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(v.name),
                    layout: None,
                    module: &module,
                    entry_point: Some(entry),
                    compilation_options: wgpu::PipelineCompilationOptions {
                        constants,
                        zero_initialize_workgroup_memory: false,
                    },
                    cache: None,
                })
            };
            let pipe = pipeline(v.entry, &v.constants);
            let layout = pipe.get_bind_group_layout(0);
            fn e(b: u32, buf: &wgpu::Buffer) -> wgpu::BindGroupEntry<'_> {
                wgpu::BindGroupEntry {
                    binding: b,
                    resource: buf.as_entire_binding(),
                }
            }
            // x24's pack step (one bind group: it reads only x), and how often it runs.
            let pack = match v.layout {
                Layout::X24 { repack } => {
                    let pipe = pipeline("pack_x24", &[]);
                    let bg = device.create_bind_group(&wgpu::BindGroupDescriptor {
                        label: Some("pack"),
                        layout: &pipe.get_bind_group_layout(0),
                        entries: &[e(0, &xp), e(3, &xb), e(5, &packed)],
                    });
                    // As `x24_matvec` dispatches it: 4 invocations per 32-value chunk,
                    // 64 per workgroup.
                    let wgs = (chunks * 4).div_ceil(64) as u32;
                    Some((pipe, bg, wgs, repack))
                }
                _ => None,
            };
            let bgs: Vec<wgpu::BindGroup> = mats
                .iter()
                .enumerate()
                .map(|(c, m)| {
                    let yb = if v.own_y && c > 0 {
                        &own_ys[c - 1]
                    } else {
                        &yb
                    };
                    let entries: Vec<wgpu::BindGroupEntry> = match v.layout {
                        Layout::X24 { .. } => vec![
                            e(0, &xp),
                            e(1, m),
                            e(2, m),
                            e(4, yb),
                            e(6, &packed),
                            e(7, &packed),
                        ],
                        Layout::F32 => vec![
                            e(0, &pp),
                            e(1, m),
                            e(3, yb),
                            e(4, m),
                            e(5, &xb),
                            e(6, m),
                            e(7, m),
                            e(8, m),
                        ],
                        Layout::Lab if v.entry == "stream" => {
                            vec![e(0, &lp), e(2, m), e(4, yb)]
                        }
                        Layout::Lab => {
                            vec![e(0, &lp), e(1, m), e(2, m), e(3, &xb), e(4, yb)]
                        }
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
                    for i in 0..n {
                        if let Some((pack_pipe, pack_bg, wgs, repack)) = &pack
                            && (i == 0 || *repack)
                        {
                            pass.set_pipeline(pack_pipe);
                            pass.set_bind_group(0, pack_bg, &[]);
                            pass.dispatch_workgroups(*wgs, 1, 1);
                        }
                        pass.set_pipeline(&pipe);
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
            // Untimed: compiles, faults in; checks the product's output (y cleared
            // first, so that a kernel writing nothing cannot pass on an earlier one's y).
            let mut enc = device.create_command_encoder(&Default::default());
            enc.clear_buffer(&yb, 0, None);
            queue.submit([enc.finish(), record(1, false)]);
            let check = if v.product {
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
                if err.is_nan() || err >= TOLERANCE {
                    println!("  {:<40} WRONG: max error {err:e} of max |y|", v.name);
                    continue;
                }
                format!("ok {err:.2e}")
            } else {
                "-".into()
            };
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
                "  {:<40} {check:<10} {:>8.1} us {:>8.1} GB/s {:>5.1}% of {peak} GB/s{on_device}",
                v.name,
                t * 1e6,
                gbs,
                100.0 * gbs / peak
            );
        }
    }
}
