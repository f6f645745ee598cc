//! Expert-pool and row-pool geometry, as recorded in the plan and the manifest.

use serde::{Deserialize, Serialize};

use super::{LayoutError, PAGE, Scheme, align_up};
use crate::dtype::Dtype;

/// Expert projection inside a blob.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpertPart {
    /// Gate projection `[I, H]`.
    Gate,
    /// Up projection `[I, H]`.
    Up,
    /// Down projection `[H, I]`.
    Down,
    /// Fused gate and up `[E, 2I, H]` (rows `[0, I)` gate, `[I, 2I)` up).
    GateUp,
}

/// One projection's place inside an expert blob.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlobPart {
    /// `gate`, `up` or `down`.
    pub part: ExpertPart,
    /// Rows of the projection matrix.
    pub rows: u64,
    /// Columns.
    pub cols: u64,
    /// Offset of the weights (or passthrough data) inside the blob.
    pub offset: u64,
    /// Weight bytes (quantized) or data bytes (passthrough).
    pub weights: u64,
    /// Scale bytes (0 for passthrough); scales follow the weights.
    pub scales: u64,
    /// Bias bytes (0 for passthrough); biases follow the scales.
    pub biases: u64,
    /// This part's scheme when it differs from the pool's (a mixed-precision source
    /// keeps, say, a 6-bit `down` next to 3-bit `gate` and `up`); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheme: Option<Scheme>,
}

/// One expert pool file: expert `e` at `e * stride`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpertPool {
    /// Output path inside the `.gturbo` directory.
    pub file: String,
    /// Layer index.
    pub layer: u64,
    /// Sidecar the pool belongs to (`None` for the main model).
    pub sidecar: Option<String>,
    /// Experts in the pool.
    pub experts: u64,
    /// Scheme of every projection whose part names none of its own.
    pub scheme: Scheme,
    /// Source dtype.
    pub dtype: Dtype,
    /// Bytes of one blob (gate, up, down contiguous).
    pub blob_bytes: u64,
    /// Blob stride: `blob_bytes` rounded up to PAGE.
    pub stride: u64,
    /// Projections in blob order: gate, up, down.
    pub parts: Vec<BlobPart>,
    /// File size: `experts * stride`.
    pub file_bytes: u64,
}

/// One shard region of a row pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RowShard {
    /// Source tensor name.
    pub tensor: String,
    /// Rows.
    pub rows: u64,
    /// Offset of the region in the pool file.
    pub offset: u64,
    /// Blocks.
    pub blocks: u64,
    /// Region bytes.
    pub region_bytes: u64,
}

/// One row-lookup pool file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RowPool {
    /// Output path.
    pub file: String,
    /// Layer.
    pub layer: u64,
    /// Pool name from the family rule.
    pub name: String,
    /// Row width in elements.
    pub width: u64,
    /// Source dtype.
    pub dtype: Dtype,
    /// Scheme of the stored rows.
    pub scheme: Scheme,
    /// Stored bytes per row.
    pub row_bytes: u64,
    /// Rows per PAGE block.
    pub rows_per_block: u64,
    /// Shard regions in order.
    pub shards: Vec<RowShard>,
    /// File size.
    pub file_bytes: u64,
}

/// The parts an expert blob holds, in blob order.
pub const BLOB_PARTS: [ExpertPart; 3] = [ExpertPart::Gate, ExpertPart::Up, ExpertPart::Down];

impl BlobPart {
    /// Bytes of the part: weights, scales and biases.
    pub fn total(&self) -> Option<u64> {
        self.weights
            .checked_add(self.scales)?
            .checked_add(self.biases)
    }
}

impl ExpertPool {
    /// The scheme `part` is stored at: its own, else the pool's.
    pub fn part_scheme(&self, part: &BlobPart) -> Scheme {
        part.scheme.unwrap_or(self.scheme)
    }

    /// Whether the pool's numbers agree with each other and with the format: parts
    /// gate, up, down contiguous from 0 with the sizes their shape and scheme give,
    /// `blob_bytes` their sum, `stride` the blob rounded up to [`PAGE`], `file_bytes`
    /// `experts * stride`. Empty when consistent. Install, verify-install and run all
    /// rely on this before computing an expert's offset.
    pub fn layout_errors(&self) -> Vec<LayoutError> {
        let mut errs = Vec::new();
        if self.experts == 0 {
            errs.push(LayoutError::new(
                "experts",
                "a pool holds at least one expert",
            ));
        }
        let kinds: Vec<ExpertPart> = self.parts.iter().map(|p| p.part).collect();
        if kinds != BLOB_PARTS {
            errs.push(LayoutError::new(
                "parts",
                format!("parts are {kinds:?}; a blob is [Gate, Up, Down] in that order"),
            ));
        }
        let mut cursor = 0u64;
        for (i, p) in self.parts.iter().enumerate() {
            errs.extend(self.part_size_errors(i, p));
            if p.offset != cursor {
                errs.push(LayoutError::new(
                    format!("parts[{i}].offset"),
                    format!(
                        "{}; the part must follow the previous one at {cursor}",
                        p.offset
                    ),
                ));
            }
            match p.total().and_then(|t| p.offset.checked_add(t)) {
                Some(end) => cursor = end,
                None => {
                    errs.push(LayoutError::new(
                        format!("parts[{i}].offset"),
                        "offset + size overflows 64 bits",
                    ));
                    return errs;
                }
            }
        }
        errs.extend(self.blob_errors(cursor));
        errs
    }

    /// Part `i`'s weights, scales and biases against the sizes its shape and scheme give.
    fn part_size_errors(&self, i: usize, p: &BlobPart) -> Vec<LayoutError> {
        let at = |f: &str| format!("parts[{i}].{f}");
        let scheme = self.part_scheme(p);
        let expected = scheme
            .sizes(p.rows, p.cols, self.dtype.size())
            .map(|q| (q.weights, q.scales, q.biases));
        let Some((w, s, b)) = expected else {
            return vec![LayoutError::new(
                at("cols"),
                format!(
                    "shape [{}, {}] has no {} layout ({}sizes must fit 64 bits)",
                    p.rows,
                    p.cols,
                    scheme.label(),
                    scheme.group().map_or(String::new(), |g| format!(
                        "columns must be a positive multiple of {g} for quantized parts, "
                    ))
                ),
            )];
        };
        [
            ("weights", w, p.weights),
            ("scales", s, p.scales),
            ("biases", b, p.biases),
        ]
        .into_iter()
        .filter(|(_, want, got)| want != got)
        .map(|(name, want, got)| {
            LayoutError::new(
                at(name),
                format!(
                    "{got} bytes; shape [{}, {}] at {} gives {want}",
                    p.rows,
                    p.cols,
                    scheme.label()
                ),
            )
        })
        .collect()
    }

    /// `blob_bytes` where the parts end (`cursor`), `stride` the blob rounded up to
    /// [`PAGE`], `file_bytes` `experts * stride`.
    fn blob_errors(&self, cursor: u64) -> Vec<LayoutError> {
        let mut errs = Vec::new();
        if cursor != self.blob_bytes {
            errs.push(LayoutError::new(
                "blob_bytes",
                format!("{}; the parts end at {cursor}", self.blob_bytes),
            ));
        }
        if !self.stride.is_multiple_of(PAGE) || self.stride == 0 {
            errs.push(LayoutError::new(
                "stride",
                format!(
                    "{} is not a positive multiple of the {PAGE}-byte page",
                    self.stride
                ),
            ));
        }
        match align_up(self.blob_bytes, PAGE) {
            Some(want) if want == self.stride => {}
            want => errs.push(LayoutError::new(
                "stride",
                format!(
                    "{}; blob_bytes {} rounded up to the page gives {}",
                    self.stride,
                    self.blob_bytes,
                    want.map_or("an overflow".to_string(), |w| w.to_string())
                ),
            )),
        }
        match self.experts.checked_mul(self.stride) {
            Some(want) if want == self.file_bytes => {}
            want => errs.push(LayoutError::new(
                "file_bytes",
                format!(
                    "{}; experts {} × stride {} = {}",
                    self.file_bytes,
                    self.experts,
                    self.stride,
                    want.map_or("an overflow".to_string(), |w| w.to_string())
                ),
            )),
        }
        errs
    }
}

impl RowPool {
    /// Whether the pool's numbers agree with each other and with the format:
    /// `row_bytes` from width, dtype and scheme, `rows_per_block = PAGE / row_bytes`,
    /// shard regions contiguous from 0, each `ceil(rows / rows_per_block)` blocks of
    /// [`PAGE`], `file_bytes` their sum. Empty when consistent.
    pub fn layout_errors(&self) -> Vec<LayoutError> {
        let mut errs = Vec::new();
        let Some(rows_per_block) = self.row_errors(&mut errs) else {
            return errs;
        };
        if self.shards.is_empty() {
            errs.push(LayoutError::new(
                "shards",
                "a row pool has at least one shard",
            ));
        }
        let mut cursor = 0u64;
        for (i, s) in self.shards.iter().enumerate() {
            errs.extend(Self::region_errors(i, s, cursor, rows_per_block));
            match cursor.checked_add(s.region_bytes) {
                Some(c) => cursor = c,
                None => {
                    errs.push(LayoutError::new(
                        format!("shards[{i}].region_bytes"),
                        "regions overflow 64 bits",
                    ));
                    return errs;
                }
            }
        }
        if self.file_bytes != cursor {
            errs.push(LayoutError::new(
                "file_bytes",
                format!("{}; the shard regions end at {cursor}", self.file_bytes),
            ));
        }
        errs.extend(self.regions_inside_file_errors());
        errs
    }

    /// `row_bytes` from width, dtype and scheme, one row fitting a block, and
    /// `rows_per_block`: pushes what does not hold to `errs` and returns the rows per
    /// block, or `None` when no region can be checked (a row that fits no block).
    fn row_errors(&self, errs: &mut Vec<LayoutError>) -> Option<u64> {
        match super::row_bytes(self.width, self.dtype.size(), self.scheme) {
            Some(want) if want == self.row_bytes => {}
            want => errs.push(LayoutError::new(
                "row_bytes",
                format!(
                    "{}; width {} of {:?} at {} gives {}",
                    self.row_bytes,
                    self.width,
                    self.dtype,
                    self.scheme.label(),
                    want.map_or("no layout".to_string(), |w| w.to_string())
                ),
            )),
        }
        if self.row_bytes == 0 || self.row_bytes > PAGE {
            errs.push(LayoutError::new(
                "row_bytes",
                format!("{}; a row must fit one {PAGE}-byte block", self.row_bytes),
            ));
            return None;
        }
        let rows_per_block = PAGE / self.row_bytes;
        if self.rows_per_block != rows_per_block {
            errs.push(LayoutError::new(
                "rows_per_block",
                format!(
                    "{}; {PAGE} / row_bytes {} gives {rows_per_block}",
                    self.rows_per_block, self.row_bytes
                ),
            ));
        }
        Some(rows_per_block)
    }

    /// Shard `i`'s region: at `cursor` (where the previous one ends), with the blocks
    /// its rows need and those blocks' bytes.
    fn region_errors(i: usize, s: &RowShard, cursor: u64, rows_per_block: u64) -> Vec<LayoutError> {
        let at = |f: &str| format!("shards[{i}].{f}");
        let mut errs = Vec::new();
        if s.offset != cursor {
            errs.push(LayoutError::new(
                at("offset"),
                format!(
                    "{}; the region must follow the previous one at {cursor}",
                    s.offset
                ),
            ));
        }
        let blocks = s.rows.div_ceil(rows_per_block);
        if s.blocks != blocks {
            errs.push(LayoutError::new(
                at("blocks"),
                format!(
                    "{}; {} rows at {rows_per_block} per block need {blocks}",
                    s.blocks, s.rows
                ),
            ));
        }
        match blocks.checked_mul(PAGE) {
            Some(want) if want == s.region_bytes => {}
            want => errs.push(LayoutError::new(
                at("region_bytes"),
                format!(
                    "{}; {blocks} blocks of {PAGE} give {}",
                    s.region_bytes,
                    want.map_or("an overflow".to_string(), |w| w.to_string())
                ),
            )),
        }
        errs
    }

    /// Each region as declared must lie inside the file, whatever the sums say.
    fn regions_inside_file_errors(&self) -> Vec<LayoutError> {
        let mut errs = Vec::new();
        for (i, s) in self.shards.iter().enumerate() {
            let end = s.offset.checked_add(s.region_bytes);
            if end.is_none_or(|e| e > self.file_bytes) {
                errs.push(LayoutError::new(
                    format!("shards[{i}]"),
                    format!(
                        "region at {} of {} bytes ends past file_bytes {}",
                        s.offset, s.region_bytes, self.file_bytes
                    ),
                ));
            }
        }
        errs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Dtype;

    fn expert_pool() -> ExpertPool {
        // The scaled Flash-Next replica's layer: 8 experts of gate/up [128, 256], down [256, 128].
        let part = |part, rows, cols, offset| BlobPart {
            part,
            rows,
            cols,
            offset,
            weights: 16384,
            scales: 1024,
            biases: 1024,
            scheme: None,
        };
        ExpertPool {
            file: "packed_experts/layer_00.bin".into(),
            layer: 0,
            sidecar: None,
            experts: 8,
            scheme: Scheme::Int4G64,
            dtype: Dtype::BF16,
            blob_bytes: 55296,
            stride: 65536,
            parts: vec![
                part(ExpertPart::Gate, 128, 256, 0),
                part(ExpertPart::Up, 128, 256, 18432),
                part(ExpertPart::Down, 256, 128, 36864),
            ],
            file_bytes: 524288,
        }
    }

    fn row_pool() -> RowPool {
        RowPool {
            file: "ple/layer_01_ngram_rows.bin".into(),
            layer: 1,
            name: "ngram_rows".into(),
            width: 160,
            dtype: Dtype::BF16,
            scheme: Scheme::Passthrough,
            row_bytes: 320,
            rows_per_block: 51,
            shards: vec![
                RowShard {
                    tensor: "s0".into(),
                    rows: 3000,
                    offset: 0,
                    blocks: 59,
                    region_bytes: 966656,
                },
                RowShard {
                    tensor: "s1".into(),
                    rows: 2551,
                    offset: 966656,
                    blocks: 51,
                    region_bytes: 835584,
                },
            ],
            file_bytes: 966656 + 835584,
        }
    }

    fn fields(errs: &[LayoutError]) -> Vec<String> {
        errs.iter().map(|e| e.field.clone()).collect()
    }

    #[test]
    fn consistent_pools_have_no_errors() {
        assert_eq!(expert_pool().layout_errors(), vec![]);
        assert_eq!(row_pool().layout_errors(), vec![]);
    }

    #[test]
    fn expert_pool_errors_name_the_field() {
        let mut p = expert_pool();
        p.stride = 65536 + 1;
        let e = p.layout_errors();
        assert_eq!(fields(&e), ["stride", "stride", "file_bytes"]);
        assert!(
            e[1].detail
                .contains("blob_bytes 55296 rounded up to the page gives 65536"),
            "{e:?}"
        );

        let mut p = expert_pool();
        p.parts[1].offset = 18433;
        let e = p.layout_errors();
        assert_eq!(fields(&e), ["parts[1].offset", "parts[2].offset"]);
        assert!(
            e[0].detail
                .contains("must follow the previous one at 18432")
        );

        let mut p = expert_pool();
        p.parts[2].cols = 100;
        assert_eq!(fields(&p.layout_errors()), ["parts[2].cols"]);

        let mut p = expert_pool();
        p.experts = u64::MAX;
        let e = p.layout_errors();
        assert_eq!(fields(&e), ["file_bytes"]);
        assert!(e[0].detail.contains("an overflow"));

        let mut p = expert_pool();
        p.parts[0].weights = u64::MAX;
        p.parts.swap(0, 2);
        let e = p.layout_errors();
        assert!(fields(&e).contains(&"parts".to_string()), "{e:?}");
    }

    #[test]
    fn row_pool_errors_name_the_field() {
        let mut p = row_pool();
        p.rows_per_block = 50;
        assert_eq!(fields(&p.layout_errors()), ["rows_per_block"]);

        let mut p = row_pool();
        p.shards[1].offset += PAGE;
        assert_eq!(
            fields(&p.layout_errors()),
            ["shards[1].offset", "shards[1]"]
        );

        let mut p = row_pool();
        p.shards[0].rows = 3061;
        let e = p.layout_errors();
        assert_eq!(fields(&e), ["shards[0].blocks", "shards[0].region_bytes"]);
        assert!(e[0].detail.contains("3061 rows at 51 per block need 61"));

        let mut p = row_pool();
        p.row_bytes = u64::MAX;
        let e = p.layout_errors();
        assert_eq!(fields(&e), ["row_bytes", "row_bytes"]);

        let mut p = row_pool();
        p.shards[0].region_bytes = u64::MAX;
        assert!(fields(&p.layout_errors()).contains(&"shards[0].region_bytes".to_string()));
    }
}
