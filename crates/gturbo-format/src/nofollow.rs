//! Opens on a hostile filesystem: a path is opened, looked at and created without
//! ever following a link at its last component, so a link planted there can never
//! make gturbo read, write, truncate or publish somewhere else. The installer (its
//! staging directory and the files beside the output), [`crate::check::open_inside`]
//! (a listed file of an install) and the local source (a snapshot's files) use these;
//! each words its own refusals.
//!
//! # The rule
//! - Every open is `O_NOFOLLOW`: a link at the last component fails to open instead of
//!   being followed. The open is also `O_NONBLOCK`, so a FIFO planted there cannot
//!   block it; [`open_regular`] also refuses what is not a regular file once opened.
//! - A file that each run writes anew is unlinked first (unlinking never follows a
//!   link) and created with `O_EXCL` ([`create_fresh`]); a link at its place is
//!   refused, not replaced, so a planted link is always reported.
//! - A directory gturbo makes is created when absent, and refused when a link or
//!   anything but a directory stands at its place ([`ensure_dir`]), component by
//!   component below a root ([`ensure_dirs`]).
//!
//! Unix only, like the install lock ([`crate::lock`]).

use std::fs::{File, FileType, Metadata, OpenOptions};
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Why a path was not opened, looked at or made.
#[derive(Debug, thiserror::Error)]
pub enum NoFollowError {
    /// Something other than what was asked for stands at `path`: a link, or another
    /// file type where a regular file or a directory was expected.
    #[error("{}: {what}", path.display())]
    Planted {
        /// The path.
        path: PathBuf,
        /// What stands there, in words ([`describe`]).
        what: &'static str,
    },
    /// The filesystem's own error at `path`.
    #[error("{}: {source}", path.display())]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

impl NoFollowError {
    fn io(path: &Path, source: io::Error) -> NoFollowError {
        NoFollowError::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    fn planted(path: &Path, t: FileType) -> NoFollowError {
        NoFollowError::Planted {
            path: path.to_path_buf(),
            what: describe(t),
        }
    }
}

/// Open `path` with `options` plus `O_NOFOLLOW | O_NONBLOCK`: a link at the last
/// component fails (`ELOOP`) instead of being followed, and a FIFO cannot block the
/// open. What was opened is not checked: see [`open_regular`].
pub fn open(path: &Path, options: &mut OpenOptions) -> io::Result<File> {
    options
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
}

/// [`open`], refusing a link (as [`NoFollowError::Planted`] `a symbolic link`) and
/// anything that is not a regular file once opened.
pub fn open_regular(path: &Path, options: &mut OpenOptions) -> Result<File, NoFollowError> {
    let file = open(path, options).map_err(|e| {
        if e.raw_os_error() == Some(libc::ELOOP) {
            NoFollowError::Planted {
                path: path.to_path_buf(),
                what: "a symbolic link",
            }
        } else {
            NoFollowError::io(path, e)
        }
    })?;
    let t = file
        .metadata()
        .map_err(|e| NoFollowError::io(path, e))?
        .file_type();
    if !t.is_file() {
        return Err(NoFollowError::planted(path, t));
    }
    Ok(file)
}

/// The metadata of what stands at `path`, without following a link: `None` when
/// nothing does.
pub fn lstat(path: &Path) -> io::Result<Option<Metadata>> {
    match std::fs::symlink_metadata(path) {
        Ok(m) => Ok(Some(m)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// What stands at `path` without following a link: `None` when nothing does.
pub fn kind(path: &Path) -> io::Result<Option<FileType>> {
    Ok(lstat(path)?.map(|m| m.file_type()))
}

/// Whether `b` (of a file just opened) is the regular file `a` (looked at before the
/// open) described: an entry swapped between the look and the open is not.
pub fn same_file(a: &Metadata, b: &Metadata) -> bool {
    a.dev() == b.dev() && a.ino() == b.ino() && b.is_file()
}

/// Words for a file type that is not a regular file, in a refusal.
pub fn describe(t: FileType) -> &'static str {
    if t.is_symlink() {
        "a symbolic link"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO (named pipe)"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_block_device() || t.is_char_device() {
        "a device"
    } else {
        "not a regular file"
    }
}

/// A new, empty file at `path`, open for reading and writing: a regular file an
/// earlier run left there is unlinked, a link or anything else is refused, then the
/// file is created with `O_EXCL`.
pub fn create_fresh(path: &Path) -> Result<File, NoFollowError> {
    match kind(path).map_err(|e| NoFollowError::io(path, e))? {
        None => {}
        Some(t) if t.is_file() => {
            std::fs::remove_file(path).map_err(|e| NoFollowError::io(path, e))?
        }
        Some(t) => return Err(NoFollowError::planted(path, t)),
    }
    open_regular(
        path,
        OpenOptions::new().read(true).write(true).create_new(true),
    )
}

/// Make sure `path` is a directory: created when absent, refused when a link or
/// anything else stands there.
pub fn ensure_dir(path: &Path) -> Result<(), NoFollowError> {
    let kind = |p: &Path| kind(p).map_err(|e| NoFollowError::io(p, e));
    match kind(path)? {
        Some(t) if t.is_dir() => Ok(()),
        Some(t) => Err(NoFollowError::planted(path, t)),
        None => match std::fs::create_dir(path) {
            Ok(()) => Ok(()),
            // Created by someone else meanwhile: check what it is.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => match kind(path)? {
                Some(t) if t.is_dir() => Ok(()),
                Some(t) => Err(NoFollowError::planted(path, t)),
                None => Err(NoFollowError::io(path, e)),
            },
            Err(e) => Err(NoFollowError::io(path, e)),
        },
    }
}

/// [`ensure_dir`] for `root` and every directory from it down to `root/rel`, one
/// component at a time.
pub fn ensure_dirs(root: &Path, rel: &Path) -> Result<(), NoFollowError> {
    ensure_dir(root)?;
    let mut at = root.to_path_buf();
    for c in rel.components() {
        at.push(c);
        ensure_dir(&at)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::symlink;

    #[test]
    fn links_are_never_followed_and_their_targets_are_untouched() {
        let tmp = tempfile::tempdir().unwrap();
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let link = tmp.path().join("l");
        symlink(&victim, &link).unwrap();
        let e = open(&link, OpenOptions::new().read(true)).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ELOOP));
        for e in [
            open_regular(&link, OpenOptions::new().read(true).write(true))
                .err()
                .unwrap(),
            create_fresh(&link).err().unwrap(),
            ensure_dir(&link).err().unwrap(),
        ] {
            assert_eq!(
                e.to_string(),
                format!("{}: a symbolic link", link.display())
            );
        }
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert!(kind(&link).unwrap().unwrap().is_symlink());
        assert!(kind(&tmp.path().join("none")).unwrap().is_none());
    }

    #[test]
    fn fresh_files_dirs_below_a_root_and_the_same_file() {
        let tmp = tempfile::tempdir().unwrap();
        let f = tmp.path().join("m");
        std::fs::write(&f, b"old").unwrap();
        create_fresh(&f).unwrap().write_all(b"new").unwrap();
        assert_eq!(std::fs::read(&f).unwrap(), b"new");
        let after = open(&f, OpenOptions::new().read(true)).unwrap();
        assert!(same_file(
            &lstat(&f).unwrap().unwrap(),
            &after.metadata().unwrap()
        ));
        // A directory opened where the file was looked at is not the same file.
        let d = std::fs::File::open(tmp.path()).unwrap();
        assert!(!same_file(
            &lstat(tmp.path()).unwrap().unwrap(),
            &d.metadata().unwrap()
        ));
        let root = tmp.path().join("s");
        ensure_dirs(&root, Path::new("a/b")).unwrap();
        assert!(root.join("a/b").is_dir());
        symlink(tmp.path(), root.join("c")).unwrap();
        let e = ensure_dirs(&root, Path::new("c/d")).unwrap_err();
        assert!(e.to_string().ends_with("/s/c: a symbolic link"), "{e}");
        assert!(!tmp.path().join("d").exists());
    }
}
