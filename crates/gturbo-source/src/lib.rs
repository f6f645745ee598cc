//! Where gturbo's bytes come from, and the safetensors headers in them.
//!
//! - [`source`]: an HF-compatible HTTP endpoint or a local snapshot directory, behind
//!   one ranged-read trait; knows nothing about tensors.
//! - [`header`]: safetensors headers read with ranged requests and validated as hostile
//!   input.
//!
//! Depends only on [`gturbo_format`] (re-exported as `format`, with its `env`).

pub use gturbo_format as format;
pub use gturbo_format::env;

pub mod header;
pub mod source;
