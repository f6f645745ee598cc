//! The shader check (every kernel variant becomes MSL and HLSL source; no GPU) and
//! each GPU operation against the CPU operation it replaces, on random inputs at
//! awkward shapes: one group, row and token counts no workgroup divides, the largest
//! shapes SmolLM2 has (hidden 576, intermediate 1536, vocabulary 49152).
//!
//! The parity tests need an adapter (Mesa's llvmpipe is enough). Without one they
//! print `skipped: …` and return, unless `GTURBO_REQUIRE_GPU=1`, where they fail.
//! Tolerances are the module doc's numerics contract.

use std::sync::OnceLock;

use super::shaders::{Kernel, Shader};
use super::*;
use crate::format::dtype::Dtype;
use crate::format::pools::{BlobPart, ExpertPart, ExpertPool};
use crate::format::quant::{Bits, Group, Spec, f32_to_bf16, quantize_rows};
use crate::format::{PAGE, Scheme, align_up};
use crate::runtime::kernels::expert_matrices;
use crate::runtime::kernels::{
    AttentionSpec, Causal, Cpu, FloatDtype, Matrix, axpy, dot, rms_norm, silu_mul, softmax_inplace,
};
use crate::runtime::testing::Rng;

// ---------------------------------------------------------------- shader check

fn parse(shader: Shader) -> (naga::Module, naga::valid::ModuleInfo) {
    let module = naga::front::wgsl::parse_str(shader.source())
        .unwrap_or_else(|e| panic!("{}: {}", shader.file(), e.emit_to_string(shader.source())));
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::empty(),
    )
    .validate(&module)
    .unwrap_or_else(|e| panic!("{}: {e:?}", shader.file()));
    (module, info)
}

/// Every variant the host builds (and the 2-bit and g32/g128 ones the sources are
/// written for) becomes Metal and HLSL source, with its override constants applied
/// as wgpu applies them. No GPU needed.
#[test]
fn every_kernel_translates_to_msl_and_hlsl() {
    let variants = Kernel::all_variants();
    for k in &variants {
        let (module, info) = parse(k.shader);
        let mut constants = naga::back::PipelineConstants::default();
        for &(name, v) in &k.constants {
            constants.insert(name.to_string(), v);
        }
        let ep = (naga::ShaderStage::Compute, k.entry);
        let (module, info) =
            naga::back::pipeline_constants::process_overrides(&module, &info, Some(ep), &constants)
                .unwrap_or_else(|e| panic!("{}: overrides: {e:?}", k.label()));
        let msl_opts = naga::back::msl::Options {
            lang_version: (2, 0),
            ..Default::default()
        };
        let msl_pipe = naga::back::msl::PipelineOptions {
            entry_point: Some((naga::ShaderStage::Compute, k.entry.to_string())),
            ..Default::default()
        };
        let (msl, _) = naga::back::msl::write_string(&module, &info, &msl_opts, &msl_pipe)
            .unwrap_or_else(|e| panic!("{}: MSL: {e:?}", k.label()));
        assert!(
            msl.contains(&format!("kernel void {}", k.entry)),
            "{}: no Metal kernel in the MSL",
            k.label()
        );
        let hlsl_opts = naga::back::hlsl::Options {
            shader_model: naga::back::hlsl::ShaderModel::V6_0,
            ..Default::default()
        };
        let hlsl_pipe = naga::back::hlsl::PipelineOptions {
            entry_point: Some((naga::ShaderStage::Compute, k.entry.to_string())),
        };
        let mut hlsl = String::new();
        naga::back::hlsl::Writer::new(&mut hlsl, &hlsl_opts, &hlsl_pipe)
            .write(&module, &info, None)
            .unwrap_or_else(|e| panic!("{}: HLSL: {e:?}", k.label()));
        assert!(
            hlsl.contains("[numthreads("),
            "{}: no HLSL kernel",
            k.label()
        );
    }
    // Every entry point of every source is covered.
    for shader in Shader::ALL {
        let (module, _) = parse(shader);
        for ep in &module.entry_points {
            assert!(
                variants
                    .iter()
                    .any(|k| k.shader == shader && k.entry == ep.name),
                "{}:{} has no variant in Kernel::all_variants",
                shader.file(),
                ep.name
            );
        }
    }
}

/// The host's parameter structs match each shader's `Params`: same names, same
/// order, one 4-byte word each, within the 256-byte slot a dispatch reserves.
#[test]
fn host_params_match_the_shaders() {
    for shader in Shader::ALL {
        let (module, _) = parse(shader);
        let (_, ty) = module
            .types
            .iter()
            .find(|(_, t)| t.name.as_deref() == Some("Params"))
            .unwrap_or_else(|| panic!("{} declares no Params", shader.file()));
        let naga::TypeInner::Struct { members, span } = &ty.inner else {
            panic!("{}: Params is not a struct", shader.file());
        };
        let got: Vec<(String, u32)> = members
            .iter()
            .map(|m| (m.name.clone().unwrap_or_default(), m.offset))
            .collect();
        let want: Vec<(String, u32)> = shader
            .params_fields()
            .iter()
            .enumerate()
            .map(|(i, n)| (n.to_string(), 4 * i as u32))
            .collect();
        assert_eq!(got, want, "{}: Params fields", shader.file());
        for m in members {
            let size = module.types[m.ty].inner.size(module.to_ctx());
            assert_eq!(size, 4, "{}: field {:?}", shader.file(), m.name);
        }
        assert!(*span as usize <= shaders::PARAMS_SLOT);
    }
}

// ---------------------------------------------------------------- fixtures

static CTX: OnceLock<std::result::Result<GpuContext, String>> = OnceLock::new();
static GPU: OnceLock<std::result::Result<Gpu, String>> = OnceLock::new();

/// `Some(v)`, or `None` after recording why the test is skipped: through
/// `require_or_skip`, which fails the test instead in a strict run (CI), and a failure
/// too when `GTURBO_REQUIRE_GPU=1`.
fn or_skip<T>(test: &str, r: &'static std::result::Result<T, String>) -> Option<&'static T> {
    match r {
        Ok(c) => Some(c),
        Err(e) => {
            if std::env::var(gturbo_testkit::skip::GTURBO_REQUIRE_GPU).is_ok_and(|v| v == "1") {
                panic!("{test}: GTURBO_REQUIRE_GPU=1 but no GPU: {e}");
            }
            gturbo_testkit::skip::require_or_skip(test, Err(format!("no GPU adapter ({e})")))
        }
    }
}

/// The shared context (see [`or_skip`]), its products in f32 (the packed 24-bit x
/// kernel off, whatever the adapter's default: `packed_x_products_match_cpu` has a
/// context of its own for it).
fn gpu(test: &str) -> Option<&'static GpuContext> {
    or_skip(
        test,
        CTX.get_or_init(|| {
            let ctx = GpuContext::new(&GpuOptions::default()).map_err(|e| e.to_string())?;
            ctx.set_packed_x(None);
            Ok(ctx)
        }),
    )
}

/// The shared backend (see [`or_skip`]).
pub(crate) fn gpu_backend(test: &str) -> Option<&'static Gpu> {
    or_skip(
        test,
        GPU.get_or_init(|| Gpu::new(&GpuOptions::default()).map_err(|e| e.to_string())),
    )
}

/// The seam's contract (`kernels::conformance`, the same checks the CPU meets) on the
/// GPU backend, one test per group of ops.
macro_rules! seam_checks {
    ($($op:ident),*) => {
        mod seam {
            $(
                #[test]
                fn $op() {
                    let Some(g) = super::gpu_backend(concat!("seam::", stringify!($op))) else {
                        return;
                    };
                    crate::runtime::kernels::conformance::$op(g);
                }
            )*
        }
    };
}

seam_checks!(
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

/// A bias that is not whole rows of its input is a shape error naming the op, not a
/// panic or an out-of-bounds read on the device; so is a bias that is the input.
#[test]
fn add_bias_of_a_partial_row_is_an_error() {
    use crate::runtime::kernels::Backend;
    let Some(g) = gpu_backend("add_bias_of_a_partial_row_is_an_error") else {
        return;
    };
    let mut x = g.upload(&[1.0; 10]).unwrap();
    let bias = g.upload(&[1.0; 3]).unwrap();
    let err = g.add_bias(&mut x, &bias).unwrap_err();
    assert_eq!(err.op, "add_bias");
    assert!(err.to_string().contains("add_bias"), "{err}");
    let empty = g.upload(&[]).map(|e| g.add_bias(&mut x, &e));
    assert!(!matches!(empty, Ok(Ok(()))), "an empty bias is refused");
    let ctx = g.context();
    let t = ctx.upload_f32(&[4], &[1.0; 4]).unwrap();
    assert!(ctx.add_bias(&t, &t).is_err(), "an aliased bias is refused");
    assert_eq!(g.read(&x).unwrap(), vec![1.0; 10], "x is left alone");
}

/// A matrix's bytes as the install stores them, plus what the tolerance needs: per
/// element `|s·q| + |b|` (quantized) or `|w|` (float).
struct Fixture {
    kind: &'static str,
    bits: u32,
    group: usize,
    parts: Vec<Vec<u8>>,
    rows: usize,
    cols: usize,
    mag: Vec<f32>,
}

impl Fixture {
    fn quant(bits: Bits, rows: usize, cols: usize, rng: &mut Rng) -> Fixture {
        Fixture::quant_g(bits, Group::G64, rows, cols, rng)
    }

    fn quant_g(bits: Bits, group: Group, rows: usize, cols: usize, rng: &mut Rng) -> Fixture {
        let n = rows * cols;
        let g = group.size();
        let spec = Spec::new(bits, group);
        let mut src: Vec<u16> = (0..n)
            .map(|i| f32_to_bf16(rng.unit() * (0.02 + (i / cols % 7) as f32 * 0.05)))
            .collect();
        src[..g].fill(0);
        let mut w = vec![0u8; n * bits.bits() as usize / 8];
        let mut s = vec![0u8; n / g * 2];
        let mut b = vec![0u8; n / g * 2];
        quantize_rows(&src, cols, spec, &mut w, &mut s, &mut b).unwrap();
        let mut dense = vec![0f32; n];
        crate::format::quant::dequantize_rows(&w, &s, &b, cols, spec, &mut dense).unwrap();
        let bias = |i: usize| {
            crate::format::quant::bf16_to_f32(u16::from_le_bytes([
                b[2 * (i / g)],
                b[2 * (i / g) + 1],
            ]))
        };
        let mag = (0..n)
            .map(|i| (dense[i] - bias(i)).abs() + bias(i).abs())
            .collect();
        Fixture {
            kind: "quant",
            bits: bits.bits(),
            group: g,
            parts: vec![w, s, b],
            rows,
            cols,
            mag,
        }
    }

    fn float(kind: &'static str, rows: usize, cols: usize, rng: &mut Rng) -> Fixture {
        let vals = rng.vec(rows * cols);
        let (bytes, dense): (Vec<u8>, Vec<f32>) = match kind {
            "bf16" => {
                let b: Vec<u16> = vals.iter().map(|&v| f32_to_bf16(v)).collect();
                (
                    b.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    b.iter()
                        .map(|&v| crate::format::quant::bf16_to_f32(v))
                        .collect(),
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
            parts: vec![bytes],
            rows,
            cols,
            mag: dense.iter().map(|v| v.abs()).collect(),
        }
    }

    fn matrix(&self) -> Matrix<'_> {
        let (rows, cols) = (self.rows, self.cols);
        let data = &self.parts[0];
        match self.kind {
            "quant" => Matrix::Quant {
                bits: self.bits,
                group: self.group,
                weights: &self.parts[0],
                scales: &self.parts[1],
                biases: &self.parts[2],
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

    /// `Σ_c mag[r,c]·|x_c|` for each row, for each of the `n` inputs.
    fn bound(&self, xs: &[f32]) -> Vec<f32> {
        let mut out = Vec::new();
        for x in xs.chunks_exact(self.cols) {
            for r in 0..self.rows {
                let row = &self.mag[r * self.cols..(r + 1) * self.cols];
                out.push(row.iter().zip(x).map(|(m, x)| m * x.abs()).sum());
            }
        }
        out
    }
}

/// Fail with the first element where `|got − want| > tol[i]`.
fn assert_close(what: &str, got: &[f32], want: &[f32], tol: impl Fn(usize) -> f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let t = tol(i);
        assert!(
            g == w || (g - w).abs() <= t,
            "{what}: element {i}: gpu {g}, cpu {w}, |diff| {} > tolerance {t}",
            (g - w).abs()
        );
    }
}

/// A guard value written after an output, which no kernel may touch.
const GUARD: f32 = 12345.678;
const GUARDS: usize = 64;

/// Run the GPU product over an output buffer with guard words after it, check the
/// guards, and return the output.
fn gpu_matmul(ctx: &GpuContext, w: &GpuMatrix, xs: &[f32], n: usize, what: &str) -> Vec<f32> {
    let x = ctx.upload_f32(&[n, w.cols()], xs).unwrap();
    let len = n * w.rows();
    let mut init = vec![0f32; len + GUARDS];
    init[len..].fill(GUARD);
    let y = ctx.upload_f32(&[len + GUARDS], &init).unwrap();
    ctx.matmul_raw(w, &x.buf, &y.buf, n).unwrap();
    let mut out = ctx.download_f32(&y).unwrap();
    assert!(
        out[len..].iter().all(|&g| g == GUARD),
        "{what}: a kernel wrote past its output"
    );
    out.truncate(len);
    out
}

/// The product on both backends, compared under the contract's bound.
fn check_product(ctx: &GpuContext, f: &Fixture, n: usize, rng: &mut Rng) {
    let what = format!(
        "{}{} [{}x{}] n={n} ({})",
        f.kind,
        if f.bits > 0 {
            format!("{}_g{}", f.bits, f.group)
        } else {
            String::new()
        },
        f.rows,
        f.cols,
        if tuning::use_tiled(n) {
            "tiled"
        } else {
            "matvec"
        }
    );
    let m = f.matrix();
    let w = GpuMatrix::upload(ctx, &m, "test").unwrap();
    let xs = rng.vec(n * f.cols);
    let got = gpu_matmul(ctx, &w, &xs, n, &what);
    let mut want = vec![0f32; n * f.rows];
    Cpu::new(1).matmul(&m, &xs, n, &mut want);
    let bound = f.bound(&xs);
    let path = if n == 1 && w.fast_path() { " fast" } else { "" };
    assert_close(&format!("{what}{path}"), &got, &want, |i| {
        2e-5 * bound[i] + 1e-30
    });
    // The fast kernel at tilings the shape-based choice may not take: one lane per
    // few words to a whole workgroup per row, 1 to 4 rows per set.
    if let (true, Encoding::Affine { bits, group }) =
        (n == 1 && w.fast_path() && f.rows <= 2048, w.encoding)
    {
        for (lanes, rps) in [(4, 1), (8, 3), (32, 4), (64, 2), (256, 4)] {
            let x = ctx.upload_f32(&[1, f.cols], &xs).unwrap();
            let mut init = vec![0f32; f.rows + GUARDS];
            init[f.rows..].fill(GUARD);
            let y = ctx.upload_f32(&[f.rows + GUARDS], &init).unwrap();
            let p = super::shaders::QmatvecParams {
                rows: f.rows as u32,
                cols: f.cols as u32,
                n: 1,
                w_off: w.w_off,
                s_off: w.s_off,
                b_off: w.b_off,
                ..Default::default()
            };
            ctx.fast_matvec(&w, &p, &x.buf, &y.buf, lanes, rps, bits, group)
                .unwrap();
            let mut out = ctx.download_f32(&y).unwrap();
            let label = format!("{what} fast {lanes}x{rps}");
            assert!(
                out[f.rows..].iter().all(|&g| g == GUARD),
                "{label}: a kernel wrote past its output"
            );
            out.truncate(f.rows);
            assert_close(&label, &out, &want, |i| 2e-5 * bound[i] + 1e-30);
        }
    }
    if f.kind == "quant" {
        let fast = matches!(f.bits, 2 | 4 | 8) && f.group.is_multiple_of(128 / f.bits as usize);
        assert_eq!(
            w.fast_path(),
            fast,
            "{what}: fast path expected for 2/4/8 bits whose 16-byte words stay in a group"
        );
        // The same codes one word further into their buffer: off the 16-byte
        // boundary, so the matrix-vector product takes the scalar kernel.
        let mut bytes = vec![0u8; 4];
        for p in &f.parts {
            bytes.extend_from_slice(p);
        }
        let (wl, sl) = (f.parts[0].len(), f.parts[1].len());
        let shifted = GpuMatrix {
            buf: ctx.upload_bytes("shifted", &bytes).unwrap(),
            w_off: 1,
            s_off: ((4 + wl) / 2) as u32,
            b_off: ((4 + wl + sl) / 2) as u32,
            ..w.clone()
        };
        assert!(!shifted.fast_path());
        let got = gpu_matmul(ctx, &shifted, &xs, n, &what);
        assert_close(&format!("{what} at a word offset"), &got, &want, |i| {
            2e-5 * bound[i] + 1e-30
        });
    }
    // The public entry point agrees with the raw one.
    if n == 1 {
        let x = ctx.upload_f32(&[n, f.cols], &xs).unwrap();
        let y = ctx.zeros(&[n, f.rows], DType::F32).unwrap();
        ctx.matmul(&w, &x, &y).unwrap();
        assert_eq!(ctx.download_f32(&y).unwrap(), got, "{what}: matmul vs raw");
    }
}

// ---------------------------------------------------------------- products

#[test]
fn quantized_products_match_cpu() {
    let Some(ctx) = gpu("quantized_products_match_cpu") else {
        return;
    };
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for bits in [Bits::Four, Bits::Eight] {
        // One group; rows no workgroup divides; SmolLM2's attention, MLP up and down.
        for (rows, cols, ns) in [
            (1, 64, &[1, 3][..]),
            (13, 192, &[1, 9]),
            (576, 576, &[1, 7]),
            (1536, 576, &[1, 17]),
            (576, 1536, &[1, 2]),
        ] {
            let f = Fixture::quant(bits, rows, cols, &mut rng);
            for &n in ns {
                check_product(ctx, &f, n, &mut rng);
            }
        }
    }
    // Every MLX width and group, at one group and at rows no workgroup divides.
    for bits in Bits::ALL {
        for group in Group::ALL {
            for (rows, cols, ns) in [(1, group.size(), &[1, 2][..]), (13, 384, &[1, 3])] {
                let f = Fixture::quant_g(bits, group, rows, cols, &mut rng);
                for &n in ns {
                    check_product(ctx, &f, n, &mut rng);
                }
            }
        }
    }
    // SmolLM2's vocabulary head at INT4.
    let f = Fixture::quant(Bits::Four, 49152, 576, &mut rng);
    check_product(ctx, &f, 1, &mut rng);
}

/// The packed 24-bit x kernel (`qmatvec_x24`) against the CPU's f32 product, under the
/// contract's bound for it: reduction order plus x's rounding, half a step (1/(2^23 − 1) of
/// the chunk's largest |x|) per value. Shapes: one group of each size, rows no
/// workgroup divides, SmolLM2's, an 8192-column row (256 lanes: few rows). Then the packed x word
/// for word (an all-zero chunk among them), and its reuse: two products of one x pack
/// it once, and a write to x is seen.
#[test]
fn packed_x_products_match_cpu() {
    static X24: OnceLock<std::result::Result<GpuContext, String>> = OnceLock::new();
    let Some(ctx) = or_skip(
        "packed_x_products_match_cpu",
        X24.get_or_init(|| {
            let ctx = GpuContext::new(&GpuOptions::default()).map_err(|e| e.to_string())?;
            ctx.set_packed_x(Some(0));
            Ok(ctx)
        }),
    ) else {
        return;
    };
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let cpu = |f: &Fixture, xs: &[f32]| {
        let mut y = vec![0f32; f.rows];
        Cpu::new(1).matmul(&f.matrix(), xs, 1, &mut y);
        y
    };
    let tolerance = |f: &Fixture, xs: &[f32]| -> Vec<f32> {
        let steps: Vec<f32> = xs
            .chunks_exact(32)
            .map(|c| c.iter().fold(0f32, |m, v| m.max(v.abs())) / 8388607.0)
            .collect();
        let bound = f.bound(xs);
        (0..f.rows)
            .map(|r| {
                // Half a step per value, and the step's own error: h and 1/h are f32
                // quotients (WGSL allows 2.5 ulp each), so h·round(x/h) = x·(1 ± 6·2^-24).
                let rounding: f32 = (0..f.cols)
                    .map(|c| f.mag[r * f.cols + c] * (0.5 * steps[c / 32] + 4e-7 * xs[c].abs()))
                    .sum();
                // Reduction order: the f32 kernel's bound is 2e-5 (the CPU's own loose
                // one); here measured ≤ 2e-8 on llvmpipe, so 2e-7 keeps a wrong byte
                // plane (≈ 1e-6 of the bound) from passing.
                2e-7 * bound[r] + rounding + 1e-30
            })
            .collect()
    };
    let mut cases = vec![];
    for group in Group::ALL {
        cases.push((group, 1, group.size()));
        cases.push((group, 13, 384));
    }
    cases.extend([
        (Group::G64, 576, 576),
        (Group::G64, 1536, 576),
        (Group::G64, 576, 1536),
        (Group::G64, 37, 8192),
    ]);
    for (group, rows, cols) in cases {
        let f = Fixture::quant_g(Bits::Four, group, rows, cols, &mut rng);
        let what = format!("x24 4_g{} [{rows}x{cols}]", group.size());
        let w = GpuMatrix::upload(ctx, &f.matrix(), "test").unwrap();
        assert!(w.x24_path(), "{what}: takes the packed-x kernel");
        let xs = rng.vec(cols);
        let got = gpu_matmul(ctx, &w, &xs, 1, &what);
        let want = cpu(&f, &xs);
        let tol = tolerance(&f, &xs);
        assert_close(&what, &got, &want, |i| tol[i]);
        if rows >= 13 {
            // Other tilings than the shape's own: a lane per few words to a workgroup
            // per 4 rows.
            for lanes in [4, 32, 256] {
                ctx.set_x24_lanes(Some(lanes)).unwrap();
                let y = gpu_matmul(ctx, &w, &xs, 1, &what);
                ctx.set_x24_lanes(None).unwrap();
                assert_close(&format!("{what} {lanes} lanes"), &y, &want, |i| tol[i]);
            }
            // Not the f32 kernel's result by accident: x's rounding shows somewhere.
            let f32_path = {
                ctx.set_packed_x(None);
                let y = gpu_matmul(ctx, &w, &xs, 1, &what);
                ctx.set_packed_x(Some(0));
                y
            };
            assert_ne!(got, f32_path, "{what}: the packed-x kernel ran");
        }
    }
    // The packed x itself, word for word: each value's three bytes (even codes' then
    // odd codes' per word), within one unit of round(x / h) (h is an f32 quotient),
    // then h and Σ x per chunk.
    let cols = 384;
    let f = Fixture::quant(Bits::Four, 5, cols, &mut rng);
    let w = GpuMatrix::upload(ctx, &f.matrix(), "pack").unwrap();
    let mut xs = rng.vec(cols);
    xs[33] = 0.0;
    xs[64..96].fill(0.0);
    gpu_matmul(ctx, &w, &xs, 1, "x24 pack");
    let chunks = cols / 32;
    let words = ctx.with_packed_x(|held| {
        let buf = held.buf.clone().expect("a packed buffer");
        GpuTensor::new(buf, &[26 * chunks], DType::U32)
    });
    let got = ctx.download_u32(&words).unwrap();
    let byte = |plane: usize, c: usize, k: usize| {
        // Code k of chunk c: word j = k / 8, byte i = (k % 8) / 2, odd codes 4 words on.
        let word = got[plane * 8 * chunks + c * 8 + (k % 2) * 4 + k / 8];
        (word >> (8 * ((k % 8) / 2))) & 0xff
    };
    for c in 0..chunks {
        let vals = &xs[32 * c..32 * c + 32];
        let m = vals.iter().fold(0f32, |a, v| a.max(v.abs()));
        let h = f32::from_bits(got[24 * chunks + 2 * c]);
        let sum = f32::from_bits(got[24 * chunks + 2 * c + 1]);
        let want_h = if m > 0.0 { m / 8388607.0 } else { 1.0 };
        assert!(
            (h - want_h).abs() <= 4e-7 * want_h,
            "chunk {c}: step {h}, want {want_h}"
        );
        let exact: f64 = vals.iter().map(|&v| f64::from(v)).sum();
        let scale: f64 = vals.iter().map(|&v| f64::from(v.abs())).sum();
        assert!(
            (f64::from(sum) - exact).abs() <= 1e-6 * scale + 1e-30,
            "chunk {c}: Σx {sum}, want {exact}"
        );
        for (k, &v) in vals.iter().enumerate() {
            let q = (byte(0, c, k) as i32 as i8 as i32) << 16
                | (byte(1, c, k) << 8 | byte(2, c, k)) as i32;
            let want = if m > 0.0 {
                (f64::from(v) / f64::from(m) * 8388607.0).round()
            } else {
                0.0
            };
            assert!(
                (f64::from(q) - want).abs() <= 1.0,
                "chunk {c} value {k}: x24 {q}, want {want}"
            );
        }
    }
    // One x, two matrices: packed once. Then x rewritten: packed again, and used.
    let (a, b) = (
        Fixture::quant(Bits::Four, 40, 640, &mut rng),
        Fixture::quant(Bits::Four, 24, 640, &mut rng),
    );
    let (wa, wb) = (
        GpuMatrix::upload(ctx, &a.matrix(), "a").unwrap(),
        GpuMatrix::upload(ctx, &b.matrix(), "b").unwrap(),
    );
    let (x1, x2) = (rng.vec(640), rng.vec(640));
    let x = ctx.upload_f32(&[1, 640], &x1).unwrap();
    let (ya, yb) = (
        ctx.zeros(&[1, 40], DType::F32).unwrap(),
        ctx.zeros(&[1, 24], DType::F32).unwrap(),
    );
    ctx.flush().unwrap();
    let before = ctx.stats().dispatches;
    ctx.matmul(&wa, &x, &ya).unwrap();
    ctx.matmul(&wb, &x, &yb).unwrap();
    assert_eq!(
        ctx.stats().dispatches - before,
        3,
        "one pack and two products for two matrices of one x"
    );
    let (ta, tb) = (tolerance(&a, &x1), tolerance(&b, &x1));
    assert_close(
        "x24 reuse a",
        &ctx.download_f32(&ya).unwrap(),
        &cpu(&a, &x1),
        |i| ta[i],
    );
    assert_close(
        "x24 reuse b",
        &ctx.download_f32(&yb).unwrap(),
        &cpu(&b, &x1),
        |i| tb[i],
    );
    ctx.matmul(&wa, &x, &ya).unwrap();
    ctx.write_f32(&x, &x2).unwrap();
    ctx.matmul(&wb, &x, &yb).unwrap();
    let tb = tolerance(&b, &x2);
    assert_close(
        "x24 after a write to x",
        &ctx.download_f32(&yb).unwrap(),
        &cpu(&b, &x2),
        |i| tb[i],
    );
}

/// `qmatvec_x24`'s lanes give about 512 workgroups (the H200's best at every shape
/// timed), never more lanes than a row has words, 4 to 256.
#[test]
fn packed_x_tiling_aims_at_512_workgroups() {
    for (row_v, rows, lanes) in [
        (128, 4096, 128),
        (256, 8192, 64),
        (256, 16384, 32),
        (128, 8192, 64),
        (512, 4096, 128),
        (18, 49152, 8),
        (2, 64, 4),
        (512, 1, 256),
        (512, 1 << 20, 4),
    ] {
        assert_eq!(
            tuning::x24_lanes(row_v, rows),
            lanes,
            "{rows} rows of {row_v} words"
        );
    }
}

#[test]
fn float_products_match_cpu() {
    let Some(ctx) = gpu("float_products_match_cpu") else {
        return;
    };
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    for kind in ["bf16", "f16", "f32"] {
        // Odd widths put rows at half-word offsets; 65 columns cross a tile chunk.
        for (rows, cols, ns) in [
            (1, 1, &[1, 2][..]),
            (7, 33, &[1, 3]),
            (19, 65, &[1, 10]),
            (576, 576, &[1, 5]),
        ] {
            let f = Fixture::float(kind, rows, cols, &mut rng);
            for &n in ns {
                check_product(ctx, &f, n, &mut rng);
            }
        }
    }
    // A tied BF16 head at SmolLM2's vocabulary.
    let f = Fixture::float("bf16", 49152, 576, &mut rng);
    check_product(ctx, &f, 1, &mut rng);
}

#[test]
fn embedding_rows_match_cpu() {
    let Some(ctx) = gpu("embedding_rows_match_cpu") else {
        return;
    };
    let mut rng = Rng(7);
    let tables = [
        Fixture::quant(Bits::Four, 49152, 576, &mut rng),
        Fixture::quant(Bits::Eight, 5, 128, &mut rng),
        Fixture::quant_g(Bits::Three, Group::G128, 3, 256, &mut rng),
        Fixture::quant_g(Bits::Five, Group::G32, 2, 96, &mut rng),
        Fixture::quant_g(Bits::Six, Group::G64, 4, 192, &mut rng),
        Fixture::quant_g(Bits::Two, Group::G32, 2, 64, &mut rng),
        Fixture::float("bf16", 11, 9, &mut rng),
        Fixture::float("f16", 3, 5, &mut rng),
        Fixture::float("f32", 3, 5, &mut rng),
    ];
    for f in &tables {
        let m = f.matrix();
        let table = GpuMatrix::upload(ctx, &m, "embed").unwrap();
        let last = f.rows as u32 - 1;
        let tokens = [0, last, last / 2, 1.min(last)];
        let out = ctx.zeros(&[tokens.len(), f.cols], DType::F32).unwrap();
        ctx.embed(&table, &tokens, &out).unwrap();
        let got = ctx.download_f32(&out).unwrap();
        let mut want = vec![0f32; tokens.len() * f.cols];
        for (t, o) in tokens.iter().zip(want.chunks_exact_mut(f.cols)) {
            Cpu::new(1).row(&m, *t as usize, o);
        }
        let mag: Vec<f32> = tokens
            .iter()
            .flat_map(|&t| f.mag[t as usize * f.cols..(t as usize + 1) * f.cols].to_vec())
            .collect();
        assert_close(
            &format!("embed {} [{}x{}]", f.kind, f.rows, f.cols),
            &got,
            &want,
            |i| 1e-6 * mag[i],
        );
        let err = ctx.embed(&table, &[last + 1], &out).unwrap_err();
        assert!(err.to_string().contains("outside the table"), "{err}");
    }
}

// ---------------------------------------------------------------- norms, rope

#[test]
fn rms_norm_matches_cpu() {
    let Some(ctx) = gpu("rms_norm_matches_cpu") else {
        return;
    };
    let mut rng = Rng(11);
    for (n, d) in [(1, 1), (3, 64), (2, 511), (5, 576), (1, 1025)] {
        let x = rng.vec(n * d);
        let w = rng.vec(d);
        for plus_one in [false, true] {
            let weff: Vec<f32> = if plus_one {
                w.iter().map(|v| 1.0 + v).collect()
            } else {
                w.clone()
            };
            let mut want = vec![0f32; n * d];
            for (xr, o) in x.chunks_exact(d).zip(want.chunks_exact_mut(d)) {
                rms_norm(xr, &weff, 1e-5, o);
            }
            let (gx, gw) = (
                ctx.upload_f32(&[n, d], &x).unwrap(),
                ctx.upload_f32(&[d], &w).unwrap(),
            );
            let out = ctx.zeros(&[n, d], DType::F32).unwrap();
            ctx.rms_norm(&gx, &gw, 1e-5, plus_one, &out).unwrap();
            let got = ctx.download_f32(&out).unwrap();
            let scale: Vec<f32> = want
                .chunks_exact(d)
                .map(|r| r.iter().fold(0f32, |m, v| m.max(v.abs())))
                .collect();
            assert_close(
                &format!("rms_norm n={n} d={d} +1={plus_one}"),
                &got,
                &want,
                |i| 1e-5 * scale[i / d] + 1e-30,
            );
        }
    }
}

/// The CPU runner's RoPE (`Backend::rope` of `kernels/cpu`), extended to a
/// partial rotary width the way Hugging Face's partial RoPE does it: the first `rot`
/// dims are rotated in the rotate-half layout with `inv_freq_i = θ^(-2i/rot)`.
fn rope_ref(x: &mut [f32], head_dim: usize, rot: usize, theta: f64, pos: usize) {
    let half = rot / 2;
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| (1.0 / theta.powf(2.0 * i as f64 / rot as f64)) as f32)
        .collect();
    for head in x.chunks_exact_mut(head_dim) {
        let (a, b) = head[..rot].split_at_mut(half);
        for i in 0..half {
            let ang = pos as f32 * inv_freq[i];
            let (s, c) = ang.sin_cos();
            let (x1, x2) = (a[i], b[i]);
            a[i] = x1 * c - x2 * s;
            b[i] = x2 * c + x1 * s;
        }
    }
}

#[test]
fn rope_matches_cpu_full_and_partial() {
    let Some(ctx) = gpu("rope_matches_cpu_full_and_partial") else {
        return;
    };
    let mut rng = Rng(13);
    let positions = 5000;
    // SmolLM2 (head 64, θ 1e5), Qwen3 (head 128, θ 1e6), and a quarter-width partial.
    for (heads, head_dim, rot, theta) in [
        (9, 64, 64, 100_000.0),
        (3, 128, 128, 1_000_000.0),
        (2, 64, 16, 10_000.0),
    ] {
        let table = RopeTable::new(ctx, rot, theta, positions).unwrap();
        for (pos0, n) in [(0, 5), (4990, 3)] {
            let x = rng.vec(n * heads * head_dim);
            let mut want = x.clone();
            for (i, tok) in want.chunks_exact_mut(heads * head_dim).enumerate() {
                rope_ref(tok, head_dim, rot, theta, pos0 + i);
            }
            let gx = ctx.upload_f32(&[n, heads * head_dim], &x).unwrap();
            ctx.rope(&table, &gx, heads, head_dim, pos0).unwrap();
            let got = ctx.download_f32(&gx).unwrap();
            assert_close(
                &format!("rope heads={heads} head_dim={head_dim} rot={rot} pos0={pos0}"),
                &got,
                &want,
                |_| 1e-6 * 2.0,
            );
        }
        let gx = ctx.zeros(&[1, heads * head_dim], DType::F32).unwrap();
        assert!(ctx.rope(&table, &gx, heads, head_dim, positions).is_err());
    }
}

// ---------------------------------------------------------------- attention

/// The CPU runner's attention loop (`kernels/cpu` `attention`), over f32 caches.
#[allow(clippy::too_many_arguments)]
fn attention_ref(
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    n: usize,
    pos0: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
) -> Vec<f32> {
    let (qw, kvw) = (heads * hd, kv_heads * hd);
    let scale = 1.0 / (hd as f32).sqrt();
    let group = heads / kv_heads;
    let mut att = vec![0f32; n * qw];
    let mut scores = vec![0f32; pos0 + n];
    for i in 0..n {
        let upto = pos0 + i + 1;
        for hh in 0..heads {
            let kvh = hh / group;
            let qh = &q[i * qw + hh * hd..i * qw + (hh + 1) * hd];
            for (j, sc) in scores[..upto].iter_mut().enumerate() {
                let kj = &kc[j * kvw + kvh * hd..j * kvw + (kvh + 1) * hd];
                *sc = dot(qh, kj) * scale;
            }
            softmax_inplace(&mut scores[..upto]);
            let ah = &mut att[i * qw + hh * hd..i * qw + (hh + 1) * hd];
            for (j, &p) in scores[..upto].iter().enumerate() {
                axpy(p, &vc[j * kvw + kvh * hd..j * kvw + (kvh + 1) * hd], ah);
            }
        }
    }
    att
}

#[test]
fn attention_matches_cpu_prefill_then_decode() {
    let Some(ctx) = gpu("attention_matches_cpu_prefill_then_decode") else {
        return;
    };
    let mut rng = Rng(17);
    // SmolLM2's heads (9 query, 3 KV, width 64) and a Qwen3-like 4:1 group at 128.
    for (heads, kv_heads, hd) in [(9, 3, 64), (4, 1, 128)] {
        let kvw = kv_heads * hd;
        let cap = 160;
        let cache = KvCache::new(ctx, cap, AttentionSpec::dense(kv_heads, hd)).unwrap();
        let (mut kc, mut vc) = (Vec::new(), Vec::new());
        let mut pos = 0;
        // A prefill longer than one block of 64 keys, then decode steps, then a
        // second chunk of prefill.
        for n in [70, 1, 1, 13, 1] {
            let q = rng.vec(n * heads * hd);
            // Larger scores make the softmax peaked, so a wrong mask shows.
            let q: Vec<f32> = q.iter().map(|v| v * 3.0).collect();
            let k = rng.vec(n * kvw);
            let v = rng.vec(n * kvw);
            kc.extend_from_slice(&k);
            vc.extend_from_slice(&v);
            let want = attention_ref(&q, &kc, &vc, n, pos, heads, kv_heads, hd);
            let (gq, gk, gv) = (
                ctx.upload_f32(&[n, heads * hd], &q).unwrap(),
                ctx.upload_f32(&[n, kvw], &k).unwrap(),
                ctx.upload_f32(&[n, kvw], &v).unwrap(),
            );
            ctx.kv_append(&cache, &gk, &gv, pos).unwrap();
            let out = ctx.zeros(&[n, heads * hd], DType::F32).unwrap();
            let at = Causal {
                pos,
                heads,
                scale: 1.0 / (hd as f32).sqrt(),
            };
            ctx.attention(&gq, &cache, at, None, &out).unwrap();
            let got = ctx.download_f32(&out).unwrap();
            assert_close(
                &format!("attention heads={heads}/{kv_heads} hd={hd} pos0={pos} n={n}"),
                &got,
                &want,
                |_| 1e-5,
            );
            pos += n;
        }
        let q = ctx.zeros(&[cap, heads * hd], DType::F32).unwrap();
        let out = ctx.zeros(&[cap, heads * hd], DType::F32).unwrap();
        let at = Causal {
            pos: 1,
            heads,
            scale: 0.125,
        };
        assert!(ctx.attention(&q, &cache, at, None, &out).is_err());
    }
    // A long context: decode splits it into chunks of 96 positions (more than one
    // 64-key block each, the last one partial), combined across 22 workgroups.
    let (heads, kv_heads, hd, pos) = (2, 1, 64, 2100);
    assert_eq!(tuning::split_chunk(1, heads, pos + 1), Some(96));
    let cache = KvCache::new(ctx, pos + 1, AttentionSpec::dense(kv_heads, hd)).unwrap();
    let k = rng.vec((pos + 1) * hd);
    let v = rng.vec((pos + 1) * hd);
    let (gk, gv) = (
        ctx.upload_f32(&[pos + 1, hd], &k).unwrap(),
        ctx.upload_f32(&[pos + 1, hd], &v).unwrap(),
    );
    ctx.kv_append(&cache, &gk, &gv, 0).unwrap();
    let q: Vec<f32> = rng.vec(heads * hd).iter().map(|v| v * 3.0).collect();
    let want = attention_ref(&q, &k, &v, 1, pos, heads, kv_heads, hd);
    let gq = ctx.upload_f32(&[1, heads * hd], &q).unwrap();
    let out = ctx.zeros(&[1, heads * hd], DType::F32).unwrap();
    let at = Causal {
        pos,
        heads,
        scale: 1.0 / (hd as f32).sqrt(),
    };
    ctx.attention(&gq, &cache, at, None, &out).unwrap();
    let got = ctx.download_f32(&out).unwrap();
    assert_close("attention split over 2101 positions", &got, &want, |_| 1e-5);
}

#[test]
fn attention_spec_limits_are_errors() {
    let Some(ctx) = gpu("attention_spec_limits_are_errors") else {
        return;
    };
    let f32s = |shape: &[usize]| ctx.zeros(shape, DType::F32).unwrap();
    let spec = |qk_dim, v_dim, window| AttentionSpec {
        kv_heads: 1,
        qk_dim,
        v_dim,
        window,
        values_in_keys: false,
    };
    let e = KvCache::new(ctx, 4, spec(8, 8, Some(0)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("must be positive"), "{e}");
    let at = Causal {
        pos: 0,
        heads: 2,
        scale: 1.0,
    };
    // Past what a workgroup holds: the query in workgroup memory, the values in lanes.
    for (qk, v, what) in [
        (1025, 8, "query and key head width 1025 is not in 1..=1024"),
        (8, 513, "value head width 513 is not in 1..=512"),
    ] {
        let cache = KvCache::new(ctx, 4, spec(qk, v, None)).unwrap();
        let e = ctx
            .attention(&f32s(&[1, 2 * qk]), &cache, at, None, &f32s(&[1, 2 * v]))
            .unwrap_err()
            .to_string();
        assert!(e.contains(what), "{e}");
    }
    let cache = KvCache::new(ctx, 4, spec(8, 16, Some(2))).unwrap();
    let (q, out) = (f32s(&[1, 16]), f32s(&[1, 32]));
    let e = ctx
        .attention(&q, &cache, at, Some(&f32s(&[3])), &out)
        .unwrap_err()
        .to_string();
    assert!(e.contains("3 sinks for 2 query heads"), "{e}");
    // An output of the key width, and values of the key width.
    let e = ctx
        .attention(&q, &cache, at, None, &f32s(&[1, 16]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("out of 16 elements"), "{e}");
    let e = ctx
        .kv_append(&cache, &f32s(&[1, 8]), &f32s(&[1, 8]), 0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("v has 8 elements for 1 rows of 16"), "{e}");
    ctx.attention(&q, &cache, at, Some(&f32s(&[2])), &out)
        .unwrap();
    ctx.flush().unwrap();
}

// ---------------------------------------------------------------- element-wise

#[test]
fn swiglu_softmax_and_add_match_cpu() {
    let Some(ctx) = gpu("swiglu_softmax_and_add_match_cpu") else {
        return;
    };
    let mut rng = Rng(19);
    for n in [1, 1536, 1536 * 3 + 5] {
        let g: Vec<f32> = rng.vec(n).iter().map(|v| v * 12.0).collect();
        let u = rng.vec(n);
        let mut want = g.clone();
        silu_mul(&mut want, &u);
        let (gg, gu) = (
            ctx.upload_f32(&[n], &g).unwrap(),
            ctx.upload_f32(&[n], &u).unwrap(),
        );
        ctx.swiglu(&gg, &gu).unwrap();
        let got = ctx.download_f32(&gg).unwrap();
        assert_close(&format!("swiglu n={n}"), &got, &want, |i| {
            1e-5 * ((g[i] * u[i]).abs() + 1e-6)
        });
        ctx.add(&gg, &gu).unwrap();
        let sum = ctx.download_f32(&gg).unwrap();
        let want_sum: Vec<f32> = got.iter().zip(&u).map(|(a, b)| a + b).collect();
        assert_eq!(sum, want_sum, "add n={n}");
        assert!(ctx.add(&gg, &gg).is_err(), "an aliased add is refused");
    }
    for (rows, d) in [(1, 1), (3, 49152), (4, 300)] {
        let mut x: Vec<f32> = rng.vec(rows * d).iter().map(|v| v * 20.0).collect();
        if d == 300 {
            // Masked entries, and a fully masked row (left alone).
            x[5] = f32::NEG_INFINITY;
            x[299] = f32::NEG_INFINITY;
            x[2 * d..3 * d].fill(f32::NEG_INFINITY);
        }
        let mut want = x.clone();
        for r in want.chunks_exact_mut(d) {
            softmax_inplace(r);
        }
        let gx = ctx.upload_f32(&[rows, d], &x).unwrap();
        ctx.softmax(&gx, d).unwrap();
        let got = ctx.download_f32(&gx).unwrap();
        assert_close(&format!("softmax {rows}x{d}"), &got, &want, |i| {
            let r = i / d;
            let max = x[r * d..(r + 1) * d]
                .iter()
                .fold(f32::MIN, |m, v| m.max(*v));
            softmax_tol(x[i] - max, d) * want[i].abs()
        });
    }
}

/// Relative tolerance of one softmax output whose input sits `x_minus_max` below the
/// row maximum, in a row of `d`: the GPU's `exp` is specified to `3 + 2|x|` ulp (the
/// CPU's to about 1), and the two sums of `d` terms are added in different orders
/// (the CPU's sequentially), which we bound statistically by `4√d` ulp.
fn softmax_tol(x_minus_max: f32, d: usize) -> f32 {
    (8.0 + 2.0 * x_minus_max.abs() + 4.0 * (d as f32).sqrt()) * f32::EPSILON
}

/// The CPU runner's routing (`layers::moe` over `kernels/cpu`): softmax, a sort by
/// probability with ties to the lower id, the first k, optionally renormalised.
fn route_ref(logits: &[f32], k: usize, renorm: bool) -> (Vec<u32>, Vec<f32>) {
    let mut p = logits.to_vec();
    softmax_inplace(&mut p);
    let mut idx: Vec<usize> = (0..p.len()).collect();
    idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    let top = &idx[..k];
    let sum: f32 = top.iter().map(|&e| p[e]).sum();
    (
        top.iter().map(|&e| e as u32).collect(),
        top.iter()
            .map(|&e| if renorm { p[e] / sum } else { p[e] })
            .collect(),
    )
}

#[test]
fn router_topk_matches_cpu() {
    let Some(ctx) = gpu("router_topk_matches_cpu") else {
        return;
    };
    let mut rng = Rng(23);
    for (n, experts, k) in [(1, 1, 1), (5, 128, 8), (2, 60, 4), (3, 513, 10)] {
        let mut logits: Vec<f32> = rng.vec(n * experts).iter().map(|v| v * 4.0).collect();
        if experts > 8 {
            // Exact ties inside and across the top k: equal logits give equal
            // probabilities on both backends, and the lower id wins.
            logits[experts + 3] = 9.0;
            logits[experts + 1] = 9.0;
            logits[experts + 7] = 9.0;
            logits[2 * experts - 1] = 9.0;
        }
        for renorm in [false, true] {
            let g = ctx.upload_f32(&[n, experts], &logits).unwrap();
            let r = ctx.router_topk(&g, experts, k, renorm).unwrap();
            let ids = ctx.download_u32(&r.ids).unwrap();
            let wts = ctx.download_f32(&r.weights).unwrap();
            for t in 0..n {
                let (want_ids, want_w) =
                    route_ref(&logits[t * experts..(t + 1) * experts], k, renorm);
                let what = format!("router n={n} E={experts} k={k} renorm={renorm} token {t}");
                assert_eq!(&ids[t * k..(t + 1) * k], &want_ids[..], "{what}: ids");
                let row = &logits[t * experts..(t + 1) * experts];
                let max = row.iter().fold(f32::MIN, |m, v| m.max(*v));
                assert_close(&what, &wts[t * k..(t + 1) * k], &want_w, |i| {
                    let x = row[want_ids[i] as usize];
                    (softmax_tol(x - max, experts) + if renorm { softmax_tol(0.0, k) } else { 0.0 })
                        * want_w[i]
                });
            }
        }
    }
    // An all-equal row routes to the lowest ids.
    let g = ctx.upload_f32(&[1, 16], &[0.5; 16]).unwrap();
    let r = ctx.router_topk(&g, 16, 4, true).unwrap();
    assert_eq!(ctx.download_u32(&r.ids).unwrap(), vec![0, 1, 2, 3]);
}

// ---------------------------------------------------------------- experts

/// An expert pool of `experts` INT4 blobs `[gate; up; down]` laid out as the install
/// lays them out, with each blob's bytes.
fn pool_fixture(experts: usize, h: usize, i: usize, rng: &mut Rng) -> (ExpertPool, Vec<Vec<u8>>) {
    let shapes = [
        (ExpertPart::Gate, i, h),
        (ExpertPart::Up, i, h),
        (ExpertPart::Down, h, i),
    ];
    let mut parts = Vec::new();
    let mut offset = 0u64;
    for &(part, rows, cols) in &shapes {
        let q = Scheme::Int4G64.sizes(rows as u64, cols as u64, 2).unwrap();
        parts.push(BlobPart {
            part,
            rows: rows as u64,
            cols: cols as u64,
            offset,
            weights: q.weights,
            scales: q.scales,
            biases: q.biases,
            scheme: None,
        });
        offset += q.weights + q.scales + q.biases;
    }
    let stride = align_up(offset, PAGE).unwrap();
    let pool = ExpertPool {
        file: "experts/layer0.bin".into(),
        layer: 0,
        sidecar: None,
        experts: experts as u64,
        scheme: Scheme::Int4G64,
        dtype: Dtype::BF16,
        blob_bytes: offset,
        stride,
        parts,
        file_bytes: experts as u64 * stride,
    };
    assert!(
        pool.layout_errors().is_empty(),
        "{:?}",
        pool.layout_errors()
    );
    let blobs = (0..experts)
        .map(|_| {
            let mut blob = Vec::new();
            for &(_, rows, cols) in &shapes {
                let f = Fixture::quant(Bits::Four, rows, cols, rng);
                for p in &f.parts {
                    blob.extend_from_slice(p);
                }
            }
            blob
        })
        .collect();
    (pool, blobs)
}

/// The CPU runner's expert step (`layers::moe` over `kernels/cpu`): gather, gate and up,
/// SwiGLU, down, weighted add.
fn expert_ref(
    pool: &ExpertPool,
    blob: &[u8],
    x: &[f32],
    h: usize,
    toks: &[(usize, f32)],
    out: &mut [f32],
) {
    let cpu = Cpu::new(1);
    let [gate, up, down] = expert_matrices(pool, blob);
    let (m, inter) = (toks.len(), gate.rows());
    let mut xs = vec![0f32; m * h];
    for (r, &(t, _)) in toks.iter().enumerate() {
        xs[r * h..(r + 1) * h].copy_from_slice(&x[t * h..(t + 1) * h]);
    }
    let mut g = vec![0f32; m * inter];
    let mut u = vec![0f32; m * inter];
    cpu.matmul(&gate, &xs, m, &mut g);
    cpu.matmul(&up, &xs, m, &mut u);
    silu_mul(&mut g, &u);
    let mut d = vec![0f32; m * h];
    cpu.matmul(&down, &g, m, &mut d);
    for (r, &(t, w)) in toks.iter().enumerate() {
        axpy(w, &d[r * h..(r + 1) * h], &mut out[t * h..(t + 1) * h]);
    }
}

#[test]
fn moe_on_the_device_matches_cpu_routing_and_experts() {
    let Some(ctx) = gpu("moe_on_the_device_matches_cpu_routing_and_experts") else {
        return;
    };
    let mut rng = Rng(31);
    let (experts, h, inter, k) = (6, 128, 64, 3);
    let (pool, blobs) = pool_fixture(experts, h, inter, &mut rng);
    let stride = pool.stride as usize;
    let mut file = vec![0u8; experts * stride];
    for (e, b) in blobs.iter().enumerate() {
        file[e * stride..e * stride + b.len()].copy_from_slice(b);
    }
    let whole = ExpertSlots::whole_pool(ctx, &pool, &file).unwrap();
    let router = Fixture::quant(Bits::Eight, experts, h, &mut rng);
    let gr = GpuMatrix::upload(ctx, &router.matrix(), "router").unwrap();
    let cpu = Cpu::new(1);
    for renorm in [false, true] {
        let x = rng.vec(h);
        let gx = ctx.upload_f32(&[1, h], &x).unwrap();
        let out = ctx.upload_f32(&[h], &vec![GUARD; h]).unwrap();
        let mut bufs = Vec::new();
        let mut scratch = |len: usize| -> crate::runtime::kernels::gpu::Result<_> {
            let b = ctx.zeros(&[len], DType::F32)?.buf;
            bufs.push(b.clone());
            Ok(b)
        };
        let ran = ctx
            .moe_resident(&whole, &gr, &gx, k, renorm, &out, &mut scratch)
            .unwrap();
        assert!(ran, "the INT4 pool takes the fused kernels");
        let got = ctx.download_f32(&out).unwrap();
        // The CPU runner's path: route, then each chosen expert's FFN, weighted.
        let mut logits = vec![0f32; experts];
        cpu.matmul(&router.matrix(), &x, 1, &mut logits);
        let (ids, wts) = route_ref(&logits, k, renorm);
        let gpu_ids = ctx
            .download_u32(&GpuTensor::new(bufs[1].clone(), &[k], DType::U32))
            .unwrap();
        assert_eq!(
            gpu_ids, ids,
            "renorm={renorm}: the device routes as the host"
        );
        let mut want = vec![0f32; h];
        for (&e, &w) in ids.iter().zip(&wts) {
            expert_ref(&pool, &blobs[e as usize], &x, h, &[(0, w)], &mut want);
        }
        let max = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert_close(&format!("moe renorm={renorm}"), &got, &want, |_| 1e-4 * max);
    }
}

#[test]
fn expert_ffn_matches_cpu_and_slot_refills_are_ordered() {
    let Some(ctx) = gpu("expert_ffn_matches_cpu_and_slot_refills_are_ordered") else {
        return;
    };
    let mut rng = Rng(29);
    let (h, inter, n) = (128, 192, 4);
    let (pool, blobs) = pool_fixture(3, h, inter, &mut rng);
    let slots = ExpertSlots::new(ctx, &pool, 2).unwrap();
    let x = rng.vec(n * h);
    let gx = ctx.upload_f32(&[n, h], &x).unwrap();
    let out = ctx.zeros(&[n, h], DType::F32).unwrap();
    let mut want = vec![0f32; n * h];
    // Expert 2 in slot 1 for tokens 3 and 0; expert 0 in slot 0 for token 1 alone
    // (the matrix-vector path); then slot 0 refilled with expert 1 for three tokens
    // while the first slot-0 product is still only recorded.
    // (expert, slot, [(token, weight)])
    type Step<'a> = (usize, usize, &'a [(usize, f32)]);
    let steps: [Step; 3] = [
        (2, 1, &[(3, 0.7), (0, 0.25)]),
        (0, 0, &[(1, 0.5)]),
        (1, 0, &[(2, 0.125), (1, 0.5), (0, 1.0)]),
    ];
    for (expert, slot, toks) in steps {
        slots.fill(ctx, slot, &blobs[expert]).unwrap();
        let ids: Vec<u32> = toks.iter().map(|&(t, _)| t as u32).collect();
        let wts: Vec<f32> = toks.iter().map(|&(_, w)| w).collect();
        ctx.expert_ffn(&slots, slot, &gx, &ids, &wts, &out).unwrap();
        expert_ref(&pool, &blobs[expert], &x, h, toks, &mut want);
    }
    let got = ctx.download_f32(&out).unwrap();
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert_close("expert_ffn", &got, &want, |_| 1e-4 * scale);
    // Hostile routing lists are refused before anything is recorded.
    assert!(
        ctx.expert_ffn(&slots, 0, &gx, &[1, 1], &[1.0, 1.0], &out)
            .is_err()
    );
    assert!(
        ctx.expert_ffn(&slots, 0, &gx, &[n as u32], &[1.0], &out)
            .is_err()
    );
    assert!(ctx.expert_ffn(&slots, 2, &gx, &[0], &[1.0], &out).is_err());
    assert!(slots.fill(ctx, 0, &blobs[0][1..]).is_err());
}

// ---------------------------------------------------------------- errors

#[test]
fn bad_operands_are_errors_not_panics() {
    let Some(ctx) = gpu("bad_operands_are_errors_not_panics") else {
        return;
    };
    let mut rng = Rng(31);
    let f = Fixture::quant(Bits::Four, 8, 64, &mut rng);
    let w = GpuMatrix::upload(ctx, &f.matrix(), "w").unwrap();
    let x = ctx.zeros(&[65], DType::F32).unwrap();
    let y = ctx.zeros(&[8], DType::F32).unwrap();
    assert!(ctx.matmul(&w, &x, &y).is_err(), "x width");
    let x = ctx.zeros(&[64], DType::F32).unwrap();
    assert!(ctx.matmul(&w, &x, &x).is_err(), "aliased output");
    let ids = ctx.zeros(&[64], DType::U32).unwrap();
    assert!(ctx.matmul(&w, &ids, &y).is_err(), "u32 input");
    let short = Matrix::Quant {
        bits: 4,
        group: 64,
        weights: &f.parts[0][1..],
        scales: &f.parts[1],
        biases: &f.parts[2],
        rows: 8,
        cols: 64,
    };
    assert!(matches!(
        GpuMatrix::upload(ctx, &short, "bad"),
        Err(GpuError::Matrix(_))
    ));
    ctx.flush().unwrap();
}

#[test]
fn adapter_listing_names_the_backend() {
    let Some(ctx) = gpu("adapter_listing_names_the_backend") else {
        return;
    };
    let all = list_adapters();
    assert!(!all.is_empty());
    let a = ctx.adapter();
    assert!(
        ["Vulkan", "Metal", "Dx12"].contains(&a.backend.as_str()),
        "{a}"
    );
    assert!(a.max_storage_binding_bytes > 0 && a.max_buffer_bytes > 0);
    let err = GpuContext::new(&GpuOptions {
        adapter: Some("no such adapter".into()),
        ..Default::default()
    })
    .unwrap_err();
    assert!(err.to_string().contains(&a.name), "{err}");
}
