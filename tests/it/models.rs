//! `runtime::models`: the one registry (`models::open` picks the model by the gate's
//! runner, whatever the family) and the `Model` a caller drives, whose session
//! snapshots continue exactly as the session they were taken from, on both backends.

use std::path::Path;

use gturbo::runtime::experts::ExpertMode;
use gturbo::runtime::kernels::{Cpu, Ops};
use gturbo::runtime::load::{self, LoadOptions};
use gturbo::runtime::models::{self, Model};
use gturbo::runtime::sample::argmax;

use crate::gpu::gpu;

/// Greedy steps after `prompt` on `model` from session `s`: the tokens and each
/// step's logits.
fn steps(model: &dyn Model, s: &mut models::Session, first: u32, n: usize) -> Vec<Vec<f32>> {
    let mut t = first;
    let mut out = Vec::new();
    for _ in 0..n {
        let l = model.forward(s, &[t], false).unwrap();
        t = argmax(&l);
        out.push(l);
    }
    out
}

/// A snapshot taken after the prompt continues bit for bit as the original does, after
/// the original went on (so the copy shares no state with it), and matches a fresh
/// session fed the same tokens.
fn snapshots_continue_as_the_original<B: Ops + 'static>(dir: &Path, b: &B, prompt: &[u32]) {
    let install = load::open(
        dir,
        LoadOptions {
            experts: ExpertMode::Resident,
            ..Default::default()
        },
    )
    .unwrap();
    let model = models::open(&install, b).unwrap();
    let mut s = model.session();
    let first = argmax(&model.forward(&mut s, prompt, false).unwrap());
    let mut snap = model.snapshot(&s).unwrap();
    assert_eq!(snap.pos, prompt.len());
    let original = steps(model.as_ref(), &mut s, first, 4);
    let resumed = steps(model.as_ref(), &mut snap, first, 4);
    assert_eq!(resumed, original, "{}: the snapshot's steps", dir.display());
    let mut fresh = model.session();
    model.forward(&mut fresh, prompt, false).unwrap();
    assert_eq!(steps(model.as_ref(), &mut fresh, first, 4), original);
    // A session of another model is refused, not misread.
    let other_install = load::open(dir, LoadOptions::default()).unwrap();
    let cpu = Cpu::new(1);
    let other = models::open(&other_install, &cpu).unwrap();
    let mut foreign = other.session();
    if std::any::type_name::<B>() != std::any::type_name::<Cpu>() {
        let err = model.forward(&mut foreign, &[first], false).unwrap_err();
        assert!(err.to_string().contains("another model"), "{err}");
    }
}

fn mixtral_prompt() -> Vec<u32> {
    vec![1, 349, 311, 287, 285, 290, 198, 172, 384, 331, 316]
}

#[test]
fn decoder_snapshots_continue_as_the_original_on_the_cpu() {
    snapshots_continue_as_the_original(crate::mixtral::bf16(), &Cpu::new(2), &mixtral_prompt());
}

#[test]
fn decoder_snapshots_continue_as_the_original_on_the_gpu() {
    let Some(g) = gpu("decoder_snapshots_continue_as_the_original_on_the_gpu") else {
        return;
    };
    snapshots_continue_as_the_original(crate::mixtral::bf16(), &g, &mixtral_prompt());
}

#[test]
fn deepseek_snapshots_continue_as_the_original_on_both_backends() {
    let prompt = mixtral_prompt();
    snapshots_continue_as_the_original(crate::deepseek::bf16(), &Cpu::new(2), &prompt);
    let Some(g) = gpu("deepseek_snapshots_continue_as_the_original_on_both_backends") else {
        return;
    };
    snapshots_continue_as_the_original(crate::deepseek::bf16(), &g, &prompt);
}

#[test]
fn flash_next_snapshots_continue_as_the_original_on_both_backends() {
    let dir = crate::gpu_flash::scaled_install();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 % 200 + 3) as u32).collect();
    snapshots_continue_as_the_original(dir, &Cpu::new(2), &prompt);
    if let Some(g) = gpu("flash_next_snapshots_continue_as_the_original_on_both_backends") {
        snapshots_continue_as_the_original(dir, &g, &prompt);
    }
}
