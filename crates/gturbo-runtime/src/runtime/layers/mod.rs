//! Layers the models compose, written once over the backend's ops: the reader of the
//! manifest's architecture axes, rotary embeddings as the config describes them (RoPE
//! scaling, partial rotary, layouts), projections with an optional bias, dense MLPs and
//! the shared expert, multi-head latent attention, the routed experts' one dispatch, the
//! softmax-routed sparse MoE block with its gated shared expert (`sparse_moe`), and Gated
//! DeltaNet linear attention (`gdn`): Flash-Next and Qwen3-Next compose the last two;
//! and the final norm and output head (`head`).

pub mod axes;
pub mod gdn;
pub mod head;
pub mod linear;
pub mod mla;
pub mod mlp;
pub mod moe;
pub mod rope;
pub mod sparse_moe;
