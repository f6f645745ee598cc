//! Compressed-tensors INT4 (`quant_method: compressed-tensors`, `format:
//! pack-quantized`, 4 bits, group 32, symmetric: Kimi-K2-Thinking's routed experts)
//! as MLX affine 4-bit g32, losslessly.
//!
//! # The two layouts
//! - compressed-tensors stores `P.weight_packed` I32 `[rows, cols / 8]`,
//!   `P.weight_scale` BF16 `[rows, cols / 32]` and `P.weight_shape` I32 `[2]`. Its
//!   `pack_to_int32` (`compressed_tensors/compressors/quantized_compressors/
//!   pack_quantized.py`) shifts each signed code to unsigned (`q + 8`, `offset = 1 <<
//!   (num_bits - 1)`) and ORs column `8k + i` into word `k` at bits `4i`
//!   (`packed |= value[:, i::pack_factor] << num_bits * i`): low nibble first, eight
//!   consecutive columns per little-endian word. `unpack_from_int32` undoes it and
//!   subtracts the offset; `dequantize` is `scale × (q − 8)`.
//! - MLX affine 4-bit packs eight consecutive columns per U32 word, column `8k + i` at
//!   bits `4i` too, and dequantizes `scale × q + bias` per group.
//!
//! So the words are MLX's unchanged, `scales = weight_scale`, and `biases = −8 ×
//! scale`: exactly what MLX-LM's `deepseek_v3.py` `sanitize` does (`weight_packed
//! .view(mx.uint32)`, `scales = s`, `biases = -8 * s`). `−8 × s` is exact in BF16 (a
//! power of two: the exponent moves by 3) unless it overflows, and `scale × q − 8 ×
//! scale` is exact in f32 (a 4-bit code times an 8-bit mantissa), so the MLX form
//! dequantizes, rounded once to BF16, to `bf16_round(scale × (q − 8))`, the rule
//! [`dequantize_rows`] implements for `--quant bf16`.

use crate::format::quant::{bf16_to_f32, f32_to_bf16};

/// Bits per code.
pub const BITS: u32 = 4;
/// Columns per scale (`group_size` of the `pack-quantized` scheme Kimi ships).
pub const GROUP: usize = 32;
/// Codes per packed 32-bit word.
pub const PER_WORD: usize = 32 / BITS as usize;
/// `pack_to_int32`'s shift to unsigned, `1 << (num_bits - 1)`.
pub const OFFSET: i32 = 1 << (BITS - 1);

/// A scale the conversion cannot carry: not finite, or `−8 × scale` past BF16's range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("scale {index} ({value:#06x} as BF16) is not finite or overflows when multiplied by -8")]
pub struct BadScale {
    /// Index of the scale in the slice.
    pub index: usize,
    /// Its BF16 bits.
    pub value: u16,
}

/// MLX's biases for compressed-tensors scales: `−8 × s` per BF16 scale (little-endian
/// bytes in, little-endian bytes out, `out.len() == scales.len()`).
pub fn mlx_biases(scales: &[u8], out: &mut [u8]) -> Result<(), BadScale> {
    for (index, (s, o)) in scales
        .chunks_exact(2)
        .zip(out.chunks_exact_mut(2))
        .enumerate()
    {
        let value = u16::from_le_bytes([s[0], s[1]]);
        let b = -(OFFSET as f32) * bf16_to_f32(value);
        let bits = f32_to_bf16(b);
        if !b.is_finite() || bf16_to_f32(bits) != b {
            return Err(BadScale { index, value });
        }
        o.copy_from_slice(&bits.to_le_bytes());
    }
    Ok(())
}

/// The unsigned code of column `col` in a row of packed words (little-endian bytes).
pub fn code(words: &[u8], col: usize) -> u8 {
    let w = col / PER_WORD;
    let word = u32::from_le_bytes([
        words[4 * w],
        words[4 * w + 1],
        words[4 * w + 2],
        words[4 * w + 3],
    ]);
    ((word >> (BITS as usize * (col % PER_WORD))) & 0xf) as u8
}

/// Dequantize whole rows of `cols` columns to BF16 little-endian bytes:
/// `bf16_round(scale × (q − 8))` (compressed-tensors' `dequantize`, one rounding).
/// `words` holds `cols / 8` words per row and `scales` `cols / 32` BF16 scales per
/// row; `out` is 2 bytes per element.
pub fn dequantize_rows(words: &[u8], scales: &[u8], cols: usize, out: &mut [u8]) {
    let (wrow, srow) = (cols / PER_WORD * 4, cols / GROUP * 2);
    for ((w, s), o) in words
        .chunks_exact(wrow)
        .zip(scales.chunks_exact(srow))
        .zip(out.chunks_exact_mut(cols * 2))
    {
        for (c, e) in o.chunks_exact_mut(2).enumerate() {
            let g = 2 * (c / GROUP);
            let scale = bf16_to_f32(u16::from_le_bytes([s[g], s[g + 1]]));
            let q = code(w, c) as i32 - OFFSET;
            e.copy_from_slice(&f32_to_bf16(scale * q as f32).to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::quant::{Spec, dequantize_rows as mlx_dequantize};

    /// `pack_to_int32` as compressed-tensors writes it, from signed codes in
    /// `-8..=7`: shift to unsigned, then column `8k + i` into word `k` at bits `4i`.
    fn pack_to_int32(codes: &[i8], cols: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for row in codes.chunks_exact(cols) {
            for k in 0..cols / PER_WORD {
                let mut word = 0u32;
                for i in 0..PER_WORD {
                    let v = (row[k * PER_WORD + i] as i32 + OFFSET) as u32;
                    word |= v << (BITS as usize * i);
                }
                out.extend(word.to_le_bytes());
            }
        }
        out
    }

    /// Seeded codes in `-8..=7` and positive BF16 scales.
    fn fixture(rows: usize, cols: usize) -> (Vec<i8>, Vec<u8>) {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let codes = (0..rows * cols).map(|_| (next() % 16) as i8 - 8).collect();
        let scales = (0..rows * cols / GROUP)
            .flat_map(|_| {
                let s = (next() % 1000 + 1) as f32 * 1e-5;
                f32_to_bf16(s).to_le_bytes()
            })
            .collect();
        (codes, scales)
    }

    /// Both forms dequantize to the same BF16, element for element: the
    /// compressed-tensors rule on the packed words, and MLX's affine dequantization
    /// (`scale × q + bias`, f32, rounded once) of the same words with `biases = −8 ×
    /// scales`; and the codes read back are the ones packed (low nibble first).
    #[test]
    fn compressed_tensors_int4_is_mlx_affine_4bit_g32_with_biases_minus_8_scale() {
        let (rows, cols) = (3, 96);
        let (codes, scales) = fixture(rows, cols);
        let words = pack_to_int32(&codes, cols);
        assert_eq!(words.len(), rows * cols / 2);
        for (i, &q) in codes.iter().enumerate() {
            let row = &words[(i / cols) * cols / 2..][..cols / 2];
            assert_eq!(code(row, i % cols) as i32 - OFFSET, q as i32, "element {i}");
        }
        // The first word holds columns 0..8, column 0 in the low nibble.
        assert_eq!(words[0] & 0xf, (codes[0] as i32 + OFFSET) as u8);
        assert_eq!(words[0] >> 4, (codes[1] as i32 + OFFSET) as u8);
        let mut ct = vec![0u8; rows * cols * 2];
        dequantize_rows(&words, &scales, cols, &mut ct);
        let mut biases = vec![0u8; scales.len()];
        mlx_biases(&scales, &mut biases).unwrap();
        let mut f = vec![0f32; rows * cols];
        let spec = Spec::from_numbers(4, 32).unwrap();
        mlx_dequantize(&words, &scales, &biases, cols, spec, &mut f).unwrap();
        let mlx: Vec<u8> = f
            .iter()
            .flat_map(|v| f32_to_bf16(*v).to_le_bytes())
            .collect();
        assert!(ct == mlx, "the two forms differ");
        // And both are the rule, recomputed here from the signed codes.
        for (i, &q) in codes.iter().enumerate() {
            let g = 2 * ((i / cols) * (cols / GROUP) + (i % cols) / GROUP);
            let s = bf16_to_f32(u16::from_le_bytes([scales[g], scales[g + 1]]));
            let want = f32_to_bf16(s * q as f32);
            assert_eq!(u16::from_le_bytes([ct[2 * i], ct[2 * i + 1]]), want, "{i}");
        }
    }

    #[test]
    fn biases_are_exact_and_bad_scales_are_named() {
        let scales: Vec<u8> = [0x3c00u16, 0x0001, 0x8000 | 0x3f80]
            .iter()
            .flat_map(|s| s.to_le_bytes())
            .collect();
        let mut out = vec![0u8; scales.len()];
        mlx_biases(&scales, &mut out).unwrap();
        let got: Vec<u16> = out
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        // −8 × 2^-7 = −2^-4; −8 × the smallest subnormal; −8 × −1 = 8.
        assert_eq!(got, [0xbd80, 0x8008, 0x4100]);
        for bad in [0x7f80u16, 0x7fc0, 0x7f7f] {
            let e = mlx_biases(&bad.to_le_bytes(), &mut [0u8; 2]).unwrap_err();
            assert_eq!(
                e,
                BadScale {
                    index: 0,
                    value: bad
                }
            );
        }
    }
}
