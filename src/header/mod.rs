//! Safetensors shard headers, read with ranged requests and validated as hostile input.
//!
//! A shard is `[u64 LE header length n][n bytes of JSON][data]`. Only the first
//! `8 + n` bytes are ever fetched here: one speculative read of [`SPECULATIVE_READ`]
//! bytes usually covers both the length and the JSON; a second read fetches the rest
//! when it does not.
//!
//! (Skeleton: the helper owning this module replaces the bodies.)

use std::collections::BTreeMap;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::source::{RangeSource, SourceError};

/// Bytes fetched by the first, speculative header read.
pub const SPECULATIVE_READ: u64 = 64 * 1024;
/// Largest header accepted (the safetensors crate's own limit).
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// Element types a safetensors header may declare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[allow(missing_docs, non_camel_case_types, clippy::upper_case_acronyms)]
pub enum Dtype {
    BOOL,
    U8,
    I8,
    F8_E5M2,
    F8_E4M3,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    F64,
    I64,
    U64,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            Dtype::BOOL | Dtype::U8 | Dtype::I8 | Dtype::F8_E5M2 | Dtype::F8_E4M3 => 1,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 4,
            Dtype::F64 | Dtype::I64 | Dtype::U64 => 8,
        }
    }

    /// The name as written in headers (`BF16`, `I64`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::BOOL => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8_E5M2 => "F8_E5M2",
            Dtype::F8_E4M3 => "F8_E4M3",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
        }
    }
}

/// One tensor as its shard's header declares it, after validation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorHeader {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Logical shape.
    pub shape: Vec<u64>,
    /// Byte span relative to the start of the data section.
    pub data: Range<u64>,
}

/// A validated shard header.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardHeader {
    /// Shard file name inside the repo.
    pub shard: String,
    /// Shard size in bytes.
    pub file_size: u64,
    /// JSON header length `n`; the data section starts at `8 + n`.
    pub header_len: u64,
    /// Tensors sorted by data offset.
    pub tensors: Vec<TensorHeader>,
    /// `__metadata__`, if present.
    pub metadata: BTreeMap<String, String>,
}

impl ShardHeader {
    /// Absolute file offset where the data section starts.
    pub fn data_start(&self) -> u64 {
        8 + self.header_len
    }
}

/// A header that cannot be trusted. Every variant names the shard, and the tensor and
/// field where there is one.
#[derive(Debug, thiserror::Error)]
pub enum HeaderError {
    /// Placeholder until the real variants land.
    #[error("{shard}: {detail}")]
    Invalid {
        /// Shard.
        shard: String,
        /// What.
        detail: String,
    },
}

/// A header that could not be fetched or could not be trusted.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    /// Fetch failed.
    #[error(transparent)]
    Source(#[from] SourceError),
    /// Validation failed.
    #[error(transparent)]
    Header(#[from] HeaderError),
}

/// Validate `bytes` (at least the first `8 + n` bytes of the shard) as the header of
/// `shard`, a file of `file_size` bytes.
pub fn parse_header(shard: &str, file_size: u64, bytes: &[u8]) -> Result<ShardHeader, HeaderError> {
    let _ = (file_size, bytes);
    Err(HeaderError::Invalid {
        shard: shard.to_string(),
        detail: "header parsing not implemented yet".into(),
    })
}

/// Read and validate the header of `shard` (of `file_size` bytes) from `source`, with
/// one speculative ranged read and, when the header is longer, one more.
pub async fn read_header(
    source: &dyn RangeSource,
    shard: &str,
    file_size: u64,
) -> Result<ShardHeader, ShardError> {
    let first = source
        .read_range(shard, 0..SPECULATIVE_READ.min(file_size))
        .await?;
    Ok(parse_header(shard, file_size, &first)?)
}
