//! The resident weights file: everything that is not a routed expert or a row table.
//!
//! Layout (see `manifests/FORMAT.md`):
//! `[8 bytes magic "GTRBRES1"][u64 LE index length n][n bytes JSON index][zeros to the
//! next PAGE][payload]`. Offsets in the index are relative to the payload start
//! (`align_up(16 + n, PAGE)`), so the index never depends on its own length. Every
//! entry starts on a PAGE boundary; its sub-regions (weights, scales, biases) are
//! packed after it, each aligned to [`SUBREGION_ALIGN`].

use serde::{Deserialize, Serialize};

use super::{PAGE, QuantSizes, SUBREGION_ALIGN, Scheme, align_up};

/// File magic.
pub const MAGIC: &[u8; 8] = b"GTRBRES1";

/// A byte span `[offset, offset + len)` relative to the payload start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    /// Offset from the payload start.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// One tensor in the resident file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResidentEntry {
    /// Source tensor name.
    pub name: String,
    /// Source dtype (`BF16`, `F32`, `I64`, ...).
    pub dtype: String,
    /// Logical shape.
    pub shape: Vec<u64>,
    /// How the bytes are stored.
    pub scheme: Scheme,
    /// Passthrough bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Span>,
    /// Packed U32 weights (quantized schemes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<Span>,
    /// BF16 scales (quantized schemes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scales: Option<Span>,
    /// BF16 biases (quantized schemes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub biases: Option<Span>,
}

/// The JSON index at the head of the resident file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResidentIndex {
    /// Format tag, `gturbo-resident`.
    pub format: String,
    /// Format version.
    pub version: u32,
    /// Entries in payload order.
    pub tensors: Vec<ResidentEntry>,
}

/// A tensor to place: what the planner knows before offsets exist.
#[derive(Debug, Clone)]
pub struct ResidentInput {
    /// Name.
    pub name: String,
    /// Source dtype name.
    pub dtype: String,
    /// Shape.
    pub shape: Vec<u64>,
    /// Source element size in bytes.
    pub elem_bytes: u64,
    /// Scheme.
    pub scheme: Scheme,
}

/// The placed resident file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResidentLayout {
    /// The index written at the head of the file.
    pub index: ResidentIndex,
    /// Bytes of the serialized index.
    pub index_len: u64,
    /// Absolute offset of the payload.
    pub payload_start: u64,
    /// Total file size.
    pub file_bytes: u64,
}

impl ResidentLayout {
    /// Place `inputs` in order. `None` when a size overflows or a quantized tensor's
    /// last dimension is not a multiple of 64 (the planner checks that first).
    pub fn place(inputs: &[ResidentInput]) -> Option<ResidentLayout> {
        let mut cursor = 0u64;
        let mut tensors = Vec::with_capacity(inputs.len());
        for t in inputs {
            let start = align_up(cursor, PAGE)?;
            let mut entry = ResidentEntry {
                name: t.name.clone(),
                dtype: t.dtype.clone(),
                shape: t.shape.clone(),
                scheme: t.scheme,
                data: None,
                weights: None,
                scales: None,
                biases: None,
            };
            let elems = t.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?;
            match t.scheme.bits() {
                None => {
                    let len = elems.checked_mul(t.elem_bytes)?;
                    entry.data = Some(Span { offset: start, len });
                    cursor = start.checked_add(len)?;
                }
                Some(bits) => {
                    let cols = *t.shape.last()?;
                    let rows = elems / cols.max(1);
                    let q = QuantSizes::new(rows, cols, bits)?;
                    let w = Span {
                        offset: start,
                        len: q.weights,
                    };
                    let s_off = align_up(w.offset.checked_add(w.len)?, SUBREGION_ALIGN)?;
                    let s = Span {
                        offset: s_off,
                        len: q.scales,
                    };
                    let b_off = align_up(s_off.checked_add(s.len)?, SUBREGION_ALIGN)?;
                    let b = Span {
                        offset: b_off,
                        len: q.biases,
                    };
                    cursor = b_off.checked_add(b.len)?;
                    entry.weights = Some(w);
                    entry.scales = Some(s);
                    entry.biases = Some(b);
                }
            }
            tensors.push(entry);
        }
        let index = ResidentIndex {
            format: "gturbo-resident".into(),
            version: 1,
            tensors,
        };
        let index_len = serde_json::to_vec(&index).ok()?.len() as u64;
        let payload_start = align_up(16 + index_len, PAGE)?;
        let file_bytes = if inputs.is_empty() {
            payload_start
        } else {
            payload_start.checked_add(align_up(cursor, SUBREGION_ALIGN)?)?
        };
        Some(ResidentLayout {
            index,
            index_len,
            payload_start,
            file_bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_start_on_pages_and_subregions_are_aligned() {
        let inputs = vec![
            ResidentInput {
                name: "a.weight".into(),
                dtype: "BF16".into(),
                shape: vec![3, 128],
                elem_bytes: 2,
                scheme: Scheme::Int4G64,
            },
            ResidentInput {
                name: "n.weight".into(),
                dtype: "BF16".into(),
                shape: vec![100],
                elem_bytes: 2,
                scheme: Scheme::Passthrough,
            },
        ];
        let l = ResidentLayout::place(&inputs).unwrap();
        let a = &l.index.tensors[0];
        assert_eq!(
            a.weights,
            Some(Span {
                offset: 0,
                len: 192
            })
        );
        assert_eq!(
            a.scales,
            Some(Span {
                offset: 192,
                len: 12
            })
        );
        assert_eq!(
            a.biases,
            Some(Span {
                offset: 256,
                len: 12
            })
        );
        let n = &l.index.tensors[1];
        assert_eq!(
            n.data,
            Some(Span {
                offset: PAGE,
                len: 200
            })
        );
        assert_eq!(l.payload_start, PAGE);
        assert_eq!(l.file_bytes, PAGE + PAGE + 256);
        assert_eq!(
            l.index_len,
            serde_json::to_vec(&l.index).unwrap().len() as u64
        );
    }
}
