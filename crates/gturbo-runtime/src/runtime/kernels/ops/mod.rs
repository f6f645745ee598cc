//! Operations beyond the core [`Backend`] seam, grouped by the math they compute, not
//! by the model that first needed them: elementwise gating, hyper-connections, linear
//! attention, n-gram embeddings, sparse attention. Every backend implements every
//! family (the CPU in `kernels::cpu`, the GPU in `kernels::gpu::ops`), and a model asks
//! for the families it composes; [`Ops`] is all of them, what a model loader takes.
//!
//! A new family's operation goes in the family whose math it is (or a new file here),
//! with its dims type beside it, a CPU implementation and a GPU one, and a conformance
//! test holding the GPU to the CPU.

#[cfg(all(test, feature = "gpu"))]
pub(crate) mod conformance;
pub mod elementwise;
pub mod hyper;
pub mod linear_attention;
pub mod ngram;
pub mod sparse_attention;

pub use elementwise::{Act, ClampedGlu, ElementwiseOps, GateAct};
pub use hyper::{HcDims, HyperConnectionOps};
pub use linear_attention::{GdnDims, LinearAttentionOps};
pub use ngram::NgramOps;
pub use sparse_attention::{AttnRows, IndexerDims, SparseAttentionOps};

use super::Backend;

/// Every operation family: what a backend offers every model.
pub trait Ops:
    Backend + ElementwiseOps + HyperConnectionOps + LinearAttentionOps + NgramOps + SparseAttentionOps
{
}

impl<B> Ops for B where
    B: Backend
        + ElementwiseOps
        + HyperConnectionOps
        + LinearAttentionOps
        + NgramOps
        + SparseAttentionOps
{
}
