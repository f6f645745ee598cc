//! What goes where: the install plan, built from the family rules, `config.json` and
//! the validated shard headers alone, before a byte of weights moves.
//!
//! The plan gives every tensor its role, scheme and output placement (resident entry,
//! expert pool slot, row pool region, or exclusion), sizes every output file exactly
//! with the [`crate::format`] types (so a dry run and a real install cannot disagree),
//! coalesces source byte ranges into large reads ([`coalesce`]), and has a fingerprint:
//! the SHA-256 of its canonical JSON.
//!
//! [`build()`] runs in named stages, each a function that returns what it placed:
//! *arch* (the config's axes), *classify* (every tensor's role, as a typed draft),
//! *resident* (the resident file, entries in name order), *expert pools*, *row pools*,
//! then the *copied files*, the *census* and the *reads*. A tensor's destination is
//! set once, by the stage that places it.

mod arch;
mod build;
mod census;
mod classify;
pub mod coalesce;
mod error;
mod experts;
pub mod fp8;
pub mod int4_ct;
pub mod mlx;
pub mod mxfp4;
pub mod placement;
mod policy;
pub mod profile;
mod rows;
mod types;

pub use self::arch::arch_from_config;
pub use self::build::{build, copied_max_bytes};
pub use self::census::{changed, footprint};
pub use self::error::PlanError;
pub use self::types::{
    Arch, COPIED_FILES, Census, CensusRow, CopiedFile, Dest, MAX_COPIED_BYTES, OutputTotals,
    Outputs, PLAN_SCHEMA, PackedPart, Plan, PlanInput, PlanOptions, PlanSource, PlannedShard,
    PlannedTensor, RangeRead, Requant, ScaledFp8, SourcePart,
};
pub use crate::format::pools::{BlobPart, ExpertPart, ExpertPool, RowPool, RowShard};
pub use profile::{AutoChoice, Machine, QuantMode};
