//! What a plan adds up to: its census, output totals and footprint, the facts it was
//! made from (and what changed between two records of them), and its fingerprint.

use std::collections::{BTreeMap, BTreeSet};

use super::profile;
use super::types::{Census, Dest, OutputTotals, Outputs, Plan, PlannedTensor};
use crate::format::Scheme;
use crate::format::pools::{ExpertPart, ExpertPool};
use crate::header::Dtype;

fn elems(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
}

impl Census {
    /// The *census* stage: count every source tensor by the scheme of its output.
    pub(super) fn count(tensors: &[PlannedTensor], outputs: &Outputs) -> Census {
        let mut census = Census::default();
        for t in tensors {
            // A pre-quantized module counts once, as its logical matrix.
            if t.packed.is_some_and(|p| p.stream != 0) {
                continue;
            }
            let n = match t.packed {
                Some(p) => elems(&t.shape).map_or(0, |e| {
                    e / t.shape.last().copied().unwrap_or(1).max(1) * p.cols
                }),
                None => elems(&t.shape).unwrap_or(0),
            };
            let out = match &t.dest {
                Dest::Excluded { .. } => t.src[1] - t.src[0],
                Dest::Resident { entry } => outputs.resident.index.tensors[*entry].stored_bytes(),
                Dest::ExpertsFused { pool, part, .. } => {
                    let p = &outputs.expert_pools[*pool];
                    let per: u64 = p
                        .parts
                        .iter()
                        .filter(|bp| match part {
                            ExpertPart::GateUp => bp.part != ExpertPart::Down,
                            other => bp.part == *other,
                        })
                        .map(|bp| bp.weights + bp.scales + bp.biases)
                        .sum();
                    per * p.experts
                }
                Dest::Expert { pool, part, .. } => {
                    let bp = outputs.expert_pools[*pool]
                        .parts
                        .iter()
                        .find(|bp| bp.part == *part);
                    bp.map(|bp| bp.weights + bp.scales + bp.biases).unwrap_or(0)
                }
                Dest::Rows { pool, .. } => outputs.row_pools[*pool].row_bytes * t.shape[0],
            };
            let row = match (&t.dest, t.scheme) {
                (Dest::Excluded { .. }, _) => &mut census.excluded,
                (_, Scheme::Int4G64) => &mut census.int4,
                (_, Scheme::Int8G64) => &mut census.int8,
                (_, Scheme::Passthrough) => &mut census.passthrough,
                (_, other) => census.other.entry(other.label()).or_default(),
            };
            row.tensors += 1;
            row.params += n;
            row.bytes += out;
        }
        census
    }
}

/// Resident + working-set bytes of an install ([`Plan::footprint`]'s rule): the
/// resident file, plus `num_experts_per_tok` (every expert when the axes name none)
/// blobs of each main-model expert pool.
pub fn footprint(
    resident_bytes: u64,
    pools: &[ExpertPool],
    axes: &BTreeMap<String, serde_json::Value>,
) -> u64 {
    let k = axes.get("num_experts_per_tok").and_then(|v| v.as_u64());
    pools
        .iter()
        .filter(|p| p.sidecar.is_none())
        .map(|p| {
            k.unwrap_or(p.experts)
                .min(p.experts)
                .saturating_mul(p.stride)
        })
        .fold(resident_bytes, u64::saturating_add)
}

/// What differs between two records of [`Plan::facts`], `before` then `now`, one
/// `name: was X, now Y` per fact, `; `-separated; empty when they agree.
pub fn changed(before: &BTreeMap<String, String>, now: &BTreeMap<String, String>) -> String {
    let names: BTreeSet<&String> = before.keys().chain(now.keys()).collect();
    names
        .into_iter()
        .filter_map(|k| {
            // A flag absent from a record was not given.
            let absent = if k.starts_with("--") {
                "not set"
            } else {
                "absent"
            };
            let (a, b) = (before.get(k), now.get(k));
            (a != b).then(|| {
                format!(
                    "{k}: was {}, now {}",
                    a.map_or(absent, |s| s.as_str()),
                    b.map_or(absent, |s| s.as_str())
                )
            })
        })
        .collect::<Vec<_>>()
        .join("; ")
}

impl Plan {
    /// SHA-256 of the plan's canonical JSON (sorted keys, no whitespace).
    pub fn fingerprint(&self) -> String {
        let bytes = crate::format::json::to_compact(self).expect(
            "a Plan always serializes: derived impls (and the resident entries' infallible \
             one) over strings, integers and string-keyed maps",
        );
        crate::format::digest::sha256_hex(&bytes)
    }

    /// Output bytes per kind.
    pub fn totals(&self) -> OutputTotals {
        let o = &self.outputs;
        let mut t = OutputTotals {
            resident: o.resident.file_bytes,
            ..Default::default()
        };
        for p in &o.expert_pools {
            if p.sidecar.is_some() {
                t.sidecar_experts += p.file_bytes;
            } else {
                t.experts += p.file_bytes;
            }
        }
        t.rows = o.row_pools.iter().map(|p| p.file_bytes).sum();
        t.copied = o.copied.iter().map(|c| c.bytes).sum();
        t.total = t.resident + t.experts + t.sidecar_experts + t.rows + t.copied;
        t.files =
            1 + o.expert_pools.len() as u64 + o.row_pools.len() as u64 + o.copied.len() as u64;
        t
    }

    /// What the plan was made from, each under the name a user knows it by (a flag,
    /// a file and field, a source shard): recorded beside a partial install, so a
    /// rerun whose fingerprint differs can say exactly what changed ([`changed`]).
    /// Everything else in the plan follows from these and gturbo's own layout rules.
    pub fn facts(&self) -> BTreeMap<String, String> {
        let none = || "none".to_string();
        let on = |b: bool| if b { "set" } else { "not set" }.to_string();
        let mut f = BTreeMap::new();
        let mut put = |k: String, v: String| {
            f.insert(k, v);
        };
        put("family".into(), self.family.clone());
        put("source repo".into(), self.source.repo.clone());
        put("revision".into(), self.source.revision.clone());
        put(
            "resolved commit".into(),
            self.source.commit.clone().unwrap_or_else(none),
        );
        put(
            "SHA-256 of model.safetensors.index.json".into(),
            self.source.index_sha256.clone().unwrap_or_else(none),
        );
        put("--quant".into(), self.options.quant.as_str().into());
        let max = self.options.coalesce_max;
        put(
            "--range-mib".into(),
            if max.is_multiple_of(1 << 20) {
                (max >> 20).to_string()
            } else {
                format!("{max} bytes")
            },
        );
        put(
            "read-through gap".into(),
            format!("{} bytes", self.options.coalesce_gap),
        );
        put("--no-verify-source".into(), on(!self.options.verify_source));
        if self.options.requantize {
            put("--requantize".into(), on(true));
        }
        for s in &self.options.skip_sidecars {
            put(format!("--skip-{s}"), on(true));
        }
        for s in &self.options.keep_sidecars {
            put(format!("--keep-{s}"), on(true));
        }
        put(
            "config.json model_type".into(),
            self.arch.model_type.clone(),
        );
        for (axis, v) in &self.arch.axes {
            put(format!("config.json axis {axis}"), v.to_string());
        }
        for (i, sh) in self.shards.iter().enumerate() {
            put(
                format!("{}: published SHA-256", sh.path),
                sh.sha256.clone().unwrap_or_else(none),
            );
            put(format!("{}: size", sh.path), format!("{} bytes", sh.size));
            // The header's tensors (names, dtypes, shapes, offsets), not what the
            // plan makes of them (that follows from the flags above).
            // A requantized module's staged scales and biases, and an FP8 weight's
            // block scales, are header tensors too.
            let staged = self
                .tensors
                .iter()
                .filter_map(|t| t.requant.as_ref())
                .flat_map(|r| [&r.scales, &r.biases])
                .chain(
                    self.tensors
                        .iter()
                        .filter_map(|t| Some(&t.fp8.as_ref()?.scale_inv)),
                )
                .filter(|p| p.shard == i)
                .map(|p| (p.name.as_str(), p.dtype, p.shape.as_slice(), p.src));
            let tensors: Vec<(&str, Dtype, &[u64], [u64; 2])> = self
                .tensors
                .iter()
                .filter(|t| t.shard == i)
                .map(|t| (t.name.as_str(), t.dtype, t.shape.as_slice(), t.src))
                .chain(staged)
                .collect();
            let digest = crate::format::json::to_compact(&tensors)
                .map(|b| crate::format::digest::sha256_hex(&b))
                .unwrap_or_else(|e| e.to_string());
            put(format!("{}: header (tensors)", sh.path), digest);
        }
        for c in &self.outputs.copied {
            put(format!("{}: size", c.source), format!("{} bytes", c.bytes));
        }
        f
    }

    /// The memory an installed model keeps in use, as `--quant auto` weighs it: the
    /// resident file plus its working set, the experts one token routes to
    /// (`num_experts_per_tok` blobs of each main-model expert pool; every expert when
    /// the config names no such axis).
    pub fn footprint(&self) -> u64 {
        footprint(
            self.outputs.resident.file_bytes,
            &self.outputs.expert_pools,
            &self.arch.axes,
        )
    }

    /// The modules a profile with rules put at another scheme than its default, as
    /// (module, scheme), each once (unfused experts as `experts.*`); empty for a
    /// profile without rules and for a pre-quantized source.
    pub fn profile_deviations(&self) -> Vec<(String, Scheme)> {
        let Some(default) = self.profile_default else {
            return Vec::new();
        };
        if !profile::get(self.options.quant.as_str()).is_ok_and(|p| p.has_rules()) {
            return Vec::new();
        }
        let mut out: Vec<(String, Scheme)> = Vec::new();
        for t in &self.tensors {
            if t.scheme == default
                || t.scheme == Scheme::Passthrough
                || matches!(t.dest, Dest::Excluded { .. })
            {
                continue;
            }
            let stem = t.name.strip_suffix(".weight").unwrap_or(&t.name);
            let parts: Vec<&str> = stem.split('.').collect();
            let module: Vec<&str> = parts
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let expert = i > 0 && parts[i - 1] == "experts";
                    if expert && p.bytes().all(|b| b.is_ascii_digit()) {
                        "*"
                    } else {
                        p
                    }
                })
                .collect();
            let entry = (module.join("."), t.scheme);
            if !out.contains(&entry) {
                out.push(entry);
            }
        }
        out
    }

    /// Bytes the reads fetch.
    pub fn source_bytes_read(&self) -> u64 {
        self.reads.iter().map(|r| r.end - r.start).sum()
    }
}
