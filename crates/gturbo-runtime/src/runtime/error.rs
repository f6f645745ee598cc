//! Why `gturbo run` cannot run: the one error of the runtime's entry points
//! (`load::open`, `Model::new`, `Model::forward`, `generate`, `ExpertStore::get`).
//!
//! It is split by whose fault it is, because that decides what the user does next and
//! the exit code: the capability gate refused the family ([`GateError`], exit 1), the
//! install is damaged or unreadable ([`InstallFault`], naming the file and the field;
//! exit 1 for damage, 2 for an I/O error), or the caller's input cannot be run
//! ([`InputError`]: the prompt, the token ids, the flags; exit 2), or the compute
//! device failed ([`BackendError`], exit 2). The module depends on nothing else of the
//! runtime but the gate and the kernels' error type, so every other module may use it.

use super::gate::GateError;
use super::kernels::BackendError;

/// Why an install cannot be run, or a prompt cannot be run on it.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The capability gate refused the family or an axis.
    #[error(transparent)]
    Gate(#[from] GateError),
    /// A file of the install is missing, damaged, inconsistent or unreadable.
    #[error(transparent)]
    Install(#[from] InstallFault),
    /// The caller's input (prompt, token ids, flags) cannot be run on this install.
    #[error(transparent)]
    Input(#[from] InputError),
    /// The compute device failed (out of memory, lost); the install and input are fine.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

impl RunError {
    /// Whether gturbo refused the install (gate, damage) rather than failed to run it
    /// (I/O, bad input).
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            RunError::Gate(_) | RunError::Install(InstallFault::Invalid { .. })
        )
    }

    /// A damaged or inconsistent install: `file` (relative to the install) and what
    /// is wrong, naming the field.
    pub(crate) fn invalid(file: impl Into<String>, msg: impl Into<String>) -> RunError {
        RunError::Install(InstallFault::Invalid {
            file: file.into(),
            msg: msg.into(),
        })
    }

    /// An I/O error on `file`.
    pub(crate) fn io(file: impl Into<String>, source: std::io::Error) -> RunError {
        RunError::Install(InstallFault::Io {
            file: file.into(),
            source,
        })
    }
}

/// A file of the install that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum InstallFault {
    /// Missing, damaged or inconsistent content.
    #[error("{file}: {msg}")]
    Invalid {
        /// The file, relative to the install (or absolute).
        file: String,
        /// What is wrong, naming the field.
        msg: String,
    },
    /// An I/O error while opening, mapping or reading the file.
    #[error("{file}: {source}")]
    Io {
        /// The file.
        file: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// Input that cannot be run on an install that is itself fine.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InputError {
    /// The prompt has no tokens.
    #[error("input: the prompt encodes to no tokens")]
    EmptyPrompt,
    /// A token id the model has no embedding for.
    #[error("input: token id {token} is outside the vocabulary ({vocab})")]
    TokenOutsideVocabulary {
        /// The id given.
        token: u32,
        /// The model's vocabulary size.
        vocab: usize,
    },
    /// The prompt and the tokens generated so far need more positions than the model
    /// has (`arch.axes.max_position_embeddings` of the manifest).
    #[error(
        "input: a sequence of {tokens} tokens (prompt and generated) exceeds the model's \
         max_position_embeddings {max}"
    )]
    SequenceTooLong {
        /// Positions the sequence would need.
        tokens: usize,
        /// Positions the model has.
        max: usize,
    },
    /// The caller holds blobs of every expert slot and asks for another one: waiting
    /// for a slot would never end.
    #[error(
        "input: all {slots} expert cache slots are held by this thread while it asks for \
         another expert; give more --expert-cache-slots"
    )]
    ExpertSlotsExhausted {
        /// The slot budget.
        slots: usize,
    },
    /// A session handed to a model other than the one that made it.
    #[error("input: the session belongs to another model")]
    ForeignSession,
    /// Saved session state that does not fit the model (a damaged or foreign snapshot).
    #[error("input: the session snapshot does not fit this model: {0}")]
    BadSnapshot(String),
}
