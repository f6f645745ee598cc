//! The qwen4_exp (Flash-Next) text forward pass on the CPU, as pure functions over f32
//! slices and the kernels' [`Matrix`](crate::runtime::kernels::Matrix) products, one
//! module per operation of the reference (transformers 5.24
//! `models/qwen4_exp/modeling_qwen4_exp.py`; `tests/data/flashnext_toy/REFERENCE_NOTES.md`
//! gives its math):
//! - [`norm`]: the zero-centred RMSNorm with f32 upcast, the sigmoid-gated norm,
//!   l2 normalisation, activations;
//! - [`hc`]: hyper-connection read (mix, inject) and write-back, the final mixer;
//! - [`gdn`]: Gated DeltaNet: causal conv state and the delta-rule recurrence;
//! - [`rope`]: partial rotary embedding, rotate-half;
//! - [`attention`]: gated attention and the QSA indexer (block pooling, relu-sum
//!   scores, selection with the tail rule);
//! - [`topk`]: `torch.topk`'s tie-breaking, exactly;
//! - [`ple`]: the PLE n-gram embedding (exact integer row ids, signed-sqrt gating,
//!   dilated conv) over [`rows`], the bounded `pread` row cache;
//! - [`moe`]: routing (f32 softmax, top-k, renormalise) and the sigmoid-gated shared
//!   expert over the install's expert store;
//! - [`config`], [`install`], [`model`]: the numbers from the manifest, the install
//!   opened without the capability gate (not wired to `gturbo run` yet), and the
//!   forward pass (prefill and cached decode) as a sequence of those op calls.
//!
//! MTP (`mtp.*`) is not part of generation: the install carries it as a sidecar and
//! nothing here reads it.

pub mod attention;
pub mod config;
pub mod gdn;
pub mod hc;
pub mod install;
pub mod model;
pub mod moe;
pub mod norm;
pub mod ple;
pub mod rope;
pub mod rows;
pub mod topk;
