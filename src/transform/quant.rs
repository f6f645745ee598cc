//! Affine INT4/INT8 quantization, group size 64, bit-exact with MLX
//! `mx.quantize(w, group_size=64, bits=4|8)` (affine mode, CPU path), in bounded
//! scratch.
//!
//! This module owns the arithmetic and the byte layout of one quantized matrix; it
//! knows nothing about tensor names, files or rows beyond "a row is `cols` elements".
//! Callers (the install pipeline) stream a tensor through [`quantize_rows`] a tile of
//! whole rows at a time and add the tensor name and row offset to any error.
//!
//! # The formula
//! The semantics of MLX's CPU affine `quantize` (`mlx/backend/cpu/quantized.cpp`),
//! checked bit for bit against live MLX 0.32.4 (`scripts/mlx_crosscheck.py`):
//! Groups are 64 consecutive elements along the last axis. Everything is computed in
//! f32 (BF16 widens exactly), with `levels = 2^bits - 1` (15 or 255):
//! 1. `min`, `max` over the group. (MLX's comparisons skip NaN; gturbo refuses groups
//!    holding ±inf or NaN instead, see [`QuantError::NonFinite`].)
//! 2. `scale = max((max - min) / levels, 1e-7)`. The *edge* is `min` when
//!    `|min| > |max|` (strictly), else `max`; when the edge is `max`, `scale = -scale`.
//! 3. `q0 = rint(edge / scale)` (round half to even). If `q0 != 0`:
//!    `scale = edge / q0`, `bias = edge`; otherwise `bias = 0` and the scale stays.
//!    This puts 0.0 on the code grid (at code `-q0`), so zeros dequantize to (nearly,
//!    after BF16 rounding of scale and bias) zero.
//! 4. Each element: `q = clamp(rint((w - bias) / scale), 0, levels)`, with the f32
//!    `scale` and `bias` (a true division, not a multiplication by a reciprocal).
//! 5. The stored scale and bias are the f32 values rounded to BF16 (nearest, ties to
//!    even).
//!
//! A constant group `c` therefore stores scale ≈ -1e-7 (BF16 `0xB3D7`), bias `c` and
//! all-zero codes; an all-zero group stores scale `0xB3D7`, bias 0.
//!
//! # Layout
//! Element `k` of a row goes to little-endian u32 word `k / per_word` at bits
//! `bits * (k % per_word)` (element 0 in the lowest bits), `per_word` = 8 at 4 bits
//! and 4 at 8 bits. For `rows × cols` elements the outputs are `rows*cols*bits/8`
//! weight bytes (U32 `[rows, cols*bits/32]`) and `rows*cols/64*2` bytes each of BF16
//! scales and biases (`[rows, cols/64]`), all little-endian: exactly the bytes MLX's
//! `safetensors` writer puts on disk. Because a group never crosses a row, the flat
//! layout of a tile of rows is the matching slice of the whole tensor's layout, so
//! tiles of any whole number of rows give the same bytes as one call.
//!
//! # Where gturbo departs from MLX (refusals, never different bytes)
//! - A group holding ±inf or NaN is refused ([`QuantError::NonFinite`]): MLX skips NaN
//!   in min/max, then converts a NaN code with an undefined float-to-int cast.
//! - A group of finite values whose span `max - min` overflows f32 (|values| near
//!   BF16's limit, opposite signs) is refused ([`QuantError::RangeOverflow`]): MLX
//!   stores an infinite scale there and every weight dequantizes to NaN.
//!
//! # Why the code looks the way it does
//! Hundreds of gigabytes go through [`quantize_rows`], so a group is processed in
//! fixed-size stack arrays with branch-free loops the compiler vectorises, and nothing
//! allocates. `rint` of the clamped code uses the exact 2^23 trick: for
//! `0 <= x < 2^23`, the f32 addition `x + 2^23` rounds to an integer with ties to even
//! under the default rounding mode, and its bit pattern minus that of 2^23 is the
//! integer. Clamping before rounding gives the same code as MLX's round-then-clamp
//! because the bounds are integers.

use crate::format::Scheme;

/// Elements per quantization group.
pub const GROUP: usize = 64;

/// MLX's lower bound on the magnitude of the first scale estimate (`1e-7` as f32).
const SCALE_EPS: f32 = 1e-7;

/// 2^23: adding it to `x` in `[0, 2^23)` rounds `x` to an integer, ties to even.
const ROUND_MAGIC: f32 = 8_388_608.0;

/// Bit width of the quantized codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bits {
    /// INT4: 15 levels, 8 codes per u32 word.
    Four,
    /// INT8: 255 levels, 4 codes per u32 word (policy overrides such as MoE routers).
    Eight,
}

impl Bits {
    /// Bits per code.
    pub fn bits(self) -> u32 {
        match self {
            Bits::Four => 4,
            Bits::Eight => 8,
        }
    }

    /// The bit width for a quantizing scheme; `None` for passthrough.
    pub fn from_scheme(scheme: Scheme) -> Option<Bits> {
        match scheme {
            Scheme::Int4G64 => Some(Bits::Four),
            Scheme::Int8G64 => Some(Bits::Eight),
            Scheme::Passthrough => None,
        }
    }

    /// Bytes of packed codes for one group of 64 elements.
    pub fn group_weight_bytes(self) -> usize {
        GROUP * self.bits() as usize / 8
    }
}

/// A slice whose length does not fit the requested quantization.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    /// The row width is zero or not a multiple of the group size.
    #[error("row width {cols} is not a positive multiple of the group size 64")]
    Cols {
        /// The row width given.
        cols: usize,
    },
    /// The input does not hold a whole number of rows.
    #[error("input holds {len} elements, not a whole number of {cols}-element rows")]
    InputLen {
        /// Elements in the input.
        len: usize,
        /// The row width given.
        cols: usize,
    },
    /// A raw BF16 byte input has an odd length.
    #[error("BF16 input holds {len} bytes, an odd number")]
    OddBytes {
        /// Bytes in the input.
        len: usize,
    },
    /// An output (or, for dequantization, a packed input) slice has the wrong length.
    #[error("{slice} slice holds {len} bytes, expected {expected}")]
    SliceLen {
        /// Which slice: `weights`, `scales`, `biases` or `output`.
        slice: &'static str,
        /// Its length in bytes (elements for `output`).
        len: usize,
        /// The length the input shape requires.
        expected: usize,
    },
}

/// Why a slice could not be quantized. Indices are element indices within the slice
/// given; callers add the tensor name and the row offset of the tile.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum QuantError {
    /// A group holds +inf, -inf or NaN. Non-finite weights in a checkpoint are a defect
    /// to report, not to encode.
    #[error("non-finite weight (inf or NaN) at element {index}")]
    NonFinite {
        /// Index of the first non-finite element of the group.
        index: usize,
    },
    /// A group's span `max - min` overflows f32, so its scale would be infinite.
    #[error("group starting at element {index} spans {min:e}..{max:e}, wider than f32 can hold")]
    RangeOverflow {
        /// Index of the group's first element.
        index: usize,
        /// The group minimum.
        min: f32,
        /// The group maximum.
        max: f32,
    },
    /// The slices do not fit the shape.
    #[error("bad shape: {0}")]
    BadShape(#[from] ShapeError),
}

/// Widen a BF16 bit pattern to f32 (exact).
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Round an f32 to BF16, to nearest with ties to even (as MLX's `bfloat16_t`
/// conversion does for every non-NaN value); NaN becomes a quiet NaN.
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) as u16) | 0x0040;
    }
    // No overflow: the largest non-NaN pattern is 0xFF80_0000.
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

/// Check that `n_elems` elements of rows `cols` wide fit the output slices of `bits`,
/// by the format's size rule ([`crate::format::Affine::sizes`]).
fn check_shapes(
    n_elems: usize,
    cols: usize,
    bits: Bits,
    weights: usize,
    scales: usize,
    biases: usize,
) -> Result<(), ShapeError> {
    let affine = crate::format::Affine::new(bits.bits(), GROUP as u32)
        .expect("4 and 8 bits at group 64 are MLX layouts");
    if !affine.fits(cols as u64) {
        return Err(ShapeError::Cols { cols });
    }
    if !n_elems.is_multiple_of(cols) {
        return Err(ShapeError::InputLen { len: n_elems, cols });
    }
    // The element count is a slice length in memory, so its sizes fit 64 bits.
    let q = affine
        .sizes((n_elems / cols) as u64, cols as u64)
        .expect("an in-memory slice of whole rows has sizes that fit 64 bits");
    let want = [
        ("weights", weights, q.weights as usize),
        ("scales", scales, q.scales as usize),
        ("biases", biases, q.biases as usize),
    ];
    for (slice, len, expected) in want {
        if len != expected {
            return Err(ShapeError::SliceLen {
                slice,
                len,
                expected,
            });
        }
    }
    Ok(())
}

/// Quantize whole rows of BF16 values (given as bit patterns) into MLX's affine
/// layout, writing the packed little-endian u32 words and the little-endian BF16
/// scales and biases straight into the output byte slices.
///
/// `src_bf16.len()` must be a multiple of `cols`, `cols` a multiple of 64, and the
/// outputs exactly `len*bits/8`, `len/64*2` and `len/64*2` bytes. On error the
/// outputs hold unspecified bytes.
pub fn quantize_rows(
    src_bf16: &[u16],
    cols: usize,
    bits: Bits,
    weights: &mut [u8],
    scales: &mut [u8],
    biases: &mut [u8],
) -> Result<(), QuantError> {
    check_shapes(
        src_bf16.len(),
        cols,
        bits,
        weights.len(),
        scales.len(),
        biases.len(),
    )?;
    let load = |g: usize, out: &mut [u16; GROUP]| {
        out.copy_from_slice(&src_bf16[g * GROUP..(g + 1) * GROUP]);
    };
    quantize_groups(src_bf16.len() / GROUP, load, bits, weights, scales, biases)
}

/// [`quantize_rows`] over raw little-endian BF16 bytes, as they come off the network
/// (`src.len()` = 2 × elements). Element indices in errors count elements, not bytes.
pub fn quantize_rows_le_bytes(
    src: &[u8],
    cols: usize,
    bits: Bits,
    weights: &mut [u8],
    scales: &mut [u8],
    biases: &mut [u8],
) -> Result<(), QuantError> {
    if !src.len().is_multiple_of(2) {
        return Err(ShapeError::OddBytes { len: src.len() }.into());
    }
    let n = src.len() / 2;
    check_shapes(n, cols, bits, weights.len(), scales.len(), biases.len())?;
    let load = |g: usize, out: &mut [u16; GROUP]| {
        let bytes = &src[g * GROUP * 2..(g + 1) * GROUP * 2];
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
            *o = u16::from_le_bytes([b[0], b[1]]);
        }
    };
    quantize_groups(n / GROUP, load, bits, weights, scales, biases)
}

/// Quantize `n_groups` groups fetched by `load`; shapes are already checked.
fn quantize_groups(
    n_groups: usize,
    load: impl Fn(usize, &mut [u16; GROUP]),
    bits: Bits,
    weights: &mut [u8],
    scales: &mut [u8],
    biases: &mut [u8],
) -> Result<(), QuantError> {
    match bits {
        Bits::Four => quantize_groups_at::<4>(n_groups, load, weights, scales, biases),
        Bits::Eight => quantize_groups_at::<8>(n_groups, load, weights, scales, biases),
    }
}

fn quantize_groups_at<const BITS: u32>(
    n_groups: usize,
    load: impl Fn(usize, &mut [u16; GROUP]),
    weights: &mut [u8],
    scales: &mut [u8],
    biases: &mut [u8],
) -> Result<(), QuantError> {
    let wbytes = GROUP * BITS as usize / 8;
    let mut raw = [0u16; GROUP];
    let mut codes = [0u32; GROUP];
    for ((g, (wout, sout)), bout) in weights
        .chunks_exact_mut(wbytes)
        .zip(scales.chunks_exact_mut(2))
        .enumerate()
        .zip(biases.chunks_exact_mut(2))
        .take(n_groups)
    {
        load(g, &mut raw);
        let (scale, bias) = quantize_group::<BITS>(&raw, &mut codes, g * GROUP)?;
        pack::<BITS>(&codes, wout);
        sout.copy_from_slice(&f32_to_bf16(scale).to_le_bytes());
        bout.copy_from_slice(&f32_to_bf16(bias).to_le_bytes());
    }
    Ok(())
}

/// Quantize one group into `codes`; returns the f32 scale and bias (before BF16
/// rounding). `base` is the group's first element index, for errors.
#[inline(always)]
fn quantize_group<const BITS: u32>(
    raw: &[u16; GROUP],
    codes: &mut [u32; GROUP],
    base: usize,
) -> Result<(f32, f32), QuantError> {
    let levels = ((1u32 << BITS) - 1) as f32;

    // An exponent of all ones is ±inf or NaN. Checked on the bits so the scan
    // vectorises and nothing below ever sees a NaN.
    let non_finite = raw
        .iter()
        .fold(false, |acc, &b| acc | (b & 0x7F80 == 0x7F80));
    if non_finite {
        let at = raw.iter().position(|&b| b & 0x7F80 == 0x7F80).unwrap_or(0);
        return Err(QuantError::NonFinite { index: base + at });
    }

    let mut vals = [0f32; GROUP];
    for (v, &b) in vals.iter_mut().zip(raw) {
        *v = bf16_to_f32(b);
    }
    // Eight independent lanes so the reduction vectorises; min/max are exact, so
    // the order does not matter.
    let mut mins = [f32::INFINITY; 8];
    let mut maxs = [f32::NEG_INFINITY; 8];
    for chunk in vals.chunks_exact(8) {
        for l in 0..8 {
            let v = chunk[l];
            mins[l] = if v < mins[l] { v } else { mins[l] };
            maxs[l] = if v > maxs[l] { v } else { maxs[l] };
        }
    }
    let w_min = mins
        .iter()
        .fold(f32::INFINITY, |a, &v| if v < a { v } else { a });
    let w_max = maxs
        .iter()
        .fold(f32::NEG_INFINITY, |a, &v| if v > a { v } else { a });

    let span = w_max - w_min;
    if !span.is_finite() {
        return Err(QuantError::RangeOverflow {
            index: base,
            min: w_min,
            max: w_max,
        });
    }
    let use_min = w_min.abs() > w_max.abs();
    let mut scale = span / levels;
    if scale < SCALE_EPS {
        scale = SCALE_EPS;
    }
    let edge = if use_min { w_min } else { w_max };
    if !use_min {
        scale = -scale;
    }
    let q0 = (edge / scale).round_ties_even();
    let mut bias = 0.0f32;
    if q0 != 0.0 {
        scale = edge / q0;
        bias = edge;
    }

    for (c, &v) in codes.iter_mut().zip(&vals) {
        let x = (v - bias) / scale;
        // `x > 0` is false for -0.0 and NaN alike, both of which code as 0.
        let x = if x > 0.0 { x } else { 0.0 };
        let x = if x < levels { x } else { levels };
        *c = (x + ROUND_MAGIC).to_bits() - ROUND_MAGIC.to_bits();
    }
    Ok((scale, bias))
}

/// Pack 64 codes of `BITS` bits into little-endian u32 words, element 0 lowest.
#[inline(always)]
fn pack<const BITS: u32>(codes: &[u32; GROUP], out: &mut [u8]) {
    let per_word = (32 / BITS) as usize;
    for (word_codes, dst) in codes.chunks_exact(per_word).zip(out.chunks_exact_mut(4)) {
        let mut word = 0u32;
        for (k, &c) in word_codes.iter().enumerate() {
            word |= c << (BITS as usize * k);
        }
        dst.copy_from_slice(&word.to_le_bytes());
    }
}

/// Check the packed slices against an output of `n_out` elements.
fn check_dequant_shapes(
    n_out: usize,
    cols: usize,
    bits: Bits,
    weights: &[u8],
    scales: &[u8],
    biases: &[u8],
) -> Result<(), ShapeError> {
    check_shapes(n_out, cols, bits, weights.len(), scales.len(), biases.len())
}

/// Code `k` of a group's packed bytes.
#[inline(always)]
fn code_at(wgroup: &[u8], bits: Bits, k: usize) -> u32 {
    match bits {
        Bits::Four => ((wgroup[k / 2] >> (4 * (k % 2))) & 0x0F) as u32,
        Bits::Eight => wgroup[k] as u32,
    }
}

/// Dequantize whole rows to f32: `w = scale * q + bias` with the BF16 scale and bias
/// widened to f32 (one rounding per operation, no fused multiply-add). `out.len()`
/// sets the number of elements; the packed slices must match it.
pub fn dequantize_rows(
    weights: &[u8],
    scales: &[u8],
    biases: &[u8],
    cols: usize,
    bits: Bits,
    out: &mut [f32],
) -> Result<(), QuantError> {
    check_dequant_shapes(out.len(), cols, bits, weights, scales, biases)?;
    let wbytes = bits.group_weight_bytes();
    for (((o, w), s), b) in out
        .chunks_exact_mut(GROUP)
        .zip(weights.chunks_exact(wbytes))
        .zip(scales.chunks_exact(2))
        .zip(biases.chunks_exact(2))
    {
        let scale = bf16_to_f32(u16::from_le_bytes([s[0], s[1]]));
        let bias = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
        for (k, v) in o.iter_mut().enumerate() {
            *v = scale * code_at(w, bits, k) as f32 + bias;
        }
    }
    Ok(())
}

/// Dequantize whole rows to BF16 bit patterns exactly as MLX's CPU `dequantize` does
/// for BF16 arrays: every operation rounds to BF16, `bf16(bf16(q * scale) + bias)`.
/// For tests and tools that compare against MLX output; the runtime wants
/// [`dequantize_rows`].
pub fn dequantize_rows_bf16(
    weights: &[u8],
    scales: &[u8],
    biases: &[u8],
    cols: usize,
    bits: Bits,
    out: &mut [u16],
) -> Result<(), QuantError> {
    check_dequant_shapes(out.len(), cols, bits, weights, scales, biases)?;
    let wbytes = bits.group_weight_bytes();
    for (((o, w), s), b) in out
        .chunks_exact_mut(GROUP)
        .zip(weights.chunks_exact(wbytes))
        .zip(scales.chunks_exact(2))
        .zip(biases.chunks_exact(2))
    {
        let scale = bf16_to_f32(u16::from_le_bytes([s[0], s[1]]));
        let bias = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
        for (k, v) in o.iter_mut().enumerate() {
            let prod = bf16_to_f32(f32_to_bf16(code_at(w, bits, k) as f32 * scale));
            *v = f32_to_bf16(prod + bias);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Packed weights, scales and biases.
    type Packed = (Vec<u8>, Vec<u8>, Vec<u8>);

    fn quant(src: &[u16], cols: usize, bits: Bits) -> Result<Packed, QuantError> {
        let g = src.len() / GROUP;
        let mut w = vec![0u8; g * bits.group_weight_bytes()];
        let mut s = vec![0u8; g * 2];
        let mut b = vec![0u8; g * 2];
        quantize_rows(src, cols, bits, &mut w, &mut s, &mut b)?;
        Ok((w, s, b))
    }

    #[test]
    fn bf16_rounding_is_nearest_even() {
        // 1.0 + half an ulp of BF16 ties down to 1.0 (even), 1.0 + 1.5 ulp ties up.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F80_8000)), 0x3F80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F81_8000)), 0x3F82);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F80_8001)), 0x3F81);
        assert_eq!(f32_to_bf16(-1e-7), 0xB3D7);
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7F80);
        assert_eq!(
            f32_to_bf16(f32::MAX),
            0x7F80,
            "rounds past the largest BF16"
        );
        assert_eq!(f32_to_bf16(f32::NAN) & 0x7FC0, 0x7FC0);
        for bits in [0u16, 0x8000, 0x0001, 0x3F80, 0xC2F7, 0x7F7F] {
            assert_eq!(f32_to_bf16(bf16_to_f32(bits)), bits);
        }
    }

    #[test]
    fn constant_group_stores_minus_epsilon_scale_and_the_constant() {
        let c = 0xBF40u16; // -0.75
        let (w, s, b) = quant(&[c; 64], 64, Bits::Four).unwrap();
        assert_eq!(w, vec![0u8; 32]);
        assert_eq!(s, 0xB3D7u16.to_le_bytes());
        assert_eq!(b, c.to_le_bytes());
        let (w, s, b) = quant(&[0u16; 64], 64, Bits::Eight).unwrap();
        assert_eq!(w, vec![0u8; 64]);
        assert_eq!(s, 0xB3D7u16.to_le_bytes());
        assert_eq!(b, [0, 0]);
    }

    #[test]
    fn exact_grid_round_trips_and_packs_low_nibble_first() {
        // 0, 1, ..., 15, 0, 1, ... : edge = max = 15, scale = -1, bias = 15, q = 15 - w.
        let src: Vec<u16> = (0..64).map(|k| f32_to_bf16((k % 16) as f32)).collect();
        let (w, s, b) = quant(&src, 64, Bits::Four).unwrap();
        assert_eq!(s, f32_to_bf16(-1.0).to_le_bytes());
        assert_eq!(b, f32_to_bf16(15.0).to_le_bytes());
        // Element 0 (code 15) in the lowest nibble, element 1 (code 14) next.
        assert_eq!(&w[..4], &0x89AB_CDEFu32.to_le_bytes());
        let mut out = [0f32; 64];
        dequantize_rows(&w, &s, &b, 64, Bits::Four, &mut out).unwrap();
        for (k, v) in out.iter().enumerate() {
            assert_eq!(*v, (k % 16) as f32);
        }
    }

    #[test]
    fn shape_errors_name_the_slice() {
        let src = [0u16; 128];
        let mut w = [0u8; 64];
        let mut s = [0u8; 4];
        let mut b = [0u8; 4];
        let e = quantize_rows(&src, 96, Bits::Four, &mut w, &mut s, &mut b).unwrap_err();
        assert_eq!(
            e.to_string(),
            "bad shape: row width 96 is not a positive multiple of the group size 64"
        );
        let e = quantize_rows(&src[..64], 128, Bits::Four, &mut w, &mut s, &mut b).unwrap_err();
        assert_eq!(
            e.to_string(),
            "bad shape: input holds 64 elements, not a whole number of 128-element rows"
        );
        let e = quantize_rows(&src, 64, Bits::Eight, &mut w, &mut s, &mut b).unwrap_err();
        assert_eq!(
            e.to_string(),
            "bad shape: weights slice holds 64 bytes, expected 128"
        );
        let e = quantize_rows(&src, 64, Bits::Four, &mut w, &mut s[..2], &mut b).unwrap_err();
        assert_eq!(
            e.to_string(),
            "bad shape: scales slice holds 2 bytes, expected 4"
        );
        let e = quantize_rows_le_bytes(&[0u8; 129], 64, Bits::Four, &mut w, &mut s, &mut b)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "bad shape: BF16 input holds 129 bytes, an odd number"
        );
    }

    #[test]
    fn span_overflow_is_refused() {
        let mut src = [0u16; 128];
        src[64 + 3] = 0x7F7E; // ~3.38e38
        src[64 + 9] = 0xFEF0; // ~-1.6e38
        let e = quant(&src, 128, Bits::Four).unwrap_err();
        assert!(
            matches!(e, QuantError::RangeOverflow { index: 64, .. }),
            "{e:?}"
        );
    }
}
