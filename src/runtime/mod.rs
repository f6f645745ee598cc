//! The embedded runtime that runs an install: the capability gate, the loader
//! (memory-mapped resident weights, expert blobs read into a bounded cache), the
//! decoder runner, the compute kernels, text in and out, and sampling.

pub mod kernels;
pub mod sample;
pub mod text;

pub mod experts;
pub mod flash_next;
pub mod gate;
pub mod generate;
pub mod load;
pub mod model;
