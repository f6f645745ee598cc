//! The readers verify-install and the runtime apply to an untrusted `.gturbo`
//! directory, on arbitrary bytes: they may refuse anything, but must never panic, and
//! what the layout checks accept must hold together.
//!
//! The same input is tried three ways: as `manifest.json` (parse, then the pure
//! manifest checks, pool geometry included); as a whole `resident.bin` (head, index,
//! index layout against the real payload size); and as a bare resident JSON index
//! behind a synthetic head (so the fuzzer need not discover the magic).

#![no_main]

use gturbo::format::manifest::Manifest;
use gturbo::format::resident::{MAGIC, ResidentHead, ResidentIndex};
use libfuzzer_sys::fuzz_target;

/// Payload size assumed for a bare index.
const BARE_PAYLOAD: u64 = 1 << 30;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Manifest::parse(data) {
        let failures = gturbo::verify::check_manifest(&m);
        for p in &m.expert_pools {
            if p.layout_errors().is_empty() {
                // Accepted geometry: every part lies inside the stride, the file is
                // experts × stride.
                for part in &p.parts {
                    assert!(part.offset + part.total().unwrap() <= p.stride);
                }
                assert_eq!(p.experts.checked_mul(p.stride), Some(p.file_bytes));
            }
        }
        for p in &m.row_pools {
            if p.layout_errors().is_empty() {
                for s in &p.shards {
                    assert!(s.offset.checked_add(s.region_bytes).unwrap() <= p.file_bytes);
                }
            }
        }
        // Any failure names its file.
        assert!(failures.iter().all(|f| !f.file.is_empty()));
    }
    if let Ok(h) = ResidentHead::parse(data, data.len() as u64)
        && let Some(payload) = (data.len() as u64).checked_sub(h.payload_start)
    {
        check_index(&h.index, payload);
    }
    let mut file = MAGIC.to_vec();
    file.extend_from_slice(&(data.len() as u64).to_le_bytes());
    file.extend_from_slice(data);
    if let Ok(h) = ResidentHead::parse(&file, file.len() as u64 + BARE_PAYLOAD) {
        check_index(&h.index, BARE_PAYLOAD);
    }
});

/// What `layout_errors` accepts: spans inside the payload and not overlapping.
fn check_index(index: &ResidentIndex, payload: u64) {
    if !index.layout_errors(payload).is_empty() {
        return;
    }
    let mut spans: Vec<(u64, u64)> = index
        .tensors
        .iter()
        .flat_map(|t| t.spans())
        .filter(|(_, s)| s.len > 0)
        .map(|(_, s)| (s.offset, s.offset.checked_add(s.len).unwrap()))
        .collect();
    spans.sort();
    for w in spans.windows(2) {
        assert!(w[0].1 <= w[1].0, "accepted overlapping spans {w:?}");
    }
    assert!(spans.iter().all(|s| s.1 <= payload));
}
