//! The `.gturbo` on-disk format: the types and sizes shared by install (what to
//! write), verify-install (what to check) and run (what to read).
//!
//! The spec in MUST/MAY terms lives in `manifests/FORMAT.md`; this module is its
//! single implementation. Every size the planner predicts comes from here, so a dry
//! run and a real install cannot disagree.

use serde::{Deserialize, Serialize};

pub mod axes;
pub mod check;
pub mod digest;
pub mod dtype;
pub mod env;
pub mod json;
pub mod lock;
pub mod manifest;
pub mod mxfp4;
pub mod nofollow;
pub mod pools;
pub mod quality;
pub mod quant;
pub mod receipt;
pub mod resident;
pub mod sizes;
pub mod tokenizer;

pub use sizes::{Affine, QuantSizes, RowBlocks, row_bytes};

/// Every alignment in the format uses this unit, whatever the host's page size
/// (16 KiB is Apple silicon's page; on 4 KiB hosts it is still a multiple).
pub const PAGE: u64 = 16 * 1024;

/// Alignment of sub-regions (weights, scales, biases) inside one resident entry, so
/// SIMD kernels can load them without straddling cache lines.
pub const SUBREGION_ALIGN: u64 = 64;

/// One inconsistency found in a format structure: the field (a JSON path such as
/// `parts[1].offset` or `tensors[3] (model.norm.weight).data`) and what is wrong.
/// The caller adds the file it came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutError {
    /// Field or byte offset the problem is at.
    pub field: String,
    /// What is wrong, with the expected and found values.
    pub detail: String,
}

impl LayoutError {
    /// A problem at `field`.
    pub fn new(field: impl Into<String>, detail: impl Into<String>) -> LayoutError {
        LayoutError {
            field: field.into(),
            detail: detail.into(),
        }
    }
}

impl std::fmt::Display for LayoutError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.detail)
    }
}

/// Longest path (in bytes) a manifest may name inside the directory.
pub const MAX_PATH_BYTES: usize = 1024;

/// Whether `path` is a safe path inside an install directory: relative,
/// `/`-separated, no empty, `.` or `..` component, no backslash, colon or control
/// character. Readers MUST refuse any other path before touching the filesystem, so
/// a hostile manifest cannot name a file outside the directory.
pub fn check_relative_path(path: &str) -> Result<(), String> {
    if path.is_empty() {
        return Err("empty path".into());
    }
    if path.len() > MAX_PATH_BYTES {
        return Err(format!(
            "path is {} bytes, more than {MAX_PATH_BYTES}",
            path.len()
        ));
    }
    if path.starts_with('/') {
        return Err(format!(
            "{path:?} is absolute; paths are relative to the directory"
        ));
    }
    if let Some(c) = path
        .chars()
        .find(|c| *c == '\\' || *c == ':' || c.is_control())
    {
        return Err(format!("{path:?} contains {c:?}"));
    }
    for part in path.split('/') {
        match part {
            "" => return Err(format!("{path:?} has an empty component")),
            "." | ".." => {
                return Err(format!(
                    "{path:?} has a {part:?} component; paths must stay inside the directory"
                ));
            }
            _ => {}
        }
    }
    Ok(())
}

/// Round `n` up to a multiple of `align` (a power of two or any positive number).
/// `None` on overflow.
pub fn align_up(n: u64, align: u64) -> Option<u64> {
    debug_assert!(align > 0);
    let rem = n % align;
    if rem == 0 {
        Some(n)
    } else {
        n.checked_add(align - rem)
    }
}

/// How one slot's bytes are stored: MLX affine quantization at one of the widths and
/// groups MLX writes ([`Affine`]), MLX's `mxfp4` microscaling layout ([`sizes`]'s
/// MXFP4 section), or the source bytes unchanged.
///
/// Written as its label: `int{bits}_g{group}` (`int4_g64`, `int3_g128`), `mxfp4_g32` or
/// `passthrough`; a reader refuses any other name, naming the accepted ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scheme {
    /// Affine quantization in MLX's layout (U32 words, BF16 scales and biases).
    Affine(Affine),
    /// MXFP4 in MLX's `mxfp4` layout: E2M1 codes eight to a U32 word, one E8M0 scale
    /// byte per group of 32, no biases (gpt-oss's experts, kept as published).
    Mxfp4,
    /// Source bytes unchanged, at the source dtype.
    Passthrough,
}

/// The label of [`Scheme::Mxfp4`]: MXFP4 in groups of 32 (MLX's `mxfp4` mode has no
/// other group).
pub const MXFP4_LABEL: &str = "mxfp4_g32";

#[allow(non_upper_case_globals)]
impl Scheme {
    /// Affine INT4, group 64: the family default.
    pub const Int4G64: Scheme = Scheme::Affine(Affine::INT4_G64);
    /// Affine INT8, group 64: the routers' default.
    pub const Int8G64: Scheme = Scheme::Affine(Affine::INT8_G64);
}

impl Scheme {
    /// The affine layout of an affine scheme, `None` for MXFP4 and passthrough. Every
    /// affine size follows from it (see [`sizes`]).
    pub const fn affine(self) -> Option<Affine> {
        match self {
            Scheme::Affine(a) => Some(a),
            Scheme::Mxfp4 | Scheme::Passthrough => None,
        }
    }

    /// Whether the bytes are quantized codes with scales (affine or MXFP4), not the
    /// source's elements.
    pub const fn is_quantized(self) -> bool {
        !matches!(self, Scheme::Passthrough)
    }

    /// The scheme that stores `affine` (every layout [`Affine`] admits).
    pub fn from_affine(affine: Affine) -> Option<Scheme> {
        Some(Scheme::Affine(affine))
    }

    /// Bits per quantized element, `None` for passthrough.
    pub fn bits(self) -> Option<u32> {
        match self {
            Scheme::Mxfp4 => Some(sizes::MXFP4_BITS),
            s => s.affine().map(Affine::bits),
        }
    }

    /// Elements per quantization group, `None` for passthrough.
    pub fn group(self) -> Option<u32> {
        match self {
            Scheme::Mxfp4 => Some(sizes::MXFP4_GROUP as u32),
            s => s.affine().map(Affine::group),
        }
    }

    /// The name it is written under: `int4_g64`, `int3_g128`, `mxfp4_g32`,
    /// `passthrough`.
    pub fn label(self) -> String {
        match self {
            Scheme::Affine(a) => a.label(),
            Scheme::Mxfp4 => MXFP4_LABEL.into(),
            Scheme::Passthrough => "passthrough".into(),
        }
    }

    /// The scheme named `name` ([`Scheme::label`]'s inverse); the error lists what
    /// is accepted.
    pub fn parse(name: &str) -> Result<Scheme, String> {
        if name == "passthrough" {
            return Ok(Scheme::Passthrough);
        }
        if name == MXFP4_LABEL {
            return Ok(Scheme::Mxfp4);
        }
        let affine = name
            .strip_prefix("int")
            .and_then(|r| r.split_once("_g"))
            .and_then(|(b, g)| Some((b.parse::<u32>().ok()?, g.parse::<u32>().ok()?)))
            .filter(|(b, g)| name == format!("int{b}_g{g}"));
        match affine {
            Some((b, g)) => Affine::new(b, g).map(Scheme::Affine).ok_or_else(|| {
                format!(
                    "scheme `{name}`: {b} bits in groups of {g} is not a layout MLX writes \
                     (bits {:?}, groups {:?})",
                    Affine::BITS,
                    Affine::GROUPS
                )
            }),
            None => Err(format!(
                "unknown scheme `{name}`; expected `passthrough`, `{MXFP4_LABEL}` or \
                 `int{{bits}}_g{{group}}` with bits {:?} and group {:?}",
                Affine::BITS,
                Affine::GROUPS
            )),
        }
    }
}

impl Serialize for Scheme {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.label())
    }
}

impl<'de> Deserialize<'de> for Scheme {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Scheme, D::Error> {
        let name = std::borrow::Cow::<'de, str>::deserialize(d)?;
        Scheme::parse(&name).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_stay_inside_the_directory() {
        for ok in [
            "resident.bin",
            "packed_experts/layer_00.bin",
            "tokenizer/a.b.json",
        ] {
            assert_eq!(check_relative_path(ok), Ok(()), "{ok}");
        }
        for (bad, why) in [
            ("", "empty path"),
            ("/etc/passwd", "is absolute"),
            ("../x", "\"..\" component"),
            ("a/../../x", "\"..\" component"),
            ("a/./b", "\".\" component"),
            ("a//b", "empty component"),
            ("a/", "empty component"),
            ("a\\..\\b", "contains '\\\\'"),
            ("C:x", "contains ':'"),
            ("a\nb", "contains '\\n'"),
        ] {
            let e = check_relative_path(bad).unwrap_err();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
        assert!(
            check_relative_path(&"a".repeat(MAX_PATH_BYTES + 1))
                .unwrap_err()
                .contains("more than 1024")
        );
    }
}
