//! `verify-install`: prove that a `.gturbo` directory is what its manifest says, byte
//! for byte and layout for layout, without trusting anything in it.
//!
//! Two levels, so the runtime can share the cheap one:
//! - [`open_manifest`] and [`check_layout`] read only the manifest, the resident
//!   file's head, the tokenizer JSON files and directory metadata: names, sizes, every
//!   number of the layout. The runtime calls them at every load.
//! - [`verify`] adds the SHA-256 of every file (hashed in parallel, streamed in
//!   [`CHUNK`] pieces) and, when everything holds, rewrites the receipt.
//!
//! Everything in the directory is hostile input: paths are checked before any
//! filesystem call ([`crate::format::check_relative_path`]), symlinks are never
//! followed (a listed path through a link is a failure naming the link), sizes are
//! capped before anything is allocated, and each failure names the file and the field
//! or byte offset it is about.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{File, Metadata};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Instant, SystemTime};

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::format::digest::{git_blob_sha1, is_sha256, sha256_hex};
use crate::format::manifest::{self, MAX_MANIFEST_BYTES, Manifest};
use crate::format::quality::{self, Quality};
use crate::format::receipt::{self, Prover, Receipt, ReceiptCopied, ReceiptFile};
use crate::format::resident::ResidentHead;
use crate::format::{LayoutError, PAGE, check_relative_path, tokenizer};

/// Bytes read and hashed at a time by each hashing thread: memory stays
/// `threads × CHUNK` whatever the file sizes. Small enough that the kernel's copy and
/// the hash both stay in the core's L2: on the 2-core EPYC CI host page-cache reads
/// run at 4.5 GB/s with 64–128 KiB buffers and 1 GB/s with 256 KiB or more.
pub const CHUNK: usize = 128 << 10;
/// Largest tokenizer JSON file parsed by the cheap checks.
pub const MAX_TOKENIZER_JSON_BYTES: u64 = 256 << 20;
/// Largest receipt read back.
pub const MAX_RECEIPT_BYTES: u64 = MAX_MANIFEST_BYTES;
/// Directory entries looked at when listing unexpected files; a hostile directory
/// with millions of entries gets a failure, not an endless walk.
const MAX_WALK_ENTRIES: usize = 100_000;
/// Deepest directory nesting walked.
const MAX_WALK_DEPTH: usize = 16;
/// The `kind` values a manifest file entry may have.
const KINDS: [&str; 4] = ["resident", "experts", "rows", "tokenizer"];
/// The tokenizers-format tokenizer, held to [`tokenizer::check_bounds`].
const TOKENIZER_JSON: &str = "tokenizer/tokenizer.json";
/// Tokenizer files of which an install must have at least one.
const TOKENIZER_MODELS: [&str; 3] = [
    TOKENIZER_JSON,
    "tokenizer/tokenizer.model",
    "tokenizer/vocab.json",
];

/// One thing that does not hold: the file it is about (relative to the directory),
/// where in it (a field such as `expert_pools[0] (packed_experts/layer_00.bin).stride`
/// or a byte offset; empty when it is the whole file) and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VerifyFailure {
    /// File inside the directory.
    pub file: String,
    /// Field or byte offset; empty for the file as a whole.
    pub at: String,
    /// What is wrong, with the expected and found values.
    pub detail: String,
}

impl VerifyFailure {
    /// A failure about `file` at `at`.
    pub fn new(
        file: impl Into<String>,
        at: impl Into<String>,
        detail: impl Into<String>,
    ) -> VerifyFailure {
        VerifyFailure {
            file: file.into(),
            at: at.into(),
            detail: detail.into(),
        }
    }

    fn layout(file: &str, prefix: &str, e: LayoutError) -> VerifyFailure {
        let at = if prefix.is_empty() {
            e.field
        } else {
            format!("{prefix}.{}", e.field)
        };
        VerifyFailure::new(file, at, e.detail)
    }

    fn io(file: &str, e: &io::Error) -> VerifyFailure {
        VerifyFailure::new(file, "", format!("cannot read: {e}"))
    }
}

impl std::fmt::Display for VerifyFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.at.is_empty() {
            write!(f, "{}: {}", self.file, self.detail)
        } else {
            write!(f, "{}: {}: {}", self.file, self.at, self.detail)
        }
    }
}

/// Read and parse `dir/manifest.json`: a regular file (not a link), at most
/// [`MAX_MANIFEST_BYTES`], valid JSON with known keys, the known format and version,
/// and every path it names safe (relative, no `..`). The cheap entry point the runtime
/// calls at every load, before [`check_layout`].
pub fn open_manifest(dir: &Path) -> Result<Manifest, VerifyFailure> {
    read_manifest(dir).map(|(_, m)| m)
}

/// [`open_manifest`] that also returns the manifest's bytes (for its SHA-256).
fn read_manifest(dir: &Path) -> Result<(Vec<u8>, Manifest), VerifyFailure> {
    let name = manifest::FILE_NAME;
    if let Err(e) = std::fs::symlink_metadata(dir.join(name))
        && e.kind() == io::ErrorKind::NotFound
    {
        return Err(VerifyFailure::new(
            name,
            "",
            "missing: not a .gturbo install, or an unfinished one",
        ));
    }
    let (file, len) = open_inside(dir, name)?;
    if len > MAX_MANIFEST_BYTES {
        return Err(VerifyFailure::new(
            name,
            "size",
            format!("{len} bytes; a manifest may have at most {MAX_MANIFEST_BYTES}"),
        ));
    }
    let bytes = read_capped(file, MAX_MANIFEST_BYTES).map_err(|e| VerifyFailure::io(name, &e))?;
    let m = Manifest::parse(&bytes).map_err(|e| VerifyFailure::layout(name, "", e))?;
    if let Some(f) = unsafe_paths(&m).into_iter().next() {
        return Err(f);
    }
    Ok((bytes, m))
}

/// Every path the manifest names that is not a safe relative path.
fn unsafe_paths(m: &Manifest) -> Vec<VerifyFailure> {
    let mut named: Vec<(String, &str)> = vec![("resident.file".into(), &m.resident.file)];
    named.extend(
        m.files
            .iter()
            .enumerate()
            .map(|(i, f)| (format!("files[{i}].path"), f.path.as_str())),
    );
    named.extend(
        m.expert_pools
            .iter()
            .enumerate()
            .map(|(i, p)| (format!("expert_pools[{i}].file"), p.file.as_str())),
    );
    named.extend(
        m.row_pools
            .iter()
            .enumerate()
            .map(|(i, p)| (format!("row_pools[{i}].file"), p.file.as_str())),
    );
    named
        .into_iter()
        .filter_map(|(at, p)| {
            check_relative_path(p)
                .err()
                .map(|e| VerifyFailure::new(manifest::FILE_NAME, at, e))
        })
        .collect()
}

/// The manifest's own consistency, without the disk: known kinds and hash syntax,
/// files sorted and unique, every pool and the resident file listed with the right
/// kind and size, pool geometry (see `ExpertPool::layout_errors`,
/// `RowPool::layout_errors`), sidecar pools belonging to a carried sidecar, a
/// tokenizer present, the architecture axes within their bounds
/// ([`crate::family::axes::check`]). Pure, so the fuzzer drives it directly.
pub fn check_manifest(m: &Manifest) -> Vec<VerifyFailure> {
    let mf = manifest::FILE_NAME;
    let mut out = unsafe_paths(m);
    let fail = |at: String, detail: String| VerifyFailure::new(mf, at, detail);

    // The architecture axes, by the rules the planner and the runtime apply.
    if let Err(e) = crate::family::axes::check(&m.arch.axes) {
        out.push(fail(format!("arch.axes.{}", e.axis), e.detail));
    }
    if m.tool.name != "gturbo" {
        out.push(fail(
            "tool.name".into(),
            format!("{:?}; expected \"gturbo\"", m.tool.name),
        ));
    }
    let q = &m.quantized_at_install;
    // The record's numbers are its scheme's (a passthrough record, `--quant bf16`,
    // keeps gturbo's group of 64, or 0 from a pre-quantized source's).
    let want_group = q.scheme.group().unwrap_or(64);
    let group_ok = q.group_size == want_group || (q.scheme.group().is_none() && q.group_size == 0);
    if q.bits != q.scheme.bits().unwrap_or(0) || !group_ok {
        out.push(fail(
            m.quantized_at_install_key().into(),
            format!(
                "scheme {} with bits {} and group_size {}; expected bits {} and group_size {want_group}",
                q.scheme.label(),
                q.bits,
                q.group_size,
                q.scheme.bits().unwrap_or(0)
            ),
        ));
    }
    for (name, state) in &m.sidecars {
        if state != "carried" && state != "skipped" {
            out.push(fail(
                format!("sidecars.{name}"),
                format!("{state:?}; expected \"carried\" or \"skipped\""),
            ));
        }
    }

    // The file list.
    let mut by_path: BTreeMap<&str, (usize, &manifest::ManifestFile)> = BTreeMap::new();
    for (i, f) in m.files.iter().enumerate() {
        if !KINDS.contains(&f.kind.as_str()) {
            out.push(fail(
                format!("files[{i}].kind"),
                format!("{:?}; expected one of {KINDS:?}", f.kind),
            ));
        }
        if !is_sha256(&f.sha256) {
            out.push(fail(
                format!("files[{i}].sha256"),
                format!("{:?} is not 64 lowercase hex digits", f.sha256),
            ));
        }
        if f.path == manifest::FILE_NAME || f.path == receipt::FILE_NAME {
            out.push(fail(
                format!("files[{i}].path"),
                format!("{:?} is never listed in the manifest", f.path),
            ));
        }
        if i > 0 && m.files[i - 1].path >= f.path {
            out.push(fail(
                format!("files[{i}].path"),
                format!(
                    "{:?} after {:?}: files are sorted by path, each once",
                    f.path,
                    m.files[i - 1].path
                ),
            ));
        }
        by_path.entry(&f.path).or_insert((i, f));
    }

    // Every described file is listed with its kind and size, and every listed data
    // file is described.
    let mut described: BTreeSet<&str> = BTreeSet::new();
    let mut data_files: Vec<(String, &str, &str, Option<u64>)> =
        vec![("resident.file".into(), &m.resident.file, "resident", None)];
    for (i, p) in m.expert_pools.iter().enumerate() {
        data_files.push((
            format!("expert_pools[{i}].file_bytes"),
            &p.file,
            "experts",
            Some(p.file_bytes),
        ));
    }
    for (i, p) in m.row_pools.iter().enumerate() {
        data_files.push((
            format!("row_pools[{i}].file_bytes"),
            &p.file,
            "rows",
            Some(p.file_bytes),
        ));
    }
    for (at, path, kind, bytes) in data_files {
        if !described.insert(path) {
            out.push(fail(at.clone(), format!("{path:?} is described twice")));
        }
        match by_path.get(path) {
            None => out.push(fail(at, format!("{path:?} is not in files"))),
            Some((i, f)) => {
                if f.kind != kind {
                    out.push(fail(
                        format!("files[{i}].kind"),
                        format!("{:?} for {path:?}; {at} makes it {kind:?}", f.kind),
                    ));
                }
                if let Some(b) = bytes.filter(|b| *b != f.bytes) {
                    out.push(fail(
                        format!("files[{i}].bytes"),
                        format!("{} for {path:?}; {at} gives {b}", f.bytes),
                    ));
                }
            }
        }
    }
    for (i, f) in m.files.iter().enumerate() {
        if f.kind != "tokenizer"
            && KINDS.contains(&f.kind.as_str())
            && !described.contains(f.path.as_str())
        {
            out.push(fail(
                format!("files[{i}]"),
                format!(
                    "{:?} is listed as {:?} but no resident entry or pool describes it",
                    f.path, f.kind
                ),
            ));
        }
        if f.kind == "tokenizer" && !f.path.starts_with("tokenizer/") {
            out.push(fail(
                format!("files[{i}].path"),
                format!("{:?}: tokenizer files live under tokenizer/", f.path),
            ));
        }
    }
    if !TOKENIZER_MODELS
        .iter()
        .any(|t| by_path.get(t).is_some_and(|(_, f)| f.kind == "tokenizer"))
    {
        out.push(fail(
            "files".into(),
            format!("no tokenizer: none of {TOKENIZER_MODELS:?} is listed"),
        ));
    }
    if m.resident.payload_start < PAGE || !m.resident.payload_start.is_multiple_of(PAGE) {
        out.push(fail(
            "resident.payload_start".into(),
            format!(
                "{}; the payload starts on a {PAGE}-byte page after the head",
                m.resident.payload_start
            ),
        ));
    }

    // Pool geometry and names.
    for (i, p) in m.expert_pools.iter().enumerate() {
        let prefix = format!("expert_pools[{i}] ({})", p.file);
        out.extend(
            p.layout_errors()
                .into_iter()
                .map(|e| VerifyFailure::layout(mf, &prefix, e)),
        );
        let want = match &p.sidecar {
            None => format!("packed_experts/layer_{:02}.bin", p.layer),
            Some(s) => format!("packed_experts/{s}_layer_{:02}.bin", p.layer),
        };
        if p.file != want {
            out.push(fail(
                format!("expert_pools[{i}].file"),
                format!("{:?}; layer {} gives {want:?}", p.file, p.layer),
            ));
        }
        if let Some(s) = &p.sidecar
            && m.sidecars.get(s).map(String::as_str) != Some("carried")
        {
            out.push(fail(
                format!("expert_pools[{i}].sidecar"),
                format!("{s:?} is not a carried sidecar in sidecars"),
            ));
        }
    }
    for (i, p) in m.row_pools.iter().enumerate() {
        let prefix = format!("row_pools[{i}] ({})", p.file);
        out.extend(
            p.layout_errors()
                .into_iter()
                .map(|e| VerifyFailure::layout(mf, &prefix, e)),
        );
        let want = format!("ple/layer_{:02}_{}.bin", p.layer, p.name);
        if p.file != want {
            out.push(fail(
                format!("row_pools[{i}].file"),
                format!(
                    "{:?}; layer {} and name {:?} give {want:?}",
                    p.file, p.layer, p.name
                ),
            ));
        }
    }
    out
}

/// The cheap checks against the disk, no hashing: [`check_manifest`], then every
/// listed file exists as a regular file (no link on its path) with its listed size,
/// the resident file's head and index agree with the manifest and describe a valid
/// payload, tokenizer JSON files parse, and nothing unexpected lies in the
/// directory. Empty when everything holds.
pub fn check_layout(dir: &Path, m: &Manifest) -> Vec<VerifyFailure> {
    let mut out = check_manifest(m);
    for f in &m.files {
        // A path the checks refused is never opened; the rest still are.
        if check_relative_path(&f.path).is_err() {
            continue;
        }
        let (file, len) = match open_inside(dir, &f.path) {
            Ok(x) => x,
            Err(e) => {
                out.push(e);
                continue;
            }
        };
        if len != f.bytes {
            out.push(VerifyFailure::new(
                &f.path,
                "size",
                format!(
                    "{len} bytes on disk, the manifest lists {}{}",
                    f.bytes,
                    if len < f.bytes {
                        " (truncated)"
                    } else {
                        " (longer)"
                    }
                ),
            ));
        }
        if f.path == m.resident.file && f.kind == "resident" {
            out.extend(check_resident(file, len, m));
        } else if f.path == TOKENIZER_JSON && len > tokenizer::MAX_BYTES {
            out.push(VerifyFailure::new(
                &f.path,
                "size",
                tokenizer::too_large(len),
            ));
        } else if f.kind == "tokenizer"
            && f.path.ends_with(".json")
            && len == f.bytes
            && len <= MAX_TOKENIZER_JSON_BYTES
        {
            match read_capped(file, MAX_TOKENIZER_JSON_BYTES) {
                Err(e) => out.push(VerifyFailure::io(&f.path, &e)),
                Ok(bytes) => {
                    if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(&bytes) {
                        out.push(VerifyFailure::new(
                            &f.path,
                            format!("line {} column {}", e.line(), e.column()),
                            format!("not valid JSON: {e}"),
                        ));
                    } else if f.path == TOKENIZER_JSON
                        && let Err(e) = tokenizer::check_bounds(&bytes)
                    {
                        // What loading it would cost `gturbo run`, checked here too.
                        out.push(VerifyFailure::new(&f.path, e.field, e.detail));
                    }
                }
            }
        }
    }
    out.extend(unexpected_files(dir, m));
    out
}

/// The resident file's head against the manifest and its own payload.
fn check_resident(file: File, len: u64, m: &Manifest) -> Vec<VerifyFailure> {
    let rf = m.resident.file.as_str();
    let mut reader = io::BufReader::new(file);
    let head = match ResidentHead::read(&mut reader, len) {
        Ok(h) => h,
        Err(e) => return vec![VerifyFailure::layout(rf, "", e)],
    };
    let mut out = Vec::new();
    if head.payload_start != m.resident.payload_start {
        out.push(VerifyFailure::new(
            manifest::FILE_NAME,
            "resident.payload_start",
            format!(
                "{}; {rf}'s index of {} bytes puts the payload at {}",
                m.resident.payload_start, head.index_len, head.payload_start
            ),
        ));
    }
    if head.index.tensors.len() as u64 != m.resident.entries {
        out.push(VerifyFailure::new(
            manifest::FILE_NAME,
            "resident.entries",
            format!(
                "{}; {rf}'s index has {}",
                m.resident.entries,
                head.index.tensors.len()
            ),
        ));
    }
    match len.checked_sub(head.payload_start) {
        None => out.push(VerifyFailure::new(
            rf,
            "byte 8 (index length)",
            format!(
                "the payload would start at {} but the file has {len} bytes",
                head.payload_start
            ),
        )),
        Some(payload) => out.extend(
            head.index
                .layout_errors(payload)
                .into_iter()
                .map(|e| VerifyFailure::layout(rf, "index", e)),
        ),
    }
    out
}

/// Files and links in the directory the manifest does not account for. Links are
/// reported, never followed.
pub fn unexpected_files(dir: &Path, m: &Manifest) -> Vec<VerifyFailure> {
    let mut known: BTreeSet<&str> = m.files.iter().map(|f| f.path.as_str()).collect();
    known.insert(manifest::FILE_NAME);
    known.insert(receipt::FILE_NAME);
    known.insert(quality::FILE_NAME);
    let mut out = Vec::new();
    let mut seen = 0usize;
    let mut stack: Vec<(PathBuf, String, usize)> = vec![(dir.to_path_buf(), String::new(), 0)];
    while let Some((abs, rel, depth)) = stack.pop() {
        let entries = match std::fs::read_dir(&abs) {
            Ok(e) => e,
            Err(e) => {
                out.push(VerifyFailure::new(
                    if rel.is_empty() { "." } else { &rel },
                    "",
                    format!("cannot list: {e}"),
                ));
                continue;
            }
        };
        let mut names: Vec<(String, std::fs::FileType, PathBuf)> = Vec::new();
        for e in entries {
            seen += 1;
            if seen > MAX_WALK_ENTRIES {
                out.push(VerifyFailure::new(
                    ".",
                    "",
                    format!("more than {MAX_WALK_ENTRIES} entries; stopped listing"),
                ));
                return out;
            }
            let Ok(e) = e else { continue };
            let name = e.file_name().to_string_lossy().into_owned();
            let path = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
            };
            match e.file_type() {
                Ok(t) => names.push((path, t, e.path())),
                Err(err) => out.push(VerifyFailure::new(path, "", format!("cannot stat: {err}"))),
            }
        }
        names.sort_by(|a, b| a.0.cmp(&b.0));
        for (path, t, abs) in names {
            if t.is_dir() {
                if depth + 1 >= MAX_WALK_DEPTH {
                    out.push(VerifyFailure::new(
                        path,
                        "",
                        format!("unexpected directory nested deeper than {MAX_WALK_DEPTH}"),
                    ));
                } else {
                    stack.push((abs, path, depth + 1));
                }
            } else if !known.contains(path.as_str()) {
                let what = if t.is_symlink() {
                    "unexpected symlink (not followed), not listed in the manifest"
                } else if t.is_file() {
                    "unexpected file, not listed in the manifest"
                } else {
                    "unexpected special file, not listed in the manifest"
                };
                out.push(VerifyFailure::new(path, "", what));
            }
        }
    }
    out.sort_by(|a, b| a.file.cmp(&b.file));
    out
}

/// Open `dir/rel` for reading without following any link: `rel` must be a safe
/// relative path, every component on the way must be a real directory and the last
/// a regular file. Returns the file and its size.
pub fn open_inside(dir: &Path, rel: &str) -> Result<(File, u64), VerifyFailure> {
    check_relative_path(rel).map_err(|e| VerifyFailure::new(rel, "path", e))?;
    let parts: Vec<&str> = rel.split('/').collect();
    let mut path = dir.to_path_buf();
    let mut last: Option<Metadata> = None;
    for (i, part) in parts.iter().enumerate() {
        path.push(part);
        let md = match std::fs::symlink_metadata(&path) {
            Ok(md) => md,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(VerifyFailure::new(
                    rel,
                    "",
                    "missing: listed in the manifest, not on disk",
                ));
            }
            Err(e) => return Err(VerifyFailure::io(rel, &e)),
        };
        let here = parts[..=i].join("/");
        if md.file_type().is_symlink() {
            return Err(VerifyFailure::new(
                rel,
                "",
                format!("{here} is a symlink; verify-install never follows links"),
            ));
        }
        let is_last = i + 1 == parts.len();
        if !is_last && !md.is_dir() {
            return Err(VerifyFailure::new(
                rel,
                "",
                format!("{here} is not a directory"),
            ));
        }
        if is_last && !md.is_file() {
            return Err(VerifyFailure::new(rel, "", "not a regular file"));
        }
        last = Some(md);
    }
    let file = open_no_follow(&path).map_err(|e| VerifyFailure::io(rel, &e))?;
    let md = file.metadata().map_err(|e| VerifyFailure::io(rel, &e))?;
    if let Some(before) = last
        && !same_file(&before, &md)
    {
        // The entry changed between the check and the open (a swapped-in link).
        return Err(VerifyFailure::new(
            rel,
            "",
            "changed while being opened; refusing it",
        ));
    }
    Ok((file, md.len()))
}

#[cfg(unix)]
fn open_no_follow(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    // O_NOFOLLOW: a link swapped in after the check fails to open instead of being
    // followed; O_NONBLOCK: a FIFO swapped in cannot block the open.
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
}

#[cfg(not(unix))]
fn open_no_follow(path: &Path) -> io::Result<File> {
    File::open(path)
}

#[cfg(unix)]
fn same_file(a: &Metadata, b: &Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    a.dev() == b.dev() && a.ino() == b.ino() && b.is_file()
}

#[cfg(not(unix))]
fn same_file(_: &Metadata, b: &Metadata) -> bool {
    b.is_file()
}

/// Read a whole file of at most `cap` bytes.
fn read_capped(file: File, cap: u64) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    file.take(cap + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > cap {
        return Err(io::Error::other(format!("more than {cap} bytes")));
    }
    Ok(bytes)
}

/// Hooks a caller can use to show progress of a full verify.
pub trait VerifyProgress: Sync {
    /// Hashing starts: `files` files of `bytes` bytes in all.
    fn start(&self, _files: u64, _bytes: u64) {}
    /// `bytes` more bytes were hashed (called from the hashing threads).
    fn hashed(&self, _bytes: u64) {}
}

/// Settings of a full verify.
#[derive(Clone, Copy)]
pub struct VerifyOptions<'a> {
    /// Hashing threads; 0 means the available cores.
    pub threads: usize,
    /// Rewrite `verified-install.json` when everything holds.
    pub write_receipt: bool,
    /// Progress hooks.
    pub progress: Option<&'a dyn VerifyProgress>,
}

impl Default for VerifyOptions<'_> {
    fn default() -> Self {
        VerifyOptions {
            threads: 0,
            write_receipt: true,
            progress: None,
        }
    }
}

/// What happened to the receipt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReceiptOutcome {
    /// Rewritten, source repo and commit carried forward from the previous receipt.
    Rewritten,
    /// Rewritten without source provenance: there was no previous receipt, or it
    /// named another manifest or other file hashes.
    RewrittenWithoutProvenance,
    /// Not written: something failed, or the caller asked not to.
    NotWritten,
}

/// The outcome of [`verify`].
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The directory verified.
    pub dir: String,
    /// Whether everything holds.
    pub ok: bool,
    /// What does not hold, in check order.
    pub failures: Vec<VerifyFailure>,
    /// Files hashed (the manifest included).
    pub files: u64,
    /// Bytes hashed.
    pub bytes: u64,
    /// Wall time in seconds.
    pub elapsed_s: f64,
    /// SHA-256 of `manifest.json`, when it could be read.
    pub manifest_sha256: Option<String>,
    /// What happened to the receipt.
    pub receipt: ReceiptOutcome,
    /// Hashing threads used.
    pub threads: usize,
}

impl Report {
    /// Hashing rate in MB/s (10^6 bytes per second).
    pub fn mb_per_s(&self) -> f64 {
        self.bytes as f64 / 1e6 / self.elapsed_s.max(1e-9)
    }

    /// `verified N files, B bytes, in T s (X MB/s)`.
    pub fn summary(&self) -> String {
        format!(
            "verified {} files, {} bytes, in {:.2} s ({:.0} MB/s)",
            self.files,
            self.bytes,
            self.elapsed_s,
            self.mb_per_s()
        )
    }
}

/// The full check: [`open_manifest`], [`check_layout`], the SHA-256 of every listed
/// file against the manifest (in parallel, `threads × CHUNK` bytes of memory), the
/// manifest's SHA-256 against the receipt's when there is one, then, when everything
/// holds, the receipt rewritten atomically.
pub fn verify(dir: &Path, opts: &VerifyOptions<'_>) -> Report {
    let started = Instant::now();
    let threads = if opts.threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        opts.threads
    };
    let mut report = Report {
        dir: dir.display().to_string(),
        ok: false,
        failures: Vec::new(),
        files: 0,
        bytes: 0,
        elapsed_s: 0.0,
        manifest_sha256: None,
        receipt: ReceiptOutcome::NotWritten,
        threads,
    };
    let (manifest_bytes, m) = match read_manifest(dir) {
        Ok(x) => x,
        Err(f) => {
            report.failures.push(f);
            report.elapsed_s = started.elapsed().as_secs_f64();
            return report;
        }
    };
    let manifest_sha = sha256_hex(&manifest_bytes);
    report.manifest_sha256 = Some(manifest_sha.clone());
    report.files = 1;
    report.bytes = manifest_bytes.len() as u64;
    report.failures = check_layout(dir, &m);

    // The receipt, if any, must name this manifest: a manifest edited after it was
    // verified is caught here even where its numbers stay consistent.
    let old_receipt = match read_receipt(dir) {
        Ok(r) => r,
        Err(f) => {
            report.failures.push(f);
            None
        }
    };
    if let Some(r) = &old_receipt
        && r.manifest_sha256 != manifest_sha
    {
        report.failures.push(VerifyFailure::new(
            manifest::FILE_NAME,
            "sha256",
            format!(
                "{manifest_sha} on disk, {} recorded {} (the manifest changed after it was verified)",
                receipt::FILE_NAME,
                r.manifest_sha256
            ),
        ));
    }

    // A recorded quality result must be the one the receipt lists, measured on this
    // manifest; one that checks out is carried into the rewritten receipt.
    let quality_entry = match check_quality(dir, &manifest_sha, old_receipt.as_ref()) {
        Ok(q) => q.map(|(entry, _)| entry),
        Err(f) => {
            report.failures.push(f);
            None
        }
    };

    // Hash every listed file whose size checked out; bigger files first so the
    // threads finish together.
    let failed: BTreeSet<&str> = report
        .failures
        .iter()
        .filter(|f| f.at == "size" || f.at.is_empty())
        .map(|f| f.file.as_str())
        .collect();
    let mut todo: Vec<&manifest::ManifestFile> = m
        .files
        .iter()
        .filter(|f| check_relative_path(&f.path).is_ok() && !failed.contains(f.path.as_str()))
        .collect();
    todo.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.path.cmp(&b.path)));
    if let Some(p) = opts.progress {
        p.start(todo.len() as u64, todo.iter().map(|f| f.bytes).sum::<u64>());
    }
    let paths: Vec<&str> = todo.iter().map(|f| f.path.as_str()).collect();
    let results = hash_files(dir, &paths, threads, opts.progress);
    let mut hashes: Vec<ReceiptFile> = Vec::new();
    for (f, r) in todo.iter().zip(results) {
        match r {
            Err(e) => report.failures.push(e),
            Ok((sha, len)) => {
                report.files += 1;
                report.bytes += len;
                if len != f.bytes {
                    report.failures.push(VerifyFailure::new(
                        &f.path,
                        "size",
                        format!(
                            "{len} bytes read, the manifest lists {} (changed during the check)",
                            f.bytes
                        ),
                    ));
                } else if sha != f.sha256 {
                    report.failures.push(VerifyFailure::new(
                        &f.path,
                        "sha256",
                        format!("{sha} on disk, the manifest lists {}", f.sha256),
                    ));
                }
                hashes.push(ReceiptFile {
                    path: f.path.clone(),
                    bytes: len,
                    sha256: sha,
                });
            }
        }
    }
    hashes.sort_by(|a, b| a.path.cmp(&b.path));
    // The copied files against the hashes their source published, as the receipt
    // records them: the install proved them once, this proves them again on disk.
    if let Some(r) = old_receipt
        .as_ref()
        .filter(|r| r.manifest_sha256 == manifest_sha)
    {
        report
            .failures
            .extend(check_copied(dir, &m, &r.source_copied));
    }
    report.ok = report.failures.is_empty();
    if report.ok && opts.write_receipt {
        match write_receipt(dir, &manifest_sha, hashes, old_receipt, quality_entry) {
            Ok(outcome) => report.receipt = outcome,
            Err(f) => {
                report.failures.push(f);
                report.ok = false;
            }
        }
    }
    report.elapsed_s = started.elapsed().as_secs_f64();
    report
}

/// Each copied file the receipt records as verified, against the git blob id or SHA-256
/// its source published. Only files the manifest lists are opened (a receipt naming
/// another path is a failure), each at most the bound the install held it to
/// ([`crate::plan::copied_max_bytes`]).
fn check_copied(dir: &Path, m: &Manifest, copied: &[ReceiptCopied]) -> Vec<VerifyFailure> {
    let mut out = Vec::new();
    let rname = receipt::FILE_NAME;
    for c in copied.iter().filter(|c| c.verified) {
        let listed = (m.files.iter()).any(|f| f.path == c.file && f.kind == "tokenizer");
        if !listed || check_relative_path(&c.file).is_err() {
            out.push(VerifyFailure::new(
                rname,
                "source_copied",
                format!("{:?} is not a copied file of the manifest", c.file),
            ));
            continue;
        }
        let bytes = match open_inside(dir, &c.file).and_then(|(file, _)| {
            read_capped(file, crate::plan::copied_max_bytes(&c.path).0)
                .map_err(|e| VerifyFailure::io(&c.file, &e))
        }) {
            Ok(b) => b,
            Err(f) => {
                out.push(f);
                continue;
            }
        };
        let checks = [
            (
                "source git blob id",
                &c.git_oid,
                git_blob_sha1 as fn(&[u8]) -> String,
            ),
            ("source sha256", &c.sha256, sha256_hex),
        ];
        for (at, want, hash) in checks {
            if let Some(want) = want {
                let got = hash(&bytes);
                if got != *want {
                    out.push(VerifyFailure::new(
                        &c.file,
                        at,
                        format!(
                            "{got} on disk, the source ({}) published {want}, as {rname} records",
                            c.path
                        ),
                    ));
                }
            }
        }
    }
    out
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

/// Whether the receipt vouches for this install without hashing: it exists, names the
/// SHA-256 of the manifest on disk, and lists exactly the manifest's files with the
/// sizes they have on disk. This is what a runtime may accept instead of full hashing
/// when the user asks it to trust the receipt; it proves sizes, not bytes. Call it
/// after [`check_layout`] found nothing.
pub fn receipt_vouches(dir: &Path) -> Result<bool, VerifyFailure> {
    let (bytes, m) = read_manifest(dir)?;
    let Some(r) = read_receipt(dir)? else {
        return Ok(false);
    };
    if r.manifest_sha256 != sha256_hex(&bytes) || r.files.len() != m.files.len() {
        return Ok(false);
    }
    for (rf, mf) in r.files.iter().zip(&m.files) {
        if rf.path != mf.path || rf.bytes != mf.bytes || rf.sha256 != mf.sha256 {
            return Ok(false);
        }
        if open_inside(dir, &mf.path)?.1 != mf.bytes {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The receipt on disk, if any. A receipt that cannot be read or parsed is a failure.
pub fn read_receipt(dir: &Path) -> Result<Option<Receipt>, VerifyFailure> {
    let name = receipt::FILE_NAME;
    match std::fs::symlink_metadata(dir.join(name)) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        _ => {}
    }
    let (file, len) = open_inside(dir, name)?;
    if len > MAX_RECEIPT_BYTES {
        return Err(VerifyFailure::new(
            name,
            "size",
            format!("{len} bytes; a receipt may have at most {MAX_RECEIPT_BYTES}"),
        ));
    }
    let bytes = read_capped(file, MAX_RECEIPT_BYTES).map_err(|e| VerifyFailure::io(name, &e))?;
    serde_json::from_slice(&bytes).map(Some).map_err(|e| {
        VerifyFailure::new(
            name,
            format!("line {} column {}", e.line(), e.column()),
            format!("not a valid receipt (delete it to verify without it): {e}"),
        )
    })
}

/// Rewrite the receipt atomically: a temporary file in the directory, fsynced,
/// renamed over the old one, the directory fsynced. Source repo and commit are
/// carried forward only from a receipt that names this manifest and these hashes.
fn write_receipt(
    dir: &Path,
    manifest_sha: &str,
    files: Vec<ReceiptFile>,
    old: Option<Receipt>,
    quality: Option<ReceiptFile>,
) -> Result<ReceiptOutcome, VerifyFailure> {
    let carried = old
        .filter(|r| r.manifest_sha256 == manifest_sha && r.files == files)
        .map(|r| {
            (
                r.source_repo,
                r.source_commit,
                r.source_shards,
                r.source_copied,
            )
        });
    let outcome = if carried.is_some() {
        ReceiptOutcome::Rewritten
    } else {
        ReceiptOutcome::RewrittenWithoutProvenance
    };
    // No matching receipt: no provenance, `""`, `None` and no shards (FORMAT.md's
    // rewrite rule).
    let (source_repo, source_commit, source_shards, source_copied) = carried.unwrap_or_default();
    let mut r = Receipt::new(
        Prover::VerifyInstall,
        manifest_sha.to_string(),
        files,
        source_repo,
        source_commit,
        source_shards,
        SystemTime::now(),
    );
    r.quality = quality;
    r.source_copied = source_copied;
    write_receipt_file(dir, &r)?;
    Ok(outcome)
}

/// Write `r` as the receipt atomically: a temporary file in the directory, fsynced,
/// renamed over the old one, the directory fsynced.
fn write_receipt_file(dir: &Path, r: &Receipt) -> Result<(), VerifyFailure> {
    let name = receipt::FILE_NAME;
    let tmp = dir.join(format!("{name}.tmp-{}", std::process::id()));
    let fail =
        |e: io::Error| VerifyFailure::new(name, "", format!("cannot write the receipt: {e}"));
    let result = (|| -> io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        f.write_all(&r.to_canonical_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, dir.join(name))?;
        File::open(dir)?.sync_all()
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(fail(e));
    }
    Ok(())
}

/// The recorded quality result of the install whose manifest's SHA-256 is
/// `manifest_sha`, checked against the receipt `r` (FORMAT.md, "quality.json"):
/// `Ok(None)` when none is recorded (no `quality.json`, no receipt entry), the receipt
/// entry and the parsed result when both agree, and a failure naming `quality.json`
/// when the file and the receipt disagree, the file does not parse, or it measured
/// another manifest.
pub fn check_quality(
    dir: &Path,
    manifest_sha: &str,
    r: Option<&Receipt>,
) -> Result<Option<(ReceiptFile, Quality)>, VerifyFailure> {
    let name = quality::FILE_NAME;
    let present = !matches!(std::fs::symlink_metadata(dir.join(name)),
        Err(e) if e.kind() == io::ErrorKind::NotFound);
    let entry = r.and_then(|r| r.quality.clone());
    let entry = match (present, entry) {
        (false, None) => return Ok(None),
        (false, Some(_)) => {
            return Err(VerifyFailure::new(
                name,
                "",
                format!(
                    "missing; {} lists a recorded quality result",
                    receipt::FILE_NAME
                ),
            ));
        }
        (true, None) => {
            return Err(VerifyFailure::new(
                name,
                "",
                format!(
                    "not covered by {} (only `gturbo eval --record` records a quality \
                     result; delete the file or measure again)",
                    receipt::FILE_NAME
                ),
            ));
        }
        (true, Some(e)) => e,
    };
    let (file, len) = open_inside(dir, name)?;
    if len > quality::MAX_BYTES {
        return Err(VerifyFailure::new(
            name,
            "size",
            format!(
                "{len} bytes; a quality file may have at most {}",
                quality::MAX_BYTES
            ),
        ));
    }
    let bytes = read_capped(file, quality::MAX_BYTES).map_err(|e| VerifyFailure::io(name, &e))?;
    let sha = sha256_hex(&bytes);
    if entry.path != name || sha != entry.sha256 || bytes.len() as u64 != entry.bytes {
        return Err(VerifyFailure::new(
            name,
            "sha256",
            format!(
                "{sha} ({} bytes) on disk, {} lists {} ({} bytes) for {:?}",
                bytes.len(),
                receipt::FILE_NAME,
                entry.sha256,
                entry.bytes,
                entry.path
            ),
        ));
    }
    let q = Quality::parse(&bytes).map_err(|e| VerifyFailure::new(name, "", e))?;
    if q.manifest_sha256 != manifest_sha {
        return Err(VerifyFailure::new(
            name,
            "manifest_sha256",
            format!(
                "measured the manifest {}, this install's is {manifest_sha} (the install \
                 changed after the measurement)",
                q.manifest_sha256
            ),
        ));
    }
    Ok(Some((entry, q)))
}

/// The install's recorded quality result as `gturbo run` reads it: the manifest's
/// SHA-256 and the receipt, then [`check_quality`]. Small reads only.
pub fn recorded_quality(dir: &Path) -> Result<Option<Quality>, VerifyFailure> {
    let (bytes, _) = read_manifest(dir)?;
    let r = read_receipt(dir)?;
    Ok(check_quality(dir, &sha256_hex(&bytes), r.as_ref())?.map(|(_, q)| q))
}

/// Record `q` as the install's quality result (`gturbo eval --record`), by the rule
/// FORMAT.md states: the install must have a receipt naming the manifest on disk
/// (which `q.manifest_sha256` must be too); `quality.json` is written atomically, then
/// the receipt is rewritten with every field as it was and `quality` set to the new
/// file's path, size and SHA-256. A result already recorded is replaced.
pub fn record_quality(dir: &Path, q: &Quality) -> Result<(), VerifyFailure> {
    let (bytes, _) = read_manifest(dir)?;
    let sha = sha256_hex(&bytes);
    let Some(mut r) = read_receipt(dir)? else {
        return Err(VerifyFailure::new(
            receipt::FILE_NAME,
            "",
            "missing: a quality result is recorded in the receipt (run `gturbo verify-install` first)",
        ));
    };
    if r.manifest_sha256 != sha || q.manifest_sha256 != sha {
        return Err(VerifyFailure::new(
            receipt::FILE_NAME,
            "manifest_sha256",
            format!(
                "the receipt names {}, the measurement {}, the manifest on disk is {sha} \
                 (run `gturbo verify-install`, then measure again)",
                r.manifest_sha256, q.manifest_sha256
            ),
        ));
    }
    let name = quality::FILE_NAME;
    let body = q.to_canonical_bytes();
    let tmp = dir.join(format!("{name}.tmp-{}", std::process::id()));
    let result = (|| -> io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        f.write_all(&body)?;
        f.sync_all()?;
        std::fs::rename(&tmp, dir.join(name))?;
        File::open(dir)?.sync_all()
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(VerifyFailure::new(name, "", format!("cannot write: {e}")));
    }
    r.quality = Some(ReceiptFile {
        path: name.into(),
        bytes: body.len() as u64,
        sha256: sha256_hex(&body),
    });
    write_receipt_file(dir, &r)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The seed manifest of the fuzz script, in a directory with files of its sizes.
    fn manifest() -> Manifest {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/fuzz.sh"))
            .unwrap();
        let start = text.find("<<'JSON'\n").unwrap() + 8;
        let end = text[start..].find("\nJSON\n").unwrap() + start;
        Manifest::parse(&text.as_bytes()[start..end]).unwrap()
    }

    fn ats(f: &[VerifyFailure]) -> Vec<String> {
        f.iter().map(|f| format!("{}: {}", f.file, f.at)).collect()
    }

    #[test]
    fn the_seed_manifest_is_consistent() {
        assert_eq!(check_manifest(&manifest()), vec![]);
    }

    #[test]
    fn manifest_cross_checks_name_the_field() {
        let mut m = manifest();
        m.files[0].bytes += 1;
        m.files[1].kind = "weights".into();
        m.files[3].sha256 = "ABC".into();
        m.row_pools[0].layer = 2;
        m.expert_pools[0].sidecar = Some("mtp2".into());
        m.resident.payload_start = 100;
        let got = ats(&check_manifest(&m));
        assert_eq!(
            got,
            [
                "manifest.json: files[1].kind",
                "manifest.json: files[3].sha256",
                "manifest.json: files[0].bytes",
                "manifest.json: files[1].kind",
                "manifest.json: resident.payload_start",
                "manifest.json: expert_pools[0].file",
                "manifest.json: expert_pools[0].sidecar",
                "manifest.json: row_pools[0].file",
            ]
            .map(String::from)
            .to_vec(),
        );
    }

    #[test]
    fn unsorted_duplicate_and_reserved_paths_are_refused() {
        let mut m = manifest();
        m.files.swap(0, 1);
        m.files[3].path = "manifest.json".into();
        let got = ats(&check_manifest(&m));
        assert!(
            got.contains(&"manifest.json: files[1].path".to_string()),
            "{got:?}"
        );
        assert!(
            got.contains(&"manifest.json: files[3].path".to_string()),
            "{got:?}"
        );
        assert!(
            got.contains(&"manifest.json: files".to_string()),
            "no tokenizer left: {got:?}"
        );
        let mut m = manifest();
        m.files[2].path = "../resident.bin".into();
        let f = &check_manifest(&m)[0];
        assert_eq!(
            f.to_string(),
            "manifest.json: files[2].path: \"../resident.bin\" has a \"..\" component; paths must stay inside the directory"
        );
    }

    #[test]
    fn open_inside_never_follows_links() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().join("i");
        std::fs::create_dir_all(d.join("sub")).unwrap();
        std::fs::write(d.join("sub/a.bin"), b"abc").unwrap();
        std::fs::write(tmp.path().join("secret"), b"secret").unwrap();
        std::os::unix::fs::symlink(tmp.path().join("secret"), d.join("link")).unwrap();
        std::os::unix::fs::symlink(d.join("sub"), d.join("sublink")).unwrap();
        assert_eq!(open_inside(&d, "sub/a.bin").unwrap().1, 3);
        let e = open_inside(&d, "link").unwrap_err();
        assert_eq!(
            e.to_string(),
            "link: link is a symlink; verify-install never follows links"
        );
        let e = open_inside(&d, "sublink/a.bin").unwrap_err();
        assert_eq!(
            e.to_string(),
            "sublink/a.bin: sublink is a symlink; verify-install never follows links"
        );
        assert_eq!(
            open_inside(&d, "sub").unwrap_err().detail,
            "not a regular file"
        );
        assert_eq!(
            open_inside(&d, "sub/a.bin/x").unwrap_err().detail,
            "sub/a.bin is not a directory"
        );
        assert_eq!(open_inside(&d, "../secret").unwrap_err().at, "path");
        assert_eq!(
            open_inside(&d, "nope").unwrap_err().detail,
            "missing: listed in the manifest, not on disk"
        );
    }

    #[test]
    fn failure_lines_name_file_and_field() {
        assert_eq!(
            VerifyFailure::new("a.bin", "byte 8", "bad").to_string(),
            "a.bin: byte 8: bad"
        );
        assert_eq!(
            VerifyFailure::new("a.bin", "", "bad").to_string(),
            "a.bin: bad"
        );
    }
}
