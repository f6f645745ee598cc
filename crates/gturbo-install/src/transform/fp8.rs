//! FP8 e4m3 block-scaled weights (DeepSeek-V3/R1, Kimi-K2, MiniMax-M2): a weight
//! `[rows, cols]` of F8_E4M3 codes and its F32 `weight_scale_inv`
//! `[ceil(rows/128), ceil(cols/128)]`, one scale per 128×128 block, the blocks at the
//! right and bottom edges partial.
//!
//! The rule is MLX-LM's (mlx-lm 0.32.2, `mlx_lm/models/deepseek_v3.py`,
//! `Model.sanitize`, its inner `dequant`):
//!
//! ```python
//! weight = mx.from_fp8(weight, dtype=mx.bfloat16)
//! bs = 128  # block size
//! ... pad to whole blocks, reshape to (m/bs, bs, n/bs, bs) ...
//! weight = (weight * scale_inv[:, None, :, None]).reshape(...)
//! return weight[:m, :n].astype(dtype)    # dtype = mx.bfloat16
//! ```
//!
//! `from_fp8` to BF16 is exact (every e4m3 value is a BF16 value), the product of a
//! BF16 and an F32 array is F32 in MLX (one f32 rounding), and `astype(bfloat16)`
//! rounds that to nearest even: each element is
//! `bf16_round(f32(fp8) × scale_inv[row / 128][col / 128])`. The padding only fills
//! the partial edge blocks with zeros that are cut off again, so an element's block is
//! just its row and column divided by 128.
//!
//! The e4m3 here is the "fn" variant (OCP FP8 E4M3, PyTorch `float8_e4m3fn`): bias 7,
//! no infinities, `S.1111.111` (0x7f, 0xff) the only NaNs, largest finite ±448.

use crate::format::quant::f32_to_bf16;

/// Rows and columns of one scale block (MLX-LM's `bs = 128`; the config's
/// `weight_block_size` must say `[128, 128]`).
pub const BLOCK: u64 = 128;

/// Scale blocks along an axis of `n` elements (the last one partial).
pub fn blocks(n: u64) -> u64 {
    n.div_ceil(BLOCK)
}

/// Whether byte `b` is an e4m3 NaN (`S.1111.111`).
#[inline(always)]
pub fn is_nan(b: u8) -> bool {
    b & 0x7f == 0x7f
}

/// The value of e4m3 code `b` as f32 (exact); NaN for the two NaN codes.
#[inline(always)]
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = ((b & 0x80) as u32) << 24;
    let exp = ((b >> 3) & 0x0f) as u32;
    let man = (b & 0x07) as u32;
    if is_nan(b) {
        return f32::NAN;
    }
    let magnitude = if exp == 0 {
        // Subnormal: man/8 × 2^(1-7), exact in f32.
        man as f32 * (1.0 / 512.0)
    } else {
        // Normal: rebias 7 → 127, the 3 mantissa bits on top of f32's 23.
        f32::from_bits(((exp + 120) << 23) | (man << 20))
    };
    f32::from_bits(magnitude.to_bits() | sign)
}

/// Why a band of FP8 rows cannot be dequantized.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Fp8Error {
    /// An e4m3 NaN code in the weight.
    #[error(
        "element {element} is an e4m3 NaN (0x{byte:02x}); refusing to install a defective checkpoint"
    )]
    Nan {
        /// Flat element index in the tensor.
        element: u64,
        /// The code.
        byte: u8,
    },
    /// A scale that is inf or NaN.
    #[error("block [{row}, {col}] of `weight_scale_inv` is {value}; a block scale must be finite")]
    NonFiniteScale {
        /// Block row.
        row: u64,
        /// Block column.
        col: u64,
        /// The scale.
        value: f32,
    },
    /// The slices do not fit the shape (a bug in the caller).
    #[error("{0}")]
    Shape(String),
}

/// Dequantize rows `row0..row0 + src.len() / cols` of an FP8 weight `cols` wide into
/// BF16 bit patterns `out`, as MLX-LM's `sanitize` does (see the module doc).
///
/// `scales` holds the little-endian F32 scale rows `row0 / 128 ..` of the tensor's
/// `weight_scale_inv` (each `ceil(cols / 128)` wide), as many as the rows need. The
/// rows may start and end anywhere: each row picks its own scale row.
pub fn dequantize_rows(
    src: &[u8],
    row0: u64,
    cols: usize,
    scales: &[u8],
    out: &mut [u16],
) -> Result<(), Fp8Error> {
    if cols == 0 || !src.len().is_multiple_of(cols) || out.len() != src.len() {
        return Err(Fp8Error::Shape(format!(
            "{} FP8 bytes and {} outputs for rows {cols} wide",
            src.len(),
            out.len()
        )));
    }
    let per = blocks(cols as u64) as usize;
    let rows = src.len() / cols;
    let srow0 = row0 / BLOCK;
    let need = if rows == 0 {
        0
    } else {
        ((row0 + rows as u64 - 1) / BLOCK - srow0 + 1) as usize
    };
    if scales.len() < need * per * 4 {
        return Err(Fp8Error::Shape(format!(
            "{} scale bytes for {need} scale rows of {per}",
            scales.len()
        )));
    }
    // The scales of each scale row, decoded and checked once per row band.
    let mut band = vec![0f32; per];
    let mut band_at = u64::MAX;
    for (r, (row, out_row)) in src
        .chunks_exact(cols)
        .zip(out.chunks_exact_mut(cols))
        .enumerate()
    {
        let abs = row0 + r as u64;
        let srow = abs / BLOCK;
        if srow != band_at {
            let at = ((srow - srow0) as usize) * per * 4;
            for (c, s) in band.iter_mut().enumerate() {
                let b = &scales[at + 4 * c..at + 4 * c + 4];
                *s = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                if !s.is_finite() {
                    return Err(Fp8Error::NonFiniteScale {
                        row: srow,
                        col: c as u64,
                        value: *s,
                    });
                }
            }
            band_at = srow;
        }
        for (c, (&b, o)) in row.iter().zip(out_row.iter_mut()).enumerate() {
            if is_nan(b) {
                return Err(Fp8Error::Nan {
                    element: abs * cols as u64 + c as u64,
                    byte: b,
                });
            }
            *o = f32_to_bf16(e4m3_to_f32(b) * band[c / BLOCK as usize]);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::quant::bf16_to_f32;

    /// The e4m3fn value of `b` from its definition, computed independently of the bit
    /// manipulation above: `(-1)^s × 2^(e-7) × (1 + m/8)`, or `(-1)^s × 2^-6 × m/8`
    /// for `e == 0`, in f64.
    fn reference(b: u8) -> Option<f64> {
        let (s, e, m) = (b >> 7, (b >> 3) & 15, b & 7);
        if e == 15 && m == 7 {
            return None;
        }
        let sign = if s == 1 { -1.0 } else { 1.0 };
        let v = if e == 0 {
            2f64.powi(-6) * (m as f64 / 8.0)
        } else {
            2f64.powi(e as i32 - 7) * (1.0 + m as f64 / 8.0)
        };
        Some(sign * v)
    }

    #[test]
    fn every_e4m3_code_decodes_to_its_value() {
        let mut nans = 0;
        for b in 0..=255u8 {
            let v = e4m3_to_f32(b);
            match reference(b) {
                None => {
                    assert!(v.is_nan() && is_nan(b), "{b:#04x}");
                    nans += 1;
                }
                Some(r) => {
                    assert!(!is_nan(b), "{b:#04x}");
                    assert_eq!(v as f64, r, "{b:#04x}");
                    // Sign of zero kept (0x80 is -0.0).
                    assert_eq!(v.is_sign_negative(), b & 0x80 != 0, "{b:#04x}");
                }
            }
        }
        assert_eq!(nans, 2);
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0xfe), -448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x38), 1.0);
    }

    /// `rows × cols` FP8 codes (every finite code in turn) and per-block scales.
    fn case(rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
        let finite: Vec<u8> = (0..=255u8).filter(|&b| !is_nan(b)).collect();
        let w = (0..rows * cols)
            .map(|i| finite[(i * 7 + i / cols) % finite.len()])
            .collect();
        let (br, bc) = (blocks(rows as u64) as usize, blocks(cols as u64) as usize);
        let s = (0..br * bc)
            .map(|i| 0.000_173 * (1.0 + i as f32 * 0.37))
            .collect();
        (w, s)
    }

    fn le(s: &[f32]) -> Vec<u8> {
        s.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn blocks_pick_their_scale_and_partial_edge_blocks_work_from_any_row() {
        // 300 × 200: blocks of 128 rows (128, 128, 44) and 128 columns (128, 72).
        let (rows, cols) = (300usize, 200usize);
        let (w, s) = case(rows, cols);
        let bc = blocks(cols as u64) as usize;
        assert_eq!((blocks(rows as u64), bc), (3, 2));
        let expect: Vec<u16> = (0..rows * cols)
            .map(|i| {
                let (r, c) = (i / cols, i % cols);
                let v = reference(w[i]).unwrap() as f32 * s[(r / 128) * bc + c / 128];
                f32_to_bf16(v)
            })
            .collect();
        let mut all = vec![0u16; rows * cols];
        dequantize_rows(&w, 0, cols, &le(&s), &mut all).unwrap();
        assert_eq!(all, expect);
        // A few outputs by hand: the element's own block's scale, f32 product, BF16.
        let at = |r: usize, c: usize| bf16_to_f32(all[r * cols + c]);
        let by_hand = |r: usize, c: usize, br: usize, bcol: usize| {
            bf16_to_f32(f32_to_bf16(
                e4m3_to_f32(w[r * cols + c]) * s[br * bc + bcol],
            ))
        };
        assert_eq!(at(299, 199), by_hand(299, 199, 2, 1));
        assert_eq!(at(127, 128), by_hand(127, 128, 0, 1));
        assert_eq!(at(128, 127), by_hand(128, 127, 1, 0));
        // Tiles cut anywhere (across block edges, starting mid-band) give the same.
        for (r0, r1) in [(0, 1), (5, 131), (127, 129), (250, 300), (128, 256)] {
            let srow0 = r0 / 128;
            let scales = le(&s[srow0 * bc..]);
            let mut out = vec![0u16; (r1 - r0) * cols];
            dequantize_rows(&w[r0 * cols..r1 * cols], r0 as u64, cols, &scales, &mut out).unwrap();
            assert_eq!(out, expect[r0 * cols..r1 * cols], "rows {r0}..{r1}");
        }
    }

    #[test]
    fn nan_codes_and_non_finite_scales_are_errors() {
        let (mut w, mut s) = case(130, 64);
        w[129 * 64 + 3] = 0xff;
        let mut out = vec![0u16; w.len()];
        let e = dequantize_rows(&w, 0, 64, &le(&s), &mut out).unwrap_err();
        assert_eq!(
            e.to_string(),
            "element 8259 is an e4m3 NaN (0xff); refusing to install a defective checkpoint"
        );
        w[129 * 64 + 3] = 0x7f;
        assert!(matches!(
            dequantize_rows(&w, 0, 64, &le(&s), &mut out),
            Err(Fp8Error::Nan { byte: 0x7f, .. })
        ));
        w[129 * 64 + 3] = 0;
        s[1] = f32::INFINITY;
        let e = dequantize_rows(&w, 0, 64, &le(&s), &mut out).unwrap_err();
        assert_eq!(
            e.to_string(),
            "block [1, 0] of `weight_scale_inv` is inf; a block scale must be finite"
        );
        s[1] = f32::NAN;
        assert!(matches!(
            dequantize_rows(&w, 0, 64, &le(&s), &mut out),
            Err(Fp8Error::NonFiniteScale { row: 1, col: 0, .. })
        ));
        // Too few scale rows for the rows asked for is a shape error, not a panic.
        assert!(matches!(
            dequantize_rows(&w, 0, 64, &le(&s[..1]), &mut out),
            Err(Fp8Error::Shape(_))
        ));
    }
}
