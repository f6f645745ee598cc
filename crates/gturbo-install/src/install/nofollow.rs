//! The paths an install creates beside the output (`<out>.partial/`, `.partial.lock`,
//! `.partial.journal`) and inside its staging directory are opened without following
//! a link, so a link planted there can never make gturbo write, truncate or publish
//! outside the output.
//!
//! # The rule
//! - Every open is `O_NOFOLLOW`: a link at the last component fails to open (it is
//!   refused naming the path, [`InstallError::Planted`]) instead of being followed. The
//!   open is also `O_NONBLOCK`, so a FIFO planted there cannot block it, and what was
//!   opened must be a regular file.
//! - A file that each run writes anew (the journal when it starts over, the copied
//!   tokenizer files, the manifest, the receipt) is unlinked first (unlinking never
//!   follows a link) and created with `O_EXCL`; a link at its place is refused, not
//!   replaced, so a planted link is always reported.
//! - A directory gturbo makes is created when absent, and refused when a link or
//!   anything but a directory stands at its place. Checked component by component
//!   below the staging directory.

use std::fs::{File, FileType, OpenOptions};
use std::io;
use std::path::Path;

use super::{InstallError, io_err};

/// The refusal of `path`, where `what` stands (`a symbolic link`, …).
pub(super) fn planted(path: &Path, what: &str) -> InstallError {
    InstallError::Planted {
        path: path.display().to_string(),
        what: what.to_string(),
    }
}

/// What stands at `path` without following a link: `None` when nothing does.
pub(super) fn kind(path: &Path) -> Result<Option<FileType>, InstallError> {
    match std::fs::symlink_metadata(path) {
        Ok(m) => Ok(Some(m.file_type())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err(path, e)),
    }
}

/// Words for a non-regular file type in a refusal.
fn describe(t: FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
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

/// Open `path` with `options` plus `O_NOFOLLOW | O_NONBLOCK`; a link there is refused,
/// and so is anything but a regular file.
pub(super) fn open(path: &Path, options: &mut OpenOptions) -> Result<File, InstallError> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = options
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) {
                planted(path, "a symbolic link")
            } else {
                io_err(path, e)
            }
        })?;
    let t = file.metadata().map_err(|e| io_err(path, e))?.file_type();
    if !t.is_file() {
        return Err(planted(path, describe(t)));
    }
    Ok(file)
}

/// Open an existing regular file for reading.
pub(super) fn open_read(path: &Path) -> Result<File, InstallError> {
    open(path, OpenOptions::new().read(true))
}

/// Open (creating it when absent) a regular file for reading and writing, never
/// truncating it.
pub(super) fn open_rw(path: &Path) -> Result<File, InstallError> {
    open(
        path,
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false),
    )
}

/// A new, empty file at `path`: a file an earlier run left there is unlinked, a link or
/// anything else is refused, then the file is created with `O_EXCL`.
pub(super) fn create_fresh(path: &Path) -> Result<File, InstallError> {
    match kind(path)? {
        None => {}
        Some(t) if t.is_file() => std::fs::remove_file(path).map_err(|e| io_err(path, e))?,
        Some(t) => return Err(planted(path, describe(t))),
    }
    open(
        path,
        OpenOptions::new().read(true).write(true).create_new(true),
    )
}

/// Make sure `path` is a directory gturbo may write into: created when absent, refused
/// when a link or anything else stands there.
pub(super) fn ensure_dir(path: &Path) -> Result<(), InstallError> {
    match kind(path)? {
        Some(t) if t.is_dir() => Ok(()),
        Some(t) => Err(planted(path, describe(t))),
        None => match std::fs::create_dir(path) {
            Ok(()) => Ok(()),
            // Created by someone else meanwhile: check what it is.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => match kind(path)? {
                Some(t) if t.is_dir() => Ok(()),
                Some(t) => Err(planted(path, describe(t))),
                None => Err(io_err(path, e)),
            },
            Err(e) => Err(io_err(path, e)),
        },
    }
}

/// [`ensure_dir`] for every directory from `root` (itself included) down to `dir`,
/// which lies below `root`.
pub(super) fn ensure_dirs(root: &Path, dir: &Path) -> Result<(), InstallError> {
    ensure_dir(root)?;
    let rel = dir.strip_prefix(root).map_err(|_| {
        InstallError::Internal(format!("{} is outside {}", dir.display(), root.display()))
    })?;
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
    fn links_are_refused_naming_the_path_and_their_targets_are_untouched() {
        let tmp = tempfile::tempdir().unwrap();
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let link = tmp.path().join("x.partial.lock");
        symlink(&victim, &link).unwrap();
        for e in [
            open_rw(&link).err().unwrap(),
            open_read(&link).err().unwrap(),
            create_fresh(&link).err().unwrap(),
            ensure_dir(&link).err().unwrap(),
        ] {
            assert!(
                e.to_string()
                    .starts_with(&format!("{}: a symbolic link", link.display())),
                "{e}"
            );
        }
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        // A dangling link: its target is not created.
        let dangling = tmp.path().join("j");
        symlink(tmp.path().join("nowhere"), &dangling).unwrap();
        assert!(create_fresh(&dangling).is_err() && open_rw(&dangling).is_err());
        assert!(!tmp.path().join("nowhere").exists());
    }

    #[test]
    fn fresh_files_replace_an_earlier_file_and_dirs_are_made_below_the_root() {
        let tmp = tempfile::tempdir().unwrap();
        let f = tmp.path().join("m");
        std::fs::write(&f, b"old").unwrap();
        create_fresh(&f).unwrap().write_all(b"new").unwrap();
        assert_eq!(std::fs::read(&f).unwrap(), b"new");
        let root = tmp.path().join("s");
        ensure_dirs(&root, &root.join("a/b")).unwrap();
        assert!(root.join("a/b").is_dir());
        // A link in the middle of the path is refused.
        symlink(tmp.path(), root.join("c")).unwrap();
        let e = ensure_dirs(&root, &root.join("c/d")).err().unwrap();
        assert!(e.to_string().contains("/s/c: a symbolic link"), "{e}");
        assert!(!tmp.path().join("d").exists());
        // A FIFO is refused without blocking.
        let fifo = tmp.path().join("fifo");
        assert!(
            std::process::Command::new("mkfifo")
                .arg(&fifo)
                .status()
                .unwrap()
                .success()
        );
        let e = open_rw(&fifo).err().unwrap();
        assert!(e.to_string().contains("a FIFO (named pipe)"), "{e}");
    }
}
