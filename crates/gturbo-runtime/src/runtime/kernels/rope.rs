//! Partial rotary embedding, rotate-half (NeoX) layout, as `Qwen4ExpTextRotaryEmbedding`
//! and `apply_rotary_pos_emb` compute it for text.
//!
//! `rd = int(head_dim · partial_rotary_factor)` dimensions rotate (16 of 64 in the toy,
//! 64 of 256 in the real model); the rest pass through. `inv_freq_i = θ^(−2i/rd)` for
//! `i < rd/2`, computed in f32 as torch does; the rotation itself is the seam's
//! [`Backend::rope`](crate::runtime::kernels::Backend::rope) with these `rd/2`
//! frequencies (angle `p · inv_freq_i` in f32, `x1 = x[..rd/2]`, `x2 = x[rd/2..rd]`,
//! `x[..rd] ← (x1·cos − x2·sin, x2·cos + x1·sin)`). Text positions are the same in all
//! three mRoPE sections, so the section recomposition changes nothing.

/// The `rotary_dim / 2` frequencies for base `theta`, in f32 as torch computes them:
/// `1.0 / (base ** (arange(0, rd, 2, float) / rd))`.
pub fn inv_freq(theta: f64, rotary_dim: usize) -> Vec<f32> {
    let theta = theta as f32;
    (0..rotary_dim / 2)
        .map(|i| {
            let e = (2 * i) as f32 / rotary_dim as f32;
            1.0 / theta.powf(e)
        })
        .collect()
}
