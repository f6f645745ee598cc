//! Portable inner loops: plain Rust over fixed-width arrays, written so the compiler
//! vectorises them on any target (NEON on Apple silicon, SSE2 on baseline x86-64).

use super::{FloatDtype, Matrix, Prepared, bf16_at, quant_row_bytes};
use crate::format::mxfp4::GROUP as MXFP4_GROUP;
use crate::format::quant::{self, Bits, GROUP, MAX_GROUP, bf16_to_f32};

/// `y = W x` over all rows of `w`.
pub(super) fn matvec(w: &Matrix, prep: &Prepared, y: &mut [f32]) {
    match *w {
        Matrix::Mxfp4 { .. } => matvec_mxfp4(w, &prep.x, y),
        Matrix::Quant {
            bits,
            weights,
            scales,
            biases,
            cols,
            ..
        } => {
            let (wrow, srow) = quant_row_bytes(bits, GROUP, cols);
            if !prep.q8.is_empty() {
                for (((o, wr), sr), br) in y
                    .iter_mut()
                    .zip(weights.chunks_exact(wrow))
                    .zip(scales.chunks_exact(srow))
                    .zip(biases.chunks_exact(srow))
                {
                    *o = q4_row_q8(wr, sr, br, prep);
                }
                return;
            }
            for (((o, wr), sr), br) in y
                .iter_mut()
                .zip(weights.chunks_exact(wrow))
                .zip(scales.chunks_exact(srow))
                .zip(biases.chunks_exact(srow))
            {
                *o = quant_row(bits, wr, sr, br, &prep.x, &prep.group_sums);
            }
        }
        Matrix::Float {
            dtype: FloatDtype::Bf16,
            data,
            cols,
            ..
        } => {
            for (o, r) in y.iter_mut().zip(data.chunks_exact(cols * 2)) {
                *o = dot_with(r, &prep.x, 2, |b| {
                    bf16_to_f32(u16::from_le_bytes([b[0], b[1]]))
                });
            }
        }
        Matrix::Float {
            dtype: FloatDtype::F16,
            data,
            cols,
            ..
        } => {
            for (o, r) in y.iter_mut().zip(data.chunks_exact(cols * 2)) {
                *o = dot_with(r, &prep.x, 2, |b| {
                    half::f16::from_le_bytes([b[0], b[1]]).to_f32()
                });
            }
        }
        Matrix::Float {
            dtype: FloatDtype::F32,
            data,
            cols,
            ..
        } => {
            for (o, r) in y.iter_mut().zip(data.chunks_exact(cols * 4)) {
                *o = dot_with(r, &prep.x, 4, |b| {
                    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
                });
            }
        }
    }
}

/// `Σ decode(row element c)·x[c]` with eight partial sums.
#[inline(always)]
fn dot_with(row: &[u8], x: &[f32], width: usize, decode: impl Fn(&[u8]) -> f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut rows = row.chunks_exact(8 * width);
    let mut xs = x.chunks_exact(8);
    for (r, x) in (&mut rows).zip(&mut xs) {
        for i in 0..8 {
            acc[i] += decode(&r[i * width..(i + 1) * width]) * x[i];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for (r, x) in rows.remainder().chunks_exact(width).zip(xs.remainder()) {
        sum += decode(r) * x;
    }
    sum
}

/// One quantized row against the permuted input: `Σ_g s_g·Σ q·x + b_g·Σ x`.
#[inline(always)]
fn quant_row(bits: u32, w: &[u8], s: &[u8], b: &[u8], px: &[f32], gsum: &[f32]) -> f32 {
    let per_word = (32 / bits) as usize;
    let mask = (1u32 << bits) - 1;
    let block = 8 * per_word;
    let gbytes = GROUP * bits as usize / 8;
    let mut total = 0.0f32;
    for ((((wg, xg), sg), bg), gs) in w
        .chunks_exact(gbytes)
        .zip(px.chunks_exact(GROUP))
        .zip(s.chunks_exact(2))
        .zip(b.chunks_exact(2))
        .zip(gsum)
    {
        let mut acc = [0.0f32; 8];
        for (wb, xb) in wg.chunks_exact(32).zip(xg.chunks_exact(block)) {
            let mut words = [0u32; 8];
            for (i, wd) in words.iter_mut().enumerate() {
                *wd = u32::from_le_bytes([wb[4 * i], wb[4 * i + 1], wb[4 * i + 2], wb[4 * i + 3]]);
            }
            for (sh, xs) in xb.chunks_exact(8).enumerate() {
                let shift = bits * sh as u32;
                for i in 0..8 {
                    acc[i] += ((words[i] >> shift) & mask) as f32 * xs[i];
                }
            }
        }
        let q_dot: f32 = acc.iter().sum();
        total += bf16_at(sg, 0) * q_dot + bf16_at(bg, 0) * gs;
    }
    total
}

/// `yt[r·n + j] = row r · x_j` for INT4 rows and int8-prepared inputs.
pub(super) fn matmul_q8(w: &Matrix, preps: &[Prepared], yt: &mut [f32]) {
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
        for (o, p) in out.iter_mut().zip(preps) {
            *o = q4_row_q8(wr, sr, br, p);
        }
    }
}

/// One INT4 row against int8 activations: the integer sum per group is exact, then
/// scaled by `s·d`.
fn q4_row_q8(w: &[u8], s: &[u8], b: &[u8], prep: &Prepared) -> f32 {
    let mut total = 0.0f32;
    for (((((wg, xg), sg), bg), d), gs) in w
        .chunks_exact(32)
        .zip(prep.q8.chunks_exact(GROUP))
        .zip(s.chunks_exact(2))
        .zip(b.chunks_exact(2))
        .zip(&prep.q8_scale)
        .zip(&prep.group_sums)
    {
        let (even, odd) = xg.split_at(32);
        let mut isum = 0i32;
        for ((byte, e), o) in wg.iter().zip(even).zip(odd) {
            isum +=
                (byte & 0x0F) as i32 * (*e as i8) as i32 + (byte >> 4) as i32 * (*o as i8) as i32;
        }
        total += bf16_at(sg, 0) * d * isum as f32 + bf16_at(bg, 0) * gs;
    }
    total
}

/// The values of the two codes of one byte of an MXFP4 row (low nibble first), by
/// the byte: E2M1 of each nibble, built once at compile time.
pub(super) static MXFP4_PAIRS: [[f32; 2]; 256] = {
    let mut t = [[0.0f32; 2]; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = [e2m1_const(b as u8 & 0xf), e2m1_const(b as u8 >> 4)];
        b += 1;
    }
    t
};

/// [`crate::format::mxfp4::e2m1`] in a `const` context (the table above).
const fn e2m1_const(c: u8) -> f32 {
    let m = crate::format::mxfp4::E2M1[(c & 7) as usize];
    if c & 8 != 0 { -m } else { m }
}

/// `y = W x` for an MXFP4 matrix, `x` in natural order: per group of 32, the codes'
/// E2M1 values dotted with `x` (eight partial sums), times `2^(e − 127)`. Each
/// product `E2M1 × x` is exact in f32 up to its rounding; the group's scale is a power
/// of two, so the result agrees with "dequantize, then dot" to f32 rounding.
pub(super) fn matvec_mxfp4(w: &Matrix, x: &[f32], y: &mut [f32]) {
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
    for ((o, w), s) in y
        .iter_mut()
        .zip(weights.chunks_exact(wr))
        .zip(scales.chunks_exact(sr))
    {
        *o = mxfp4_row_dot(w, s, x);
    }
}

/// One MXFP4 row (`w` its code bytes, `s` its scale bytes) against `x`.
#[inline(always)]
pub(super) fn mxfp4_row_dot(w: &[u8], s: &[u8], x: &[f32]) -> f32 {
    let mut total = 0.0f32;
    for ((wg, &e), xg) in w
        .chunks_exact(MXFP4_GROUP / 2)
        .zip(s)
        .zip(x.chunks_exact(MXFP4_GROUP))
    {
        let mut acc = [0.0f32; 8];
        for (wb, xb) in wg.chunks_exact(4).zip(xg.chunks_exact(8)) {
            for i in 0..4 {
                let [lo, hi] = MXFP4_PAIRS[wb[i] as usize];
                acc[2 * i] += lo * xb[2 * i];
                acc[2 * i + 1] += hi * xb[2 * i + 1];
            }
        }
        total += crate::format::mxfp4::scale(e) * acc.iter().sum::<f32>();
    }
    total
}

/// Row 0 of `w` (a one-row matrix) as f32.
pub(super) fn row(w: &Matrix, out: &mut [f32]) {
    if w.general_quant() {
        return row_general(w, out);
    }
    match *w {
        Matrix::Mxfp4 {
            weights, scales, ..
        } => {
            for ((og, wg), &e) in out
                .chunks_exact_mut(MXFP4_GROUP)
                .zip(weights.chunks_exact(MXFP4_GROUP / 2))
                .zip(scales)
            {
                let s = crate::format::mxfp4::scale(e);
                for (o, &b) in og.chunks_exact_mut(2).zip(wg) {
                    let [lo, hi] = MXFP4_PAIRS[b as usize];
                    o[0] = lo * s;
                    o[1] = hi * s;
                }
            }
        }
        Matrix::Quant {
            bits,
            weights,
            scales,
            biases,
            ..
        } => {
            let gbytes = GROUP * bits as usize / 8;
            let mask = (1u32 << bits) - 1;
            for (((o, wg), sg), bg) in out
                .chunks_exact_mut(GROUP)
                .zip(weights.chunks_exact(gbytes))
                .zip(scales.chunks_exact(2))
                .zip(biases.chunks_exact(2))
            {
                let (scale, bias) = (bf16_at(sg, 0), bf16_at(bg, 0));
                let per_byte = 8 / bits as usize;
                for (k, v) in o.iter_mut().enumerate() {
                    let byte = wg[k / per_byte] as u32;
                    let q = (byte >> (bits as usize * (k % per_byte))) & mask;
                    *v = scale * q as f32 + bias;
                }
            }
        }
        Matrix::Float {
            dtype: FloatDtype::Bf16,
            data,
            ..
        } => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = bf16_at(data, i);
            }
        }
        Matrix::Float {
            dtype: FloatDtype::F16,
            data,
            ..
        } => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(2)) {
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

/// Row 0 of the one-row matrix `w` in the order [`Prepared`] puts the input in:
/// permuted within each block of eight words for quantized matrices, natural otherwise.
pub(super) fn row_prepared(w: &Matrix, out: &mut [f32]) {
    let Matrix::Quant {
        bits,
        weights,
        scales,
        biases,
        ..
    } = *w
    else {
        return row(w, out);
    };
    let per_word = (32 / bits) as usize;
    let mask = (1u32 << bits) - 1;
    let gbytes = GROUP * bits as usize / 8;
    for (((og, wg), sg), bg) in out
        .chunks_exact_mut(GROUP)
        .zip(weights.chunks_exact(gbytes))
        .zip(scales.chunks_exact(2))
        .zip(biases.chunks_exact(2))
    {
        let (scale, bias) = (bf16_at(sg, 0), bf16_at(bg, 0));
        for (wb, ob) in wg.chunks_exact(32).zip(og.chunks_exact_mut(8 * per_word)) {
            for (i, wd) in wb.chunks_exact(4).enumerate() {
                let word = u32::from_le_bytes([wd[0], wd[1], wd[2], wd[3]]);
                for s in 0..per_word {
                    let q = (word >> (bits as usize * s)) & mask;
                    ob[s * 8 + i] = scale * q as f32 + bias;
                }
            }
        }
    }
}

/// `Σ a[i]·b[i]` with eight partial sums.
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut ac = a.chunks_exact(8);
    let mut bc = b.chunks_exact(8);
    for (x, y) in (&mut ac).zip(&mut bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for (x, y) in ac.remainder().iter().zip(bc.remainder()) {
        sum += x * y;
    }
    sum
}

/// Run `each(codes, scale, bias, group_index)` over the groups of the one-row
/// quantized matrix `w`, in order, with the group's codes unpacked from the row's
/// dense little-endian bit stream (the layout of every width).
#[inline(always)]
fn each_group(w: &Matrix, mut each: impl FnMut(&[u8], f32, f32, usize)) {
    let Matrix::Quant {
        bits,
        group,
        weights,
        scales,
        biases,
        ..
    } = *w
    else {
        unreachable!("the general loop of a float matrix");
    };
    let b = Bits::from_bits(bits).expect("Matrix::check accepted the width");
    let gbytes = group * bits as usize / 8;
    let mut codes = [0u8; MAX_GROUP];
    let codes = &mut codes[..group];
    for (g, ((wg, sg), bg)) in weights
        .chunks_exact(gbytes)
        .zip(scales.chunks_exact(2))
        .zip(biases.chunks_exact(2))
        .enumerate()
    {
        quant::unpack_codes(wg, b, codes).expect("a group holds a whole number of u32 words");
        each(codes, bf16_at(sg, 0), bf16_at(bg, 0), g);
    }
}

/// `y = W x` for a quantized matrix of any width and group (see
/// [`Matrix::general_quant`]): per group `s·Σ q·x + b·Σ x`, the input in natural
/// order.
pub(super) fn matvec_general(w: &Matrix, prep: &Prepared, y: &mut [f32]) {
    let Matrix::Quant {
        bits, group, cols, ..
    } = *w
    else {
        unreachable!("the general loop of a float matrix");
    };
    for (r, o) in y.iter_mut().enumerate() {
        let row = w.slice_rows(r, r + 1);
        let mut total = 0.0f32;
        each_group(&row, |codes, scale, bias, g| {
            let x = &prep.x[g * group..(g + 1) * group];
            let mut acc = [0.0f32; 8];
            for (c, xs) in codes.chunks_exact(8).zip(x.chunks_exact(8)) {
                for i in 0..8 {
                    acc[i] += c[i] as f32 * xs[i];
                }
            }
            total += scale * acc.iter().sum::<f32>() + bias * prep.group_sums[g];
        });
        *o = total;
    }
    debug_assert_eq!(prep.x.len(), cols, "{bits}-bit input");
}

/// Row 0 of a one-row quantized matrix of any width and group as f32, in natural
/// order: `s·q + b` per element.
fn row_general(w: &Matrix, out: &mut [f32]) {
    let Matrix::Quant { group, .. } = *w else {
        unreachable!("the general loop of a float matrix");
    };
    each_group(w, |codes, scale, bias, g| {
        for (o, &q) in out[g * group..(g + 1) * group].iter_mut().zip(codes) {
            *o = scale * q as f32 + bias;
        }
    });
}
