//! Rotary position embeddings as a pure description: which dims of a head rotate and in
//! which pairs, at which frequencies, how a scaled context changes those frequencies,
//! and the factors YaRN puts on cos/sin and on the softmax. No backend: a runner turns
//! a [`RopeSpec`] into the backend's table (`Backend::rope_table` takes
//! [`RopeSpec::inv_freq`]) and [`RopeSpec::apply`] is the CPU reference for the
//! rotation a kernel computes.
//!
//! # The reference is transformers
//! The frequencies follow `transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS` (and
//! each model's `compute_default_rope_parameters`), step by step: where transformers
//! works on float32 tensors this code does the same f32 operation in the same order
//! (torch casts a Python scalar operand to f32, computes `s / t` as
//! `reciprocal(t) * s`, and `s ** t` as an f32 power), and where transformers works
//! on Python floats (the dynamic base, YaRN's correction range and mscale, llama3's
//! wavelength bounds) this code works in f64. The frequencies then equal
//! transformers' to the rounding of its f32 `pow` (within an ulp);
//! `tests/data/rope_golden.json` (from `scripts/golden/gen_rope_golden.py`) holds the
//! check.
//!
//! # Layouts
//! The rotated dims are the first `rotary_dim` of each head (partial rotary, as
//! transformers' `q[..., :rotary_dim]`); the `rotary_dim / 2` pairs are
//! `(j, j + rotary_dim/2)` in the half-split (rotate-half) layout and `(2j, 2j + 1)`
//! in the interleaved (GPT-J) layout, pair `j` turning at `inv_freq[j]`.
//! transformers' DeepSeek-V3 `apply_rotary_pos_emb_interleave` rotates the same pairs
//! but writes the result de-interleaved (evens then odds); q and k get the same
//! permutation, so their dot products, and attention, are the same as here.

use std::cmp::Ordering;
use std::f64::consts::PI;

use serde_json::{Map, Value};

use crate::format::axes::{Rule, rule};
use crate::format::manifest::Manifest;
use crate::runtime::error::RunError;
use crate::runtime::layers::axes::Axes;

/// `rope_theta` when the config gives none (transformers' `default_theta`).
pub const DEFAULT_THETA: f64 = 10_000.0;
/// Largest scaling factor accepted: published models use at most 40 (DeepSeek-V3);
/// the bound keeps an untrusted factor from making the frequencies meaningless.
pub const MAX_FACTOR: f64 = 65_536.0;
/// Largest YaRN `beta_fast`/`beta_slow`, `mscale`, `mscale_all_dim` or
/// `attention_factor` accepted (published values are at most 32).
pub const MAX_YARN_PARAM: f64 = 1e6;
/// YaRN's `beta_fast` when absent or 0 (transformers: `beta_fast or 32`).
pub const YARN_BETA_FAST: f64 = 32.0;
/// YaRN's `beta_slow` when absent or 0 (transformers: `beta_slow or 1`).
pub const YARN_BETA_SLOW: f64 = 1.0;
/// [`RopeSpec::from_manifest`] reads integer axes below this.
const AXIS_BELOW: u64 = 1 << 32;
/// Added to YaRN's ramp end when it equals its start (transformers' singularity guard).
const YARN_RAMP_EPS: f64 = 0.001;

/// Which dims of a head's rotary part form the rotated pairs: the backends' own
/// [`RopeLayout`] (`HalfSplit`: transformers' `rotate_half`, its default;
/// `Interleaved`: GPT-J, GLM's original layout, DeepSeek-V3 checkpoints with
/// `rope_interleave`, transformers' default for that family).
pub use crate::runtime::kernels::RopeLayout as Layout;
#[cfg(doc)]
use crate::runtime::kernels::RopeLayout;

/// How the frequencies are changed for a context longer than pretraining.
#[derive(Debug, Clone, PartialEq)]
pub enum Scaling {
    /// Plain RoPE: `inv_freq_j = θ^(-2j/d)`.
    None,
    /// Every frequency divided by `factor` (position interpolation).
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// Dynamic NTK: past `original_max` positions the base grows with the sequence.
    Dynamic {
        /// The NTK factor.
        factor: f64,
        /// Positions up to which the frequencies are plain; transformers takes the
        /// config's `max_position_embeddings` (not `original_max_position_embeddings`).
        original_max: usize,
    },
    /// YaRN: frequencies ramped between interpolated and extrapolated by dimension,
    /// and cos/sin scaled by [`RopeSpec::attention_scaling`].
    Yarn {
        /// The context scale (when the config has none:
        /// `max_position_embeddings / original_max`).
        factor: f64,
        /// Pretraining context.
        original_max: usize,
        /// Rotations at which the ramp starts (0 or absent in the config: 32).
        beta_fast: f64,
        /// Rotations at which the ramp ends (0 or absent in the config: 1).
        beta_slow: f64,
        /// Numerator mscale of the attention factor (with `mscale_all_dim`); a 0 in
        /// the config is `None`, as transformers tests it for truth.
        mscale: Option<f64>,
        /// Denominator mscale of the attention factor, and DeepSeek-V3's softmax
        /// correction ([`RopeSpec::softmax_scale`]); 0 in the config is `None`.
        mscale_all_dim: Option<f64>,
        /// An explicit factor on cos/sin, overriding the mscale rules.
        attention_factor: Option<f64>,
        /// Round the correction range out to whole dims (default true; gpt-oss false).
        truncate: bool,
    },
    /// Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth
    /// blend between.
    Llama3 {
        /// Divisor of the long wavelengths.
        factor: f64,
        /// `original_max / low_freq_factor` is the long-wavelength bound.
        low_freq_factor: f64,
        /// `original_max / high_freq_factor` is the short-wavelength bound.
        high_freq_factor: f64,
        /// Pretraining context.
        original_max: usize,
    },
}

/// A rotary embedding: the head it rotates, its base, layout and scaling.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeSpec {
    /// Width of the head whose first `rotary_dim` dims rotate.
    pub head_dim: usize,
    /// Dims that rotate (even, at most `head_dim`).
    pub rotary_dim: usize,
    /// The base θ.
    pub theta: f64,
    /// Which dims pair up.
    pub layout: Layout,
    /// Context scaling.
    pub scaling: Scaling,
}

/// The bound of a count axis in the install's rules (`format::axes`), so a value
/// nested in `rope_scaling` meets the same bound as the top-level axis.
fn count_bound(axis: &str) -> u64 {
    match rule(axis) {
        Rule::Count { max } => max,
        _ => 0,
    }
}

/// The bound of a positive-real axis in the install's rules.
fn positive_bound(axis: &str) -> f64 {
    match rule(axis) {
        Rule::Positive { max } => max,
        _ => 0.0,
    }
}

/// `base ** e` as torch computes it on f32 (the base cast to f32 first); within an
/// ulp of torch's vectorized `pow`.
fn pow_f32(base: f32, e: f32) -> f32 {
    f64::from(base).powf(f64::from(e)) as f32
}

/// `1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))`, the plain frequencies.
fn plain_inv_freq(theta: f64, dim: usize) -> Vec<f32> {
    let base = theta as f32;
    (0..dim / 2)
        .map(|j| 1.0 / pow_f32(base, (2 * j) as f32 / dim as f32))
        .collect()
}

/// YaRN's `get_mscale`: `0.1·mscale·ln(scale) + 1`, 1 for `scale ≤ 1`.
fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// YaRN's `find_correction_dim`: the dim whose wavelength makes `rotations` turns in
/// `original_max` positions.
fn yarn_correction_dim(rotations: f64, dim: usize, theta: f64, original_max: usize) -> f64 {
    (dim as f64 * (original_max as f64 / (rotations * 2.0 * PI)).ln()) / (2.0 * theta.ln())
}

impl RopeSpec {
    /// Plain RoPE over the whole head in the half-split layout (what the decoder
    /// runner does today).
    pub fn plain(head_dim: usize, theta: f64) -> RopeSpec {
        RopeSpec {
            head_dim,
            rotary_dim: head_dim,
            theta,
            layout: Layout::HalfSplit,
            scaling: Scaling::None,
        }
    }

    /// `RopeSpec::from_axes` on `m`'s axes, integer axes below 2^32 (the decoder
    /// runner's bound).
    pub fn from_manifest(m: &Manifest, head_dim: usize) -> Result<RopeSpec, RunError> {
        RopeSpec::from_axes(&Axes::new(m, AXIS_BELOW, "missing"), head_dim)
    }

    /// Read the rotary embedding of a head `head_dim` wide from the manifest's axes:
    /// `rope_theta`, `partial_rotary_factor` or `rotary_dim`, `rope_interleave`,
    /// `max_position_embeddings`, `original_max_position_embeddings` and the
    /// `rope_scaling` object (`rope_parameters`, transformers 5's name, when there is
    /// no `rope_scaling`), whose `rope_type` (legacy `type`) is `default`, `linear`,
    /// `dynamic`, `yarn` or `llama3`. `head_dim` is the caller's: the rotated head
    /// (`head_dim`, or MLA's `qk_rope_head_dim`). Precedence is transformers':
    /// `rope_theta` and `partial_rotary_factor` inside the object win over the top
    /// level; a top-level `original_max_position_embeddings` wins over the object's
    /// (Phi-3), which wins over `max_position_embeddings`. A family whose config
    /// class interleaves by default (DeepSeek-V3) writes `rope_interleave` in its
    /// axes or sets [`RopeSpec::layout`] itself. Every value is checked: an error
    /// names the manifest and the axis (`arch.axes.rope_scaling.factor`).
    pub(crate) fn from_axes(a: &Axes<'_>, head_dim: usize) -> Result<RopeSpec, RunError> {
        let obj = Obj::read(a)?;
        let (theta, axis) = match obj.positive("rope_theta", positive_bound("rope_theta"))? {
            Some(t) => (t, format!("{}.rope_theta", obj.key)),
            None => match a.value("rope_theta") {
                Some(v) => {
                    crate::format::axes::check_value("rope_theta", v)
                        .map_err(|e| a.err("rope_theta", &e))?;
                    (a.f64("rope_theta")?, "rope_theta".to_string())
                }
                None => (DEFAULT_THETA, String::new()),
            },
        };
        if theta <= 1.0 {
            // θ = 1 turns every pair at one speed (YaRN's ramp divides by ln θ);
            // below 1 the frequencies grow with the dim.
            return Err(a.err(&axis, &format!("{theta} is out of range (above 1)")));
        }
        let rotary_dim = rotary_dim(a, &obj, head_dim)?;
        let layout = match a.opt_bool("rope_interleave")? {
            Some(true) => Layout::Interleaved,
            _ => Layout::HalfSplit,
        };
        let max_positions = a.opt_usize("max_position_embeddings")?;
        let scaling = obj.scaling(a, max_positions)?;
        if matches!(scaling, Scaling::Dynamic { .. }) && rotary_dim <= 2 {
            // The dynamic base has the exponent d / (d - 2).
            return Err(obj.err(
                obj.type_key,
                &format!("dynamic needs more than 2 rotary dims (the head rotates {rotary_dim})"),
            ));
        }
        Ok(RopeSpec {
            head_dim,
            rotary_dim,
            theta,
            layout,
            scaling,
        })
    }

    /// Number of rotated pairs (and of frequencies).
    pub fn pairs(&self) -> usize {
        self.rotary_dim / 2
    }

    /// The `rotary_dim / 2` frequencies for a sequence spanning `seq_len` positions
    /// (its largest position + 1). Only [`Scaling::Dynamic`] depends on `seq_len`:
    /// transformers recomputes its frequencies whenever the longest sequence seen so
    /// far grows past `original_max` (cached keys keep the rotation they were given),
    /// so a runner passes that longest length.
    pub fn inv_freq(&self, seq_len: usize) -> Vec<f32> {
        let dim = self.rotary_dim;
        match self.scaling {
            Scaling::None => plain_inv_freq(self.theta, dim),
            Scaling::Linear { factor } => {
                let f = factor as f32;
                plain_inv_freq(self.theta, dim)
                    .into_iter()
                    .map(|x| x / f)
                    .collect()
            }
            Scaling::Dynamic {
                factor,
                original_max,
            } => {
                // Python floats: base · (factor·L/L₀ − (factor − 1))^(d/(d−2)), L ≥ L₀.
                let len = seq_len.max(original_max) as f64;
                let d = dim as f64;
                let grow =
                    (factor * len / original_max as f64 - (factor - 1.0)).powf(d / (d - 2.0));
                plain_inv_freq(self.theta * grow, dim)
            }
            Scaling::Yarn {
                factor,
                original_max,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                let mut low = yarn_correction_dim(beta_fast, dim, self.theta, original_max);
                let mut high = yarn_correction_dim(beta_slow, dim, self.theta, original_max);
                if truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                // transformers bounds the range by the rotary dim, not the pair count.
                let low = low.max(0.0);
                let mut high = high.min((dim - 1) as f64);
                if low == high {
                    high += YARN_RAMP_EPS;
                }
                let (start, span) = (low as f32, (high - low) as f32);
                let base = self.theta as f32;
                let f = factor as f32;
                (0..dim / 2)
                    .map(|j| {
                        let pos_freq = pow_f32(base, (2 * j) as f32 / dim as f32);
                        let extrapolation = 1.0 / pos_freq;
                        let interpolation = 1.0 / (f * pos_freq);
                        let ramp = ((j as f32 - start) / span).clamp(0.0, 1.0);
                        let keep = 1.0 - ramp;
                        interpolation * (1.0 - keep) + extrapolation * keep
                    })
                    .collect()
            }
            Scaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max,
            } => {
                let low_wavelen = (original_max as f64 / low_freq_factor) as f32;
                let high_wavelen = (original_max as f64 / high_freq_factor) as f32;
                let two_pi = (2.0 * PI) as f32;
                let old = original_max as f32;
                let f = factor as f32;
                let lo = low_freq_factor as f32;
                let span = (high_freq_factor - low_freq_factor) as f32;
                plain_inv_freq(self.theta, dim)
                    .into_iter()
                    .map(|x| {
                        let wavelen = (1.0 / x) * two_pi;
                        let kept = if wavelen > low_wavelen { x / f } else { x };
                        let smooth = ((1.0 / wavelen) * old - lo) / span;
                        let smoothed = (1.0 - smooth) * kept / f + smooth * kept;
                        // transformers' `~(w < high) * ~(w > low)`, NaN counting as medium.
                        let medium = wavelen.partial_cmp(&high_wavelen) != Some(Ordering::Less)
                            && wavelen.partial_cmp(&low_wavelen) != Some(Ordering::Greater);
                        if medium { smoothed } else { kept }
                    })
                    .collect()
            }
        }
    }

    /// The factor on cos and sin (transformers' `attention_scaling`): for YaRN the
    /// explicit `attention_factor`, else `mscale(factor, mscale) /
    /// mscale(factor, mscale_all_dim)` when both are set (1 for DeepSeek-V3's
    /// 1 / 1), else `mscale(factor, 1) = 0.1·ln(factor) + 1` (gpt-oss); 1 otherwise.
    pub fn attention_scaling(&self) -> f32 {
        match self.scaling {
            Scaling::Yarn {
                factor,
                mscale,
                mscale_all_dim,
                attention_factor,
                ..
            } => attention_factor.unwrap_or_else(|| match (mscale, mscale_all_dim) {
                (Some(m), Some(all)) => yarn_mscale(factor, m) / yarn_mscale(factor, all),
                _ => yarn_mscale(factor, 1.0),
            }) as f32,
            _ => 1.0,
        }
    }

    /// The softmax scale `scale` (`1/√qk_head_dim`) as DeepSeek-V3's attention
    /// corrects it (`yarn_apply_mscale`): `scale · m · m` with
    /// `m = mscale(factor, mscale_all_dim)` when YaRN has `mscale_all_dim`, `scale`
    /// otherwise. It is the model's rule, not RoPE's (gpt-oss has no
    /// `mscale_all_dim`), so only a runner of that family calls it.
    pub fn softmax_scale(&self, scale: f64) -> f64 {
        match self.scaling {
            Scaling::Yarn {
                factor,
                mscale_all_dim: Some(all),
                ..
            } => {
                let m = yarn_mscale(factor, all);
                scale * m * m
            }
            _ => scale,
        }
    }

    /// Rotate `x` (`[tokens, heads, head_dim]`, token `i` at position `pos + i`) in
    /// place, with the frequencies of a sequence spanning `pos + tokens` positions.
    pub fn apply(&self, x: &mut [f32], heads: usize, pos: usize) {
        let tokens = x.len() / (heads * self.head_dim).max(1);
        let freqs = self.inv_freq(pos + tokens);
        self.apply_with(&freqs, x, heads, pos);
    }

    /// [`RopeSpec::apply`] with given frequencies. As transformers: the angle is the
    /// f32 product `p·inv_freq_j`, `c = cos(angle)·attention_scaling` and
    /// `s = sin(angle)·attention_scaling` rounded to f32, and the pair `(a, b)`
    /// becomes `(a·c − b·s, b·c + a·s)`; dims from `rotary_dim` on are left alone.
    ///
    /// # Panics
    /// When `inv_freq` is not `rotary_dim / 2` long, `rotary_dim` exceeds
    /// `head_dim`, or `x` is not whole tokens: caller bugs, not input.
    pub fn apply_with(&self, inv_freq: &[f32], x: &mut [f32], heads: usize, pos: usize) {
        let half = self.pairs();
        assert_eq!(inv_freq.len(), half, "rope: one frequency per pair");
        assert!(
            self.rotary_dim <= self.head_dim,
            "rope: rotary dims exceed the head"
        );
        let row = heads * self.head_dim;
        assert!(
            row > 0 && x.len().is_multiple_of(row),
            "rope: x is not whole tokens"
        );
        let scale = self.attention_scaling();
        for (i, token) in x.chunks_exact_mut(row).enumerate() {
            let p = (pos + i) as f32;
            for head in token.chunks_exact_mut(self.head_dim) {
                for (j, &f) in inv_freq.iter().enumerate() {
                    let angle = f64::from(p * f);
                    let c = angle.cos() as f32 * scale;
                    let s = angle.sin() as f32 * scale;
                    let (ia, ib) = match self.layout {
                        Layout::HalfSplit => (j, j + half),
                        Layout::Interleaved => (2 * j, 2 * j + 1),
                    };
                    let (a, b) = (head[ia], head[ib]);
                    head[ia] = a * c - b * s;
                    head[ib] = b * c + a * s;
                }
            }
        }
    }
}

/// The rotated dims: `int(head_dim · partial_rotary_factor)` (the object's factor,
/// else the top level's), or an explicit `rotary_dim`, else the whole head.
fn rotary_dim(a: &Axes<'_>, obj: &Obj<'_>, head_dim: usize) -> Result<usize, RunError> {
    let factor = match obj.positive("partial_rotary_factor", 1.0)? {
        Some(f) => Some((f, format!("{}.partial_rotary_factor", obj.key))),
        None => match a.opt_f64("partial_rotary_factor")? {
            Some(f) if f > 1.0 => {
                return Err(a.err(
                    "partial_rotary_factor",
                    &format!("{f} is out of range (at most 1)"),
                ));
            }
            Some(f) => Some((f, "partial_rotary_factor".to_string())),
            None => None,
        },
    };
    let explicit = a.opt_usize("rotary_dim")?;
    let (dim, axis) = match (factor, explicit) {
        // Python's int() truncates the product.
        (Some((f, axis)), None) => ((head_dim as f64 * f) as usize, axis),
        (Some((f, axis)), Some(r)) => {
            let d = (head_dim as f64 * f) as usize;
            if d != r {
                return Err(a.err(
                    "rotary_dim",
                    &format!("{r} disagrees with {axis} {f} of head width {head_dim} ({d})"),
                ));
            }
            (d, axis)
        }
        (None, Some(r)) => (r, "rotary_dim".to_string()),
        (None, None) => (head_dim, "head_dim".to_string()),
    };
    if dim == 0 || dim % 2 != 0 || dim > head_dim {
        return Err(a.err(
            &axis,
            &format!(
                "{dim} rotary dims of a head {head_dim} wide; RoPE rotates pairs \
                 (even, non-zero, at most the head)"
            ),
        ));
    }
    Ok(dim)
}

/// The `rope_scaling` object (or `rope_parameters`), absent being empty.
struct Obj<'a> {
    a: &'a Axes<'a>,
    /// The axis it came from, for errors.
    key: &'static str,
    /// `rope_type`, or the legacy `type` when that is the one given.
    type_key: &'static str,
    map: Option<&'a Map<String, Value>>,
}

impl<'a> Obj<'a> {
    fn read(a: &'a Axes<'a>) -> Result<Obj<'a>, RunError> {
        let (key, v) = match (a.value("rope_scaling"), a.value("rope_parameters")) {
            (Some(v), _) => ("rope_scaling", Some(v)),
            (None, Some(v)) => ("rope_parameters", Some(v)),
            (None, None) => ("rope_scaling", None),
        };
        let map = match v {
            None => None,
            Some(Value::Object(m)) => Some(m),
            Some(other) => return Err(a.err(key, &format!("expected an object, found {other}"))),
        };
        let type_key = match map {
            Some(m) if !m.contains_key("rope_type") && m.contains_key("type") => "type",
            _ => "rope_type",
        };
        Ok(Obj {
            a,
            key,
            type_key,
            map,
        })
    }

    fn err(&self, field: &str, msg: &str) -> RunError {
        self.a.err(&format!("{}.{field}", self.key), msg)
    }

    fn get(&self, field: &str) -> Option<&'a Value> {
        self.map?.get(field).filter(|v| !v.is_null())
    }

    /// A finite number in `[min, max]` (`min` excluded when `open`), when present.
    fn real(&self, field: &str, min: f64, open: bool, max: f64) -> Result<Option<f64>, RunError> {
        let Some(v) = self.get(field) else {
            return Ok(None);
        };
        let Some(x) = v.as_f64() else {
            return Err(self.err(field, &format!("expected a number, found {v}")));
        };
        let low_ok = if open { x > min } else { x >= min };
        if !(x.is_finite() && low_ok && x <= max) {
            let side = if open { "above" } else { "at least" };
            return Err(self.err(
                field,
                &format!("{v} is out of range ({side} {min}, at most {max})"),
            ));
        }
        Ok(Some(x))
    }

    /// A finite number in `(0, max]`, when present.
    fn positive(&self, field: &str, max: f64) -> Result<Option<f64>, RunError> {
        self.real(field, 0.0, true, max)
    }

    /// A finite number in `[0, max]`, 0 read as absent (transformers tests these
    /// for truth: `beta_fast or 32`, `if mscale and mscale_all_dim`).
    fn truthy(&self, field: &str) -> Result<Option<f64>, RunError> {
        Ok(self
            .real(field, 0.0, false, MAX_YARN_PARAM)?
            .filter(|&x| x != 0.0))
    }

    fn required(&self, field: &str, v: Option<f64>, rope_type: &str) -> Result<f64, RunError> {
        v.ok_or_else(|| self.err(field, &format!("missing (rope_type {rope_type} needs it)")))
    }

    /// A position count in `1..=` the `max_position_embeddings` bound, when present.
    fn positions(&self, field: &str) -> Result<Option<usize>, RunError> {
        let Some(v) = self.get(field) else {
            return Ok(None);
        };
        let max = count_bound("max_position_embeddings");
        v.as_u64()
            .filter(|&n| n >= 1 && n <= max)
            .map(|n| Some(n as usize))
            .ok_or_else(|| {
                self.err(
                    field,
                    &format!("{v} is not a position count (an integer from 1 to {max})"),
                )
            })
    }

    fn flag(&self, field: &str) -> Result<Option<bool>, RunError> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.err(field, &format!("expected true or false, found {v}"))),
        }
    }

    /// The pretraining context of YaRN and llama3, by transformers' precedence.
    fn original_max(&self, a: &Axes<'_>, max_positions: Option<usize>) -> Result<usize, RunError> {
        const FIELD: &str = "original_max_position_embeddings";
        if let Some(n) = a.opt_usize(FIELD)? {
            return Ok(n);
        }
        self.positions(FIELD)?.or(max_positions).ok_or_else(|| {
            self.err(
                FIELD,
                "missing, and there is no max_position_embeddings to take instead",
            )
        })
    }

    fn scaling(&self, a: &Axes<'_>, max_positions: Option<usize>) -> Result<Scaling, RunError> {
        if self.map.is_none() {
            return Ok(Scaling::None);
        }
        let rope_type = match self.get(self.type_key) {
            None => "default",
            Some(Value::String(s)) => s.as_str(),
            Some(v) => {
                return Err(self.err(self.type_key, &format!("expected a string, found {v}")));
            }
        };
        let factor = self.positive("factor", MAX_FACTOR)?;
        Ok(match rope_type {
            "default" => Scaling::None,
            "linear" => Scaling::Linear {
                factor: self.required("factor", factor, rope_type)?,
            },
            "dynamic" => Scaling::Dynamic {
                factor: self.required("factor", factor, rope_type)?,
                original_max: max_positions.ok_or_else(|| {
                    a.err(
                        "max_position_embeddings",
                        "missing (rope_scaling dynamic scales past it)",
                    )
                })?,
            },
            "yarn" => {
                let original_max = self.original_max(a, max_positions)?;
                let factor = match (factor, max_positions) {
                    (Some(f), _) => f,
                    (None, Some(m)) if m as f64 / original_max as f64 <= MAX_FACTOR => {
                        m as f64 / original_max as f64
                    }
                    _ => {
                        return Err(self.err(
                            "factor",
                            "missing, and max_position_embeddings / \
                             original_max_position_embeddings cannot stand in",
                        ));
                    }
                };
                let attention_factor = self.positive("attention_factor", MAX_YARN_PARAM)?;
                Scaling::Yarn {
                    factor,
                    original_max,
                    beta_fast: self.truthy("beta_fast")?.unwrap_or(YARN_BETA_FAST),
                    beta_slow: self.truthy("beta_slow")?.unwrap_or(YARN_BETA_SLOW),
                    mscale: self.truthy("mscale")?,
                    mscale_all_dim: self.truthy("mscale_all_dim")?,
                    attention_factor,
                    truncate: self.flag("truncate")?.unwrap_or(true),
                }
            }
            "llama3" => {
                let low = self.positive("low_freq_factor", MAX_FACTOR)?;
                let high = self.positive("high_freq_factor", MAX_FACTOR)?;
                let low_freq_factor = self.required("low_freq_factor", low, rope_type)?;
                let high_freq_factor = self.required("high_freq_factor", high, rope_type)?;
                if high_freq_factor <= low_freq_factor {
                    return Err(self.err(
                        "high_freq_factor",
                        &format!(
                            "{high_freq_factor} must exceed low_freq_factor {low_freq_factor} \
                             (the blend divides by their difference)"
                        ),
                    ));
                }
                Scaling::Llama3 {
                    factor: self.required("factor", factor, rope_type)?,
                    low_freq_factor,
                    high_freq_factor,
                    original_max: self.original_max(a, max_positions)?,
                }
            }
            other => {
                return Err(self.err(
                    self.type_key,
                    &format!(
                        "RoPE scaling {other:?} is not implemented (gturbo knows default, \
                         linear, dynamic, yarn, llama3)"
                    ),
                ));
            }
        })
    }
}

#[cfg(test)]
mod tests;
