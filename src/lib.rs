//! gturbo installs very large sharded Hugging Face models onto local disk in the
//! page-aligned `.gturbo` layout that a streaming runtime reads.
//!
//! # Layout
//! The modules follow the data, in pipeline order:
//! - [`source`]: where bytes come from (an HF-compatible HTTP endpoint or a local
//!   snapshot directory); knows nothing about tensors.
//! - [`header`]: safetensors headers read with ranged requests and validated as
//!   hostile input.
//! - [`family`]: family files (`families/*.json`), the data that maps tensor names to
//!   roles, transforms and placements.
//! - [`plan`]: what goes where: every tensor's placement, coalesced source reads, output
//!   sizes, the census and the plan fingerprint.
//! - [`transform`]: what happens to bytes (INT4/INT8 affine quantization).
//! - [`format`]: the `.gturbo` on-disk types shared by install, verify and run.
//! - [`runtime`]: what runs an install: compute kernels and the model runners.
//! - [`cli`]: argument parsing, output and exit codes.
//! - [`testkit`]: a local HF-compatible hub and the replica generator, for tests and demos.

pub mod cli;
pub mod env;
pub mod family;
pub mod format;
pub mod header;
pub mod install;
pub mod plan;
pub mod runtime;
pub mod source;
pub mod testkit;
pub mod transform;
