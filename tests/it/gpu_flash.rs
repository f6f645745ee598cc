//! The Flash-Next runner on the GPU backend (`--backend gpu`) against the CPU backend:
//! the scaled replica at INT4 (the real row width, one indexed-attention layer past
//! its indexer's dense range, a PLE layer, 8 experts) gives the CPU's greedy tokens,
//! and its logits agree at every position within docs/GPU.md's tolerance, streaming its
//! experts through 2 slots and with resident experts; `gturbo run --backend gpu` runs
//! it on the adapter. On a machine without a GPU these run on Mesa's llvmpipe; with no
//! adapter at all they are reported as skipped (a failure in a strict run: CI).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use gturbo::runtime::experts::ExpertMode;
use gturbo::runtime::kernels::Ops;
use gturbo::runtime::kernels::{Backend, Cpu};
use gturbo::runtime::models::flash_next::install::{self, DEFAULT_ROW_CACHE_ROWS, FlashOptions};
use gturbo::runtime::models::flash_next::model::FlashModel;
use gturbo_testkit::replica::{self, FlashNextSpec};
use serde_json::Value;

use crate::gpu::{LOGIT_RTOL, gpu, rollout, worst_relative};
use crate::support::cli::install;

/// The scaled replica installed at INT4 once for this test binary (kept for the run).
pub(crate) fn scaled_install() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let tmp = crate::support::run_dir("flash-next-scaled-int4");
        let snap = tmp.join("snap");
        replica::write_flash_next(&snap, &FlashNextSpec::scaled()).expect("write the replica");
        let out = tmp.join("flash.gturbo");
        install("qwen38flashnext", &snap, &out, &[]);
        out
    })
}

/// 100 prompt ids: past the indexer's dense range (budget 64 plus the tail), so the
/// attention layer reads a selection of blocks.
fn prompt(vocab: usize) -> Vec<u32> {
    (0..100)
        .map(|i| ((i * 37) % (vocab - 24) + 3) as u32)
        .collect()
}

/// The install at `dir` opened with `experts`.
fn open(dir: &Path, experts: ExpertMode) -> install::FlashInstall {
    let opts = FlashOptions {
        experts,
        row_cache_rows: DEFAULT_ROW_CACHE_ROWS,
    };
    install::open(dir, opts).unwrap()
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
    let fi = open(dir, experts);
    let model = FlashModel::new(&fi, b).unwrap();
    let mut s = model.session();
    rollout(model.cfg.vocab, prompt, steps, |ids, prefill| {
        model.forward(&mut s, ids, prefill).unwrap()
    })
}

#[test]
fn the_scaled_flash_next_replica_on_the_gpu_gives_the_cpu_tokens_and_logits() {
    const TEST: &str = "the_scaled_flash_next_replica_on_the_gpu_gives_the_cpu_tokens_and_logits";
    let Some(g) = gpu(TEST) else {
        return;
    };
    let dir = scaled_install();
    let prompt = prompt(FlashNextSpec::scaled().vocab_size as usize);
    let steps = 8;
    let (cpu_tokens, cpu_logits) = greedy(dir, ExpertMode::Slots(2), &Cpu::new(2), &prompt, steps);
    for experts in [ExpertMode::Slots(2), ExpertMode::Resident] {
        let (tokens, logits) = greedy(dir, experts, &g, &prompt, steps);
        assert_eq!(
            tokens,
            cpu_tokens,
            "greedy tokens on {} ({experts:?})",
            g.name()
        );
        let (worst, at) = worst_relative(&logits, &cpu_logits);
        eprintln!(
            "Flash-Next scaled INT4 on {} ({experts:?}): {} positions, worst relative logit \
             difference {worst:.2e} at {at}",
            g.name(),
            logits.len()
        );
        assert!(
            worst <= LOGIT_RTOL,
            "{experts:?}, position {at}: logits differ by {worst:.2e} of their largest \
             magnitude (> {LOGIT_RTOL})"
        );
    }
}

fn run_json(dir: &Path, backend: &str) -> (Value, String) {
    let args = [
        "--allow-unmeasured",
        "--max-tokens",
        "4",
        "--expert-cache-slots",
        "2",
        "--prompt-ids",
        "5,17,200,33,9,48,310,2,77,120,64,1,250,19,8,400",
        "--backend",
        backend,
    ];
    crate::support::cli::run_json(dir, &args)
}

#[test]
fn run_backend_gpu_runs_flash_next_on_the_adapter() {
    const TEST: &str = "run_backend_gpu_runs_flash_next_on_the_adapter";
    let Some(g) = gpu(TEST) else {
        return;
    };
    let adapter = g.adapter().clone();
    drop(g);
    let dir = scaled_install();
    let (cpu, _) = run_json(dir, "cpu");
    let (gpu, footer) = run_json(dir, "gpu");
    assert_eq!(gpu["runner"], "flash-next");
    assert_eq!(gpu["tokens"], cpu["tokens"]);
    let name = gpu["backend"].as_str().unwrap();
    assert!(
        name.contains(&adapter.name) && name.contains(&adapter.backend),
        "{name} vs {adapter}"
    );
    assert!(gpu["device_memory_bytes"].as_u64().unwrap() > 0, "{gpu}");
    assert!(cpu["device_memory_bytes"].is_null());
    // The runner's own footer parts, the same figures as on the CPU.
    assert_eq!(gpu["state_bytes"], cpu["state_bytes"]);
    assert_eq!(gpu["row_cache"]["misses"], cpu["row_cache"]["misses"]);
    for part in [
        &format!("on {name}, device memory ")[..],
        "row cache",
        "KV cache + GDN/PLE state",
    ] {
        assert!(footer.contains(part), "{part}: {footer}");
    }
    // `auto` takes hardware adapters only: with a software one alone, the CPU.
    let (auto, _) = run_json(dir, "auto");
    assert_eq!(auto["tokens"], cpu["tokens"]);
    if adapter.device_type == "Cpu" {
        assert_eq!(
            auto["backend"], cpu["backend"],
            "auto on a software adapter"
        );
    }
}

/// Flash-Next's routed experts go through the one MoE dispatch (`layers::moe`), which
/// asks the GPU first to run a resident layer whole: with resident experts a decode
/// step reads no routing back (only the logits and the indexer's block scores), where
/// with slots it reads each MoE layer's choice back; and the tokens agree.
#[test]
fn flash_next_on_the_gpu_takes_the_resident_expert_path() {
    const TEST: &str = "flash_next_on_the_gpu_takes_the_resident_expert_path";
    let Some(g) = gpu(TEST) else {
        return;
    };
    let dir = scaled_install();
    let prompt = prompt(FlashNextSpec::scaled().vocab_size as usize);
    let mut reads = Vec::new();
    let mut tokens = Vec::new();
    for experts in [ExpertMode::Slots(2), ExpertMode::Resident] {
        let fi = open(dir, experts);
        let model = FlashModel::new(&fi, &g).unwrap();
        let mut s = model.session();
        let logits = model.forward(&mut s, &prompt, false).unwrap();
        let next = gturbo::runtime::sample::argmax(&logits);
        let before = g.context().stats().readbacks;
        let logits = model.forward(&mut s, &[next], false).unwrap();
        reads.push(g.context().stats().readbacks - before);
        tokens.push((next, gturbo::runtime::sample::argmax(&logits)));
    }
    let layers = FlashNextSpec::scaled().num_hidden_layers;
    eprintln!(
        "read-backs per decode step: slots {}, resident {}",
        reads[0], reads[1]
    );
    assert_eq!(
        tokens[0], tokens[1],
        "slots and resident experts pick the same tokens"
    );
    assert!(
        reads[0] >= reads[1] + layers,
        "a resident decode step reads back {} times, a slot-cache one {}: the {layers} MoE \
         layers' routing should stay on the device",
        reads[1],
        reads[0]
    );
}
