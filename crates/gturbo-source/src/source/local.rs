//! A snapshot directory on disk (`--from DIR`) as a [`RangeSource`].
//!
//! Two layouts are understood:
//! - a plain directory: every regular file below it (skipping `.git` and `.cache`) is
//!   a repo file; a symlink is followed only when it resolves inside the directory; the
//!   commit is unknown; anything that is neither a file nor a folder (a FIFO, a socket,
//!   a device) refuses the snapshot, naming it;
//! - a Hugging Face cache snapshot `.../models--ORG--NAME/snapshots/<commit>/`, or the
//!   `models--ORG--NAME` folder itself (the snapshot then comes from
//!   `refs/<revision or main>`): files are symlinks into `../../blobs/`, accepted when
//!   they stay inside `models--ORG--NAME`; the commit is the snapshot folder's name, and
//!   a blob named by 64 hex digits (an LFS file) gives the file's SHA-256, one named by
//!   40 (any other file) its git blob id.
//!
//! A plain directory publishes no hash: its files are installed unverified (the install
//! says so per file, and `--require-source-hash` refuses them).
//!
//! The directory is walked once, in [`LocalSource::open`]; each file's resolved location
//! is kept, and later reads open it without following a link (`open_listed`): a
//! link swapped in after the walk cannot redirect a read. Reads are positional and
//! exact.

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use bytes::Bytes;

use super::{
    ByteStream, RangeSource, RepoFile, ResolvedRepo, SourceError, SourceStats, check_repo_path,
};
use crate::format::digest::{GIT_OID_HEX_LEN, SHA256_HEX_LEN, is_hex};
use crate::format::nofollow::{self, NoFollowError};

/// Largest chunk [`LocalSource::stream_range`] yields: what one read holds in flight.
pub const STREAM_CHUNK: usize = 1024 * 1024;

/// Folders never listed: VCS data and caches (`hf download --local-dir` keeps its
/// metadata in `.cache`).
const SKIPPED_DIRS: [&str; 2] = [".git", ".cache"];

/// A local snapshot directory.
#[derive(Debug)]
pub struct LocalSource {
    /// The directory the user named.
    dir: PathBuf,
    repo: ResolvedRepo,
    /// Repo path → resolved file on disk.
    paths: BTreeMap<String, PathBuf>,
    requests: AtomicU64,
    /// Shared with open streams, which count their chunks as they read them.
    bytes: Arc<AtomicU64>,
}

/// How the directory was recognised.
struct Layout {
    /// The folder whose files are the repo.
    snapshot: PathBuf,
    /// Symlinks must resolve inside this folder.
    jail: PathBuf,
    /// Whether symlinks into `jail/blobs` carry hashes.
    hf_cache: bool,
    repo: String,
    revision: String,
    commit: Option<String>,
}

impl LocalSource {
    /// Open `dir` (a plain snapshot directory or a Hugging Face cache folder) and list
    /// its files. `revision_hint` picks the ref of a `models--ORG--NAME` folder and is
    /// checked against a snapshot folder's commit.
    pub fn open(dir: &Path, revision_hint: Option<&str>) -> Result<LocalSource, SourceError> {
        let canonical = fs::canonicalize(dir).map_err(|e| io_err(dir, e))?;
        if !canonical.is_dir() {
            return Err(SourceError::Config(format!(
                "{}: not a directory",
                dir.display()
            )));
        }
        let layout = detect_layout(&canonical, revision_hint)?;
        let mut files = Vec::new();
        let mut paths = BTreeMap::new();
        walk(&layout, &layout.snapshot, "", &mut files, &mut paths)?;
        files.sort_by(|a: &RepoFile, b| a.path.cmp(&b.path));
        Ok(LocalSource {
            dir: dir.to_path_buf(),
            repo: ResolvedRepo {
                repo: layout.repo,
                revision: layout.revision,
                commit: layout.commit,
                files,
            },
            paths,
            requests: AtomicU64::new(0),
            bytes: Arc::new(AtomicU64::new(0)),
        })
    }

    /// The resolved file for `path`, after the name check.
    /// [`Self::locate`], then refuse a range that is reversed or runs past the listed size.
    fn locate_range(&self, path: &str, range: &Range<u64>) -> Result<PathBuf, SourceError> {
        let (disk, size) = self.locate(path)?;
        if range.start > range.end {
            return Err(bad_range(path, range, "range starts after it ends".into()));
        }
        if range.end > size {
            return Err(bad_range(path, range, format!("file is {size} bytes")));
        }
        Ok(disk)
    }

    fn locate(&self, path: &str) -> Result<(PathBuf, u64), SourceError> {
        check_repo_path("requested path", path)?;
        match (self.paths.get(path), self.repo.file(path)) {
            (Some(disk), Some(f)) => Ok((disk.clone(), f.size)),
            _ => Err(SourceError::MissingFile {
                repo: self.repo.repo.clone(),
                path: path.to_string(),
            }),
        }
    }

    fn count(&self, bytes: usize) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

#[async_trait]
impl RangeSource for LocalSource {
    fn describe(&self) -> String {
        format!("local {}", self.dir.display())
    }

    async fn resolve(&self) -> Result<ResolvedRepo, SourceError> {
        Ok(self.repo.clone())
    }

    async fn read_range(&self, path: &str, range: Range<u64>) -> Result<Bytes, SourceError> {
        let disk = self.locate_range(path, &range)?;
        let bad = |detail: String| bad_range(path, &range, detail);
        let len = usize::try_from(range.end - range.start)
            .map_err(|_| bad("range does not fit in memory".into()))?;
        let start = range.start;
        let read = tokio::task::spawn_blocking(move || -> std::io::Result<Vec<u8>> {
            let file = open_listed(&disk)?;
            let mut buf = vec![0u8; len];
            file.read_exact_at(&mut buf, start)?;
            Ok(buf)
        })
        .await
        .map_err(|e| SourceError::Io {
            path: path.to_string(),
            source: std::io::Error::other(e),
        })?;
        let buf = match read {
            Ok(buf) => buf,
            // The file shrank since the walk.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Err(bad("file ended before the range did".into()));
            }
            Err(source) => {
                return Err(SourceError::Io {
                    path: path.to_string(),
                    source,
                });
            }
        };
        self.count(buf.len());
        Ok(Bytes::from(buf))
    }

    /// Chunks of at most [`STREAM_CHUNK`] bytes, each a positional read of the file
    /// opened once here. A range past the listed size is refused at once; a file that
    /// shrank since the walk ends the stream with [`SourceError::BadRange`].
    async fn stream_range(&self, path: &str, range: Range<u64>) -> Result<ByteStream, SourceError> {
        let disk = self.locate_range(path, &range)?;
        let file = tokio::task::spawn_blocking(move || open_listed(&disk))
            .await
            .map_err(|e| join_err(path, e))?
            .map_err(|source| SourceError::Io {
                path: path.to_string(),
                source,
            })?;
        self.requests.fetch_add(1, Ordering::Relaxed);
        let state = LocalStream {
            file: Arc::new(file),
            path: path.to_string(),
            pos: range.start,
            range,
            bytes: Arc::clone(&self.bytes),
            done: false,
        };
        Ok(Box::pin(futures_util::stream::unfold(
            state,
            |mut s| async move {
                let item = s.next_chunk().await?;
                Some((item, s))
            },
        )))
    }

    async fn read_file(&self, path: &str, max_len: u64) -> Result<Bytes, SourceError> {
        let (disk, size) = self.locate(path)?;
        let too_large = |size| SourceError::TooLarge {
            path: path.to_string(),
            size,
            max: max_len,
        };
        if size > max_len {
            return Err(too_large(size));
        }
        let read = tokio::task::spawn_blocking(move || -> std::io::Result<Vec<u8>> {
            // One byte over the cap tells a file that grew since the walk.
            let mut buf = Vec::new();
            open_listed(&disk)?
                .take(max_len.saturating_add(1))
                .read_to_end(&mut buf)?;
            Ok(buf)
        })
        .await
        .map_err(|e| SourceError::Io {
            path: path.to_string(),
            source: std::io::Error::other(e),
        })?
        .map_err(|source| SourceError::Io {
            path: path.to_string(),
            source,
        })?;
        if read.len() as u64 > max_len {
            return Err(too_large(read.len() as u64));
        }
        self.count(read.len());
        Ok(Bytes::from(read))
    }

    fn stats(&self) -> SourceStats {
        SourceStats {
            requests: self.requests.load(Ordering::Relaxed),
            retries: 0,
            bytes: self.bytes.load(Ordering::Relaxed),
        }
    }

    /// A Hugging Face cache's blob name, for a file not in LFS; none for a plain folder.
    fn published_git_oid(&self, path: &str) -> Option<String> {
        self.repo.file(path).and_then(|f| f.git_oid.clone())
    }
}

/// One streamed range of an open file.
struct LocalStream {
    file: Arc<fs::File>,
    path: String,
    range: Range<u64>,
    /// The next byte to read.
    pos: u64,
    bytes: Arc<AtomicU64>,
    done: bool,
}

impl LocalStream {
    async fn next_chunk(&mut self) -> Option<Result<Bytes, SourceError>> {
        if self.done || self.pos >= self.range.end {
            return None;
        }
        // At most STREAM_CHUNK, so the cast cannot truncate.
        let len = (self.range.end - self.pos).min(STREAM_CHUNK as u64) as usize;
        let file = Arc::clone(&self.file);
        let at = self.pos;
        let read = tokio::task::spawn_blocking(move || -> std::io::Result<Vec<u8>> {
            let mut buf = vec![0u8; len];
            file.read_exact_at(&mut buf, at)?;
            Ok(buf)
        })
        .await;
        let result = match read {
            Ok(Ok(buf)) => {
                self.pos += len as u64;
                self.bytes.fetch_add(len as u64, Ordering::Relaxed);
                return Some(Ok(Bytes::from(buf)));
            }
            Err(e) => join_err(&self.path, e),
            // The file shrank since the walk.
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => SourceError::BadRange {
                path: self.path.clone(),
                range: self.range.clone(),
                detail: format!("file ended before the range did (reading at byte {at})"),
            },
            Ok(Err(source)) => SourceError::Io {
                path: self.path.clone(),
                source,
            },
        };
        self.done = true;
        Some(Err(result))
    }
}

fn join_err(path: &str, e: tokio::task::JoinError) -> SourceError {
    SourceError::Io {
        path: path.to_string(),
        source: std::io::Error::other(e),
    }
}

fn io_err(path: &Path, source: std::io::Error) -> SourceError {
    SourceError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn file_name(p: &Path) -> Option<&str> {
    p.file_name().and_then(|n| n.to_str())
}

/// `models--ORG--NAME` → `ORG/NAME` (`models--NAME` → `NAME`).
fn hf_repo_name(folder: &str) -> Option<String> {
    let rest = folder.strip_prefix("models--")?;
    if rest.is_empty() {
        return None;
    }
    Some(match rest.split_once("--") {
        Some((org, name)) => format!("{org}/{name}"),
        None => rest.to_string(),
    })
}

/// Read `refs/<name>` of an HF cache repo folder: a 40-hex commit.
fn read_ref(repo_root: &Path, name: &str) -> Result<Option<String>, SourceError> {
    check_repo_path("revision", name)?;
    let path = repo_root.join("refs").join(name);
    let text = match fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(&path, e)),
    };
    let commit = text.trim();
    if !is_hex(commit, 40) {
        return Err(SourceError::Malformed {
            url: path.display().to_string(),
            field: "ref".into(),
            detail: format!("expected a 40-hex commit, found {:?}", clip(commit)),
        });
    }
    Ok(Some(commit.to_ascii_lowercase()))
}

fn clip(s: &str) -> String {
    s.chars().take(80).collect()
}

/// For `.../models--ORG--NAME/snapshots/<40-hex>`: the `models--ORG--NAME` folder and
/// `ORG/NAME`.
fn hf_snapshot_parent(dir: &Path) -> Option<(&Path, String)> {
    let parent = dir.parent()?;
    let grand = parent.parent()?;
    if file_name(parent) != Some("snapshots") || !is_hex(file_name(dir)?, 40) {
        return None;
    }
    Some((grand, hf_repo_name(file_name(grand)?)?))
}

fn detect_layout(dir: &Path, hint: Option<&str>) -> Result<Layout, SourceError> {
    let name = file_name(dir).unwrap_or_default();
    // `models--ORG--NAME/snapshots/<commit>`
    if let Some((grand, repo)) = hf_snapshot_parent(dir) {
        let commit = name.to_ascii_lowercase();
        if let Some(hint) = hint {
            let wanted = if is_hex(hint, 40) {
                Some(hint.to_ascii_lowercase())
            } else {
                read_ref(grand, hint)?
            };
            match wanted {
                Some(wanted) if wanted != commit => {
                    return Err(SourceError::Config(format!(
                        "{}: snapshot is commit {commit}, but revision {hint} is {wanted}",
                        dir.display()
                    )));
                }
                _ => {}
            }
        }
        return Ok(Layout {
            snapshot: dir.to_path_buf(),
            jail: grand.to_path_buf(),
            hf_cache: true,
            repo,
            revision: hint.unwrap_or(&commit).to_string(),
            commit: Some(commit),
        });
    }
    // `models--ORG--NAME` itself.
    if let Some(repo) = hf_repo_name(name).filter(|_| dir.join("snapshots").is_dir()) {
        let revision = hint.unwrap_or("main");
        let commit = if is_hex(revision, 40) {
            revision.to_ascii_lowercase()
        } else {
            read_ref(dir, revision)?.ok_or_else(|| {
                SourceError::Config(format!(
                    "{}: no refs/{revision} in this Hugging Face cache folder; pass the revision or a snapshot folder",
                    dir.display()
                ))
            })?
        };
        let snapshot = dir.join("snapshots").join(&commit);
        if !snapshot.is_dir() {
            return Err(SourceError::Config(format!(
                "{}: revision {revision} is commit {commit}, which has no snapshot folder",
                dir.display()
            )));
        }
        return Ok(Layout {
            snapshot,
            jail: dir.to_path_buf(),
            hf_cache: true,
            repo,
            revision: revision.to_string(),
            commit: Some(commit),
        });
    }
    Ok(Layout {
        snapshot: dir.to_path_buf(),
        jail: dir.to_path_buf(),
        hf_cache: false,
        repo: name.to_string(),
        revision: hint.unwrap_or("local").to_string(),
        commit: None,
    })
}

/// List the files under `dir` (whose repo path is `prefix`), depth first.
fn walk(
    layout: &Layout,
    dir: &Path,
    prefix: &str,
    files: &mut Vec<RepoFile>,
    paths: &mut BTreeMap<String, PathBuf>,
) -> Result<(), SourceError> {
    let origin = format!("local directory {}", layout.snapshot.display());
    let entries = fs::read_dir(dir).map_err(|e| io_err(dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| io_err(dir, e))?;
        let disk = entry.path();
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            return Err(SourceError::UnsafePath {
                origin,
                name: entry.file_name().to_string_lossy().into_owned(),
                why: "name is not UTF-8".into(),
            });
        };
        let rel = if prefix.is_empty() {
            name.clone()
        } else {
            format!("{prefix}/{name}")
        };
        let kind = entry.file_type().map_err(|e| io_err(&disk, e))?;
        if kind.is_dir() {
            if !SKIPPED_DIRS.contains(&name.as_str()) {
                check_repo_path(&origin, &rel)?;
                walk(layout, &disk, &rel, files, paths)?;
            }
            continue;
        }
        let (target, (sha256, git_oid)) = if kind.is_symlink() {
            let refuse = |why: String| SourceError::UnsafePath {
                origin: origin.clone(),
                name: rel.clone(),
                why,
            };
            let target = fs::canonicalize(&disk).map_err(|e| io_err(&disk, e))?;
            if !target.starts_with(&layout.jail) {
                return Err(refuse(format!(
                    "symlink resolves outside {} (to {})",
                    layout.jail.display(),
                    target.display()
                )));
            }
            if target.is_dir() {
                return Err(refuse("symlink to a directory; not followed".into()));
            }
            // LFS blobs are named by their SHA-256; other blobs by a git SHA-1.
            let blob = |len| {
                file_name(&target)
                    .filter(|n| layout.hf_cache && is_hex(n, len))
                    .map(str::to_ascii_lowercase)
            };
            let hashes = (blob(SHA256_HEX_LEN), blob(GIT_OID_HEX_LEN));
            (target, hashes)
        } else if kind.is_file() {
            (disk, (None, None))
        } else {
            // A FIFO would block a read forever and a device is no repo content:
            // refuse the snapshot, naming the entry, rather than install without it.
            return Err(not_regular(&origin, &rel, kind));
        };
        check_repo_path(&origin, &rel)?;
        let meta = fs::metadata(&target).map_err(|e| io_err(&target, e))?;
        if !meta.is_file() {
            return Err(not_regular(&origin, &rel, meta.file_type()));
        }
        files.push(RepoFile {
            path: rel.clone(),
            size: meta.len(),
            sha256,
            git_oid,
        });
        paths.insert(rel, target);
    }
    Ok(())
}

/// Open a listed file, at the location the walk resolved, for reading. The walk left
/// no link at that place, so a link (or a FIFO, anything but a regular file) there now
/// was swapped in since: it is refused, not followed or blocked on.
fn open_listed(disk: &Path) -> std::io::Result<fs::File> {
    nofollow::open_regular(disk, fs::OpenOptions::new().read(true)).map_err(|e| match e {
        NoFollowError::Io { source, .. } => source,
        NoFollowError::Planted { what, .. } => std::io::Error::other(format!(
            "{what} stands where the listing found a regular file; not followed"
        )),
    })
}

/// The refusal of a snapshot entry that is not a regular file (nor a folder).
fn not_regular(origin: &str, rel: &str, kind: fs::FileType) -> SourceError {
    use std::os::unix::fs::FileTypeExt;
    let kind = if kind.is_fifo() {
        "a FIFO (named pipe)"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_dir() {
        "a folder"
    } else {
        "an unknown kind of file"
    };
    SourceError::NotRegularFile {
        origin: origin.to_string(),
        name: rel.to_string(),
        kind: kind.to_string(),
    }
}

fn bad_range(path: &str, range: &Range<u64>, detail: String) -> SourceError {
    SourceError::BadRange {
        path: path.to_string(),
        range: range.clone(),
        detail,
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    fn write(path: &Path, bytes: &[u8]) {
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).unwrap();
        }
        fs::write(path, bytes).unwrap();
    }

    /// 0, 1, 2, ... 255, 0, 1, ...
    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| i as u8).collect()
    }

    #[tokio::test]
    async fn plain_directory_lists_sorted_files_and_skips_tool_folders() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("my-model");
        write(&root.join("model.safetensors"), &pattern(1000));
        write(&root.join("config.json"), b"{}");
        write(&root.join("sub/b.txt"), b"bb");
        write(&root.join(".git/HEAD"), b"ref");
        write(&root.join(".cache/huggingface/x"), b"x");
        symlink("model.safetensors", root.join("alias.safetensors")).unwrap();

        let src = LocalSource::open(&root, None).unwrap();
        let repo = src.resolve().await.unwrap();
        assert_eq!(repo.repo, "my-model");
        assert_eq!(repo.commit, None);
        assert_eq!(repo.revision, "local");
        let listed: Vec<(&str, u64, Option<&str>)> = repo
            .files
            .iter()
            .map(|f| (f.path.as_str(), f.size, f.sha256.as_deref()))
            .collect();
        assert_eq!(
            listed,
            vec![
                ("alias.safetensors", 1000, None),
                ("config.json", 2, None),
                ("model.safetensors", 1000, None),
                ("sub/b.txt", 2, None),
            ]
        );
        assert_eq!(src.describe(), format!("local {}", root.display()));
        assert_eq!(src.stats(), SourceStats::default());
    }

    #[tokio::test]
    async fn a_link_swapped_in_after_the_walk_is_refused_not_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("m");
        write(&root.join("m.safetensors"), &pattern(100));
        write(&root.join("config.json"), b"{}");
        write(&tmp.path().join("secret"), &[7u8; 100]);
        let src = LocalSource::open(&root, None).unwrap();
        for name in ["m.safetensors", "config.json"] {
            fs::remove_file(root.join(name)).unwrap();
            symlink(tmp.path().join("secret"), root.join(name)).unwrap();
        }
        let e = src.read_range("m.safetensors", 0..10).await.unwrap_err();
        assert!(
            e.to_string().contains("a symbolic link stands where"),
            "{e}"
        );
        let e = src.read_file("config.json", 100).await.unwrap_err();
        assert!(e.to_string().contains("not followed"), "{e}");
        let e = src
            .stream_range("m.safetensors", 0..10)
            .await
            .err()
            .unwrap();
        assert!(
            e.to_string().starts_with("m.safetensors: a symbolic link"),
            "{e}"
        );
    }

    #[tokio::test]
    async fn ranges_are_exact_and_counted() {
        let tmp = tempfile::tempdir().unwrap();
        let data = pattern(5000);
        write(&tmp.path().join("m.safetensors"), &data);
        write(&tmp.path().join("config.json"), b"{\"a\":1}");
        let src = LocalSource::open(tmp.path(), None).unwrap();

        let got = src.read_range("m.safetensors", 4090..4100).await.unwrap();
        assert_eq!(&got[..], &data[4090..4100]);
        let got = src.read_range("m.safetensors", 0..5000).await.unwrap();
        assert_eq!(&got[..], &data[..]);
        let got = src.read_range("m.safetensors", 5000..5000).await.unwrap();
        assert!(got.is_empty());
        let got = src.read_file("config.json", 7).await.unwrap();
        assert_eq!(&got[..], b"{\"a\":1}");
        assert_eq!(
            src.stats(),
            SourceStats {
                requests: 4,
                retries: 0,
                bytes: 10 + 5000 + 7,
            }
        );
    }

    #[tokio::test]
    async fn short_file_and_oversize_reads_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        write(&tmp.path().join("m.safetensors"), &pattern(100));
        write(&tmp.path().join("config.json"), &[b' '; 64]);
        let src = LocalSource::open(tmp.path(), None).unwrap();

        let err = src.read_range("m.safetensors", 90..101).await.unwrap_err();
        assert!(matches!(err, SourceError::BadRange { .. }), "{err:?}");
        assert_eq!(
            err.to_string(),
            "m.safetensors bytes 90-100: bad ranged answer: file is 100 bytes"
        );

        // The file shrinks after the listing: the read itself comes up short.
        fs::write(tmp.path().join("m.safetensors"), pattern(50)).unwrap();
        let err = src.read_range("m.safetensors", 40..60).await.unwrap_err();
        assert_eq!(
            err.to_string(),
            "m.safetensors bytes 40-59: bad ranged answer: file ended before the range did"
        );

        let err = src.read_file("config.json", 63).await.unwrap_err();
        assert!(
            matches!(
                err,
                SourceError::TooLarge {
                    size: 64,
                    max: 63,
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            "config.json: 64 bytes, more than the 63 bytes accepted for this file"
        );
        assert_eq!(src.stats().requests, 0, "refused reads are not counted");
    }

    /// Every chunk of a stream, or the first error.
    async fn collect(mut stream: ByteStream) -> (Vec<Bytes>, Option<SourceError>) {
        use futures_util::StreamExt as _;
        let mut chunks = Vec::new();
        while let Some(item) = stream.next().await {
            match item {
                Ok(c) => chunks.push(c),
                Err(e) => {
                    assert!(stream.next().await.is_none(), "nothing after the error");
                    return (chunks, Some(e));
                }
            }
        }
        (chunks, None)
    }

    #[tokio::test]
    async fn streamed_ranges_are_exact_in_chunks_of_at_most_one_mib() {
        let tmp = tempfile::tempdir().unwrap();
        // 251 is prime: a chunk out of place would not line up.
        let data: Vec<u8> = (0..3 * STREAM_CHUNK + 12_345)
            .map(|i| (i % 251) as u8)
            .collect();
        write(&tmp.path().join("m.safetensors"), &data);
        let src = LocalSource::open(tmp.path(), None).unwrap();

        let n = data.len() as u64;
        let (chunks, err) = collect(src.stream_range("m.safetensors", 5..n).await.unwrap()).await;
        assert!(err.is_none(), "{err:?}");
        let lens: Vec<usize> = chunks.iter().map(Bytes::len).collect();
        assert_eq!(lens, [STREAM_CHUNK, STREAM_CHUNK, STREAM_CHUNK, 12_340]);
        let got: Vec<u8> = chunks.iter().flat_map(|c| c.iter().copied()).collect();
        assert!(got == data[5..], "streamed bytes differ");

        let (chunks, err) = collect(src.stream_range("m.safetensors", 9..9).await.unwrap()).await;
        assert!(chunks.is_empty() && err.is_none(), "{chunks:?} {err:?}");
        assert_eq!(
            src.stats(),
            SourceStats {
                requests: 2,
                retries: 0,
                bytes: n - 5,
            }
        );
    }

    #[tokio::test]
    async fn a_short_file_ends_a_stream_with_bad_range() {
        let tmp = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..3 * STREAM_CHUNK).map(|i| (i % 251) as u8).collect();
        write(&tmp.path().join("m.safetensors"), &data);
        let src = LocalSource::open(tmp.path(), None).unwrap();
        let n = data.len() as u64;

        // Past the listed size: refused before anything is read.
        let err = match src.stream_range("m.safetensors", 10..n + 1).await {
            Ok(_) => panic!("a range past the end was accepted"),
            Err(e) => e,
        };
        assert_eq!(
            err.to_string(),
            format!("m.safetensors bytes 10-{n}: bad ranged answer: file is {n} bytes")
        );
        assert_eq!(src.stats().requests, 0);

        // The file shrinks after the listing: the chunks before the end arrive, then
        // the stream ends with the error.
        fs::write(
            tmp.path().join("m.safetensors"),
            &data[..STREAM_CHUNK + STREAM_CHUNK / 2],
        )
        .unwrap();
        let (chunks, err) = collect(src.stream_range("m.safetensors", 0..n).await.unwrap()).await;
        let lens: Vec<usize> = chunks.iter().map(Bytes::len).collect();
        assert_eq!(lens, [STREAM_CHUNK]);
        assert!(chunks[0] == data[..STREAM_CHUNK]);
        let err = err.expect("the stream ends with an error");
        assert!(matches!(err, SourceError::BadRange { .. }), "{err:?}");
        assert_eq!(
            err.to_string(),
            format!(
                "m.safetensors bytes 0-{}: bad ranged answer: file ended before the range did (reading at byte {STREAM_CHUNK})",
                n - 1
            )
        );
    }

    /// Issue 13, item 16: a FIFO (or socket) in a snapshot is named and refused, not
    /// silently left out of the install; so is a symlink to one.
    #[test]
    fn a_fifo_or_socket_in_the_snapshot_is_named_and_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("snap");
        write(&root.join("config.json"), b"{}");
        std::fs::create_dir_all(root.join("weights")).unwrap();
        let fifo = root.join("weights/pipe.safetensors");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .expect("mkfifo runs");
        assert!(made.success(), "mkfifo {}", fifo.display());
        let err = LocalSource::open(&root, None).unwrap_err();
        assert!(matches!(err, SourceError::NotRegularFile { .. }), "{err:?}");
        assert_eq!(
            err.to_string(),
            format!(
                "local directory {}: weights/pipe.safetensors: a FIFO (named pipe), not a regular file; a snapshot may hold only regular files, folders and symlinks to them",
                fs::canonicalize(&root).unwrap().display()
            )
        );

        // A symlink to a FIFO (kept in `.cache`, which is never listed): refused by
        // the link's name.
        std::fs::create_dir_all(root.join(".cache")).unwrap();
        std::fs::rename(&fifo, root.join(".cache/pipe")).unwrap();
        symlink("../.cache/pipe", root.join("weights/link.safetensors")).unwrap();
        let err = LocalSource::open(&root, None).unwrap_err();
        assert!(
            matches!(err, SourceError::NotRegularFile { ref name, .. } if name == "weights/link.safetensors"),
            "{err:?}"
        );
        std::fs::remove_file(root.join("weights/link.safetensors")).unwrap();
        let ok = LocalSource::open(&root, None).unwrap();
        assert_eq!(ok.repo.files.len(), 1, "the FIFO in .cache is not listed");

        // A socket.
        let sock_dir = tmp.path().join("sock");
        write(&sock_dir.join("config.json"), b"{}");
        let _listener = std::os::unix::net::UnixListener::bind(sock_dir.join("s")).unwrap();
        let err = LocalSource::open(&sock_dir, None).unwrap_err();
        assert!(
            err.to_string()
                .contains(": s: a socket, not a regular file"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn traversal_and_unknown_paths_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("snap");
        write(&root.join("a.json"), b"{}");
        write(&tmp.path().join("secret"), b"secret");
        let src = LocalSource::open(&root, None).unwrap();

        for bad in ["../secret", "/etc/passwd", "a/../../secret"] {
            let err = src.read_range(bad, 0..1).await.unwrap_err();
            assert!(
                matches!(err, SourceError::UnsafePath { .. }),
                "{bad}: {err:?}"
            );
            assert!(
                err.to_string()
                    .starts_with("requested path: unsafe file name"),
                "{err}"
            );
            let err = src.read_file(bad, 100).await.unwrap_err();
            assert!(
                matches!(err, SourceError::UnsafePath { .. }),
                "{bad}: {err:?}"
            );
        }
        let err = src.read_file("b.json", 100).await.unwrap_err();
        assert_eq!(err.to_string(), "b.json: not in the snapshot of snap");

        // A symlink out of a plain directory refuses the whole directory.
        symlink(tmp.path().join("secret"), root.join("leak")).unwrap();
        let err = LocalSource::open(&root, None).unwrap_err();
        assert!(
            matches!(err, SourceError::UnsafePath { ref name, .. } if name == "leak"),
            "{err:?}"
        );
        assert!(
            err.to_string().contains("symlink resolves outside"),
            "{err}"
        );
    }

    const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
    const LFS_OID: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
    const GIT_OID: &str = "a94a8fe5ccb19ba61c4c0873d391e987982fbbd3";

    /// `models--Org--Name` with one LFS blob, one git blob, a nested file and refs/main.
    fn hf_cache(base: &Path) -> PathBuf {
        let repo = base.join("hub/models--Org--Name");
        write(&repo.join("blobs").join(LFS_OID), &pattern(300));
        write(&repo.join("blobs").join(GIT_OID), b"{\"model_type\":\"x\"}");
        write(&repo.join("refs/main"), COMMIT.as_bytes());
        let snap = repo.join("snapshots").join(COMMIT);
        fs::create_dir_all(snap.join("sub")).unwrap();
        symlink(
            Path::new("../../blobs").join(LFS_OID),
            snap.join("model.safetensors"),
        )
        .unwrap();
        symlink(
            Path::new("../../blobs").join(GIT_OID),
            snap.join("config.json"),
        )
        .unwrap();
        symlink(
            Path::new("../../../blobs").join(GIT_OID),
            snap.join("sub/copy.json"),
        )
        .unwrap();
        repo
    }

    fn summary(repo: &ResolvedRepo) -> Vec<(String, u64, Option<String>)> {
        repo.files
            .iter()
            .map(|f| (f.path.clone(), f.size, f.sha256.clone()))
            .collect()
    }

    #[tokio::test]
    async fn hf_cache_snapshot_yields_commit_repo_and_lfs_sha256() {
        let tmp = tempfile::tempdir().unwrap();
        let repo_dir = hf_cache(tmp.path());
        let snap = repo_dir.join("snapshots").join(COMMIT);

        let want = vec![
            ("config.json".to_string(), 18, None),
            (
                "model.safetensors".to_string(),
                300,
                Some(LFS_OID.to_string()),
            ),
            ("sub/copy.json".to_string(), 18, None),
        ];
        let src = LocalSource::open(&snap, None).unwrap();
        let repo = src.resolve().await.unwrap();
        assert_eq!(repo.repo, "Org/Name");
        assert_eq!(repo.commit.as_deref(), Some(COMMIT));
        assert_eq!(repo.revision, COMMIT);
        assert_eq!(summary(&repo), want);
        // A blob named by 40 hex digits gives the file's git blob id.
        assert_eq!(
            src.published_git_oid("config.json").as_deref(),
            Some(GIT_OID)
        );
        assert_eq!(src.published_git_oid("model.safetensors"), None);
        let got = src.read_range("model.safetensors", 250..300).await.unwrap();
        assert_eq!(&got[..], &pattern(300)[250..]);

        // The repo folder: refs/main picks the same snapshot.
        let src = LocalSource::open(&repo_dir, None).unwrap();
        let repo = src.resolve().await.unwrap();
        assert_eq!(repo.repo, "Org/Name");
        assert_eq!(repo.commit.as_deref(), Some(COMMIT));
        assert_eq!(repo.revision, "main");
        assert_eq!(summary(&repo), want);

        // A revision hint that names another commit is refused.
        let err = LocalSource::open(&snap, Some(&"f".repeat(40))).unwrap_err();
        assert!(
            err.to_string()
                .contains(&format!("snapshot is commit {COMMIT}")),
            "{err}"
        );
        let err = LocalSource::open(&repo_dir, Some("dev")).unwrap_err();
        assert!(err.to_string().contains("no refs/dev"), "{err}");
    }

    #[test]
    fn hf_cache_symlink_escaping_the_repo_folder_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let repo_dir = hf_cache(tmp.path());
        // A sibling repo's blob is outside `models--Org--Name`.
        let other = tmp.path().join("hub/models--Evil--X/blobs/b");
        write(&other, b"evil");
        let snap = repo_dir.join("snapshots").join(COMMIT);
        symlink(
            "../../../models--Evil--X/blobs/b",
            snap.join("tokenizer.json"),
        )
        .unwrap();
        let err = LocalSource::open(&snap, None).unwrap_err();
        assert!(
            matches!(err, SourceError::UnsafePath { ref name, .. } if name == "tokenizer.json"),
            "{err:?}"
        );
        assert!(
            err.to_string().contains("symlink resolves outside"),
            "{err}"
        );
    }
}
