//! Layers the models compose, written once over the backend's ops: the reader of the
//! manifest's architecture axes, rotary embeddings as the config describes them (RoPE
//! scaling, partial rotary, layouts), projections with an optional bias, dense MLPs and
//! the shared expert, multi-head latent attention, and the routed experts' one dispatch.

pub mod axes;
pub mod linear;
pub mod mla;
pub mod mlp;
pub mod moe;
pub mod rope;
