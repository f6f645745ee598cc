//! The MLX quantizer goldens' case files and the comparison every check of them
//! makes, shared by gturbo-format's own tests (which CI also runs on aarch64 under
//! qemu) and the live cross-check in the CLI's integration tests (`#[path]`).
#![allow(dead_code)]

use gturbo_format::quant::{QuantError, Spec, dequantize_rows_bf16, quantize_rows};
use serde::Deserialize;

/// One matrix of the golden file or the cross-check file (the shared fields).
#[derive(Deserialize)]
pub struct Case {
    pub name: String,
    pub shape: [usize; 2],
    #[serde(default = "four")]
    pub bits: u32,
    #[serde(default = "sixty_four")]
    pub group_size: u32,
    pub w_bf16_bits: Vec<u16>,
    pub q_u32: Vec<u32>,
    pub scales_bf16_bits: Vec<u16>,
    pub biases_bf16_bits: Vec<u16>,
    pub dequant_bf16_bits: Vec<u16>,
    #[serde(default)]
    pub x_bf16_bits: Vec<u16>,
    #[serde(default)]
    pub y_fp32_matvec: Vec<f32>,
    /// The codes as MLX unpacks them (`mx.dequantize` with scale 1, bias 0).
    #[serde(default)]
    pub codes: Vec<u8>,
    /// `mx.dequantize` on f32-widened scales and biases, as f32 bit patterns.
    #[serde(default)]
    pub dequant_f32_bits: Vec<u32>,
}

pub fn four() -> u32 {
    4
}

pub fn sixty_four() -> u32 {
    64
}

#[derive(Deserialize)]
pub struct CaseFile {
    pub mlx_version: String,
    pub cases: Vec<Case>,
}

impl Case {
    pub fn spec(&self) -> Spec {
        Spec::from_numbers(self.bits.into(), self.group_size.into())
            .unwrap_or_else(|e| panic!("{}: {e}", self.name))
    }
}

/// Quantized outputs as the typed values MLX reports.
pub struct Quantized {
    pub words: Vec<u32>,
    pub scales: Vec<u16>,
    pub biases: Vec<u16>,
    pub wbytes: Vec<u8>,
    pub sbytes: Vec<u8>,
    pub bbytes: Vec<u8>,
}

/// Output byte lengths (weights, scales) for `n` elements at `spec`.
pub fn sizes(n: usize, spec: Spec) -> (usize, usize) {
    let groups = n / spec.group.size();
    (groups * spec.group_weight_bytes(), groups * 2)
}

pub fn quantize(src: &[u16], cols: usize, spec: impl Into<Spec>) -> Result<Quantized, QuantError> {
    let spec = spec.into();
    let (wn, sn) = sizes(src.len(), spec);
    let mut wbytes = vec![0u8; wn];
    let mut sbytes = vec![0u8; sn];
    let mut bbytes = vec![0u8; sn];
    quantize_rows(src, cols, spec, &mut wbytes, &mut sbytes, &mut bbytes)?;
    let words = wbytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let le16 = |b: &[u8]| -> Vec<u16> {
        b.chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect()
    };
    Ok(Quantized {
        words,
        scales: le16(&sbytes),
        biases: le16(&bbytes),
        wbytes,
        sbytes,
        bbytes,
    })
}

/// Mismatch counts of one case: (words, scales, biases, dequantized values).
pub fn compare(case: &Case) -> [usize; 4] {
    let cols = case.shape[1];
    let bits = case.spec();
    let q = quantize(&case.w_bf16_bits, cols, bits)
        .unwrap_or_else(|e| panic!("{}: quantize refused: {e}", case.name));
    let count = |a: &[u32], b: &[u32]| {
        assert_eq!(a.len(), b.len(), "{}: length", case.name);
        a.iter().zip(b).filter(|(x, y)| x != y).count()
    };
    let widen = |v: &[u16]| v.iter().map(|&x| x as u32).collect::<Vec<_>>();
    let mut deq = vec![0u16; case.w_bf16_bits.len()];
    dequantize_rows_bf16(&q.wbytes, &q.sbytes, &q.bbytes, cols, bits, &mut deq)
        .unwrap_or_else(|e| panic!("{}: dequantize refused: {e}", case.name));
    [
        count(&q.words, &case.q_u32),
        count(&widen(&q.scales), &widen(&case.scales_bf16_bits)),
        count(&widen(&q.biases), &widen(&case.biases_bf16_bits)),
        count(&widen(&deq), &widen(&case.dequant_bf16_bits)),
    ]
}

pub fn load(path: &str) -> CaseFile {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parse {path}: {e}"))
}
