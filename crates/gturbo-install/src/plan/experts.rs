//! The plan's *expert pools* stage: group expert tensors into per-layer pools and
//! size them.
//!
//! A pool is either fused (one `gate_up_proj [E, 2I, H]` and one `down_proj [E, H, I]`)
//! or unfused (`gate_proj`, `up_proj`, `down_proj` per expert, numbered `0..E`); both
//! land in the same layout: one blob per expert (gate, up, down, each as
//! weights/scales/biases), one stride per pool (the blob rounded up to a page).

use std::collections::BTreeMap;

use crate::format::pools::{BlobPart, ExpertPart, ExpertPool};
use crate::format::{PAGE, Scheme, align_up};
use crate::header::Dtype;

use super::classify::{Draft, DraftRole, PoolKey};
use super::error::PlanError;
use super::policy::Policy;
use super::types::{Dest, Placed};

/// One member of a pool: tensor index, part, expert (`None` when fused).
type Member = (usize, ExpertPart, Option<u64>);

/// The expert pools (main model first, then sidecars; layer order inside each) and
/// where each member tensor goes.
pub(super) fn place(
    policy: &Policy<'_>,
    drafts: &[Draft],
) -> Result<(Vec<ExpertPool>, Placed), PlanError> {
    let mut groups: BTreeMap<PoolKey, Vec<Member>> = BTreeMap::new();
    for (ti, d) in drafts.iter().enumerate() {
        if let DraftRole::Expert {
            pool, part, expert, ..
        } = &d.role
        {
            groups
                .entry(pool.clone())
                .or_default()
                .push((ti, *part, *expert));
        }
    }
    let mut pools = Vec::new();
    let mut placed = Placed::new();
    for (key, members) in groups {
        let (pool, members_placed) = place_pool(policy, drafts, key, &members, pools.len())?;
        pools.push(pool);
        placed.extend(members_placed);
    }
    Ok((pools, placed))
}

/// Check and size pool number `pi`; where its members go.
fn place_pool(
    policy: &Policy<'_>,
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
    let schemes = match part_schemes(tensors, members).map_err(pool_err)? {
        Some(s) => s,
        // Each part at its profile scheme; gate and up rows are `hidden` long, down's
        // `inter`.
        None => {
            let mut s = [Scheme::Passthrough; 3];
            for &(ti, part, _) in members {
                let idx: &[usize] = if part == ExpertPart::GateUp {
                    &[0, 1]
                } else {
                    &[part_index(part)]
                };
                for &i in idx {
                    let cols = if i == 2 { shape.inter } else { shape.hidden };
                    s[i] = policy.pool(&tensors[ti].name, layer, dtype, cols);
                }
            }
            s
        }
    };
    let scheme = schemes[0];
    let (parts, blob_bytes) = blob_parts(&shape, dtype, schemes)
        .ok_or_else(|| PlanError::Overflow { what: file.clone() })?;
    let stride =
        align_up(blob_bytes, PAGE).ok_or_else(|| PlanError::Overflow { what: file.clone() })?;
    let file_bytes = shape
        .experts
        .checked_mul(stride)
        .ok_or_else(|| PlanError::Overflow { what: file.clone() })?;
    let placed = dests
        .into_iter()
        .map(|(ti, dest)| {
            let s = match &dest {
                Dest::ExpertsFused { part, .. } | Dest::Expert { part, .. } => {
                    schemes[part_index(*part)]
                }
                _ => scheme,
            };
            (ti, s, dest)
        })
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

/// Index of a part's scheme in blob order (a fused gate_up is at the gate's).
fn part_index(part: ExpertPart) -> usize {
    match part {
        ExpertPart::Gate | ExpertPart::GateUp => 0,
        ExpertPart::Up => 1,
        ExpertPart::Down => 2,
    }
}

/// The gate, up and down schemes of a pool of pre-quantized members (each part keeps
/// its source's width and group, an unquantized one stays at its dtype); `None` when
/// no member is pre-quantized. One part at two layouts is refused.
fn part_schemes(tensors: &[Draft], members: &[Member]) -> Result<Option<[Scheme; 3]>, String> {
    if members.iter().all(|m| tensors[m.0].packed.is_none()) {
        return Ok(None);
    }
    let mut schemes: [Option<(Scheme, &str)>; 3] = [None; 3];
    for &(ti, part, _) in members {
        let t = &tensors[ti];
        // mlx-lm leaves a projection whose rows are not whole groups unquantized.
        let s = t.packed.as_ref().map_or(Scheme::Passthrough, |p| p.scheme);
        let idx: &[usize] = if part == ExpertPart::GateUp {
            &[0, 1]
        } else {
            &[part_index(part)]
        };
        for &i in idx {
            match schemes[i] {
                Some((prev, other)) if prev != s => {
                    return Err(format!(
                        "`{}` is {} but `{other}` of the same projection is {}",
                        t.name,
                        s.label(),
                        prev.label()
                    ));
                }
                _ => schemes[i] = Some((s, &t.name)),
            }
        }
    }
    Ok(Some(
        schemes.map(|s| s.map_or(Scheme::Passthrough, |s| s.0)),
    ))
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
    if gu.is_empty() {
        return stacked_shape(tensors, members, pi);
    }
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
    let interleaved = matches!(
        tensors[gu[0]].role,
        DraftRole::Expert {
            gate_up_interleaved: true,
            ..
        }
    );
    let dest = |part| Dest::ExpertsFused {
        pool: pi,
        part,
        interleaved: interleaved && part == ExpertPart::GateUp,
    };
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

/// The axes of a stacked pool (MLX's `switch_mlp`: one `gate_proj` and one `up_proj`
/// `[E, I, H]`, one `down_proj [E, H, I]`) and its three tensors' destinations.
fn stacked_shape(
    tensors: &[Draft],
    members: &[Member],
    pi: usize,
) -> Result<(PoolShape, Vec<(usize, Dest)>), String> {
    let mut by_part: BTreeMap<ExpertPart, usize> = BTreeMap::new();
    for &(ti, part, _) in members {
        if by_part.insert(part, ti).is_some() {
            return Err(format!(
                "two stacked `{part:?}` tensors, the second `{}`",
                tensors[ti].name
            ));
        }
    }
    let get = |p: ExpertPart, what: &str| {
        by_part.get(&p).copied().ok_or_else(|| {
            format!("needs stacked gate_proj, up_proj and down_proj; {what} is missing")
        })
    };
    let (g, u, d) = (
        get(ExpertPart::Gate, "gate_proj")?,
        get(ExpertPart::Up, "up_proj")?,
        get(ExpertPart::Down, "down_proj")?,
    );
    let gs = &tensors[g].shape;
    let (experts, inter, hidden) = (gs[0], gs[1], gs[2]);
    for (ti, want) in [(u, [experts, inter, hidden]), (d, [experts, hidden, inter])] {
        if tensors[ti].shape[..] != want {
            return Err(format!(
                "`{}` shape {:?} does not match `{}` {:?} (expected {want:?})",
                tensors[ti].name, tensors[ti].shape, tensors[g].name, gs
            ));
        }
    }
    let dest = |part| Dest::ExpertsFused {
        pool: pi,
        part,
        interleaved: false,
    };
    Ok((
        PoolShape {
            experts,
            inter,
            hidden,
        },
        vec![
            (g, dest(ExpertPart::Gate)),
            (u, dest(ExpertPart::Up)),
            (d, dest(ExpertPart::Down)),
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

/// The blob's parts (gate, up, down, contiguous, at `schemes` in that order; a part
/// records its scheme only where it differs from the gate's, the pool's) and its
/// unpadded length.
fn blob_parts(
    shape: &PoolShape,
    dtype: Dtype,
    schemes: [Scheme; 3],
) -> Option<(Vec<BlobPart>, u64)> {
    let (inter, hidden) = (shape.inter, shape.hidden);
    let mut parts = Vec::new();
    let mut offset = 0u64;
    for ((part, r, c), scheme) in [
        (ExpertPart::Gate, inter, hidden),
        (ExpertPart::Up, inter, hidden),
        (ExpertPart::Down, hidden, inter),
    ]
    .into_iter()
    .zip(schemes)
    {
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
            scheme: (scheme != schemes[0]).then_some(scheme),
        });
        offset = offset.checked_add(w.checked_add(s)?.checked_add(b)?)?;
    }
    Some((parts, offset))
}
