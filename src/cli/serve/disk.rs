//! `gturbo serve --cache-dir DIR`: prefix snapshots kept across restarts.
//!
//! Each snapshot is one file, `<install>-<prefix>.snap` (the first 16 hex digits of
//! the install identity, 32 of the token prefix's SHA-256), written to a temporary
//! name and renamed into place, so a reader never sees half a file:
//!
//! | bytes | what |
//! |---|---|
//! | 8 | [`MAGIC`] |
//! | 4 | [`FORMAT_VERSION`], u32 LE |
//! | 32 | the install identity: SHA-256 of the manifest's bytes and the backend's name |
//! | 8 | token count `n`, u64 LE |
//! | 8 | state length `m`, u64 LE |
//! | 32 | SHA-256 of the tokens and the state bytes |
//! | 4n | the token prefix, u32 LE |
//! | m | the session state ([`SessionData::to_bytes`]) |
//!
//! The identity binds a snapshot to one install on one backend (the kernels of
//! another backend round differently, and a server promises the uncached tokens).
//! On start every file of this install is read back and checked: its length, magic,
//! version, identity and digest, then the state against the model's geometry. A file
//! that fails is reported on stderr and deleted; files of other installs are left
//! alone (another server may own them). The set on disk is held under `--cache-bytes`
//! by deleting the least recently used (by modification time; a restore touches its
//! file). Writing happens on a thread of its own so that a request never waits for
//! the disk.

use std::path::{Path, PathBuf};
use std::sync::mpsc::{Sender, channel};
use std::time::SystemTime;

use sha2::{Digest as _, Sha256};

use crate::runtime::models::state::SessionData;
use crate::runtime::models::{Model, Session};

/// The first bytes of a snapshot file.
pub const MAGIC: &[u8; 8] = b"GTSNAP\r\n";
/// The layout version; a file of another version is not read.
pub const FORMAT_VERSION: u32 = 1;
/// The file name's extension.
const EXT: &str = "snap";
/// Header bytes before the tokens.
const HEADER: usize = 8 + 4 + 32 + 8 + 8 + 32;

/// What binds a snapshot to an install on a backend.
pub type Identity = [u8; 32];

/// The identity of the install whose manifest is `manifest` on `backend`.
pub fn identity(manifest: &[u8], backend: &str) -> Identity {
    let mut h = Sha256::new();
    h.update(b"gturbo serve snapshot\0");
    h.update((manifest.len() as u64).to_le_bytes());
    h.update(manifest);
    h.update(backend.as_bytes());
    h.finalize().into()
}

fn digest(tokens: &[u8], state: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(tokens);
    h.update(state);
    h.finalize().into()
}

fn token_bytes(tokens: &[u32]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

/// A snapshot file's bytes.
pub fn encode(id: &Identity, tokens: &[u32], state: &SessionData) -> Vec<u8> {
    let (t, s) = (token_bytes(tokens), state.to_bytes());
    let mut out = Vec::with_capacity(HEADER + t.len() + s.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(id);
    out.extend_from_slice(&(tokens.len() as u64).to_le_bytes());
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(&digest(&t, &s));
    out.extend_from_slice(&t);
    out.extend_from_slice(&s);
    out
}

/// The token prefix and state of a snapshot file's `bytes`, or why they are not a
/// sound snapshot of install `id`.
pub fn decode(id: &Identity, bytes: &[u8]) -> Result<(Vec<u32>, SessionData), String> {
    if bytes.len() < HEADER {
        return Err(format!("{} bytes, shorter than the header", bytes.len()));
    }
    if &bytes[..8] != MAGIC {
        return Err("not a gturbo snapshot (magic)".into());
    }
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap_or_default());
    let version = u32::from_le_bytes(bytes[8..12].try_into().unwrap_or_default());
    if version != FORMAT_VERSION {
        return Err(format!(
            "format version {version}, this gturbo reads {FORMAT_VERSION}"
        ));
    }
    if bytes[12..44] != id[..] {
        return Err("written for another install or backend".into());
    }
    let (n, m) = (u64_at(44), u64_at(52));
    let expected = usize::try_from(n)
        .ok()
        .and_then(|n| n.checked_mul(4))
        .and_then(|t| usize::try_from(m).ok().and_then(|m| t.checked_add(m)))
        .and_then(|b| b.checked_add(HEADER));
    if expected != Some(bytes.len()) {
        return Err(format!(
            "{} bytes where the header says {n} tokens and {m} state bytes",
            bytes.len()
        ));
    }
    let split = HEADER + n as usize * 4;
    let (t, s) = (&bytes[HEADER..split], &bytes[split..]);
    if digest(t, s)[..] != bytes[60..92] {
        return Err("the digest does not match the contents".into());
    }
    let tokens: Vec<u32> = t
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let state = SessionData::from_bytes(s).map_err(|e| e.to_string())?;
    if tokens.is_empty() || state.pos != tokens.len() {
        return Err(format!(
            "{} tokens for a state at position {}",
            tokens.len(),
            state.pos
        ));
    }
    Ok((tokens, state))
}

/// What the writer thread does.
enum Order {
    Save(Vec<u32>, SessionData),
    Touch(Vec<u32>),
}

/// The snapshot directory of one install: its files are found by their name's prefix.
#[derive(Clone)]
struct Files {
    dir: PathBuf,
    id: Identity,
    cap: u64,
}

impl Files {
    fn prefix(&self) -> String {
        hex::encode(&self.id[..8])
    }

    fn path(&self, tokens: &[u32]) -> PathBuf {
        let h: [u8; 32] = Sha256::digest(token_bytes(tokens)).into();
        self.dir
            .join(format!("{}-{}.{EXT}", self.prefix(), hex::encode(&h[..16])))
    }

    /// This install's snapshot files with their modification time and size, oldest
    /// first.
    fn list(&self) -> Vec<(PathBuf, SystemTime, u64)> {
        let prefix = format!("{}-", self.prefix());
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut out: Vec<_> = rd
            .flatten()
            .filter(|e| {
                let name = e.file_name();
                let name = name.to_string_lossy();
                name.starts_with(&prefix) && name.ends_with(&format!(".{EXT}"))
            })
            .filter_map(|e| {
                let md = e.metadata().ok().filter(|m| m.is_file())?;
                Some((e.path(), md.modified().ok()?, md.len()))
            })
            .collect();
        out.sort_by_key(|(_, t, _)| *t);
        out
    }

    /// Delete this install's half-written files (a server killed while writing).
    fn remove_partial(&self) {
        let prefix = format!("{}-", self.prefix());
        for e in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            let ext = name.rsplit_once('.').map_or("", |(_, x)| x);
            if name.starts_with(&prefix) && ext.starts_with("tmp") {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }

    /// Delete the oldest files until the rest fit the bound.
    fn prune(&self) {
        let files = self.list();
        let mut total: u64 = files.iter().map(|(_, _, n)| n).sum();
        for (path, _, n) in files {
            if total <= self.cap {
                break;
            }
            if std::fs::remove_file(&path).is_ok() {
                total -= n;
            }
        }
    }

    fn save(&self, tokens: &[u32], state: &SessionData) -> std::io::Result<()> {
        let bytes = encode(&self.id, tokens, state);
        if bytes.len() as u64 > self.cap {
            return Ok(()); // larger than the whole bound: kept in memory only
        }
        let path = self.path(tokens);
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, &bytes)?;
        std::fs::rename(&tmp, &path).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })?;
        self.prune();
        Ok(())
    }

    fn touch(&self, tokens: &[u32]) {
        if let Ok(f) = std::fs::File::options().write(true).open(self.path(tokens)) {
            let _ = f.set_modified(SystemTime::now());
        }
    }
}

/// The snapshots of one install kept in a directory.
pub struct DiskCache {
    files: Files,
    orders: Sender<Order>,
}

impl DiskCache {
    /// The cache in `dir` (made if missing) for install `id`, at most `cap` bytes of
    /// files; its writer thread runs until the cache is dropped.
    pub fn open(dir: &Path, id: Identity, cap: u64) -> Result<DiskCache, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("--cache-dir {}: {e}", dir.display()))?;
        let files = Files {
            dir: dir.to_path_buf(),
            id,
            cap,
        };
        let (orders, rx) = channel::<Order>();
        let writer = files.clone();
        std::thread::Builder::new()
            .name("gturbo-serve-disk".into())
            .spawn(move || {
                for order in rx {
                    match order {
                        Order::Save(tokens, state) => {
                            if let Err(e) = writer.save(&tokens, &state) {
                                eprintln!(
                                    "warning: --cache-dir {}: a snapshot was not written: {e}",
                                    writer.dir.display()
                                );
                            }
                        }
                        Order::Touch(tokens) => writer.touch(&tokens),
                    }
                }
            })
            .map_err(|e| format!("cannot start the snapshot writer: {e}"))?;
        Ok(DiskCache { files, orders })
    }

    /// Every sound snapshot of this install, oldest first, restored on `model`; each
    /// file that is not one is reported on stderr and deleted.
    pub fn load(&self, model: &dyn Model) -> Vec<(Vec<u32>, Session)> {
        self.files.remove_partial();
        let mut out = Vec::new();
        for (path, _, len) in self.files.list() {
            let read = if len > self.files.cap {
                Err(format!("{len} bytes, more than --cache-bytes"))
            } else {
                std::fs::read(&path)
                    .map_err(|e| e.to_string())
                    .and_then(|b| decode(&self.files.id, &b))
                    .and_then(|(tokens, state)| {
                        let s = model.import_session(&state).map_err(|e| e.to_string())?;
                        Ok((tokens, s))
                    })
            };
            match read {
                Ok(t) => out.push(t),
                Err(e) => {
                    eprintln!(
                        "warning: {}: ignored and deleted, not a sound snapshot of this install: {e}",
                        path.display()
                    );
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        out
    }

    /// Write the snapshot of `tokens` (in the background).
    pub fn save(&self, tokens: &[u32], state: SessionData) {
        let _ = self.orders.send(Order::Save(tokens.to_vec(), state));
    }

    /// Mark the snapshot of `tokens` as just used.
    pub fn touch(&self, tokens: &[u32]) {
        let _ = self.orders.send(Order::Touch(tokens.to_vec()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::models::state::Part;

    fn state(n: usize) -> SessionData {
        SessionData {
            pos: n,
            parts: vec![Part::F32(vec![0.5; 3 * n]), Part::I64(vec![7])],
        }
    }

    #[test]
    fn a_snapshot_file_round_trips_and_any_damage_is_refused() {
        let id = identity(b"{\"format\":\"gturbo\"}", "cpu");
        let tokens = [5u32, 6, 7];
        let bytes = encode(&id, &tokens, &state(3));
        assert_eq!(decode(&id, &bytes).unwrap(), (tokens.to_vec(), state(3)));
        // Every truncation, every flipped byte, another install or backend.
        for n in 0..bytes.len() {
            assert!(decode(&id, &bytes[..n]).is_err(), "{n} bytes");
        }
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x40;
            assert!(decode(&id, &b).is_err(), "byte {i} flipped");
        }
        let other = identity(b"{\"format\":\"gturbo\"}", "gpu");
        assert!(
            decode(&other, &bytes)
                .unwrap_err()
                .contains("another install")
        );
        // Another version is named as such.
        let mut v = bytes.clone();
        v[8] = 2;
        assert!(decode(&id, &v).unwrap_err().contains("format version 2"));
        // Tokens that do not match the state's position.
        let odd = encode(&id, &tokens, &state(2));
        assert!(decode(&id, &odd).is_err());
    }

    #[test]
    fn the_disk_set_keeps_the_most_recent_under_the_bound() {
        let tmp = tempfile::tempdir().unwrap();
        let id = identity(b"m", "cpu");
        let one = encode(&id, &[1], &state(1)).len() as u64;
        let files = Files {
            dir: tmp.path().to_path_buf(),
            id,
            cap: 2 * one,
        };
        // Another install's file is neither counted nor deleted.
        let foreign = tmp.path().join("0000000000000000-00.snap");
        std::fs::write(&foreign, vec![0u8; 10 * one as usize]).unwrap();
        for t in 1..=3u32 {
            files.save(&[t], &state(1)).unwrap();
            // Distinct modification times, oldest first.
            let f = std::fs::File::options()
                .write(true)
                .open(files.path(&[t]))
                .unwrap();
            f.set_modified(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(t.into()))
                .unwrap();
        }
        files.prune();
        let kept: Vec<PathBuf> = files.list().into_iter().map(|(p, _, _)| p).collect();
        assert_eq!(kept, vec![files.path(&[2]), files.path(&[3])]);
        assert!(foreign.exists());
        // Touching the older one makes the other the next to go.
        files.touch(&[2]);
        files.save(&[4], &state(1)).unwrap();
        let mut kept: Vec<PathBuf> = files.list().into_iter().map(|(p, _, _)| p).collect();
        let mut want = vec![files.path(&[2]), files.path(&[4])];
        kept.sort();
        want.sort();
        assert_eq!(kept, want);
        // A snapshot larger than the bound is not written.
        let big = vec![9; 40];
        assert!(encode(&id, &big, &state(40)).len() as u64 > files.cap);
        files.save(&big, &state(40)).unwrap();
        assert!(!files.path(&big).exists());
    }
}
