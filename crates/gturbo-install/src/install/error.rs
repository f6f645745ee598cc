//! Why an install cannot be planned or carried out: one error type for every step,
//! each variant naming what the user needs to act on (the file, the field, the path).

use super::lock;
use crate::family::FamilyError;
use crate::header::ShardError;
use crate::plan::PlanError;
use crate::source::SourceError;

/// Why an install cannot be planned.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// Source failure.
    #[error(transparent)]
    Source(#[from] SourceError),
    /// A shard header failed.
    #[error(transparent)]
    Shard(#[from] ShardError),
    /// The plan could not be made.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// Family problem.
    #[error(transparent)]
    Family(#[from] FamilyError),
    /// The index does not hash to the pin: the hard gate.
    #[error(
        "{file}: SHA-256 mismatch ({origin})\n  Expected: {expected}\n  Computed: {computed}\n\nhint: the repo changed or this is not the pinned snapshot; pass `--index-sha256 {computed}` only if you trust this index"
    )]
    IndexHashMismatch {
        /// The index file.
        file: String,
        /// Where the expectation came from.
        origin: String,
        /// Expected hash.
        expected: String,
        /// Computed hash.
        computed: String,
    },
    /// Local I/O on the output.
    #[error("{path}: {source}")]
    Io {
        /// File or directory.
        path: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// A weight is inf or NaN.
    #[error(
        "{shard}: tensor `{tensor}`: non-finite weight (inf or NaN) at element {element}; refusing to install a defective checkpoint"
    )]
    NonFinite {
        /// The source shard holding it.
        shard: String,
        /// Tensor.
        tensor: String,
        /// Flat element index.
        element: u64,
    },
    /// A transform failed.
    #[error("tensor `{tensor}`: {detail}")]
    Transform {
        /// Tensor.
        tensor: String,
        /// What.
        detail: String,
    },
    /// The partial install was made by another plan.
    #[error(
        "{journal}: the partial install was planned with fingerprint {theirs}, this plan is {ours} ({changed}); refusing to mix them\n\nhint: rerun with the original flags to resume, or pass --discard-partial to start over"
    )]
    PlanChanged {
        /// Journal path.
        journal: String,
        /// Fingerprint in the journal.
        theirs: String,
        /// This plan's fingerprint.
        ours: String,
        /// What differs between the two plans' inputs, by name.
        changed: String,
    },
    /// A source shard's bytes do not hash to the published SHA-256.
    #[error(
        "{shard}: source SHA-256 mismatch: the bytes read are not the published file\n  Expected: {expected}\n  Computed: {computed}\n\nhint: what came from this shard is discarded; rerun to fetch it again"
    )]
    SourceHashMismatch {
        /// Shard.
        shard: String,
        /// Published hash.
        expected: String,
        /// Hash of the bytes read.
        computed: String,
    },
    /// A file copied from the source (config, tokenizer, chat template) does not hash to
    /// what the source published for it.
    #[error(
        "{file}: source {what} mismatch: the bytes read are not the published file\n  Expected: {expected}\n  Computed: {computed}\n\nhint: the source serves other bytes than the ones it publishes a hash for; nothing of them is installed"
    )]
    CopiedHashMismatch {
        /// Path in the repo.
        file: String,
        /// `git blob id` or `SHA-256`.
        what: &'static str,
        /// Published hash.
        expected: String,
        /// Hash of the bytes read.
        computed: String,
    },
    /// `--require-source-hash`, and a copied file whose source published no hash after
    /// all (an answer said the file is in LFS, so the listing's `oid` names its pointer).
    #[error(
        "{file}: no published hash (git blob id or SHA-256) to verify it against (--require-source-hash)"
    )]
    CopiedUnpublished {
        /// Path in the repo.
        file: String,
    },
    /// The output filesystem cannot hold the rest of the install (checked before writing).
    #[error(
        "{path}: not enough free space: the rest of the install needs {needed} bytes (with a reserve), {available} are available\n\nhint: free space or choose another --out; the partial install is kept and resumes"
    )]
    NotEnoughSpace {
        /// Staging directory.
        path: String,
        /// Bytes needed.
        needed: u64,
        /// Bytes available.
        available: u64,
    },
    /// The disk filled up while writing.
    #[error(
        "{path}: no space left on device\n\nhint: the partial install is kept: free space and rerun the same command to resume"
    )]
    NoSpace {
        /// File being written.
        path: String,
    },
    /// The output exists.
    #[error("{path} already exists; pass --overwrite to replace it")]
    OutputExists {
        /// Output path.
        path: String,
    },
    /// `--overwrite` of something gturbo did not make: only a published `.gturbo`
    /// install (its manifest and receipt say so, and every file in it is one the
    /// manifest lists) is ever replaced.
    #[error(
        "{path}: {why}; --overwrite replaces only a .gturbo install that gturbo made, so it is left as it is (it holds {holds})\n\nhint: choose another --out, or move it away yourself"
    )]
    NotOurs {
        /// The output path.
        path: String,
        /// Why it is not gturbo's.
        why: String,
        /// What is in it (a few names and a count).
        holds: String,
    },
    /// The output is the `--from` folder, holds it or lies inside it.
    #[error(
        "--out {out} {how} the source folder --from {from}; refusing (an install there would {harm})\n\nhint: choose an --out outside {from}"
    )]
    OutputOverlapsSource {
        /// The output path (or its staging directory) as given.
        out: String,
        /// `is`, `holds` or `lies inside`.
        how: &'static str,
        /// The source folder, canonical.
        from: String,
        /// What would happen.
        harm: &'static str,
    },
    /// An interrupted run published the output, but it no longer verifies.
    #[error(
        "{path} already exists: a run of this plan published it but stopped before cleaning up, and it does not verify ({failure})\n\nhint: pass --overwrite to install it again"
    )]
    PublishedDamaged {
        /// Output path.
        path: String,
        /// The first failure of the verification.
        failure: String,
    },
    /// Another install holds the lock.
    #[error("{path} is locked by another gturbo install into the same output")]
    Locked {
        /// Lock path.
        path: String,
    },
    /// `--overwrite` of an install that a running model (or a verify) has open.
    #[error(
        "{path}: {}; --overwrite never replaces an install that is in use\n\nhint: let it finish (or stop it), then rerun this command",
        lock::IN_USE
    )]
    InUse {
        /// The published output directory.
        path: String,
    },
    /// The partial install's journal is in a format this build does not read.
    #[error(
        "{journal}: written in journal format {found}, this gturbo reads \"gturbo-install\" version 1; refusing to guess at it\n\nhint: pass --discard-partial to start over"
    )]
    JournalFormat {
        /// Journal path.
        journal: String,
        /// The head's `journal` and `version`.
        found: String,
    },
    /// A link (or another file type) stands where the install creates its own path
    /// beside or inside the output: never followed, never written through.
    #[error(
        "{path}: {what}, where gturbo creates its own file or directory of the install; refusing to follow or write through it\n\nhint: remove it (or choose another --out) and rerun"
    )]
    Planted {
        /// The path.
        path: String,
        /// What stands there (`a symbolic link`, `a FIFO (named pipe)`, …).
        what: String,
    },
    /// A bug.
    #[error("internal error: {0}")]
    Internal(String),
    /// The index or config does not parse or is inconsistent with the shards.
    #[error("{file}: field `{field}`: {detail}")]
    Invalid {
        /// File.
        file: String,
        /// Field.
        field: String,
        /// What is wrong.
        detail: String,
    },
}

impl InstallError {
    /// True when gturbo ran and refused (a hash or pin gate), as opposed to not
    /// being able to run at all. Decides exit code 1 vs 2.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            InstallError::IndexHashMismatch { .. }
                | InstallError::PlanChanged { .. }
                | InstallError::NonFinite { .. }
                | InstallError::SourceHashMismatch { .. }
                | InstallError::CopiedHashMismatch { .. }
                | InstallError::CopiedUnpublished { .. }
        )
    }
}

/// An I/O error on `path`; a full disk becomes [`InstallError::NoSpace`].
pub(super) fn io_err(path: &std::path::Path, e: std::io::Error) -> InstallError {
    if e.kind() == std::io::ErrorKind::StorageFull || e.raw_os_error() == Some(28) {
        return InstallError::NoSpace {
            path: path.display().to_string(),
        };
    }
    InstallError::Io {
        path: path.display().to_string(),
        source: e,
    }
}

pub(super) fn invalid(file: &str, field: &str, detail: impl Into<String>) -> InstallError {
    InstallError::Invalid {
        file: file.to_string(),
        field: field.to_string(),
        detail: detail.into(),
    }
}
