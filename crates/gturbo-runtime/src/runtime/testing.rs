//! What the unit tests share: [`Rng`], the seeded generator behind their random inputs.

/// xorshift64: the same inputs on every run.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    /// The next state.
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in [-1, 1).
    pub(crate) fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// `n` values uniform in [-1, 1).
    pub(crate) fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.unit()).collect()
    }

    /// `n` values uniform in [-scale, scale).
    pub(crate) fn scaled(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.unit() * scale).collect()
    }
}
