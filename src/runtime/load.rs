//! Opening an install for `gturbo run`: manifest, capability gate, layout checks, the
//! memory-mapped resident file, and the expert store.
//!
//! Order matters: the manifest is read and the gate applied before any other file
//! is opened, so a refused install costs one small read.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::experts::{ExpertMode, ExpertStore};
use super::gate::{self, GateError, Runner};
use super::kernels::Matrix;
use crate::format::QuantSizes;
use crate::format::manifest::{self, Manifest};
use crate::format::resident::{ResidentEntry, ResidentHead, Span};
use crate::install::lock::InstallLock;
use crate::verify::{self, VerifyFailure};

/// Why an install cannot be run.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The capability gate refused the family or an axis.
    #[error("{0}")]
    Gate(#[from] GateError),
    /// A file of the install is missing, damaged or inconsistent.
    #[error("{file}: {msg}")]
    Invalid {
        /// The file, relative to the install (or absolute).
        file: String,
        /// What is wrong, naming the field.
        msg: String,
    },
    /// An I/O error on a file.
    #[error("{file}: {source}")]
    Io {
        /// The file.
        file: String,
        /// The error.
        source: std::io::Error,
    },
}

impl LoadError {
    /// Whether gturbo refused the install (gate, damage) rather than failed to run.
    pub fn is_refusal(&self) -> bool {
        matches!(self, LoadError::Gate(_) | LoadError::Invalid { .. })
    }

    pub(crate) fn invalid(file: impl Into<String>, msg: impl Into<String>) -> LoadError {
        LoadError::Invalid {
            file: file.into(),
            msg: msg.into(),
        }
    }

    pub(crate) fn io(file: impl Into<String>, source: std::io::Error) -> LoadError {
        LoadError::Io {
            file: file.into(),
            source,
        }
    }
}

/// How to open an install.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    /// Expert residency.
    pub experts: ExpertMode,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            experts: ExpertMode::Slots(16),
        }
    }
}

/// Read `manifest.json` (verify-install's cheap parser: size cap, known keys, safe
/// paths) and apply the capability gate; opens no other file.
pub fn open_gated(dir: &Path) -> Result<(Manifest, &'static Runner), LoadError> {
    let manifest = verify::open_manifest(dir)
        .map_err(|f| LoadError::invalid(f.file.clone(), at_detail(&f)))?;
    let runner = gate::check(&manifest.family, &manifest.arch.required_axes)?;
    Ok((manifest, runner))
}

fn at_detail(f: &VerifyFailure) -> String {
    if f.at.is_empty() {
        f.detail.clone()
    } else {
        format!("{}: {}", f.at, f.detail)
    }
}

/// An opened install: the manifest, its runner, the mapped resident tensors and the
/// expert store.
pub struct Install {
    /// The `.gturbo` directory.
    pub dir: PathBuf,
    /// The manifest.
    pub manifest: Manifest,
    /// The runner the gate chose.
    pub runner: &'static Runner,
    resident: Mmap,
    payload_start: usize,
    tensors: HashMap<String, ResidentEntry>,
    /// Bytes of `resident.bin`.
    pub resident_bytes: u64,
    /// Routed experts.
    pub experts: ExpertStore,
    /// The install's shared lock, held while the install is open (see
    /// [`crate::install::lock`]): no overwrite replaces it under the maps.
    _lock: InstallLock,
}

impl std::fmt::Debug for Install {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Install")
            .field("dir", &self.dir)
            .field("family", &self.manifest.family)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// Open an install: gate, layout, resident map, expert pools.
pub fn open(dir: &Path, opts: LoadOptions) -> Result<Install, LoadError> {
    // The lock first, so everything read below is of one install.
    let lock = InstallLock::shared(dir);
    if let Err(e) = &lock
        && e.kind() == std::io::ErrorKind::NotFound
    {
        // No such directory: the manifest check says so in its own words.
        open_gated(dir)?;
    }
    let lock = lock.map_err(|e| LoadError::io(dir.display().to_string(), e))?;
    let (manifest, runner) = open_gated(dir)?;
    // verify-install's cheap checks (sizes, resident index, pool geometry, tokenizer
    // JSON; no hashing): after them every span sliced below lies inside its file.
    let failures = verify::check_layout(dir, &manifest);
    if let Some(first) = failures.first() {
        let more = match failures.len() {
            1 => String::new(),
            n => format!(" (and {} more; `gturbo verify-install` lists them)", n - 1),
        };
        return Err(LoadError::invalid(
            first.file.clone(),
            format!("{}{more}", at_detail(first)),
        ));
    }
    let rel = &manifest.resident.file;
    let path = safe_join(dir, rel)?;
    let file = File::open(&path).map_err(|e| LoadError::io(rel, e))?;
    let len = file.metadata().map_err(|e| LoadError::io(rel, e))?.len();
    // SAFETY: the map is only read, and no gturbo process truncates or rewrites a
    // published file (`crate::install::lock`): `install --overwrite` refuses while
    // `lock` (this install's shared lock, held as long as the map) is held, and even
    // then replaces a directory only by rename, the receipt by rename too, so the
    // mapped inode keeps its length and bytes. Only a foreign writer truncating
    // `resident.bin` in place could make a read fault (SIGBUS): the mmap contract.
    #[allow(unsafe_code)]
    let map = unsafe { Mmap::map(&file) }.map_err(|e| LoadError::io(rel, e))?;
    let head =
        ResidentHead::parse(&map, len).map_err(|e| LoadError::invalid(rel, e.to_string()))?;
    let (index, payload_start) = (head.index, head.payload_start);
    if payload_start != manifest.resident.payload_start {
        return Err(LoadError::invalid(
            rel,
            format!(
                "payload starts at {payload_start}, manifest resident.payloadStart says {}",
                manifest.resident.payload_start
            ),
        ));
    }
    let mut tensors = HashMap::new();
    for e in index.tensors {
        check_entry(rel, &e, len - payload_start)?;
        tensors.insert(e.name.clone(), e);
    }
    let experts = ExpertStore::open(dir, &manifest, opts.experts)?;
    Ok(Install {
        dir: dir.to_path_buf(),
        manifest,
        runner,
        resident: map,
        payload_start: payload_start as usize,
        tensors,
        resident_bytes: len,
        experts,
        _lock: lock,
    })
}

/// `dir/rel`, refusing names that would leave the install.
pub(crate) fn safe_join(dir: &Path, rel: &str) -> Result<PathBuf, LoadError> {
    let p = Path::new(rel);
    let ok = !rel.is_empty()
        && p.components()
            .all(|c| matches!(c, std::path::Component::Normal(_)));
    if !ok {
        return Err(LoadError::invalid(
            manifest::FILE_NAME,
            format!("file name {rel:?} leaves the install directory"),
        ));
    }
    Ok(dir.join(p))
}

fn check_entry(rel: &str, e: &ResidentEntry, payload: u64) -> Result<(), LoadError> {
    let bad = |msg: String| LoadError::invalid(rel, format!("tensor {}: {msg}", e.name));
    let within = |s: &Option<Span>, what: &str| -> Result<(), LoadError> {
        match s {
            Some(s)
                if s.offset
                    .checked_add(s.len)
                    .is_some_and(|end| end <= payload) =>
            {
                Ok(())
            }
            Some(s) => Err(bad(format!(
                "{what} span {}+{} runs past the payload ({payload} bytes)",
                s.offset, s.len
            ))),
            None => Err(bad(format!("no {what} span"))),
        }
    };
    match e.scheme.bits() {
        None => within(&e.data, "data"),
        Some(bits) => {
            within(&e.weights, "weights")?;
            within(&e.scales, "scales")?;
            within(&e.biases, "biases")?;
            let cols = *e.shape.last().unwrap_or(&0);
            let rows = e.shape.iter().product::<u64>() / cols.max(1);
            let q = QuantSizes::new(rows, cols, bits)
                .ok_or_else(|| bad(format!("shape {:?} cannot be quantized", e.shape)))?;
            let lens = (
                e.weights.map(|s| s.len),
                e.scales.map(|s| s.len),
                e.biases.map(|s| s.len),
            );
            if lens != (Some(q.weights), Some(q.scales), Some(q.biases)) {
                return Err(bad(format!(
                    "span lengths {lens:?} do not match shape {:?}",
                    e.shape
                )));
            }
            Ok(())
        }
    }
}

impl Install {
    fn span(&self, s: Span) -> &[u8] {
        let a = self.payload_start + s.offset as usize;
        &self.resident[a..a + s.len as usize]
    }

    fn entry(&self, name: &str) -> Result<&ResidentEntry, LoadError> {
        self.tensors.get(name).ok_or_else(|| {
            LoadError::invalid(
                &self.manifest.resident.file,
                format!("tensor {name} is not in the resident index"),
            )
        })
    }

    /// Whether the resident file holds `name`.
    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// A 2-D tensor as a matrix view, checked to be `[rows, cols]`.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix<'_>, LoadError> {
        let e = self.entry(name)?;
        let shape: Vec<u64> = vec![rows as u64, cols as u64];
        if e.shape != shape {
            return Err(LoadError::invalid(
                &self.manifest.resident.file,
                format!(
                    "tensor {name} has shape {:?}, the config implies {shape:?}",
                    e.shape
                ),
            ));
        }
        self.matrix_any(name, e, rows, cols)
    }

    /// A 1-D tensor (norm weights) widened to f32, checked to have `len` elements.
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, LoadError> {
        let e = self.entry(name)?;
        if e.shape != [len as u64] {
            return Err(LoadError::invalid(
                &self.manifest.resident.file,
                format!("tensor {name} has shape {:?}, expected [{len}]", e.shape),
            ));
        }
        let m = self.matrix_any(name, e, 1, len)?;
        let mut out = vec![0f32; len];
        super::kernels::Backend::row(&super::kernels::Cpu::new(1), &m, 0, &mut out);
        Ok(out)
    }

    fn matrix_any(
        &self,
        name: &str,
        e: &ResidentEntry,
        rows: usize,
        cols: usize,
    ) -> Result<Matrix<'_>, LoadError> {
        matrix_view(
            &self.manifest.resident.file,
            name,
            rows,
            cols,
            |s| self.span(s),
            e,
        )
    }
}

/// A matrix view of `rows × cols` from a resident entry's spans.
fn matrix_view<'a>(
    file: &str,
    name: &str,
    rows: usize,
    cols: usize,
    span: impl Fn(Span) -> &'a [u8],
    e: &ResidentEntry,
) -> Result<Matrix<'a>, LoadError> {
    let bad = |msg: String| LoadError::invalid(file, format!("tensor {name}: {msg}"));
    let dtype = e.dtype.as_str();
    match e.scheme.bits() {
        Some(bits) => match (e.weights, e.scales, e.biases) {
            (Some(w), Some(s), Some(b)) => Ok(Matrix::Quant {
                bits,
                weights: span(w),
                scales: span(s),
                biases: span(b),
                rows,
                cols,
            }),
            _ => Err(bad("quantized entry without weights/scales/biases".into())),
        },
        None => {
            let data = span(e.data.ok_or_else(|| bad("no data span".into()))?);
            let elem = match dtype {
                "BF16" | "F16" => 2,
                "F32" => 4,
                other => return Err(bad(format!("dtype {other} cannot be computed with"))),
            };
            if data.len() != rows * cols * elem {
                return Err(bad(format!(
                    "{} data bytes for {rows}×{cols} {dtype}",
                    data.len()
                )));
            }
            Ok(match dtype {
                "BF16" => Matrix::Bf16 { data, rows, cols },
                "F16" => Matrix::F16 { data, rows, cols },
                _ => Matrix::F32 { data, rows, cols },
            })
        }
    }
}
