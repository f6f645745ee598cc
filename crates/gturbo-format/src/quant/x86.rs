//! The affine quantizer's AVX2 inner loop for x86-64, chosen at run time (the release
//! build targets baseline x86-64, whose SSE2 divides four floats at a time).
//!
//! The same arithmetic as the portable loop ([`super::quantize_group`]), in the same
//! order, eight elements per instruction; every step is one IEEE operation on f32
//! with the same operands, so the bytes are the same (the unit tests compare both
//! loops on every spec). Groups go eight at a time: the eight minima and maxima are
//! reduced, then the eight scales and biases are computed in the lanes of one vector
//! (their divisions overlap instead of stalling each group), then each group's codes.
//! A block holding a refused group (non-finite weights, a span that overflows) goes
//! back to the portable loop, which finds and reports it exactly as without AVX2.
//!
//! [`quantize`] checks [`available`] itself before calling into the
//! `#[target_feature]` code, so no caller can reach an instruction the CPU lacks.
//! Loads and stores slice first (bounds checked) and then access the slice's own
//! pointer, unaligned.

use std::arch::x86_64::*;

use super::{Bits, Group, Input, Outputs, QuantError, ROUND_MAGIC, SCALE_EPS, Spec};

/// Whether this CPU has AVX2 (detection is cached by std).
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx2")
}

/// Quantize `input` (whole groups of `spec`, shapes checked by the caller) into `out`.
#[allow(unsafe_code)]
pub(super) fn quantize(input: Input<'_>, spec: Spec, out: Outputs<'_>) -> Result<(), QuantError> {
    assert!(available(), "AVX2 quantizer on a CPU without AVX2");
    macro_rules! at {
        ($bits:literal, $group:literal) => {
            // SAFETY (each instance): AVX2 was detected at run time just above.
            unsafe { groups::<$bits, $group>(input, out) }
        };
    }
    for_spec!(spec, at)
}

/// BF16 elements `e..e + 8` of the input, as eight u16 in element order.
#[inline]
#[allow(unsafe_code)]
fn ld8(input: Input<'_>, e: usize) -> __m128i {
    match input {
        Input::Bits(s) => {
            let s = &s[e..e + 8];
            // SAFETY: `s` holds 8 u16 = 16 bytes (sliced above); the load is unaligned.
            unsafe { _mm_loadu_si128(s.as_ptr().cast()) }
        }
        Input::LeBytes(b) => {
            // x86-64 is little-endian: the bytes are the u16 values.
            let b = &b[2 * e..2 * e + 16];
            // SAFETY: `b` holds 16 bytes (sliced above); the load is unaligned.
            unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
        }
    }
}

/// Eight BF16 elements from `e`, widened exactly to f32 (as bit patterns).
#[inline]
#[target_feature(enable = "avx2")]
fn widen8(input: Input<'_>, e: usize) -> __m256i {
    _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(ld8(input, e)))
}

/// The smallest lane (exact: min does not round).
#[inline]
#[target_feature(enable = "avx2")]
fn hmin(v: __m256) -> f32 {
    let m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let m = _mm_min_ps(m, _mm_movehl_ps(m, m));
    _mm_cvtss_f32(_mm_min_ss(m, _mm_shuffle_ps::<0b01>(m, m)))
}

/// The largest lane.
#[inline]
#[target_feature(enable = "avx2")]
fn hmax(v: __m256) -> f32 {
    let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<0b01>(m, m)))
}

/// 16 bytes to the start of `out`.
#[inline]
#[allow(unsafe_code)]
fn st16(out: &mut [u8], v: __m128i) {
    let out = &mut out[..16];
    // SAFETY: `out` holds 16 bytes (sliced above); the store is unaligned.
    unsafe { _mm_storeu_si128(out.as_mut_ptr().cast(), v) }
}

/// 32 bytes to the start of `out`.
#[inline]
#[target_feature(enable = "avx2")]
#[allow(unsafe_code)]
fn st32(out: &mut [u8], v: __m256i) {
    let out = &mut out[..32];
    // SAFETY: `out` holds 32 bytes (sliced above); the store is unaligned.
    unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), v) }
}

/// Eight finite f32 rounded to BF16 (nearest, ties to even: [`super::f32_to_bf16`]
/// without its NaN case, which a scale or bias never is), little-endian, to `out`.
#[inline]
#[target_feature(enable = "avx2")]
fn store_bf16x8(v: __m256, out: &mut [u8]) {
    let b = _mm256_castps_si256(v);
    let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
    let r = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
    let r = _mm256_srli_epi32::<16>(r);
    // Every lane is below 2^16, so the saturating pack is exact.
    let halves = (_mm256_castsi256_si128(r), _mm256_extracti128_si256::<1>(r));
    st16(out, _mm_packus_epi32(halves.0, halves.1));
}

/// Every group of `input`: blocks of eight in the vector loop, the rest (and any block
/// with a refused group) in the portable one.
#[target_feature(enable = "avx2")]
fn groups<const BITS: u32, const G: usize>(
    input: Input<'_>,
    (weights, scales, biases): Outputs<'_>,
) -> Result<(), QuantError> {
    let wbytes = G * BITS as usize / 8;
    let n_groups = input.len() / G;
    let blocks = weights
        .chunks_exact_mut(8 * wbytes)
        .zip(scales.chunks_exact_mut(16))
        .zip(biases.chunks_exact_mut(16))
        .take(n_groups / 8);
    for (k, ((w, s), b)) in blocks.enumerate() {
        if !block::<BITS, G>(input, 8 * k, (w, s, b)) {
            super::quantize_groups_at::<BITS, G>(input, 8 * k..8 * k + 8, (w, s, b))?;
        }
    }
    let rest = n_groups / 8 * 8;
    let out = (
        &mut weights[rest * wbytes..],
        &mut scales[rest * 2..],
        &mut biases[rest * 2..],
    );
    super::quantize_groups_at::<BITS, G>(input, rest..n_groups, out)
}

/// Groups `first..first + 8`; false (outputs unspecified) if one of them is refused.
#[inline]
#[target_feature(enable = "avx2")]
fn block<const BITS: u32, const G: usize>(
    input: Input<'_>,
    first: usize,
    (wout, sout, bout): Outputs<'_>,
) -> bool {
    let levels = ((1u32 << BITS) - 1) as f32;
    let exp = _mm256_set1_epi32(0x7F80_0000);
    // 1. Each group's min and max; an exponent of all ones anywhere (±inf, NaN) is
    //    a refusal.
    let mut bad = _mm256_setzero_si256();
    let (mut mins, mut maxs) = ([0f32; 8], [0f32; 8]);
    for j in 0..8 {
        let mut mn = _mm256_set1_ps(f32::INFINITY);
        let mut mx = _mm256_set1_ps(f32::NEG_INFINITY);
        for e in (0..G).step_by(8) {
            let i = widen8(input, (first + j) * G + e);
            bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(i, exp), exp));
            let v = _mm256_castsi256_ps(i);
            // `v < m ? v : m`, as the portable loop's lanes.
            mn = _mm256_min_ps(v, mn);
            mx = _mm256_max_ps(v, mx);
        }
        mins[j] = hmin(mn);
        maxs[j] = hmax(mx);
    }
    if _mm256_movemask_epi8(bad) != 0 {
        return false;
    }
    // 2. The eight scales and biases, lane j for group j (the portable steps, as
    //    blends).
    let load = |a: &[f32; 8]| _mm256_setr_ps(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
    let (mn, mx) = (load(&mins), load(&maxs));
    let sign = _mm256_set1_ps(-0.0);
    let span = _mm256_sub_ps(mx, mn);
    // The span is never negative; below infinity (ordered) means finite.
    let finite = _mm256_cmp_ps::<_CMP_LT_OQ>(span, _mm256_set1_ps(f32::INFINITY));
    if _mm256_movemask_ps(finite) != 0xFF {
        return false;
    }
    let use_min =
        _mm256_cmp_ps::<_CMP_GT_OQ>(_mm256_andnot_ps(sign, mn), _mm256_andnot_ps(sign, mx));
    let scale = _mm256_div_ps(span, _mm256_set1_ps(levels));
    let eps = _mm256_set1_ps(SCALE_EPS);
    let scale = _mm256_blendv_ps(scale, eps, _mm256_cmp_ps::<_CMP_LT_OQ>(scale, eps));
    let edge = _mm256_blendv_ps(mx, mn, use_min);
    let scale = _mm256_blendv_ps(_mm256_xor_ps(scale, sign), scale, use_min);
    // Round to nearest, ties to even: `round_ties_even`.
    let q0 = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_div_ps(
        edge, scale,
    ));
    let nonzero = _mm256_cmp_ps::<_CMP_NEQ_OQ>(q0, _mm256_setzero_ps());
    let scale = _mm256_blendv_ps(scale, _mm256_div_ps(edge, q0), nonzero);
    let bias = _mm256_and_ps(edge, nonzero);
    store_bf16x8(scale, sout);
    store_bf16x8(bias, bout);
    // 3. Each group's codes, packed.
    let (zero, top) = (_mm256_setzero_ps(), _mm256_set1_ps(levels));
    let magic = _mm256_set1_ps(ROUND_MAGIC);
    let wbytes = G * BITS as usize / 8;
    for (j, wo) in wout.chunks_exact_mut(wbytes).enumerate().take(8) {
        let at = _mm256_set1_epi32(j as i32);
        let (s, b) = (
            _mm256_permutevar8x32_ps(scale, at),
            _mm256_permutevar8x32_ps(bias, at),
        );
        let mut codes = [_mm256_setzero_si256(); 16];
        let codes = &mut codes[..G / 8];
        for (k, c) in codes.iter_mut().enumerate() {
            let v = _mm256_castsi256_ps(widen8(input, (first + j) * G + 8 * k));
            // A true division, as MLX's. `max(x, 0)` is `x > 0 ? x : 0` (NaN and -0
            // code as 0), `min(x, levels)` is `x < levels ? x : levels`.
            let x = _mm256_div_ps(_mm256_sub_ps(v, b), s);
            let x = _mm256_min_ps(_mm256_max_ps(x, zero), top);
            let rounded = _mm256_castps_si256(_mm256_add_ps(x, magic));
            *c = _mm256_sub_epi32(rounded, _mm256_castps_si256(magic));
        }
        pack::<BITS, G>(codes, wo);
    }
    true
}

/// Pack one group's code vectors (eight codes each, element order) into its words.
#[inline]
#[target_feature(enable = "avx2")]
#[allow(unsafe_code)]
fn pack<const BITS: u32, const G: usize>(codes: &[__m256i], out: &mut [u8]) {
    if 32 % BITS != 0 {
        // Codes straddle words (3, 5, 6 bits): the portable bit stream.
        let mut flat = [0u32; G];
        for (c, f) in codes.iter().zip(flat.chunks_exact_mut(8)) {
            let f = &mut f[..8];
            // SAFETY: `f` holds 8 u32 = 32 bytes (sliced above); the store is unaligned.
            unsafe { _mm256_storeu_si256(f.as_mut_ptr().cast(), *c) };
        }
        super::pack::<BITS, G>(&flat, out);
        return;
    }
    // Shift every code to its place in its word: the codes of one word then hold
    // disjoint bits, so adding them (horizontally) is OR-ing them.
    let per_word = 32 / BITS;
    let shifts = |first: u32| {
        let s = |l: u32| ((first + l) % per_word * BITS) as i32;
        _mm256_setr_epi32(s(0), s(1), s(2), s(3), s(4), s(5), s(6), s(7))
    };
    match BITS {
        8 => {
            // Four vectors (32 codes) make eight words; lanes 0-3 of vector k make
            // word 2k, lanes 4-7 word 2k + 1.
            let sh = shifts(0);
            let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            for (v, o) in codes.chunks_exact(4).zip(out.chunks_exact_mut(32)) {
                let v: [__m256i; 4] = std::array::from_fn(|i| _mm256_sllv_epi32(v[i], sh));
                let a = _mm256_hadd_epi32(v[0], v[1]);
                let b = _mm256_hadd_epi32(v[2], v[3]);
                // Words 0 2 4 6 | 1 3 5 7.
                let w = _mm256_hadd_epi32(a, b);
                st32(o, _mm256_permutevar8x32_epi32(w, order));
            }
        }
        4 => {
            // Vector k makes word k.
            let sh = shifts(0);
            let mut v = [_mm256_setzero_si256(); 16];
            let v = &mut v[..codes.len()];
            for (p, &c) in v.iter_mut().zip(codes) {
                *p = _mm256_sllv_epi32(c, sh);
            }
            words_of(v, out);
        }
        _ => {
            // 2 bits: vectors 2k and 2k + 1 make word k.
            let (s0, s1) = (shifts(0), shifts(8));
            let mut v = [_mm256_setzero_si256(); 8];
            let v = &mut v[..codes.len() / 2];
            for (p, c) in v.iter_mut().zip(codes.chunks_exact(2)) {
                *p = _mm256_or_si256(_mm256_sllv_epi32(c[0], s0), _mm256_sllv_epi32(c[1], s1));
            }
            words_of(v, out);
        }
    }
}

/// Words `k = 0..v.len()` to `out`, word k being the sum of vector k's lanes (a
/// multiple of 8 vectors, or 4, or 2: groups of 32 to 128 codes).
#[inline]
#[target_feature(enable = "avx2")]
fn words_of(v: &[__m256i], out: &mut [u8]) {
    // The sums of v[0..4]'s lanes in the low half, of v[4..8]'s in the high half.
    let sum4 = |v: &[__m256i]| {
        _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]))
    };
    let halves =
        |a: __m256i| _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256::<1>(a));
    let mut eights = v.chunks_exact(8);
    let mut at = 0;
    for e in &mut eights {
        let (a, b) = (sum4(&e[..4]), sum4(&e[4..]));
        let lo = _mm256_permute2x128_si256::<0x20>(a, b);
        let hi = _mm256_permute2x128_si256::<0x31>(a, b);
        st32(&mut out[at..], _mm256_add_epi32(lo, hi));
        at += 32;
    }
    match eights.remainder() {
        [] => {}
        r @ [_, _, _, _] => st16(&mut out[at..], halves(sum4(r))),
        r => {
            let a = _mm256_hadd_epi32(r[0], r[1]);
            let w = halves(_mm256_hadd_epi32(a, a));
            out[at..at + 8].copy_from_slice(&(_mm_cvtsi128_si64(w) as u64).to_le_bytes());
        }
    }
}
