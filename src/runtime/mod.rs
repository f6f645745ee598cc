//! The embedded runtime that runs an install: the capability gate, the loader
//! (memory-mapped resident weights, expert blobs read into a bounded cache), the
//! decoder runner and the compute kernels.

pub mod kernels;

pub mod experts;
pub mod gate;
pub mod generate;
pub mod load;
pub mod model;
