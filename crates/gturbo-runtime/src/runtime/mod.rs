//! The embedded runtime that runs an install: the capability gate, the loader
//! (memory-mapped resident weights, expert blobs read into a bounded cache), the two
//! runners (the decoder, `model`, and Flash-Next, `flash_next`), the compute kernels
//! (CPU, and GPU with the `gpu` feature), text in and out, and sampling.
//!
//! Layering, each module using only those above it: `gate` and `kernels`; `error`
//! (the one [`RunError`] of the entry points); `axes` (the runners' reader of
//! `arch.axes`); `experts` (the slot cache over open pool files); `load` (opens the
//! install's files); `model`; `generate`; `flash_next`.

pub use error::RunError;

pub mod kernels;
pub mod sample;
pub mod text;

pub mod error;
pub mod experts;
pub mod gate;
pub mod generate;
pub mod layers;
pub mod load;
pub mod models;
pub mod paths;
pub mod rows;
#[cfg(test)]
mod testing;
