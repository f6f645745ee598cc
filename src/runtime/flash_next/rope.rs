//! Partial rotary embedding, rotate-half (NeoX) layout, as `Qwen4ExpTextRotaryEmbedding`
//! and `apply_rotary_pos_emb` compute it for text.
//!
//! `rd = int(head_dim · partial_rotary_factor)` dimensions rotate (16 of 64 in the toy,
//! 64 of 256 in the real model); the rest pass through. `inv_freq_i = θ^(−2i/rd)` for
//! `i < rd/2`, computed in f32 as torch does; the angle is the f32 product `p ·
//! inv_freq_i`. With `x1 = x[..rd/2]`, `x2 = x[rd/2..rd]`:
//! `x[..rd] ← (x1·cos − x2·sin, x2·cos + x1·sin)`. Text positions are the same in all
//! three mRoPE sections, so the section recomposition changes nothing.

/// The rotary tables of one model.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    /// `inv_freq` `[rd/2]`.
    pub inv_freq: Vec<f32>,
    /// Rotated dimensions `rd` (even).
    pub rotary_dim: usize,
}

impl Rope {
    /// Tables for `rotary_dim` rotated dimensions with base `theta`.
    pub fn new(theta: f64, rotary_dim: usize) -> Rope {
        let theta = theta as f32;
        let inv_freq = (0..rotary_dim / 2)
            .map(|i| {
                // torch: 1.0 / (base ** (arange(0, rd, 2, float) / rd)), all f32.
                let e = (2 * i) as f32 / rotary_dim as f32;
                1.0 / theta.powf(e)
            })
            .collect();
        Rope {
            inv_freq,
            rotary_dim,
        }
    }

    /// Rotate the first `rd` dimensions of every `head_dim`-wide head in `x` for
    /// position `pos`.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, pos: usize) {
        let half = self.rotary_dim / 2;
        assert!(
            self.rotary_dim <= head_dim && x.len().is_multiple_of(head_dim),
            "rope: lengths"
        );
        let (cos, sin): (Vec<f32>, Vec<f32>) = self
            .inv_freq
            .iter()
            .map(|&f| {
                let ang = pos as f32 * f;
                (ang.cos(), ang.sin())
            })
            .unzip();
        for head in x.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let (x1, x2) = (head[i], head[half + i]);
                head[i] = x1 * cos[i] - x2 * sin[i];
                head[half + i] = x2 * cos[i] + x1 * sin[i];
            }
        }
    }
}
