//! Where each source row lands, in output-file byte offsets.
//!
//! The executor streams a tensor's bytes row by row (a row is the last axis; groups of
//! 64 never cross rows), so every destination is a function of (tensor, row). This
//! module computes it from the plan alone, which is also what lets a resumed install
//! re-derive and re-check exactly the bytes a read wrote.

use crate::format::{RowBlocks, Scheme};

use super::types::{Dest, Plan, PlannedTensor};
use crate::format::pools::ExpertPart;
use crate::format::resident::Storage;

/// Output file ids: 0 is `resident.bin`, then expert pools, then row pools.
pub fn output_file_paths(plan: &Plan) -> Vec<String> {
    let mut v = vec!["resident.bin".to_string()];
    v.extend(plan.outputs.expert_pools.iter().map(|p| p.file.clone()));
    v.extend(plan.outputs.row_pools.iter().map(|p| p.file.clone()));
    v
}

/// Where one row's output goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowDest {
    /// Output file id (see [`output_file_paths`]).
    pub file: usize,
    /// Offset of the row's weights (or passthrough bytes).
    pub weights: u64,
    /// Offset of the row's scales (quantized schemes).
    pub scales: u64,
    /// Offset of the row's biases (quantized schemes).
    pub biases: u64,
}

/// How a tensor's rows map to output bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorPlacement {
    /// Scheme applied to every row.
    pub scheme: Scheme,
    /// Source bytes per row.
    pub src_row_bytes: u64,
    /// Elements per row.
    pub cols: u64,
    /// Rows in the tensor.
    pub rows: u64,
    /// Output bytes per row: weights (or passthrough bytes), scales, biases.
    pub out_row: (u64, u64, u64),
    /// For a pre-quantized source tensor, the one stream (0 weights, 1 scales,
    /// 2 biases) its rows are copied into; `None` when every stream is written from
    /// the tensor (quantized or passed through).
    pub stream: Option<usize>,
    /// For a module dequantized and quantized again (`--requantize`): the source's
    /// layout; its source rows are packed words, its scales and biases staged.
    pub requant: Option<Scheme>,
    /// For an FP8 weight: its source rows are e4m3 codes, its block scales staged.
    pub fp8: bool,
    /// The scales of a compressed-tensors module, which also write its biases.
    pub biases_from_scales: bool,
    /// Rows (of the tensor as placed) per source row: 1, or one expert's rows for
    /// transposed experts, whose source row is a whole expert.
    pub rows_per_src_row: u64,
    /// Transposed experts (gpt-oss): each source row is one expert's `[in, out]`
    /// matrix, `Some(interleaved)` (a `gate_up` whose out axis alternates gate and
    /// up); the placed rows are its transpose, gate rows before up rows.
    pub transposed: Option<bool>,
    kind: Kind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    /// Row-major regions: weights/scales/biases bases.
    Linear { file: usize, w: u64, s: u64, b: u64 },
    /// Rows grouped per expert: `rows_per_expert` source rows per expert; each
    /// expert's rows split into parts (row count, part weights/scales/biases offsets
    /// inside the blob).
    Experts {
        file: usize,
        stride: u64,
        first_expert: u64,
        rows_per_expert: u64,
        parts: Vec<(u64, u64, u64, u64)>,
        /// Source rows alternate between the parts (gpt-oss's gate_up) instead of
        /// filling one part after the other.
        interleaved: bool,
    },
    /// Row pool region.
    Rows {
        file: usize,
        base: u64,
        blocks: RowBlocks,
    },
}

impl Kind {
    /// Where `t`'s rows (`rows` of them) land in its destination's file; `None` for an
    /// excluded tensor or a destination the plan does not describe.
    fn of(plan: &Plan, t: &PlannedTensor, rows: u64) -> Option<Kind> {
        let n_pools = plan.outputs.expert_pools.len();
        match &t.dest {
            Dest::Excluded { .. } => None,
            Dest::Resident { entry } => Some(Kind::resident(plan, *entry)),
            Dest::ExpertsFused { pool, part, .. } | Dest::Expert { pool, part, .. } => {
                Kind::experts(plan, t, *pool, *part, rows)
            }
            Dest::Rows { pool, shard } => {
                let p = &plan.outputs.row_pools[*pool];
                let s = &p.shards[*shard];
                Some(Kind::Rows {
                    file: 1 + n_pools + pool,
                    base: s.offset,
                    blocks: RowBlocks::new(s.rows, p.row_bytes)?,
                })
            }
        }
    }

    /// Resident entry `entry`: its regions in the resident file's payload.
    fn resident(plan: &Plan, entry: usize) -> Kind {
        let e = &plan.outputs.resident.index.tensors[entry];
        let base = plan.outputs.resident.payload_start;
        match e.storage {
            Storage::Dense { data } => Kind::Linear {
                file: 0,
                w: base + data.offset,
                s: 0,
                b: 0,
            },
            Storage::Quant {
                weights,
                scales,
                biases,
                ..
            } => Kind::Linear {
                file: 0,
                w: base + weights.offset,
                s: base + scales.offset,
                b: base + biases.offset,
            },
        }
    }

    /// Part `part` of expert pool `pool`: the blob parts it fills (gate and up for a
    /// fused `gate_up`), and the experts its rows cover.
    fn experts(
        plan: &Plan,
        t: &PlannedTensor,
        pool: usize,
        part: ExpertPart,
        rows: u64,
    ) -> Option<Kind> {
        let p = &plan.outputs.expert_pools[pool];
        let offs = |want: ExpertPart| {
            p.parts.iter().find(|bp| bp.part == want).map(|bp| {
                (
                    bp.rows,
                    bp.offset,
                    bp.offset + bp.weights,
                    bp.offset + bp.weights + bp.scales,
                )
            })
        };
        let parts: Vec<(u64, u64, u64, u64)> = match part {
            ExpertPart::GateUp => vec![offs(ExpertPart::Gate)?, offs(ExpertPart::Up)?],
            other => vec![offs(other)?],
        };
        let (first_expert, rows_per_expert) = match &t.dest {
            Dest::Expert { expert, .. } => (*expert, rows),
            _ => (0, parts.iter().map(|p| p.0).sum()),
        };
        let interleaved = matches!(
            t.dest,
            Dest::ExpertsFused {
                interleaved: true,
                ..
            }
        );
        Some(Kind::Experts {
            file: 1 + pool,
            stride: p.stride,
            first_expert,
            rows_per_expert,
            parts,
            interleaved,
        })
    }
}

impl TensorPlacement {
    /// Placement of `t` in `plan`; `None` for excluded tensors, and for a row the
    /// format has no layout for under the tensor's scheme (the planner never plans one).
    pub fn new(plan: &Plan, t: &PlannedTensor) -> Option<TensorPlacement> {
        let src_cols = t.shape.last().copied().unwrap_or(1).max(1);
        let elems: u64 = t.shape.iter().product();
        let rows = if t.shape.is_empty() {
            1
        } else {
            elems / src_cols
        };
        let elem = t.dtype.size();
        let src_row_bytes = t.src_row_bytes();
        let requant = match &t.requant {
            Some(r) if r.from.is_quantized() => Some(r.from),
            Some(_) => return None,
            None => None,
        };
        // A pre-quantized part: the logical matrix's columns, and its stream's bytes
        // per row must be the source's.
        let (cols, stream) = match t.packed {
            Some(p) => (p.cols, Some(p.stream as usize)),
            None => (src_cols, None),
        };
        let row = t.scheme.row_sizes(cols, elem)?;
        let out_row = (row.weights, row.scales, row.biases);
        if let Some(k) = stream {
            let per = [out_row.0, out_row.1, out_row.2];
            if per.get(k) != Some(&src_row_bytes) {
                return None;
            }
        }
        let kind = Kind::of(plan, t, rows)?;
        Some(TensorPlacement {
            scheme: t.scheme,
            src_row_bytes,
            cols,
            rows,
            out_row,
            stream,
            requant,
            fp8: t.fp8.is_some(),
            biases_from_scales: t.packed.is_some_and(|p| p.biases_from_scales),
            rows_per_src_row: t.rows_per_src_row(),
            transposed: t.transposed.then_some(matches!(
                t.dest,
                Dest::ExpertsFused {
                    part: ExpertPart::GateUp,
                    ..
                }
            )),
            kind,
        })
    }

    /// Whether stream `k` (0 weights, 1 scales, 2 biases) is written from this tensor.
    pub fn writes(&self, k: usize) -> bool {
        self.stream.is_none_or(|s| s == k) || (k == 2 && self.biases_from_scales)
    }

    /// Destination of source row `row`.
    pub fn row(&self, row: u64) -> RowDest {
        let (ow, os, _) = self.out_row;
        match &self.kind {
            Kind::Linear { file, w, s, b } => RowDest {
                file: *file,
                weights: w + row * ow,
                scales: s + row * os,
                biases: b + row * os,
            },
            Kind::Experts {
                file,
                stride,
                first_expert,
                rows_per_expert,
                parts,
                interleaved,
            } => {
                let e = first_expert + row / rows_per_expert;
                let mut r = row % rows_per_expert;
                let base = e * stride;
                if *interleaved {
                    // Row 2i + k is row i of part k.
                    let n = parts.len() as u64;
                    let (_, w, s, b) = parts[(r % n) as usize];
                    r /= n;
                    return RowDest {
                        file: *file,
                        weights: base + w + r * ow,
                        scales: base + s + r * os,
                        biases: base + b + r * os,
                    };
                }
                for &(n, w, s, b) in parts {
                    if r < n {
                        return RowDest {
                            file: *file,
                            weights: base + w + r * ow,
                            scales: base + s + r * os,
                            biases: base + b + r * os,
                        };
                    }
                    r -= n;
                }
                // Unreachable for rows < self.rows: parts cover rows_per_expert.
                RowDest {
                    file: *file,
                    weights: base,
                    scales: base,
                    biases: base,
                }
            }
            Kind::Rows { file, base, blocks } => {
                let at = base + blocks.row_offset(row);
                RowDest {
                    file: *file,
                    weights: at,
                    scales: at + ow,
                    biases: at + ow + os,
                }
            }
        }
    }
}
