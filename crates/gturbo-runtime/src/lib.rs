//! gturbo's runtime: what runs an install (the capability gate, the loader, compute
//! kernels on the CPU and, with the `gpu` feature, on wgpu, and the model runners).
//!
//! Depends only on [`gturbo_format`] (re-exported as `format`, with its `env`): the
//! runtime reads installs, it never installs, and is the only crate that depends on
//! wgpu.

pub use gturbo_format as format;
pub use gturbo_format::env;

pub mod runtime;
