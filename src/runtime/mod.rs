//! The embedded runtime that runs an install.

pub mod kernels;
pub mod sample;
pub mod text;
