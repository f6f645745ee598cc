//! A session's state as host values, independent of the backend that computed it:
//! what a server writes to disk to continue a prefix after a restart. Each model
//! exports its session as an ordered list of [`Part`]s (KV rows, recurrent and conv
//! states, token histories) and imports such a list back, checking every part's kind
//! and length against its own geometry: bytes read from a file are never trusted.

use super::super::error::{InputError, RunError};
use super::super::kernels::ops::{AttnRows, IndexerDims, SparseAttentionOps};
use super::super::kernels::{AttentionSpec, Backend, KvRows};

/// One array of a session's state.
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    /// Floats: KV rows, conv and recurrent states.
    F32(Vec<f32>),
    /// Integers: token histories.
    I64(Vec<i64>),
}

/// A session's state: its position and its parts, in the order its model writes them.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SessionData {
    /// Tokens the state holds.
    pub pos: usize,
    /// The arrays, in the model's order.
    pub parts: Vec<Part>,
}

/// Tag of a [`Part::F32`] in [`SessionData::to_bytes`].
const TAG_F32: u8 = 1;
/// Tag of a [`Part::I64`].
const TAG_I64: u8 = 2;

/// A snapshot the model cannot take: `what` says why.
pub fn bad_snapshot(what: impl Into<String>) -> RunError {
    RunError::Input(InputError::BadSnapshot(what.into()))
}

impl SessionData {
    /// The bytes: `pos` (u64 LE), the part count (u64 LE), then per part a tag byte,
    /// its element count (u64 LE) and its elements (LE).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&(self.pos as u64).to_le_bytes());
        out.extend_from_slice(&(self.parts.len() as u64).to_le_bytes());
        for p in &self.parts {
            match p {
                Part::F32(v) => {
                    out.push(TAG_F32);
                    out.extend_from_slice(&(v.len() as u64).to_le_bytes());
                    v.iter()
                        .for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
                }
                Part::I64(v) => {
                    out.push(TAG_I64);
                    out.extend_from_slice(&(v.len() as u64).to_le_bytes());
                    v.iter()
                        .for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
                }
            }
        }
        out
    }

    /// Parse [`SessionData::to_bytes`]' layout; any truncation, unknown tag, length
    /// past the input or trailing byte is an error naming where.
    pub fn from_bytes(bytes: &[u8]) -> Result<SessionData, RunError> {
        let mut r = Reader { bytes, at: 0 };
        let pos = usize::try_from(r.u64("pos")?).map_err(|_| bad_snapshot("pos overflows"))?;
        let count = r.u64("part count")?;
        let mut parts = Vec::new();
        for i in 0..count {
            let tag = r.take(1, "part tag")?[0];
            let n = r.u64("part length")?;
            let elem = match tag {
                TAG_F32 => 4,
                TAG_I64 => 8,
                t => return Err(bad_snapshot(format!("part {i}: unknown tag {t}"))),
            };
            let len = usize::try_from(n)
                .ok()
                .and_then(|n| n.checked_mul(elem))
                .ok_or_else(|| bad_snapshot(format!("part {i}: {n} elements overflow")))?;
            let raw = r.take(len, "part elements")?;
            parts.push(match tag {
                TAG_F32 => Part::F32(
                    raw.chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect(),
                ),
                _ => Part::I64(
                    raw.chunks_exact(8)
                        .map(|b| i64::from_le_bytes(b.try_into().unwrap_or_default()))
                        .collect(),
                ),
            });
        }
        if r.at != bytes.len() {
            return Err(bad_snapshot(format!(
                "{} bytes after the last part",
                bytes.len() - r.at
            )));
        }
        Ok(SessionData { pos, parts })
    }

    /// The parts in order, for a model's import.
    pub fn reader(&self) -> Parts<'_> {
        Parts {
            parts: self.parts.iter(),
            index: 0,
        }
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], RunError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| {
                bad_snapshot(format!("truncated at byte {} reading the {what}", self.at))
            })?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u64(&mut self, what: &str) -> Result<u64, RunError> {
        let b = self.take(8, what)?;
        Ok(u64::from_le_bytes(b.try_into().unwrap_or_default()))
    }
}

/// The parts of a [`SessionData`] handed out in order, each checked as it is taken.
pub struct Parts<'a> {
    parts: std::slice::Iter<'a, Part>,
    index: usize,
}

impl<'a> Parts<'a> {
    fn next(&mut self, what: &str) -> Result<&'a Part, RunError> {
        self.index += 1;
        self.parts
            .next()
            .ok_or_else(|| bad_snapshot(format!("part {} ({what}) is missing", self.index - 1)))
    }

    /// The next part: floats, `len` of them when given, else a multiple of `unit`.
    pub fn f32(
        &mut self,
        what: &str,
        len: Option<usize>,
        unit: usize,
    ) -> Result<&'a [f32], RunError> {
        let i = self.index;
        match self.next(what)? {
            Part::F32(v)
                if len.is_none_or(|n| n == v.len()) && v.len().is_multiple_of(unit.max(1)) =>
            {
                Ok(v)
            }
            Part::F32(v) => Err(bad_snapshot(format!(
                "part {i} ({what}) has {} floats; {} expected",
                v.len(),
                len.map_or(format!("a multiple of {unit}"), |n| n.to_string())
            ))),
            Part::I64(_) => Err(bad_snapshot(format!("part {i} ({what}) is not floats"))),
        }
    }

    /// The next part: `len` integers, each in `range`.
    pub fn i64(
        &mut self,
        what: &str,
        len: usize,
        range: std::ops::Range<i64>,
    ) -> Result<&'a [i64], RunError> {
        let i = self.index;
        match self.next(what)? {
            Part::I64(v) if v.len() == len && v.iter().all(|x| range.contains(x)) => Ok(v),
            Part::I64(v) => Err(bad_snapshot(format!(
                "part {i} ({what}) holds {} integers, not {len} in {range:?}",
                v.len()
            ))),
            Part::F32(_) => Err(bad_snapshot(format!("part {i} ({what}) is not integers"))),
        }
    }

    /// `Ok` when every part was taken.
    pub fn finish(mut self) -> Result<(), RunError> {
        match self.parts.next() {
            None => Ok(()),
            Some(_) => Err(bad_snapshot(format!(
                "{} parts where the model has {}",
                self.index + 1 + self.parts.len(),
                self.index
            ))),
        }
    }
}

/// Append `kv`'s keys and values (two parts).
pub fn export_kv<B: Backend>(b: &B, kv: &B::Kv, parts: &mut Vec<Part>) -> Result<(), RunError> {
    let rows = b.read_kv(kv)?;
    parts.push(Part::F32(rows.k));
    parts.push(Part::F32(rows.v));
    Ok(())
}

/// Fill `kv` (empty, of `spec`, at most `max` positions) from the next two parts,
/// which must hold exactly `pos` positions.
pub fn import_kv<B: Backend>(
    b: &B,
    kv: &mut B::Kv,
    (spec, max): (AttentionSpec, usize),
    r: &mut Parts<'_>,
    pos: usize,
) -> Result<(), RunError> {
    let rows = KvRows {
        k: r.f32("keys", None, spec.k_width())?.to_vec(),
        v: r.f32("values", None, spec.stored_v_width())?.to_vec(),
    };
    match rows.positions(&spec, max) {
        Ok(n) if n == pos => {}
        Ok(n) => {
            return Err(bad_snapshot(format!(
                "a KV cache of {n} positions at position {pos}"
            )));
        }
        Err(e) => return Err(bad_snapshot(e)),
    }
    b.load_kv(kv, &rows)?;
    Ok(())
}

/// Append an indexed-attention cache (four parts).
pub fn export_attn<B: SparseAttentionOps>(
    b: &B,
    c: &B::AttnCache,
    parts: &mut Vec<Part>,
) -> Result<(), RunError> {
    let rows = b.read_cache(c)?;
    parts.extend([rows.k, rows.v, rows.raw, rows.blocks].map(Part::F32));
    Ok(())
}

/// Fill `c` (empty, rows `kv_width` wide, `ix`'s indexer) from the next four parts,
/// which must hold exactly `pos` positions.
pub fn import_attn<B: SparseAttentionOps>(
    b: &B,
    c: &mut B::AttnCache,
    (kv_width, ix): (usize, &IndexerDims),
    r: &mut Parts<'_>,
    pos: usize,
) -> Result<(), RunError> {
    let rows = AttnRows {
        k: r.f32("keys", None, kv_width)?.to_vec(),
        v: r.f32("values", None, kv_width)?.to_vec(),
        raw: r.f32("indexer keys", None, ix.head_dim)?.to_vec(),
        blocks: r.f32("block keys", None, ix.head_dim)?.to_vec(),
    };
    match rows.positions(kv_width, ix) {
        Ok(n) if n == pos => {}
        Ok(n) => {
            return Err(bad_snapshot(format!(
                "an attention cache of {n} positions at position {pos}"
            )));
        }
        Err(e) => return Err(bad_snapshot(e)),
    }
    b.load_cache(c, &rows)?;
    Ok(())
}

/// A buffer of exactly `len` floats from the next part.
pub fn import_buf<B: Backend>(
    b: &B,
    r: &mut Parts<'_>,
    what: &str,
    len: usize,
) -> Result<B::Buf, RunError> {
    Ok(b.upload(r.f32(what, Some(len), 1)?)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_bytes_round_trip_and_every_truncation_is_an_error() {
        let d = SessionData {
            pos: 7,
            parts: vec![
                Part::F32(vec![1.5, -2.0]),
                Part::I64(vec![3, -4]),
                Part::F32(Vec::new()),
            ],
        };
        let b = d.to_bytes();
        assert_eq!(b.len(), 16 + (9 + 8) + (9 + 16) + 9);
        assert_eq!(SessionData::from_bytes(&b).unwrap(), d);
        for n in 0..b.len() {
            assert!(SessionData::from_bytes(&b[..n]).is_err(), "{n} bytes");
        }
        let mut long = b.clone();
        long.push(0);
        assert!(SessionData::from_bytes(&long).is_err());
        // A length that overflows, and an unknown tag.
        let mut huge = b.clone();
        huge[17..25].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(SessionData::from_bytes(&huge).is_err());
        let mut tag = b;
        tag[16] = 9;
        assert!(SessionData::from_bytes(&tag).is_err());
    }

    #[test]
    fn parts_are_checked_as_they_are_taken() {
        let d = SessionData {
            pos: 1,
            parts: vec![Part::F32(vec![0.0; 6]), Part::I64(vec![1, 2])],
        };
        let mut r = d.reader();
        assert!(r.f32("kv", Some(5), 1).is_err());
        let mut r = d.reader();
        assert!(r.f32("kv", None, 4).is_err());
        let mut r = d.reader();
        assert_eq!(r.f32("kv", None, 3).unwrap().len(), 6);
        assert!(r.i64("history", 2, 0..2).is_err());
        let mut r = d.reader();
        r.f32("kv", Some(6), 1).unwrap();
        r.i64("history", 2, 0..3).unwrap();
        r.finish().unwrap();
        let mut r = d.reader();
        r.f32("kv", Some(6), 1).unwrap();
        assert!(r.finish().is_err());
        let mut r = d.reader();
        r.f32("kv", Some(6), 1).unwrap();
        r.i64("history", 2, 0..3).unwrap();
        assert!(r.f32("more", None, 1).is_err());
    }
}
