//! Affine quantization at every width and group size MLX writes (2, 3, 4, 5, 6 and 8
//! bits × groups of 32, 64 and 128), bit-exact with MLX
//! `mx.quantize(w, group_size, bits)` (affine mode, CPU path), in bounded scratch;
//! and the matching unpacking and dequantization.
//!
//! This module owns the arithmetic and the byte layout of one quantized matrix; it
//! knows nothing about tensor names, files or rows beyond "a row is `cols` elements".
//! Callers (the install pipeline) stream a tensor through [`quantize_rows`] a tile of
//! whole rows at a time and add the tensor name and row offset to any error. A
//! [`Spec`] names the width and group; a bare [`Bits`] means group 64, gturbo's own
//! INT4/INT8 installs.
//!
//! # The formula
//! The semantics of MLX's CPU affine `quantize` (`mlx/backend/cpu/quantized.cpp`),
//! checked bit for bit against MLX 0.32.4 (`scripts/golden/gen_golden_widths.py`,
//! `scripts/peers/mlx_crosscheck.py`): groups are `group` consecutive elements along the
//! last axis. Everything is computed in f32 (BF16 widens exactly), with
//! `levels = 2^bits - 1`:
//! 1. `min`, `max` over the group. (MLX's comparisons skip NaN; gturbo refuses groups
//!    holding ±inf or NaN instead, see [`QuantError::NonFinite`].)
//! 2. `scale = max((max - min) / levels, 1e-7)`. The *edge* is `min` when
//!    `|min| > |max|` (strictly), else `max`; when the edge is `max`, `scale = -scale`.
//! 3. `q0 = rint(edge / scale)` (round half to even). If `q0 != 0`:
//!    `scale = edge / q0`, `bias = edge`; otherwise `bias = 0` and the scale stays.
//!    This puts 0.0 on the code grid (at code `-q0`), so zeros dequantize to (nearly,
//!    after BF16 rounding of scale and bias) zero.
//! 4. Each element: `q = clamp(rint((w - bias) / scale), 0, levels)`, with the f32
//!    `scale` and `bias` (a true division, not a multiplication by a reciprocal).
//! 5. The stored scale and bias are the f32 values rounded to BF16 (nearest, ties to
//!    even).
//!
//! A constant group `c` therefore stores scale ≈ -1e-7 (BF16 `0xB3D7`), bias `c` and
//! all-zero codes; an all-zero group stores scale `0xB3D7`, bias 0.
//!
//! # Layout
//! Each row of codes is one dense little-endian bit stream: the code of element `k`
//! occupies stream bits `[bits·k, bits·k + bits)`, lowest bit first, and stream bit
//! `i` is bit `i % 32` of little-endian u32 word `i / 32`. At 2, 4 and 8 bits that is
//! `32 / bits` whole codes per word (element `k` at bits `bits·(k % (32/bits))` of word
//! `k / (32/bits)`); at 3, 5 and 6 bits codes straddle words (MLX's CPU kernel packs 8
//! codes in 3 or 5 bytes and 4 codes in 3 bytes, which concatenate to the same
//! stream; its `dequantize` reads the u32 words back as one stream). A group is
//! `group·bits/32` whole words, so groups, like rows, never share a word.
//!
//! For `rows × cols` elements the outputs are `rows·cols·bits/8` weight bytes (U32
//! `[rows, cols·bits/32]`) and `rows·cols/group·2` bytes each of BF16 scales and
//! biases (`[rows, cols/group]`), all little-endian: exactly the bytes MLX's
//! `safetensors` writer puts on disk. Because a group never crosses a row, the flat
//! layout of a tile of rows is the matching slice of the whole tensor's layout, so
//! tiles of any whole number of rows give the same bytes as one call.
//!
//! # Where gturbo departs from MLX (refusals, never different bytes)
//! - A group holding ±inf or NaN is refused ([`QuantError::NonFinite`]): MLX skips NaN
//!   in min/max, then converts a NaN code with an undefined float-to-int cast.
//! - A group of finite values whose span `max - min` overflows f32 (|values| near
//!   BF16's limit, opposite signs) is refused ([`QuantError::RangeOverflow`]): MLX
//!   stores an infinite scale there and every weight dequantizes to NaN.
//!
//! # Why the code looks the way it does
//! Hundreds of gigabytes go through [`quantize_rows`], so each (width, group) pair is
//! its own monomorphised loop over fixed-size stack arrays, with branch-free loops the
//! compiler vectorises, and nothing allocates. `rint` of the clamped code uses the
//! exact 2^23 trick: for `0 <= x < 2^23`, the f32 addition `x + 2^23` rounds to an
//! integer with ties to even under the default rounding mode, and its bit pattern
//! minus that of 2^23 is the integer. Clamping before rounding gives the same code as
//! MLX's round-then-clamp because the bounds are integers.

use crate::Scheme;

/// `$at!(BITS, GROUP)` for `$spec`'s width and group, as literals: the one place a
/// spec picks its monomorphised loop (the portable one here, the AVX2 one in `x86`).
macro_rules! for_spec {
    ($spec:expr, $at:ident) => {
        match $spec.bits {
            Bits::Two => for_spec!(@group $spec, $at, 2),
            Bits::Three => for_spec!(@group $spec, $at, 3),
            Bits::Four => for_spec!(@group $spec, $at, 4),
            Bits::Five => for_spec!(@group $spec, $at, 5),
            Bits::Six => for_spec!(@group $spec, $at, 6),
            Bits::Eight => for_spec!(@group $spec, $at, 8),
        }
    };
    (@group $spec:expr, $at:ident, $bits:literal) => {
        match $spec.group {
            Group::G32 => $at!($bits, 32),
            Group::G64 => $at!($bits, 64),
            Group::G128 => $at!($bits, 128),
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod x86;

/// The group size of gturbo's own INT4/INT8 installs, and the group a bare [`Bits`]
/// stands for where a [`Spec`] is expected.
pub const GROUP: usize = 64;

/// The largest group size MLX writes.
pub const MAX_GROUP: usize = 128;

/// MLX's lower bound on the magnitude of the first scale estimate (`1e-7` as f32).
const SCALE_EPS: f32 = 1e-7;

/// 2^23: adding it to `x` in `[0, 2^23)` rounds `x` to an integer, ties to even.
const ROUND_MAGIC: f32 = 8_388_608.0;

/// Bit width of the quantized codes: the widths MLX's affine mode writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bits {
    /// 2 bits: 3 levels, 16 codes per u32 word.
    Two,
    /// 3 bits: 7 levels, codes straddle words (32 codes in 3 words).
    Three,
    /// INT4: 15 levels, 8 codes per u32 word.
    Four,
    /// 5 bits: 31 levels, codes straddle words (32 codes in 5 words).
    Five,
    /// 6 bits: 63 levels, codes straddle words (16 codes in 3 words).
    Six,
    /// INT8: 255 levels, 4 codes per u32 word (policy overrides such as MoE routers).
    Eight,
}

impl Bits {
    /// Every width, narrowest first.
    pub const ALL: [Bits; 6] = [
        Bits::Two,
        Bits::Three,
        Bits::Four,
        Bits::Five,
        Bits::Six,
        Bits::Eight,
    ];

    /// Bits per code.
    pub fn bits(self) -> u32 {
        match self {
            Bits::Two => 2,
            Bits::Three => 3,
            Bits::Four => 4,
            Bits::Five => 5,
            Bits::Six => 6,
            Bits::Eight => 8,
        }
    }

    /// The width with `n` bits per code; `None` for a width MLX does not write.
    pub fn from_bits(n: u32) -> Option<Bits> {
        Bits::ALL.into_iter().find(|b| b.bits() == n)
    }

    /// The largest code, `2^bits - 1`.
    pub fn levels(self) -> u32 {
        (1 << self.bits()) - 1
    }

    /// The bit width of an affine scheme; `None` for MXFP4 and passthrough.
    pub fn from_scheme(scheme: Scheme) -> Option<Bits> {
        scheme.affine().and_then(|a| Bits::from_bits(a.bits()))
    }

    /// Bytes of packed codes for one group of [`GROUP`] (64) elements.
    pub fn group_weight_bytes(self) -> usize {
        Spec::from(self).group_weight_bytes()
    }
}

/// Elements per quantization group: the group sizes MLX's affine mode writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Group {
    /// 32 elements.
    G32,
    /// 64 elements (gturbo's own installs, and MLX's default).
    G64,
    /// 128 elements.
    G128,
}

impl Group {
    /// Every group size, smallest first.
    pub const ALL: [Group; 3] = [Group::G32, Group::G64, Group::G128];

    /// Elements per group.
    pub fn size(self) -> usize {
        match self {
            Group::G32 => 32,
            Group::G64 => 64,
            Group::G128 => 128,
        }
    }

    /// The group of `n` elements; `None` for a size MLX does not write.
    pub fn from_size(n: usize) -> Option<Group> {
        Group::ALL.into_iter().find(|g| g.size() == n)
    }
}

/// One affine quantization: a code width and a group size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Spec {
    /// Bits per code.
    pub bits: Bits,
    /// Elements per group (one BF16 scale and bias each).
    pub group: Group,
}

/// A width or group size outside what MLX writes (as read from a config, say).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// Not 2, 3, 4, 5, 6 or 8 bits.
    #[error("quantization bits {0} is not one of 2, 3, 4, 5, 6, 8")]
    Bits(u64),
    /// Not a group of 32, 64 or 128.
    #[error("quantization group size {0} is not one of 32, 64, 128")]
    Group(u64),
}

impl Spec {
    /// The spec of `bits` per code in groups of `group`.
    pub const fn new(bits: Bits, group: Group) -> Spec {
        Spec { bits, group }
    }

    /// The spec for numeric `bits` and `group_size` (an MLX config's
    /// `quantization` entry), or which of the two MLX does not write.
    pub fn from_numbers(bits: u64, group_size: u64) -> Result<Spec, SpecError> {
        let b = u32::try_from(bits)
            .ok()
            .and_then(Bits::from_bits)
            .ok_or(SpecError::Bits(bits))?;
        let g = usize::try_from(group_size)
            .ok()
            .and_then(Group::from_size)
            .ok_or(SpecError::Group(group_size))?;
        Ok(Spec::new(b, g))
    }

    /// Every spec MLX writes: each width at each group size.
    pub fn all() -> impl Iterator<Item = Spec> {
        Bits::ALL
            .into_iter()
            .flat_map(|b| Group::ALL.into_iter().map(move |g| Spec::new(b, g)))
    }

    /// Bytes of packed codes for one group: `group·bits/8`, a whole number of u32
    /// words because every group holds a multiple of 32 codes.
    pub fn group_weight_bytes(self) -> usize {
        self.group.size() * self.bits.bits() as usize / 8
    }

    /// The spec of a format layout (every [`crate::Affine`] is one).
    pub fn from_affine(a: crate::Affine) -> Spec {
        Spec::from_numbers(a.bits() as u64, a.group() as u64)
            .expect("the format admits only the MLX layouts a Spec names")
    }

    /// The spec of a quantizing scheme; `None` for passthrough.
    pub fn from_scheme(scheme: Scheme) -> Option<Spec> {
        scheme.affine().map(Spec::from_affine)
    }

    /// This layout as the format names it (the one size rule lives there).
    pub fn affine(self) -> crate::Affine {
        crate::Affine::new(self.bits.bits(), self.group.size() as u32)
            .expect("every Spec is one of the MLX layouts the format admits")
    }

    /// Bytes of packed codes, and of BF16 scales (as many of biases), for `n_elems`
    /// elements in whole groups, by the format's size rule (sizes are linear in the
    /// element count, so one row of `n_elems` has the sizes of any whole rows).
    fn packed_sizes(self, n_elems: usize) -> (usize, usize) {
        let q = self
            .affine()
            .sizes(1, n_elems as u64)
            .expect("an in-memory slice of whole groups has sizes that fit 64 bits");
        (q.weights as usize, q.scales as usize)
    }
}

impl From<Bits> for Spec {
    /// `bits` at gturbo's own group size, [`GROUP`].
    fn from(bits: Bits) -> Spec {
        Spec::new(bits, Group::G64)
    }
}

impl std::fmt::Display for Spec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-bit g{}", self.bits.bits(), self.group.size())
    }
}

/// A slice whose length does not fit the requested quantization.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    /// The row width is zero or not a multiple of the group size.
    #[error("row width {cols} is not a positive multiple of the group size {group}")]
    Cols {
        /// The row width given.
        cols: usize,
        /// The group size asked for.
        group: usize,
    },
    /// The input does not hold a whole number of rows.
    #[error("input holds {len} elements, not a whole number of {cols}-element rows")]
    InputLen {
        /// Elements in the input.
        len: usize,
        /// The row width given.
        cols: usize,
    },
    /// A raw BF16 byte input has an odd length.
    #[error("BF16 input holds {len} bytes, an odd number")]
    OddBytes {
        /// Bytes in the input.
        len: usize,
    },
    /// A number of codes to unpack that does not fill whole u32 words.
    #[error("{len} codes of {bits} bits do not fill a whole number of u32 words")]
    CodeCount {
        /// Codes asked for.
        len: usize,
        /// Bits per code.
        bits: u32,
    },
    /// An output (or, for dequantization, a packed input) slice has the wrong length.
    #[error("{slice} slice holds {len} bytes, expected {expected}")]
    SliceLen {
        /// Which slice: `weights`, `scales`, `biases`, `packed` or `output`.
        slice: &'static str,
        /// Its length in bytes (elements for `output`).
        len: usize,
        /// The length the input shape requires.
        expected: usize,
    },
}

/// Why a slice could not be quantized. Indices are element indices within the slice
/// given; callers add the tensor name and the row offset of the tile.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum QuantError {
    /// A group holds +inf, -inf or NaN. Non-finite weights in a checkpoint are a defect
    /// to report, not to encode.
    #[error("non-finite weight (inf or NaN) at element {index}")]
    NonFinite {
        /// Index of the first non-finite element of the group.
        index: usize,
    },
    /// A group's span `max - min` overflows f32, so its scale would be infinite.
    #[error("group starting at element {index} spans {min:e}..{max:e}, wider than f32 can hold")]
    RangeOverflow {
        /// Index of the group's first element.
        index: usize,
        /// The group minimum.
        min: f32,
        /// The group maximum.
        max: f32,
    },
    /// The slices do not fit the shape.
    #[error("bad shape: {0}")]
    BadShape(#[from] ShapeError),
}

/// Widen a BF16 bit pattern to f32 (exact).
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Round an f32 to BF16, to nearest with ties to even (as MLX's `bfloat16_t`
/// conversion does for every non-NaN value); NaN becomes a quiet NaN.
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) as u16) | 0x0040;
    }
    // No overflow: the largest non-NaN pattern is 0xFF80_0000.
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

/// Check that `n_elems` elements of rows `cols` wide fit the packed slices of `spec`,
/// by the format's size rule ([`crate::Affine::sizes`]).
fn check_shapes(
    n_elems: usize,
    cols: usize,
    spec: Spec,
    weights: usize,
    scales: usize,
    biases: usize,
) -> Result<(), ShapeError> {
    let group = spec.group.size();
    if !spec.affine().fits(cols as u64) {
        return Err(ShapeError::Cols { cols, group });
    }
    if !n_elems.is_multiple_of(cols) {
        return Err(ShapeError::InputLen { len: n_elems, cols });
    }
    let (wbytes, sbytes) = spec.packed_sizes(n_elems);
    let want = [
        ("weights", weights, wbytes),
        ("scales", scales, sbytes),
        ("biases", biases, sbytes),
    ];
    for (slice, len, expected) in want {
        if len != expected {
            return Err(ShapeError::SliceLen {
                slice,
                len,
                expected,
            });
        }
    }
    Ok(())
}

/// Quantize whole rows of BF16 values (given as bit patterns) into MLX's affine
/// layout for `spec` (a [`Spec`], or a [`Bits`] for group 64), writing the packed
/// little-endian u32 words and the little-endian BF16 scales and biases straight into
/// the output byte slices.
///
/// `src_bf16.len()` must be a multiple of `cols`, `cols` a multiple of the group, and
/// the outputs exactly `len·bits/8`, `len/group·2` and `len/group·2` bytes. On error
/// the outputs hold unspecified bytes.
pub fn quantize_rows(
    src_bf16: &[u16],
    cols: usize,
    spec: impl Into<Spec>,
    weights: &mut [u8],
    scales: &mut [u8],
    biases: &mut [u8],
) -> Result<(), QuantError> {
    let spec = spec.into();
    let n = src_bf16.len();
    check_shapes(n, cols, spec, weights.len(), scales.len(), biases.len())?;
    quantize_groups(Input::Bits(src_bf16), spec, (weights, scales, biases))
}

/// [`quantize_rows`] over raw little-endian BF16 bytes, as they come off the network
/// (`src.len()` = 2 × elements). Element indices in errors count elements, not bytes.
pub fn quantize_rows_le_bytes(
    src: &[u8],
    cols: usize,
    spec: impl Into<Spec>,
    weights: &mut [u8],
    scales: &mut [u8],
    biases: &mut [u8],
) -> Result<(), QuantError> {
    let spec = spec.into();
    if !src.len().is_multiple_of(2) {
        return Err(ShapeError::OddBytes { len: src.len() }.into());
    }
    let n = src.len() / 2;
    check_shapes(n, cols, spec, weights.len(), scales.len(), biases.len())?;
    quantize_groups(Input::LeBytes(src), spec, (weights, scales, biases))
}

/// The BF16 elements being quantized: bit patterns, or little-endian bytes read in
/// place (no copy of a tile to widen it).
#[derive(Debug, Clone, Copy)]
enum Input<'a> {
    Bits(&'a [u16]),
    LeBytes(&'a [u8]),
}

impl Input<'_> {
    /// Elements.
    fn len(self) -> usize {
        match self {
            Input::Bits(s) => s.len(),
            Input::LeBytes(b) => b.len() / 2,
        }
    }

    /// Group `g` of `out.len()` elements into `out`.
    #[inline(always)]
    fn load_group(self, g: usize, out: &mut [u16]) {
        let len = out.len();
        match self {
            Input::Bits(s) => out.copy_from_slice(&s[g * len..(g + 1) * len]),
            Input::LeBytes(b) => {
                let bytes = &b[g * len * 2..(g + 1) * len * 2];
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = u16::from_le_bytes([b[0], b[1]]);
                }
            }
        }
    }
}

/// Quantize every group of `input` (shapes already checked): the AVX2 loop where the
/// CPU has it, else the portable one. Both give the same bytes and errors.
fn quantize_groups(input: Input<'_>, spec: Spec, out: Outputs<'_>) -> Result<(), QuantError> {
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        return x86::quantize(input, spec, out);
    }
    quantize_portable(input, spec, out)
}

/// The portable loop over every group of `input`: picks the monomorphised loop.
fn quantize_portable(input: Input<'_>, spec: Spec, out: Outputs<'_>) -> Result<(), QuantError> {
    let all = 0..input.len() / spec.group.size();
    macro_rules! at {
        ($bits:literal, $group:literal) => {
            quantize_groups_at::<$bits, $group>(input, all, out)
        };
    }
    for_spec!(spec, at)
}

/// The packed weights, scales and biases being written.
type Outputs<'a> = (&'a mut [u8], &'a mut [u8], &'a mut [u8]);

/// Groups `groups` of `input` into `out`, which holds exactly those groups' outputs.
fn quantize_groups_at<const BITS: u32, const G: usize>(
    input: Input<'_>,
    groups: std::ops::Range<usize>,
    (weights, scales, biases): Outputs<'_>,
) -> Result<(), QuantError> {
    let wbytes = G * BITS as usize / 8;
    let mut raw = [0u16; G];
    let mut codes = [0u32; G];
    for ((g, (wout, sout)), bout) in groups
        .zip(
            weights
                .chunks_exact_mut(wbytes)
                .zip(scales.chunks_exact_mut(2)),
        )
        .zip(biases.chunks_exact_mut(2))
    {
        input.load_group(g, &mut raw);
        let (scale, bias) = quantize_group::<BITS, G>(&raw, &mut codes, g * G)?;
        pack::<BITS, G>(&codes, wout);
        sout.copy_from_slice(&f32_to_bf16(scale).to_le_bytes());
        bout.copy_from_slice(&f32_to_bf16(bias).to_le_bytes());
    }
    Ok(())
}

/// Quantize one group into `codes`; returns the f32 scale and bias (before BF16
/// rounding). `base` is the group's first element index, for errors.
#[inline(always)]
fn quantize_group<const BITS: u32, const G: usize>(
    raw: &[u16; G],
    codes: &mut [u32; G],
    base: usize,
) -> Result<(f32, f32), QuantError> {
    let levels = ((1u32 << BITS) - 1) as f32;

    // An exponent of all ones is ±inf or NaN. Checked on the bits so the scan
    // vectorises and nothing below ever sees a NaN.
    let non_finite = raw
        .iter()
        .fold(false, |acc, &b| acc | (b & 0x7F80 == 0x7F80));
    if non_finite {
        let at = raw.iter().position(|&b| b & 0x7F80 == 0x7F80).unwrap_or(0);
        return Err(QuantError::NonFinite { index: base + at });
    }

    let mut vals = [0f32; G];
    for (v, &b) in vals.iter_mut().zip(raw) {
        *v = bf16_to_f32(b);
    }
    // Eight independent lanes so the reduction vectorises (every group size is a
    // multiple of 8); min/max are exact, so the order does not matter.
    let mut mins = [f32::INFINITY; 8];
    let mut maxs = [f32::NEG_INFINITY; 8];
    for chunk in vals.chunks_exact(8) {
        for l in 0..8 {
            let v = chunk[l];
            mins[l] = if v < mins[l] { v } else { mins[l] };
            maxs[l] = if v > maxs[l] { v } else { maxs[l] };
        }
    }
    let w_min = mins
        .iter()
        .fold(f32::INFINITY, |a, &v| if v < a { v } else { a });
    let w_max = maxs
        .iter()
        .fold(f32::NEG_INFINITY, |a, &v| if v > a { v } else { a });

    let span = w_max - w_min;
    if !span.is_finite() {
        return Err(QuantError::RangeOverflow {
            index: base,
            min: w_min,
            max: w_max,
        });
    }
    let use_min = w_min.abs() > w_max.abs();
    let mut scale = span / levels;
    if scale < SCALE_EPS {
        scale = SCALE_EPS;
    }
    let edge = if use_min { w_min } else { w_max };
    if !use_min {
        scale = -scale;
    }
    let q0 = (edge / scale).round_ties_even();
    let mut bias = 0.0f32;
    if q0 != 0.0 {
        scale = edge / q0;
        bias = edge;
    }

    for (c, &v) in codes.iter_mut().zip(&vals) {
        let x = (v - bias) / scale;
        // `x > 0` is false for -0.0 and NaN alike, both of which code as 0.
        let x = if x > 0.0 { x } else { 0.0 };
        let x = if x < levels { x } else { levels };
        *c = (x + ROUND_MAGIC).to_bits() - ROUND_MAGIC.to_bits();
    }
    Ok((scale, bias))
}

/// Pack a group's codes of `BITS` bits into its little-endian u32 words as one bit
/// stream, element 0 lowest.
#[inline(always)]
fn pack<const BITS: u32, const G: usize>(codes: &[u32; G], out: &mut [u8]) {
    if 32 % BITS == 0 {
        // Whole codes per word: one word at a time, which vectorises.
        let per_word = (32 / BITS) as usize;
        for (word_codes, dst) in codes.chunks_exact(per_word).zip(out.chunks_exact_mut(4)) {
            let mut word = 0u32;
            for (k, &c) in word_codes.iter().enumerate() {
                word |= c << (BITS as usize * k);
            }
            dst.copy_from_slice(&word.to_le_bytes());
        }
    } else {
        // Codes straddle words: shift them into a 64-bit accumulator and flush each
        // completed word. `G·BITS` is a multiple of 32, so nothing is left over.
        let mut words = out.chunks_exact_mut(4);
        let (mut acc, mut filled) = (0u64, 0u32);
        for &c in codes {
            acc |= (c as u64) << filled;
            filled += BITS;
            if filled >= 32 {
                if let Some(dst) = words.next() {
                    dst.copy_from_slice(&(acc as u32).to_le_bytes());
                }
                acc >>= 32;
                filled -= 32;
            }
        }
    }
}

/// Unpack `codes.len()` codes of `bits` bits from the bit stream in `packed`, which
/// holds exactly `codes.len()·bits/8` bytes of whole u32 words (unchecked here).
#[inline(always)]
fn unpack(bits: u32, packed: &[u8], codes: &mut [u8]) {
    let mask = (1u64 << bits) - 1;
    let mut words = packed
        .chunks_exact(4)
        .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]));
    let (mut acc, mut filled) = (0u64, 0u32);
    for c in codes {
        if filled < bits {
            acc |= (words.next().unwrap_or(0) as u64) << filled;
            filled += 32;
        }
        // The mask keeps at most 8 bits, so the cast is exact.
        *c = (acc & mask) as u8;
        acc >>= bits;
        filled -= bits;
    }
}

/// Unpack the codes of a row (or any run of whole u32 words) of packed weights: code
/// `k` from stream bits `[bits·k, bits·k + bits)`. `codes.len()·bits` must be a
/// multiple of 32 and `packed` exactly `codes.len()·bits/8` bytes.
pub fn unpack_codes(packed: &[u8], bits: Bits, codes: &mut [u8]) -> Result<(), ShapeError> {
    let b = bits.bits();
    if !(codes.len() * b as usize).is_multiple_of(32) {
        return Err(ShapeError::CodeCount {
            len: codes.len(),
            bits: b,
        });
    }
    let expected = codes.len() * b as usize / 8;
    if packed.len() != expected {
        return Err(ShapeError::SliceLen {
            slice: "packed",
            len: packed.len(),
            expected,
        });
    }
    unpack(b, packed, codes);
    Ok(())
}

/// Run `each(codes, scale, bias, out)` over the groups of checked packed rows, with
/// the group's codes unpacked and its BF16 scale and bias widened to f32.
fn for_each_group<T>(
    (weights, scales, biases): (&[u8], &[u8], &[u8]),
    cols: usize,
    spec: Spec,
    out: &mut [T],
    mut each: impl FnMut(&[u8], f32, f32, &mut [T]),
) -> Result<(), QuantError> {
    check_shapes(
        out.len(),
        cols,
        spec,
        weights.len(),
        scales.len(),
        biases.len(),
    )?;
    let group = spec.group.size();
    let mut codes = [0u8; MAX_GROUP];
    let codes = &mut codes[..group];
    for (((o, w), s), b) in out
        .chunks_exact_mut(group)
        .zip(weights.chunks_exact(spec.group_weight_bytes()))
        .zip(scales.chunks_exact(2))
        .zip(biases.chunks_exact(2))
    {
        unpack(spec.bits.bits(), w, codes);
        let scale = bf16_to_f32(u16::from_le_bytes([s[0], s[1]]));
        let bias = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
        each(codes, scale, bias, o);
    }
    Ok(())
}

/// Dequantize whole rows to f32: `w = scale * q + bias` with the BF16 scale and bias
/// widened to f32 (one rounding per operation, no fused multiply-add), as MLX's
/// `dequantize` does on f32 scales and biases. `out.len()` sets the number of
/// elements; the packed slices must match it.
pub fn dequantize_rows(
    weights: &[u8],
    scales: &[u8],
    biases: &[u8],
    cols: usize,
    spec: impl Into<Spec>,
    out: &mut [f32],
) -> Result<(), QuantError> {
    let packed = (weights, scales, biases);
    for_each_group(packed, cols, spec.into(), out, |codes, scale, bias, o| {
        for (v, &q) in o.iter_mut().zip(codes) {
            *v = scale * q as f32 + bias;
        }
    })
}

/// Dequantize whole rows to BF16 bit patterns exactly as MLX's CPU `dequantize` does
/// for BF16 arrays: every operation rounds to BF16, `bf16(bf16(q * scale) + bias)`.
/// For tests and tools that compare against MLX output; the runtime wants
/// [`dequantize_rows`].
pub fn dequantize_rows_bf16(
    weights: &[u8],
    scales: &[u8],
    biases: &[u8],
    cols: usize,
    spec: impl Into<Spec>,
    out: &mut [u16],
) -> Result<(), QuantError> {
    let packed = (weights, scales, biases);
    for_each_group(packed, cols, spec.into(), out, |codes, scale, bias, o| {
        for (v, &q) in o.iter_mut().zip(codes) {
            let prod = bf16_to_f32(f32_to_bf16(q as f32 * scale));
            *v = f32_to_bf16(prod + bias);
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Packed weights, scales and biases.
    type Packed = (Vec<u8>, Vec<u8>, Vec<u8>);

    fn quant(src: &[u16], cols: usize, spec: impl Into<Spec>) -> Result<Packed, QuantError> {
        let spec = spec.into();
        let (wn, sn) = spec.packed_sizes(src.len());
        let (mut w, mut s, mut b) = (vec![0u8; wn], vec![0u8; sn], vec![0u8; sn]);
        quantize_rows(src, cols, spec, &mut w, &mut s, &mut b)?;
        Ok((w, s, b))
    }

    #[test]
    fn bf16_rounding_is_nearest_even() {
        // 1.0 + half an ulp of BF16 ties down to 1.0 (even), 1.0 + 1.5 ulp ties up.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F80_8000)), 0x3F80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F81_8000)), 0x3F82);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F80_8001)), 0x3F81);
        assert_eq!(f32_to_bf16(-1e-7), 0xB3D7);
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7F80);
        assert_eq!(
            f32_to_bf16(f32::MAX),
            0x7F80,
            "rounds past the largest BF16"
        );
        assert_eq!(f32_to_bf16(f32::NAN) & 0x7FC0, 0x7FC0);
        for bits in [0u16, 0x8000, 0x0001, 0x3F80, 0xC2F7, 0x7F7F] {
            assert_eq!(f32_to_bf16(bf16_to_f32(bits)), bits);
        }
    }

    #[test]
    fn constant_group_stores_minus_epsilon_scale_and_the_constant() {
        let c = 0xBF40u16; // -0.75
        let (w, s, b) = quant(&[c; 64], 64, Bits::Four).unwrap();
        assert_eq!(w, vec![0u8; 32]);
        assert_eq!(s, 0xB3D7u16.to_le_bytes());
        assert_eq!(b, c.to_le_bytes());
        let (w, s, b) = quant(&[0u16; 64], 64, Bits::Eight).unwrap();
        assert_eq!(w, vec![0u8; 64]);
        assert_eq!(s, 0xB3D7u16.to_le_bytes());
        assert_eq!(b, [0, 0]);
        for spec in Spec::all() {
            let (w, s, b) = quant(&[c; 128], 128, spec).unwrap();
            let groups = 128 / spec.group.size();
            assert_eq!(w, vec![0u8; 128 * spec.bits.bits() as usize / 8], "{spec}");
            assert_eq!(s, 0xB3D7u16.to_le_bytes().repeat(groups), "{spec}");
            assert_eq!(b, c.to_le_bytes().repeat(groups), "{spec}");
        }
    }

    #[test]
    fn exact_grid_round_trips_and_packs_low_nibble_first() {
        // 0, 1, ..., 15, 0, 1, ... : edge = max = 15, scale = -1, bias = 15, q = 15 - w.
        let src: Vec<u16> = (0..64).map(|k| f32_to_bf16((k % 16) as f32)).collect();
        let (w, s, b) = quant(&src, 64, Bits::Four).unwrap();
        assert_eq!(s, f32_to_bf16(-1.0).to_le_bytes());
        assert_eq!(b, f32_to_bf16(15.0).to_le_bytes());
        // Element 0 (code 15) in the lowest nibble, element 1 (code 14) next.
        assert_eq!(&w[..4], &0x89AB_CDEFu32.to_le_bytes());
        let mut out = [0f32; 64];
        dequantize_rows(&w, &s, &b, 64, Bits::Four, &mut out).unwrap();
        for (k, v) in out.iter().enumerate() {
            assert_eq!(*v, (k % 16) as f32);
        }
    }

    #[test]
    fn three_bit_codes_straddle_words_as_one_stream() {
        // Values 7 - k % 8 give codes k % 8 (edge = max = 7, scale = -1, bias = 7).
        // Code k sits at stream bits 3k.., so the first word, read as octal digits,
        // is codes 10, 9, ..., 0, and code 10 (= 2, binary 010) lends its top bit to
        // word 1.
        let src: Vec<u16> = (0..32).map(|k| f32_to_bf16((7 - k % 8) as f32)).collect();
        let (w, s, b) = quant(&src, 32, Spec::new(Bits::Three, Group::G32)).unwrap();
        assert_eq!(w.len(), 12);
        assert_eq!(s, f32_to_bf16(-1.0).to_le_bytes());
        assert_eq!(b, f32_to_bf16(7.0).to_le_bytes());
        assert_eq!(&w[..4], &0o21076543210u32.to_le_bytes());
        // Word 1: code 10's top bit (0), then codes 11.. at bit 1 + 3(k - 11).
        let word1 = u32::from_le_bytes([w[4], w[5], w[6], w[7]]);
        assert_eq!(word1 & 1, 0);
        assert_eq!((word1 >> 1) & 7, 3, "code 11");
        let mut codes = [0u8; 32];
        unpack_codes(&w, Bits::Three, &mut codes).unwrap();
        assert!(codes.iter().enumerate().all(|(k, &c)| c as usize == k % 8));
    }

    /// A row of `n` integer values in `0..=levels` holding both 0 and `levels` in
    /// every group of `group`, so each group's codes are `levels - value`.
    fn grid_row(n: usize, group: usize, levels: u32, mut seed: u64) -> Vec<u32> {
        (0..n)
            .map(|k| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                match k % group {
                    0 => 0,
                    1 => levels,
                    _ => (seed >> 33) as u32 % (levels + 1),
                }
            })
            .collect()
    }

    #[test]
    fn every_width_and_group_round_trips_an_exact_grid() {
        for spec in Spec::all() {
            let (rows, cols) = (3, 256);
            let levels = spec.bits.levels();
            let vals = grid_row(rows * cols, spec.group.size(), levels, 99);
            let src: Vec<u16> = vals.iter().map(|&v| f32_to_bf16(v as f32)).collect();
            let (w, s, b) = quant(&src, cols, spec).unwrap();
            assert_eq!(
                w.len(),
                rows * cols * spec.bits.bits() as usize / 8,
                "{spec}"
            );
            assert!(
                s.chunks_exact(2)
                    .all(|c| c == f32_to_bf16(-1.0).to_le_bytes())
            );
            let mut codes = vec![0u8; rows * cols];
            unpack_codes(&w, spec.bits, &mut codes).unwrap();
            for (k, (&c, &v)) in codes.iter().zip(&vals).enumerate() {
                assert_eq!(c as u32, levels - v, "{spec} element {k}");
            }
            let mut out = vec![0f32; rows * cols];
            dequantize_rows(&w, &s, &b, cols, spec, &mut out).unwrap();
            assert!(
                out.iter().zip(&vals).all(|(&o, &v)| o == v as f32),
                "{spec}"
            );
            let mut out16 = vec![0u16; rows * cols];
            dequantize_rows_bf16(&w, &s, &b, cols, spec, &mut out16).unwrap();
            assert_eq!(out16, src, "{spec}");
        }
    }

    #[test]
    fn specs_from_numbers_accept_what_mlx_writes() {
        assert_eq!(Spec::all().count(), 18);
        for spec in Spec::all() {
            let n = (spec.bits.bits() as u64, spec.group.size() as u64);
            assert_eq!(Spec::from_numbers(n.0, n.1), Ok(spec));
        }
        assert_eq!(Spec::from(Bits::Four), Spec::new(Bits::Four, Group::G64));
        assert_eq!(Spec::new(Bits::Six, Group::G128).to_string(), "6-bit g128");
        let e = Spec::from_numbers(7, 64).unwrap_err();
        assert_eq!(
            e.to_string(),
            "quantization bits 7 is not one of 2, 3, 4, 5, 6, 8"
        );
        let e = Spec::from_numbers(4, 48).unwrap_err();
        assert_eq!(
            e.to_string(),
            "quantization group size 48 is not one of 32, 64, 128"
        );
        assert_eq!(
            Spec::from_numbers(1 << 33, 64),
            Err(SpecError::Bits(1 << 33))
        );
        assert_eq!(Spec::from_numbers(4, 0), Err(SpecError::Group(0)));
    }

    #[test]
    fn shape_errors_name_the_slice() {
        let src = [0u16; 128];
        let mut w = [0u8; 64];
        let mut s = [0u8; 4];
        let mut b = [0u8; 4];
        let e = quantize_rows(&src, 96, Bits::Four, &mut w, &mut s, &mut b).unwrap_err();
        assert_eq!(
            e.to_string(),
            "bad shape: row width 96 is not a positive multiple of the group size 64"
        );
        let g128 = Spec::new(Bits::Four, Group::G128);
        let e = quantize_rows(&src[..64], 64, g128, &mut w, &mut s, &mut b).unwrap_err();
        assert_eq!(
            e.to_string(),
            "bad shape: row width 64 is not a positive multiple of the group size 128"
        );
        let e = quantize_rows(&src[..64], 128, Bits::Four, &mut w, &mut s, &mut b).unwrap_err();
        assert_eq!(
            e.to_string(),
            "bad shape: input holds 64 elements, not a whole number of 128-element rows"
        );
        let e = quantize_rows(&src, 64, Bits::Eight, &mut w, &mut s, &mut b).unwrap_err();
        assert_eq!(
            e.to_string(),
            "bad shape: weights slice holds 64 bytes, expected 128"
        );
        let g32 = Spec::new(Bits::Three, Group::G32);
        let e = quantize_rows(&src, 128, g32, &mut w[..48], &mut s, &mut b).unwrap_err();
        assert_eq!(
            e.to_string(),
            "bad shape: scales slice holds 4 bytes, expected 8"
        );
        let e = quantize_rows(&src, 64, Bits::Four, &mut w, &mut s[..2], &mut b).unwrap_err();
        assert_eq!(
            e.to_string(),
            "bad shape: scales slice holds 2 bytes, expected 4"
        );
        let e = quantize_rows_le_bytes(&[0u8; 129], 64, Bits::Four, &mut w, &mut s, &mut b)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "bad shape: BF16 input holds 129 bytes, an odd number"
        );
        let mut out = [0f32; 128];
        let e = dequantize_rows(&w[..48], &s, &b, 64, Bits::Four, &mut out).unwrap_err();
        assert_eq!(
            e.to_string(),
            "bad shape: weights slice holds 48 bytes, expected 64"
        );
    }

    #[test]
    fn unpack_codes_checks_its_lengths() {
        let mut codes = [0u8; 16];
        let e = unpack_codes(&[0u8; 6], Bits::Three, &mut codes).unwrap_err();
        assert_eq!(
            e.to_string(),
            "16 codes of 3 bits do not fill a whole number of u32 words"
        );
        let e = unpack_codes(&[0u8; 4], Bits::Four, &mut codes).unwrap_err();
        assert_eq!(e.to_string(), "packed slice holds 4 bytes, expected 8");
        // 16 two-bit codes fill exactly one word.
        unpack_codes(&0xE4E4_E4E4u32.to_le_bytes(), Bits::Two, &mut codes).unwrap();
        assert_eq!(codes, [0, 1, 2, 3].repeat(4)[..]);
    }

    #[test]
    fn span_overflow_is_refused() {
        let mut src = [0u16; 128];
        src[64 + 3] = 0x7F7E; // ~3.38e38
        src[64 + 9] = 0xFEF0; // ~-1.6e38
        let e = quant(&src, 128, Bits::Four).unwrap_err();
        assert!(
            matches!(e, QuantError::RangeOverflow { index: 64, .. }),
            "{e:?}"
        );
        let e = quant(&src, 128, Spec::new(Bits::Five, Group::G32)).unwrap_err();
        assert!(
            matches!(e, QuantError::RangeOverflow { index: 64, .. }),
            "{e:?}"
        );
    }

    /// BF16 groups of the kinds that need care, one kind per group: zeros of both
    /// signs, constants (small, huge, of both signs), subnormals, values at BF16's
    /// limit, spans that overflow, ±inf and NaN (only where `refuse` allows), near-ties,
    /// and plain random rows with and without an offset. (Only the AVX2 comparison
    /// uses them.)
    #[cfg(target_arch = "x86_64")]
    fn hard_groups(n_groups: usize, group: usize, refuse: bool, mut seed: u64) -> Vec<u16> {
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut out = Vec::with_capacity(n_groups * group);
        for g in 0..n_groups {
            let kind = next() % if refuse { 18 } else { 16 };
            for _ in 0..group {
                let r = next();
                let x = r % 97;
                let v = match kind {
                    0 => 0,
                    1 => 0x8000,
                    2 => 0x3f80,
                    3 if x < 50 => 0x8000 | (r >> 20) as u16 & 0x7f,
                    3 => (r >> 20) as u16 & 0x7f,
                    4 => 0x7f7f,
                    5 => 0xff7f,
                    6 => [0x7f7f, 0x7f7e][(x < 48) as usize],
                    7 => [0x0001, 0x8001][(x < 48) as usize],
                    8 => [0x3f80, 0x3f81][(x < 48) as usize],
                    9 => [0x4000, 0xc000][(x < 90) as usize],
                    // Wide exponents, finite: any sign, exponent below all ones.
                    10 => (r >> 16) as u16 & 0xff7f,
                    11 => f32_to_bf16((r >> 40) as f32 * 1e-30),
                    12 => f32_to_bf16((x as f32 - 48.0) / 4.0),
                    13 | 14 => {
                        let u = (r >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                        f32_to_bf16(u * 0.2 + if kind == 14 { 0.7 } else { 0.0 })
                    }
                    // Opposite signs near the limit: the span overflows.
                    15 if g % 2 == 0 && refuse => [0x7f7f, 0xff7f][(x < 48) as usize],
                    15 => 0x3c00,
                    16 if x < 3 => 0x7f80 | x as u16,
                    17 if x < 2 => 0xff80 | (x as u16) << 6,
                    _ => f32_to_bf16((x as f32 - 48.0) / 1024.0),
                };
                out.push(v);
            }
        }
        out
    }

    #[test]
    fn the_avx2_loop_gives_the_portable_bytes_and_errors() {
        #[cfg(target_arch = "x86_64")]
        {
            if !x86::available() {
                eprintln!("skipped: the_avx2_loop_gives_the_portable_bytes_and_errors: no AVX2");
                return;
            }
            let mut seed = 0x9e37_79b9_7f4a_7c15u64;
            let (mut ok, mut refused) = (0, 0);
            for spec in Spec::all() {
                let group = spec.group.size();
                // 8, 11 and 24 groups per call: whole blocks, a block and a rest, three
                // blocks; every third call may hold refused groups.
                for (calls, n_groups) in [(40, 8), (40, 11), (30, 24)] {
                    for c in 0..calls {
                        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                        let src = hard_groups(n_groups, group, c % 3 == 0, seed);
                        let bytes: Vec<u8> = src.iter().flat_map(|v| v.to_le_bytes()).collect();
                        let (wn, sn) = spec.packed_sizes(src.len());
                        let run = |input: Input<'_>, fast: bool| {
                            let (mut w, mut s, mut b) = (vec![0; wn], vec![0; sn], vec![0; sn]);
                            let r = if fast {
                                x86::quantize(input, spec, (&mut w, &mut s, &mut b))
                            } else {
                                quantize_portable(input, spec, (&mut w, &mut s, &mut b))
                            };
                            r.map(|()| (w, s, b))
                        };
                        let want = run(Input::Bits(&src), false);
                        if want.is_ok() {
                            ok += 1;
                        } else {
                            refused += 1;
                        }
                        let what = format!("{spec}, {n_groups} groups, call {c}");
                        assert_eq!(run(Input::Bits(&src), true), want, "{what}");
                        assert_eq!(run(Input::LeBytes(&bytes), true), want, "{what}, bytes");
                    }
                }
            }
            // Both outcomes were compared, many times.
            assert!(
                ok > 500 && refused > 300,
                "{ok} quantized, {refused} refused"
            );
        }
        #[cfg(not(target_arch = "x86_64"))]
        eprintln!("skipped: the_avx2_loop_gives_the_portable_bytes_and_errors: not x86-64");
    }
}
