//! Byte ranges from a hub or a local snapshot; knows nothing about tensors.
//!
//! One abstraction, [`RangeSource`], with two implementations:
//! - [`http::HttpSource`]: any Hugging Face-compatible endpoint (the hub, a mirror,
//!   the local test hub). Resolves the revision to a commit once, lists the tree once,
//!   resolves each file once and reuses the redirected location, checks every ranged
//!   answer (206, `Content-Range`, length), retries transient faults.
//! - [`local::LocalSource`]: a snapshot directory on disk (`--from DIR`), including a
//!   Hugging Face cache snapshot folder.

use std::fmt;
use std::ops::Range;

use async_trait::async_trait;
use bytes::Bytes;

pub mod budget;
pub mod http;
pub mod local;
pub mod pace;
pub mod retry;
pub mod token;

/// Chunks of one ranged read.
pub type ByteStream =
    std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<Bytes, SourceError>> + Send>>;

/// One file of the resolved repository snapshot.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RepoFile {
    /// Path inside the repo, `/`-separated, validated (no `..`, not absolute).
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// SHA-256 of the content, lowercase hex, where the source publishes it
    /// (LFS files: `lfs.oid` in the tree listing or `X-Linked-Etag`).
    pub sha256: Option<String>,
    /// The git blob id of the content (SHA-1 of `blob <len>\0` and the bytes,
    /// lowercase hex), where the source publishes it: the tree listing's `oid` of a
    /// file not in LFS (an LFS file's `oid` names its pointer, not its content), or the
    /// blob name in a Hugging Face cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub git_oid: Option<String>,
}

/// A repository pinned to one commit, with its file listing.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ResolvedRepo {
    /// `org/name` (for a local snapshot: the directory's name).
    pub repo: String,
    /// The revision the user asked for (`main`, a tag, a commit).
    pub revision: String,
    /// The 40-hex commit it resolved to; `None` for a local folder that does not say.
    pub commit: Option<String>,
    /// Every file, sorted by path.
    pub files: Vec<RepoFile>,
}

impl ResolvedRepo {
    /// The listed file at `path`, if any.
    pub fn file(&self, path: &str) -> Option<&RepoFile> {
        self.files
            .binary_search_by(|f| f.path.as_str().cmp(path))
            .ok()
            .map(|i| &self.files[i])
    }
}

/// Counters a source keeps so the dry run can report what it cost.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct SourceStats {
    /// Requests sent (HTTP requests for a hub, opens+reads for a local folder),
    /// including redirects followed and retries.
    pub requests: u64,
    /// Retries after a transient fault.
    pub retries: u64,
    /// Body bytes received.
    pub bytes: u64,
}

/// Where bytes come from.
#[async_trait]
pub trait RangeSource: Send + Sync {
    /// One line for humans: `https://hub.example Qwen/X` or `local /path`.
    fn describe(&self) -> String;

    /// The pinned snapshot: resolved commit and every file with its size.
    /// Implementations resolve once and cache the answer.
    async fn resolve(&self) -> Result<ResolvedRepo, SourceError>;

    /// Exactly the bytes `range` of `path` (end exclusive). An answer of any other
    /// length is an error, never a short read.
    async fn read_range(&self, path: &str, range: Range<u64>) -> Result<Bytes, SourceError>;

    /// The bytes `range` of `path` as a stream of chunks, so a large read is consumed
    /// in bounded memory. The chunks together are exactly the range; a stream that
    /// ends early or errors means the read must be retried as a whole. The default
    /// delivers [`RangeSource::read_range`] as one chunk.
    async fn stream_range(&self, path: &str, range: Range<u64>) -> Result<ByteStream, SourceError> {
        let bytes = self.read_range(path, range).await?;
        Ok(Box::pin(futures_util::stream::once(
            async move { Ok(bytes) },
        )))
    }

    /// A whole small file (index, config, tokenizer). `max_len` bounds what is accepted.
    async fn read_file(&self, path: &str, max_len: u64) -> Result<Bytes, SourceError>;

    /// Counters so far.
    fn stats(&self) -> SourceStats;

    /// How often the source pushed back so far (a monotonic count): for a hub, retries
    /// after a `429` or `503` and requests that waited on its resolver budget or its
    /// `RateLimit`. `--jobs auto` opens no more connections once this moves. A source
    /// that cannot push back (a local folder) says 0.
    fn pushbacks(&self) -> u64 {
        0
    }

    /// The SHA-256 the source publishes for `path`, as known now: the listing's, or one
    /// a file answer carried (HTTP: `X-Linked-Etag`, or an `ETag` that is a SHA-256).
    /// Asked after the shard headers are read, so those answers count.
    fn published_sha256(&self, path: &str) -> Option<String> {
        let _ = path;
        None
    }

    /// The git blob id the source publishes for `path`, as known now: the listing's
    /// ([`RepoFile::git_oid`]), or (HTTP) the `ETag` of an answer for the file, which
    /// the hub sets to the blob id for a file not in LFS. A source that publishes none
    /// says `None`.
    fn published_git_oid(&self, path: &str) -> Option<String> {
        let _ = path;
        None
    }
}

/// Why a source could not deliver. Every variant names what the user needs to act:
/// the file, the byte range, the status.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// 401/403: gated or private repository, or a bad token.
    #[error("{url}: HTTP {status}: {}", unauthorized_hint(*status, *token_sent))]
    Unauthorized {
        /// The URL (never with credentials).
        url: String,
        /// HTTP status.
        status: u16,
        /// Whether the request carried a token (the hint differs: set one, or fix it).
        token_sent: bool,
    },
    /// 404: repo, revision or file not found.
    #[error("{url}: HTTP 404: not found ({what})")]
    NotFound {
        /// The URL.
        url: String,
        /// What was looked for: `repo Qwen/X`, `revision main`, `file model.safetensors`.
        what: String,
    },
    /// Any other non-success status that retries did not cure.
    #[error("{url}: HTTP {status}{range}: {detail}", range = fmt_range(range))]
    Status {
        /// The URL.
        url: String,
        /// HTTP status.
        status: u16,
        /// Byte range asked for, if any.
        range: Option<Range<u64>>,
        /// What the server said or what was wrong.
        detail: String,
    },
    /// The server answered a range request but not with the asked-for bytes
    /// (200 instead of 206, a wrong `Content-Range`, a short or long body).
    #[error("{path} bytes {}-{}: bad ranged answer: {detail}", range.start, range.end.saturating_sub(1))]
    BadRange {
        /// The file.
        path: String,
        /// Byte range asked for.
        range: Range<u64>,
        /// What was wrong, with the header values seen.
        detail: String,
    },
    /// The server asked us to wait longer than we accept.
    #[error(
        "{url}: server asked to wait {wait_s} s (Retry-After: {header}), over the {limit_s} s limit"
    )]
    RetryAfterTooLong {
        /// The URL.
        url: String,
        /// The header as sent.
        header: String,
        /// Seconds asked for.
        wait_s: u64,
        /// Seconds we accept.
        limit_s: u64,
    },
    /// Network-level failure after all retries (connect, reset, timeout, truncated body).
    #[error("{url}{range}: network error after {attempts} attempt(s): {detail}", range = fmt_range(range))]
    Network {
        /// The URL.
        url: String,
        /// Byte range asked for, if any.
        range: Option<Range<u64>>,
        /// Attempts made.
        attempts: u32,
        /// The last error's text.
        detail: String,
    },
    /// A transfer broke a progress rule ([`pace`]) on every attempt: too few bytes in
    /// the low-speed window, or an attempt past the range timeout.
    #[error("{file}{range}: too slow, gave up after {attempts} attempt(s): {detail} (from {url})", range = fmt_range(range))]
    TooSlow {
        /// The file (or, for an API call, what was asked for).
        file: String,
        /// The URL.
        url: String,
        /// Byte range asked for, if any.
        range: Option<Range<u64>>,
        /// Attempts made.
        attempts: u32,
        /// The rule broken and the observed rate, on the last attempt.
        detail: String,
    },
    /// A server answer (revision info, tree listing) that does not parse or is unsafe.
    #[error("{url}: malformed answer: field `{field}`: {detail}")]
    Malformed {
        /// The URL.
        url: String,
        /// The field that was wrong.
        field: String,
        /// What was wrong.
        detail: String,
    },
    /// The file is not in the snapshot.
    #[error("{path}: not in the snapshot of {repo}")]
    MissingFile {
        /// The repo.
        repo: String,
        /// The file.
        path: String,
    },
    /// A file is larger than the caller accepts.
    #[error("{path}: {size} bytes, more than the {max} bytes accepted for this file")]
    TooLarge {
        /// The file.
        path: String,
        /// Its size.
        size: u64,
        /// The limit.
        max: u64,
    },
    /// A name from the source that could escape the snapshot (`..`, absolute, backslash).
    #[error("{origin}: unsafe file name {name:?}: {why}")]
    UnsafePath {
        /// Where the name came from (tree listing, index weight_map, directory).
        origin: String,
        /// The name.
        name: String,
        /// Why it is refused.
        why: String,
    },
    /// A local snapshot holds something that is neither a file nor a folder (a FIFO, a
    /// socket, a device): reading it could block forever or read a device.
    #[error(
        "{origin}: {name}: {kind}, not a regular file; a snapshot may hold only regular files, folders and symlinks to them"
    )]
    NotRegularFile {
        /// The snapshot directory.
        origin: String,
        /// The entry, relative to the snapshot.
        name: String,
        /// What it is: `a FIFO (named pipe)`, `a socket`, ...
        kind: String,
    },
    /// Local I/O.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Bad configuration (endpoint URL, token file).
    #[error("{0}")]
    Config(String),
}

/// What to do about a 401/403. A request without a token may just need one; a request
/// with one was refused with it, so "set HF_TOKEN" would not help.
fn unauthorized_hint(status: u16, token_sent: bool) -> &'static str {
    match (token_sent, status) {
        (false, _) => {
            "access denied; the repo may be gated or private (set HF_TOKEN or log in with `hf auth login`, and accept the repo's terms on the hub)"
        }
        (true, 401) => {
            "access denied with the token given: it is invalid, expired or revoked (check HF_TOKEN, HF_TOKEN_PATH or the token file from `hf auth login`)"
        }
        (true, _) => {
            "access denied with the token given: it is valid but has no access to this repo (accept the repo's terms on the hub, or use a token with read access to it)"
        }
    }
}

fn fmt_range(range: &Option<Range<u64>>) -> String {
    match range {
        Some(r) => format!(" (bytes {}-{})", r.start, r.end.saturating_sub(1)),
        None => String::new(),
    }
}

/// Check a file name that came from untrusted input (tree listing, index `weight_map`,
/// directory walk): relative, `/`-separated, no `..`/`.` components, no empty
/// components, no backslashes or NULs, at most 16 components and 1024 bytes.
pub fn check_repo_path(origin: &str, name: &str) -> Result<(), SourceError> {
    let refuse = |why: &str| {
        Err(SourceError::UnsafePath {
            origin: origin.to_string(),
            name: name.to_string(),
            why: why.to_string(),
        })
    };
    if name.is_empty() {
        return refuse("empty name");
    }
    if name.len() > 1024 {
        return refuse("longer than 1024 bytes");
    }
    if name.starts_with('/') {
        return refuse("absolute path");
    }
    if name.contains('\\') {
        return refuse("backslash in name");
    }
    if name.contains('\0') || name.chars().any(|c| c.is_control()) {
        return refuse("control character in name");
    }
    if name.len() >= 2 && name.as_bytes()[1] == b':' {
        return refuse("drive-letter path");
    }
    let parts: Vec<&str> = name.split('/').collect();
    if parts.len() > 16 {
        return refuse("more than 16 path components");
    }
    for p in parts {
        match p {
            "" => return refuse("empty path component"),
            "." | ".." => return refuse("`.` or `..` component"),
            _ => {}
        }
    }
    Ok(())
}

impl fmt::Display for ResolvedRepo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}@{}",
            self.repo,
            self.commit.as_deref().unwrap_or(&self.revision)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_paths_that_escape_are_refused_with_reason() {
        for (name, why) in [
            ("../etc/passwd", "`.` or `..` component"),
            ("a/../../b", "`.` or `..` component"),
            ("/etc/passwd", "absolute path"),
            ("a\\b", "backslash in name"),
            ("a//b", "empty path component"),
            ("C:x", "drive-letter path"),
            ("", "empty name"),
        ] {
            let err = check_repo_path("index weight_map", name).unwrap_err();
            let text = err.to_string();
            assert!(text.contains(why), "{name}: {text}");
            assert!(
                text.starts_with("index weight_map: unsafe file name"),
                "{text}"
            );
        }
        for ok in [
            "model.safetensors",
            "sub/dir/model-00001-of-00002.safetensors",
        ] {
            check_repo_path("x", ok).unwrap();
        }
    }
}
