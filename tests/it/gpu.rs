//! The GPU backend (`--backend gpu`, wgpu) against the CPU backend on whole models:
//! SmolLM2 INT4's greedy tokens and logits, a tiny qwen3_moe streaming its experts
//! through 2 slots, and the CLI's backend choice. On a machine without a GPU these
//! run on Mesa's llvmpipe (software Vulkan); with no adapter at all they are reported
//! as skipped (a failure in a strict run: CI).

use std::path::Path;

use gturbo::runtime::experts::ExpertMode;
use gturbo::runtime::generate::argmax;
use gturbo::runtime::kernels::gpu::{Gpu, GpuOptions};
use gturbo::runtime::kernels::{Backend, Cpu, Ops};
use gturbo::runtime::load::{self, LoadOptions};
use gturbo::runtime::models::decoder::Model;
use gturbo_testkit::skip::{GTURBO_REQUIRE_GPU, require_or_skip};
use serde_json::Value;

use crate::runtime::smollm2;
use crate::support::cli::{gturbo, moe_install, text};
use crate::support::temp_dir;

/// The relative tolerance on logits: at every position, `max |gpu − cpu| ≤ LOGIT_RTOL ·
/// max |cpu|` (FORMAT.md, "GPU numerics").
pub(crate) const LOGIT_RTOL: f64 = 1e-3;

/// The first adapter wgpu offers (llvmpipe here), or `None` after recording the skip;
/// a failure instead when `GTURBO_REQUIRE_GPU=1`, as in the kernels' own GPU tests.
pub(crate) fn gpu(test: &str) -> Option<Gpu> {
    let g = Gpu::new(&GpuOptions::default()).map_err(|e| format!("no GPU adapter: {e}"));
    if let Err(e) = &g
        && std::env::var(GTURBO_REQUIRE_GPU).is_ok_and(|v| v == "1")
    {
        panic!("{test}: {GTURBO_REQUIRE_GPU}=1 but {e}");
    }
    require_or_skip(test, g)
}

/// Greedy decoding of `steps` tokens after `prompt`, with the logits of every
/// position (the prompt's, then each decode step's).
fn greedy<B: Ops>(
    dir: &Path,
    experts: ExpertMode,
    b: &B,
    prompt: &[u32],
    steps: usize,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let install = load::open(
        dir,
        LoadOptions {
            experts,
            ..Default::default()
        },
    )
    .unwrap();
    let model = Model::new(&install, b).unwrap();
    let mut s = model.session();
    rollout(model.cfg.vocab, prompt, steps, |ids, prefill| {
        model.forward(&mut s, ids, prefill).unwrap()
    })
}

/// Greedy decoding of `steps` tokens after `prompt` through `forward(ids, prefill)`
/// (the prompt at once, then one token at a time), with the logits of every position.
pub(crate) fn rollout(
    vocab: usize,
    prompt: &[u32],
    steps: usize,
    mut forward: impl FnMut(&[u32], bool) -> Vec<f32>,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let all = forward(prompt, true);
    let mut rows: Vec<Vec<f32>> = all.chunks_exact(vocab).map(<[f32]>::to_vec).collect();
    let mut tokens = Vec::new();
    while tokens.len() < steps {
        let t = argmax(rows.last().unwrap());
        tokens.push(t);
        if tokens.len() == steps {
            break;
        }
        rows.push(forward(&[t], false));
    }
    (tokens, rows)
}

/// Largest `max |a − b| / max |b|` over the positions.
pub(crate) fn worst_relative(got: &[Vec<f32>], want: &[Vec<f32>]) -> (f64, usize) {
    assert_eq!(got.len(), want.len(), "positions");
    let mut worst = (0.0, 0);
    for (p, (g, w)) in got.iter().zip(want).enumerate() {
        let scale = w.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
        let diff = g
            .iter()
            .zip(w)
            .fold(0f64, |m, (a, b)| m.max((*a as f64 - *b as f64).abs()));
        let r = diff / scale;
        if r > worst.0 {
            worst = (r, p);
        }
    }
    worst
}

#[test]
fn smollm2_int4_on_the_gpu_matches_the_cpu_for_32_greedy_tokens_and_every_logit() {
    const TEST: &str =
        "smollm2_int4_on_the_gpu_matches_the_cpu_for_32_greedy_tokens_and_every_logit";
    let Some((_, int4, _)) = smollm2(TEST) else {
        return;
    };
    let Some(g) = gpu(TEST) else {
        return;
    };
    // "The capital of France is" (the tokenizer's ids, as runtime.rs checks them).
    let prompt = [504, 3575, 282, 4649, 314];
    let (cpu_tokens, cpu_logits) = greedy(int4, ExpertMode::Slots(1), &Cpu::new(2), &prompt, 32);
    let (gpu_tokens, gpu_logits) = greedy(int4, ExpertMode::Slots(1), &g, &prompt, 32);
    assert_eq!(gpu_tokens, cpu_tokens, "greedy tokens on {}", g.name());
    let (worst, at) = worst_relative(&gpu_logits, &cpu_logits);
    eprintln!(
        "SmolLM2 INT4 on {}: {} positions, worst relative logit difference {worst:.2e} at {at}",
        g.name(),
        gpu_logits.len()
    );
    assert!(
        worst <= LOGIT_RTOL,
        "position {at}: logits differ by {worst:.2e} of their largest magnitude (> {LOGIT_RTOL})"
    );
}

#[test]
fn tiny_qwen3_moe_on_the_gpu_with_2_expert_slots_gives_the_cpu_tokens() {
    const TEST: &str = "tiny_qwen3_moe_on_the_gpu_with_2_expert_slots_gives_the_cpu_tokens";
    let Some(g) = gpu(TEST) else {
        return;
    };
    let tmp = temp_dir();
    let (_, out) = moe_install(tmp.path());
    let prompt = [
        5, 17, 200, 33, 9, 48, 310, 2, 77, 120, 64, 1, 250, 19, 8, 400,
    ];
    let (cpu_tokens, cpu_logits) = greedy(&out, ExpertMode::Slots(2), &Cpu::new(2), &prompt, 24);
    let (gpu_tokens, gpu_logits) = greedy(&out, ExpertMode::Slots(2), &g, &prompt, 24);
    assert_eq!(gpu_tokens, cpu_tokens, "greedy tokens with 2 slots");
    // Resident (mapped) experts take the other device path: uploaded once, kept.
    let (resident, _) = greedy(&out, ExpertMode::Resident, &g, &prompt, 24);
    assert_eq!(resident, cpu_tokens, "greedy tokens with resident experts");
    let (worst, at) = worst_relative(&gpu_logits, &cpu_logits);
    assert!(worst <= LOGIT_RTOL, "position {at}: {worst:.2e}");
}

/// The dense qwen3 decoder (QK-norm, untied head) on the GPU: the CPU's greedy tokens
/// and logits.
#[test]
fn tiny_qwen3_on_the_gpu_gives_the_cpu_tokens_and_logits() {
    const TEST: &str = "tiny_qwen3_on_the_gpu_gives_the_cpu_tokens_and_logits";
    let Some(g) = gpu(TEST) else {
        return;
    };
    let tmp = temp_dir();
    let out = crate::runtime::qwen3_install(tmp.path(), 7);
    let prompt = [5, 17, 200, 33, 9, 48, 310, 2, 77, 120, 64, 1];
    let (cpu_tokens, cpu_logits) = greedy(&out, ExpertMode::Slots(2), &Cpu::new(2), &prompt, 16);
    let (gpu_tokens, gpu_logits) = greedy(&out, ExpertMode::Slots(2), &g, &prompt, 16);
    assert_eq!(gpu_tokens, cpu_tokens, "greedy tokens");
    let (worst, at) = worst_relative(&gpu_logits, &cpu_logits);
    assert!(worst <= LOGIT_RTOL, "position {at}: {worst:.2e}");
}

fn run(args: &[&str]) -> std::process::Output {
    gturbo().arg("run").args(args).output().unwrap()
}

#[test]
fn run_backend_gpu_names_the_adapter_and_auto_skips_software_adapters() {
    const TEST: &str = "run_backend_gpu_names_the_adapter_and_auto_skips_software_adapters";
    let Some(g) = gpu(TEST) else {
        return;
    };
    let adapter = g.adapter().clone();
    drop(g);
    let tmp = temp_dir();
    let (_, out) = moe_install(tmp.path());
    let dir = out.to_str().unwrap();
    let ids = "5,17,200,33,9,48,310,2";
    let json = |backend: &str| -> Value {
        let o = run(&[
            dir,
            "--json",
            "--max-tokens",
            "8",
            "--threads",
            "2",
            "--expert-cache-slots",
            "2",
            "--prompt-ids",
            ids,
            "--backend",
            backend,
        ]);
        assert!(o.status.success(), "--backend {backend}: {}", text(&o));
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        let mut v: Value = serde_json::from_slice(&o.stdout).unwrap();
        v["footer"] = Value::from(err);
        v
    };
    let cpu = json("cpu");
    let gpu = json("gpu");
    assert_eq!(gpu["tokens"], cpu["tokens"]);
    let name = gpu["backend"].as_str().unwrap();
    assert!(
        name.contains(&adapter.name) && name.contains(&adapter.backend),
        "{name} vs {adapter}"
    );
    assert!(gpu["device_memory_bytes"].as_u64().unwrap() > 0);
    let footer = gpu["footer"].as_str().unwrap();
    assert!(
        footer.contains(&format!("on {name}, device memory ")),
        "{footer}"
    );
    assert!(cpu["device_memory_bytes"].is_null());
    // `auto` takes a hardware adapter only: with a software one alone (llvmpipe), the CPU.
    let auto = json("auto");
    assert_eq!(auto["tokens"], cpu["tokens"]);
    if adapter.device_type == "Cpu" {
        assert_eq!(
            auto["backend"], cpu["backend"],
            "auto on a software adapter"
        );
    }
    // An adapter that is not there is a clear error with `--backend gpu`.
    let o = run(&[
        dir,
        "--prompt-ids",
        ids,
        "--backend",
        "gpu",
        "--adapter",
        "no-such-adapter",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--backend gpu: no GPU adapter matches \"no-such-adapter\"")
            && err.contains(&adapter.name),
        "{err}"
    );
    // The listing names each adapter and its backend.
    let o = run(&["--list-adapters"]);
    assert!(o.status.success(), "{}", text(&o));
    let list = String::from_utf8_lossy(&o.stdout);
    assert!(
        list.contains(&format!("0: {} ({}", adapter.name, adapter.backend)),
        "{list}"
    );
}

/// An install the runner refuses gets the same error and exit code on either backend:
/// the GPU path reports the install's fault, not "does not load on <adapter>".
#[test]
fn an_install_the_runner_refuses_fails_alike_on_cpu_and_gpu() {
    const TEST: &str = "an_install_the_runner_refuses_fails_alike_on_cpu_and_gpu";
    let Some(g) = gpu(TEST) else {
        return;
    };
    drop(g);
    let tmp = temp_dir();
    let (_, out) = moe_install(tmp.path());
    // The expert width the runner derives the pools' shapes from, edited: the pools on
    // disk no longer match it (a check of the model, after the install has opened).
    let path = out.join("manifest.json");
    let mut m: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    m["arch"]["axes"]["moe_intermediate_size"] = Value::from(128);
    std::fs::write(&path, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    let dir = out.to_str().unwrap();
    let on = |backend: &str| run(&[dir, "--prompt-ids", "5,17", "--backend", backend]);
    let (cpu, gpu) = (on("cpu"), on("gpu"));
    let err = |o: &std::process::Output| String::from_utf8_lossy(&o.stderr).to_string();
    assert!(
        err(&cpu).contains("experts of shapes"),
        "the refusal this test is about: {}",
        err(&cpu)
    );
    assert_eq!(gpu.status.code(), cpu.status.code(), "{}", err(&gpu));
    // gturbo's own lines (a software Vulkan driver may add its own warnings).
    let ours = |o: &std::process::Output| -> Vec<String> {
        err(o)
            .lines()
            .filter(|l| l.starts_with("gturbo:"))
            .map(str::to_string)
            .collect()
    };
    assert_eq!(ours(&gpu), ours(&cpu));
}
