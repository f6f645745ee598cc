//! The plan's *row pools* stage: group row-table shards into row pools and size them.
//!
//! A row pool is one file per (layer, table name); its shards (numbered `0..n`, one
//! width and dtype) are laid out one after another, each as whole 16 KiB blocks of
//! rows that never straddle a block ([`RowBlocks`]).

use std::collections::BTreeMap;

use crate::format::pools::{RowPool, RowShard};
use crate::format::{PAGE, RowBlocks, row_bytes};

use super::classify::{Draft, DraftRole, TableKey};
use super::error::PlanError;
use super::policy::Policy;
use super::types::{Dest, Placed};

/// The row pools in (layer, name) order and where each shard tensor goes.
pub(super) fn place(
    policy: &Policy<'_>,
    drafts: &[Draft],
) -> Result<(Vec<RowPool>, Placed), PlanError> {
    // (shard index, tensor index) per table.
    let mut tables: BTreeMap<TableKey, Vec<(u64, usize)>> = BTreeMap::new();
    for (ti, d) in drafts.iter().enumerate() {
        if let DraftRole::Rows { table, shard } = &d.role {
            tables.entry(table.clone()).or_default().push((*shard, ti));
        }
    }
    let mut pools = Vec::new();
    let mut placed = Placed::new();
    for (key, mut members) in tables {
        members.sort();
        let (pool, members_placed) = place_table(policy, drafts, key, &members, pools.len())?;
        pools.push(pool);
        placed.extend(members_placed);
    }
    Ok((pools, placed))
}

/// Check and size row pool number `pi` from its `(shard, tensor)` members in shard
/// order; where each member goes.
fn place_table(
    policy: &Policy<'_>,
    tensors: &[Draft],
    (layer, name): TableKey,
    members: &[(u64, usize)],
    pi: usize,
) -> Result<(RowPool, Placed), PlanError> {
    let file = format!("ple/layer_{layer:02}_{name}.bin");
    let pool_err = |detail: String| PlanError::Pool {
        pool: file.clone(),
        detail,
    };
    for (i, (s, ti)) in members.iter().enumerate() {
        if *s != i as u64 {
            return Err(pool_err(format!(
                "row shards are not numbered 0..{}: `{}` is shard {s} at position {i}",
                members.len(),
                tensors[*ti].name
            )));
        }
    }
    let first = &tensors[members[0].1];
    let (width, dtype) = (first.shape[1], first.dtype);
    if let Some((_, ti)) = members
        .iter()
        .find(|(_, ti)| tensors[*ti].shape[1] != width || tensors[*ti].dtype != dtype)
    {
        return Err(pool_err(format!(
            "`{}` is {} {:?}, but `{}` is {} {:?}",
            tensors[*ti].name,
            tensors[*ti].dtype.name(),
            tensors[*ti].shape,
            first.name,
            dtype.name(),
            first.shape
        )));
    }
    let scheme = policy.pool(&first.name, layer, dtype, width);
    let rb = row_bytes(width, dtype.size(), scheme)
        .ok_or_else(|| PlanError::Overflow { what: file.clone() })?;
    let mut offset = 0u64;
    let mut shards = Vec::new();
    let mut placed = Placed::new();
    let mut rows_per_block = 0;
    for (si, (_, ti)) in members.iter().enumerate() {
        let t = &tensors[*ti];
        let g = RowBlocks::new(t.shape[0], rb)
            .ok_or_else(|| pool_err(format!("a {rb}-byte row does not fit a {PAGE}-byte block")))?;
        rows_per_block = g.rows_per_block;
        shards.push(RowShard {
            tensor: t.name.clone(),
            rows: t.shape[0],
            offset,
            blocks: g.blocks,
            region_bytes: g.region_bytes,
        });
        offset = offset
            .checked_add(g.region_bytes)
            .ok_or_else(|| PlanError::Overflow { what: file.clone() })?;
        placed.push((
            *ti,
            scheme,
            Dest::Rows {
                pool: pi,
                shard: si,
            },
        ));
    }
    let pool = RowPool {
        file,
        layer,
        name,
        width,
        dtype,
        scheme,
        row_bytes: rb,
        rows_per_block,
        shards,
        file_bytes: offset,
    };
    Ok((pool, placed))
}
