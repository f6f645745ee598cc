//! Output files hashed while the stream still runs: a file is hashed as soon as the
//! last read that writes it is durable, on one thread beside the jobs, so the
//! manifest's hashing after the stream only has the files finished last.
//!
//! On a capped link the cores wait for the network, and hashing every output after
//! the last byte (the manifest's `files`, [`super::publish::finalize`]) was a stretch
//! where the link stood idle: 0.45 s of a 20 s install of the 3.4 GB benchmark
//! snapshot at `--jobs 4`. A file's bytes no longer change once its last read is
//! durable (the stream is the only writer of the output files, and the resident
//! file's head is written before it starts), so its hash then is the hash at publish.
//! The hashing is verify-install's ([`crate::verify::hash_files`]), as at publish.

use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;

/// What the hashing thread hands back: (output file index, SHA-256) of each file.
type Hashed = Vec<(usize, String)>;

/// Per output file: the reads still to come that write it, and the hashes taken.
pub(super) struct Finished {
    /// Reads of this run still to be made durable that write each output file.
    left: Vec<AtomicUsize>,
    /// Output files each read of this run writes (by read index; empty otherwise).
    files_of: Vec<Vec<usize>>,
    queue: Mutex<Option<mpsc::Sender<usize>>>,
    worker: Mutex<Option<std::thread::JoinHandle<Hashed>>>,
    /// Files written again after they may have been hashed (a shard fetched a second
    /// time in the same run): their hashes are left to publish.
    stale: Mutex<Vec<usize>>,
}

impl Finished {
    /// `files_of[read]`: the output files each read of this run writes; `staging` and
    /// `rel`: where the output files are (`rel` in output file order). Files no read of
    /// this run writes (all kept from a previous run) are left to publish.
    pub(super) fn new(files_of: Vec<Vec<usize>>, staging: PathBuf, rel: Vec<String>) -> Finished {
        let mut left = vec![0usize; rel.len()];
        for &f in files_of.iter().flatten() {
            if let Some(n) = left.get_mut(f) {
                *n += 1;
            }
        }
        let (tx, rx) = mpsc::channel::<usize>();
        let worker = std::thread::Builder::new()
            .name("gturbo-hash-finished".into())
            .spawn(move || {
                let mut hashed = Vec::new();
                for f in rx {
                    let Some(r) = rel.get(f) else { continue };
                    // A failure here is left to publish, which hashes the file again
                    // and reports it.
                    if let Some(Ok((sha, _))) =
                        crate::verify::hash_files(&staging, &[r.as_str()], 1, None).pop()
                    {
                        hashed.push((f, sha));
                    }
                }
                hashed
            })
            .ok();
        Finished {
            left: left.into_iter().map(AtomicUsize::new).collect(),
            files_of,
            queue: Mutex::new(worker.as_ref().map(|_| tx)),
            worker: Mutex::new(worker),
            stale: Mutex::new(Vec::new()),
        }
    }

    /// `files` are about to be written again (a shard fetched a second time): any hash
    /// taken of them, or to come, is dropped and publish hashes them instead.
    pub(super) fn forget(&self, files: impl IntoIterator<Item = usize>) {
        self.stale
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(files);
    }

    /// Read `ri` is durable: queue each file it finished for hashing.
    pub(super) fn read_durable(&self, ri: usize) {
        let Some(files) = self.files_of.get(ri) else {
            return;
        };
        for &f in files {
            let Some(n) = self.left.get(f) else { continue };
            if n.fetch_sub(1, Ordering::AcqRel) == 1
                && let Some(q) = self
                    .queue
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .as_ref()
            {
                let _ = q.send(f);
            }
        }
    }

    /// Wait for the queued hashes: the SHA-256 of each output file hashed, by output
    /// file index (`None`: publish hashes it).
    pub(super) fn take(&self) -> Vec<Option<String>> {
        drop(self.queue.lock().unwrap_or_else(|p| p.into_inner()).take());
        let mut out = vec![None; self.left.len()];
        let worker = self.worker.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(Ok(hashed)) = worker.map(|w| w.join()) {
            // A file is queued once, when its count of reads still to come reaches 0.
            let stale = self.stale.lock().unwrap_or_else(|p| p.into_inner());
            for (f, sha) in hashed {
                if !stale.contains(&f) {
                    out[f] = Some(sha);
                }
            }
        }
        out
    }
}

impl Drop for Finished {
    fn drop(&mut self) {
        // An install that fails ends the worker too (it finishes the file at hand).
        drop(
            self.queue
                .get_mut()
                .unwrap_or_else(|p| p.into_inner())
                .take(),
        );
    }
}
