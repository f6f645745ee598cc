//! Streaming deserialization of the header JSON into raw tensor entries.
//!
//! Hand-written serde visitors instead of `serde_json::Value` or derived structs, for
//! three reasons:
//! - duplicates: a JSON map type silently keeps the last of two equal keys, so the top
//!   object, each tensor entry and `__metadata__` are read key by key;
//! - memory: a hostile 100 MB header of `[0,0,0,...]` must not become gigabytes of
//!   `Value`s; every field is checked as it streams past and refused at the first bad
//!   element (at most 8 dimensions, 2 offsets are ever stored per tensor);
//! - errors: each refusal is a typed [`HeaderError`] naming the tensor and field. serde
//!   errors can only carry a string, so the typed error is parked in [`Ctx`] and the
//!   serde error only unwinds the parser; the caller prefers the parked error.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashSet};
use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};

use super::Dtype;
use super::error::{HeaderError, clip};

/// Most dimensions a tensor may declare.
pub(crate) const MAX_DIMS: usize = 8;
/// Largest single dimension accepted (2^40): larger values are absurd for any shard
/// and, paired with a zero dimension, would slip past the byte-span check.
pub(crate) const MAX_DIM: u64 = 1 << 40;
/// Longest tensor name accepted, in bytes.
pub(crate) const MAX_NAME_LEN: usize = 1024;

/// One tensor entry as written, before the span and layout checks.
#[derive(Debug)]
pub(crate) struct RawTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub begin: u64,
    pub end: u64,
}

/// The top-level object.
#[derive(Debug, Default)]
pub(crate) struct RawHeader {
    /// In file order.
    pub tensors: Vec<RawTensor>,
    pub metadata: BTreeMap<String, String>,
}

/// Shared by all visitors: the shard name for messages and the parked typed error.
pub(crate) struct Ctx<'s> {
    pub shard: &'s str,
    pub problem: RefCell<Option<HeaderError>>,
}

impl<'s> Ctx<'s> {
    pub fn new(shard: &'s str) -> Self {
        Ctx {
            shard,
            problem: RefCell::new(None),
        }
    }

    /// Park `err` (the innermost refusal wins) and return a serde error that unwinds.
    fn reject<E: de::Error>(&self, err: HeaderError) -> E {
        let mut slot = self.problem.borrow_mut();
        if slot.is_none() {
            *slot = Some(err);
        }
        E::custom("header rejected")
    }

    fn shard(&self) -> String {
        self.shard.to_string()
    }
}

/// Generate the `visit_*` methods for JSON kinds a visitor does not accept; each calls
/// the visitor's own `wrong(found)` to build its typed error.
macro_rules! reject_kinds {
    ($($kind:ident),* $(,)?) => { $( reject_kinds!(@one $kind); )* };
    (@one bool) => {
        fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
            Err(self.wrong(format!("the boolean {v}")))
        }
    };
    (@one i64) => {
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
            Err(self.wrong(format!("the number {v}")))
        }
    };
    (@one u64) => {
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
            Err(self.wrong(format!("the number {v}")))
        }
    };
    (@one f64) => {
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
            Err(self.wrong(format!("the number {v}")))
        }
    };
    (@one str) => {
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Err(self.wrong(format!("the string {:?}", clip(v))))
        }
    };
    (@one unit) => {
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Err(self.wrong("null".to_string()))
        }
    };
    (@one seq) => {
        fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
            Err(self.wrong("an array".to_string()))
        }
    };
    (@one map) => {
        fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
            Err(self.wrong("an object".to_string()))
        }
    };
}

/// The top-level object (the caller has checked that it starts with `{`).
pub(crate) struct TopSeed<'c, 's>(pub &'c Ctx<'s>);

impl<'de> DeserializeSeed<'de> for TopSeed<'_, '_> {
    type Value = RawHeader;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<RawHeader, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for TopSeed<'_, '_> {
    type Value = RawHeader;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a safetensors header object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawHeader, A::Error> {
        let ctx = self.0;
        let mut out = RawHeader::default();
        let mut seen_metadata = false;
        let mut names = HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if key == "__metadata__" {
                if seen_metadata {
                    return Err(ctx.reject(HeaderError::BadMetadata {
                        shard: ctx.shard(),
                        key: None,
                        detail: "appears more than once".into(),
                    }));
                }
                seen_metadata = true;
                out.metadata = map.next_value_seed(MetaSeed(ctx))?;
                continue;
            }
            if key.is_empty() {
                return Err(ctx.reject(HeaderError::BadTensorName {
                    shard: ctx.shard(),
                    tensor: key,
                    why: "empty name".into(),
                }));
            }
            if key.len() > MAX_NAME_LEN {
                return Err(ctx.reject(HeaderError::BadTensorName {
                    shard: ctx.shard(),
                    tensor: clip(&key),
                    why: format!("{} bytes, over the {MAX_NAME_LEN}-byte limit", key.len()),
                }));
            }
            if !names.insert(key.clone()) {
                return Err(ctx.reject(HeaderError::DuplicateTensor {
                    shard: ctx.shard(),
                    tensor: key,
                }));
            }
            let entry = map.next_value_seed(EntrySeed { ctx, tensor: &key })?;
            out.tensors.push(RawTensor {
                name: key,
                dtype: entry.dtype,
                shape: entry.shape,
                begin: entry.offsets[0],
                end: entry.offsets[1],
            });
        }
        Ok(out)
    }
}

/// `__metadata__`: an object of string → string, or `null` (as the safetensors crate
/// accepts).
struct MetaSeed<'c, 's>(&'c Ctx<'s>);

impl MetaSeed<'_, '_> {
    fn wrong<E: de::Error>(&self, found: String) -> E {
        self.0.reject(HeaderError::BadMetadata {
            shard: self.0.shard(),
            key: None,
            detail: format!("must be an object of strings, found {found}"),
        })
    }
}

impl<'de> DeserializeSeed<'de> for MetaSeed<'_, '_> {
    type Value = BTreeMap<String, String>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for MetaSeed<'_, '_> {
    type Value = BTreeMap<String, String>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object of strings")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(BTreeMap::new())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let ctx = self.0;
        let mut out = BTreeMap::new();
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) {
                return Err(ctx.reject(HeaderError::BadMetadata {
                    shard: ctx.shard(),
                    key: Some(clip(&key)),
                    detail: "appears more than once".into(),
                }));
            }
            let value = map.next_value_seed(MetaValueSeed { ctx, key: &key })?;
            out.insert(key, value);
        }
        Ok(out)
    }

    reject_kinds!(bool, i64, u64, f64, str, seq);
}

struct MetaValueSeed<'c, 's, 'k> {
    ctx: &'c Ctx<'s>,
    key: &'k str,
}

impl MetaValueSeed<'_, '_, '_> {
    fn wrong<E: de::Error>(&self, found: String) -> E {
        self.ctx.reject(HeaderError::BadMetadata {
            shard: self.ctx.shard(),
            key: Some(clip(self.key)),
            detail: format!("value must be a string, found {found}"),
        })
    }
}

impl<'de> DeserializeSeed<'de> for MetaValueSeed<'_, '_, '_> {
    type Value = String;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<String, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for MetaValueSeed<'_, '_, '_> {
    type Value = String;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<String, E> {
        Ok(v.to_string())
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<String, E> {
        Ok(v)
    }

    reject_kinds!(bool, i64, u64, f64, unit, seq, map);
}

/// A tensor entry's three fields.
struct Entry {
    dtype: Dtype,
    shape: Vec<u64>,
    offsets: [u64; 2],
}

struct EntrySeed<'c, 's, 't> {
    ctx: &'c Ctx<'s>,
    tensor: &'t str,
}

impl EntrySeed<'_, '_, '_> {
    fn wrong<E: de::Error>(&self, found: String) -> E {
        self.ctx.reject(HeaderError::TensorNotObject {
            shard: self.ctx.shard(),
            tensor: self.tensor.to_string(),
            found,
        })
    }

    fn field_seed(&self, field: &'static str) -> FieldSeed<'_, '_, '_> {
        FieldSeed {
            ctx: self.ctx,
            tensor: self.tensor,
            field,
        }
    }
}

impl<'de> DeserializeSeed<'de> for EntrySeed<'_, '_, '_> {
    type Value = Entry;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Entry, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for EntrySeed<'_, '_, '_> {
    type Value = Entry;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a tensor entry object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Entry, A::Error> {
        let ctx = self.ctx;
        let mut dtype = None;
        let mut shape = None;
        let mut offsets = None;
        let duplicate = |field: &'static str| {
            ctx.reject::<A::Error>(HeaderError::DuplicateField {
                shard: ctx.shard(),
                tensor: self.tensor.to_string(),
                field,
            })
        };
        while let Some(field) = map.next_key::<String>()? {
            match field.as_str() {
                "dtype" => {
                    if dtype.is_some() {
                        return Err(duplicate("dtype"));
                    }
                    dtype = Some(map.next_value_seed(DtypeSeed(self.field_seed("dtype")))?);
                }
                "shape" => {
                    if shape.is_some() {
                        return Err(duplicate("shape"));
                    }
                    shape = Some(map.next_value_seed(ShapeSeed(self.field_seed("shape")))?);
                }
                "data_offsets" => {
                    if offsets.is_some() {
                        return Err(duplicate("data_offsets"));
                    }
                    offsets =
                        Some(map.next_value_seed(OffsetsSeed(self.field_seed("data_offsets")))?);
                }
                other => {
                    return Err(ctx.reject(HeaderError::UnknownField {
                        shard: ctx.shard(),
                        tensor: self.tensor.to_string(),
                        field: clip(other),
                    }));
                }
            }
        }
        let missing = |field: &'static str| {
            ctx.reject::<A::Error>(HeaderError::MissingField {
                shard: ctx.shard(),
                tensor: self.tensor.to_string(),
                field,
            })
        };
        Ok(Entry {
            dtype: dtype.ok_or_else(|| missing("dtype"))?,
            shape: shape.ok_or_else(|| missing("shape"))?,
            offsets: offsets.ok_or_else(|| missing("data_offsets"))?,
        })
    }

    reject_kinds!(bool, i64, u64, f64, str, unit, seq);
}

/// Where a field value sits, for its errors.
#[derive(Clone, Copy)]
struct FieldSeed<'c, 's, 't> {
    ctx: &'c Ctx<'s>,
    tensor: &'t str,
    field: &'static str,
}

impl FieldSeed<'_, '_, '_> {
    fn type_error<E: de::Error>(&self, expected: &'static str, found: String) -> E {
        self.ctx.reject(HeaderError::FieldType {
            shard: self.ctx.shard(),
            tensor: self.tensor.to_string(),
            field: self.field,
            expected,
            found,
        })
    }

    /// `BadShape` or `BadOffsets`, depending on the field.
    fn bad<E: de::Error>(&self, detail: String) -> E {
        let (shard, tensor) = (self.ctx.shard(), self.tensor.to_string());
        self.ctx.reject(if self.field == "shape" {
            HeaderError::BadShape {
                shard,
                tensor,
                detail,
            }
        } else {
            HeaderError::BadOffsets {
                shard,
                tensor,
                detail,
            }
        })
    }
}

struct DtypeSeed<'c, 's, 't>(FieldSeed<'c, 's, 't>);

impl DtypeSeed<'_, '_, '_> {
    fn wrong<E: de::Error>(&self, found: String) -> E {
        self.0.type_error("a dtype string", found)
    }
}

impl<'de> DeserializeSeed<'de> for DtypeSeed<'_, '_, '_> {
    type Value = Dtype;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Dtype, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for DtypeSeed<'_, '_, '_> {
    type Value = Dtype;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a dtype string")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Dtype, E> {
        Dtype::from_name(v).ok_or_else(|| {
            let at = self.0;
            at.ctx.reject(HeaderError::UnknownDtype {
                shard: at.ctx.shard(),
                tensor: at.tensor.to_string(),
                dtype: clip(v),
            })
        })
    }

    reject_kinds!(bool, i64, u64, f64, unit, seq, map);
}

struct ShapeSeed<'c, 's, 't>(FieldSeed<'c, 's, 't>);

impl ShapeSeed<'_, '_, '_> {
    fn wrong<E: de::Error>(&self, found: String) -> E {
        self.0.type_error("an array of integers", found)
    }
}

impl<'de> DeserializeSeed<'de> for ShapeSeed<'_, '_, '_> {
    type Value = Vec<u64>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Vec<u64>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ShapeSeed<'_, '_, '_> {
    type Value = Vec<u64>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of integers")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u64>, A::Error> {
        let at = self.0;
        let mut dims = Vec::new();
        while let Some(dim) = seq.next_element_seed(IntSeed {
            at,
            index: dims.len(),
        })? {
            if dims.len() == MAX_DIMS {
                return Err(at.bad(format!("more than {MAX_DIMS} dimensions")));
            }
            if dim > MAX_DIM {
                return Err(at.bad(format!(
                    "dimension {} is {dim}, over the {MAX_DIM} limit",
                    dims.len()
                )));
            }
            dims.push(dim);
        }
        Ok(dims)
    }

    reject_kinds!(bool, i64, u64, f64, str, unit, map);
}

struct OffsetsSeed<'c, 's, 't>(FieldSeed<'c, 's, 't>);

impl OffsetsSeed<'_, '_, '_> {
    fn wrong<E: de::Error>(&self, found: String) -> E {
        self.0.type_error("an array [begin, end]", found)
    }
}

impl<'de> DeserializeSeed<'de> for OffsetsSeed<'_, '_, '_> {
    type Value = [u64; 2];

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<[u64; 2], D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for OffsetsSeed<'_, '_, '_> {
    type Value = [u64; 2];

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array [begin, end]")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<[u64; 2], A::Error> {
        let at = self.0;
        let mut got = [0u64; 2];
        let mut n = 0;
        while let Some(v) = seq.next_element_seed(IntSeed { at, index: n })? {
            if n == 2 {
                return Err(at.bad("more than 2 elements; expected [begin, end]".into()));
            }
            got[n] = v;
            n += 1;
        }
        if n != 2 {
            return Err(at.bad(format!("{n} element(s); expected [begin, end]")));
        }
        let [begin, end] = got;
        if begin > end {
            return Err(at.bad(format!("begin {begin} is after end {end}")));
        }
        Ok(got)
    }

    reject_kinds!(bool, i64, u64, f64, str, unit, map);
}

/// One element of `shape` or `data_offsets`: a non-negative integer.
struct IntSeed<'c, 's, 't> {
    at: FieldSeed<'c, 's, 't>,
    index: usize,
}

impl IntSeed<'_, '_, '_> {
    fn wrong<E: de::Error>(&self, found: String) -> E {
        self.at.bad(format!(
            "element {} is {found}, not a non-negative integer",
            self.index
        ))
    }
}

impl<'de> DeserializeSeed<'de> for IntSeed<'_, '_, '_> {
    type Value = u64;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<u64, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for IntSeed<'_, '_, '_> {
    type Value = u64;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a non-negative integer")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
        Ok(v)
    }

    // serde_json calls visit_i64 only for negative integers.
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
        u64::try_from(v).map_err(|_| self.wrong(format!("the negative number {v}")))
    }

    // Integers beyond u64 also arrive here, as floats.
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<u64, E> {
        Err(self.wrong(format!("the fractional or out-of-range number {v}")))
    }

    reject_kinds!(bool, str, unit, seq, map);
}
