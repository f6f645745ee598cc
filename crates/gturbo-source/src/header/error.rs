//! Why a shard header is refused. One variant per kind of defect; each names the shard,
//! and the tensor and field where there is one, so a message alone says what to fix.
//!
//! Tensor names and other strings taken from the header are shown with `{:?}` quoting
//! (control characters escaped) and clipped to [`CLIP`] characters, so a hostile
//! header cannot flood or garble a terminal through an error message.

use std::ops::Range;

use super::Dtype;

/// Characters of a header-supplied string kept in an error message.
pub(crate) const CLIP: usize = 80;

/// `s`, clipped to [`CLIP`] characters with a marker saying how long it really was.
pub(crate) fn clip(s: &str) -> String {
    if s.chars().count() <= CLIP {
        s.to_string()
    } else {
        let head: String = s.chars().take(CLIP).collect();
        format!("{head}…({} bytes)", s.len())
    }
}

/// A header that cannot be trusted. Every variant names the shard, and the tensor and
/// field where there is one.
#[derive(Debug, thiserror::Error)]
pub enum HeaderError {
    /// The file cannot even hold the 8-byte header length.
    #[error("{shard}: file is {file_size} bytes, too short for the 8-byte header length")]
    FileTooSmall {
        /// Shard.
        shard: String,
        /// Its size.
        file_size: u64,
    },
    /// Header length `n` is 0 (the smallest header is `{}`).
    #[error("{shard}: header length is 0; the smallest valid header is `{{}}`")]
    EmptyHeader {
        /// Shard.
        shard: String,
    },
    /// Header length `n` is over [`super::MAX_HEADER_LEN`].
    #[error("{shard}: header length {len} bytes is over the {max}-byte limit")]
    HeaderTooLarge {
        /// Shard.
        shard: String,
        /// Declared length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// `8 + n` is past the end of the file.
    #[error(
        "{shard}: header length {len} bytes runs past the end of the {file_size}-byte file (8 + {len} > {file_size})"
    )]
    HeaderPastEof {
        /// Shard.
        shard: String,
        /// Declared length.
        len: u64,
        /// File size.
        file_size: u64,
    },
    /// The caller supplied fewer bytes than the header needs.
    #[error("{shard}: header needs the first {needed} bytes of the file, only {got} supplied")]
    Truncated {
        /// Shard.
        shard: String,
        /// Bytes needed (`8` or `8 + n`).
        needed: u64,
        /// Bytes supplied.
        got: u64,
    },
    /// The JSON bytes are not UTF-8.
    #[error("{shard}: header is not valid UTF-8 (first bad byte at file offset {offset})")]
    NotUtf8 {
        /// Shard.
        shard: String,
        /// Absolute file offset of the first invalid byte.
        offset: u64,
    },
    /// The header does not start with `{` (the spec requires it).
    #[error("{shard}: header must be a JSON object starting with `{{`, found {found}")]
    NotObject {
        /// Shard.
        shard: String,
        /// What the first byte was.
        found: String,
    },
    /// Not well-formed JSON (syntax, early end, trailing bytes other than whitespace).
    #[error("{shard}: header is not well-formed JSON")]
    Json {
        /// Shard.
        shard: String,
        /// The parser's message, with line and column.
        #[source]
        source: serde_json::Error,
    },
    /// The same tensor name appears twice (a JSON map would silently keep the last).
    #[error("{shard}: tensor {tensor:?} is declared more than once")]
    DuplicateTensor {
        /// Shard.
        shard: String,
        /// The name.
        tensor: String,
    },
    /// Empty or overlong tensor name.
    #[error("{shard}: tensor name {tensor:?}: {why}")]
    BadTensorName {
        /// Shard.
        shard: String,
        /// The name (clipped).
        tensor: String,
        /// Why it is refused.
        why: String,
    },
    /// `__metadata__` is not an object of strings, or repeats a key.
    #[error("{shard}: `__metadata__`{}: {detail}", fmt_key(key))]
    BadMetadata {
        /// Shard.
        shard: String,
        /// The metadata key at fault, if one.
        key: Option<String>,
        /// What is wrong.
        detail: String,
    },
    /// A tensor entry that is not a JSON object.
    #[error(
        "{shard}: tensor {tensor:?}: entry must be an object with `dtype`, `shape` and `data_offsets`, found {found}"
    )]
    TensorNotObject {
        /// Shard.
        shard: String,
        /// Tensor.
        tensor: String,
        /// What was there instead.
        found: String,
    },
    /// A field other than `dtype`, `shape`, `data_offsets`.
    #[error("{shard}: tensor {tensor:?}: unknown field {field:?}")]
    UnknownField {
        /// Shard.
        shard: String,
        /// Tensor.
        tensor: String,
        /// The field (clipped).
        field: String,
    },
    /// A field given twice.
    #[error("{shard}: tensor {tensor:?}: field `{field}` appears more than once")]
    DuplicateField {
        /// Shard.
        shard: String,
        /// Tensor.
        tensor: String,
        /// The field.
        field: &'static str,
    },
    /// A required field is absent.
    #[error("{shard}: tensor {tensor:?}: missing field `{field}`")]
    MissingField {
        /// Shard.
        shard: String,
        /// Tensor.
        tensor: String,
        /// The field.
        field: &'static str,
    },
    /// A field of the wrong JSON type.
    #[error("{shard}: tensor {tensor:?}: field `{field}` must be {expected}, found {found}")]
    FieldType {
        /// Shard.
        shard: String,
        /// Tensor.
        tensor: String,
        /// The field.
        field: &'static str,
        /// What it must be.
        expected: &'static str,
        /// What it was.
        found: String,
    },
    /// `dtype` names no known element type.
    #[error("{shard}: tensor {tensor:?}: field `dtype`: unknown dtype {dtype:?}")]
    UnknownDtype {
        /// Shard.
        shard: String,
        /// Tensor.
        tensor: String,
        /// The dtype string (clipped).
        dtype: String,
    },
    /// `shape` has a negative, fractional or absurd dimension, or too many.
    #[error("{shard}: tensor {tensor:?}: field `shape`: {detail}")]
    BadShape {
        /// Shard.
        shard: String,
        /// Tensor.
        tensor: String,
        /// What is wrong, naming the dimension.
        detail: String,
    },
    /// `data_offsets` is not `[begin, end]` with integers `begin <= end`.
    #[error("{shard}: tensor {tensor:?}: field `data_offsets`: {detail}")]
    BadOffsets {
        /// Shard.
        shard: String,
        /// Tensor.
        tensor: String,
        /// What is wrong.
        detail: String,
    },
    /// `product(shape) × dtype size` differs from `end − begin`.
    #[error(
        "{shard}: tensor {tensor:?}: field `data_offsets` spans {declared} bytes, but {dtype} × shape {shape:?} is {expected} bytes"
    )]
    SpanMismatch {
        /// Shard.
        shard: String,
        /// Tensor.
        tensor: String,
        /// Element type.
        dtype: Dtype,
        /// Shape.
        shape: Vec<u64>,
        /// `end − begin`.
        declared: u64,
        /// `product(shape) × dtype size`.
        expected: u64,
    },
    /// `product(shape) × dtype size` does not fit in 64 bits.
    #[error(
        "{shard}: tensor {tensor:?}: field `shape`: {dtype} × shape {shape:?} overflows 64 bits"
    )]
    SizeOverflow {
        /// Shard.
        shard: String,
        /// Tensor.
        tensor: String,
        /// Element type.
        dtype: Dtype,
        /// Shape.
        shape: Vec<u64>,
    },
    /// Two tensors share data bytes.
    #[error(
        "{shard}: tensors {first:?} (data bytes {}..{}) and {second:?} (data bytes {}..{}) overlap",
        first_span.start, first_span.end, second_span.start, second_span.end
    )]
    Overlap {
        /// Shard.
        shard: String,
        /// The tensor starting first.
        first: String,
        /// Its span.
        first_span: Range<u64>,
        /// The tensor starting inside it.
        second: String,
        /// Its span.
        second_span: Range<u64>,
    },
    /// Data bytes that belong to no tensor.
    #[error(
        "{shard}: data bytes {}..{} belong to no tensor (between {} and tensor {after:?})",
        gap.start, gap.end, fmt_before(before)
    )]
    Gap {
        /// Shard.
        shard: String,
        /// The tensor before the gap; `None` when the gap is at the start of the data.
        before: Option<String>,
        /// The tensor after the gap.
        after: String,
        /// The uncovered span, relative to the data section.
        gap: Range<u64>,
    },
    /// The tensors do not end exactly where the file ends.
    #[error(
        "{shard}: tensors cover {covered} data bytes (last: {}) but the file holds {data_len} bytes after its header",
        fmt_last(last_tensor)
    )]
    DataEndMismatch {
        /// Shard.
        shard: String,
        /// The tensor ending last, if any.
        last_tensor: Option<String>,
        /// End of the last tensor, relative to the data section.
        covered: u64,
        /// `file_size − (8 + n)`.
        data_len: u64,
    },
}

impl HeaderError {
    /// The shard every variant names.
    pub fn shard(&self) -> &str {
        match self {
            HeaderError::FileTooSmall { shard, .. }
            | HeaderError::EmptyHeader { shard }
            | HeaderError::HeaderTooLarge { shard, .. }
            | HeaderError::HeaderPastEof { shard, .. }
            | HeaderError::Truncated { shard, .. }
            | HeaderError::NotUtf8 { shard, .. }
            | HeaderError::NotObject { shard, .. }
            | HeaderError::Json { shard, .. }
            | HeaderError::DuplicateTensor { shard, .. }
            | HeaderError::BadTensorName { shard, .. }
            | HeaderError::BadMetadata { shard, .. }
            | HeaderError::TensorNotObject { shard, .. }
            | HeaderError::UnknownField { shard, .. }
            | HeaderError::DuplicateField { shard, .. }
            | HeaderError::MissingField { shard, .. }
            | HeaderError::FieldType { shard, .. }
            | HeaderError::UnknownDtype { shard, .. }
            | HeaderError::BadShape { shard, .. }
            | HeaderError::BadOffsets { shard, .. }
            | HeaderError::SpanMismatch { shard, .. }
            | HeaderError::SizeOverflow { shard, .. }
            | HeaderError::Overlap { shard, .. }
            | HeaderError::Gap { shard, .. }
            | HeaderError::DataEndMismatch { shard, .. } => shard,
        }
    }
}

fn fmt_key(key: &Option<String>) -> String {
    match key {
        Some(k) => format!(" key {k:?}"),
        None => String::new(),
    }
}

fn fmt_before(before: &Option<String>) -> String {
    match before {
        Some(t) => format!("tensor {t:?}"),
        None => "the start of the data section".to_string(),
    }
}

fn fmt_last(last: &Option<String>) -> String {
    match last {
        Some(t) => format!("tensor {t:?}"),
        None => "no tensors".to_string(),
    }
}
