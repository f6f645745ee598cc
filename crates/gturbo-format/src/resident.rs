//! The resident weights file: everything that is not a routed expert or a row table.
//!
//! Layout (see `manifests/FORMAT.md`):
//! `[8 bytes magic "GTRBRES1"][u64 LE index length n][n bytes JSON index][zeros to the
//! next PAGE][payload]`. Offsets in the index are relative to the payload start
//! (`align_up(16 + n, PAGE)`), so the index never depends on its own length. Every
//! entry starts on a PAGE boundary; its sub-regions (weights, scales, biases) are
//! packed after it, each aligned to [`SUBREGION_ALIGN`].

use serde::{Deserialize, Serialize};

use super::sizes::matrix_dims;
use super::{Affine, LayoutError, PAGE, SUBREGION_ALIGN, Scheme, align_up};
use crate::dtype::Dtype;

/// File magic.
pub const MAGIC: &[u8; 8] = b"GTRBRES1";
/// The index's `format` tag.
pub const INDEX_FORMAT: &str = "gturbo-resident";
/// The index version this reader knows.
pub const INDEX_VERSION: u32 = 1;
/// Largest JSON index a reader accepts (the full Flash-Next index is about 200 KB).
pub const MAX_INDEX_BYTES: u64 = 64 << 20;

/// A byte span `[offset, offset + len)` relative to the payload start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Span {
    /// Offset from the payload start.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// One tensor in the resident file.
///
/// On disk (the JSON index) an entry is `{"name", "dtype", "shape", "scheme", "data"}`
/// for passthrough or `{..., "scheme", "weights", "scales", "biases"}` for a quantized
/// scheme, in that key order; the typed [`Storage`] makes the two shapes the only ones
/// that exist in memory.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "WireEntry")]
pub struct ResidentEntry {
    /// Source tensor name.
    pub name: String,
    /// Source dtype: the element type of passthrough data, and the dtype whose values
    /// a quantized entry's scales and biases encode.
    pub dtype: Dtype,
    /// Logical shape.
    pub shape: Vec<u64>,
    /// How the bytes are stored, and where.
    pub storage: Storage,
}

/// How a resident entry's bytes are stored, with its spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// The source bytes at the source dtype (scheme `passthrough`).
    Dense {
        /// The data.
        data: Span,
    },
    /// MLX affine quantization (see [`super::sizes`]).
    Quant {
        /// Bits and group size.
        affine: Affine,
        /// Packed U32 weights.
        weights: Span,
        /// Scales.
        scales: Span,
        /// Biases.
        biases: Span,
    },
}

/// An entry as written in the JSON index (field order is the on-disk key order).
#[derive(Serialize)]
struct WireEntryOut<'a> {
    name: &'a str,
    dtype: &'static str,
    shape: &'a [u64],
    scheme: std::borrow::Cow<'static, str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    data: Option<Span>,
    #[serde(skip_serializing_if = "Option::is_none")]
    weights: Option<Span>,
    #[serde(skip_serializing_if = "Option::is_none")]
    scales: Option<Span>,
    #[serde(skip_serializing_if = "Option::is_none")]
    biases: Option<Span>,
}

/// An entry as read from the JSON index, before its dtype and spans are checked
/// against its scheme.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WireEntry {
    name: String,
    dtype: String,
    shape: Vec<u64>,
    scheme: Scheme,
    #[serde(default)]
    data: Option<Span>,
    #[serde(default)]
    weights: Option<Span>,
    #[serde(default)]
    scales: Option<Span>,
    #[serde(default)]
    biases: Option<Span>,
}

impl Serialize for ResidentEntry {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (scheme, data, weights, scales, biases) = match self.storage {
            Storage::Dense { data } => (
                Scheme::Passthrough.label().into(),
                Some(data),
                None,
                None,
                None,
            ),
            Storage::Quant {
                affine,
                weights,
                scales,
                biases,
            } => (
                affine.label().into(),
                None,
                Some(weights),
                Some(scales),
                Some(biases),
            ),
        };
        WireEntryOut {
            name: &self.name,
            dtype: self.dtype.name(),
            shape: &self.shape,
            scheme,
            data,
            weights,
            scales,
            biases,
        }
        .serialize(s)
    }
}

impl WireEntry {
    /// The typed entry; `Err((field, why))` when the dtype is unknown or the spans are
    /// not the ones the scheme has.
    fn typed(self) -> Result<ResidentEntry, (&'static str, String)> {
        let dtype = Dtype::from_name(&self.dtype).ok_or_else(|| {
            (
                "dtype",
                format!("{:?} is not a safetensors dtype", self.dtype),
            )
        })?;
        if self.scheme == Scheme::Mxfp4 {
            // MXFP4 lives in expert pools only (gpt-oss's experts); the resident file
            // has no span for it.
            return Err((
                "scheme",
                format!(
                    "{}: a resident entry is passthrough or affine",
                    self.scheme.label()
                ),
            ));
        }
        let storage = match (
            self.scheme.affine(),
            self.data,
            self.weights,
            self.scales,
            self.biases,
        ) {
            (None, Some(data), None, None, None) => Storage::Dense { data },
            (Some(affine), None, Some(weights), Some(scales), Some(biases)) => Storage::Quant {
                affine,
                weights,
                scales,
                biases,
            },
            (a, data, weights, scales, biases) => {
                let has: Vec<&str> = [
                    ("data", data),
                    ("weights", weights),
                    ("scales", scales),
                    ("biases", biases),
                ]
                .into_iter()
                .filter_map(|(n, s)| s.map(|_| n))
                .collect();
                let want = if a.is_some() {
                    "weights, scales and biases"
                } else {
                    "data"
                };
                return Err((
                    "",
                    format!(
                        "spans {has:?}; scheme {} stores {want}",
                        self.scheme.label()
                    ),
                ));
            }
        };
        Ok(ResidentEntry {
            name: self.name,
            dtype,
            shape: self.shape,
            storage,
        })
    }
}

impl TryFrom<WireEntry> for ResidentEntry {
    type Error = String;

    fn try_from(w: WireEntry) -> Result<ResidentEntry, String> {
        let name: String = w.name.chars().take(200).collect();
        w.typed().map_err(|(field, why)| {
            if field.is_empty() {
                format!("tensor {name}: {why}")
            } else {
                format!("tensor {name}: {field}: {why}")
            }
        })
    }
}

/// The JSON index at the head of the resident file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
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
    /// Source dtype.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<u64>,
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
    /// last dimension has no layout under its scheme (the planner checks that first).
    pub fn place(inputs: &[ResidentInput]) -> Option<ResidentLayout> {
        let mut cursor = 0u64;
        let mut tensors = Vec::with_capacity(inputs.len());
        for t in inputs {
            let start = align_up(cursor, PAGE)?;
            let (rows, cols) = matrix_dims(&t.shape)?;
            if t.scheme == Scheme::Mxfp4 {
                // Expert pools only (see `WireEntry::typed`).
                return None;
            }
            let q = t.scheme.sizes(rows, cols, t.dtype.size())?;
            let storage = match t.scheme.affine() {
                None => {
                    let data = Span {
                        offset: start,
                        len: q.weights,
                    };
                    cursor = start.checked_add(data.len)?;
                    Storage::Dense { data }
                }
                Some(affine) => {
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
                    Storage::Quant {
                        affine,
                        weights: w,
                        scales: s,
                        biases: b,
                    }
                }
            };
            tensors.push(ResidentEntry {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                storage,
            });
        }
        let index = ResidentIndex {
            format: INDEX_FORMAT.into(),
            version: INDEX_VERSION,
            tensors,
        };
        let index_len = serde_json::to_vec(&index)
            .expect("a resident index always serializes: strings, integers and spans")
            .len() as u64;
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

/// The head of a resident file as read back: the index and where the payload starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResidentHead {
    /// The parsed index.
    pub index: ResidentIndex,
    /// Bytes of the JSON index.
    pub index_len: u64,
    /// Absolute offset of the payload: `align_up(16 + index_len, PAGE)`.
    pub payload_start: u64,
}

impl ResidentHead {
    /// Read the head from `reader` positioned at the start of a file of `file_bytes`
    /// bytes: magic, index length (at most [`MAX_INDEX_BYTES`] and inside the file),
    /// the JSON index (known keys only, the known format and version). It never
    /// allocates more than the index length it has checked. Errors name the byte
    /// offset or field.
    pub fn read(
        reader: &mut impl std::io::Read,
        file_bytes: u64,
    ) -> Result<ResidentHead, LayoutError> {
        let mut prefix = [0u8; 16];
        if file_bytes < 16 {
            return Err(LayoutError::new(
                "byte 0",
                format!("{file_bytes} bytes; the head alone is 16 bytes"),
            ));
        }
        reader.read_exact(&mut prefix).map_err(|e| {
            LayoutError::new("byte 0", format!("cannot read the 16-byte head: {e}"))
        })?;
        if &prefix[..8] != MAGIC {
            return Err(LayoutError::new(
                "byte 0 (magic)",
                format!(
                    "{:?}, expected {:?}",
                    String::from_utf8_lossy(&prefix[..8]),
                    String::from_utf8_lossy(MAGIC)
                ),
            ));
        }
        let index_len = u64::from_le_bytes(prefix[8..16].try_into().unwrap_or([0; 8]));
        if index_len > MAX_INDEX_BYTES || index_len > file_bytes - 16 {
            return Err(LayoutError::new(
                "byte 8 (index length)",
                format!(
                    "{index_len} bytes; the file has {} after the head and an index may have at most {MAX_INDEX_BYTES}",
                    file_bytes - 16
                ),
            ));
        }
        let mut json = vec![0u8; index_len as usize];
        reader.read_exact(&mut json).map_err(|e| {
            LayoutError::new(
                "byte 16 (index)",
                format!("cannot read {index_len} bytes: {e}"),
            )
        })?;
        /// The index as read, before its entries are typed.
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct WireIndex {
            format: String,
            version: u32,
            tensors: Vec<WireEntry>,
        }
        let wire: WireIndex = serde_json::from_slice(&json)
            .map_err(|e| LayoutError::new("byte 16 (index)", format!("not a valid index: {e}")))?;
        if wire.format != INDEX_FORMAT || wire.version != INDEX_VERSION {
            return Err(LayoutError::new(
                "index format",
                format!(
                    "{:?} version {}; this reader knows {INDEX_FORMAT:?} version {INDEX_VERSION}",
                    wire.format, wire.version
                ),
            ));
        }
        let mut tensors = Vec::with_capacity(wire.tensors.len());
        for (i, w) in wire.tensors.into_iter().enumerate() {
            let at = entry_field(i, &w.name);
            tensors.push(w.typed().map_err(|(field, why)| {
                LayoutError::new(
                    if field.is_empty() {
                        format!("index.{at}")
                    } else {
                        format!("index.{at}.{field}")
                    },
                    why,
                )
            })?);
        }
        let index = ResidentIndex {
            format: wire.format,
            version: wire.version,
            tensors,
        };
        let payload_start = align_up(16 + index_len, PAGE).unwrap_or(u64::MAX);
        Ok(ResidentHead {
            index,
            index_len,
            payload_start,
        })
    }

    /// [`ResidentHead::read`] on bytes in memory (the whole file or at least its head).
    pub fn parse(bytes: &[u8], file_bytes: u64) -> Result<ResidentHead, LayoutError> {
        ResidentHead::read(&mut &bytes[..], file_bytes)
    }
}

/// `tensors[i] (name)`, the name cut to 200 characters: how errors name an entry.
fn entry_field(i: usize, name: &str) -> String {
    let name: String = name.chars().take(200).collect();
    format!("tensors[{i}] ({name})")
}

impl ResidentEntry {
    /// Byte spans of the entry with their names (`data`, or `weights`, `scales`,
    /// `biases`), in payload order as written.
    pub fn spans(&self) -> Vec<(&'static str, Span)> {
        match self.storage {
            Storage::Dense { data } => vec![("data", data)],
            Storage::Quant {
                weights,
                scales,
                biases,
                ..
            } => vec![("weights", weights), ("scales", scales), ("biases", biases)],
        }
    }

    /// Stored bytes: the sum of the span lengths.
    pub fn stored_bytes(&self) -> u64 {
        self.spans().iter().map(|(_, s)| s.len).sum()
    }

    /// The scheme name the entry is stored under (`passthrough`, `int4_g64`).
    pub fn scheme_label(&self) -> String {
        match self.storage {
            Storage::Dense { .. } => Scheme::Passthrough.label(),
            Storage::Quant { affine, .. } => affine.label(),
        }
    }

    /// The span lengths the entry must have, in span order; `Err((field, why))` when
    /// its shape admits none under its storage.
    pub fn expected_lens(&self) -> Result<Vec<(&'static str, u64)>, (&'static str, String)> {
        let (rows, cols) = matrix_dims(&self.shape)
            .ok_or(("shape", format!("{:?} overflows 64 bits", self.shape)))?;
        match self.storage {
            Storage::Dense { .. } => {
                let q = Scheme::Passthrough
                    .sizes(rows, cols, self.dtype.size())
                    .ok_or(("shape", format!("{:?} overflows 64 bits", self.shape)))?;
                Ok(vec![("data", q.weights)])
            }
            Storage::Quant { affine, .. } => {
                let q = affine.sizes(rows, cols).ok_or((
                    "shape",
                    format!(
                        "{:?} cannot be stored at {}: the last axis must be a positive multiple of {}",
                        self.shape,
                        affine.label(),
                        affine.group()
                    ),
                ))?;
                Ok(vec![
                    ("weights", q.weights),
                    ("scales", q.scales),
                    ("biases", q.biases),
                ])
            }
        }
    }
}

impl ResidentIndex {
    /// Whether the index describes a valid payload of `payload_bytes` bytes (the file
    /// size minus the payload start): every entry's dtype and shape give its byte
    /// sizes under its scheme, each entry starts on a page and its sub-regions on 64
    /// bytes, every span lies inside the payload and no two spans overlap, and the
    /// file ends at the last entry rounded up to 64 bytes. Empty when consistent.
    pub fn layout_errors(&self, payload_bytes: u64) -> Vec<LayoutError> {
        let mut errs = Vec::new();
        let mut all: Vec<(u64, u64, String)> = Vec::new();
        let mut last_end = 0u64;
        for (i, e) in self.tensors.iter().enumerate() {
            let at = |f: &str| {
                let entry = entry_field(i, &e.name);
                if f.is_empty() {
                    entry
                } else {
                    format!("{entry}.{f}")
                }
            };
            let spans = e.spans();
            match e.expected_lens() {
                Err(why) => errs.push(LayoutError::new(at(why.0), why.1)),
                Ok(want) => {
                    let got: Vec<(&str, u64)> = spans.iter().map(|(n, s)| (*n, s.len)).collect();
                    if got != want {
                        errs.push(LayoutError::new(
                            at(""),
                            format!(
                                "spans {got:?}; dtype {} shape {:?} at {} gives {want:?}",
                                e.dtype.name(),
                                e.shape,
                                e.scheme_label()
                            ),
                        ));
                    }
                }
            }
            for (k, (n, s)) in spans.iter().enumerate() {
                let align = if k == 0 { PAGE } else { SUBREGION_ALIGN };
                if !s.offset.is_multiple_of(align) {
                    errs.push(LayoutError::new(
                        at(&format!("{n}.offset")),
                        format!("{} is not a multiple of {align}", s.offset),
                    ));
                }
                match s.offset.checked_add(s.len) {
                    Some(end) if end <= payload_bytes => {
                        last_end = last_end.max(end);
                        if s.len > 0 {
                            all.push((s.offset, end, at(n)));
                        }
                    }
                    _ => errs.push(LayoutError::new(
                        at(&format!("{n}.offset")),
                        format!(
                            "span at {} of {} bytes ends past the payload's {payload_bytes} bytes",
                            s.offset, s.len
                        ),
                    )),
                }
            }
        }
        all.sort();
        for w in all.windows(2) {
            if w[1].0 < w[0].1 {
                errs.push(LayoutError::new(
                    w[1].2.clone() + ".offset",
                    format!(
                        "span [{}, {}) overlaps {} at [{}, {})",
                        w[1].0, w[1].1, w[0].2, w[0].0, w[0].1
                    ),
                ));
            }
        }
        if errs.is_empty() {
            let want = align_up(last_end, SUBREGION_ALIGN).unwrap_or(u64::MAX);
            if want != payload_bytes {
                errs.push(LayoutError::new(
                    "payload",
                    format!("{payload_bytes} bytes; the last entry ends at {last_end}, which gives {want}"),
                ));
            }
        }
        errs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two_entries() -> ResidentLayout {
        ResidentLayout::place(&[
            ResidentInput {
                name: "a.weight".into(),
                dtype: Dtype::BF16,
                shape: vec![3, 128],
                scheme: Scheme::Int4G64,
            },
            ResidentInput {
                name: "n.weight".into(),
                dtype: Dtype::BF16,
                shape: vec![100],
                scheme: Scheme::Passthrough,
            },
        ])
        .unwrap()
    }

    fn file_of(l: &ResidentLayout) -> Vec<u8> {
        let json = serde_json::to_vec(&l.index).unwrap();
        let mut f = MAGIC.to_vec();
        f.extend_from_slice(&(json.len() as u64).to_le_bytes());
        f.extend_from_slice(&json);
        f.resize(l.file_bytes as usize, 0);
        f
    }

    #[test]
    fn a_placed_layout_reads_back_and_is_consistent() {
        let l = two_entries();
        let f = file_of(&l);
        let head = ResidentHead::parse(&f, f.len() as u64).unwrap();
        assert_eq!(head.index, l.index);
        assert_eq!(head.payload_start, l.payload_start);
        assert_eq!(
            head.index.layout_errors(l.file_bytes - l.payload_start),
            vec![]
        );
    }

    #[test]
    fn hostile_heads_are_refused_by_offset() {
        let l = two_entries();
        let f = file_of(&l);
        let mut bad = f.clone();
        bad[0] = b'X';
        assert_eq!(
            ResidentHead::parse(&bad, bad.len() as u64)
                .unwrap_err()
                .field,
            "byte 0 (magic)"
        );
        let mut bad = f.clone();
        bad[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        let e = ResidentHead::parse(&bad, bad.len() as u64).unwrap_err();
        assert_eq!(e.field, "byte 8 (index length)");
        assert!(e.detail.starts_with("18446744073709551615 bytes"), "{e}");
        let e = ResidentHead::parse(&f[..10], 10).unwrap_err();
        assert_eq!(e.field, "byte 0");
        let mut bad = f.clone();
        bad[16] = b'[';
        let e = ResidentHead::parse(&bad, bad.len() as u64).unwrap_err();
        assert_eq!(e.field, "byte 16 (index)");
        // Deep nesting is refused without exhausting the stack.
        let deep = "[".repeat(100_000);
        let mut bad = MAGIC.to_vec();
        bad.extend_from_slice(&(deep.len() as u64).to_le_bytes());
        bad.extend_from_slice(deep.as_bytes());
        let e = ResidentHead::parse(&bad, bad.len() as u64).unwrap_err();
        assert_eq!(e.field, "byte 16 (index)");
    }

    #[test]
    fn index_errors_name_the_entry_and_span() {
        let l = two_entries();
        let payload = l.file_bytes - l.payload_start;
        let dense = |offset, len| Storage::Dense {
            data: Span { offset, len },
        };
        let mut ix = l.index.clone();
        ix.tensors[1].storage = dense(0, 200);
        let e = ix.layout_errors(payload);
        assert_eq!(e.len(), 2, "{e:?}");
        assert_eq!(e[0].field, "tensors[1] (n.weight).data.offset");
        assert_eq!(e[1].field, "tensors[0] (a.weight).scales.offset");
        assert!(
            e[0].detail
                .contains("overlaps tensors[0] (a.weight).weights at [0, 192)"),
            "{e:?}"
        );

        let mut ix = l.index.clone();
        ix.tensors[1].storage = dense(u64::MAX - 10, 200);
        let e = ix.layout_errors(payload);
        assert_eq!(e[1].field, "tensors[1] (n.weight).data.offset");
        assert!(e[1].detail.contains("ends past the payload"), "{e:?}");

        let mut ix = l.index.clone();
        ix.tensors[1].shape = vec![u64::MAX, 2];
        let e = ix.layout_errors(payload);
        assert_eq!(e[0].field, "tensors[1] (n.weight).shape");

        let mut ix = l.index.clone();
        ix.tensors[0].shape = vec![3, 129];
        let e = ix.layout_errors(payload);
        assert_eq!(e[0].field, "tensors[0] (a.weight).shape");

        let mut ix = l.index.clone();
        ix.tensors[1].shape = vec![101];
        let e = ix.layout_errors(payload);
        assert_eq!(e[0].field, "tensors[1] (n.weight)");
        assert!(e[0].detail.contains("gives [(\"data\", 202)]"), "{e:?}");

        assert_eq!(l.index.layout_errors(payload + 64)[0].field, "payload");
    }

    /// What the typed entry cannot hold is refused when the head is read, named by
    /// entry and field as the layout errors name them.
    #[test]
    fn entries_the_types_cannot_hold_are_refused_by_entry() {
        let l = two_entries();
        let edit = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut ix = serde_json::to_value(&l.index).unwrap();
            f(&mut ix);
            let json = serde_json::to_vec(&ix).unwrap();
            let mut file = MAGIC.to_vec();
            file.extend_from_slice(&(json.len() as u64).to_le_bytes());
            file.extend_from_slice(&json);
            file.resize(l.file_bytes as usize, 0);
            ResidentHead::parse(&file, file.len() as u64).unwrap_err()
        };
        let e = edit(&|ix| ix["tensors"][0]["dtype"] = "Q9".into());
        assert_eq!(e.field, "index.tensors[0] (a.weight).dtype");
        assert_eq!(e.detail, "\"Q9\" is not a safetensors dtype");
        let e =
            edit(&|ix| ix["tensors"][1]["weights"] = serde_json::json!({"offset": 0, "len": 0}));
        assert_eq!(e.field, "index.tensors[1] (n.weight)");
        assert_eq!(
            e.detail,
            "spans [\"data\", \"weights\"]; scheme passthrough stores data"
        );
        let e = edit(&|ix| {
            ix["tensors"][0].as_object_mut().unwrap().remove("biases");
        });
        assert_eq!(
            e.detail,
            "spans [\"weights\", \"scales\"]; scheme int4_g64 stores weights, scales and biases"
        );
        // Every MLX layout is a scheme; a width MLX does not write is not.
        let e = edit(&|ix| ix["tensors"][0]["scheme"] = "int7_g64".into());
        assert_eq!(e.field, "byte 16 (index)");
        assert!(
            e.detail
                .contains("7 bits in groups of 64 is not a layout MLX writes"),
            "{e}"
        );
        // Through serde alone (a plan read back), the entry is named too.
        let mut ix = serde_json::to_value(&l.index).unwrap();
        ix["tensors"][0]["dtype"] = "Q9".into();
        let e = serde_json::from_value::<ResidentIndex>(ix).unwrap_err();
        assert_eq!(
            e.to_string(),
            "tensor a.weight: dtype: \"Q9\" is not a safetensors dtype"
        );
    }

    /// The index keeps its on-disk form: the keys in this order, `data` or the three
    /// quantized spans, the scheme by name.
    #[test]
    fn the_index_json_is_the_documented_form() {
        let l = two_entries();
        assert_eq!(
            String::from_utf8(serde_json::to_vec(&l.index).unwrap()).unwrap(),
            concat!(
                r#"{"format":"gturbo-resident","version":1,"tensors":["#,
                r#"{"name":"a.weight","dtype":"BF16","shape":[3,128],"scheme":"int4_g64","#,
                r#""weights":{"offset":0,"len":192},"scales":{"offset":192,"len":12},"#,
                r#""biases":{"offset":256,"len":12}},"#,
                r#"{"name":"n.weight","dtype":"BF16","shape":[100],"scheme":"passthrough","#,
                r#""data":{"offset":16384,"len":200}}]}"#
            )
        );
    }

    #[test]
    fn entries_start_on_pages_and_subregions_are_aligned() {
        let l = two_entries();
        let a = &l.index.tensors[0];
        assert_eq!(
            a.storage,
            Storage::Quant {
                affine: Scheme::Int4G64.affine().unwrap(),
                weights: Span {
                    offset: 0,
                    len: 192
                },
                scales: Span {
                    offset: 192,
                    len: 12
                },
                biases: Span {
                    offset: 256,
                    len: 12
                },
            }
        );
        let n = &l.index.tensors[1];
        assert_eq!(
            n.storage,
            Storage::Dense {
                data: Span {
                    offset: PAGE,
                    len: 200
                }
            }
        );
        assert_eq!(l.payload_start, PAGE);
        assert_eq!(l.file_bytes, PAGE + PAGE + 256);
        assert_eq!(
            l.index_len,
            serde_json::to_vec(&l.index).unwrap().len() as u64
        );
    }
}
