//! The qwen4_exp (Flash-Next) text model: composition only, over the core
//! [`Backend`](crate::runtime::kernels::Backend) ops and the operation families of
//! [`kernels::ops`](crate::runtime::kernels::ops) (whose CPU implementations, in
//! `kernels/cpu/`, are the slice math of the reference), one module per block of the
//! reference (transformers 5.24 `models/qwen4_exp/modeling_qwen4_exp.py`;
//! `tests/data/flashnext_toy/REFERENCE_NOTES.md` gives its math):
//! - [`hc`]: hyper-connection read (mix, inject) and write-back, the final mixer;
//! - `layers::gdn`: Gated DeltaNet (the causal conv and the delta rule are
//!   `kernels::ops::LinearAttentionOps`), shared with Qwen3-Next;
//! - [`attention`]: gated attention and the QSA indexer (block pooling, relu-sum
//!   scores, selection with `torch.topk`'s tie rule, `kernels::topk`);
//! - [`ple`]: the PLE n-gram embedding (exact integer row ids, signed-sqrt gating,
//!   dilated conv) over the install's row caches (`runtime::rows`);
//! - `layers::sparse_moe`: the routed experts through `layers::moe` (f32 softmax, top-k,
//!   renormalise) and the sigmoid-gated shared expert (`layers::mlp`), shared with
//!   Qwen3-Next;
//! - [`config`], [`install`], [`model`]: the numbers from the manifest, opening the
//!   install, and the forward pass (prefill and cached decode) as a sequence of op
//!   calls, generic over the backend (`FlashModel<'a, B: Ops>`).
//!
//! MTP (`mtp.*`) is not part of generation: the install carries it as a sidecar and
//! nothing here reads it (so the family does not list `multiTokenPrediction` among the
//! axes a runner must implement).

pub mod attention;
pub mod config;
pub mod hc;
pub mod install;
pub mod model;
pub mod ple;
