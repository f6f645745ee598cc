//! The plan's first stage, *classify*: give every source tensor its role.
//!
//! Each tensor of each validated header is matched against the family's rules and
//! becomes a [`Draft`]: its source bytes and a [`DraftRole`] saying which later stage
//! places it (resident file, an expert pool, a row table) or why it is left out. The
//! checks that need only the tensor itself happen here (duplicate names, expert and
//! row shapes and dtypes); checks across tensors belong to the stage that groups them.

use std::collections::BTreeMap;

use crate::family::{Family, Role, RuleMatch};
use crate::format::Scheme;
use crate::format::pools::ExpertPart;
use crate::header::{Dtype, ShardHeader};

use super::error::PlanError;
use super::mlx::{Packed, PartSrc, Source};
use super::policy::Policy;
use super::types::{Arch, PlanOptions};

/// An expert pool: the sidecar it belongs to (`None` for the main model) and its layer.
/// `None` orders before every sidecar, so a map over keys lists the main model first.
pub(super) type PoolKey = (Option<String>, u64);

/// A row table: its layer and pool name.
pub(super) type TableKey = (u64, String);

/// One source tensor, classified but not yet placed.
#[derive(Debug)]
pub(super) struct Draft {
    /// Name.
    pub name: String,
    /// Index into the plan's shards.
    pub shard: usize,
    /// Source dtype.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<u64>,
    /// Absolute byte range in the shard file.
    pub src: [u64; 2],
    /// What happens to it.
    pub role: DraftRole,
    /// The `{layer}` its rule captured, if any.
    pub layer: Option<u64>,
    /// The sidecar its rule belongs to, if any.
    pub sidecar: Option<String>,
    /// The module's source parts, for a pre-quantized tensor (its bytes are copied,
    /// never quantized again).
    pub packed: Option<Packed>,
    /// The module's source parts, for a pre-quantized tensor installed with
    /// `--requantize` (planned like a BF16 matrix, dequantized by the executor).
    pub requant: Option<Packed>,
    /// The block scales of an FP8 weight (planned like the BF16 matrix it
    /// dequantizes to, dequantized by the executor).
    pub fp8: Option<PartSrc>,
    /// Fused experts stored transposed ([`crate::family::TensorRule::transposed`]):
    /// `shape` is then the logical `[E, out, in]`, not the source's `[E, in, out]`.
    pub transposed: bool,
}

/// Which stage places a tensor.
#[derive(Debug)]
pub(super) enum DraftRole {
    /// Not installed.
    Excluded {
        /// Why.
        why: String,
    },
    /// An entry of the resident file, at this scheme.
    Resident {
        /// Scheme under the family policy.
        scheme: Scheme,
    },
    /// A member of an expert pool.
    Expert {
        /// The pool.
        pool: PoolKey,
        /// Which projection.
        part: ExpertPart,
        /// The expert, for an unfused checkpoint (`None`: the tensor holds every expert).
        expert: Option<u64>,
        /// A fused gate_up whose rows alternate gate, up (the rule's
        /// `gate_up_interleaved`).
        gate_up_interleaved: bool,
    },
    /// One shard of a row table.
    Rows {
        /// The table.
        table: TableKey,
        /// Shard index inside the table.
        shard: u64,
    },
}

/// Classify every source tensor (see [`super::mlx::sources`]), in (shard, offset)
/// order. A pre-quantized source's quantized modules keep their own widths and
/// everything else stays at its dtype ([`Policy`]).
pub(super) fn classify(
    family: &Family,
    arch: &Arch,
    options: &PlanOptions,
    policy: &Policy<'_>,
    headers: &[ShardHeader],
    sources: Vec<Source>,
) -> Result<Vec<Draft>, PlanError> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut drafts = Vec::new();
    for mut t in sources {
        let (si, h) = (t.shard, &headers[t.shard]);
        // Under --requantize a module is the matrix it dequantizes to: the policy
        // gives its scheme, as for a BF16 source.
        let requant = if policy.requantize {
            t.packed.take()
        } else {
            None
        };
        let (m, name) =
            family
                .classify_normalised(&t.name)
                .ok_or_else(|| PlanError::Unmatched {
                    shard: h.shard.clone(),
                    tensor: t.name.clone(),
                    family_file: family.origin.clone(),
                })?;
        let name = name.into_owned();
        // Two source names (one prefixed) for one installed name are duplicates too.
        if let Some(&prev) = seen.get(&name) {
            return Err(PlanError::Duplicate {
                tensor: name,
                first: headers[prev].shard.clone(),
                second: h.shard.clone(),
            });
        }
        seen.insert(name.clone(), si);
        // A rule's sidecar, else the one its layer number puts it in (a NextN layer).
        let sidecar = m.rule.sidecar.clone().or_else(|| {
            family
                .layer_sidecar(m.captures.layer, &arch.axes)
                .map(str::to_string)
        });
        let tensor = Classified {
            source: &t,
            shard: &h.shard,
            name: &name,
            rule: &m,
            sidecar: sidecar.as_deref(),
            requantized: requant.is_some(),
        };
        let role = tensor.role(family, options, policy)?;
        let transposed = m.rule.transposed;
        if transposed && (t.packed.is_some() || requant.is_some() || t.fp8.is_some()) {
            return Err(tensor.tensor_err(
                "dtype",
                "transposed experts are installed from unquantized weights".into(),
            ));
        }
        let mut shape = t.shape;
        if transposed && let [_, a, b] = &mut shape[..] {
            std::mem::swap(a, b);
        }
        drafts.push(Draft {
            name,
            shard: si,
            dtype: t.dtype,
            shape,
            src: t.src,
            role,
            layer: m.captures.layer,
            sidecar,
            packed: t.packed,
            requant,
            fp8: t.fp8,
            transposed,
        });
    }
    Ok(drafts)
}

/// One source tensor and the family rule it matched, for the role stage.
struct Classified<'a> {
    source: &'a Source,
    /// The shard file it is in (for errors).
    shard: &'a str,
    /// Its installed name.
    name: &'a str,
    rule: &'a RuleMatch<'a>,
    /// The sidecar it belongs to, if any.
    sidecar: Option<&'a str>,
    /// Whether it is a module `--requantize` dequantizes.
    requantized: bool,
}

impl Classified<'_> {
    fn tensor_err(&self, field: &str, detail: String) -> PlanError {
        PlanError::Tensor {
            shard: self.shard.to_string(),
            tensor: self.source.name.clone(),
            field: field.to_string(),
            detail,
        }
    }

    /// What happens to the tensor: excluded (by its rule, or with a skipped sidecar),
    /// resident at the policy's scheme, or a member of an expert pool or a row table.
    fn role(
        &self,
        family: &Family,
        options: &PlanOptions,
        policy: &Policy<'_>,
    ) -> Result<DraftRole, PlanError> {
        let (m, t) = (self.rule, self.source);
        let skipped = self.sidecar.filter(|s| options.skips_sidecar(family, s));
        if let Some(s) = skipped {
            return Ok(DraftRole::Excluded {
                why: format!("sidecar `{s}` skipped"),
            });
        }
        Ok(match m.rule.role {
            Role::Excluded => DraftRole::Excluded {
                why: m
                    .rule
                    .why
                    .clone()
                    .unwrap_or_else(|| "excluded by the family".into()),
            },
            Role::Resident => DraftRole::Resident {
                scheme: match &t.packed {
                    Some(p) if p.scheme == Scheme::Mxfp4 => {
                        return Err(self.tensor_err(
                            "role",
                            "an MXFP4 module is installed into an expert pool; the family \
                             makes this one resident, which has no MXFP4 layout"
                                .into(),
                        ));
                    }
                    Some(p) => p.scheme,
                    None => policy.resident(self.name, m.captures.layer, t.dtype, &t.shape),
                },
            },
            Role::ExpertsFused | Role::Expert | Role::ExpertsStacked => self.expert_role()?,
            Role::Rows => self.rows_role()?,
        })
    }

    /// An expert projection: the part its rule's role and capture name, and the
    /// dimensions that role gives.
    fn expert_role(&self) -> Result<DraftRole, PlanError> {
        let (m, t) = (self.rule, self.source);
        let part = match (
            m.rule.role,
            m.captures.part.as_deref().map(|p| m.rule.part(p)),
        ) {
            (Role::ExpertsStacked, Some("gate_proj")) => ExpertPart::Gate,
            (Role::ExpertsStacked, Some("up_proj")) => ExpertPart::Up,
            (Role::ExpertsStacked, Some("down_proj")) => ExpertPart::Down,
            (Role::ExpertsFused, Some("gate_up_proj")) => ExpertPart::GateUp,
            (Role::ExpertsFused, Some("down_proj")) => ExpertPart::Down,
            (Role::Expert, Some("gate_proj")) => ExpertPart::Gate,
            (Role::Expert, Some("up_proj")) => ExpertPart::Up,
            (Role::Expert, Some("down_proj")) => ExpertPart::Down,
            (_, p) => {
                return Err(self.tensor_err(
                    "name",
                    format!(
                        "expert part {p:?} is not one of gate_up_proj/down_proj (fused) or gate_proj/up_proj/down_proj"
                    ),
                ));
            }
        };
        let want_dims = if m.rule.role == Role::Expert { 2 } else { 3 };
        if t.shape.len() != want_dims || t.shape.contains(&0) {
            return Err(self.tensor_err(
                "shape",
                format!(
                    "{:?}: expected {want_dims} non-zero dimensions for {:?} experts",
                    t.shape, m.rule.role
                ),
            ));
        }
        Ok(DraftRole::Expert {
            pool: (
                self.sidecar.map(str::to_string),
                m.captures.layer.unwrap_or(0),
            ),
            part,
            expert: m.captures.expert,
            gate_up_interleaved: m.rule.gate_up_interleaved && part == ExpertPart::GateUp,
        })
    }

    /// A shard of a row table: unquantized, 2-D, floating point.
    fn rows_role(&self) -> Result<DraftRole, PlanError> {
        let (m, t) = (self.rule, self.source);
        if t.packed.is_some() || self.requantized || t.fp8.is_some() {
            return Err(self.tensor_err(
                "dtype",
                "a row table is installed from unquantized rows; this one is \
                 pre-quantized (MLX or FP8)"
                    .into(),
            ));
        }
        if t.shape.len() != 2 || t.shape[1] == 0 {
            return Err(self.tensor_err(
                "shape",
                format!("{:?}: a row table must be 2-D [rows, width]", t.shape),
            ));
        }
        if !matches!(t.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
            return Err(self.tensor_err(
                "dtype",
                format!("{}: a row table must be floating point", t.dtype.name()),
            ));
        }
        let name = m.rule.pool.clone().unwrap_or_else(|| "rows".into());
        Ok(DraftRole::Rows {
            table: (m.captures.layer.unwrap_or(0), name),
            shard: m.captures.shard.unwrap_or(0),
        })
    }
}
