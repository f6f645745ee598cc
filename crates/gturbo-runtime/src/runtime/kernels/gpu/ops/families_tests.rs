//! The GPU's operation families against the CPU's (`kernels::ops::conformance`, which states
//! the tolerances), one test per group of ops. They need an adapter (Mesa's llvmpipe is
//! enough); without one they are reported as skipped, and fail under
//! `GTURBO_REQUIRE_GPU=1` or in a strict run (CI).

use crate::runtime::kernels::gpu::tests::gpu_backend as gpu;
use crate::runtime::kernels::ops::conformance;
use crate::runtime::kernels::ops::*;
use crate::runtime::kernels::{Backend, Causal};

macro_rules! flash_checks {
        ($($group:ident),*) => {
            $(
                #[test]
                fn $group() {
                    let Some(g) = gpu(concat!("flash::", stringify!($group))) else {
                        return;
                    };
                    conformance::$group(g);
                }
            )*
        };
    }

flash_checks!(elementwise, norms, conv, gdn, indexer);

/// Operands that do not fit are errors naming the op, never device reads out of
/// bounds (and never panics).
#[test]
fn bad_operands_are_errors_not_panics() {
    let Some(g) = gpu("flash::bad_operands_are_errors_not_panics") else {
        return;
    };
    let d = HcDims {
        streams: 3,
        hidden: 8,
        lowrank: 0,
        eps: 1e-6,
    };
    let (mix, xn) = (g.zeros(48).unwrap(), g.zeros(47).unwrap());
    let mut out = g.zeros(16).unwrap();
    let e = g.hc_mix(&mix, &xn, d, &mut out).unwrap_err().to_string();
    assert!(e.contains("hc_mix") && e.contains("xn of 47"), "{e}");
    let x = g.zeros(40).unwrap();
    let e = g
        .gather_cols(&x, 8, 4..9, &mut out)
        .unwrap_err()
        .to_string();
    assert!(e.contains("gather_cols") && e.contains("4..9"), "{e}");
    // A selection naming a block the query cannot see yet.
    let ix = IndexerDims {
        heads: 1,
        head_dim: 8,
        budget: 8,
        compress: 4,
    };
    let mut cache = g.attn_cache(1, 8, ix).unwrap();
    let (q, k) = (g.zeros(8).unwrap(), g.zeros(8).unwrap());
    let mut o = g.zeros(8).unwrap();
    let at = Causal {
        pos: 0,
        heads: 1,
        scale: 1.0,
    };
    let e = g
        .indexed_attention(&mut cache, &q, &k, &k, at, &[vec![0]], &mut o)
        .unwrap_err()
        .to_string();
    assert!(e.contains("selects block 0 of the 0 it sees"), "{e}");
    // A position past what the cache holds.
    let at = Causal { pos: 3, ..at };
    let e = g
        .indexed_attention(&mut cache, &q, &k, &k, at, &[vec![]], &mut o)
        .unwrap_err()
        .to_string();
    assert!(e.contains("position 3 past the 0 cached"), "{e}");
    g.finish().unwrap();
}
