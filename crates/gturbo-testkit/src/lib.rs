//! Test and demo support for gturbo, kept out of the shipped crate: a local Hugging
//! Face-compatible hub ([`hub`]), the Qwen3.8-Flash-Next and tiny-family replica
//! generators ([`replica`]), and the one rule for tests that need something the machine
//! may lack ([`skip`]). The `gturbo-dev` binary exposes the hub and the replicas to
//! scripts.
//!
//! The crate does not depend on `gturbo`: what it serves and writes is checked against
//! gturbo by gturbo's own tests, which use this crate as a dev-dependency.

pub mod hub;
pub mod replica;
pub mod skip;
