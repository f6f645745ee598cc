//! Hostile headers, each refused with one exact error, plus the happy path and the
//! read pattern of `read_header`.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Mutex;

use async_trait::async_trait;
use bytes::Bytes;

use super::*;
use crate::source::{ResolvedRepo, SourceStats};

const SHARD: &str = "model-00001-of-00002.safetensors";

/// `[u64 LE len][json]`.
fn with_len(json: &[u8]) -> Vec<u8> {
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(json);
    out
}

/// Parse `json` as the header of a file whose data section is `data_len` bytes.
fn parse_json(json: &[u8], data_len: u64) -> Result<ShardHeader, HeaderError> {
    let bytes = with_len(json);
    parse_header(SHARD, bytes.len() as u64 + data_len, &bytes)
}

fn refuse_json(json: &[u8], data_len: u64) -> HeaderError {
    match parse_json(json, data_len) {
        Ok(h) => panic!(
            "accepted hostile header {:?}: {h:?}",
            String::from_utf8_lossy(json)
        ),
        Err(e) => e,
    }
}

fn refuse_bytes(file_size: u64, bytes: &[u8]) -> HeaderError {
    match parse_header(SHARD, file_size, bytes) {
        Ok(h) => panic!("accepted hostile bytes {bytes:?}: {h:?}"),
        Err(e) => e,
    }
}

#[test]
fn file_shorter_than_the_length_field() {
    let err = refuse_bytes(7, b"\x02\x00\x00\x00\x00\x00\x00");
    assert!(
        matches!(err, HeaderError::FileTooSmall { file_size: 7, .. }),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!("{SHARD}: file is 7 bytes, too short for the 8-byte header length")
    );
}

#[test]
fn zero_header_length() {
    let err = refuse_bytes(100, b"\x00\x00\x00\x00\x00\x00\x00\x00{}");
    assert!(matches!(err, HeaderError::EmptyHeader { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        format!("{SHARD}: header length is 0; the smallest valid header is `{{}}`")
    );
}

#[test]
fn oversized_header_length() {
    // 100_000_001 = 0x05F5E101: one byte over the limit.
    let err = refuse_bytes(1 << 40, b"\x01\xe1\xf5\x05\x00\x00\x00\x00{}");
    assert!(
        matches!(
            err,
            HeaderError::HeaderTooLarge {
                len: 100_000_001,
                max: MAX_HEADER_LEN,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!("{SHARD}: header length 100000001 bytes is over the 100000000-byte limit")
    );
    // u64::MAX must not overflow `8 + n` anywhere.
    let err = refuse_bytes(u64::MAX, b"\xff\xff\xff\xff\xff\xff\xff\xff{}");
    assert!(
        matches!(err, HeaderError::HeaderTooLarge { len: u64::MAX, .. }),
        "{err:?}"
    );
}

#[test]
fn header_length_past_end_of_file() {
    // n = 16 but the file is 20 bytes: 8 + 16 > 20.
    let err = refuse_bytes(20, b"\x10\x00\x00\x00\x00\x00\x00\x00{}          ");
    assert!(
        matches!(
            err,
            HeaderError::HeaderPastEof {
                len: 16,
                file_size: 20,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!(
            "{SHARD}: header length 16 bytes runs past the end of the 20-byte file (8 + 16 > 20)"
        )
    );
}

#[test]
fn fewer_bytes_supplied_than_the_header_needs() {
    // n = 100, file of 1000 bytes, only 12 bytes supplied.
    let err = refuse_bytes(1000, b"\x64\x00\x00\x00\x00\x00\x00\x00{\"a\"");
    assert!(
        matches!(
            err,
            HeaderError::Truncated {
                needed: 108,
                got: 12,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!("{SHARD}: header needs the first 108 bytes of the file, only 12 supplied")
    );
    // Not even the length field.
    let err = refuse_bytes(1000, b"\x64\x00\x00");
    assert!(
        matches!(
            err,
            HeaderError::Truncated {
                needed: 8,
                got: 3,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn header_not_utf8() {
    // 0xff at JSON byte 3, file offset 11.
    let err = refuse_json(b"{\"a\xff\":{}}", 0);
    assert!(
        matches!(err, HeaderError::NotUtf8 { offset: 11, .. }),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!("{SHARD}: header is not valid UTF-8 (first bad byte at file offset 11)")
    );
}

#[test]
fn header_not_an_object() {
    let err = refuse_json(b"[1, 2]", 0);
    assert!(
        matches!(&err, HeaderError::NotObject { found, .. } if found == "`[`"),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!("{SHARD}: header must be a JSON object starting with `{{`, found `[`")
    );
    // The spec requires `{` as the very first byte: no leading whitespace.
    let err = refuse_json(b" {}", 0);
    assert!(matches!(err, HeaderError::NotObject { .. }), "{err:?}");
    let err = refuse_json(b"\0{}", 0);
    assert!(err.to_string().ends_with("found '\\0' (U+0000)"), "{err}");
}

#[test]
fn header_not_well_formed_json() {
    for json in [
        &b"{\"a\": "[..],
        b"{\"a\": {\"dtype\": tru}}",
        // NUL padding is not whitespace.
        b"{}\0\0\0\0",
        b"{} {}",
    ] {
        let err = refuse_json(json, 0);
        assert!(matches!(err, HeaderError::Json { .. }), "{err:?}");
        assert_eq!(
            err.to_string(),
            format!("{SHARD}: header is not well-formed JSON")
        );
        let cause = std::error::Error::source(&err).map(|c| c.to_string());
        assert!(cause.is_some_and(|c| c.contains("column")), "{err:?}");
    }
}

#[test]
fn duplicate_tensor_names() {
    // The second "w" would silently replace the first in a JSON map.
    let json = br#"{"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"w":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}"#;
    let err = refuse_json(json, 8);
    assert!(
        matches!(&err, HeaderError::DuplicateTensor { tensor, .. } if tensor == "w"),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!("{SHARD}: tensor \"w\" is declared more than once")
    );
}

#[test]
fn bad_tensor_names() {
    let err = refuse_json(
        br#"{"":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#,
        1,
    );
    assert!(matches!(err, HeaderError::BadTensorName { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        format!("{SHARD}: tensor name \"\": empty name")
    );

    let long = "x".repeat(1025);
    let json = format!(r#"{{"{long}":{{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}}}"#);
    let err = refuse_json(json.as_bytes(), 1);
    let text = err.to_string();
    assert!(matches!(err, HeaderError::BadTensorName { .. }), "{err:?}");
    assert!(
        text.ends_with("…(1025 bytes)\": 1025 bytes, over the 1024-byte limit"),
        "{text}"
    );
    assert!(text.len() < 200, "message not clipped: {text}");
}

#[test]
fn unknown_dtype() {
    let err = refuse_json(
        br#"{"w":{"dtype":"F4","shape":[1],"data_offsets":[0,1]}}"#,
        1,
    );
    assert!(
        matches!(&err, HeaderError::UnknownDtype { tensor, dtype, .. } if tensor == "w" && dtype == "F4"),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!("{SHARD}: tensor \"w\": field `dtype`: unknown dtype \"F4\"")
    );
    // Case matters: headers spell dtypes in capitals.
    let err = refuse_json(
        br#"{"w":{"dtype":"bf16","shape":[1],"data_offsets":[0,2]}}"#,
        2,
    );
    assert!(matches!(err, HeaderError::UnknownDtype { .. }), "{err:?}");
}

#[test]
fn negative_and_fractional_dimensions() {
    let err = refuse_json(
        br#"{"w":{"dtype":"U8","shape":[2,-2],"data_offsets":[0,4]}}"#,
        4,
    );
    assert!(
        matches!(&err, HeaderError::BadShape { tensor, .. } if tensor == "w"),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!(
            "{SHARD}: tensor \"w\": field `shape`: element 1 is the negative number -2, not a non-negative integer"
        )
    );
    let err = refuse_json(
        br#"{"w":{"dtype":"U8","shape":[2.5],"data_offsets":[0,2]}}"#,
        2,
    );
    assert!(matches!(err, HeaderError::BadShape { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        format!(
            "{SHARD}: tensor \"w\": field `shape`: element 0 is the fractional or out-of-range number 2.5, not a non-negative integer"
        )
    );
    // Even an integral float is not an integer.
    let err = refuse_json(
        br#"{"w":{"dtype":"U8","shape":[2.0],"data_offsets":[0,2]}}"#,
        2,
    );
    assert!(matches!(err, HeaderError::BadShape { .. }), "{err:?}");
    let err = refuse_json(
        br#"{"w":{"dtype":"U8","shape":["2"],"data_offsets":[0,2]}}"#,
        2,
    );
    assert!(
        err.to_string().contains("element 0 is the string \"2\""),
        "{err}"
    );
}

#[test]
fn too_many_or_absurd_dimensions() {
    let err = refuse_json(
        br#"{"w":{"dtype":"U8","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,1]}}"#,
        1,
    );
    assert!(matches!(err, HeaderError::BadShape { .. }), "{err:?}");
    assert!(
        err.to_string()
            .ends_with("field `shape`: more than 8 dimensions"),
        "{err}"
    );

    // 2^40 + 1 with a zero beside it would pass the span check.
    let err = refuse_json(
        br#"{"w":{"dtype":"U8","shape":[0,1099511627777],"data_offsets":[0,0]}}"#,
        0,
    );
    assert!(matches!(err, HeaderError::BadShape { .. }), "{err:?}");
    assert!(
        err.to_string()
            .ends_with("dimension 1 is 1099511627777, over the 1099511627776 limit"),
        "{err}"
    );
}

#[test]
fn span_mismatch() {
    // 2 × 2 F32 is 16 bytes; the offsets span 8.
    let err = refuse_json(
        br#"{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,8]}}"#,
        8,
    );
    assert!(
        matches!(&err, HeaderError::SpanMismatch { tensor, declared: 8, expected: 16, dtype: Dtype::F32, .. } if tensor == "w"),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!(
            "{SHARD}: tensor \"w\": field `data_offsets` spans 8 bytes, but F32 × shape [2, 2] is 16 bytes"
        )
    );
}

#[test]
fn overflow_in_byte_size() {
    // 2^40 × 2^23 = 2^63 elements fit in u64; × 4 bytes does not.
    let err = refuse_json(
        br#"{"w":{"dtype":"F32","shape":[1099511627776,8388608],"data_offsets":[0,0]}}"#,
        0,
    );
    assert!(
        matches!(&err, HeaderError::SizeOverflow { tensor, .. } if tensor == "w"),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!(
            "{SHARD}: tensor \"w\": field `shape`: F32 × shape [1099511627776, 8388608] overflows 64 bits"
        )
    );
    // The element count itself overflowing.
    let err = refuse_json(
        br#"{"w":{"dtype":"U8","shape":[1099511627776,1099511627776],"data_offsets":[0,0]}}"#,
        0,
    );
    assert!(matches!(err, HeaderError::SizeOverflow { .. }), "{err:?}");
    // A zero dimension makes it empty, not an overflow.
    parse_json(
        br#"{"w":{"dtype":"U8","shape":[1099511627776,1099511627776,0],"data_offsets":[0,0]}}"#,
        0,
    )
    .unwrap();
}

#[test]
fn bad_data_offsets() {
    let cases: [(&[u8], &str); 5] = [
        (
            br#"{"w":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}}"#,
            "begin 4 is after end 0",
        ),
        (
            br#"{"w":{"dtype":"U8","shape":[0],"data_offsets":[0]}}"#,
            "1 element(s); expected [begin, end]",
        ),
        (
            br#"{"w":{"dtype":"U8","shape":[0],"data_offsets":[0,0,0]}}"#,
            "more than 2 elements; expected [begin, end]",
        ),
        (
            br#"{"w":{"dtype":"U8","shape":[0],"data_offsets":[-1,0]}}"#,
            "element 0 is the negative number -1, not a non-negative integer",
        ),
        (
            // Beyond u64: serde_json hands it over as a float.
            br#"{"w":{"dtype":"U8","shape":[0],"data_offsets":[0,18446744073709551616]}}"#,
            "element 1 is the fractional or out-of-range number 18446744073709552000, not a non-negative integer",
        ),
    ];
    for (json, detail) in cases {
        let err = refuse_json(json, 0);
        assert!(matches!(err, HeaderError::BadOffsets { .. }), "{err:?}");
        assert_eq!(
            err.to_string(),
            format!("{SHARD}: tensor \"w\": field `data_offsets`: {detail}")
        );
    }
}

#[test]
fn malformed_tensor_entries() {
    let err = refuse_json(br#"{"w":[0,1]}"#, 0);
    assert!(
        matches!(err, HeaderError::TensorNotObject { .. }),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!(
            "{SHARD}: tensor \"w\": entry must be an object with `dtype`, `shape` and `data_offsets`, found an array"
        )
    );
    let err = refuse_json(
        br#"{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":1}}"#,
        1,
    );
    assert!(
        matches!(&err, HeaderError::UnknownField { field, .. } if field == "extra"),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!("{SHARD}: tensor \"w\": unknown field \"extra\"")
    );

    let err = refuse_json(
        br#"{"w":{"dtype":"U8","shape":[1],"dtype":"F32","data_offsets":[0,1]}}"#,
        1,
    );
    assert!(
        matches!(err, HeaderError::DuplicateField { field: "dtype", .. }),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!("{SHARD}: tensor \"w\": field `dtype` appears more than once")
    );

    let err = refuse_json(br#"{"w":{"dtype":"U8","shape":[1]}}"#, 1);
    assert!(
        matches!(
            err,
            HeaderError::MissingField {
                field: "data_offsets",
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!("{SHARD}: tensor \"w\": missing field `data_offsets`")
    );

    let err = refuse_json(br#"{"w":{"dtype":7,"shape":[1],"data_offsets":[0,1]}}"#, 1);
    assert!(
        matches!(err, HeaderError::FieldType { field: "dtype", .. }),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!("{SHARD}: tensor \"w\": field `dtype` must be a dtype string, found the number 7")
    );

    let err = refuse_json(
        br#"{"w":{"dtype":"U8","shape":{},"data_offsets":[0,1]}}"#,
        1,
    );
    assert!(
        matches!(err, HeaderError::FieldType { field: "shape", .. }),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .ends_with("must be an array of integers, found an object"),
        "{err}"
    );
}

#[test]
fn overlapping_offsets() {
    let json = br#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}}"#;
    let err = refuse_json(json, 12);
    assert!(
        matches!(&err, HeaderError::Overlap { first, second, .. } if first == "a" && second == "b"),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!("{SHARD}: tensors \"a\" (data bytes 0..8) and \"b\" (data bytes 4..12) overlap")
    );
    // A zero-size tensor placed inside another one is also refused.
    let json = br#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"z":{"dtype":"U8","shape":[0],"data_offsets":[4,4]}}"#;
    let err = refuse_json(json, 8);
    assert!(matches!(err, HeaderError::Overlap { .. }), "{err:?}");
}

#[test]
fn gap_between_tensors() {
    let json = br#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[4],"data_offsets":[12,16]}}"#;
    let err = refuse_json(json, 16);
    assert!(
        matches!(&err, HeaderError::Gap { before: Some(a), after, gap, .. } if a == "a" && after == "b" && *gap == (8..12)),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!(
            "{SHARD}: data bytes 8..12 belong to no tensor (between tensor \"a\" and tensor \"b\")"
        )
    );
    // Data not starting at 0.
    let err = refuse_json(
        br#"{"b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}"#,
        8,
    );
    assert!(
        matches!(err, HeaderError::Gap { before: None, .. }),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!(
            "{SHARD}: data bytes 0..4 belong to no tensor (between the start of the data section and tensor \"b\")"
        )
    );
}

#[test]
fn data_not_ending_at_end_of_file() {
    let json = br#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}"#;
    // Trailing bytes after the last tensor.
    let err = refuse_json(json, 9);
    assert!(
        matches!(&err, HeaderError::DataEndMismatch { last_tensor: Some(a), covered: 8, data_len: 9, .. } if a == "a"),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!(
            "{SHARD}: tensors cover 8 data bytes (last: tensor \"a\") but the file holds 9 bytes after its header"
        )
    );
    // The last tensor runs past the end of the file.
    let err = refuse_json(json, 7);
    assert!(
        matches!(
            err,
            HeaderError::DataEndMismatch {
                covered: 8,
                data_len: 7,
                ..
            }
        ),
        "{err:?}"
    );
    // No tensors at all but data bytes.
    let err = refuse_json(b"{}", 1);
    assert!(err.to_string().contains("(last: no tensors)"), "{err}");
}

#[test]
fn bad_metadata() {
    let err = refuse_json(br#"{"__metadata__":{"format":1}}"#, 0);
    assert!(
        matches!(&err, HeaderError::BadMetadata { key: Some(k), .. } if k == "format"),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!(
            "{SHARD}: `__metadata__` key \"format\": value must be a string, found the number 1"
        )
    );
    let err = refuse_json(br#"{"__metadata__":["pt"]}"#, 0);
    assert!(
        matches!(err, HeaderError::BadMetadata { key: None, .. }),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!("{SHARD}: `__metadata__`: must be an object of strings, found an array")
    );
    let err = refuse_json(br#"{"__metadata__":{"format":"pt","format":"np"}}"#, 0);
    assert_eq!(
        err.to_string(),
        format!("{SHARD}: `__metadata__` key \"format\": appears more than once")
    );
    let err = refuse_json(br#"{"__metadata__":{},"__metadata__":{}}"#, 0);
    assert_eq!(
        err.to_string(),
        format!("{SHARD}: `__metadata__`: appears more than once")
    );
    // null is read as no metadata, as the safetensors crate does.
    assert!(
        parse_json(br#"{"__metadata__":null}"#, 0)
            .unwrap()
            .metadata
            .is_empty()
    );
}

#[test]
fn tensor_names_in_messages_are_escaped() {
    let json = b"{\"w\\u001b[2J\":{\"dtype\":\"F4\",\"shape\":[1],\"data_offsets\":[0,1]}}";
    let err = refuse_json(json, 1);
    let text = err.to_string();
    assert!(!text.contains('\u{1b}'), "{text:?}");
    assert!(text.contains(r#"tensor "w\u{1b}[2J""#), "{text}");
}

/// A valid header: keys out of offset order, metadata, and space padding to a
/// multiple of 8 as writers do.
fn valid_header() -> (Vec<u8>, u64) {
    let mut json = br#"{"__metadata__":{"format":"pt"},"model.norm.weight":{"dtype":"BF16","shape":[4],"data_offsets":[24,32]},"model.embed.weight":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"empty":{"dtype":"I64","shape":[0,5],"data_offsets":[32,32]},"scale":{"dtype":"F8_E4M3","shape":[],"data_offsets":[32,33]}}"#.to_vec();
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let bytes = with_len(&json);
    let file_size = bytes.len() as u64 + 33;
    (bytes, file_size)
}

#[test]
fn valid_padded_header_parses_sorted_by_offset() {
    let (mut bytes, file_size) = valid_header();
    let header_len = bytes.len() as u64 - 8;
    assert!(bytes.ends_with(b" "), "test header must carry padding");
    // Bytes past the header (the start of the data section) are ignored.
    bytes.extend_from_slice(&[0xAB; 33]);
    let got = parse_header(SHARD, file_size, &bytes).unwrap();
    let t = |name: &str, dtype, shape: &[u64], data: Range<u64>| TensorHeader {
        name: name.to_string(),
        dtype,
        shape: shape.to_vec(),
        data,
    };
    let want = ShardHeader {
        shard: SHARD.to_string(),
        file_size,
        header_len,
        tensors: vec![
            t("model.embed.weight", Dtype::F32, &[2, 3], 0..24),
            t("model.norm.weight", Dtype::BF16, &[4], 24..32),
            t("empty", Dtype::I64, &[0, 5], 32..32),
            t("scale", Dtype::F8_E4M3, &[], 32..33),
        ],
        metadata: BTreeMap::from([("format".to_string(), "pt".to_string())]),
    };
    assert_eq!(got, want);
    assert_eq!(got.data_start(), 8 + header_len);
    assert_eq!(got.data_start() + 33, file_size);
}

#[test]
fn every_dtype_round_trips_its_name() {
    for d in Dtype::ALL {
        assert_eq!(Dtype::from_name(d.name()), Some(d));
    }
    assert_eq!(Dtype::from_name("F8_E4M3").map(Dtype::size), Some(1));
    assert_eq!(Dtype::from_name("U64").map(Dtype::size), Some(8));
}

/// An in-memory source that logs every range asked for.
struct MemSource {
    path: String,
    data: Vec<u8>,
    log: Mutex<Vec<Range<u64>>>,
}

impl MemSource {
    fn new(data: Vec<u8>) -> Self {
        MemSource {
            path: SHARD.to_string(),
            data,
            log: Mutex::new(Vec::new()),
        }
    }

    fn requests(&self) -> Vec<Range<u64>> {
        self.log.lock().unwrap().clone()
    }
}

#[async_trait]
impl RangeSource for MemSource {
    fn describe(&self) -> String {
        "memory".into()
    }

    async fn resolve(&self) -> Result<ResolvedRepo, SourceError> {
        unimplemented!("not used by read_header")
    }

    async fn read_range(&self, path: &str, range: Range<u64>) -> Result<Bytes, SourceError> {
        assert_eq!(path, self.path);
        self.log.lock().unwrap().push(range.clone());
        let slice = self
            .data
            .get(range.start as usize..range.end as usize)
            .ok_or_else(|| SourceError::BadRange {
                path: path.to_string(),
                range: range.clone(),
                detail: "past end".into(),
            })?;
        Ok(Bytes::copy_from_slice(slice))
    }

    async fn read_file(&self, _: &str, _: u64) -> Result<Bytes, SourceError> {
        unimplemented!("not used by read_header")
    }

    fn stats(&self) -> SourceStats {
        SourceStats::default()
    }
}

/// A shard whose header is `json`, followed by `data_len` data bytes
/// set to 0xDA so a read into the data is easy to spot.
fn shard_file(json: &str, data_len: usize) -> Vec<u8> {
    let mut out = with_len(json.as_bytes());
    out.resize(out.len() + data_len, 0xDA);
    out
}

#[tokio::test]
async fn small_header_takes_one_speculative_read() {
    // 200 KB of data: the speculative read is capped at SPECULATIVE_READ.
    let json = r#"{"w":{"dtype":"U8","shape":[200000],"data_offsets":[0,200000]}}"#;
    let src = MemSource::new(shard_file(json, 200_000));
    let size = src.data.len() as u64;
    let h = read_header(&src, SHARD, size, &HeaderBudget::new(1 << 30))
        .await
        .unwrap();
    assert_eq!(h.tensors[0].data, 0..200_000);
    assert_eq!(src.requests(), vec![0..SPECULATIVE_READ]);

    // A file smaller than SPECULATIVE_READ is read once, whole, never past its end.
    let json = r#"{"w":{"dtype":"U8","shape":[10],"data_offsets":[0,10]}}"#;
    let src = MemSource::new(shard_file(json, 10));
    let size = src.data.len() as u64;
    read_header(&src, SHARD, size, &HeaderBudget::new(1 << 30))
        .await
        .unwrap();
    assert_eq!(src.requests(), vec![0..size]);
}

#[tokio::test]
async fn long_header_takes_exactly_two_reads_and_never_the_data() {
    // ~100 KB of metadata pushes the header past SPECULATIVE_READ.
    let blob = "m".repeat(100_000);
    let json = format!(
        r#"{{"__metadata__":{{"blob":"{blob}"}},"w":{{"dtype":"U8","shape":[1000],"data_offsets":[0,1000]}}}}"#
    );
    let src = MemSource::new(shard_file(&json, 1000));
    let size = src.data.len() as u64;
    let data_start = 8 + json.len() as u64;
    assert!(data_start > SPECULATIVE_READ);
    let h = read_header(&src, SHARD, size, &HeaderBudget::new(1 << 30))
        .await
        .unwrap();
    assert_eq!(h.data_start(), data_start);
    assert_eq!(h.metadata["blob"].len(), 100_000);
    assert_eq!(
        src.requests(),
        vec![0..SPECULATIVE_READ, SPECULATIVE_READ..data_start]
    );
    // No byte of the data section was requested.
    assert!(src.requests().iter().all(|r| r.end <= data_start));
}

#[tokio::test]
async fn read_header_refuses_before_reading_more() {
    // A file too small for the length field costs no request.
    let src = MemSource::new(vec![1, 2, 3]);
    let err = read_header(&src, SHARD, 3, &HeaderBudget::new(1 << 30))
        .await
        .unwrap_err();
    assert!(
        matches!(err, ShardError::Header(HeaderError::FileTooSmall { .. })),
        "{err:?}"
    );
    assert!(src.requests().is_empty());

    // An oversized length is refused after the first read, without a second.
    let mut data = b"\xff\xff\xff\xff\x00\x00\x00\x00{}".to_vec();
    data.resize(100_000, 0);
    let src = MemSource::new(data);
    let err = read_header(&src, SHARD, 100_000, &HeaderBudget::new(1 << 30))
        .await
        .unwrap_err();
    assert!(
        matches!(err, ShardError::Header(HeaderError::HeaderTooLarge { .. })),
        "{err:?}"
    );
    assert_eq!(src.requests(), vec![0..SPECULATIVE_READ]);
    assert!(err.to_string().starts_with(SHARD), "{err}");
}

/// A source that notes what is left of a header budget at each read.
struct BudgetProbe {
    inner: MemSource,
    budget: std::sync::Arc<HeaderBudget>,
    seen: Mutex<Vec<u64>>,
}

#[async_trait]
impl RangeSource for BudgetProbe {
    fn describe(&self) -> String {
        "probe".into()
    }

    async fn resolve(&self) -> Result<ResolvedRepo, SourceError> {
        unimplemented!("not used by read_header")
    }

    async fn read_range(&self, path: &str, range: Range<u64>) -> Result<Bytes, SourceError> {
        self.seen.lock().unwrap().push(self.budget.available());
        self.inner.read_range(path, range).await
    }

    async fn read_file(&self, _: &str, _: u64) -> Result<Bytes, SourceError> {
        unimplemented!("not used by read_header")
    }

    fn stats(&self) -> SourceStats {
        SourceStats::default()
    }
}

/// Issue 22, defect 4: a header holds HEADER_MEMORY_FACTOR × its length of the shared
/// budget from once its length is known until it is parsed, and a header costing more
/// than the whole budget holds all of it (it is read alone).
#[tokio::test]
async fn a_header_holds_its_share_of_the_budget_while_it_is_read() {
    let blob = "m".repeat(100_000);
    let json = format!(
        r#"{{"__metadata__":{{"blob":"{blob}"}},"w":{{"dtype":"U8","shape":[1000],"data_offsets":[0,1000]}}}}"#
    );
    let n = json.len() as u64;
    for (total, held) in [(1 << 20, HEADER_MEMORY_FACTOR * n), (300_000, 300_000)] {
        let budget = std::sync::Arc::new(HeaderBudget::new(total));
        let src = BudgetProbe {
            inner: MemSource::new(shard_file(&json, 1000)),
            budget: budget.clone(),
            seen: Mutex::new(Vec::new()),
        };
        let size = src.inner.data.len() as u64;
        read_header(&src, SHARD, size, &budget).await.unwrap();
        // The first read (which gives the length) holds nothing; the rest holds the
        // header's share; parsed, the share is back.
        assert_eq!(*src.seen.lock().unwrap(), vec![total, total - held]);
        assert_eq!(budget.available(), total);
    }
}
