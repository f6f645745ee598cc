//! N-gram embeddings: the gate that mixes a hashed n-gram row embedding into the
//! streams (Flash-Next's PLE).

use super::hyper::HcDims;
use crate::runtime::kernels::{Backend, OpResult};

/// N-gram embedding operations over a backend's tensors.
pub trait NgramOps: Backend {
    /// The PLE gate for `[n, S·H]` `key` and `qry` and `[n, H]` `value`: per stream
    /// `g = Σ key_j ⊙ qry_j / √H`, `g = sign(g) · √max(|g|, 1e-6)`, and
    /// `out[t, j] = sigmoid(g) · value[t]`.
    fn ple_gate(
        &self,
        key: &Self::Buf,
        qry: &Self::Buf,
        value: &Self::Buf,
        d: HcDims,
        out: &mut Self::Buf,
    ) -> OpResult;
}
