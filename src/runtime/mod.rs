//! The embedded runtime: text in and out, sampling.

pub mod sample;
pub mod text;
