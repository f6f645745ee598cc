//! The paths an install creates beside the output (`<out>.partial/`, `.partial.lock`,
//! `.partial.journal`) and inside its staging directory are opened without following
//! a link, so a link planted there can never make gturbo write, truncate or publish
//! outside the output. The opens are [`crate::format::nofollow`]'s; this file words
//! their refusals as the installer's errors.
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
use std::path::Path;

use crate::format::nofollow::{self, NoFollowError};

use super::{InstallError, io_err};

/// The refusal of `path`, where `what` stands (`a symbolic link`, …).
pub(super) fn planted(path: &Path, what: &str) -> InstallError {
    InstallError::Planted {
        path: path.display().to_string(),
        what: what.to_string(),
    }
}

/// The installer's words for a refusal of the shared opens.
fn refused(e: NoFollowError) -> InstallError {
    match e {
        NoFollowError::Planted { path, what } => planted(&path, what),
        NoFollowError::Io { path, source } => io_err(&path, source),
    }
}

/// What stands at `path` without following a link: `None` when nothing does.
pub(super) fn kind(path: &Path) -> Result<Option<FileType>, InstallError> {
    nofollow::kind(path).map_err(|e| io_err(path, e))
}

/// Open `path` with `options` plus `O_NOFOLLOW | O_NONBLOCK`; a link there is refused,
/// and so is anything but a regular file.
pub(super) fn open(path: &Path, options: &mut OpenOptions) -> Result<File, InstallError> {
    nofollow::open_regular(path, options).map_err(refused)
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
    nofollow::create_fresh(path).map_err(refused)
}

/// Make sure `path` is a directory gturbo may write into: created when absent, refused
/// when a link or anything else stands there.
pub(super) fn ensure_dir(path: &Path) -> Result<(), InstallError> {
    nofollow::ensure_dir(path).map_err(refused)
}

/// [`ensure_dir`] for every directory from `root` (itself included) down to `dir`,
/// which lies below `root`.
pub(super) fn ensure_dirs(root: &Path, dir: &Path) -> Result<(), InstallError> {
    let rel = dir.strip_prefix(root).map_err(|_| {
        InstallError::Internal(format!("{} is outside {}", dir.display(), root.display()))
    })?;
    nofollow::ensure_dirs(root, rel).map_err(refused)
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
