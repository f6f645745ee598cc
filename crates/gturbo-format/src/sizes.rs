//! The byte sizes of stored matrices: the one definition of how many bytes a quantized
//! (or passthrough) `[rows, cols]` matrix takes in an install. The planner, the
//! installer's row placement, verify-install, the runtime loader, the quantizer and the
//! CPU kernels all ask this module, so a width or group size is added here once.
//!
//! # MLX's affine layout
//! A matrix `[rows, cols]` quantized with `bits` per code and groups of `group`
//! consecutive elements along a row is stored as MLX stores it:
//! - weights: little-endian U32 words `[rows, cols * bits / 32]`. Each row is a dense
//!   little-endian bitstream (element `k` at bit `k * bits` of the row), so at 2, 4 and
//!   8 bits a word holds `32 / bits` whole codes, and at 3, 5 and 6 bits codes straddle
//!   words. Either way a row is `cols * bits / 32` words, which needs
//!   `cols * bits % 32 == 0`.
//! - scales, then biases: `[rows, cols / group]` in the model dtype ([`SCALE_BYTES`]
//!   each: BF16 today).
//!
//! A group never crosses a row, so row `r` of every part starts at `r` times the row's
//! bytes ([`Affine::row_sizes`]), and a tile of whole rows is a plain sub-slice.
//!
//! # MLX's `mxfp4` layout
//! [`Scheme::Mxfp4`] stores a `[rows, cols]` matrix as `mx.quantize(w, group_size=32,
//! bits=4, mode="mxfp4")` returns it (MLX 0.32.4, checked in
//! `crate::mxfp4`'s tests against the peers' venv):
//! - weights: little-endian U32 words `[rows, cols / 8]`, element `j` of a row at bits
//!   `4·(j % 8)` of word `j / 8` (low nibble first): 4-bit E2M1 codes;
//! - scales: U8 `[rows, cols / 32]`, one E8M0 exponent per group of 32;
//! - no biases.
//!
//! # What is accepted where
//! [`Affine`] admits every width and group MLX writes ([`Affine::BITS`] ×
//! [`Affine::GROUPS`]), and its arithmetic is checked: a hostile shape gives `None`,
//! never an overflow. An install may hold every one of them ([`Scheme::Affine`]); the
//! readers refuse any other scheme name.

use serde::{Deserialize, Serialize};

use super::{PAGE, Scheme};

/// Bytes of one scale (and of one bias): MLX stores them in the model dtype, BF16 for
/// every source gturbo installs today.
pub const SCALE_BYTES: u64 = 2;

/// Bits per MXFP4 code (E2M1).
pub const MXFP4_BITS: u32 = 4;
/// Elements per MXFP4 scale (the OCP microscaling block; MLX's `mxfp4` group).
pub const MXFP4_GROUP: u64 = 32;

/// Bytes of a `[rows, cols]` MXFP4 matrix: weights `rows * cols / 2`, scales
/// `rows * cols / 32` (one byte each), no biases; `None` unless `cols` is a positive
/// multiple of [`MXFP4_GROUP`], or when a size overflows 64 bits.
pub fn mxfp4_sizes(rows: u64, cols: u64) -> Option<QuantSizes> {
    if cols == 0 || !cols.is_multiple_of(MXFP4_GROUP) {
        return None;
    }
    let weights = rows.checked_mul(cols / 2)?;
    let scales = rows.checked_mul(cols / MXFP4_GROUP)?;
    weights.checked_add(scales)?;
    Some(QuantSizes {
        weights,
        scales,
        biases: 0,
    })
}

/// An affine quantization layout: `bits` per code, `group` elements per scale and bias.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Affine {
    bits: u32,
    group: u32,
}

/// Byte sizes of one stored matrix: packed weights, scales, biases. For a passthrough
/// matrix `weights` is its data and `scales` and `biases` are 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuantSizes {
    /// Packed weight bytes (data bytes for passthrough).
    pub weights: u64,
    /// Scale bytes.
    pub scales: u64,
    /// Bias bytes.
    pub biases: u64,
}

impl Affine {
    /// INT4 in groups of 64.
    pub const INT4_G64: Affine = Affine { bits: 4, group: 64 };
    /// INT8 in groups of 64.
    pub const INT8_G64: Affine = Affine { bits: 8, group: 64 };

    /// The code widths MLX's affine `quantize` writes.
    pub const BITS: [u32; 6] = [2, 3, 4, 5, 6, 8];
    /// The group sizes MLX's affine `quantize` writes.
    pub const GROUPS: [u32; 3] = [32, 64, 128];

    /// The layout with `bits` per code and groups of `group`; `None` unless both are
    /// ones MLX writes ([`Affine::BITS`], [`Affine::GROUPS`]).
    pub const fn new(bits: u32, group: u32) -> Option<Affine> {
        let mut b = false;
        let mut i = 0;
        while i < Self::BITS.len() {
            b |= Self::BITS[i] == bits;
            i += 1;
        }
        let mut g = false;
        let mut i = 0;
        while i < Self::GROUPS.len() {
            g |= Self::GROUPS[i] == group;
            i += 1;
        }
        if b && g {
            Some(Affine { bits, group })
        } else {
            None
        }
    }

    /// Bits per code.
    pub const fn bits(self) -> u32 {
        self.bits
    }

    /// Elements per group.
    pub const fn group(self) -> u32 {
        self.group
    }

    /// The scheme name this layout is written under: `int{bits}_g{group}` (`int4_g64`).
    pub fn label(self) -> String {
        format!("int{}_g{}", self.bits, self.group)
    }

    /// Whether a row of `cols` elements can be stored: a positive multiple of the group
    /// whose codes fill whole u32 words.
    pub fn fits(self, cols: u64) -> bool {
        cols > 0
            && cols.is_multiple_of(self.group as u64)
            && cols
                .checked_mul(self.bits as u64)
                .is_some_and(|b| b.is_multiple_of(32))
    }

    /// Bytes of one stored row of `cols` elements; `None` when [`Affine::fits`] says no
    /// or a size overflows.
    pub fn row_sizes(self, cols: u64) -> Option<QuantSizes> {
        self.sizes(1, cols)
    }

    /// Bytes of a `[rows, cols]` matrix: weights `rows * cols * bits / 8`, scales and
    /// biases `rows * cols / group * SCALE_BYTES` each; `None` when a row does not fit
    /// ([`Affine::fits`]) or a size overflows 64 bits.
    pub fn sizes(self, rows: u64, cols: u64) -> Option<QuantSizes> {
        if !self.fits(cols) {
            return None;
        }
        let words = cols.checked_mul(self.bits as u64)? / 32;
        let weights = rows.checked_mul(words)?.checked_mul(4)?;
        let scales = rows
            .checked_mul(cols / self.group as u64)?
            .checked_mul(SCALE_BYTES)?;
        // The sum must fit too: callers add the three.
        weights.checked_add(scales)?.checked_add(scales)?;
        Some(QuantSizes {
            weights,
            scales,
            biases: scales,
        })
    }
}

impl QuantSizes {
    /// Total bytes: weights, scales and biases (never overflows: the constructors
    /// check the sum).
    pub fn total(&self) -> u64 {
        self.weights + self.scales + self.biases
    }
}

impl Scheme {
    /// Stored bytes of a `[rows, cols]` matrix whose source elements are `elem_bytes`
    /// wide: the affine sizes for a quantized scheme, `rows * cols * elem_bytes` data
    /// bytes for passthrough. `None` when the shape has no layout under the scheme
    /// (see [`Affine::fits`]) or a size overflows 64 bits.
    pub fn sizes(self, rows: u64, cols: u64, elem_bytes: u64) -> Option<QuantSizes> {
        if self == Scheme::Mxfp4 {
            return mxfp4_sizes(rows, cols);
        }
        match self.affine() {
            Some(a) => a.sizes(rows, cols),
            None => Some(QuantSizes {
                weights: rows.checked_mul(cols)?.checked_mul(elem_bytes)?,
                scales: 0,
                biases: 0,
            }),
        }
    }

    /// Stored bytes of one row of `cols` elements: [`Scheme::sizes`] of `[1, cols]`.
    pub fn row_sizes(self, cols: u64, elem_bytes: u64) -> Option<QuantSizes> {
        self.sizes(1, cols, elem_bytes)
    }

    /// Whether a row of `cols` elements can be stored under this scheme (always, for
    /// passthrough).
    pub fn fits(self, cols: u64) -> bool {
        match self {
            Scheme::Mxfp4 => mxfp4_sizes(1, cols).is_some(),
            s => s.affine().is_none_or(|a| a.fits(cols)),
        }
    }
}

/// The rows and columns of a tensor of `shape` as a matrix: the last axis is the row,
/// the others multiply into the row count (a 1-D tensor is one row, a scalar one
/// element). `None` when the element count overflows 64 bits.
pub fn matrix_dims(shape: &[u64]) -> Option<(u64, u64)> {
    let elems = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?;
    match shape.last() {
        None => Some((1, 1)),
        Some(0) => Some((0, 0)),
        Some(&cols) => Some((elems / cols, cols)),
    }
}

/// Geometry of a row-lookup pool region: rows packed into [`PAGE`]-sized blocks,
/// never straddling a block, slack zeroed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowBlocks {
    /// Bytes of one stored row.
    pub row_bytes: u64,
    /// Rows in one block: `PAGE / row_bytes`.
    pub rows_per_block: u64,
    /// Blocks for `rows` rows.
    pub blocks: u64,
    /// Region bytes: `blocks * PAGE`.
    pub region_bytes: u64,
}

impl RowBlocks {
    /// Geometry for `rows` rows of `row_bytes` each; `None` when a row does not fit
    /// a block or sizes overflow.
    pub fn new(rows: u64, row_bytes: u64) -> Option<RowBlocks> {
        if row_bytes == 0 || row_bytes > PAGE {
            return None;
        }
        let rows_per_block = PAGE / row_bytes;
        let blocks = rows.div_ceil(rows_per_block);
        Some(RowBlocks {
            row_bytes,
            rows_per_block,
            blocks,
            region_bytes: blocks.checked_mul(PAGE)?,
        })
    }

    /// Byte offset of row `i` inside its region.
    pub fn row_offset(&self, i: u64) -> u64 {
        (i / self.rows_per_block) * PAGE + (i % self.rows_per_block) * self.row_bytes
    }
}

/// Bytes of one stored row-pool row of `width` elements of `elem_bytes` under
/// `scheme`: a quantized row is its packed weights, then its scales, then its biases;
/// a passthrough row is the source bytes (`width * elem_bytes`).
pub fn row_bytes(width: u64, elem_bytes: u64, scheme: Scheme) -> Option<u64> {
    scheme.row_sizes(width, elem_bytes).map(|s| s.total())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::align_up;

    fn a(bits: u32, group: u32) -> Affine {
        Affine::new(bits, group).unwrap()
    }

    /// Qwen3.8-Flash-Next routed expert: gate/up [640, 2560], down [2560, 640].
    #[test]
    fn flash_next_expert_blob_and_stride() {
        let gate = a(4, 64).sizes(640, 2560).unwrap();
        assert_eq!(
            (gate.weights, gate.scales, gate.biases),
            (819_200, 51_200, 51_200)
        );
        let down = a(4, 64).sizes(2560, 640).unwrap();
        let blob = 2 * gate.total() + down.total();
        assert_eq!(blob, 2_764_800);
        assert_eq!(align_up(blob, PAGE), Some(2_768_896));
        assert_eq!(2_768_896 / PAGE, 169);
        // Router at INT8: 1,392,640 B.
        assert_eq!(a(8, 64).sizes(512, 2560).unwrap().total(), 1_392_640);
        assert_eq!(a(4, 64).sizes(512, 2560).unwrap().total(), 737_280);
        assert_eq!(
            Scheme::Int8G64.sizes(512, 2560, 2),
            a(8, 64).sizes(512, 2560)
        );
    }

    #[test]
    fn flash_next_row_pool_geometry() {
        let rb = row_bytes(160, 2, Scheme::Int4G64);
        assert_eq!(rb, None, "160 is not a multiple of 64");
        let rb = row_bytes(160, 2, Scheme::Passthrough).unwrap();
        let g = RowBlocks::new(2_500_012, rb).unwrap();
        assert_eq!((g.row_bytes, g.rows_per_block, g.blocks), (320, 51, 49_020));
        assert_eq!(g.region_bytes, 803_143_680);
        assert_eq!(g.region_bytes * 128, 102_802_391_040);
        assert_eq!(g.row_offset(50), 50 * 320);
        assert_eq!(g.row_offset(51), PAGE);
        assert_eq!(
            g.row_offset(2_500_011),
            49_019 * PAGE + 2_500_011 % 51 * 320
        );
        // An INT4 row of 256: 128 B of codes, then 4 groups of BF16 scales and biases.
        assert_eq!(row_bytes(256, 2, Scheme::Int4G64), Some(128 + 8 + 8));
    }

    /// Sizes MLX gives: `mx.quantize(w, group_size, bits)` on a `[rows, cols]` matrix
    /// returns U32 weights `[rows, cols*bits/32]` and scales, biases
    /// `[rows, cols/group]`. Rows of 384 at every width and group.
    #[test]
    fn every_mlx_width_and_group_follows_the_mlx_shapes() {
        let (rows, cols) = (3u64, 384u64);
        for bits in Affine::BITS {
            for group in Affine::GROUPS {
                let q = a(bits, group).sizes(rows, cols).unwrap();
                assert_eq!(
                    q.weights,
                    rows * (cols * bits as u64 / 32) * 4,
                    "{bits}/{group}"
                );
                assert_eq!(q.scales, rows * (cols / group as u64) * 2, "{bits}/{group}");
                assert_eq!(q.biases, q.scales);
                assert_eq!(a(bits, group).label(), format!("int{bits}_g{group}"));
            }
        }
        // 3-bit g128 [2, 128]: 12 words of dense bitstream per row (not 128/10 words).
        let q = a(3, 128).sizes(2, 128).unwrap();
        assert_eq!((q.weights, q.scales, q.biases), (96, 4, 4));
        // 6-bit g32 [1, 32]: 6 words.
        assert_eq!(a(6, 32).row_sizes(32).unwrap().weights, 24);
        // Rows that are not a whole number of groups have no layout.
        assert_eq!(a(4, 128).sizes(1, 64), None);
        assert_eq!(a(5, 32).sizes(1, 48), None);
    }

    #[test]
    fn only_mlx_widths_and_groups_exist() {
        for (bits, group) in [
            (1, 64),
            (7, 64),
            (16, 64),
            (0, 64),
            (4, 48),
            (4, 0),
            (4, 256),
        ] {
            assert_eq!(Affine::new(bits, group), None, "{bits}/{group}");
        }
        assert_eq!(Scheme::Int4G64.affine(), Affine::new(4, 64));
        assert_eq!(Scheme::Int8G64.affine(), Affine::new(8, 64));
        assert_eq!(Scheme::Passthrough.affine(), None);
        for s in [Scheme::Int4G64, Scheme::Int8G64] {
            assert_eq!(s.affine().unwrap().label(), s.label());
            assert_eq!(Scheme::from_affine(s.affine().unwrap()), Some(s));
        }
        assert_eq!(
            Scheme::from_affine(a(3, 128)),
            Some(Scheme::Affine(a(3, 128)))
        );
        for bits in Affine::BITS {
            for group in Affine::GROUPS {
                let s = Scheme::Affine(a(bits, group));
                assert_eq!(Scheme::parse(&s.label()), Ok(s));
                let json = serde_json::to_string(&s).unwrap();
                assert_eq!(json, format!("\"int{bits}_g{group}\""));
                assert_eq!(serde_json::from_str::<Scheme>(&json).unwrap(), s);
            }
        }
        assert_eq!(Scheme::parse("passthrough"), Ok(Scheme::Passthrough));
        for bad in [
            "int7_g64",
            "int4_g48",
            "int04_g64",
            "int4g64",
            "int4_g64x",
            "bf16",
        ] {
            assert!(Scheme::parse(bad).is_err(), "{bad}");
        }
        assert!(
            Scheme::parse("int7_g64")
                .unwrap_err()
                .contains("not a layout MLX writes")
        );
    }

    #[test]
    fn sizes_refuse_bad_widths_and_overflow() {
        assert_eq!(a(4, 64).sizes(4, 100), None);
        assert_eq!(a(4, 64).sizes(u64::MAX, 64), None);
        assert_eq!(a(8, 32).sizes(1, u64::MAX / 2 + 1), None);
        assert_eq!(a(4, 64).sizes(1, 0), None);
        assert_eq!(Scheme::Passthrough.sizes(u64::MAX, 2, 1), None);
        // The three parts fit 64 bits one by one but not together.
        let rows = u64::MAX / 32;
        assert_eq!(a(8, 32).sizes(rows, 32), None);
        assert_eq!(RowBlocks::new(10, PAGE + 1), None);
        assert_eq!(align_up(u64::MAX, PAGE), None);
    }

    /// `mx.quantize(w, group_size=32, bits=4, mode="mxfp4")` of a `[rows, cols]`
    /// matrix returns U32 weights `[rows, cols/8]` and U8 scales `[rows, cols/32]`,
    /// no biases (MLX 0.32.4).
    #[test]
    fn mxfp4_follows_the_mlx_shapes_and_round_trips_its_label() {
        let q = Scheme::Mxfp4.sizes(4, 64, 2).unwrap();
        assert_eq!((q.weights, q.scales, q.biases), (4 * 8 * 4, 4 * 2, 0));
        // gpt-oss-120b's expert: gate [2880, 2880] and down [2880, 2880].
        let e = Scheme::Mxfp4.sizes(2880, 2880, 2).unwrap();
        assert_eq!(e.total(), 2880 * 1440 + 2880 * 90);
        assert_eq!(row_bytes(2880, 2, Scheme::Mxfp4), Some(1440 + 90));
        assert!(Scheme::Mxfp4.fits(32) && !Scheme::Mxfp4.fits(48) && !Scheme::Mxfp4.fits(0));
        assert_eq!(Scheme::Mxfp4.sizes(1, 48, 2), None);
        assert_eq!(Scheme::Mxfp4.sizes(u64::MAX, 64, 2), None);
        assert_eq!(Scheme::Mxfp4.label(), "mxfp4_g32");
        assert_eq!(Scheme::parse("mxfp4_g32"), Ok(Scheme::Mxfp4));
        assert_eq!(
            serde_json::to_string(&Scheme::Mxfp4).unwrap(),
            "\"mxfp4_g32\""
        );
        assert_eq!(
            serde_json::from_str::<Scheme>("\"mxfp4_g32\"").unwrap(),
            Scheme::Mxfp4
        );
        assert_eq!(Scheme::Mxfp4.affine(), None);
        assert_eq!(
            (Scheme::Mxfp4.bits(), Scheme::Mxfp4.group()),
            (Some(4), Some(32))
        );
        assert!(Scheme::Mxfp4.is_quantized() && !Scheme::Passthrough.is_quantized());
        for bad in ["mxfp4", "mxfp4_g64", "mxfp8_g32"] {
            assert!(
                Scheme::parse(bad).unwrap_err().contains("mxfp4_g32"),
                "{bad}"
            );
        }
    }

    #[test]
    fn matrix_dims_follow_the_last_axis() {
        assert_eq!(matrix_dims(&[3, 4, 128]), Some((12, 128)));
        assert_eq!(matrix_dims(&[100]), Some((1, 100)));
        assert_eq!(matrix_dims(&[]), Some((1, 1)));
        assert_eq!(matrix_dims(&[5, 0]), Some((0, 0)));
        assert_eq!(matrix_dims(&[u64::MAX, 2]), None);
    }
}
