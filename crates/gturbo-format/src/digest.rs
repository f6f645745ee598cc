//! SHA-256 digests and commit ids as hex text: the one definition of what the format
//! (and the pins in family files) accept.
//!
//! The format stores lowercase hex and readers of an install accept nothing else
//! ([`is_sha256`], [`is_commit`]). A hub may answer with either case; the sources check
//! that with [`is_hex`] and lowercase what they keep.

use sha2::{Digest, Sha256};

/// Hex digits of a SHA-256 digest.
pub const SHA256_HEX_LEN: usize = 64;
/// Hex digits of a git commit id (SHA-1).
pub const COMMIT_HEX_LEN: usize = 40;

/// SHA-256 of `bytes`, lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    ::hex::encode(Sha256::digest(bytes))
}

/// Hex digits of a git blob id (SHA-1).
pub const GIT_OID_HEX_LEN: usize = 40;

/// The git blob id of `bytes`, lowercase hex: SHA-1 of `blob <len>\0` and the bytes.
/// The hub publishes it for every file not stored in LFS (the tree listing's `oid`,
/// the `ETag` of its `/resolve` answer), and a Hugging Face cache names such a blob
/// by it.
pub fn git_blob_sha1(bytes: &[u8]) -> String {
    use sha1::Digest as _;
    let mut h = sha1::Sha1::new();
    h.update(format!("blob {}\0", bytes.len()));
    h.update(bytes);
    ::hex::encode(h.finalize())
}

/// Which hash a source published for a whole file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Published {
    /// The git blob id ([`git_blob_sha1`]): a file not in LFS.
    GitBlob,
    /// The SHA-256 ([`sha256_hex`]): a file in LFS.
    Sha256,
}

/// The published hashes of a whole file that `bytes` do not match, the git blob id
/// first: (which, published, computed). The installer refuses a copy on the first;
/// `verify-install` reports each.
pub fn mismatches<'a>(
    git_oid: Option<&'a str>,
    sha256: Option<&'a str>,
    bytes: &[u8],
) -> Vec<(Published, &'a str, String)> {
    [(Published::GitBlob, git_oid), (Published::Sha256, sha256)]
        .into_iter()
        .filter_map(|(which, want)| {
            let want = want?;
            let got = which.of(bytes);
            (got != want).then_some((which, want, got))
        })
        .collect()
}

impl Published {
    /// This hash of `bytes`, lowercase hex.
    pub fn of(self, bytes: &[u8]) -> String {
        match self {
            Published::GitBlob => git_blob_sha1(bytes),
            Published::Sha256 => sha256_hex(bytes),
        }
    }
}

/// Whether `s` is `len` hex digits, either case.
pub fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Whether `s` is `len` lowercase hex digits.
pub fn is_lower_hex(s: &str, len: usize) -> bool {
    s.len() == len
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// 64 lowercase hex digits: a SHA-256 as the format writes it.
pub fn is_sha256(s: &str) -> bool {
    is_lower_hex(s, SHA256_HEX_LEN)
}

/// 40 lowercase hex digits: a commit id as the format writes it.
pub fn is_commit(s: &str) -> bool {
    is_lower_hex(s, COMMIT_HEX_LEN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn git_blob_ids_are_what_git_hash_object_prints() {
        // `printf 'hello\n' | git hash-object --stdin`; `git hash-object /dev/null`.
        assert_eq!(
            git_blob_sha1(b"hello\n"),
            "ce013625030ba8dba906f756967f9e9ca394464a"
        );
        assert_eq!(
            git_blob_sha1(b""),
            "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"
        );
    }

    #[test]
    fn hex_text_by_case_and_length() {
        let sha = sha256_hex(b"");
        assert_eq!(
            sha,
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert!(is_sha256(&sha));
        assert!(!is_sha256(&sha.to_uppercase()));
        assert!(is_hex(&sha.to_uppercase(), SHA256_HEX_LEN));
        assert!(!is_sha256(&sha[1..]));
        assert!(!is_hex("g".repeat(64).as_str(), 64));
        assert!(is_commit(&"a".repeat(40)));
        assert!(!is_commit(&"A".repeat(40)));
        assert!(is_hex(&"A".repeat(40), COMMIT_HEX_LEN));
        assert!(!is_commit(&"a".repeat(41)));
    }
}
