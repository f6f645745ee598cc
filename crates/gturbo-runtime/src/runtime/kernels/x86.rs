//! AVX2 + FMA (+ F16C for half floats) inner loops for x86-64, chosen at run time.
//!
//! Every entry point checks [`available`] itself before calling into the
//! `#[target_feature]` code, so no caller can reach an instruction the CPU lacks.
//! Loads go through [`ld8`]/[`ld32`], which slice first (bounds checked) and then read
//! unaligned from the slice's own pointer.

use super::{FloatDtype, Matrix, Prepared, bf16_at, quant_row_bytes};
use crate::format::mxfp4::GROUP as MXFP4_GROUP;
use crate::format::quant::GROUP;
use std::arch::x86_64::*;

/// Whether this CPU has AVX2, FMA and F16C (detection is cached by std).
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// `y = W x` over all rows of `w`.
#[allow(unsafe_code)]
pub(super) fn matvec(w: &Matrix, prep: &Prepared, y: &mut [f32]) {
    assert!(available(), "AVX2/FMA/F16C kernels on a CPU without them");
    // SAFETY: the CPU features `matvec_avx2` enables were detected at run time just above.
    unsafe { matvec_avx2(w, prep, y) }
}

/// `y = W x` for an MXFP4 matrix, `x` in natural order.
#[allow(unsafe_code)]
pub(super) fn matvec_mxfp4(w: &Matrix, x: &[f32], y: &mut [f32]) {
    assert!(available(), "AVX2/FMA/F16C kernels on a CPU without them");
    // SAFETY: the CPU features `matvec_mxfp4_avx2` enables were detected just above.
    unsafe { matvec_mxfp4_avx2(w, x, y) }
}

/// Twice the E2M1 value of each code, as int8 (all integers: {0, 1, 2, 3, 4, 6, 8,
/// 12} and their negatives): the byte shuffle's table. The group's scale is halved
/// to match.
const MXFP4_TWICE: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

#[target_feature(enable = "avx2,fma,f16c")]
fn matvec_mxfp4_avx2(w: &Matrix, x: &[f32], y: &mut [f32]) {
    let Matrix::Mxfp4 {
        weights,
        scales,
        cols,
        ..
    } = *w
    else {
        unreachable!("the MXFP4 loop of another matrix");
    };
    let (wr, sr) = (cols / 2, cols / MXFP4_GROUP);
    let table = ld16(&MXFP4_TWICE.map(|v| v as u8));
    let nib = _mm_set1_epi8(0x0f);
    for ((o, w), s) in y
        .iter_mut()
        .zip(weights.chunks_exact(wr))
        .zip(scales.chunks_exact(sr))
    {
        let mut row = _mm256_setzero_ps();
        for ((wg, &e), xg) in w.chunks_exact(16).zip(s).zip(x.chunks_exact(MXFP4_GROUP)) {
            // 16 bytes → 32 codes in element order (low nibble first), then twice
            // their values as int8 by table lookup.
            let b = ld16(wg);
            let lo = _mm_and_si128(b, nib);
            let hi = _mm_and_si128(_mm_srli_epi16::<4>(b), nib);
            let v0 = _mm_shuffle_epi8(table, _mm_unpacklo_epi8(lo, hi));
            let v1 = _mm_shuffle_epi8(table, _mm_unpackhi_epi8(lo, hi));
            let f = widen8;
            let mut acc = _mm256_mul_ps(f(v0), ld8(xg));
            acc = _mm256_fmadd_ps(f(_mm_srli_si128::<8>(v0)), ld8(&xg[8..]), acc);
            acc = _mm256_fmadd_ps(f(v1), ld8(&xg[16..]), acc);
            acc = _mm256_fmadd_ps(f(_mm_srli_si128::<8>(v1)), ld8(&xg[24..]), acc);
            // 2^(e − 127) / 2: exact (the smallest, 2^−128, is an f32 subnormal).
            let scale = _mm256_set1_ps(crate::format::mxfp4::scale(e) * 0.5);
            row = _mm256_fmadd_ps(acc, scale, row);
        }
        *o = hsum(row);
    }
}

/// The low eight int8 lanes of `v` as f32.
#[inline]
#[target_feature(enable = "avx2")]
fn widen8(v: __m128i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
}

/// One row of `w` (a one-row matrix) in the order [`Prepared`] puts the input in:
/// permuted for quantized matrices, natural for float ones.
#[allow(unsafe_code)]
pub(super) fn row_prepared(w: &Matrix, out: &mut [f32]) {
    assert!(available(), "AVX2/FMA/F16C kernels on a CPU without them");
    // SAFETY: the CPU features `row_prepared_avx2` enables were detected just above.
    unsafe { row_prepared_avx2(w, out) }
}

/// `Σ a[i]·b[i]` (lengths equal, checked by the caller).
#[allow(unsafe_code)]
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert!(available(), "AVX2/FMA/F16C kernels on a CPU without them");
    // SAFETY: the CPU features `dot_avx2` enables were detected just above.
    unsafe { dot_avx2(a, b) }
}

/// Four dot products sharing the loads of `a`: `Σ a·b_j` for `j` in 0..4.
#[allow(unsafe_code)]
pub(super) fn dot4(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
    assert!(available(), "AVX2/FMA/F16C kernels on a CPU without them");
    // SAFETY: the CPU features `dot4_avx2` enables were detected just above.
    unsafe { dot4_avx2(a, b) }
}

/// `yt[r·n + j] = row r · x_j` for INT4 rows and int8-prepared inputs (`n` =
/// `preps.len()`).
#[allow(unsafe_code)]
pub(super) fn matmul_q8(w: &Matrix, preps: &[Prepared], yt: &mut [f32]) {
    assert!(available(), "AVX2/FMA/F16C kernels on a CPU without them");
    // SAFETY: the CPU features `matmul_q8_avx2` enables were detected just above.
    unsafe { matmul_q8_avx2(w, preps, yt) }
}

/// Eight floats from the start of `x` (panics if shorter).
#[inline]
#[target_feature(enable = "avx2")]
#[allow(unsafe_code)]
fn ld8(x: &[f32]) -> __m256 {
    let x = &x[..8];
    // SAFETY: `x` holds 8 floats (sliced above); the load is unaligned.
    unsafe { _mm256_loadu_ps(x.as_ptr()) }
}

/// 32 bytes from the start of `b` (panics if shorter).
#[inline]
#[target_feature(enable = "avx2")]
#[allow(unsafe_code)]
fn ld32(b: &[u8]) -> __m256i {
    let b = &b[..32];
    // SAFETY: `b` holds 32 bytes (sliced above); the load is unaligned.
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

/// 16 bytes from the start of `b` (panics if shorter).
#[inline]
#[target_feature(enable = "avx2")]
#[allow(unsafe_code)]
fn ld16(b: &[u8]) -> __m128i {
    let b = &b[..16];
    // SAFETY: `b` holds 16 bytes (sliced above); the load is unaligned.
    unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
}

/// Store eight floats at the start of `out` (panics if shorter).
#[inline]
#[target_feature(enable = "avx2")]
#[allow(unsafe_code)]
fn st8(out: &mut [f32], v: __m256) {
    let out = &mut out[..8];
    // SAFETY: `out` holds 8 floats (sliced above); the store is unaligned.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) }
}

#[inline]
#[target_feature(enable = "avx2")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn matvec_avx2(w: &Matrix, prep: &Prepared, y: &mut [f32]) {
    match *w {
        Matrix::Quant {
            bits,
            weights,
            scales,
            biases,
            cols,
            ..
        } => {
            let (wrow, srow) = quant_row_bytes(bits, GROUP, cols);
            let rows = y
                .iter_mut()
                .zip(weights.chunks_exact(wrow))
                .zip(scales.chunks_exact(srow))
                .zip(biases.chunks_exact(srow));
            if !prep.q8.is_empty() {
                for (((o, wr), sr), br) in rows {
                    *o = q4_row_q8(wr, sr, br, prep);
                }
                return;
            }
            let (px, gs) = (&prep.x[..cols], &prep.group_sums[..cols / GROUP]);
            if bits == 4 {
                for (((o, wr), sr), br) in rows {
                    *o = quant_row::<4>(wr, sr, br, px, gs);
                }
            } else {
                for (((o, wr), sr), br) in rows {
                    *o = quant_row::<8>(wr, sr, br, px, gs);
                }
            }
        }
        // Routed to their own loops before reaching here (`Cpu::matvec_rows`,
        // `Cpu::row_prepared`).
        Matrix::Mxfp4 { .. } => unreachable!("MXFP4 has its own loop"),
        Matrix::Float {
            dtype: FloatDtype::Bf16,
            data,
            cols,
            ..
        } => {
            for (o, r) in y.iter_mut().zip(data.chunks_exact(cols * 2)) {
                *o = bf16_row(r, &prep.x);
            }
        }
        Matrix::Float {
            dtype: FloatDtype::F16,
            data,
            cols,
            ..
        } => {
            for (o, r) in y.iter_mut().zip(data.chunks_exact(cols * 2)) {
                *o = f16_row(r, &prep.x);
            }
        }
        Matrix::Float {
            dtype: FloatDtype::F32,
            data,
            cols,
            ..
        } => {
            for (o, r) in y.iter_mut().zip(data.chunks_exact(cols * 4)) {
                *o = f32_row(r, &prep.x);
            }
        }
    }
}

/// One quantized row against the permuted input: for each group, the codes of the
/// eight u32 words sit in the eight lanes; `BITS` shifts walk through them.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn quant_row<const BITS: i32>(w: &[u8], s: &[u8], b: &[u8], px: &[f32], gsum: &[f32]) -> f32 {
    let mask = _mm256_set1_epi32((1 << BITS) - 1);
    let gbytes = 8 * BITS as usize;
    let steps = (32 / BITS) as usize;
    let mut total = _mm256_setzero_ps();
    let mut btotal = 0.0f32;
    for ((((wg, xg), sg), bg), gs) in w
        .chunks_exact(gbytes)
        .zip(px.chunks_exact(GROUP))
        .zip(s.chunks_exact(2))
        .zip(b.chunks_exact(2))
        .zip(gsum)
    {
        let mut a0 = _mm256_setzero_ps();
        let mut a1 = _mm256_setzero_ps();
        for (wb, xb) in wg.chunks_exact(32).zip(xg.chunks_exact(8 * steps)) {
            let mut v = ld32(wb);
            for k in (0..steps).step_by(2) {
                let q0 = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask));
                v = _mm256_srli_epi32::<BITS>(v);
                let q1 = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask));
                v = _mm256_srli_epi32::<BITS>(v);
                a0 = _mm256_fmadd_ps(q0, ld8(&xb[8 * k..]), a0);
                a1 = _mm256_fmadd_ps(q1, ld8(&xb[8 * k + 8..]), a1);
            }
        }
        let scale = _mm256_set1_ps(bf16_at(sg, 0));
        total = _mm256_fmadd_ps(_mm256_add_ps(a0, a1), scale, total);
        btotal += bf16_at(bg, 0) * gs;
    }
    hsum(total) + btotal
}

/// One INT4 row against int8 activations: low and high nibbles times the even and odd
/// activations with `maddubs` (pairs of u8·i8 into i16, at most 2·15·127 per pair, so
/// no saturation), widened to i32 with `madd`; the group's integer sums are exact in
/// f32 (< 2^24) and scaled by `s·d`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn q4_row_q8(w: &[u8], s: &[u8], b: &[u8], prep: &Prepared) -> f32 {
    let m4 = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    let mut btotal = 0.0f32;
    for (((((wg, xg), sg), bg), d), gs) in w
        .chunks_exact(32)
        .zip(prep.q8.chunks_exact(GROUP))
        .zip(s.chunks_exact(2))
        .zip(b.chunks_exact(2))
        .zip(&prep.q8_scale)
        .zip(&prep.group_sums)
    {
        let v = ld32(wg);
        let lo = _mm256_and_si256(v, m4);
        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
        let p = _mm256_add_epi16(
            _mm256_maddubs_epi16(lo, ld32(xg)),
            _mm256_maddubs_epi16(hi, ld32(&xg[32..])),
        );
        let sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
        acc = _mm256_fmadd_ps(sums, _mm256_set1_ps(bf16_at(sg, 0) * d), acc);
        btotal += bf16_at(bg, 0) * gs;
    }
    hsum(acc) + btotal
}

#[target_feature(enable = "avx2,fma")]
fn matmul_q8_avx2(w: &Matrix, preps: &[Prepared], yt: &mut [f32]) {
    let Matrix::Quant {
        weights,
        scales,
        biases,
        cols,
        ..
    } = *w
    else {
        unreachable!("int8 matmul of a float matrix");
    };
    let (wrow, srow) = quant_row_bytes(4, GROUP, cols);
    for (((out, wr), sr), br) in yt
        .chunks_exact_mut(preps.len())
        .zip(weights.chunks_exact(wrow))
        .zip(scales.chunks_exact(srow))
        .zip(biases.chunks_exact(srow))
    {
        let mut oc = out.chunks_exact_mut(4);
        let mut pc = preps.chunks_exact(4);
        for (o, p) in (&mut oc).zip(&mut pc) {
            o.copy_from_slice(&q4_row_q8x4(wr, sr, br, [&p[0], &p[1], &p[2], &p[3]]));
        }
        for (o, p) in oc.into_remainder().iter_mut().zip(pc.remainder()) {
            *o = q4_row_q8(wr, sr, br, p);
        }
    }
}

/// [`q4_row_q8`] for four inputs at once, unpacking each group's codes once.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn q4_row_q8x4(w: &[u8], s: &[u8], b: &[u8], p: [&Prepared; 4]) -> [f32; 4] {
    let m4 = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let groups = w.len() / 32;
    let q8 = p.map(|p| &p.q8[..groups * GROUP]);
    let d = p.map(|p| &p.q8_scale[..groups]);
    let gs = p.map(|p| &p.group_sums[..groups]);
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut bt = [0.0f32; 4];
    for (g, ((wg, sg), bg)) in w
        .chunks_exact(32)
        .zip(s.chunks_exact(2))
        .zip(b.chunks_exact(2))
        .enumerate()
    {
        let v = ld32(wg);
        let lo = _mm256_and_si256(v, m4);
        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
        let (scale, bias) = (bf16_at(sg, 0), bf16_at(bg, 0));
        for j in 0..4 {
            let xg = &q8[j][g * GROUP..];
            let prod = _mm256_add_epi16(
                _mm256_maddubs_epi16(lo, ld32(xg)),
                _mm256_maddubs_epi16(hi, ld32(&xg[32..])),
            );
            let sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones));
            acc[j] = _mm256_fmadd_ps(sums, _mm256_set1_ps(scale * d[j][g]), acc[j]);
            bt[j] += bias * gs[j][g];
        }
    }
    [0, 1, 2, 3].map(|j| hsum(acc[j]) + bt[j])
}

/// A BF16 row against `x`, 32 elements per step, scalar tail.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn bf16_row(r: &[u8], x: &[f32]) -> f32 {
    let widen = |b: &[u8]| -> __m256 {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(ld16(b))))
    };
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut rc = r.chunks_exact(64);
    let mut xc = x.chunks_exact(32);
    for (rb, xb) in (&mut rc).zip(&mut xc) {
        for (j, a) in acc.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(widen(&rb[16 * j..]), ld8(&xb[8 * j..]), *a);
        }
    }
    let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let tail = rc.remainder();
    let mut s = hsum(sum);
    for (i, x) in xc.remainder().iter().enumerate() {
        s += bf16_at(tail, i) * x;
    }
    s
}

/// An F16 row against `x`, 32 elements per step, scalar tail.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_row(r: &[u8], x: &[f32]) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut rc = r.chunks_exact(64);
    let mut xc = x.chunks_exact(32);
    for (rb, xb) in (&mut rc).zip(&mut xc) {
        for (j, a) in acc.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(_mm256_cvtph_ps(ld16(&rb[16 * j..])), ld8(&xb[8 * j..]), *a);
        }
    }
    let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut s = hsum(sum);
    for (b, x) in rc.remainder().chunks_exact(2).zip(xc.remainder()) {
        s += half::f16::from_le_bytes([b[0], b[1]]).to_f32() * x;
    }
    s
}

/// An f32 row (as bytes, any alignment) against `x`, 32 elements per step.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn f32_row(r: &[u8], x: &[f32]) -> f32 {
    let load = |b: &[u8]| _mm256_castsi256_ps(ld32(b));
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut rc = r.chunks_exact(128);
    let mut xc = x.chunks_exact(32);
    for (rb, xb) in (&mut rc).zip(&mut xc) {
        for (j, a) in acc.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(load(&rb[32 * j..]), ld8(&xb[8 * j..]), *a);
        }
    }
    let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut s = hsum(sum);
    for (b, x) in rc.remainder().chunks_exact(4).zip(xc.remainder()) {
        s += f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * x;
    }
    s
}

#[target_feature(enable = "avx2,fma,f16c")]
fn row_prepared_avx2(w: &Matrix, out: &mut [f32]) {
    match *w {
        Matrix::Quant {
            bits,
            weights,
            scales,
            biases,
            ..
        } => {
            if bits == 4 {
                dequant_permuted::<4>(weights, scales, biases, out)
            } else {
                dequant_permuted::<8>(weights, scales, biases, out)
            }
        }
        // Routed to their own loops before reaching here (`Cpu::matvec_rows`,
        // `Cpu::row_prepared`).
        Matrix::Mxfp4 { .. } => unreachable!("MXFP4 has its own loop"),
        Matrix::Float {
            dtype: FloatDtype::Bf16,
            data,
            ..
        } => {
            let mut oc = out.chunks_exact_mut(8);
            let mut dc = data.chunks_exact(16);
            for (o, d) in (&mut oc).zip(&mut dc) {
                let v = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(ld16(d)));
                st8(o, _mm256_castsi256_ps(v));
            }
            let tail = dc.remainder();
            for (i, o) in oc.into_remainder().iter_mut().enumerate() {
                *o = bf16_at(tail, i);
            }
        }
        Matrix::Float {
            dtype: FloatDtype::F16,
            data,
            ..
        } => {
            let mut oc = out.chunks_exact_mut(8);
            let mut dc = data.chunks_exact(16);
            for (o, d) in (&mut oc).zip(&mut dc) {
                st8(o, _mm256_cvtph_ps(ld16(d)));
            }
            for (o, b) in oc
                .into_remainder()
                .iter_mut()
                .zip(dc.remainder().chunks_exact(2))
            {
                *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        Matrix::Float {
            dtype: FloatDtype::F32,
            data,
            ..
        } => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
    }
}

/// Dequantize one row into the permuted order of [`Prepared`]: `s·q + b` per lane.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn dequant_permuted<const BITS: i32>(w: &[u8], s: &[u8], b: &[u8], out: &mut [f32]) {
    let mask = _mm256_set1_epi32((1 << BITS) - 1);
    let gbytes = 8 * BITS as usize;
    let steps = (32 / BITS) as usize;
    for (((wg, og), sg), bg) in w
        .chunks_exact(gbytes)
        .zip(out.chunks_exact_mut(GROUP))
        .zip(s.chunks_exact(2))
        .zip(b.chunks_exact(2))
    {
        let scale = _mm256_set1_ps(bf16_at(sg, 0));
        let bias = _mm256_set1_ps(bf16_at(bg, 0));
        for (wb, ob) in wg.chunks_exact(32).zip(og.chunks_exact_mut(8 * steps)) {
            let mut v = ld32(wb);
            for k in 0..steps {
                let q = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask));
                v = _mm256_srli_epi32::<BITS>(v);
                // Multiply then add (no fusion) so the values equal the reference
                // dequantization `scale * q + bias` bit for bit.
                st8(
                    &mut ob[8 * k..],
                    _mm256_add_ps(_mm256_mul_ps(q, scale), bias),
                );
            }
        }
    }
}

#[target_feature(enable = "avx2,fma")]
fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut ac = a.chunks_exact(32);
    let mut bc = b.chunks_exact(32);
    for (x, y) in (&mut ac).zip(&mut bc) {
        for (j, s) in acc.iter_mut().enumerate() {
            *s = _mm256_fmadd_ps(ld8(&x[8 * j..]), ld8(&y[8 * j..]), *s);
        }
    }
    let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut s = hsum(sum);
    for (x, y) in ac.remainder().iter().zip(bc.remainder()) {
        s += x * y;
    }
    s
}

#[target_feature(enable = "avx2,fma")]
fn dot4_avx2(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
    let n = a.len();
    let b = b.map(|v| &v[..n]);
    let mut acc = [_mm256_setzero_ps(); 4];
    let full = n / 8 * 8;
    for i in (0..full).step_by(8) {
        let x = ld8(&a[i..]);
        for (s, v) in acc.iter_mut().zip(b) {
            *s = _mm256_fmadd_ps(x, ld8(&v[i..]), *s);
        }
    }
    let mut out = [0.0f32; 4];
    for ((o, s), v) in out.iter_mut().zip(acc).zip(b) {
        *o = hsum(s);
        for (x, y) in a[full..].iter().zip(&v[full..]) {
            *o += x * y;
        }
    }
    out
}
