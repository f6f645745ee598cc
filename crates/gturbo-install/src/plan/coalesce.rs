//! Coalescing source byte ranges into large reads.
//!
//! Neighbouring tensors of one shard are merged into one ranged read when the gap
//! between them is small (the gap is read through and discarded: one request costs
//! more than a few hundred KiB of transfer), up to a size cap that bounds the work
//! lost when a read fails and keeps many reads in flight. A tensor larger than the cap
//! is split at whole rows, so each read carries complete rows.

pub use super::types::{COALESCE_GAP, COALESCE_MAX};
use super::types::{Dest, PlanOptions, PlannedShard, PlannedTensor, RangeRead};

/// The plan's last stage, *reads*: its reads, in (shard, offset) order. A shard whose
/// published SHA-256 is checked is read whole ([`cover_shard`]); any other shard's
/// included tensors are coalesced ([`coalesce`]). `tensors` are in (shard, offset) order.
pub fn plan_reads(
    shards: &[PlannedShard],
    tensors: &[PlannedTensor],
    options: &PlanOptions,
) -> Vec<RangeRead> {
    let mut reads = Vec::new();
    for (si, shard) in shards.iter().enumerate() {
        let mine: Vec<&PlannedTensor> = tensors.iter().filter(|t| t.shard == si).collect();
        if options.verify_source && shard.sha256.is_some() {
            reads.extend(cover_shard(si, shard.size, &mine, options.coalesce_max));
        } else {
            reads.extend(coalesce(mine, options.coalesce_max, options.coalesce_gap));
        }
    }
    reads
}

/// Reads covering every included tensor's bytes, in (shard, offset) order.
/// `tensors` must be in (shard, offset) order.
pub fn coalesce<'a>(
    tensors: impl IntoIterator<Item = &'a PlannedTensor>,
    max: u64,
    gap: u64,
) -> Vec<RangeRead> {
    let max = max.max(1);
    let mut reads: Vec<RangeRead> = Vec::new();
    let mut cur: Option<RangeRead> = None;
    for t in tensors {
        if matches!(t.dest, Dest::Excluded { .. }) || t.src[0] == t.src[1] {
            continue;
        }
        let [start, end] = t.src;
        if let Some(mut c) = cur.take() {
            if c.shard == t.shard && start >= c.end && start - c.end <= gap && end - c.start <= max
            {
                c.end = end;
                cur = Some(c);
                continue;
            }
            reads.push(c);
        }
        if end - start <= max {
            cur = Some(RangeRead {
                shard: t.shard,
                start,
                end,
            });
            continue;
        }
        let row = t.src_row_bytes();
        let piece = if row <= max { max / row * row } else { max };
        let mut s = start;
        while end - s > piece {
            reads.push(RangeRead {
                shard: t.shard,
                start: s,
                end: s + piece,
            });
            s += piece;
        }
        cur = Some(RangeRead {
            shard: t.shard,
            start: s,
            end,
        });
    }
    reads.extend(cur);
    reads
}

/// Reads covering a whole shard `[0, size)` in order (header, every tensor including
/// excluded ones), for source verification: cut between tensors, and inside a tensor
/// larger than `max` at whole rows. `tensors` are the shard's, in offset order.
pub fn cover_shard(
    shard: usize,
    size: u64,
    tensors: &[&PlannedTensor],
    max: u64,
) -> Vec<RangeRead> {
    let max = max.max(1);
    let mut reads = Vec::new();
    let mut start = 0u64;
    let mut end = tensors.first().map(|t| t.src[0]).unwrap_or(size);
    for t in tensors {
        let [ts, te] = t.src;
        if te - start <= max {
            end = te;
            continue;
        }
        if end > start && ts - start > max {
            reads.push(RangeRead { shard, start, end });
            start = end;
        }
        // Bytes before the tensor that no planned tensor holds (a requantized
        // module's staged scales and biases): read for the hash, cut anywhere.
        while ts - start > max {
            reads.push(RangeRead {
                shard,
                start,
                end: start + max,
            });
            start += max;
        }
        if ts > start {
            reads.push(RangeRead {
                shard,
                start,
                end: ts,
            });
            start = ts;
        }
        let row = t.src_row_bytes();
        let piece = if row <= max { max / row * row } else { max };
        while te - start > max {
            reads.push(RangeRead {
                shard,
                start,
                end: start + piece,
            });
            start += piece;
        }
        end = te;
    }
    end = end.max(size);
    if end > start {
        reads.push(RangeRead { shard, start, end });
    }
    reads
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Scheme;
    use crate::header::Dtype;

    fn t(shard: usize, start: u64, end: u64, excluded: bool) -> PlannedTensor {
        PlannedTensor {
            name: format!("t{start}"),
            shard,
            dtype: Dtype::BF16,
            shape: vec![(end - start) / 8, 4],
            src: [start, end],
            scheme: Scheme::Passthrough,
            packed: None,
            requant: None,
            fp8: None,
            transposed: false,
            dest: if excluded {
                Dest::Excluded { why: "x".into() }
            } else {
                Dest::Resident { entry: 0 }
            },
        }
    }

    #[test]
    fn merges_small_gaps_splits_big_tensors_and_skips_exclusions() {
        let ts = vec![
            t(0, 100, 200, false),
            t(0, 200, 300, false),
            t(0, 310, 400, false),   // gap 10: read through
            t(0, 400, 1000, true),   // excluded: not read
            t(0, 1000, 1100, false), // gap 600 > 64: new read
            t(1, 100, 300, false),   // other shard
            t(1, 300, 1000, false),  // 700 bytes > max 256: split at 8-byte rows
        ];
        let r = coalesce(&ts, 256, 64);
        // Covering a shard reads every byte, excluded ones too, cut at whole rows.
        let shard0: Vec<&PlannedTensor> = ts.iter().filter(|t| t.shard == 0).collect();
        let cover = cover_shard(0, 1100, &shard0, 256);
        let spans: Vec<(u64, u64)> = cover.iter().map(|r| (r.start, r.end)).collect();
        assert_eq!(
            spans,
            vec![(0, 200), (200, 400), (400, 656), (656, 912), (912, 1100)]
        );
        let spans: Vec<(usize, u64, u64)> = r.iter().map(|r| (r.shard, r.start, r.end)).collect();
        assert_eq!(
            spans,
            vec![
                (0, 100, 300),
                (0, 310, 400),
                (0, 1000, 1100),
                (1, 100, 300),
                (1, 300, 556),
                (1, 556, 812),
                (1, 812, 1000)
            ]
        );
        // Every included byte is covered exactly once.
        let covered: u64 = r.iter().map(|r| r.end - r.start).sum();
        assert_eq!(covered, 200 + 90 + 100 + 200 + 700);
    }

    #[test]
    fn covering_a_shard_reads_bytes_no_planned_tensor_holds_and_cuts_tensors_at_their_rows() {
        // A requantized module's scales and biases are not planned tensors: 700 bytes
        // of them lie between the two tensors (more than max 256).
        let ts = [t(0, 0, 100, false), t(0, 800, 1200, false)];
        let refs: Vec<&PlannedTensor> = ts.iter().collect();
        let spans: Vec<(u64, u64)> = cover_shard(0, 1300, &refs, 256)
            .iter()
            .map(|r| (r.start, r.end))
            .collect();
        assert_eq!(
            spans,
            vec![
                (0, 100),
                (100, 356),
                (356, 612),
                (612, 800),
                (800, 1056),
                (1056, 1300)
            ]
        );
    }
}
