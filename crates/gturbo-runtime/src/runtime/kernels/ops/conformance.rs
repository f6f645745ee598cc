//! The [`Ops`] contract as a test: every op of a backend against the CPU's
//! [`Ops`] (the implementation the goldens check, `tests/it/flash_next.rs`) on
//! random inputs at awkward shapes: widths no workgroup divides, one row, several
//! streams and heads that are not powers of two, grouped heads, the conv's state
//! shifting by fewer rows than it holds and replaced by more, the real model's widths
//! (4 × 2560 residual, 16 × 128 GDN key heads and 48 × 128 value heads, 24 attention
//! heads of 256 over 2 KV heads, the indexer's 4 heads of 128), and the
//! indexed-attention cache through a prefill, decode steps and a rewind. Generic over
//! the backend: a device backend's tests call each group with their own backend.
//!
//! # Tolerances (what a backend may differ from the CPU by)
//! - `gather_cols`, `scatter_cols`, `hc_expand`, the conv state: exact (copies, or
//!   one product per element).
//! - `gather_rows`: exact; `scatter_add_rows`: `1e-6 · (|out| + |w·x|)`.
//! - `act`, `sigmoid_mul`, `scale_rows_sigmoid`, `clamped_swiglu`: `1e-5 · |cpu| + 1e-7` (`exp` differs
//!   between libraries; WGSL allows `3 + 2·|x|` ulp).
//! - `hc_mix`, `hc_inject`: `1e-6 · Σ |terms|` (same order of operations; a device may
//!   fuse a multiply-add).
//! - `norm_grouped`, `gated_norm`: `1e-5` of the piece's largest `|output|` (the core
//!   seam's RMSNorm bound).
//! - `ple_gate`: the gate's sum `g` within `1e-5 · Σ |key·qry| / √H`, carried through the
//!   signed square root (the largest change over that interval; it is steep near 0)
//!   and the sigmoid (slope ≤ 1/4), plus `1e-5` relative, times `|value|`.
//! - `causal_conv_silu`: `2e-6 · Σ |w·x|` (the silu's slope is below 1.1) plus the
//!   elementwise bound.
//! - `gdn_recurrence`: per token, `1e-5` of the row's largest `|core|` and, after each
//!   call, of the state's largest `|entry|` (the state carries every earlier token's
//!   rounding; the decay keeps it bounded).
//! - `indexer_scores`: per score `1e-5 · Σ_h Σ_e |q_he · key_be| / √d_i` (the pooled
//!   key's norm and rotation round like the core ops), and the selection
//!   (`torch.topk`'s tie rule on the host) identical to the CPU's: the inputs make
//!   runs of exactly-zero scores (one or two indexer heads: a block whose dots are all
//!   negative scores 0 on both), so the top-k boundary falls inside ties.
//! - `indexed_attention`: `1e-5` of the largest `|v|` (the core attention bound).

use crate::runtime::kernels::CpuAttnCache;
use crate::runtime::kernels::ops::{
    Act, ClampedGlu, ElementwiseOps, GateAct, GdnDims, HcDims, HyperConnectionOps, IndexerDims,
    LinearAttentionOps, NgramOps, Ops, SparseAttentionOps,
};
use crate::runtime::kernels::rope::inv_freq;
use crate::runtime::kernels::topk::select_blocks;
use crate::runtime::kernels::{Backend, Causal, Cpu, RopeLayout};
use crate::runtime::testing::Rng;

fn cpu() -> Cpu {
    Cpu::new(1)
}

fn up<B: Backend>(b: &B, x: &[f32]) -> B::Buf {
    b.upload(x).expect("upload")
}

fn down<B: Backend>(b: &B, x: &B::Buf) -> Vec<f32> {
    b.read(x).expect("read")
}

/// `|got − want| ≤ tol(i)` everywhere.
fn close(what: &str, got: &[f32], want: &[f32], tol: impl Fn(usize) -> f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let d = (g - w).abs();
        assert!(
            d <= tol(i),
            "{what}: element {i}: {g} vs the CPU's {w} (difference {d:e}, bound {:e})",
            tol(i)
        );
    }
}

fn elementwise_tol(want: &[f32]) -> impl Fn(usize) -> f32 + '_ {
    |i| 1e-5 * want[i].abs() + 1e-7
}

fn max_abs(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// The activations, gates, gathers and the hyper-connection's expand, mix and inject,
/// in three stages sharing one random stream.
pub(crate) fn elementwise<B: Ops>(b: &B) {
    let c = cpu();
    let mut rng = Rng(0x5eed_0001);
    activations_and_gates(b, &c, &mut rng);
    column_moves(b, &c, &mut rng);
    hyper_connection_mixes(b, &c, &mut rng);
    expert_rows(b, &c, &mut rng);
}

/// `act`, `sigmoid_mul`, `scale_rows_sigmoid`.
fn activations_and_gates<B: Ops>(b: &B, c: &Cpu, rng: &mut Rng) {
    // 1001 elements: no workgroup divides them; values to ±14 reach both sides of the
    // two-sided sigmoid and its flat tails.
    let x = rng.scaled(1001, 14.0);
    for act in [Act::SiluOver(4.0), Act::Sigmoid, Act::TwoSigmoidOver(3.0)] {
        let mut g = up(b, &x);
        b.act(&mut g, act).unwrap();
        let mut w = x.clone();
        c.act(&mut w, act).unwrap();
        close(
            &format!("act {act:?}"),
            &down(b, &g),
            &w,
            elementwise_tol(&w),
        );
    }
    let gate = rng.scaled(1001, 9.0);
    let mut g = up(b, &x);
    b.sigmoid_mul(&mut g, &up(b, &gate)).unwrap();
    let mut w = x.clone();
    c.sigmoid_mul(&mut w, &gate).unwrap();
    close("sigmoid_mul", &down(b, &g), &w, elementwise_tol(&w));
    // 7 rows of 143; and one row.
    for rows in [7, 1] {
        let x = rng.scaled(rows * 143, 3.0);
        let s = rng.scaled(rows, 6.0);
        let mut g = up(b, &x);
        b.scale_rows_sigmoid(&mut g, &up(b, &s)).unwrap();
        let mut w = x.clone();
        c.scale_rows_sigmoid(&mut w, &s).unwrap();
        close("scale_rows_sigmoid", &down(b, &g), &w, elementwise_tol(&w));
    }
}

/// `gather_cols` and `scatter_cols`.
fn column_moves<B: Ops>(b: &B, c: &Cpu, rng: &mut Rng) {
    // The attention's [query | gate] split per head, the indexer's [q | k] split.
    let x = rng.scaled(5 * 3 * 80, 1.0);
    for (width, cols) in [(80, 0..40), (80, 40..80), (240, 192..240), (240, 0..1)] {
        let n = x.len() / width;
        let mut g = b.zeros(n * cols.len()).unwrap();
        b.gather_cols(&up(b, &x), width, cols.clone(), &mut g)
            .unwrap();
        let mut w = vec![0f32; n * cols.len()];
        c.gather_cols(&x, width, cols.clone(), &mut w).unwrap();
        assert_eq!(down(b, &g), w, "gather_cols {width} {cols:?}");
    }
    // MLA's [nope | rope] heads: a copy (scale 1) and a scaled rope part.
    for (width, cols, scale) in [(48, 32..48, 1.0), (48, 0..32, 1.0), (48, 32..48, 0.875)] {
        let rows = 5 * 4;
        let src = rng.scaled(rows * cols.len(), 2.0);
        let base = rng.scaled(rows * width, 1.0);
        let mut g = up(b, &base);
        b.scatter_cols(&up(b, &src), scale, width, cols.clone(), &mut g)
            .unwrap();
        let mut w = base.clone();
        c.scatter_cols(&src, scale, width, cols.clone(), &mut w)
            .unwrap();
        assert_eq!(down(b, &g), w, "scatter_cols {width} {cols:?} {scale}");
        if scale == 1.0 {
            let mut back = vec![0f32; src.len()];
            c.gather_cols(&w, width, cols.clone(), &mut back).unwrap();
            assert_eq!(back, src, "scatter_cols then gather_cols");
        }
    }
}

/// What an expert composed from the ops needs: `clamped_swiglu` (gpt-oss's limits,
/// inputs past them on both sides), `gather_rows` (exact) and `scatter_add_rows`
/// (`1e-6 · (|out| + |w·x|)`: a device may fuse the multiply-add).
fn expert_rows<B: Ops>(b: &B, c: &Cpu, rng: &mut Rng) {
    let glu = ClampedGlu {
        alpha: 1.702,
        limit: 7.0,
    };
    let (gate, upv) = (rng.scaled(1001, 12.0), rng.scaled(1001, 12.0));
    let mut g = up(b, &gate);
    b.clamped_swiglu(&mut g, &up(b, &upv), glu).unwrap();
    let mut w = gate.clone();
    c.clamped_swiglu(&mut w, &upv, glu).unwrap();
    close("clamped_swiglu", &down(b, &g), &w, elementwise_tol(&w));
    // 9 rows of 37; rows picked out of order, one of them twice for the gather.
    let (width, x) = (37, rng.scaled(9 * 37, 2.0));
    let rows = [4usize, 0, 8, 4, 2];
    let mut g = b.zeros(rows.len() * width).unwrap();
    b.gather_rows(&up(b, &x), width, &rows, &mut g).unwrap();
    let mut w = vec![0f32; rows.len() * width];
    c.gather_rows(&x, width, &rows, &mut w).unwrap();
    assert_eq!(down(b, &g), w, "gather_rows");
    let routes = [(7usize, 0.25f32), (1, -1.5), (3, 0.75)];
    let src = rng.scaled(routes.len() * width, 2.0);
    let mut g = up(b, &x);
    b.scatter_add_rows(&up(b, &src), width, &routes, &mut g)
        .unwrap();
    let mut w = x.clone();
    c.scatter_add_rows(&src, width, &routes, &mut w).unwrap();
    let tol = |i: usize| 1e-6 * (x[i].abs() + (w[i] - x[i]).abs()) + 1e-7;
    close("scatter_add_rows", &down(b, &g), &w, tol);
}

/// The hyper-connection's expand, mix and inject.
fn hyper_connection_mixes<B: Ops>(b: &B, c: &Cpu, rng: &mut Rng) {
    for d in [
        HcDims {
            streams: 3,
            hidden: 72,
            lowrank: 0,
            eps: 1e-6,
        },
        HcDims {
            streams: 4,
            hidden: 2560,
            lowrank: 0,
            eps: 1e-6,
        },
    ] {
        let n = if d.hidden > 1000 { 2 } else { 5 };
        let (h, s, wd) = (d.hidden, d.streams, d.width());
        let e = rng.scaled(n * h, 2.0);
        let mut g = b.zeros(n * wd).unwrap();
        b.hc_expand(&up(b, &e), d, &mut g).unwrap();
        let mut w = vec![0f32; n * wd];
        c.hc_expand(&e, d, &mut w).unwrap();
        assert_eq!(down(b, &g), w, "hc_expand {s}x{h}");

        let mix: Vec<f32> = rng.scaled(n * wd, 1.0).iter().map(|v| v.abs()).collect();
        let xn = rng.scaled(n * wd, 3.0);
        let mut g = b.zeros(n * h).unwrap();
        b.hc_mix(&up(b, &mix), &up(b, &xn), d, &mut g).unwrap();
        let mut w = vec![0f32; n * h];
        c.hc_mix(&mix, &xn, d, &mut w).unwrap();
        let terms = |i: usize| {
            let (t, ch) = (i / h, i % h);
            (0..s)
                .map(|j| (mix[t * wd + j * h + ch] * xn[t * wd + j * h + ch]).abs())
                .sum::<f32>()
        };
        close(&format!("hc_mix {s}x{h}"), &down(b, &g), &w, |i| {
            1e-6 * terms(i) + 1e-30
        });

        let x = rng.scaled(n * wd, 3.0);
        let inject = rng.scaled(n * s, 2.0);
        let y = rng.scaled(n * h, 2.0);
        let mut g = up(b, &x);
        b.hc_inject(&mut g, &up(b, &inject), &up(b, &y), d).unwrap();
        let mut w = x.clone();
        c.hc_inject(&mut w, &inject, &y, d).unwrap();
        close(&format!("hc_inject {s}x{h}"), &down(b, &g), &w, |i| {
            let (t, j, ch) = (i / wd, i % wd / h, i % h);
            1e-6 * (x[i].abs() + (y[t * h + ch] * inject[t * s + j]).abs())
        });
    }
}

/// The grouped offset norm, the GDN's gated norm and the PLE gate.
pub(crate) fn norms<B: Ops>(b: &B) {
    let c = cpu();
    let mut rng = Rng(0x5eed_0002);
    // (rows, weight length, group): per-stream pieces of 72, the real 4 × 2560
    // residual, one group spanning the weight, one row.
    for (n, wd, group) in [
        (5, 216, 72),
        (2, 4 * 2560, 2560),
        (3, 100, 100),
        (1, 96, 32),
    ] {
        let x = rng.scaled(n * wd, 4.0);
        let w = rng.scaled(wd, 0.5);
        let mut g = b.zeros(n * wd).unwrap();
        b.norm_grouped(&up(b, &x), &up(b, &w), group, 1e-6, &mut g)
            .unwrap();
        let mut want = vec![0f32; n * wd];
        c.norm_grouped(&x, &w, group, 1e-6, &mut want).unwrap();
        let piece_max: Vec<f32> = want.chunks(group).map(max_abs).collect();
        close(
            &format!("norm_grouped {n}x{wd}/{group}"),
            &down(b, &g),
            &want,
            |i| 1e-5 * piece_max[i / group],
        );
    }
    for act in [GateAct::Sigmoid, GateAct::Silu] {
        // 18 heads of 40 (6 tokens × 3 value heads), and the real 48 heads of 128.
        for (n, d) in [(18, 40), (48, 128)] {
            let o = rng.scaled(n * d, 2.0);
            let z = rng.scaled(n * d, 5.0);
            let w = rng.scaled(d, 1.0);
            let mut g = b.zeros(n * d).unwrap();
            b.gated_norm(&up(b, &o), &up(b, &z), &up(b, &w), 1e-6, act, &mut g)
                .unwrap();
            let mut want = vec![0f32; n * d];
            c.gated_norm(&o, &z, &w, 1e-6, act, &mut want).unwrap();
            let piece_max: Vec<f32> = want.chunks(d).map(max_abs).collect();
            close(
                &format!("gated_norm {act:?} {n}x{d}"),
                &down(b, &g),
                &want,
                |i| 1e-5 * piece_max[i / d] + 1e-30,
            );
        }
    }
    for (t, s, h) in [(5, 3, 72), (2, 4, 2560), (1, 1, 64)] {
        let d = HcDims {
            streams: s,
            hidden: h,
            lowrank: 0,
            eps: 1e-6,
        };
        let wd = s * h;
        // Small keys make some gates' sums land near 0, where the signed root is steep.
        let key = rng.scaled(t * wd, 0.3);
        let qry = rng.scaled(t * wd, 1.0);
        let value = rng.scaled(t * h, 2.0);
        let mut g = b.zeros(t * wd).unwrap();
        b.ple_gate(&up(b, &key), &up(b, &qry), &up(b, &value), d, &mut g)
            .unwrap();
        let mut want = vec![0f32; t * wd];
        c.ple_gate(&key, &qry, &value, d, &mut want).unwrap();
        let signed_root = |g: f64| g.signum() * g.abs().max(1e-6).sqrt() * f64::from(g != 0.0);
        let bound: Vec<f32> = (0..t * s)
            .map(|piece| {
                let a = piece * h;
                let dot: f64 = (0..h)
                    .map(|i| f64::from(key[a + i]) * f64::from(qry[a + i]))
                    .sum();
                let mag: f64 = (0..h)
                    .map(|i| f64::from((key[a + i] * qry[a + i]).abs()))
                    .sum();
                let (g, e) = (dot / (h as f64).sqrt(), 1e-5 * mag / (h as f64).sqrt());
                let spread = signed_root(g + e) - signed_root(g - e);
                (0.25 * spread + 1e-5) as f32
            })
            .collect();
        close(&format!("ple_gate {t}x{s}x{h}"), &down(b, &g), &want, |i| {
            let (ti, piece) = (i / wd, i / h);
            bound[piece] * value[ti * h + i % h].abs() + 1e-30
        });
    }
}

/// The depthwise causal conv with its state: the GDN's (dilation 1) and the PLE's
/// (dilation 3), through calls of more, as many and fewer rows than the state holds.
pub(crate) fn conv<B: Ops>(b: &B) {
    let c = cpu();
    let mut rng = Rng(0x5eed_0003);
    for (ch, taps, dilation, steps) in [
        (432, 4, 1, &[7usize, 1, 2, 3, 1][..]),
        (216, 4, 3, &[12, 1, 9, 2, 1]),
        (64, 1, 1, &[3, 1]),
    ] {
        let w = rng.scaled(ch * taps, 0.7);
        let past = (taps - 1) * dilation;
        let (wb, mut sb) = (up(b, &w), b.zeros(past * ch).unwrap());
        let mut sc = vec![0f32; past * ch];
        for &n in steps {
            let x = rng.scaled(n * ch, 2.0);
            // Rows −past … n−1 of the sequence the call reads.
            let ext: Vec<f32> = sc.iter().chain(&x).copied().collect();
            let mut g = b.zeros(n * ch).unwrap();
            b.causal_conv_silu(&up(b, &x), &wb, taps, dilation, &mut sb, &mut g)
                .unwrap();
            let mut want = vec![0f32; n * ch];
            c.causal_conv_silu(&x, &w, taps, dilation, &mut sc, &mut want)
                .unwrap();
            let what = format!("causal_conv_silu C{ch} K{taps} D{dilation} n{n}");
            // Σ |w·x| over the taps.
            let mag = |i: usize| {
                let (t, j) = (i / ch, i % ch);
                (0..taps)
                    .map(|k| {
                        let r = t + past - (taps - 1 - k) * dilation;
                        (w[j * taps + k] * ext[r * ch + j]).abs()
                    })
                    .sum::<f32>()
            };
            close(&what, &down(b, &g), &want, |i| {
                2e-6 * mag(i) + 1e-5 * want[i].abs() + 1e-7
            });
            assert_eq!(down(b, &sb), sc, "{what}: state");
        }
    }
}

/// The gated delta rule, its state carried through several calls.
pub(crate) fn gdn<B: Ops>(b: &B) {
    let c = cpu();
    let mut rng = Rng(0x5eed_0004);
    let dims = |nk, dk, nv, dv| GdnDims {
        hidden: 0,
        key_heads: nk,
        key_dim: dk,
        value_heads: nv,
        value_dim: dv,
        conv_kernel: 4,
        eps: 1e-6,
        gate: GateAct::Sigmoid,
    };
    // Awkward widths, grouped value heads (3 per key head), then the real model's
    // 16 key heads of 128 and 48 value heads of 128.
    for (d, steps) in [
        (dims(2, 48, 6, 40), &[7usize, 1, 2, 1][..]),
        (dims(1, 64, 1, 64), &[1, 3]),
        (dims(16, 128, 48, 128), &[2, 1]),
    ] {
        let (nv, vd, ch) = (d.value_heads, d.value_heads * d.value_dim, d.channels());
        let a_log = rng.scaled(nv, 1.0);
        let dt_bias = rng.scaled(nv, 1.0);
        let (ga, gd) = (up(b, &a_log), up(b, &dt_bias));
        let mut gs = b.zeros(nv * d.key_dim * d.value_dim).unwrap();
        let mut cs = vec![0f32; nv * d.key_dim * d.value_dim];
        for &n in steps {
            let conv = rng.scaled(n * ch, 1.5);
            let bb = rng.scaled(n * nv, 4.0);
            // Some gate inputs past softplus's threshold of 20, some far below it.
            let aa: Vec<f32> = rng.scaled(n * nv, 8.0).iter().map(|v| v * 3.0).collect();
            let mut g = b.zeros(n * vd).unwrap();
            b.gdn_recurrence(
                &up(b, &conv),
                &up(b, &bb),
                &up(b, &aa),
                &ga,
                &gd,
                &d,
                &mut gs,
                &mut g,
            )
            .unwrap();
            let mut want = vec![0f32; n * vd];
            c.gdn_recurrence(&conv, &bb, &aa, &a_log, &dt_bias, &d, &mut cs, &mut want)
                .unwrap();
            let what = format!(
                "gdn_recurrence {}x{} / {}x{} n{n}",
                d.key_heads, d.key_dim, nv, d.value_dim
            );
            let row_max: Vec<f32> = want.chunks(vd).map(max_abs).collect();
            close(&what, &down(b, &g), &want, |i| {
                1e-5 * row_max[i / vd] + 1e-30
            });
            let smax = max_abs(&cs);
            close(&format!("{what}: state"), &down(b, &gs), &cs, |_| {
                1e-5 * smax + 1e-30
            });
        }
    }
}

/// One indexed-attention geometry and the calls made on it: `(pos, tokens)`.
struct AttnCase {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    indexer: IndexerDims,
    rot: usize,
    calls: &'static [(usize, usize)],
    /// Whether the inputs must put some query's top-k boundary inside a run of
    /// exactly-zero scores (one indexer head: about half the blocks score 0).
    zero_ties: bool,
}

/// The indexer's scores (and the host's selection from them) and the attention over
/// that selection, through a prefill, decode steps and a rewind that forgets cached
/// positions.
pub(crate) fn indexer<B: Ops>(b: &B) {
    let c = cpu();
    let mut rng = Rng(0x5eed_0005);
    let cases = [
        AttnCase {
            heads: 6,
            kv_heads: 2,
            head_dim: 40,
            indexer: IndexerDims {
                heads: 1,
                head_dim: 48,
                budget: 18,
                compress: 3,
            },
            rot: 16,
            calls: &[(0, 40), (40, 1), (41, 1), (42, 2), (44, 1), (43, 2)],
            zero_ties: true,
        },
        AttnCase {
            heads: 4,
            kv_heads: 4,
            head_dim: 64,
            indexer: IndexerDims {
                heads: 2,
                head_dim: 64,
                budget: 8,
                compress: 4,
            },
            rot: 64,
            calls: &[(0, 1), (1, 22), (23, 1), (24, 1)],
            zero_ties: false,
        },
        // The real model's heads: 24 of 256 over 2 KV heads, the indexer's 4 of 128.
        AttnCase {
            heads: 24,
            kv_heads: 2,
            head_dim: 256,
            indexer: IndexerDims {
                heads: 4,
                head_dim: 128,
                budget: 16,
                compress: 4,
            },
            rot: 64,
            calls: &[(0, 25), (25, 1)],
            zero_ties: false,
        },
    ];
    for case in &cases {
        indexer_case(b, &c, &mut rng, case);
    }
}

/// One [`AttnCase`] of [`indexer`]: its calls' block scores, selections and indexed
/// attention, GPU against CPU.
fn indexer_case<B: Ops>(b: &B, c: &Cpu, rng: &mut Rng, case: &AttnCase) {
    let ix = case.indexer;
    let (di, cr, kb) = (ix.head_dim, ix.compress, ix.block_topk());
    let (qw, kvw) = (case.heads * case.head_dim, case.kv_heads * case.head_dim);
    let freqs = inv_freq(1e4, case.rot);
    let (grope, crope) = (
        b.rope_table(&freqs, 0..64, RopeLayout::HalfSplit).unwrap(),
        c.rope_table(&freqs, 0..64, RopeLayout::HalfSplit).unwrap(),
    );
    let k_norm = rng.scaled(di, 0.3);
    let gk = up(b, &k_norm);
    let mut gcache = b.attn_cache(case.kv_heads, case.head_dim, ix).unwrap();
    let mut ccache: CpuAttnCache = c.attn_cache(case.kv_heads, case.head_dim, ix).unwrap();
    let mut boundary_ties = 0;
    for &(pos, n) in case.calls {
        let what = format!(
            "{}x{} heads, indexer {}x{di}/{cr}, {n} tokens at {pos}",
            case.heads, case.head_dim, ix.heads
        );
        let iq = rng.scaled(n * ix.heads * di, 1.0);
        let raw = rng.scaled(n * di, 1.0);
        let gs = b
            .indexer_scores(
                &mut gcache,
                &up(b, &iq),
                &up(b, &raw),
                &gk,
                1e-6,
                &grope,
                pos,
            )
            .unwrap();
        let cs = c
            .indexer_scores(&mut ccache, &iq, &raw, &k_norm, 1e-6, &crope, pos)
            .unwrap();
        assert_eq!(gs.len(), n, "{what}: score rows");
        let mut blocks = Vec::with_capacity(n);
        for (i, (g, w)) in gs.iter().zip(&cs).enumerate() {
            let q = &iq[i * ix.heads * di..(i + 1) * ix.heads * di];
            let keys = &ccache.block_keys;
            close(&format!("{what}: scores of token {i}"), g, w, |blk| {
                let mag: f32 = q
                    .chunks_exact(di)
                    .map(|qh| {
                        qh.iter()
                            .zip(&keys[blk * di..(blk + 1) * di])
                            .map(|(a, k)| (a * k).abs())
                            .sum::<f32>()
                    })
                    .sum();
                1e-5 * mag / (di as f32).sqrt() + 1e-30
            });
            let (gsel, csel) = (select_blocks(g, kb), select_blocks(w, kb));
            assert_eq!(gsel, csel, "{what}: token {i}'s selection (scores {w:?})");
            let zero_in = csel.iter().any(|&blk| w[blk] == 0.0);
            let zero_out = (0..w.len()).any(|blk| w[blk] == 0.0 && !csel.contains(&blk));
            boundary_ties += usize::from(zero_in && zero_out);
            blocks.push(csel);
        }
        let q = rng.scaled(n * qw, 1.0);
        let k = rng.scaled(n * kvw, 1.0);
        let v = rng.scaled(n * kvw, 2.0);
        let at = Causal {
            pos,
            heads: case.heads,
            scale: 1.0 / (case.head_dim as f32).sqrt(),
        };
        let mut g = b.zeros(n * qw).unwrap();
        b.indexed_attention(
            &mut gcache,
            &up(b, &q),
            &up(b, &k),
            &up(b, &v),
            at,
            &blocks,
            &mut g,
        )
        .unwrap();
        let mut want = vec![0f32; n * qw];
        c.indexed_attention(&mut ccache, &q, &k, &v, at, &blocks, &mut want)
            .unwrap();
        let vmax = max_abs(&ccache.v);
        close(&format!("{what}: attention"), &down(b, &g), &want, |_| {
            1e-5 * vmax
        });
    }
    if case.zero_ties {
        assert!(
            boundary_ties > 0,
            "no query's top-{kb} boundary fell inside zero scores: the tie case did not run"
        );
    }
}
