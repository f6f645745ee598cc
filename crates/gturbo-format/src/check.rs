//! The cheap checks of a `.gturbo` directory, shared by `verify-install` and every load
//! of the runtime: [`open_manifest`] and [`check_layout`] read only the manifest, the
//! resident file's head, the tokenizer JSON files and directory metadata (names, sizes,
//! every number of the layout); [`open_inside`] opens a listed file without following
//! any link. Hashing, the receipt and the quality record are `verify-install`'s.
//!
//! Everything in the directory is hostile input: paths are checked before any
//! filesystem call ([`crate::check_relative_path`]), symlinks are never
//! followed (a listed path through a link is a failure naming the link), sizes are
//! capped before anything is allocated, and each failure names the file and the field
//! or byte offset it is about.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{File, Metadata};
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::digest::is_sha256;
use crate::manifest::{self, MAX_MANIFEST_BYTES, Manifest};
use crate::quality;
use crate::receipt;
use crate::resident::ResidentHead;
use crate::{LayoutError, PAGE, check_relative_path, nofollow, tokenizer};

/// Largest tokenizer JSON file parsed by the cheap checks.
pub const MAX_TOKENIZER_JSON_BYTES: u64 = 256 << 20;
/// Directory entries looked at when listing unexpected files; a hostile directory
/// with millions of entries gets a failure, not an endless walk.
const MAX_WALK_ENTRIES: usize = 100_000;
/// Deepest directory nesting walked.
const MAX_WALK_DEPTH: usize = 16;
/// The `kind` values a manifest file entry may have.
const KINDS: [&str; 4] = ["resident", "experts", "rows", "tokenizer"];
/// The tokenizers-format tokenizer, held to [`tokenizer::check_bounds`].
const TOKENIZER_JSON: &str = "tokenizer/tokenizer.json";
/// Tokenizer files of which an install must have at least one (`tiktoken.model`:
/// Kimi-K2's BPE ranks, which its family copies instead of a `tokenizer.json`).
const TOKENIZER_MODELS: [&str; 4] = [
    TOKENIZER_JSON,
    "tokenizer/tokenizer.model",
    "tokenizer/vocab.json",
    "tokenizer/tiktoken.model",
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

    pub fn layout(file: &str, prefix: &str, e: LayoutError) -> VerifyFailure {
        let at = if prefix.is_empty() {
            e.field
        } else {
            format!("{prefix}.{}", e.field)
        };
        VerifyFailure::new(file, at, e.detail)
    }

    pub fn io(file: &str, e: &io::Error) -> VerifyFailure {
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
pub fn read_manifest(dir: &Path) -> Result<(Vec<u8>, Manifest), VerifyFailure> {
    let name = manifest::FILE_NAME;
    if let Ok(None) = nofollow::kind(&dir.join(name)) {
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
/// ([`crate::axes::check`]). Pure, so the fuzzer drives it directly.
pub fn check_manifest(m: &Manifest) -> Vec<VerifyFailure> {
    let mut out = unsafe_paths(m);
    out.extend(header_errors(m));
    let (by_path, listing) = listing_errors(m);
    out.extend(listing);
    let described = described_errors(m, &by_path, &mut out);
    out.extend(undescribed_errors(m, &described));
    out.extend(tokenizer_and_payload_errors(m, &by_path));
    out.extend(expert_pool_errors(m));
    out.extend(row_pool_errors(m));
    out
}

/// A failure of `manifest.json` at field `at`.
fn manifest_fail(at: String, detail: String) -> VerifyFailure {
    VerifyFailure::new(manifest::FILE_NAME, at, detail)
}

/// The manifest's own records: the architecture axes, by the rules the planner and
/// the runtime apply; the tool; the quantization record's numbers; the sidecar states.
fn header_errors(m: &Manifest) -> Vec<VerifyFailure> {
    let fail = manifest_fail;
    let mut out = Vec::new();
    if let Err(e) = crate::axes::check(&m.arch.axes) {
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
    out
}

/// The listed files by path (the first entry of each), with their index.
type ByPath<'m> = BTreeMap<&'m str, (usize, &'m manifest::ManifestFile)>;

/// The file list: known kinds, hash syntax, no reserved name, sorted and unique.
/// Returns the files by path too, for the checks that follow.
fn listing_errors(m: &Manifest) -> (ByPath<'_>, Vec<VerifyFailure>) {
    let fail = manifest_fail;
    let mut out = Vec::new();
    let mut by_path: ByPath<'_> = BTreeMap::new();
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
    (by_path, out)
}

/// Every described file (the resident file, each pool) is listed with its kind and
/// size, and described once. Pushes its failures to `out`; returns the described paths.
fn described_errors<'m>(
    m: &'m Manifest,
    by_path: &ByPath<'m>,
    out: &mut Vec<VerifyFailure>,
) -> BTreeSet<&'m str> {
    let fail = manifest_fail;
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
    described
}

/// Every listed data file is described, and tokenizer files live under `tokenizer/`.
fn undescribed_errors(m: &Manifest, described: &BTreeSet<&str>) -> Vec<VerifyFailure> {
    let fail = manifest_fail;
    let mut out = Vec::new();
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
    out
}

/// A tokenizer is listed, and the resident payload starts on a page after the head.
fn tokenizer_and_payload_errors(m: &Manifest, by_path: &ByPath<'_>) -> Vec<VerifyFailure> {
    let fail = manifest_fail;
    let mut out = Vec::new();
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
    out
}

/// Each expert pool's geometry, its file name, and its sidecar carried.
fn expert_pool_errors(m: &Manifest) -> Vec<VerifyFailure> {
    let (mf, fail) = (manifest::FILE_NAME, manifest_fail);
    let mut out = Vec::new();
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
    out
}

/// Each row pool's geometry and its file name.
fn row_pool_errors(m: &Manifest) -> Vec<VerifyFailure> {
    let (mf, fail) = (manifest::FILE_NAME, manifest_fail);
    let mut out = Vec::new();
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
        let md = match nofollow::lstat(&path) {
            Ok(Some(md)) => md,
            Ok(None) => {
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
    // A link swapped in after the check fails to open instead of being followed; a
    // FIFO swapped in cannot block the open.
    let file = nofollow::open(&path, std::fs::OpenOptions::new().read(true))
        .map_err(|e| VerifyFailure::io(rel, &e))?;
    let md = file.metadata().map_err(|e| VerifyFailure::io(rel, &e))?;
    if let Some(before) = last
        && !nofollow::same_file(&before, &md)
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

/// Read a whole file of at most `cap` bytes.
pub fn read_capped(file: File, cap: u64) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    file.take(cap + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > cap {
        return Err(io::Error::other(format!("more than {cap} bytes")));
    }
    Ok(bytes)
}
