//! Layers the models compose, written once over the backend's ops: the reader of the
//! manifest's architecture axes, dense MLPs and the shared expert, and the routed
//! experts' one dispatch.

pub mod axes;
pub mod mlp;
pub mod moe;
