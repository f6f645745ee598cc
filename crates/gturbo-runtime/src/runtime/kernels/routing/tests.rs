//! [`route_logits`] against the softmax top-k the CPU backend routed by before the
//! spec existed (bit for bit, `previous_route` below), against
//! hand-worked examples of each option, and against transformers' own routers
//! (`tests/data/routing_golden.json`, made by `scripts/golden/gen_routing_golden.py`).

use super::*;
use crate::runtime::kernels::{Backend, Cpu, FloatDtype, Matrix};
use crate::runtime::testing::Rng;

/// `r`'s ids and weights, the weights as bits (so `-0.0`, NaN and rounding all count).
fn bits(r: &Routing) -> (usize, Vec<u32>, Vec<u32>) {
    let w = r.weights.iter().map(|w| w.to_bits()).collect();
    (r.top_k, r.experts.clone(), w)
}

/// The CPU backend's `route` as it was before [`RoutingSpec`] (softmax over all, the
/// top-k by a stable sort, ties to the lower id, optionally divided by the sum): the
/// routing the qwen3_moe and Flash-Next goldens were made with.
fn previous_route(logits: &[f32], experts: usize, top_k: usize, renormalize: bool) -> Routing {
    let (mut ids, mut weights) = (Vec::new(), Vec::new());
    for row in logits.chunks_exact(experts) {
        let mut p = row.to_vec();
        crate::runtime::kernels::softmax_inplace(&mut p);
        let mut idx: Vec<usize> = (0..experts).collect();
        idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        let sum: f32 = idx[..top_k].iter().map(|&e| p[e]).sum();
        for &e in &idx[..top_k] {
            ids.push(e as u32);
            weights.push(if renormalize { p[e] / sum } else { p[e] });
        }
    }
    Routing {
        top_k,
        experts: ids,
        weights,
    }
}

#[test]
fn softmax_top_k_is_bit_identical_to_the_previous_cpu_route() {
    let cpu = Cpu::new(2);
    let mut rng = Rng(0x5EED_0024);
    let mut rows_seen = 0;
    // (experts, top_k, cols, tokens, logit scale); k = E and k = 0 included.
    for (experts, top_k, cols, n, scale) in [
        (8, 2, 64, 1, 4.0),
        (8, 2, 64, 7, 4.0),
        (64, 4, 128, 5, 8.0),
        (60, 4, 96, 9, 2.0),
        (128, 8, 32, 3, 16.0),
        (7, 7, 16, 4, 1.0),
        (5, 0, 16, 2, 1.0),
        (16, 3, 40, 6, 60.0),
    ] {
        let mut vals = rng.scaled(experts * cols, scale / (cols as f32).sqrt());
        // Two identical router rows: their probabilities tie exactly, every token.
        let (a, b) = (experts / 3, experts / 2);
        if a != b {
            let row = vals[a * cols..(a + 1) * cols].to_vec();
            vals[b * cols..(b + 1) * cols].copy_from_slice(&row);
        }
        let data: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let m = Matrix::Float {
            dtype: FloatDtype::F32,
            data: &data,
            rows: experts,
            cols,
        };
        let x = rng.vec(n * cols);
        let mut logits = vec![0f32; n * experts];
        cpu.matmul(&m, &x, n, &mut logits);
        for renormalize in [false, true] {
            let want = previous_route(&logits, experts, top_k, renormalize);
            let spec = RoutingSpec::softmax_top_k(top_k, renormalize);
            let backend = cpu.route(&m, &x, &spec, RouterBias::NONE).unwrap();
            assert_eq!(bits(&backend), bits(&want), "the CPU backend's route");
            let got = route_logits(&spec, &logits, None, experts).unwrap();
            assert_eq!(bits(&got), bits(&want), "{experts}/{top_k} n {n}");
            rows_seen += n;
        }
    }
    assert_eq!(rows_seen, 2 * (1 + 7 + 5 + 9 + 3 + 4 + 2 + 6));
}

/// A spec with every option off but the ones given.
fn sigmoid(top_k: usize) -> RoutingSpec {
    RoutingSpec {
        scores: Scores::Sigmoid,
        ..RoutingSpec::softmax_top_k(top_k, false)
    }
}

fn sig(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[test]
fn the_selection_bias_chooses_but_the_weights_stay_unbiased() {
    let logits = [2.0, 1.0, 0.0, -1.0];
    let bias = [0.0, 0.0, 0.5, 0.9];
    let spec = RoutingSpec {
        selection_bias: true,
        ..sigmoid(2)
    };
    let r = route_logits(&spec, &logits, Some(&bias), 4).unwrap();
    // Keys: 0.881, 0.731, 1.0, 1.169 → experts 3 and 2 are chosen; ordered by their
    // own (unbiased) sigmoid, expert 2 (0.5) before expert 3 (0.269).
    assert_eq!(r.experts, vec![2, 3]);
    assert_eq!(r.weights, vec![sig(0.0), sig(-1.0)]);
    // Renormalized and scaled: w / (Σw + 1e-20) · 2.5.
    let spec = RoutingSpec {
        renormalize: true,
        scaling: 2.5,
        ..spec
    };
    let r = route_logits(&spec, &logits, Some(&bias), 4).unwrap();
    let sum = sig(0.0) + sig(-1.0);
    assert_eq!(
        r.weights,
        vec![
            sig(0.0) / (sum + 1e-20) * 2.5,
            sig(-1.0) / (sum + 1e-20) * 2.5
        ]
    );
}

#[test]
fn group_limits_keep_the_groups_with_the_best_two_keys() {
    // Sigmoid scores chosen directly (logits are their inverse). Four groups of three;
    // a group's score is the sum of its top two: g0 = 0.9 + 0.1 = 1.0, g1 = 0.6 + 0.58
    // = 1.18, g2 = 0.65 + 0.64 = 1.29, g3 = 0.95 + 0.01 = 0.96. Keeping two groups
    // keeps g2 and g1, so the two best single scores (0.95 in g3, 0.9 in g0) are out
    // of reach.
    let p = [
        0.9, 0.1, 0.05, 0.6, 0.58, 0.2, 0.65, 0.64, 0.3, 0.95, 0.01, 0.001,
    ];
    let logits: Vec<f32> = p.iter().map(|&p: &f32| (p / (1.0 - p)).ln()).collect();
    let spec = RoutingSpec {
        groups: Some(GroupLimit {
            n_group: 4,
            topk_group: 2,
        }),
        ..sigmoid(3)
    };
    let r = route_logits(&spec, &logits, None, 12).unwrap();
    assert_eq!(r.experts, vec![6, 7, 3]);
    let s = |e: usize| sig(logits[e]);
    assert_eq!(r.weights, vec![s(6), s(7), s(3)]);
    // One group kept: only g2's experts, so the top-3 takes its 0.3 as well.
    let spec = RoutingSpec {
        groups: Some(GroupLimit {
            n_group: 4,
            topk_group: 1,
        }),
        ..spec
    };
    assert_eq!(
        route_logits(&spec, &logits, None, 12).unwrap().experts,
        vec![6, 7, 8]
    );
    // Without groups the plain top-3 of the scores.
    assert_eq!(
        route_logits(&sigmoid(3), &logits, None, 12)
            .unwrap()
            .experts,
        vec![9, 0, 6]
    );
}

#[test]
fn top_k_then_softmax_is_a_softmax_over_the_chosen_logits() {
    let logits = [0.5, 3.0, -2.0, 2.0, 3.0, 1.0];
    let spec = RoutingSpec {
        order: Order::TopKThenSoftmax,
        ..RoutingSpec::softmax_top_k(3, false)
    };
    let r = route_logits(&spec, &logits, None, 6).unwrap();
    // 3.0 ties between experts 1 and 4: the lower id first.
    assert_eq!(r.experts, vec![1, 4, 3]);
    let mut w = vec![3.0, 3.0, 2.0];
    softmax_inplace(&mut w);
    assert_eq!(r.weights, w);
    let s: f32 = r.weights.iter().sum();
    assert!((s - 1.0).abs() < 1e-6);
}

#[test]
fn bad_specs_and_inputs_are_errors_not_panics() {
    let soft = RoutingSpec::softmax_top_k(2, true);
    let l = [0.0f32; 8];
    let err = |spec: &RoutingSpec, logits: &[f32], bias: Option<&[f32]>, e| {
        route_logits(spec, logits, bias, e).unwrap_err()
    };
    assert_eq!(err(&soft, &l, None, 0), RoutingError::NoExperts);
    assert!(matches!(
        err(&RoutingSpec::softmax_top_k(9, true), &l, None, 8),
        RoutingError::TopK { top_k: 9, .. }
    ));
    assert!(matches!(
        err(&soft, &l[..7], None, 4),
        RoutingError::Logits { len: 7, .. }
    ));
    assert!(matches!(
        err(&soft, &l, Some(&[0.0; 4]), 4),
        RoutingError::Bias { given: Some(4), .. }
    ));
    let biased = RoutingSpec {
        selection_bias: true,
        ..soft
    };
    assert!(matches!(
        err(&biased, &l, None, 4),
        RoutingError::Bias { given: None, .. }
    ));
    assert!(matches!(
        err(&biased, &l, Some(&[0.0; 3]), 4),
        RoutingError::Bias { given: Some(3), .. }
    ));
    let nan = RoutingSpec {
        scaling: f32::NAN,
        ..soft
    };
    assert!(matches!(err(&nan, &l, None, 4), RoutingError::Scaling(_)));
    let topk_sigmoid = RoutingSpec {
        order: Order::TopKThenSoftmax,
        ..sigmoid(2)
    };
    assert!(matches!(
        err(&topk_sigmoid, &l, None, 4),
        RoutingError::Combination(_)
    ));
    for (n_group, topk_group, top_k) in [
        (0, 1, 2),
        (3, 1, 2),
        (8, 1, 1),
        (2, 0, 2),
        (2, 3, 2),
        (4, 1, 3),
    ] {
        let spec = RoutingSpec {
            groups: Some(GroupLimit {
                n_group,
                topk_group,
            }),
            ..RoutingSpec::softmax_top_k(top_k, true)
        };
        assert!(
            matches!(err(&spec, &l, None, 8), RoutingError::Groups { .. }),
            "{n_group}/{topk_group} top-{top_k}"
        );
    }
    let spec = RoutingSpec {
        groups: Some(GroupLimit {
            n_group: 1,
            topk_group: 1,
        }),
        ..RoutingSpec::softmax_top_k(2, true)
    };
    assert!(matches!(
        err(
            &RoutingSpec {
                order: Order::TopKThenSoftmax,
                ..spec
            },
            &l,
            None,
            8
        ),
        RoutingError::Combination(_)
    ));
    // NaN and infinite logits route without panicking.
    let odd = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0];
    for spec in [
        soft,
        sigmoid(2),
        RoutingSpec {
            order: Order::TopKThenSoftmax,
            ..soft
        },
    ] {
        let r = route_logits(&spec, &odd, None, 4).unwrap();
        assert_eq!(r.experts.len(), 2);
    }
    // An empty batch routes to nothing.
    assert!(
        route_logits(&soft, &[], None, 4)
            .unwrap()
            .experts
            .is_empty()
    );
}

/// One router of `routing_golden.json`: its logits and bias, the config values the
/// routing reads, and the ids and weights transformers computed.
#[derive(serde::Deserialize)]
struct GoldenCase {
    name: String,
    router: String,
    config: GoldenConfig,
    n_experts: usize,
    top_k: usize,
    logits: Vec<f32>,
    bias: Option<Vec<f32>>,
    experts: Vec<u32>,
    weights: Vec<f32>,
    /// The router linear, for a router whose linear has a bias (gpt-oss): the hidden
    /// states `[tokens, hidden]`, the weight `[E, hidden]` and the bias `[E]`.
    hidden: Option<Vec<f32>>,
    router_weight: Option<Vec<f32>>,
    logit_bias: Option<Vec<f32>>,
}

#[derive(serde::Deserialize)]
struct GoldenConfig {
    n_group: Option<usize>,
    topk_group: Option<usize>,
    norm_topk_prob: Option<bool>,
    routed_scaling_factor: Option<f32>,
}

#[derive(serde::Deserialize)]
struct Golden {
    transformers: String,
    tokens: usize,
    cases: Vec<GoldenCase>,
}

/// How far the weights may be from transformers': f32 rounding of `exp`, of a sum of
/// at most 8 terms in another order and of one division, on weights of at most 2.5.
const GOLDEN_TOL: f32 = 1e-6;

/// The spec a family's config gives, per transformers' router class (the mapping the
/// family files will make).
fn golden_spec(c: &GoldenCase) -> RoutingSpec {
    let cfg = &c.config;
    match c.router.as_str() {
        "DeepseekV3TopkRouter" | "Glm4MoeTopkRouter" => RoutingSpec {
            top_k: c.top_k,
            scores: Scores::Sigmoid,
            order: Order::ScoreThenTopK,
            selection_bias: true,
            groups: Some(GroupLimit {
                n_group: cfg.n_group.unwrap(),
                topk_group: cfg.topk_group.unwrap(),
            }),
            renormalize: cfg.norm_topk_prob.unwrap(),
            scaling: cfg.routed_scaling_factor.unwrap(),
        },
        // Softmax over all, top-k, divided by the sum: transformers' order.
        "MixtralTopKRouter" => RoutingSpec::softmax_top_k(c.top_k, true),
        "GptOssTopKRouter" => RoutingSpec {
            order: Order::TopKThenSoftmax,
            ..RoutingSpec::softmax_top_k(c.top_k, false)
        },
        "Qwen3MoeTopKRouter" | "Qwen3NextTopKRouter" => {
            RoutingSpec::softmax_top_k(c.top_k, cfg.norm_topk_prob.unwrap())
        }
        other => panic!("routing_golden.json: unknown router {other}"),
    }
}

/// Largest weight difference of `got` from the golden case, after checking the ids.
/// transformers' DeepSeek and GLM routers return `topk(sorted=False)` order, so each
/// token's (id, weight) pairs are put in `Routing`'s order first: weight descending,
/// ties to the lower id.
fn golden_diff(c: &GoldenCase, got: &Routing, tokens: usize) -> f32 {
    let k = c.top_k;
    assert_eq!(got.top_k, k, "{}", c.name);
    let mut worst = 0f32;
    for t in 0..tokens {
        let mut want: Vec<(u32, f32)> = (t * k..(t + 1) * k)
            .map(|i| (c.experts[i], c.weights[i]))
            .collect();
        want.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let ids: Vec<u32> = want.iter().map(|w| w.0).collect();
        assert_eq!(
            got.experts[t * k..(t + 1) * k],
            ids,
            "{} token {t}: experts",
            c.name
        );
        for (j, &(_, w)) in want.iter().enumerate() {
            worst = worst.max((got.weights[t * k + j] - w).abs());
        }
    }
    worst
}

#[test]
fn every_family_routes_as_transformers_routes() {
    let golden: Golden = serde_json::from_str(include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/data/routing_golden.json"
    )))
    .expect("parse tests/data/routing_golden.json");
    assert!(
        golden.transformers.starts_with("5."),
        "{}",
        golden.transformers
    );
    assert_eq!(golden.cases.len(), 8);
    for c in &golden.cases {
        let (e, n) = (c.n_experts, golden.tokens);
        assert_eq!(c.logits.len(), n * e, "{}: logits", c.name);
        assert_eq!(c.experts.len(), n * c.top_k, "{}: experts", c.name);
        let spec = golden_spec(c);
        let bias = c.bias.as_deref();
        let got = route_logits(&spec, &c.logits, bias, e).unwrap();
        let worst = golden_diff(c, &got, n);
        println!("{}: max |Δw| {worst:.3e}", c.name);
        assert!(worst <= GOLDEN_TOL, "{}: weights off by {worst}", c.name);
        if spec.selection_bias {
            // The golden tests the bias and (with several groups) the group limit:
            // without either, some token's choice changes.
            let choice = |s: &RoutingSpec, b| route_logits(s, &c.logits, b, e).unwrap().experts;
            let unbiased = RoutingSpec {
                selection_bias: false,
                ..spec
            };
            assert_ne!(choice(&unbiased, None), got.experts, "{}: bias", c.name);
            let ungrouped = RoutingSpec {
                groups: None,
                ..spec
            };
            let grouped = spec.groups.is_some_and(|g| g.n_group > 1);
            assert_eq!(
                choice(&ungrouped, bias) != got.experts,
                grouped,
                "{}: groups",
                c.name
            );
        }
        if c.router == "MixtralTopKRouter" {
            // Top-k of the logits then a softmax over the k: the same routing, to
            // rounding.
            let alt = RoutingSpec {
                order: Order::TopKThenSoftmax,
                ..RoutingSpec::softmax_top_k(c.top_k, false)
            };
            let alt = route_logits(&alt, &c.logits, None, e).unwrap();
            let worst = golden_diff(c, &alt, n);
            println!("{} as top-k then softmax: max |Δw| {worst:.3e}", c.name);
            assert!(
                worst <= GOLDEN_TOL,
                "{}: top-k then softmax off by {worst}",
                c.name
            );
        }
    }
}

/// gpt-oss's router end to end: the CPU backend's `route` over transformers' router
/// weight, hidden states and linear bias (`RouterBias::logits`) chooses the module's
/// experts with its weights; without the bias some token's choice changes.
#[test]
fn a_router_with_a_linear_bias_routes_as_transformers_from_the_hidden_states() {
    let golden: Golden = serde_json::from_str(include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/data/routing_golden.json"
    )))
    .expect("parse tests/data/routing_golden.json");
    let cpu = Cpu::new(1);
    let mut checked = 0;
    for c in &golden.cases {
        let (Some(h), Some(w), Some(b)) = (&c.hidden, &c.router_weight, &c.logit_bias) else {
            continue;
        };
        let (e, n) = (c.n_experts, golden.tokens);
        let cols = h.len() / n;
        assert_eq!((w.len(), b.len()), (e * cols, e), "{}", c.name);
        let data: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let m = Matrix::Float {
            dtype: FloatDtype::F32,
            data: &data,
            rows: e,
            cols,
        };
        let spec = golden_spec(c);
        let bias = RouterBias {
            logits: Some(b),
            selection: None,
        };
        let got = cpu.route(&m, h, &spec, bias).unwrap();
        let worst = golden_diff(c, &got, n);
        println!("{} from hidden states: max |Δw| {worst:.3e}", c.name);
        assert!(worst <= GOLDEN_TOL, "{}: weights off by {worst}", c.name);
        let unbiased = cpu.route(&m, h, &spec, RouterBias::NONE).unwrap();
        assert_ne!(
            unbiased.experts, got.experts,
            "{}: the bias matters",
            c.name
        );
        let short = RouterBias {
            logits: Some(&b[1..]),
            selection: None,
        };
        let err = cpu.route(&m, h, &spec, short).unwrap_err().to_string();
        assert!(err.contains("router bias"), "{err}");
        checked += 1;
    }
    assert_eq!(checked, 1, "the gpt-oss case carries its router linear");
}
