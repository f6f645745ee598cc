//! The one file hasher of gturbo: the SHA-256 of each listed file, in parallel, each
//! streamed in [`CHUNK`] pieces (verify-install and the installer's finalize step both
//! use it).

use std::io::{self, Read};
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use sha2::{Digest, Sha256};

use crate::format::check::{VerifyFailure, open_inside};

/// Bytes read and hashed at a time by each hashing thread: memory stays
/// `threads × CHUNK` whatever the file sizes. Small enough that the kernel's copy and
/// the hash both stay in the core's L2: on the 2-core EPYC CI host page-cache reads
/// run at 4.5 GB/s with 64–128 KiB buffers and 1 GB/s with 256 KiB or more.
pub const CHUNK: usize = 128 << 10;
/// Hooks a caller can use to show progress of a full verify.
pub trait VerifyProgress: Sync {
    /// Hashing starts: `files` files of `bytes` bytes in all.
    fn start(&self, _files: u64, _bytes: u64) {}
    /// `bytes` more bytes were hashed (called from the hashing threads).
    fn hashed(&self, _bytes: u64) {}
}

/// A file's SHA-256 (lowercase hex) and length as read.
pub type HashResult = Result<(String, u64), VerifyFailure>;

/// The SHA-256 and length of each file `dir/rel`, in `files` order: the one file
/// hasher of gturbo (verify-install and the installer's finalize step both use it).
///
/// `threads` threads (0: the available cores) each take the next file from a shared
/// counter and stream it in [`CHUNK`] pieces, so memory is `threads × CHUNK` whatever
/// the sizes; list big files first for the threads to finish together. Each path is
/// opened with [`open_inside`] (no link followed); a file that cannot be opened or
/// read is an `Err` naming it and the byte offset.
pub fn hash_files(
    dir: &Path,
    files: &[&str],
    threads: usize,
    progress: Option<&dyn VerifyProgress>,
) -> Vec<HashResult> {
    let threads = if threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        threads
    };
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<HashResult>>> = Mutex::new(vec![None; files.len()]);
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, files.len().max(1)) {
            s.spawn(|| {
                let mut buf = vec![0u8; CHUNK];
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(f) = files.get(i) else { break };
                    let r = hash_one(dir, f, &mut buf, progress);
                    results.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(r);
                }
            });
        }
    });
    results
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(VerifyFailure::new("", "", "not hashed"))))
        .collect()
}

/// One file's SHA-256 and length, streamed through `buf`.
fn hash_one(
    dir: &Path,
    rel: &str,
    buf: &mut [u8],
    progress: Option<&dyn VerifyProgress>,
) -> HashResult {
    let (mut file, _) = open_inside(dir, rel)?;
    let mut h = Sha256::new();
    let mut len = 0u64;
    loop {
        let n = match file.read(buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(VerifyFailure::new(
                    rel,
                    format!("byte {len}"),
                    format!("read failed: {e}"),
                ));
            }
        };
        h.update(&buf[..n]);
        len += n as u64;
        if let Some(p) = progress {
            p.hashed(n as u64);
        }
    }
    Ok((hex::encode(h.finalize()), len))
}
