//! The executor's *stage* step: claim the output and lay out the staging directory.
//!
//! [`Staging::claim`] refuses an existing output without `--overwrite` (and a link
//! there, or at the staging directory, always: [`super::nofollow`]), takes the
//! install lock `<out>.partial.lock` (one install per output) and, when replacing a
//! published directory, that directory's exclusive lock ([`super::lock`]), all before
//! anything on disk changes. [`Staging::create_outputs`] then creates every output file
//! at its planned size under `<out>.partial/`, checks free space for what remains and
//! writes the resident file's head.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::format::resident::MAGIC;
use crate::plan::Plan;
use crate::plan::placement::output_file_paths;

use super::lock::InstallLock;
use super::nofollow;
use super::options::ExecuteOptions;
use super::{InstallError, io_err};

/// The claimed output: paths and the locks held until publication.
pub(super) struct Staging {
    /// The final `.gturbo` directory.
    pub out: PathBuf,
    /// `<out>.partial/`.
    pub dir: PathBuf,
    /// `<out>.partial.journal`.
    pub journal: PathBuf,
    /// `<out>.partial.lock`.
    pub lock_path: PathBuf,
    /// The exclusive lock on `lock_path`, held for the whole install.
    pub lock: File,
    /// The exclusive lock on the published `<out>` being replaced (`--overwrite`).
    pub replacing: Option<InstallLock>,
}

/// The data output files under the staging directory, in file-id order (see
/// [`output_file_paths`]), open for positional reads and writes.
pub(super) struct OutputFiles {
    /// Open files.
    pub files: Vec<File>,
    /// Their paths, for errors.
    pub paths: Vec<PathBuf>,
    /// The staging directory they are in.
    pub dir: PathBuf,
}

/// `out` with `suffix` appended to its last component.
pub(super) fn with_suffix(out: &Path, suffix: &str) -> PathBuf {
    let mut s = out.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

impl Staging {
    /// Claim `options.out` for this install (see the module doc).
    pub fn claim(options: &ExecuteOptions) -> Result<Staging, InstallError> {
        let out = &options.out;
        if let Some(from) = &options.from {
            apart_from_source(out, from)?;
        }
        // The published directory is never a link: gturbo neither publishes one nor
        // replaces (or writes through) one.
        match nofollow::kind(out)? {
            Some(t) if t.is_symlink() => return Err(nofollow::planted(out, "a symbolic link")),
            Some(_) if !options.overwrite => {
                return Err(InstallError::OutputExists {
                    path: out.display().to_string(),
                });
            }
            Some(t) if !t.is_dir() => return Err(nofollow::planted(out, "not a directory")),
            Some(_) => ours(out)?,
            None => {}
        }
        let dir = with_suffix(out, ".partial");
        let lock_path = with_suffix(out, ".partial.lock");
        let journal = with_suffix(out, ".partial.journal");
        if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| io_err(parent, e))?;
        }
        let lock = take_lock(&lock_path)?;
        let replacing = if out.exists() {
            Some(InstallLock::exclusive(out).map_err(|e| {
                if e.kind() == std::io::ErrorKind::WouldBlock {
                    InstallError::InUse {
                        path: out.display().to_string(),
                    }
                } else {
                    io_err(out, e)
                }
            })?)
        } else {
            None
        };
        // The staging directory is the install's own: a link there is refused (the
        // weights would land in its target, and the rename would publish the link).
        match nofollow::kind(&dir)? {
            Some(t) if t.is_dir() && options.discard_partial => {
                std::fs::remove_dir_all(&dir).map_err(|e| io_err(&dir, e))?;
            }
            Some(t) if t.is_dir() => {}
            Some(t) if t.is_symlink() => return Err(nofollow::planted(&dir, "a symbolic link")),
            Some(_) => return Err(nofollow::planted(&dir, "not a directory")),
            None => {}
        }
        Ok(Staging {
            out: out.clone(),
            dir,
            journal,
            lock_path,
            lock,
            replacing,
        })
    }

    /// Create (or reopen) every data output file at its planned size (sparse:
    /// unwritten slack reads as zero), check free space, write the resident head.
    pub fn create_outputs(&self, plan: &Plan) -> Result<OutputFiles, InstallError> {
        let rel = output_file_paths(plan);
        let sizes: Vec<u64> = std::iter::once(plan.outputs.resident.file_bytes)
            .chain(plan.outputs.expert_pools.iter().map(|p| p.file_bytes))
            .chain(plan.outputs.row_pools.iter().map(|p| p.file_bytes))
            .collect();
        let needed: u64 = sizes.iter().sum();
        let mut paths = Vec::new();
        let mut files = Vec::new();
        nofollow::ensure_dir(&self.dir)?;
        for (r, size) in rel.iter().zip(&sizes) {
            let path = self.dir.join(r);
            if let Some(dir) = path.parent() {
                nofollow::ensure_dirs(&self.dir, dir)?;
            }
            let f = nofollow::open_rw(&path)?;
            let len = f.metadata().map_err(|e| io_err(&path, e))?.len();
            if len != *size {
                f.set_len(*size).map_err(|e| io_err(&path, e))?;
            }
            paths.push(path);
            files.push(f);
        }
        let out = OutputFiles {
            files,
            paths,
            dir: self.dir.clone(),
        };
        space_preflight(
            &self.dir,
            &out,
            needed + plan.outputs.copied.iter().map(|c| c.bytes).sum::<u64>(),
        )?;
        write_resident_head(plan, &out)?;
        Ok(out)
    }
}

/// Refuse an output that is the `--from` folder, holds it or lies inside it, whatever
/// the flags: publishing (or `--overwrite`, or `--discard-partial` of the staging
/// directory beside it) would replace or remove the source, and an output inside the
/// source would change what a later install of it reads. The staging directory is
/// checked too (`--from x.partial --out x` would have it removed).
fn apart_from_source(out: &Path, from: &Path) -> Result<(), InstallError> {
    let from = std::fs::canonicalize(from).map_err(|e| io_err(from, e))?;
    for path in [out.to_path_buf(), with_suffix(out, ".partial")] {
        let at = resolved(&path).map_err(|e| io_err(&path, e))?;
        let (how, harm) = if at == from {
            ("is", "replace the source with the install")
        } else if from.starts_with(&at) {
            ("holds", "remove the source with the old output")
        } else if at.starts_with(&from) {
            ("lies inside", "write into the source")
        } else {
            continue;
        };
        return Err(InstallError::OutputOverlapsSource {
            out: out.display().to_string(),
            how,
            from: from.display().to_string(),
            harm,
        });
    }
    Ok(())
}

/// `path` with every link and `..` of its existing part resolved: the longest existing
/// ancestor canonicalized, the components that do not exist yet appended (none of them
/// can be a link, so a `..` among them is lexical).
fn resolved(path: &Path) -> std::io::Result<PathBuf> {
    let path = std::path::absolute(path)?;
    let mut base = path.as_path();
    let mut rest = Vec::new();
    let canonical = loop {
        match std::fs::canonicalize(base) {
            Ok(c) => break c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let (Some(parent), Some(name)) = (base.parent(), base.file_name()) else {
            return Err(std::io::ErrorKind::NotFound.into());
        };
        rest.push(name.to_owned());
        base = parent;
    };
    let mut at = canonical;
    for name in rest.into_iter().rev() {
        if name == ".." {
            at.pop();
        } else if name != "." {
            at.push(name);
        }
    }
    Ok(at)
}

/// Most names [`ours`] lists of a folder it refuses to replace.
const NAMES_SHOWN: usize = 5;

/// Whether the existing directory `out` is one `--overwrite` may replace: a `.gturbo`
/// install gturbo published, that is, its manifest parses, a receipt is beside it, and
/// it holds no file the manifest does not account for (a user's file put there would go
/// with it). Anything else is refused, naming the path and what is in it.
fn ours(out: &Path) -> Result<(), InstallError> {
    // An empty folder holds nothing to lose.
    if std::fs::read_dir(out).is_ok_and(|mut d| d.next().is_none()) {
        return Ok(());
    }
    let refuse = |why: String| InstallError::NotOurs {
        path: out.display().to_string(),
        why,
        holds: contents(out),
    };
    let name = crate::format::manifest::FILE_NAME;
    if std::fs::symlink_metadata(out.join(name)).is_err() {
        return Err(refuse(format!("not a .gturbo install (no {name})")));
    }
    let manifest = crate::verify::open_manifest(out)
        .map_err(|f| refuse(format!("not a .gturbo install ({f})")))?;
    match crate::verify::read_receipt(out) {
        Ok(Some(_)) => {}
        Ok(None) => {
            return Err(refuse(format!(
                "not a .gturbo install that gturbo published (no {})",
                crate::format::receipt::FILE_NAME
            )));
        }
        Err(f) => return Err(refuse(format!("not a .gturbo install ({f})"))),
    }
    let strays = crate::verify::unexpected_files(out, &manifest);
    if !strays.is_empty() {
        let names: Vec<&str> = strays.iter().map(|f| f.file.as_str()).collect();
        return Err(refuse(format!(
            "a .gturbo install that also holds {} the manifest does not list ({}{})",
            if names.len() == 1 { "a file" } else { "files" },
            names[..names.len().min(NAMES_SHOWN)].join(", "),
            if names.len() > NAMES_SHOWN {
                format!(" and {} more", names.len() - NAMES_SHOWN)
            } else {
                String::new()
            }
        )));
    }
    Ok(())
}

/// A few of the names in `dir` and how many there are, for an error.
fn contents(dir: &Path) -> String {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return "entries that cannot be listed".into();
    };
    let mut names = Vec::new();
    let mut count = 0usize;
    for e in entries.flatten() {
        count += 1;
        if names.len() < 1000 {
            let dir = e.file_type().is_ok_and(|t| t.is_dir());
            names.push(format!(
                "{}{}",
                e.file_name().to_string_lossy(),
                if dir { "/" } else { "" }
            ));
        }
    }
    names.sort();
    names.truncate(NAMES_SHOWN);
    match count {
        0 => "nothing".into(),
        n if n <= NAMES_SHOWN => format!(
            "{n} entr{}: {}",
            if n == 1 { "y" } else { "ies" },
            names.join(", ")
        ),
        n => format!("{n} entries: {}, ...", names.join(", ")),
    }
}

/// Open `<out>.partial.lock` (never following a link, never truncating: its bytes do
/// not matter, only its `flock`) and lock it, refusing at once while another install
/// holds it.
pub(super) fn take_lock(lock_path: &Path) -> Result<File, InstallError> {
    let lock = nofollow::open_rw(lock_path)?;
    match lock.try_lock() {
        Ok(()) => Ok(lock),
        Err(std::fs::TryLockError::WouldBlock) => Err(InstallError::Locked {
            path: lock_path.display().to_string(),
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(io_err(lock_path, e)),
    }
}

/// The resident file's head: magic, index length, index.
fn write_resident_head(plan: &Plan, out: &OutputFiles) -> Result<(), InstallError> {
    let r = &plan.outputs.resident;
    let mut head = Vec::with_capacity(16 + r.index_len as usize);
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&r.index_len.to_le_bytes());
    head.extend_from_slice(
        &serde_json::to_vec(&r.index).map_err(|e| InstallError::Internal(e.to_string()))?,
    );
    out.files[0]
        .write_all_at(&head, 0)
        .map_err(|e| io_err(&out.paths[0], e))
}

/// Bytes kept free beyond what the install still needs: 1 % of the output, at least
/// 64 MiB (filesystems misbehave when full, and other programs need room too).
pub fn space_reserve(total: u64) -> u64 {
    (total / 100).max(64 << 20)
}

/// Refuse to start writing when the output's filesystem cannot hold what remains.
fn space_preflight(staging: &Path, out: &OutputFiles, total: u64) -> Result<(), InstallError> {
    if std::env::var_os(crate::env::GTURBO_TEST_SKIP_SPACE_CHECK).is_some() {
        return Ok(());
    }
    use std::os::unix::fs::MetadataExt;
    let mut allocated = 0u64;
    for (f, p) in out.files.iter().zip(&out.paths) {
        allocated += f.metadata().map_err(|e| io_err(p, e))?.blocks() * 512;
    }
    let remaining = total.saturating_sub(allocated);
    let available = fs4::available_space(staging).map_err(|e| io_err(staging, e))?;
    let needed = remaining + space_reserve(total);
    if available < needed {
        return Err(InstallError::NotEnoughSpace {
            path: staging.display().to_string(),
            needed,
            available,
        });
    }
    Ok(())
}
