//! Picking the next token from logits: greedy (temperature 0) or temperature sampling
//! restricted by top-k and top-p, from a seeded generator so a run is repeatable.

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplerConfig {
    /// 0 (or below, or not finite) is greedy: the highest logit, lowest id on ties.
    pub temperature: f32,
    /// Keep only the k most likely tokens (`Some(0)` is treated as no limit).
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches p.
    pub top_p: Option<f32>,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 0,
        }
    }
}

/// A small PCG32 (O'Neill's XSH-RR 64/32) instead of a crate: the sequence for a seed
/// is part of the user-visible behaviour (`--seed S` repeats a run), so it must not
/// change when a dependency changes its algorithms or its float conversion.
#[derive(Debug, Clone)]
struct Pcg32 {
    state: u64,
    inc: u64,
}

impl Pcg32 {
    const MUL: u64 = 6_364_136_223_846_793_005;

    fn new(seed: u64) -> Self {
        // The reference seeding: stream 0xda3e39cb94b95bdb, state advanced twice.
        let mut rng = Pcg32 {
            state: 0,
            inc: (0xda3e_39cb_94b9_5bdb_u64 << 1) | 1,
        };
        rng.next_u32();
        rng.state = rng.state.wrapping_add(seed);
        rng.next_u32();
        rng
    }

    fn next_u32(&mut self) -> u32 {
        let old = self.state;
        self.state = old.wrapping_mul(Self::MUL).wrapping_add(self.inc);
        let xorshifted = (((old >> 18) ^ old) >> 27) as u32;
        let rot = (old >> 59) as u32;
        xorshifted.rotate_right(rot)
    }

    /// Uniform in [0, 1) with 24 random bits.
    fn next_unit(&mut self) -> f64 {
        f64::from(self.next_u32() >> 8) / f64::from(1u32 << 24)
    }
}

/// Chooses tokens; one per generated position.
#[derive(Debug, Clone)]
pub struct Sampler {
    cfg: SamplerConfig,
    rng: Pcg32,
    /// Scratch: (id, logit) candidates, reused between calls.
    candidates: Vec<(u32, f32)>,
}

/// Index of the highest logit; the lowest index wins ties; NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best as u32
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Self {
        Sampler {
            cfg,
            rng: Pcg32::new(cfg.seed),
            candidates: Vec::new(),
        }
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// The next token id for these logits (one per vocabulary entry; `logits` must not
    /// be empty).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let t = self.cfg.temperature;
        let top_k = self.cfg.top_k.filter(|&k| k > 0);
        if !(t.is_finite() && t > 0.0) || top_k == Some(1) {
            return argmax(logits);
        }
        let c = &mut self.candidates;
        c.clear();
        c.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, v)| !v.is_nan())
                .map(|(i, &v)| (i as u32, v)),
        );
        if c.is_empty() {
            return 0;
        }
        // Most likely first; the lower id first among equals, so ties are stable.
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if let Some(k) = top_k
            && k < c.len()
        {
            c.select_nth_unstable_by(k - 1, by_logit);
            c.truncate(k);
        }
        c.sort_unstable_by(by_logit);
        // Softmax at temperature t, in f64, relative to the largest logit.
        let max = f64::from(c[0].1);
        let mut probs: Vec<f64> = c
            .iter()
            .map(|&(_, v)| ((f64::from(v) - max) / f64::from(t)).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        let mut keep = probs.len();
        if let Some(p) = self.cfg.top_p
            && p < 1.0
        {
            // The smallest prefix whose mass reaches p (at least one token).
            let mut mass = 0.0;
            for (i, q) in probs.iter().enumerate() {
                mass += q;
                if mass >= f64::from(p) {
                    keep = i + 1;
                    break;
                }
            }
        }
        let kept_mass: f64 = probs[..keep].iter().sum();
        let mut r = self.rng.next_unit() * kept_mass;
        for (i, q) in probs[..keep].iter().enumerate() {
            if r < *q {
                return c[i].0;
            }
            r -= q;
        }
        c[keep - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(temperature: f32, top_k: Option<usize>, top_p: Option<f32>, seed: u64) -> SamplerConfig {
        SamplerConfig {
            temperature,
            top_k,
            top_p,
            seed,
        }
    }

    #[test]
    fn pcg32_matches_the_reference_sequence() {
        // pcg32-global demo (pcg_basic.c): seed 42, sequence 54 gives 0xa15c02b7 first.
        let mut rng = Pcg32 {
            state: 0,
            inc: (54u64 << 1) | 1,
        };
        rng.next_u32();
        rng.state = rng.state.wrapping_add(42);
        rng.next_u32();
        let got: Vec<u32> = (0..3).map(|_| rng.next_u32()).collect();
        assert_eq!(got, [0xa15c_02b7, 0x7b47_f409, 0xba1d_3330]);
    }

    #[test]
    fn greedy_picks_the_highest_logit_and_the_lowest_id_on_ties() {
        let mut s = Sampler::new(cfg(0.0, None, None, 1));
        assert_eq!(s.sample(&[0.1, 2.5, -1.0, 2.4]), 1);
        assert_eq!(s.sample(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(s.sample(&[f32::NAN, -5.0, -6.0]), 1);
        // A negative temperature is greedy too, not an error.
        let mut s = Sampler::new(cfg(-1.0, None, None, 1));
        assert_eq!(s.sample(&[0.0, 0.0, 7.0]), 2);
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let want = argmax(&logits);
        let mut s = Sampler::new(cfg(5.0, Some(1), None, 9));
        for _ in 0..100 {
            assert_eq!(s.sample(&logits), want);
        }
    }

    #[test]
    fn top_k_restricts_to_the_k_best() {
        let logits = [0.0f32, 1.0, 0.5, 0.9, 0.2];
        let mut s = Sampler::new(cfg(1.0, Some(2), None, 3));
        let mut seen = [0usize; 5];
        for _ in 0..2000 {
            seen[s.sample(&logits) as usize] += 1;
        }
        assert_eq!(seen[0] + seen[2] + seen[4], 0, "{seen:?}");
        // exp(1.0) / (exp(1.0) + exp(0.9)) = 0.525: both drawn, 1 slightly more.
        assert!(seen[1] > 900 && seen[3] > 800, "{seen:?}");
    }

    #[test]
    fn top_p_restricts_the_support_and_keeps_relative_frequencies() {
        // Probabilities at temperature 1: 0.5, 0.3, 0.15, 0.05. top_p 0.75 keeps the
        // two most likely (0.5 + 0.3 >= 0.75), renormalised to 0.625 / 0.375.
        let probs = [0.15f32, 0.5, 0.05, 0.3];
        let logits: Vec<f32> = probs.iter().map(|p| p.ln()).collect();
        let mut s = Sampler::new(cfg(1.0, None, Some(0.75), 2024));
        let n = 20_000;
        let mut seen = [0usize; 4];
        for _ in 0..n {
            seen[s.sample(&logits) as usize] += 1;
        }
        assert_eq!(seen[0] + seen[2], 0, "outside the top-p set: {seen:?}");
        let f1 = seen[1] as f64 / n as f64;
        // 0.625 +- 0.02 is about 6 standard deviations for 20k draws.
        assert!(
            (f1 - 0.625).abs() < 0.02,
            "frequency of the best token {f1}"
        );
    }

    #[test]
    fn temperature_sampling_follows_the_softmax() {
        let probs = [0.1f64, 0.2, 0.7];
        let logits: Vec<f32> = probs.iter().map(|p| (p.ln() * 0.5) as f32).collect();
        // Temperature 0.5 doubles the log-probabilities back to the distribution above.
        let mut s = Sampler::new(cfg(0.5, None, None, 7));
        let n = 20_000;
        let mut seen = [0usize; 3];
        for _ in 0..n {
            seen[s.sample(&logits) as usize] += 1;
        }
        for (i, p) in probs.iter().enumerate() {
            let f = seen[i] as f64 / n as f64;
            assert!((f - p).abs() < 0.02, "token {i}: {f} vs {p}");
        }
    }

    #[test]
    fn the_same_seed_repeats_the_sequence_and_another_seed_does_not() {
        let logits: Vec<f32> = (0..64).map(|i| (i % 7) as f32 * 0.1).collect();
        let run = |seed| {
            let mut s = Sampler::new(cfg(1.0, Some(40), Some(0.95), seed));
            (0..64).map(|_| s.sample(&logits)).collect::<Vec<u32>>()
        };
        assert_eq!(run(11), run(11));
        assert_ne!(run(11), run(12));
    }
}
