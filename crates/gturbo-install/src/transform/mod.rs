//! What happens to bytes between the source and the output: INT4/INT8 affine
//! quantization bit-exact with MLX, in bounded scratch, and the FP8 e4m3 block
//! dequantization ([`fp8`]) that turns an FP8 source into the BF16 the profile applies to,
//! and the transpose of experts stored `[in, out]` ([`transpose`]: gpt-oss).

pub mod fp8;
pub mod int4_ct;
pub mod transpose;

pub use crate::format::quant;

use crate::header::Dtype;

/// The index of the first element of `bytes` (little-endian elements of `dtype`) that
/// is +inf, -inf or NaN; `None` when all are finite or `dtype` is not floating point.
/// Passthrough tensors (norms, biases, any float tensor kept at its dtype) are checked
/// with this, as the quantizer checks matrices: a non-finite weight is a defective
/// checkpoint either way.
pub fn first_non_finite(bytes: &[u8], dtype: Dtype) -> Option<usize> {
    // Per dtype: element size, and the exponent mask (all ones: inf or NaN).
    let (size, mask): (usize, u64) = match dtype {
        Dtype::BF16 => (2, 0x7f80),
        Dtype::F16 => (2, 0x7c00),
        Dtype::F32 => (4, 0x7f80_0000),
        Dtype::F64 => (8, 0x7ff0_0000_0000_0000),
        Dtype::F8_E5M2 => (1, 0x7c),
        // E4M3 (the "fn" variant) has no infinities; NaN is S.1111.111.
        Dtype::F8_E4M3 => {
            return bytes.iter().position(|b| b & 0x7f == 0x7f);
        }
        _ => return None,
    };
    bytes.chunks_exact(size).position(|c| {
        let mut le = [0u8; 8];
        le[..size].copy_from_slice(c);
        u64::from_le_bytes(le) & mask == mask
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_float_dtype_finds_inf_and_nan_and_integers_are_never_checked() {
        let bf16 = |v: f32| ((v.to_bits() >> 16) as u16).to_le_bytes();
        let mut b: Vec<u8> = [1.0f32, -2.5, 0.0].iter().flat_map(|&v| bf16(v)).collect();
        assert_eq!(first_non_finite(&b, Dtype::BF16), None);
        b.extend(bf16(f32::NAN));
        assert_eq!(first_non_finite(&b, Dtype::BF16), Some(3));
        let f16 = |bits: u16| bits.to_le_bytes();
        let h: Vec<u8> = [0x3c00u16, 0xfc00].iter().flat_map(|&x| f16(x)).collect();
        assert_eq!(first_non_finite(&h, Dtype::F16), Some(1), "-inf");
        let f: Vec<u8> = [1.0f32, f32::MAX, f32::INFINITY]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(first_non_finite(&f, Dtype::F32), Some(2));
        let d: Vec<u8> = [f64::MIN_POSITIVE, f64::NAN]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(first_non_finite(&d, Dtype::F64), Some(1));
        assert_eq!(first_non_finite(&[0x3c, 0x7c], Dtype::F8_E5M2), Some(1));
        assert_eq!(first_non_finite(&[0x7e, 0xff], Dtype::F8_E4M3), Some(1));
        // The same bytes as integers are just numbers.
        assert_eq!(first_non_finite(&f, Dtype::I32), None);
        assert_eq!(first_non_finite(&b, Dtype::U16), None);
    }
}
