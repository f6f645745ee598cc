//! A SHA-256 whose state can be saved and restored, so a resumed install still
//! proves a source shard's whole content without reading it again.
//!
//! The sha2 crate's `Sha256` keeps its state private; its `compress256` function (the
//! `compress` feature) exposes the block compression, so the running state is eight
//! words, the byte count and the bytes of an unfinished block. That is what the
//! journal records at each read boundary.

use serde::{Deserialize, Serialize};
use sha2::digest::block_buffer::{BlockBuffer, Eager};
use sha2::digest::consts::U64;
use sha2::digest::generic_array::GenericArray;

/// The block buffer of SHA-256 (64-byte blocks, compressed as soon as whole).
type Eager64 = BlockBuffer<U64, Eager>;

const H0: [u32; 8] = [
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
];

/// A resumable SHA-256.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResumableSha256 {
    /// Chaining state.
    state: [u32; 8],
    /// Bytes hashed so far.
    len: u64,
    /// Bytes of the unfinished block (fewer than 64), hex in the journal.
    #[serde(with = "hex_bytes")]
    pending: Vec<u8>,
}

mod hex_bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(v))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        let v = hex::decode(s).map_err(serde::de::Error::custom)?;
        if v.len() >= 64 {
            return Err(serde::de::Error::custom(
                "pending block of 64 bytes or more",
            ));
        }
        Ok(v)
    }
}

impl Default for ResumableSha256 {
    fn default() -> Self {
        ResumableSha256 {
            state: H0,
            len: 0,
            pending: Vec::with_capacity(64),
        }
    }
}

impl ResumableSha256 {
    /// Bytes hashed so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether nothing was hashed yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Feed bytes.
    ///
    /// Whole blocks go to the compression function straight from `data`, as many per
    /// call as there are (the SHA-NI path runs them back to back): the block buffer
    /// hands out slices of `data` itself, so nothing is copied but the < 64 bytes of
    /// an unfinished block. (Before, every byte was copied into a freshly allocated
    /// `Vec` of blocks first.)
    pub fn update(&mut self, data: &[u8]) {
        self.len += data.len() as u64;
        // `pending` is shorter than a block by construction and by the journal check.
        debug_assert!(self.pending.len() < 64);
        let mut buf = Eager64::try_new(&self.pending).unwrap_or_default();
        let state = &mut self.state;
        buf.digest_blocks(data, |blocks| sha2::compress256(state, blocks));
        self.pending.clear();
        self.pending.extend_from_slice(buf.get_data());
    }

    /// The digest, lowercase hex (the state is not consumed).
    pub fn finalize_hex(&self) -> String {
        let mut state = self.state;
        let mut tail = self.pending.clone();
        tail.push(0x80);
        while tail.len() % 64 != 56 {
            tail.push(0);
        }
        tail.extend_from_slice(&(self.len.wrapping_mul(8)).to_be_bytes());
        let blocks: Vec<GenericArray<u8, _>> = tail
            .chunks_exact(64)
            .map(GenericArray::clone_from_slice)
            .collect();
        sha2::compress256(&mut state, &blocks);
        let mut out = String::with_capacity(64);
        for w in state {
            out.push_str(&format!("{w:08x}"));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    #[test]
    fn matches_sha2_across_any_split_and_a_save_restore() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        let want = hex::encode(Sha256::digest(&data));
        assert_eq!(
            ResumableSha256::default().finalize_hex(),
            hex::encode(Sha256::digest(b""))
        );
        for split in [0, 1, 55, 56, 63, 64, 65, 127, 4096, 9_999, 10_000] {
            let mut h = ResumableSha256::default();
            h.update(&data[..split]);
            // Save and restore through the journal's JSON form.
            let saved = serde_json::to_string(&h).unwrap();
            let mut h: ResumableSha256 = serde_json::from_str(&saved).unwrap();
            for chunk in data[split..].chunks(37) {
                h.update(chunk);
            }
            assert_eq!(h.finalize_hex(), want, "split at {split}");
            assert_eq!(h.len(), data.len() as u64);
        }
    }

    #[test]
    fn a_tampered_checkpoint_is_refused() {
        let bad = r#"{"state":[0,0,0,0,0,0,0,0],"len":3,"pending":"zz"}"#;
        assert!(serde_json::from_str::<ResumableSha256>(bad).is_err());
        let long = format!(
            r#"{{"state":[0,0,0,0,0,0,0,0],"len":3,"pending":"{}"}}"#,
            "00".repeat(64)
        );
        assert!(serde_json::from_str::<ResumableSha256>(&long).is_err());
    }
}
