//! MXFP4 values: what the bytes of a [`crate::Scheme::Mxfp4`] matrix mean (its sizes
//! are in [`crate::sizes`]). The installer's `--quant bf16` dequantization, the
//! runtime's reference and the tests all read the codes here.
//!
//! The rule (OCP Microscaling Formats v1.0 §5.3.3 E2M1 and §5.4.1 E8M0; MLX's `mxfp4`
//! mode and transformers' `integrations/mxfp4.py` `FP4_VALUES` agree, checked below
//! and in `tests/it/mxfp4.rs` against `mx.dequantize(..., mode="mxfp4")`):
//! - a code is 4 bits, sign in bit 3, magnitude `E2M1[code & 7]` from
//!   {0, 0.5, 1, 1.5, 2, 3, 4, 6};
//! - a row's element `j` is the nibble at bits `4·(j % 8)` of little-endian word
//!   `j / 8`, i.e. byte `j / 2`, low nibble first (gpt-oss's `*_blocks` bytes as
//!   stored, which MLX-LM's `gpt_oss.py` `sanitize` views as U32 unchanged);
//! - a scale byte `e` is `2^(e − 127)`, one per 32 consecutive elements of a row;
//!   `0xFF` is E8M0's NaN and no weight has it.
//!
//! Every product `E2M1 × 2^(e − 127)` is exact in f32 and in BF16 (at most two
//! significant bits) unless it overflows, so the BF16 form is the f32 one truncated.

/// Elements per scale.
pub const GROUP: usize = crate::sizes::MXFP4_GROUP as usize;

/// The E2M1 magnitudes by the code's low three bits.
pub const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// E8M0's NaN: a scale byte no finite weight has.
pub const SCALE_NAN: u8 = 0xFF;

/// The value of code `c` (low 4 bits): sign in bit 3.
pub fn e2m1(c: u8) -> f32 {
    let m = E2M1[(c & 7) as usize];
    if c & 8 != 0 { -m } else { m }
}

/// The value of scale byte `e`: `2^(e − 127)` (`e = 0` is the subnormal `2^−127`;
/// `0xFF` is NaN, which callers refuse before asking).
pub fn scale(e: u8) -> f32 {
    match e {
        0 => f32::from_bits(1 << 22),
        SCALE_NAN => f32::NAN,
        e => f32::from_bits((e as u32) << 23),
    }
}

/// The code of element `j` of a row of packed bytes (low nibble first).
pub fn code(row: &[u8], j: usize) -> u8 {
    (row[j / 2] >> (4 * (j % 2))) & 0xf
}

/// A NaN scale byte, at this index of the scales given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("scale {index} is 0xFF, E8M0's NaN")]
pub struct NanScale {
    /// Index of the scale in the slice.
    pub index: usize,
}

/// The index of the first NaN scale byte (`0xFF`), if any.
pub fn check_scales(scales: &[u8]) -> Result<(), NanScale> {
    match scales.iter().position(|&e| e == SCALE_NAN) {
        Some(index) => Err(NanScale { index }),
        None => Ok(()),
    }
}

/// Dequantize whole rows of `cols` elements to f32: `weights` holds `cols / 2` bytes
/// per row, `scales` `cols / 32` bytes per row, `out` one value per element.
pub fn dequantize_rows(
    weights: &[u8],
    scales: &[u8],
    cols: usize,
    out: &mut [f32],
) -> Result<(), NanScale> {
    check_scales(scales)?;
    for ((w, s), o) in weights
        .chunks_exact(cols / 2)
        .zip(scales.chunks_exact(cols / GROUP))
        .zip(out.chunks_exact_mut(cols))
    {
        for (j, v) in o.iter_mut().enumerate() {
            *v = e2m1(code(w, j)) * scale(s[j / GROUP]);
        }
    }
    Ok(())
}

/// [`dequantize_rows`] as BF16 bit patterns (exact: see the module doc).
pub fn dequantize_rows_bf16(
    weights: &[u8],
    scales: &[u8],
    cols: usize,
    out: &mut [u16],
) -> Result<(), NanScale> {
    check_scales(scales)?;
    for ((w, s), o) in weights
        .chunks_exact(cols / 2)
        .zip(scales.chunks_exact(cols / GROUP))
        .zip(out.chunks_exact_mut(cols))
    {
        for (j, v) in o.iter_mut().enumerate() {
            *v = crate::quant::f32_to_bf16(e2m1(code(w, j)) * scale(s[j / GROUP]));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// transformers' `FP4_VALUES` (`integrations/mxfp4.py`): codes 0..16 in order.
    #[test]
    fn the_codes_are_the_fp4_values_table() {
        let want = [
            0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
        ];
        for (c, w) in want.iter().enumerate() {
            assert_eq!(e2m1(c as u8).to_bits(), f32::to_bits(*w), "code {c}");
        }
        assert_eq!(scale(127), 1.0);
        assert_eq!(scale(128), 2.0);
        assert_eq!(scale(0), 2f32.powi(-127));
        assert_eq!(scale(1), 2f32.powi(-126));
        assert_eq!(scale(254), 2f32.powi(127));
        assert!(scale(SCALE_NAN).is_nan());
    }

    #[test]
    fn rows_read_low_nibble_first_and_nan_scales_are_found() {
        // One row of 32: byte 0 = 0x72 → element 0 is code 2 (1.0), element 1 code 7 (6).
        let mut w = vec![0u8; 16];
        w[0] = 0x72;
        w[15] = 0x9f; // element 30 code 0xf (−6), element 31 code 9 (−0.5)
        let mut out = vec![0f32; 32];
        dequantize_rows(&w, &[128], 32, &mut out).unwrap();
        assert_eq!((out[0], out[1], out[30], out[31]), (2.0, 12.0, -12.0, -1.0));
        assert!(out[2..30].iter().all(|v| *v == 0.0));
        let mut b = vec![0u16; 32];
        dequantize_rows_bf16(&w, &[128], 32, &mut b).unwrap();
        assert_eq!(b[1], 0x4140, "12.0 as BF16");
        assert_eq!(
            dequantize_rows(&w, &[SCALE_NAN], 32, &mut out),
            Err(NanScale { index: 0 })
        );
        assert_eq!(check_scales(&[1, 2, 0xff]), Err(NanScale { index: 2 }));
    }
}
