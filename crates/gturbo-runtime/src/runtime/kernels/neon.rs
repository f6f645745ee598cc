//! NEON inner loops for aarch64 (Apple silicon, Graviton, Ampere), chosen at run time,
//! with the dot-product instruction (`sdot`, FEAT_DotProd: every Apple M chip) for the
//! INT4 × int8 loop where the CPU has it.
//!
//! NEON itself is part of the aarch64 baseline, but std only lets a function use its
//! intrinsics under `#[target_feature(enable = "neon")]`; every entry point checks
//! [`available`] (and [`dotprod`] before the `sdot` loop) before calling such a
//! function, so no caller can reach an instruction the CPU lacks. Loads go through
//! [`ld4`]/[`ld16`], which slice first (bounds checked) and then read unaligned from the
//! slice's own pointer.
//!
//! Same data layouts as the AVX2 loops: the permuted input [`Prepared`] makes (eight
//! u32 words' codes, slot by slot) is read as two halves of four lanes, and the int8
//! activations as their even and odd halves. The INT4 × int8 sum of a group is an exact
//! integer on every path, and is scaled as the portable loop scales it, so the int8
//! path gives the portable loop's bits; the f32 paths differ from it by summation order
//! only (the kernel tests hold every path to the same bound).

use std::arch::aarch64::*;
use std::arch::asm;

use super::{FloatDtype, Matrix, Prepared, bf16_at, portable, quant_row_bytes};
use crate::format::quant::GROUP;

/// Whether this CPU has NEON (Advanced SIMD; detection is cached by std).
pub(super) fn available() -> bool {
    std::arch::is_aarch64_feature_detected!("neon")
}

/// Whether this CPU has the 8-bit dot-product instructions (`sdot`).
pub(super) fn dotprod() -> bool {
    available() && std::arch::is_aarch64_feature_detected!("dotprod")
}

/// `y = W x` over all rows of `w`.
#[allow(unsafe_code)]
pub(super) fn matvec(w: &Matrix, prep: &Prepared, y: &mut [f32]) {
    assert!(available(), "NEON kernels on a CPU without NEON");
    if let Matrix::Float {
        dtype: FloatDtype::F16,
        ..
    } = *w
    {
        // std's f16 vector conversions are not stable yet: half floats take the
        // portable loop (the compiler vectorises its f32 part).
        return portable::matvec(w, prep, y);
    }
    let sdot = dotprod();
    // SAFETY: NEON was detected just above, and `sdot` says whether the dot-product
    // instructions were.
    unsafe { matvec_neon(w, prep, y, sdot) }
}

/// `Σ a[i]·b[i]` (lengths equal, checked by the caller).
#[allow(unsafe_code)]
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert!(available(), "NEON kernels on a CPU without NEON");
    // SAFETY: NEON was detected just above.
    unsafe { dot_neon(a, b) }
}

/// Four dot products sharing the loads of `a`: `Σ a·b_j` for `j` in 0..4.
#[allow(unsafe_code)]
pub(super) fn dot4(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
    assert!(available(), "NEON kernels on a CPU without NEON");
    // SAFETY: NEON was detected just above.
    unsafe { dot4_neon(a, b) }
}

/// `yt[r·n + j] = row r · x_j` for INT4 rows and int8-prepared inputs (`n` =
/// `preps.len()`).
#[allow(unsafe_code)]
pub(super) fn matmul_q8(w: &Matrix, preps: &[Prepared], yt: &mut [f32]) {
    assert!(available(), "NEON kernels on a CPU without NEON");
    let sdot = dotprod();
    // SAFETY: NEON was detected just above; `sdot` says whether `sdot` was.
    unsafe { matmul_q8_neon(w, preps, yt, sdot) }
}

/// Four floats from the start of `x` (panics if shorter).
#[inline]
#[allow(unsafe_code)]
#[target_feature(enable = "neon")]
fn ld4(x: &[f32]) -> float32x4_t {
    let x = &x[..4];
    // SAFETY: `x` holds 4 floats (sliced above); the load is unaligned.
    unsafe { vld1q_f32(x.as_ptr()) }
}

/// Sixteen bytes from the start of `b` (panics if shorter).
#[inline]
#[allow(unsafe_code)]
#[target_feature(enable = "neon")]
fn ld16(b: &[u8]) -> uint8x16_t {
    let b = &b[..16];
    // SAFETY: `b` holds 16 bytes (sliced above); the load is unaligned.
    unsafe { vld1q_u8(b.as_ptr()) }
}

/// Eight u16 from the start of `b` (16 bytes, little-endian), panics if shorter.
#[inline]
#[target_feature(enable = "neon")]
fn ld8_u16(b: &[u8]) -> uint16x8_t {
    vreinterpretq_u16_u8(ld16(b))
}

/// `acc + Σ_4 a·b` per i32 lane: the `sdot` instruction. Written in `asm!` because
/// std's `vdotq_s32` is not stable yet (rust-lang/rust#117224); the instruction reads
/// and writes registers only.
#[inline]
#[allow(unsafe_code)]
#[target_feature(enable = "neon,dotprod")]
fn sdot(mut acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    // SAFETY: FEAT_DotProd is enabled for this function (callers detected it); the
    // instruction touches no memory and no flags.
    unsafe {
        asm!(
            "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    acc
}

/// `acc + Σ_4 a·b` per i32 lane without `sdot`: widening multiplies (two products per
/// i16 lane, at most 2·15·127 for nibble codes) added pairwise into i32.
#[inline]
#[target_feature(enable = "neon")]
fn dot_widen(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let p = vmull_s8(vget_low_s8(a), vget_low_s8(b));
    let p = vmlal_high_s8(p, a, b);
    vpadalq_s16(acc, p)
}

#[target_feature(enable = "neon")]
fn matvec_neon(w: &Matrix, prep: &Prepared, y: &mut [f32], sdot: bool) {
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
                    *o = q4_row_q8(wr, sr, br, prep, sdot);
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
        // Routed to its own loop before reaching here (`Cpu::matvec_rows`).
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
            dtype: FloatDtype::F32,
            data,
            cols,
            ..
        } => {
            for (o, r) in y.iter_mut().zip(data.chunks_exact(cols * 4)) {
                *o = f32_row(r, &prep.x);
            }
        }
        Matrix::Float {
            dtype: FloatDtype::F16,
            ..
        } => unreachable!("half floats take the portable loop"),
    }
}

/// One quantized row against the permuted input: for each group, the codes of words
/// 0–3 and 4–7 sit in the lanes of two vectors; `BITS` shifts walk through them.
#[inline]
#[target_feature(enable = "neon")]
fn quant_row<const BITS: i32>(w: &[u8], s: &[u8], b: &[u8], px: &[f32], gsum: &[f32]) -> f32 {
    let mask = vdupq_n_u32((1 << BITS) - 1);
    let gbytes = 8 * BITS as usize;
    let steps = (32 / BITS) as usize;
    let mut total = vdupq_n_f32(0.0);
    let mut btotal = 0.0f32;
    for ((((wg, xg), sg), bg), gs) in w
        .chunks_exact(gbytes)
        .zip(px.chunks_exact(GROUP))
        .zip(s.chunks_exact(2))
        .zip(b.chunks_exact(2))
        .zip(gsum)
    {
        let (mut a0, mut a1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
        for (wb, xb) in wg.chunks_exact(32).zip(xg.chunks_exact(8 * steps)) {
            let mut v0 = vreinterpretq_u32_u8(ld16(wb));
            let mut v1 = vreinterpretq_u32_u8(ld16(&wb[16..]));
            for k in 0..steps {
                let q0 = vcvtq_f32_u32(vandq_u32(v0, mask));
                let q1 = vcvtq_f32_u32(vandq_u32(v1, mask));
                v0 = vshrq_n_u32::<BITS>(v0);
                v1 = vshrq_n_u32::<BITS>(v1);
                a0 = vfmaq_f32(a0, q0, ld4(&xb[8 * k..]));
                a1 = vfmaq_f32(a1, q1, ld4(&xb[8 * k + 4..]));
            }
        }
        total = vfmaq_n_f32(total, vaddq_f32(a0, a1), bf16_at(sg, 0));
        btotal += bf16_at(bg, 0) * gs;
    }
    vaddvq_f32(total) + btotal
}

/// The exact integer sum `Σ q·x8` of one group: low nibbles against the even
/// activations, high nibbles against the odd ones ([`Prepared`]'s int8 layout).
#[inline]
#[allow(unsafe_code)]
#[target_feature(enable = "neon")]
fn q4_group_isum(lo: [int8x16_t; 2], hi: [int8x16_t; 2], xg: &[u8], sdot_ok: bool) -> i32 {
    let x = |i: usize| vreinterpretq_s8_u8(ld16(&xg[16 * i..]));
    let zero = vdupq_n_s32(0);
    let acc = if sdot_ok {
        // SAFETY: the caller detected FEAT_DotProd (`sdot_ok`).
        unsafe {
            let a = sdot(zero, lo[0], x(0));
            let a = sdot(a, lo[1], x(1));
            let a = sdot(a, hi[0], x(2));
            sdot(a, hi[1], x(3))
        }
    } else {
        let a = dot_widen(zero, lo[0], x(0));
        let a = dot_widen(a, lo[1], x(1));
        let a = dot_widen(a, hi[0], x(2));
        dot_widen(a, hi[1], x(3))
    };
    vaddvq_s32(acc)
}

/// A group's 32 bytes of INT4 codes as low and high nibbles (values 0–15 as i8).
#[inline]
#[target_feature(enable = "neon")]
fn nibbles(wg: &[u8]) -> ([int8x16_t; 2], [int8x16_t; 2]) {
    let m4 = vdupq_n_u8(0x0F);
    let (w0, w1) = (ld16(wg), ld16(&wg[16..]));
    let lo = [vandq_u8(w0, m4), vandq_u8(w1, m4)].map(|v| vreinterpretq_s8_u8(v));
    let hi = [vshrq_n_u8::<4>(w0), vshrq_n_u8::<4>(w1)].map(|v| vreinterpretq_s8_u8(v));
    (lo, hi)
}

/// One INT4 row against int8 activations, scaled per group as the portable loop
/// does (`s·d·Σ + b·Σx`), so the result is the portable loop's.
#[inline]
#[target_feature(enable = "neon")]
fn q4_row_q8(w: &[u8], s: &[u8], b: &[u8], prep: &Prepared, sdot_ok: bool) -> f32 {
    let mut total = 0.0f32;
    for (((((wg, xg), sg), bg), d), gs) in w
        .chunks_exact(32)
        .zip(prep.q8.chunks_exact(GROUP))
        .zip(s.chunks_exact(2))
        .zip(b.chunks_exact(2))
        .zip(&prep.q8_scale)
        .zip(&prep.group_sums)
    {
        let (lo, hi) = nibbles(wg);
        let isum = q4_group_isum(lo, hi, xg, sdot_ok);
        total += bf16_at(sg, 0) * d * isum as f32 + bf16_at(bg, 0) * gs;
    }
    total
}

#[target_feature(enable = "neon")]
fn matmul_q8_neon(w: &Matrix, preps: &[Prepared], yt: &mut [f32], sdot_ok: bool) {
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
    let groups = cols / GROUP;
    for (((out, wr), sr), br) in yt
        .chunks_exact_mut(preps.len())
        .zip(weights.chunks_exact(wrow))
        .zip(scales.chunks_exact(srow))
        .zip(biases.chunks_exact(srow))
    {
        out.fill(0.0);
        // Each group's nibbles are unpacked once for every input.
        for (g, ((wg, sg), bg)) in wr
            .chunks_exact(32)
            .zip(sr.chunks_exact(2))
            .zip(br.chunks_exact(2))
            .enumerate()
            .take(groups)
        {
            let (lo, hi) = nibbles(wg);
            let (scale, bias) = (bf16_at(sg, 0), bf16_at(bg, 0));
            for (o, p) in out.iter_mut().zip(preps) {
                let isum = q4_group_isum(lo, hi, &p.q8[g * GROUP..], sdot_ok);
                *o += scale * p.q8_scale[g] * isum as f32 + bias * p.group_sums[g];
            }
        }
    }
}

/// A BF16 row against `x`, 16 elements per step, scalar tail.
#[inline]
#[target_feature(enable = "neon")]
fn bf16_row(r: &[u8], x: &[f32]) -> f32 {
    let widen = |v: uint16x4_t| vreinterpretq_f32_u32(vshlq_n_u32::<16>(vmovl_u16(v)));
    let mut acc = [vdupq_n_f32(0.0); 4];
    let mut rows = r.chunks_exact(32);
    let mut xs = x.chunks_exact(16);
    for (rb, xb) in (&mut rows).zip(&mut xs) {
        for h in 0..2 {
            let v = ld8_u16(&rb[16 * h..]);
            let (a, b) = (2 * h, 2 * h + 1);
            acc[a] = vfmaq_f32(acc[a], widen(vget_low_u16(v)), ld4(&xb[8 * h..]));
            acc[b] = vfmaq_f32(acc[b], widen(vget_high_u16(v)), ld4(&xb[8 * h + 4..]));
        }
    }
    let mut sum = vaddvq_f32(vaddq_f32(
        vaddq_f32(acc[0], acc[1]),
        vaddq_f32(acc[2], acc[3]),
    ));
    for (rb, xv) in rows.remainder().chunks_exact(2).zip(xs.remainder()) {
        sum += bf16_at(rb, 0) * xv;
    }
    sum
}

/// An F32 row (little-endian bytes) against `x`, 16 elements per step, scalar tail.
#[inline]
#[target_feature(enable = "neon")]
fn f32_row(r: &[u8], x: &[f32]) -> f32 {
    let mut acc = [vdupq_n_f32(0.0); 4];
    let mut rows = r.chunks_exact(64);
    let mut xs = x.chunks_exact(16);
    for (rb, xb) in (&mut rows).zip(&mut xs) {
        for (i, a) in acc.iter_mut().enumerate() {
            let v = vreinterpretq_f32_u8(ld16(&rb[16 * i..]));
            *a = vfmaq_f32(*a, v, ld4(&xb[4 * i..]));
        }
    }
    let mut sum = vaddvq_f32(vaddq_f32(
        vaddq_f32(acc[0], acc[1]),
        vaddq_f32(acc[2], acc[3]),
    ));
    for (rb, xv) in rows.remainder().chunks_exact(4).zip(xs.remainder()) {
        sum += f32::from_le_bytes([rb[0], rb[1], rb[2], rb[3]]) * xv;
    }
    sum
}

#[target_feature(enable = "neon")]
fn dot_neon(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [vdupq_n_f32(0.0); 4];
    let mut ac = a.chunks_exact(16);
    let mut bc = b.chunks_exact(16);
    for (x, y) in (&mut ac).zip(&mut bc) {
        for (i, s) in acc.iter_mut().enumerate() {
            *s = vfmaq_f32(*s, ld4(&x[4 * i..]), ld4(&y[4 * i..]));
        }
    }
    let mut sum = vaddvq_f32(vaddq_f32(
        vaddq_f32(acc[0], acc[1]),
        vaddq_f32(acc[2], acc[3]),
    ));
    for (x, y) in ac.remainder().iter().zip(bc.remainder()) {
        sum += x * y;
    }
    sum
}

#[target_feature(enable = "neon")]
fn dot4_neon(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
    let mut acc = [vdupq_n_f32(0.0); 4];
    let n = a.len() / 4 * 4;
    for i in (0..n).step_by(4) {
        let va = ld4(&a[i..]);
        for (s, bj) in acc.iter_mut().zip(&b) {
            *s = vfmaq_f32(*s, va, ld4(&bj[i..]));
        }
    }
    let mut out = acc.map(|v| vaddvq_f32(v));
    for (o, bj) in out.iter_mut().zip(&b) {
        for (x, y) in a[n..].iter().zip(&bj[n..]) {
            *o += x * y;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::testing::Rng;

    /// Both integer loops (`sdot` where the CPU has it, the widening multiplies
    /// always) give the exact sum of every group, on every code and activation
    /// extreme: the CPU running the tests picks only one of them for the kernels.
    #[test]
    #[allow(unsafe_code)]
    fn both_int8_loops_give_the_exact_group_sum() {
        assert!(available(), "aarch64 without NEON");
        let mut rng = Rng(0x05EE_DA64);
        for case in 0..200 {
            let mut w = [0u8; 32];
            let mut x = [0u8; 64];
            for b in &mut w {
                *b = (rng.next() >> 24) as u8;
            }
            for (i, v) in x.iter_mut().enumerate() {
                *v = match case {
                    0 => 127u8,
                    1 => (-127i8) as u8,
                    _ if i % 7 == 0 => (-127i8) as u8,
                    _ => (rng.next() >> 24) as u8,
                };
            }
            if case == 0 || case == 1 {
                w = [0xFF; 32];
            }
            // Byte j holds element 2j (low nibble) and 2j + 1 (high nibble); the
            // activations are the even elements' then the odd ones'.
            let want: i32 = (0..32)
                .map(|j| {
                    i32::from(w[j] & 0x0F) * i32::from(x[j] as i8)
                        + i32::from(w[j] >> 4) * i32::from(x[32 + j] as i8)
                })
                .sum();
            // SAFETY: NEON was checked above; `sdot` only where detected.
            let (lo, hi) = unsafe { nibbles(&w) };
            let widened = unsafe { q4_group_isum(lo, hi, &x, false) };
            assert_eq!(widened, want, "case {case}: widening multiplies");
            if dotprod() {
                let dotted = unsafe { q4_group_isum(lo, hi, &x, true) };
                assert_eq!(dotted, want, "case {case}: sdot");
            }
        }
    }
}
