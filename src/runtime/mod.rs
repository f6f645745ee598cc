//! The embedded runtime that runs an install.

pub mod kernels;
