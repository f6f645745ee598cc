//! The affine quantizer against MLX: the committed golden vectors (MLX 0.32.4: INT4 g64
//! with matvec outputs, and every width × group MLX writes), tile invariance and the
//! refusal of non-finite weights. In gturbo-format's own tests so that CI runs them on
//! aarch64 under qemu too (`scripts/aarch64.sh`); the live cross-check against an MLX
//! install stays in the CLI's integration tests (`tests/it/quant_parity.rs`).

#[path = "support/mlx_cases.rs"]
mod mlx_cases;

use gturbo_format::quant::{
    Bits, GROUP, QuantError, Spec, bf16_to_f32, dequantize_rows, f32_to_bf16, quantize_rows,
    quantize_rows_le_bytes, unpack_codes,
};
use mlx_cases::{compare, load, quantize, sizes};
use std::collections::BTreeSet;

#[test]
fn golden_vectors_match_mlx_bit_for_bit() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/data/mlx_q4g64_golden.json"
    );
    let file = load(path);
    assert_eq!(file.mlx_version, "0.32.4");
    assert_eq!(file.cases.len(), 3);
    for case in &file.cases {
        assert_eq!(
            compare(case),
            [0; 4],
            "{}: mismatches (words, scales, biases, dequant)",
            case.name
        );

        // The byte-input entry point gives the same bytes.
        let cols = case.shape[1];
        let raw: Vec<u8> = case
            .w_bf16_bits
            .iter()
            .flat_map(|b| b.to_le_bytes())
            .collect();
        let q = quantize(&case.w_bf16_bits, cols, Bits::Four).unwrap();
        let (mut w, mut s, mut b) = (
            vec![0u8; q.wbytes.len()],
            vec![0u8; q.sbytes.len()],
            vec![0u8; q.bbytes.len()],
        );
        quantize_rows_le_bytes(&raw, cols, Bits::Four, &mut w, &mut s, &mut b).unwrap();
        assert_eq!(
            (w, s, b),
            (q.wbytes.clone(), q.sbytes.clone(), q.bbytes.clone())
        );

        // f32 dequantization: the matvec with x, accumulated k = 0..K-1 in f32 as
        // MLX's f32 quantized matmul does, reproduces the golden y exactly.
        let mut deq = vec![0f32; case.w_bf16_bits.len()];
        dequantize_rows(&q.wbytes, &q.sbytes, &q.bbytes, cols, Bits::Four, &mut deq).unwrap();
        for (n, want) in case.y_fp32_matvec.iter().enumerate() {
            let row = &deq[n * cols..(n + 1) * cols];
            let y = row
                .iter()
                .zip(&case.x_bf16_bits)
                .fold(0f32, |acc, (&w, &x)| acc + bf16_to_f32(x) * w);
            assert_eq!(
                y.to_bits(),
                want.to_bits(),
                "{} row {n}: y {y} vs {want}",
                case.name
            );
        }
        // MLX's BF16 dequantization rounds twice (after the product, after the sum);
        // each rounding moves the value by at most 2^-8 of its magnitude, so the f32
        // value lies within that of MLX's.
        for (k, (&f, &m)) in deq.iter().zip(&case.dequant_bf16_bits).enumerate() {
            let s = case.scales_bf16_bits[k / GROUP];
            let bound = (bf16_to_f32(s).abs() * 15.0 + f.abs()) / 256.0;
            let diff = (f - bf16_to_f32(m)).abs();
            assert!(
                diff <= bound,
                "{} element {k}: f32 {f} vs MLX bf16 {m:#06x}",
                case.name
            );
        }
    }
}

#[test]
fn every_width_and_group_matches_mlx_golden_vectors() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/data/mlx_quant_widths_golden.json"
    );
    let file = load(path);
    assert_eq!(file.mlx_version, "0.32.4");
    // Exactly one case per spec MLX writes.
    let specs: BTreeSet<String> = file.cases.iter().map(|c| c.spec().to_string()).collect();
    let all: BTreeSet<String> = Spec::all().map(|s| s.to_string()).collect();
    assert_eq!(specs, all);
    assert_eq!(file.cases.len(), 18);
    for case in &file.cases {
        let spec = case.spec();
        let (rows, cols) = (case.shape[0], case.shape[1]);
        assert_eq!(case.w_bf16_bits.len(), rows * cols, "{}", case.name);
        assert_eq!(
            compare(case),
            [0; 4],
            "{}: mismatches (words, scales, biases, dequant)",
            case.name
        );
        let q = quantize(&case.w_bf16_bits, cols, spec).unwrap();
        assert_eq!(
            q.words.len(),
            rows * cols * spec.bits.bits() as usize / 32,
            "{}",
            case.name
        );

        // The byte-input entry point gives the same bytes.
        let raw: Vec<u8> = case
            .w_bf16_bits
            .iter()
            .flat_map(|b| b.to_le_bytes())
            .collect();
        let (mut w, mut s, mut b) = (
            vec![0u8; q.wbytes.len()],
            vec![0u8; q.sbytes.len()],
            vec![0u8; q.bbytes.len()],
        );
        quantize_rows_le_bytes(&raw, cols, spec, &mut w, &mut s, &mut b).unwrap();
        assert!(
            (w, s, b) == (q.wbytes.clone(), q.sbytes.clone(), q.bbytes.clone()),
            "{}: byte entry point differs",
            case.name
        );

        // Unpacking MLX's own words, a row at a time, gives the codes MLX unpacks.
        let golden_bytes: Vec<u8> = case.q_u32.iter().flat_map(|w| w.to_le_bytes()).collect();
        let row_bytes = cols * spec.bits.bits() as usize / 8;
        let mut codes = vec![0u8; cols];
        for r in 0..rows {
            let packed = &golden_bytes[r * row_bytes..(r + 1) * row_bytes];
            unpack_codes(packed, spec.bits, &mut codes).unwrap();
            assert_eq!(
                codes,
                case.codes[r * cols..(r + 1) * cols],
                "{} row {r}: codes",
                case.name
            );
        }

        // f32 dequantization of MLX's own packed bytes is bit-exact with MLX's.
        let le16 = |v: &[u16]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let mut deq = vec![0f32; rows * cols];
        dequantize_rows(
            &golden_bytes,
            &le16(&case.scales_bf16_bits),
            &le16(&case.biases_bf16_bits),
            cols,
            spec,
            &mut deq,
        )
        .unwrap();
        let bad = deq
            .iter()
            .zip(&case.dequant_f32_bits)
            .filter(|(d, m)| d.to_bits() != **m)
            .count();
        assert_eq!(bad, 0, "{}: f32 dequant mismatches", case.name);
        assert_eq!(case.dequant_f32_bits.len(), rows * cols, "{}", case.name);
    }
}

/// A deterministic BF16 matrix (xorshift; values ~N(0, 0.05) with sign mix).
fn random_matrix(rows: usize, cols: usize, mut seed: u64) -> Vec<u16> {
    (0..rows * cols)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let u = (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            f32_to_bf16(u * 0.2 * if seed & 1 == 0 { 1.0 } else { 3.0 })
        })
        .collect()
}

#[test]
fn tiles_of_any_row_count_give_the_same_bytes() {
    let (rows, cols) = (256, 512);
    let src = random_matrix(rows, cols, 0x9E37_79B9_7F4A_7C15);
    for bits in Spec::all() {
        let whole = quantize(&src, cols, bits).unwrap();
        let wrow = cols * bits.bits.bits() as usize / 8;
        let srow = cols / bits.group.size() * 2;
        // 1 row; 3 rows; 8 and 64 rows; 97 rows, which leaves a ragged last tile;
        // the whole matrix.
        for tile in [1, 3, 8, 64, 97, rows] {
            let mut w = vec![0u8; rows * wrow];
            let mut s = vec![0u8; rows * srow];
            let mut b = vec![0u8; rows * srow];
            let mut r0 = 0;
            while r0 < rows {
                let r1 = (r0 + tile).min(rows);
                quantize_rows(
                    &src[r0 * cols..r1 * cols],
                    cols,
                    bits,
                    &mut w[r0 * wrow..r1 * wrow],
                    &mut s[r0 * srow..r1 * srow],
                    &mut b[r0 * srow..r1 * srow],
                )
                .unwrap();
                r0 = r1;
            }
            assert!(w == whole.wbytes, "{bits} tile {tile}: weights differ");
            assert!(s == whole.sbytes, "{bits} tile {tile}: scales differ");
            assert!(b == whole.bbytes, "{bits} tile {tile}: biases differ");
        }
    }
    // One group per row (cols = 64): a tile of one row is exactly one group.
    let src = random_matrix(40, 64, 7);
    let whole = quantize(&src, 64, Bits::Four).unwrap();
    for r in 0..40 {
        let one = quantize(&src[r * 64..(r + 1) * 64], 64, Bits::Four).unwrap();
        assert_eq!(one.wbytes, whole.wbytes[r * 32..(r + 1) * 32], "row {r}");
        assert_eq!(one.sbytes, whole.sbytes[r * 2..(r + 1) * 2], "row {r}");
        assert_eq!(one.bbytes, whole.bbytes[r * 2..(r + 1) * 2], "row {r}");
    }
}

#[test]
fn non_finite_groups_are_refused_with_the_element_index() {
    let cols = 256;
    for (pattern, name) in [
        (0x7F80u16, "+inf"),
        (0xFF80, "-inf"),
        (0x7FC0, "NaN"),
        (0xFFC1, "-NaN"),
    ] {
        let mut src = random_matrix(3, cols, 11);
        // Row 1, group 2, element 5 → flat index 256 + 128 + 5.
        src[cols + 2 * GROUP + 5] = pattern;
        // A later non-finite element in the same group does not change the index.
        src[cols + 2 * GROUP + 40] = 0x7F80;
        for bits in Spec::all() {
            let e = quantize(&src, cols, bits).err();
            assert_eq!(
                e,
                Some(QuantError::NonFinite { index: 389 }),
                "{name} {bits}"
            );
            let raw: Vec<u8> = src.iter().flat_map(|b| b.to_le_bytes()).collect();
            let (wn, sn) = sizes(src.len(), bits);
            let (mut w, mut s, mut b) = (vec![0u8; wn], vec![0u8; sn], vec![0u8; sn]);
            let e = quantize_rows_le_bytes(&raw, cols, bits, &mut w, &mut s, &mut b).unwrap_err();
            assert_eq!(
                e.to_string(),
                "non-finite weight (inf or NaN) at element 389"
            );
        }
    }
    // A NaN group after an +inf group: the first bad group wins.
    let mut src = random_matrix(2, 128, 3);
    src[70] = 0x7F80;
    src[130] = 0x7FC0;
    assert_eq!(
        quantize(&src, 128, Bits::Four).err(),
        Some(QuantError::NonFinite { index: 70 })
    );
}
