//! The qwen4_exp (Flash-Next) text forward pass, written once against the runtime's
//! [`Backend`](crate::runtime::kernels::Backend) seam plus its extension trait
//! [`seam::Ops`] (the operations only this runner needs), one module per
//! operation of the reference (transformers 5.24
//! `models/qwen4_exp/modeling_qwen4_exp.py`; `tests/data/flashnext_toy/REFERENCE_NOTES.md`
//! gives its math):
//! - [`norm`]: the zero-centred RMSNorm with f32 upcast, the sigmoid-gated norm,
//!   l2 normalisation, activations (pure slice functions the CPU ops are built of);
//! - [`hc`]: hyper-connection read (mix, inject) and write-back, the final mixer;
//! - [`gdn`]: Gated DeltaNet: causal conv state and the delta-rule recurrence;
//! - [`rope`]: the partial rotary embedding's frequencies;
//! - [`attention`]: gated attention and the QSA indexer (block pooling, relu-sum
//!   scores, selection with the tail rule);
//! - [`topk`]: `torch.topk`'s tie-breaking, exactly;
//! - [`ple`]: the PLE n-gram embedding (exact integer row ids, signed-sqrt gating,
//!   dilated conv) over [`rows`], the bounded `pread` row cache;
//! - [`moe`]: routing (f32 softmax, top-k, renormalise) and the sigmoid-gated shared
//!   expert over the install's expert store;
//! - [`seam`]: [`seam::Ops`], the geometry its ops take, and [`seam::Act`];
//! - [`ops`]: the CPU's [`seam::Ops`] (the GPU's is `kernels::gpu::flash`;
//!   `conformance`, a test module, holds a backend's ops to the CPU's);
//! - [`config`], [`install`], [`model`]: the numbers from the manifest, the install
//!   with its row caches, and the forward pass (prefill and cached decode) as a
//!   sequence of op calls, generic over the backend (`FlashModel<'a, B: Ops>`).
//!
//! MTP (`mtp.*`) is not part of generation: the install carries it as a sidecar and
//! nothing here reads it (so the family does not list `multiTokenPrediction` among the
//! axes a runner must implement).

pub mod attention;
pub mod config;
pub mod gdn;
pub mod hc;
pub mod install;
pub mod model;
pub mod moe;
pub mod ple;
