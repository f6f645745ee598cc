//! Mixtral (`MixtralForCausalLM`): the decoder with routed experts named
//! `block_sparse_moe.*` and routed by top-k of the router logits, then a softmax over
//! those k.
