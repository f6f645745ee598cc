//! RoPE against transformers (`tests/data/rope_golden.json`, from
//! `scripts/golden/gen_rope_golden.py`), the pair layouts on unit vectors, and the
//! refusals of untrusted axes.

use serde_json::{Value, json};

use super::*;
use crate::format::manifest::{self, Manifest};

/// transformers' frequencies and rotations (see the generator's docstring).
const GOLDEN: &str = include_str!("../../../../../../tests/data/rope_golden.json");

/// Frequencies must match transformers' f32 values to this relative error; its
/// vectorized `pow` is within an ulp (~6e-8) of the correctly rounded one used here.
const FREQ_REL: f64 = 1e-6;
/// A rotated value must match to this fraction of the head's largest input, given
/// transformers' frequencies (its f32 cos/sin are within an ulp of the f64 ones
/// rounded here).
const APPLY_REL: f64 = 1e-6;

/// A manifest whose axes are `axes` (the rest is filler no test reads).
fn manifest(axes: Value) -> Manifest {
    serde_json::from_value(json!({
        "arch": {"axes": axes, "model_type": "test", "required_axes": []},
        "excluded_tensors": 0, "expert_pools": [], "family": "fam", "files": [],
        "format": "gturbo", "minor_version": 1, "model_id": "t/t", "plan_fingerprint": "0",
        "quantized_at_install": {"bits": 4, "group_size": 64, "overrides": [],
            "parity_gate": "", "quality_gate": null, "scheme": "int4_g64"},
        "resident": {"entries": 0, "file": "resident.bin", "payload_start": 0},
        "row_pools": [], "sidecars": {},
        "source": {"commit": null, "index_sha256": null, "repo": "t/t", "revision": "main"},
        "tool": {"name": "gturbo", "version": "0"}, "version": 1
    }))
    .expect("test manifest")
}

fn spec(axes: Value, head_dim: usize) -> Result<RopeSpec, RunError> {
    RopeSpec::from_manifest(&manifest(axes), head_dim)
}

fn err(axes: Value, head_dim: usize) -> String {
    spec(axes, head_dim).unwrap_err().to_string()
}

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// Distance in ulps between two finite f32 of the same sign.
fn ulps(a: f32, b: f32) -> u32 {
    (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
}

/// Every golden case: the axes read into a spec whose frequencies, cos/sin factor,
/// softmax scale and rotations are transformers'.
#[test]
fn rope_matches_transformers() {
    let golden: Value = serde_json::from_str(GOLDEN).unwrap();
    let mut report = Vec::new();
    for case in golden["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let head_dim = case["head_dim"].as_u64().unwrap() as usize;
        let s = spec(case["axes"].clone(), head_dim).unwrap_or_else(|e| panic!("{name}: {e}"));
        let seq_len = case["seq_len"].as_u64().unwrap() as usize;
        let got = s.inv_freq(seq_len);
        let want = f32s(&case["inv_freq"]);
        assert_eq!(got.len(), want.len(), "{name}: frequency count");
        let (mut worst_rel, mut worst_ulps) = (0.0f64, 0);
        for (j, (&g, &w)) in got.iter().zip(&want).enumerate() {
            let rel = ((g as f64 - w as f64) / w as f64).abs();
            assert!(
                rel <= FREQ_REL,
                "{name}: inv_freq[{j}] {g:e} vs transformers {w:e}"
            );
            worst_rel = worst_rel.max(rel);
            worst_ulps = worst_ulps.max(ulps(g, w));
        }
        let factor = case["attention_factor"].as_f64().unwrap() as f32;
        assert_eq!(s.attention_scaling(), factor, "{name}: attention factor");
        if let Some(want) = case.get("softmax_scale") {
            let base = case["softmax_scale_base"].as_f64().unwrap();
            assert_eq!(s.softmax_scale(base), want.as_f64().unwrap(), "{name}");
        }
        let mut apply_rel = 0.0f64;
        if let Some(ap) = case.get("apply") {
            let heads = ap["heads"].as_u64().unwrap() as usize;
            let x = f32s(&ap["x"]);
            let out = f32s(&ap["out"]);
            let row = heads * head_dim;
            // transformers' own frequencies: an ulp of frequency is 0.01 rad at
            // position 10^5, so the rotation is checked apart from the frequencies.
            let freqs = &want;
            for (t, p) in ap["positions"].as_array().unwrap().iter().enumerate() {
                let p = p.as_u64().unwrap() as usize;
                let mut tok = x[t * row..(t + 1) * row].to_vec();
                s.apply_with(freqs, &mut tok, heads, p);
                for (h, (g, w)) in tok
                    .chunks_exact(head_dim)
                    .zip(out[t * row..].chunks_exact(head_dim))
                    .enumerate()
                {
                    let x_head = &x[t * row + h * head_dim..][..head_dim];
                    let max = x_head.iter().fold(0.0f64, |m, v| m.max(v.abs() as f64));
                    for (i, (&g, &w)) in g.iter().zip(w).enumerate() {
                        let d = (g as f64 - w as f64).abs() / max;
                        assert!(
                            d <= APPLY_REL,
                            "{name}: pos {p} head {h} dim {i}: {g} vs {w}"
                        );
                        apply_rel = apply_rel.max(d);
                    }
                }
            }
        }
        report.push(format!(
            "{name}: inv_freq max rel {worst_rel:.2e} ({worst_ulps} ulp), apply max {apply_rel:.2e}"
        ));
    }
    // `cargo test -- rope --nocapture` shows how close each case came.
    println!("{}", report.join("\n"));
}

/// The decoder runner's frequencies today, `(1 / θ^(2i/d)) as f32` in f64, next to
/// transformers' f32 computation: the distance a switch to [`RopeSpec::inv_freq`]
/// would move them.
#[test]
fn rope_decoder_f64_formula_next_to_transformers() {
    for (theta, d) in [(10_000.0f64, 64usize), (1e6, 128), (5e5, 128), (1e7, 64)] {
        let ours = RopeSpec::plain(d, theta).inv_freq(0);
        let decoder: Vec<f32> = (0..d / 2)
            .map(|i| (1.0 / theta.powf(2.0 * i as f64 / d as f64)) as f32)
            .collect();
        let worst = ours.iter().zip(&decoder).map(|(&a, &b)| ulps(a, b)).max();
        println!("theta {theta:e} d {d}: decoder formula vs transformers order: {worst:?} ulp");
        for (a, b) in ours.iter().zip(&decoder) {
            assert!(((a - b) / b).abs() < 2e-6);
        }
    }
}

/// Which dims each layout pairs: a unit vector on dim `k` turns into the dim it is
/// paired with, by `p·inv_freq_j`, and the dims past `rotary_dim` stay.
#[test]
fn rope_layouts_rotate_their_pairs() {
    // head 6, 4 rotary dims (two pairs), frequencies 1 and 1/θ^(1/2) = 0.01.
    let spec = |layout| RopeSpec {
        head_dim: 6,
        rotary_dim: 4,
        theta: 10_000.0,
        layout,
        scaling: Scaling::None,
    };
    let freqs = spec(Layout::HalfSplit).inv_freq(0);
    assert_eq!(freqs, vec![1.0, 0.01]);
    let p = 3usize;
    let unit = |k: usize| {
        let mut v = vec![0.0f32; 6];
        v[k] = 1.0;
        v
    };
    let turned = |j: usize| {
        let a = (p as f32 * freqs[j]) as f64;
        (a.cos() as f32, a.sin() as f32)
    };
    // (layout, input dim, its partner, pair index, partner sign)
    let cases = [
        (Layout::HalfSplit, 0, 2, 0, 1.0),
        (Layout::HalfSplit, 2, 0, 0, -1.0),
        (Layout::HalfSplit, 1, 3, 1, 1.0),
        (Layout::HalfSplit, 3, 1, 1, -1.0),
        (Layout::Interleaved, 0, 1, 0, 1.0),
        (Layout::Interleaved, 1, 0, 0, -1.0),
        (Layout::Interleaved, 2, 3, 1, 1.0),
        (Layout::Interleaved, 3, 2, 1, -1.0),
    ];
    for (layout, k, partner, j, sign) in cases {
        let mut x = unit(k);
        spec(layout).apply(&mut x, 1, p);
        let (c, s) = turned(j);
        let mut want = vec![0.0f32; 6];
        want[k] = c;
        want[partner] = sign * s;
        assert_eq!(x, want, "{layout:?} dim {k}");
    }
    // Past the rotary dims nothing moves; two heads, two tokens at positions p, p+1.
    let mut x: Vec<f32> = (0..24).map(|i| i as f32).collect();
    spec(Layout::Interleaved).apply(&mut x, 2, p);
    for t in 0..2 {
        for h in 0..2 {
            let base = (t * 2 + h) * 6;
            assert_eq!(
                &x[base + 4..base + 6],
                &[(base + 4) as f32, (base + 5) as f32]
            );
        }
    }
    // YaRN's factor scales cos and sin alike.
    let mut yarn = spec(Layout::HalfSplit);
    yarn.scaling = Scaling::Yarn {
        factor: 32.0,
        original_max: 4096,
        beta_fast: 32.0,
        beta_slow: 1.0,
        mscale: None,
        mscale_all_dim: None,
        attention_factor: Some(2.0),
        truncate: true,
    };
    let mut x = unit(0);
    yarn.apply(&mut x, 1, 0);
    assert_eq!(x, vec![2.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
}

/// Dynamic NTK is plain RoPE up to `max_position_embeddings` and slows down past it.
#[test]
fn rope_dynamic_grows_past_the_original_context() {
    let s = spec(
        json!({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
               "max_position_embeddings": 4096}),
        64,
    )
    .unwrap();
    let plain = RopeSpec::plain(64, DEFAULT_THETA).inv_freq(0);
    assert_eq!(s.inv_freq(1), plain);
    assert_eq!(s.inv_freq(4096), plain);
    let long = s.inv_freq(8192);
    assert_eq!(long[0], 1.0);
    assert!(long[1..].iter().zip(&plain[1..]).all(|(l, p)| l < p));
}

/// Layout, rotary dims and precedence as read from the axes.
#[test]
fn rope_reads_layout_rotary_dims_and_precedence() {
    let s = spec(json!({"rope_interleave": true}), 64).unwrap();
    assert_eq!(
        (s.layout, s.rotary_dim, s.theta),
        (Layout::Interleaved, 64, DEFAULT_THETA)
    );
    assert_eq!(spec(json!({"rotary_dim": 32}), 128).unwrap().rotary_dim, 32);
    assert_eq!(
        spec(json!({"partial_rotary_factor": 0.5, "rotary_dim": 64}), 128)
            .unwrap()
            .rotary_dim,
        64
    );
    // transformers 5's `rope_parameters`, whose theta wins over the top level.
    let s = spec(
        json!({"rope_theta": 1.0e4, "rope_parameters":
               {"rope_type": "linear", "factor": 2, "rope_theta": 5.0e5,
                "partial_rotary_factor": 0.25}}),
        128,
    )
    .unwrap();
    assert_eq!((s.theta, s.rotary_dim), (5e5, 32));
    assert_eq!(s.scaling, Scaling::Linear { factor: 2.0 });
    // `rope_type: default` inside the object, and YaRN's factor from the context ratio
    // with the top-level original context winning.
    assert_eq!(
        spec(json!({"rope_scaling": {"type": "default"}}), 64)
            .unwrap()
            .scaling,
        Scaling::None
    );
    let s = spec(
        json!({"max_position_embeddings": 32768, "original_max_position_embeddings": 4096,
               "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 2048,
                                "beta_fast": 0, "mscale": 0}}),
        64,
    )
    .unwrap();
    let Scaling::Yarn {
        factor,
        original_max,
        beta_fast,
        mscale,
        ..
    } = s.scaling
    else {
        panic!("{:?}", s.scaling)
    };
    assert_eq!(
        (factor, original_max, beta_fast, mscale),
        (8.0, 4096, YARN_BETA_FAST, None)
    );
    assert_eq!(s.softmax_scale(0.125), 0.125);
}

/// Untrusted values are refused with the manifest and the axis named, never a panic.
#[test]
fn rope_refuses_bad_axes_naming_them() {
    let at = |axis: &str| format!("{}: arch.axes.{axis} (family fam): ", manifest::FILE_NAME);
    let cases = [
        (
            json!({"rope_scaling": {"rope_type": "longrope", "factor": 2}}),
            "rope_scaling.rope_type",
        ),
        (json!({"rope_scaling": {"type": "su"}}), "rope_scaling.type"),
        (
            json!({"rope_scaling": {"rope_type": 3}}),
            "rope_scaling.rope_type",
        ),
        (json!({"rope_scaling": "yarn"}), "rope_scaling"),
        (
            json!({"rope_scaling": {"rope_type": "linear"}}),
            "rope_scaling.factor",
        ),
        (
            json!({"rope_scaling": {"rope_type": "linear", "factor": 0}}),
            "rope_scaling.factor",
        ),
        (
            json!({"rope_scaling": {"rope_type": "linear", "factor": -2}}),
            "rope_scaling.factor",
        ),
        (
            json!({"rope_scaling": {"rope_type": "linear", "factor": "NaN"}}),
            "rope_scaling.factor",
        ),
        (
            json!({"rope_scaling": {"rope_type": "linear", "factor": 1e300}}),
            "rope_scaling.factor",
        ),
        (
            json!({"rope_scaling": {"rope_type": "dynamic", "factor": 2}}),
            "max_position_embeddings",
        ),
        (
            json!({"rope_scaling": {"rope_type": "yarn", "factor": 4}}),
            "rope_scaling.original_max_position_embeddings",
        ),
        (
            json!({"rope_scaling": {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 0}}),
            "rope_scaling.original_max_position_embeddings",
        ),
        (
            json!({"rope_scaling": {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 1e30}}),
            "rope_scaling.original_max_position_embeddings",
        ),
        (
            json!({"rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 4096}}),
            "rope_scaling.factor",
        ),
        (
            json!({"rope_scaling": {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 4096, "beta_fast": -1}}),
            "rope_scaling.beta_fast",
        ),
        (
            json!({"rope_scaling": {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 4096, "mscale_all_dim": 1e9}}),
            "rope_scaling.mscale_all_dim",
        ),
        (
            json!({"rope_scaling": {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 4096, "truncate": 1}}),
            "rope_scaling.truncate",
        ),
        (
            json!({"rope_scaling": {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 4096, "attention_factor": 0}}),
            "rope_scaling.attention_factor",
        ),
        (
            json!({"rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 4, "original_max_position_embeddings": 8192}}),
            "rope_scaling.high_freq_factor",
        ),
        (
            json!({"rope_scaling": {"rope_type": "llama3", "factor": 8, "high_freq_factor": 4, "original_max_position_embeddings": 8192}}),
            "rope_scaling.low_freq_factor",
        ),
        (json!({"rope_theta": 1e300}), "rope_theta"),
        (json!({"rope_theta": -1}), "rope_theta"),
        (json!({"rope_theta": 1}), "rope_theta"),
        (json!({"rope_theta": 0.5}), "rope_theta"),
        (
            json!({"rope_scaling": {"rope_theta": 0}}),
            "rope_scaling.rope_theta",
        ),
        (
            json!({"partial_rotary_factor": 1.5}),
            "partial_rotary_factor",
        ),
        (
            json!({"partial_rotary_factor": 0.31}),
            "partial_rotary_factor",
        ),
        (
            json!({"partial_rotary_factor": 0.001}),
            "partial_rotary_factor",
        ),
        (
            json!({"rope_parameters": {"partial_rotary_factor": 2}}),
            "rope_parameters.partial_rotary_factor",
        ),
        (json!({"rotary_dim": 65}), "rotary_dim"),
        (json!({"rotary_dim": 256}), "rotary_dim"),
        (
            json!({"rotary_dim": 32, "partial_rotary_factor": 0.5}),
            "rotary_dim",
        ),
        (json!({"rope_interleave": "yes"}), "rope_interleave"),
    ];
    for (axes, axis) in cases {
        let e = err(axes.clone(), 128);
        assert!(e.starts_with(&at(axis)), "{axes}: {e}");
    }
    // A dynamic base needs d / (d − 2).
    let e = err(
        json!({"rotary_dim": 2, "max_position_embeddings": 64,
               "rope_scaling": {"rope_type": "dynamic", "factor": 2}}),
        64,
    );
    assert!(e.starts_with(&at("rope_scaling.rope_type")), "{e}");
    assert!(
        err(json!({"rope_scaling": {"rope_type": "mrope"}}), 64)
            .contains("\"mrope\" is not implemented")
    );
}

/// The largest values the bounds let through give finite frequencies and factors.
#[test]
fn rope_extremes_stay_finite() {
    for scaling in [
        json!({"rope_type": "linear", "factor": MAX_FACTOR}),
        json!({"rope_type": "dynamic", "factor": MAX_FACTOR}),
        json!({"rope_type": "yarn", "factor": MAX_FACTOR, "beta_fast": MAX_YARN_PARAM,
               "beta_slow": MAX_YARN_PARAM, "mscale": MAX_YARN_PARAM, "mscale_all_dim": 1e-9}),
        json!({"rope_type": "yarn", "factor": 1e-9, "original_max_position_embeddings": 1}),
        json!({"rope_type": "llama3", "factor": MAX_FACTOR, "low_freq_factor": 1e-9,
               "high_freq_factor": MAX_FACTOR}),
    ] {
        for theta in [1.0001, 1.5, 1e12] {
            let axes = json!({"rope_theta": theta, "max_position_embeddings": 1 << 28,
                              "rope_scaling": scaling.clone()});
            let s = spec(axes, 4096).unwrap();
            for len in [0, 1 << 28] {
                let f = s.inv_freq(len);
                assert_eq!(f.len(), 2048);
                assert!(f.iter().all(|x| !x.is_nan()), "{scaling} θ {theta}");
            }
            assert!(s.attention_scaling().is_finite());
            assert!(s.softmax_scale(1.0).is_finite());
        }
    }
}

/// The backends' `rope` op rotates as [`RopeSpec::apply_with`] does (the rotation the
/// transformers goldens check), in both layouts and with partial rotary dims: a
/// DeepSeek-V3-shaped YaRN spec (interleaved, 64 of 192 dims) and a half-split one.
#[test]
fn the_backend_rope_op_rotates_as_the_spec_does() {
    use crate::runtime::kernels::{Backend, Cpu};
    let cpu = Cpu::new(1);
    let yarn = Scaling::Yarn {
        factor: 40.0,
        original_max: 4096,
        beta_fast: 32.0,
        beta_slow: 1.0,
        mscale: Some(1.0),
        mscale_all_dim: Some(1.0),
        attention_factor: None,
        truncate: true,
    };
    for (layout, head_dim, rotary_dim) in
        [(Layout::Interleaved, 192, 64), (Layout::HalfSplit, 128, 32)]
    {
        let spec = RopeSpec {
            head_dim,
            rotary_dim,
            theta: 10_000.0,
            layout,
            scaling: yarn.clone(),
        };
        assert_eq!(
            spec.attention_scaling(),
            1.0,
            "mscale 1 over mscale_all_dim 1"
        );
        let freqs = spec.inv_freq(8192);
        let (heads, pos, n) = (3, 5000, 2);
        let x: Vec<f32> = (0..n * heads * head_dim)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        let mut want = x.clone();
        spec.apply_with(&freqs, &mut want, heads, pos);
        let table = cpu.rope_table(&freqs, pos..pos + n, layout).unwrap();
        let mut got = x;
        cpu.rope(&table, &mut got, heads, head_dim, pos).unwrap();
        let worst = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs())
            .fold(0.0f32, f32::max);
        assert!(
            worst <= 1e-5,
            "{layout:?}: the op and the spec differ by {worst}"
        );
    }
}
