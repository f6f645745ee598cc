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
//! - [`format`](mod@format): the `.gturbo` on-disk types shared by install, verify and run.
//! - [`install`]: resolve, gate and plan (everything `--dry-run` does), then the
//!   streaming, resumable executor that writes and publishes an install.
//! - [`verify`]: `verify-install`'s checks (cheap layout checks shared with the runtime,
//!   full hashing, the receipt).
//! - [`runtime`]: what runs an install: compute kernels and the model runners.
//! - [`cli`]: argument parsing, output and exit codes.
//! - [`env`](mod@env): every environment variable gturbo reads, with its meaning.
//!
//! Each layer is a crate of its own, so the compiler holds the arrows
//! (docs/ARCHITECTURE.md): `gturbo-format` <- `gturbo-source` <- `gturbo-install`,
//! `gturbo-format` <- `gturbo-runtime`, and this crate, the CLI, on top; it re-exports
//! each layer under its module name.
//!
//! The local test hub and the replica generators are not here: they live in the
//! workspace's `crates/gturbo-testkit`, which only tests, benchmarks and the demo use.

pub mod cli;

pub use gturbo_format as format;
pub use gturbo_format::env;
pub use gturbo_install::{family, install, plan, transform, verify};
pub use gturbo_runtime::runtime;
pub use gturbo_source::{header, source};
