//! The end of a decoder stack: the final RMSNorm and the output head over the last
//! position (or every position), the logits read back to the host.

use crate::runtime::error::RunError;
use crate::runtime::kernels::{Backend, NormGain};

/// The final norm and the head a model ends with.
pub struct OutputHead<'m, 'w, B: Backend> {
    /// The final RMSNorm's weight.
    pub norm: &'m B::Buf,
    /// Its epsilon.
    pub eps: f32,
    /// How its weight applies (`w` or `1 + w`).
    pub gain: NormGain,
    /// `lm_head`, or the embedding when the head is tied.
    pub head: &'m B::Weights<'w>,
    /// Hidden width (a row of `x`).
    pub hidden: usize,
    /// Vocabulary (a row of logits).
    pub vocab: usize,
}

impl<B: Backend> OutputHead<'_, '_, B> {
    /// The logits of the `n` rows of `x` when `all` (`n × vocab`), else of the last
    /// row only (`vocab`).
    pub fn logits(&self, b: &B, x: B::Buf, n: usize, all: bool) -> Result<Vec<f32>, RunError> {
        let h = self.hidden;
        let (rows, m) = if all {
            (x, n)
        } else {
            (b.copy_rows(&x, h, n - 1..n)?, 1)
        };
        let mut normed = b.zeros(m * h)?;
        b.rms_norm(&rows, self.norm, self.eps, self.gain, &mut normed)?;
        let mut logits = b.zeros(m * self.vocab)?;
        b.linear(self.head, &normed, &mut logits)?;
        Ok(b.read_owned(logits)?)
    }
}
