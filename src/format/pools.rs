//! Expert-pool and row-pool geometry, as recorded in the plan and the manifest.

use serde::{Deserialize, Serialize};

use super::Scheme;
use crate::header::Dtype;

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
}

/// One expert pool file: expert `e` at `e * stride`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertPool {
    /// Output path inside the `.gturbo` directory.
    pub file: String,
    /// Layer index.
    pub layer: u64,
    /// Sidecar the pool belongs to (`None` for the main model).
    pub sidecar: Option<String>,
    /// Experts in the pool.
    pub experts: u64,
    /// Scheme of every projection.
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
