//! What the GPU examples share (`#[path = "common/mod.rs"] mod common;`): seeded
//! random matrices and the median of timings.

/// xorshift64: random codes, and scales/biases in a realistic small range.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in [-0.5, 0.5).
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }
}

/// `n` little-endian BF16 values uniform in [-scale/2, scale/2).
pub fn bf16_bytes(rng: &mut Rng, n: usize, scale: f32) -> Vec<u8> {
    (0..n)
        .flat_map(|_| (((rng.unit() * scale).to_bits() >> 16) as u16).to_le_bytes())
        .collect()
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
