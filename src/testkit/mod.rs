//! Test and demo support, shipped in the library so integration tests, benchmarks and
//! the `gturbo-dev` binary share it: a local Hugging Face-compatible hub
//! ([`hub`]) and the Qwen3.8-Flash-Next replica generator ([`replica`]).

pub mod hub;
pub mod replica;
