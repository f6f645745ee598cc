//! The `.gturbo` on-disk format: the types and sizes shared by install (what to
//! write), verify-install (what to check) and run (what to read).
//!
//! The spec in MUST/MAY terms lives in `manifests/FORMAT.md`; this module is its
//! single implementation. Every size the planner predicts comes from here, so a dry
//! run and a real install cannot disagree.

use serde::{Deserialize, Serialize};

pub mod manifest;
pub mod pools;
pub mod receipt;
pub mod resident;

/// Every alignment in the format uses this unit, whatever the host's page size
/// (16 KiB is Apple silicon's page; on 4 KiB hosts it is still a multiple).
pub const PAGE: u64 = 16 * 1024;

/// Alignment of sub-regions (weights, scales, biases) inside one resident entry, so
/// SIMD kernels can load them without straddling cache lines.
pub const SUBREGION_ALIGN: u64 = 64;

/// One inconsistency found in a format structure: the field (a JSON path such as
/// `parts[1].offset` or `tensors[3] (model.norm.weight).data`) and what is wrong.
/// The caller adds the file it came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutError {
    /// Field or byte offset the problem is at.
    pub field: String,
    /// What is wrong, with the expected and found values.
    pub detail: String,
}

impl LayoutError {
    /// A problem at `field`.
    pub fn new(field: impl Into<String>, detail: impl Into<String>) -> LayoutError {
        LayoutError {
            field: field.into(),
            detail: detail.into(),
        }
    }
}

impl std::fmt::Display for LayoutError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.detail)
    }
}

/// Longest path (in bytes) a manifest may name inside the directory.
pub const MAX_PATH_BYTES: usize = 1024;

/// Whether `path` is a safe path inside an install directory: relative,
/// `/`-separated, no empty, `.` or `..` component, no backslash, colon or control
/// character. Readers MUST refuse any other path before touching the filesystem, so
/// a hostile manifest cannot name a file outside the directory.
pub fn check_relative_path(path: &str) -> Result<(), String> {
    if path.is_empty() {
        return Err("empty path".into());
    }
    if path.len() > MAX_PATH_BYTES {
        return Err(format!(
            "path is {} bytes, more than {MAX_PATH_BYTES}",
            path.len()
        ));
    }
    if path.starts_with('/') {
        return Err(format!(
            "{path:?} is absolute; paths are relative to the directory"
        ));
    }
    if let Some(c) = path
        .chars()
        .find(|c| *c == '\\' || *c == ':' || c.is_control())
    {
        return Err(format!("{path:?} contains {c:?}"));
    }
    for part in path.split('/') {
        match part {
            "" => return Err(format!("{path:?} has an empty component")),
            "." | ".." => {
                return Err(format!(
                    "{path:?} has a {part:?} component; paths must stay inside the directory"
                ));
            }
            _ => {}
        }
    }
    Ok(())
}

/// Round `n` up to a multiple of `align` (a power of two or any positive number).
/// `None` on overflow.
pub fn align_up(n: u64, align: u64) -> Option<u64> {
    debug_assert!(align > 0);
    let rem = n % align;
    if rem == 0 {
        Some(n)
    } else {
        n.checked_add(align - rem)
    }
}

/// How one slot's bytes are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scheme {
    /// Affine INT4, group 64, MLX layout (U32 words, BF16 scales and biases).
    Int4G64,
    /// Affine INT8, group 64, MLX layout.
    Int8G64,
    /// Source bytes unchanged, at the source dtype.
    Passthrough,
}

impl Scheme {
    /// Bits per quantized element, `None` for passthrough.
    pub fn bits(self) -> Option<u32> {
        match self {
            Scheme::Int4G64 => Some(4),
            Scheme::Int8G64 => Some(8),
            Scheme::Passthrough => None,
        }
    }

    /// Short label for humans.
    pub fn label(self) -> &'static str {
        match self {
            Scheme::Int4G64 => "int4_g64",
            Scheme::Int8G64 => "int8_g64",
            Scheme::Passthrough => "passthrough",
        }
    }
}

/// Elements per quantization group.
pub const GROUP_SIZE: u64 = 64;

/// Byte sizes of one quantized matrix `[rows, cols]` in MLX's layout: packed U32
/// weights `[rows, cols*bits/32]`, BF16 scales and biases `[rows, cols/64]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuantSizes {
    /// Packed weight bytes.
    pub weights: u64,
    /// Scale bytes.
    pub scales: u64,
    /// Bias bytes.
    pub biases: u64,
}

impl QuantSizes {
    /// Sizes for `[rows, cols]` at `bits`; `None` when `cols` is not a multiple of 64
    /// or the sizes overflow.
    pub fn new(rows: u64, cols: u64, bits: u32) -> Option<QuantSizes> {
        if cols == 0 || !cols.is_multiple_of(GROUP_SIZE) {
            return None;
        }
        let weights = rows.checked_mul(cols)?.checked_mul(bits as u64)? / 8;
        let scales = rows.checked_mul(cols / GROUP_SIZE)?.checked_mul(2)?;
        Some(QuantSizes {
            weights,
            scales,
            biases: scales,
        })
    }

    /// Total bytes.
    pub fn total(&self) -> u64 {
        self.weights + self.scales + self.biases
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

/// Bytes of one stored row of `width` BF16 elements under `scheme`: INT4 rows are
/// packed weights then BF16 scales then BF16 biases; passthrough rows are the source
/// bytes (`width * elem_bytes`).
pub fn row_bytes(width: u64, elem_bytes: u64, scheme: Scheme) -> Option<u64> {
    match scheme.bits() {
        Some(bits) => QuantSizes::new(1, width, bits).map(|s| s.total()),
        None => width.checked_mul(elem_bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen3.8-Flash-Next routed expert: gate/up [640, 2560], down [2560, 640].
    #[test]
    fn flash_next_expert_blob_and_stride() {
        let gate = QuantSizes::new(640, 2560, 4).unwrap();
        assert_eq!(
            (gate.weights, gate.scales, gate.biases),
            (819_200, 51_200, 51_200)
        );
        let down = QuantSizes::new(2560, 640, 4).unwrap();
        let blob = 2 * gate.total() + down.total();
        assert_eq!(blob, 2_764_800);
        assert_eq!(align_up(blob, PAGE), Some(2_768_896));
        assert_eq!(2_768_896 / PAGE, 169);
        // Router at INT8: 1,392,640 B.
        assert_eq!(QuantSizes::new(512, 2560, 8).unwrap().total(), 1_392_640);
        assert_eq!(QuantSizes::new(512, 2560, 4).unwrap().total(), 737_280);
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
    }

    #[test]
    fn relative_paths_stay_inside_the_directory() {
        for ok in [
            "resident.bin",
            "packed_experts/layer_00.bin",
            "tokenizer/a.b.json",
        ] {
            assert_eq!(check_relative_path(ok), Ok(()), "{ok}");
        }
        for (bad, why) in [
            ("", "empty path"),
            ("/etc/passwd", "is absolute"),
            ("../x", "\"..\" component"),
            ("a/../../x", "\"..\" component"),
            ("a/./b", "\".\" component"),
            ("a//b", "empty component"),
            ("a/", "empty component"),
            ("a\\..\\b", "contains '\\\\'"),
            ("C:x", "contains ':'"),
            ("a\nb", "contains '\\n'"),
        ] {
            let e = check_relative_path(bad).unwrap_err();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
        assert!(
            check_relative_path(&"a".repeat(MAX_PATH_BYTES + 1))
                .unwrap_err()
                .contains("more than 1024")
        );
    }

    #[test]
    fn sizes_refuse_bad_widths_and_overflow() {
        assert_eq!(QuantSizes::new(4, 100, 4), None);
        assert_eq!(QuantSizes::new(u64::MAX, 64, 4), None);
        assert_eq!(RowBlocks::new(10, PAGE + 1), None);
        assert_eq!(align_up(u64::MAX, PAGE), None);
    }
}
