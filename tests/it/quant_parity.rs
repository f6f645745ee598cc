//! The affine quantizer against a live MLX: the cross-check file produced by
//! `scripts/peers/mlx_crosscheck.py`. The committed MLX goldens are checked by
//! gturbo-format's own tests (`crates/gturbo-format/tests/quant_mlx.rs`), which share
//! the case files' reader with this one.

#[path = "../../crates/gturbo-format/tests/support/mlx_cases.rs"]
mod mlx_cases;

use std::collections::BTreeSet;

use gturbo::transform::quant::Spec;
use gturbo_testkit::skip::require_or_skip;
use mlx_cases::{compare, load};

#[test]
fn mlx_live_crosscheck() {
    let path = std::env::var("GTURBO_MLX_CROSSCHECK").map_err(|_| {
        "GTURBO_MLX_CROSSCHECK is unset (scripts/test.sh writes the file with \
         `python3 scripts/peers/mlx_crosscheck.py OUT.json` and sets GTURBO_MLX_CROSSCHECK=OUT.json)"
            .to_string()
    });
    let Some(path) = require_or_skip("mlx_live_crosscheck", path) else {
        return;
    };
    let file = load(&path);
    // Every width and group MLX writes is in the file.
    let specs: BTreeSet<String> = file.cases.iter().map(|c| c.spec().to_string()).collect();
    let all: BTreeSet<String> = Spec::all().map(|s| s.to_string()).collect();
    assert_eq!(specs, all, "cross-check file does not cover every spec");
    let (mut groups, mut elements) = (0usize, 0usize);
    let mut totals = [0usize; 4];
    let mut bad = Vec::new();
    for case in &file.cases {
        let m = compare(case);
        for (t, v) in totals.iter_mut().zip(m) {
            *t += v;
        }
        if m != [0; 4] {
            bad.push(format!("{}: {m:?}", case.name));
        }
        groups += case.scales_bf16_bits.len();
        elements += case.w_bf16_bits.len();
    }
    eprintln!(
        "mlx {} cross-check: {} matrices, {groups} groups, {elements} elements; mismatches \
         words {} scales {} biases {} dequant {}",
        file.mlx_version,
        file.cases.len(),
        totals[0],
        totals[1],
        totals[2],
        totals[3]
    );
    assert!(
        file.cases.len() >= 100,
        "cross-check file holds only {} matrices",
        file.cases.len()
    );
    assert!(
        bad.is_empty(),
        "mismatching cases (words, scales, biases, dequant): {bad:#?}"
    );
}
