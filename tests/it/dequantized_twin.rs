//! A quantized install computes what its dequantized weights compute. For each toy with
//! transformers goldens, an INT4 install is compared (`gturbo eval`) against a BF16
//! install of its dequantized twin: the same checkpoint with every tensor the install
//! quantized replaced by MLX's quantize-then-dequantize in exact F32
//! (`scripts/peers/dequantized_twin.py`). The BF16 path is held to transformers by each
//! family's own tests, so agreement here leaves the quantized matrices' arithmetic as
//! the only difference between a quantized install and its reference: the toys' large
//! INT4-vs-BF16 KL (Qwen3-Next 2.9 nats) is the weights' rounding, not the runner.

use crate::support::temp_dir;
use crate::support::toy::{install_toy, kl_against_dequantized_twin};

/// Mean KL accepted between an install and its twin: f32 summation order only
/// (measured: Qwen3-Next 7.9e-12 nats, top-1 1.0).
const MAX_KL: f64 = 1e-6;

const TEXT: &str = "A café for the quick brown fox. The quick brown fox jumps over the lazy dog \
                    while the cat sleeps in the sun, and the birds sing of rain, of wind and of \
                    the long road home.";

fn int4_equals_its_dequantized_twin(test: &str, family: &str, toy: &str) {
    let tmp = temp_dir();
    let q = tmp.path().join("int4.gturbo");
    install_toy(family, toy, &q, &[]);
    let text_file = tmp.path().join("text.txt");
    std::fs::write(&text_file, TEXT).unwrap();
    let Some((kl, top1)) = kl_against_dequantized_twin(test, family, toy, &q, &text_file) else {
        return;
    };
    assert!(
        kl < MAX_KL,
        "{family}: mean KL {kl:e} against the dequantized twin"
    );
    assert_eq!(
        top1, 1.0,
        "{family}: top-1 agreement {top1} against the dequantized twin"
    );
}

#[test]
fn qwen3_next_int4_computes_what_its_dequantized_weights_compute() {
    int4_equals_its_dequantized_twin(
        "qwen3_next_int4_computes_what_its_dequantized_weights_compute",
        "qwen3_next",
        crate::qwen3next::TOY,
    );
}

#[test]
fn deepseek_v3_int4_computes_what_its_dequantized_weights_compute() {
    int4_equals_its_dequantized_twin(
        "deepseek_v3_int4_computes_what_its_dequantized_weights_compute",
        "deepseek_v3",
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/deepseek_toy"),
    );
}

#[test]
fn glm4_moe_int4_computes_what_its_dequantized_weights_compute() {
    int4_equals_its_dequantized_twin(
        "glm4_moe_int4_computes_what_its_dequantized_weights_compute",
        "glm4_moe",
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/glm_toy"),
    );
}
