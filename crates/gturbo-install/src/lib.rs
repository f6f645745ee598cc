//! gturbo's installer, in pipeline order:
//!
//! - [`family`]: family files (`families/*.json`), the data that maps tensor names to
//!   roles, transforms and placements.
//! - [`plan`]: what goes where: every tensor's placement, coalesced source reads,
//!   output sizes, the census and the plan fingerprint.
//! - [`transform`]: what happens to bytes (INT4/INT8 affine quantization, through the
//!   format's codec).
//! - [`install`]: resolve, gate and plan (everything `--dry-run` does), then the
//!   streaming, resumable executor that writes and publishes an install.
//! - [`tiktoken`]: a tokenizer shipped as a tiktoken BPE file (Kimi-K2), converted at
//!   install into a `tokenizer.json`.
//! - [`verify`]: `verify-install`: full hashing, the receipt, the quality record (the
//!   cheap layout checks are the format's, shared with the runtime).
//!
//! Depends on [`gturbo_format`] and [`gturbo_source`] (re-exported under their module
//! names), never on the runtime.

pub use gturbo_format as format;
pub use gturbo_format::env;
pub use gturbo_source::{header, source};

pub mod family;
pub mod install;
pub mod plan;
pub mod tiktoken;
pub mod transform;
pub mod verify;
