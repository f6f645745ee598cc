//! The plan's *expert pools* stage: group expert tensors into per-layer pools and
//! size them.
//!
//! A pool is either fused (one `gate_up_proj [E, 2I, H]` and one `down_proj [E, H, I]`)
//! or unfused (`gate_proj`, `up_proj`, `down_proj` per expert, numbered `0..E`); both
//! land in the same layout: one blob per expert (gate, up, down, each as
//! weights/scales/biases), one stride per pool (the blob rounded up to a page).

use std::collections::BTreeMap;

use crate::family::Family;
use crate::format::pools::{BlobPart, ExpertPart, ExpertPool};
use crate::format::{PAGE, align_up};
use crate::header::Dtype;

use super::classify::{Draft, DraftRole, PoolKey};
use super::{Dest, Placed, PlanError, PlanOptions, pool_scheme};

/// One member of a pool: tensor index, part, expert (`None` when fused).
type Member = (usize, ExpertPart, Option<u64>);

/// The expert pools (main model first, then sidecars; layer order inside each) and
/// where each member tensor goes.
pub(super) fn place(
    family: &Family,
    options: &PlanOptions,
    drafts: &[Draft],
) -> Result<(Vec<ExpertPool>, Placed), PlanError> {
    let mut groups: BTreeMap<PoolKey, Vec<Member>> = BTreeMap::new();
    for (ti, d) in drafts.iter().enumerate() {
        if let DraftRole::Expert { pool, part, expert } = &d.role {
            groups
                .entry(pool.clone())
                .or_default()
                .push((ti, *part, *expert));
        }
    }
    let mut pools = Vec::new();
    let mut placed = Placed::new();
    for (key, members) in groups {
        let (pool, members_placed) =
            place_pool(family, options, drafts, key, &members, pools.len())?;
        pools.push(pool);
        placed.extend(members_placed);
    }
    Ok((pools, placed))
}

/// Check and size pool number `pi`; where its members go.
fn place_pool(
    family: &Family,
    options: &PlanOptions,
    tensors: &[Draft],
    (sidecar, layer): PoolKey,
    members: &[Member],
    pi: usize,
) -> Result<(ExpertPool, Placed), PlanError> {
    let file = match &sidecar {
        None => format!("packed_experts/layer_{layer:02}.bin"),
        Some(s) => format!("packed_experts/{s}_layer_{layer:02}.bin"),
    };
    let pool_err = |detail: String| PlanError::Pool {
        pool: file.clone(),
        detail,
    };
    let first = &tensors[members[0].0];
    let dtype = first.dtype;
    if let Some(&(ti, _, _)) = members.iter().find(|m| tensors[m.0].dtype != dtype) {
        return Err(pool_err(format!(
            "`{}` is {} but `{}` is {}",
            tensors[ti].name,
            tensors[ti].dtype.name(),
            first.name,
            dtype.name()
        )));
    }
    let fused = members.iter().any(|m| m.2.is_none());
    let (shape, dests) = if fused {
        fused_shape(tensors, members, pi).map_err(pool_err)?
    } else {
        unfused_shape(tensors, members, pi).map_err(pool_err)?
    };
    let scheme = pool_scheme(family, options, dtype, &[shape.hidden, shape.inter]);
    let (parts, blob_bytes) = blob_parts(&shape, dtype, scheme)
        .ok_or_else(|| PlanError::Overflow { what: file.clone() })?;
    let stride =
        align_up(blob_bytes, PAGE).ok_or_else(|| PlanError::Overflow { what: file.clone() })?;
    let file_bytes = shape
        .experts
        .checked_mul(stride)
        .ok_or_else(|| PlanError::Overflow { what: file.clone() })?;
    let placed = dests
        .into_iter()
        .map(|(ti, dest)| (ti, scheme, dest))
        .collect();
    let pool = ExpertPool {
        file,
        layer,
        sidecar,
        experts: shape.experts,
        scheme,
        dtype,
        blob_bytes,
        stride,
        parts,
        file_bytes,
    };
    Ok((pool, placed))
}

/// A pool's axes: experts `E`, intermediate `I`, hidden `H`.
struct PoolShape {
    experts: u64,
    inter: u64,
    hidden: u64,
}

/// The axes of a fused pool and its two tensors' destinations.
fn fused_shape(
    tensors: &[Draft],
    members: &[Member],
    pi: usize,
) -> Result<(PoolShape, Vec<(usize, Dest)>), String> {
    let find = |p: ExpertPart| {
        members
            .iter()
            .filter(|m| m.1 == p)
            .map(|m| m.0)
            .collect::<Vec<_>>()
    };
    let (gu, dn) = (find(ExpertPart::GateUp), find(ExpertPart::Down));
    if gu.len() != 1 || dn.len() != 1 || members.len() != 2 {
        return Err(format!(
            "needs exactly one fused gate_up_proj and one down_proj tensor, found {} and {}",
            gu.len(),
            dn.len()
        ));
    }
    let (g, d) = (&tensors[gu[0]].shape, &tensors[dn[0]].shape);
    if g[1] % 2 != 0 {
        return Err(format!(
            "`{}` shape {:?}: gate_up rows {} are not even",
            tensors[gu[0]].name, g, g[1]
        ));
    }
    let (experts, inter, hidden) = (g[0], g[1] / 2, g[2]);
    if d[..] != [experts, hidden, inter] {
        return Err(format!(
            "`{}` shape {:?} does not match gate_up_proj {:?} (expected [{experts}, {hidden}, {inter}])",
            tensors[dn[0]].name, d, g
        ));
    }
    let dest = |part| Dest::ExpertsFused { pool: pi, part };
    Ok((
        PoolShape {
            experts,
            inter,
            hidden,
        },
        vec![
            (gu[0], dest(ExpertPart::GateUp)),
            (dn[0], dest(ExpertPart::Down)),
        ],
    ))
}

/// The axes of an unfused pool (experts numbered `0..E`, each with a gate, up and
/// down projection shaped like expert 0's) and every member's destination.
fn unfused_shape(
    tensors: &[Draft],
    members: &[Member],
    pi: usize,
) -> Result<(PoolShape, Vec<(usize, Dest)>), String> {
    let mut by_expert: BTreeMap<u64, BTreeMap<ExpertPart, usize>> = BTreeMap::new();
    for &(ti, part, e) in members {
        if part == ExpertPart::GateUp {
            // A fused rule with an `{expert}` capture: there is no per-expert slot for it.
            return Err(format!(
                "`{}` is a fused gate_up_proj, but this pool's tensors are numbered per expert",
                tensors[ti].name
            ));
        }
        let e = e.unwrap_or(0);
        if by_expert.entry(e).or_default().insert(part, ti).is_some() {
            return Err(format!("expert {e} has two `{part:?}` tensors"));
        }
    }
    let experts = by_expert.len() as u64;
    if by_expert.keys().next_back() != Some(&(experts - 1)) {
        let missing = (0..experts + 1)
            .find(|e| !by_expert.contains_key(e))
            .unwrap_or(0);
        return Err(format!(
            "experts are not numbered 0..{experts}: expert {missing} is missing"
        ));
    }
    let g0 = &tensors[*by_expert[&0]
        .get(&ExpertPart::Gate)
        .ok_or_else(|| "expert 0 has no gate_proj".to_string())?]
    .shape;
    let (inter, hidden) = (g0[0], g0[1]);
    let mut dests = Vec::new();
    for (e, parts) in &by_expert {
        for (part, want) in [
            (ExpertPart::Gate, [inter, hidden]),
            (ExpertPart::Up, [inter, hidden]),
            (ExpertPart::Down, [hidden, inter]),
        ] {
            let ti = *parts.get(&part).ok_or_else(|| {
                format!(
                    "expert {e} has no `{}` tensor",
                    match part {
                        ExpertPart::Gate => "gate_proj",
                        ExpertPart::Up => "up_proj",
                        _ => "down_proj",
                    }
                )
            })?;
            if tensors[ti].shape[..] != want {
                return Err(format!(
                    "`{}` shape {:?}, expected {:?} like expert 0",
                    tensors[ti].name, tensors[ti].shape, want
                ));
            }
            dests.push((
                ti,
                Dest::Expert {
                    pool: pi,
                    expert: *e,
                    part,
                },
            ));
        }
    }
    Ok((
        PoolShape {
            experts,
            inter,
            hidden,
        },
        dests,
    ))
}

/// The blob's parts (gate, up, down, contiguous) and its unpadded length.
fn blob_parts(
    shape: &PoolShape,
    dtype: Dtype,
    scheme: crate::format::Scheme,
) -> Option<(Vec<BlobPart>, u64)> {
    let (inter, hidden) = (shape.inter, shape.hidden);
    let mut parts = Vec::new();
    let mut offset = 0u64;
    for (part, r, c) in [
        (ExpertPart::Gate, inter, hidden),
        (ExpertPart::Up, inter, hidden),
        (ExpertPart::Down, hidden, inter),
    ] {
        let (w, s, b) = scheme
            .sizes(r, c, dtype.size())
            .map(|q| (q.weights, q.scales, q.biases))?;
        parts.push(BlobPart {
            part,
            rows: r,
            cols: c,
            offset,
            weights: w,
            scales: s,
            biases: b,
        });
        offset += w + s + b;
    }
    Some((parts, offset))
}
