//! Safetensors shard headers, read with ranged requests and validated as hostile input.
//!
//! A shard is `[u64 LE header length n][n bytes of JSON][data]`. Only the first
//! `8 + n` bytes are ever fetched here: one speculative read of [`SPECULATIVE_READ`]
//! bytes usually covers both the length and the JSON; a second read fetches the rest
//! when it does not.
//!
//! Everything in a header is hostile input: the length is capped, the JSON
//! is read key by key so duplicate names are caught (`json`), every tensor's
//! `dtype × shape` must equal its byte span, and the spans must tile the data section
//! exactly, from 0 to the end of the file. Refusals are [`HeaderError`]s naming the
//! shard, tensor and field.

use std::collections::BTreeMap;
use std::ops::Range;

use serde::de::DeserializeSeed;
use serde::{Deserialize, Serialize};

use crate::source::{RangeSource, SourceError};

mod error;
mod json;

pub use error::HeaderError;

/// Bytes fetched by the first, speculative header read.
pub const SPECULATIVE_READ: u64 = 64 * 1024;
/// Largest header accepted (the safetensors crate's own limit).
pub const MAX_HEADER_LEN: u64 = 100_000_000;

pub use crate::format::dtype::Dtype;

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

fn check_file_size(shard: &str, file_size: u64) -> Result<(), HeaderError> {
    if file_size < 8 {
        return Err(HeaderError::FileTooSmall {
            shard: shard.to_string(),
            file_size,
        });
    }
    Ok(())
}

/// Check that a file of `file_size` bytes can hold a header, and read the header
/// length from `bytes`; returns `8 + n`, the bytes the whole header needs.
fn header_extent(shard: &str, file_size: u64, bytes: &[u8]) -> Result<u64, HeaderError> {
    check_file_size(shard, file_size)?;
    let Some(len_bytes) = bytes.first_chunk::<8>() else {
        return Err(HeaderError::Truncated {
            shard: shard.to_string(),
            needed: 8,
            got: bytes.len() as u64,
        });
    };
    let len = u64::from_le_bytes(*len_bytes);
    if len == 0 {
        return Err(HeaderError::EmptyHeader {
            shard: shard.to_string(),
        });
    }
    if len > MAX_HEADER_LEN {
        return Err(HeaderError::HeaderTooLarge {
            shard: shard.to_string(),
            len,
            max: MAX_HEADER_LEN,
        });
    }
    // len <= MAX_HEADER_LEN, so 8 + len cannot overflow.
    if 8 + len > file_size {
        return Err(HeaderError::HeaderPastEof {
            shard: shard.to_string(),
            len,
            file_size,
        });
    }
    Ok(8 + len)
}

/// Validate `bytes` (at least the first `8 + n` bytes of the shard) as the header of
/// `shard`, a file of `file_size` bytes. Bytes past `8 + n` are ignored.
pub fn parse_header(shard: &str, file_size: u64, bytes: &[u8]) -> Result<ShardHeader, HeaderError> {
    let needed = header_extent(shard, file_size, bytes)?;
    let header_len = needed - 8;
    let json = usize::try_from(needed)
        .ok()
        .and_then(|end| bytes.get(8..end))
        .ok_or_else(|| HeaderError::Truncated {
            shard: shard.to_string(),
            needed,
            got: bytes.len() as u64,
        })?;
    let text = std::str::from_utf8(json).map_err(|e| HeaderError::NotUtf8 {
        shard: shard.to_string(),
        offset: 8 + e.valid_up_to() as u64,
    })?;
    if !text.starts_with('{') {
        return Err(HeaderError::NotObject {
            shard: shard.to_string(),
            found: describe_first_char(text),
        });
    }

    let ctx = json::Ctx::new(shard);
    let mut de = serde_json::Deserializer::from_str(text);
    // `end()` allows only JSON whitespace after the object: the spaces writers pad
    // with (and the newlines some tools add, which the safetensors crate accepts too).
    let parsed = json::TopSeed(&ctx)
        .deserialize(&mut de)
        .and_then(|raw| de.end().map(|()| raw));
    let raw = match (parsed, ctx.problem.into_inner()) {
        (_, Some(problem)) => return Err(problem),
        (Ok(raw), None) => raw,
        (Err(source), None) => {
            return Err(HeaderError::Json {
                shard: shard.to_string(),
                source,
            });
        }
    };

    let tensors = check_layout(shard, file_size - needed, raw.tensors)?;
    Ok(ShardHeader {
        shard: shard.to_string(),
        file_size,
        header_len,
        tensors,
        metadata: raw.metadata,
    })
}

fn describe_first_char(text: &str) -> String {
    match text.chars().next() {
        None => "nothing".to_string(),
        Some(c) if c.is_ascii_graphic() => format!("`{c}`"),
        Some(c) => format!("{c:?} (U+{:04X})", u32::from(c)),
    }
}

/// Span checks per tensor (in file order), then the layout of the data section:
/// sorted by offset, contiguous from 0, ending exactly at the end of the file.
fn check_layout(
    shard: &str,
    data_len: u64,
    raw: Vec<json::RawTensor>,
) -> Result<Vec<TensorHeader>, HeaderError> {
    let mut tensors = Vec::with_capacity(raw.len());
    for t in raw {
        // A zero dimension makes the tensor empty however large the others are.
        let elements = if t.shape.contains(&0) {
            Some(0)
        } else {
            t.shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))
        };
        let Some(expected) = elements.and_then(|n| n.checked_mul(t.dtype.size())) else {
            return Err(HeaderError::SizeOverflow {
                shard: shard.to_string(),
                tensor: t.name,
                dtype: t.dtype,
                shape: t.shape,
            });
        };
        let declared = t.end - t.begin;
        if declared != expected {
            return Err(HeaderError::SpanMismatch {
                shard: shard.to_string(),
                tensor: t.name,
                dtype: t.dtype,
                shape: t.shape,
                declared,
                expected,
            });
        }
        tensors.push(TensorHeader {
            name: t.name,
            dtype: t.dtype,
            shape: t.shape,
            data: t.begin..t.end,
        });
    }
    // Names break ties so the order never depends on the header's key order.
    tensors.sort_by(|a, b| {
        (a.data.start, a.data.end, &a.name).cmp(&(b.data.start, b.data.end, &b.name))
    });

    let mut cursor = 0u64;
    let mut prev: Option<&TensorHeader> = None;
    for t in &tensors {
        if t.data.start > cursor {
            return Err(HeaderError::Gap {
                shard: shard.to_string(),
                before: prev.map(|p| p.name.clone()),
                after: t.name.clone(),
                gap: cursor..t.data.start,
            });
        }
        if let Some(p) = prev.filter(|_| t.data.start < cursor) {
            return Err(HeaderError::Overlap {
                shard: shard.to_string(),
                first: p.name.clone(),
                first_span: p.data.clone(),
                second: t.name.clone(),
                second_span: t.data.clone(),
            });
        }
        cursor = t.data.end;
        prev = Some(t);
    }
    if cursor != data_len {
        return Err(HeaderError::DataEndMismatch {
            shard: shard.to_string(),
            last_tensor: prev.map(|p| p.name.clone()),
            covered: cursor,
            data_len,
        });
    }
    Ok(tensors)
}

/// What reading and parsing a header costs in memory, as a multiple of its length `n`:
/// its bytes (`1`), plus what the parse builds from them while they are held, up to
/// 3.2 × `n` (measured: 3.22 × for 50 MB of the smallest tensor entries, their names,
/// entries and the set that catches a duplicate name; 1 × for one long `__metadata__`
/// string; nothing for the spaces a header may be padded with).
pub const HEADER_MEMORY_FACTOR: u64 = 4;

/// The memory that header reads in flight may hold together, shared by every read of
/// one install (the installer sizes it): a header takes [`HEADER_MEMORY_FACTOR`]
/// × its length of it once its length is known, before the rest of it is fetched, and
/// gives it back once parsed. A header whose cost is over the whole budget takes the
/// whole budget: it is read alone. Issue 22: 16 reads of 100 MB headers in flight took
/// an install to 1.0–1.5 GiB; with the budget they wait their turn.
///
/// What is not counted: each read's speculative first read ([`SPECULATIVE_READ`],
/// 64 KiB, the one that gives the length), and the parsed headers kept for the plan.
#[derive(Debug)]
pub struct HeaderBudget {
    permits: tokio::sync::Semaphore,
    total: u32,
}

impl HeaderBudget {
    /// A budget of `bytes` (at least 1, at most 4 GiB).
    pub fn new(bytes: u64) -> Self {
        let total = u32::try_from(bytes.max(1)).unwrap_or(u32::MAX);
        Self {
            permits: tokio::sync::Semaphore::new(total as usize),
            total,
        }
    }

    /// What a header of `header_len` bytes takes of a budget of `total` bytes.
    fn cost(total: u32, header_len: u64) -> u32 {
        let cost = header_len.saturating_mul(HEADER_MEMORY_FACTOR);
        u32::try_from(cost).unwrap_or(u32::MAX).min(total)
    }

    /// Wait until a header of `header_len` bytes fits, and hold its share until the
    /// permit drops.
    async fn take(&self, header_len: u64) -> Option<tokio::sync::SemaphorePermit<'_>> {
        // The semaphore is never closed, so this is always `Some`.
        self.permits
            .acquire_many(Self::cost(self.total, header_len))
            .await
            .ok()
    }

    /// Bytes of the budget not held now.
    pub fn available(&self) -> u64 {
        self.permits.available_permits() as u64
    }
}

/// Read and validate the header of `shard` (of `file_size` bytes) from `source`, with
/// one speculative ranged read of `min(SPECULATIVE_READ, file_size)` bytes and, when
/// the header is longer, exactly one more read for the rest of it. Nothing past
/// `8 + n` is requested beyond what the speculative read covered. The header holds its
/// share of `budget` from once its length is known until it is parsed.
pub async fn read_header(
    source: &dyn RangeSource,
    shard: &str,
    file_size: u64,
    budget: &HeaderBudget,
) -> Result<ShardHeader, ShardError> {
    // A file too small to hold the length is refused without a request.
    check_file_size(shard, file_size)?;
    let first = source
        .read_range(shard, 0..SPECULATIVE_READ.min(file_size))
        .await?;
    let needed = header_extent(shard, file_size, &first)?;
    let _held = budget.take(needed - 8).await;
    let have = first.len() as u64;
    if needed <= have {
        return Ok(parse_header(shard, file_size, &first)?);
    }
    // The rest streams into one buffer of the header's size: its bytes are held once,
    // not once as read and again as joined to the first read's. `needed` is at most
    // 8 + MAX_HEADER_LEN, so it fits in memory's address space.
    let len = usize::try_from(needed).unwrap_or(usize::MAX);
    let mut whole = Vec::with_capacity(len);
    whole.extend_from_slice(&first);
    drop(first);
    let mut rest = source.stream_range(shard, have..needed).await?;
    while let Some(chunk) = futures_util::StreamExt::next(&mut rest).await {
        let chunk = chunk?;
        // A source sends exactly the range; never grow past it if one does not.
        let room = len - whole.len();
        whole.extend_from_slice(&chunk[..chunk.len().min(room)]);
    }
    Ok(parse_header(shard, file_size, &whole)?)
}

#[cfg(test)]
mod tests;
