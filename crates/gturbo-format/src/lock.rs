//! The lock of a published `.gturbo` directory: a published install is never changed
//! under a process that has it open.
//!
//! # The rule
//! - Readers — `gturbo run` and `gturbo eval` (through the runtime's `runtime::load::open`)
//!   and `gturbo verify-install` — hold a **shared** `flock(2)` on the directory itself
//!   for as long as they use it. Many readers may hold it at once. The two that
//!   write into an install, `verify-install` (the receipt) and `eval --record`
//!   (`quality.json` and the receipt), do so under that shared lock, by renaming new
//!   files into place: readers never see a half-written file, and no overwrite can
//!   start in between.
//! - The one writer that replaces a published directory, `gturbo install --overwrite`,
//!   takes it **exclusively** before it changes anything (before the staging directory
//!   or the journal is touched) and holds it until the new directory is in place.
//! - Neither side waits: a writer finding a reader refuses at once (exit 2) naming the
//!   directory, and so does a reader finding a writer. Nothing is lost by refusing: the
//!   install has not started, and the run has not mapped anything.
//! - Independently of the lock, a published file is never truncated or written in
//!   place: an overwrite renames the old directory aside and the new one into place,
//!   and `verify-install` replaces the receipt by renaming a new file over it. A file
//!   mapped by a process that does not take the lock (an older gturbo, another tool)
//!   keeps its old inode and bytes, so a memory map of it can never fault (SIGBUS)
//!   because of gturbo.
//!
//! The lock is a `flock(2)` on the directory itself, opened read-only (which Linux and
//! macOS allow for directories, on read-only filesystems too). It belongs to the inode,
//! not the path: after an overwrite's renames the path names a new, unlocked directory.
//! A reader checks after locking that the path
//! still names the inode it locked, so it cannot end up holding the lock of a directory
//! that an overwrite renamed aside between its open and its lock.

use std::fs::{File, TryLockError};
use std::io;
use std::path::Path;

/// A held lock on an install directory; released on drop.
#[derive(Debug)]
pub struct InstallLock {
    _dir: File,
}

/// What the error of a refused reader says (the caller names the directory).
pub const BEING_REPLACED: &str = "being replaced by `gturbo install --overwrite`, which holds \
     the install's lock; run this again once that install has finished";

/// What the error of a refused writer says (the caller names the directory).
pub const IN_USE: &str = "in use: a `gturbo run`, `gturbo eval` or `gturbo verify-install` \
     holds the install's shared lock";

/// Attempts at locking the inode the path names, when an overwrite swaps the
/// directory between the open and the lock.
const ATTEMPTS: usize = 4;

impl InstallLock {
    /// Take the shared (reader) lock on `dir`, refusing at once with an error of kind
    /// `WouldBlock` ([`BEING_REPLACED`]) while an overwrite holds it.
    pub fn shared(dir: &Path) -> io::Result<InstallLock> {
        for _ in 0..ATTEMPTS {
            let f = File::open(dir)?;
            match f.try_lock_shared() {
                Ok(()) => {}
                Err(TryLockError::WouldBlock) => {
                    return Err(io::Error::new(io::ErrorKind::WouldBlock, BEING_REPLACED));
                }
                Err(TryLockError::Error(e)) => return Err(e),
            }
            if same_inode(&f, dir)? {
                return Ok(InstallLock { _dir: f });
            }
        }
        Err(io::Error::new(io::ErrorKind::WouldBlock, BEING_REPLACED))
    }

    /// Take the exclusive (writer) lock on `dir`, refusing at once with an error of
    /// kind `WouldBlock` ([`IN_USE`]) while any reader holds it.
    pub fn exclusive(dir: &Path) -> io::Result<InstallLock> {
        let f = File::open(dir)?;
        match f.try_lock() {
            Ok(()) => Ok(InstallLock { _dir: f }),
            Err(TryLockError::WouldBlock) => Err(io::Error::new(io::ErrorKind::WouldBlock, IN_USE)),
            Err(TryLockError::Error(e)) => Err(e),
        }
    }
}

/// Whether `path` still names the file `f` has open.
fn same_inode(f: &File, path: &Path) -> io::Result<bool> {
    use std::os::unix::fs::MetadataExt;
    let (a, b) = (f.metadata()?, std::fs::metadata(path)?);
    Ok(a.dev() == b.dev() && a.ino() == b.ino())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readers_share_and_exclude_the_writer_and_the_writer_excludes_readers() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("x.gturbo");
        std::fs::create_dir(&dir).unwrap();
        let r1 = InstallLock::shared(&dir).unwrap();
        let r2 = InstallLock::shared(&dir).unwrap();
        let e = InstallLock::exclusive(&dir).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        assert_eq!(e.to_string(), IN_USE);
        drop(r1);
        assert!(InstallLock::exclusive(&dir).is_err(), "r2 still reads");
        drop(r2);
        let w = InstallLock::exclusive(&dir).unwrap();
        let e = InstallLock::shared(&dir).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        assert_eq!(e.to_string(), BEING_REPLACED);
        // The writer renames the old directory aside and a new one into place: the
        // path then names another inode, which a reader may lock at once.
        std::fs::rename(&dir, tmp.path().join("old")).unwrap();
        std::fs::create_dir(&dir).unwrap();
        let r = InstallLock::shared(&dir).unwrap();
        drop(w);
        drop(r);
    }

    #[test]
    fn a_missing_directory_is_an_io_error() {
        let tmp = tempfile::tempdir().unwrap();
        let e = InstallLock::shared(&tmp.path().join("none")).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }
}
