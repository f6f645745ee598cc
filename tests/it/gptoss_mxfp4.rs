//! gpt-oss with MXFP4 experts through the runner, against transformers' goldens of
//! `tests/data/gptoss_mxfp4_toy` (`scripts/golden/gen_gptoss_mxfp4.py`: transformers
//! reads the MXFP4 checkpoint and dequantizes its experts; a prompt of 17 ids past the
//! window of 8, a greedy rollout of 24 that wraps it several times).
//!
//! The default install keeps the experts as published (`mxfp4_g32`) and quantizes
//! attention and the head to INT4, so its logits carry INT4's rounding; to hold the
//! MXFP4 expert arithmetic itself to the reference, the `--quant bf16` install (every
//! other tensor at its source dtype, experts dequantized to BF16 exactly) is given the
//! default install's MXFP4 expert pools ([`splice`]): that install differs from
//! transformers' model only in how the experts' matrices are read.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use gturbo::runtime::experts::ExpertMode;
use gturbo::runtime::kernels::{Cpu, Ops};
use serde_json::Value;

use crate::gptoss::logits_vs_golden_of;
use crate::support::cli;
use crate::support::run_dir;
use crate::support::toy::{Meta, csv, ids, install_toy, manifest, meta_of};

const TOY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/gptoss_mxfp4_toy");

/// The installs of one test run: the default (MXFP4 experts, INT4 elsewhere), the
/// `--quant bf16` one, and the BF16 one with the default's MXFP4 expert pools.
struct Installs {
    default: PathBuf,
    bf16: PathBuf,
    spliced: PathBuf,
}

fn installs() -> &'static Installs {
    static DIR: OnceLock<Installs> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = run_dir("gptoss-mxfp4");
        let i = Installs {
            default: root.join("default.gturbo"),
            bf16: root.join("bf16.gturbo"),
            spliced: root.join("spliced.gturbo"),
        };
        install_toy("gpt_oss", TOY, &i.default, &[]);
        install_toy("gpt_oss", TOY, &i.bf16, &["--quant", "bf16"]);
        splice(&i.bf16, &i.default, &i.spliced);
        i
    })
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}

/// `base` with `experts`' expert pools: the pool files, the manifest's `expert_pools`
/// and their `files` entries (sizes and digests) taken from `experts`.
fn splice(base: &Path, experts: &Path, out: &Path) {
    copy_tree(base, out);
    copy_tree(&experts.join("packed_experts"), &out.join("packed_experts"));
    let mut m = manifest(base);
    let e = manifest(experts);
    m["expert_pools"] = e["expert_pools"].clone();
    let pool_file = |path: &Value| {
        e["files"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["path"] == *path)
            .cloned()
    };
    for f in m["files"].as_array_mut().unwrap() {
        if f["kind"] == "experts" {
            *f = pool_file(&f["path"]).expect("the same pool files");
        }
    }
    std::fs::write(
        out.join("manifest.json"),
        serde_json::to_vec_pretty(&m).unwrap(),
    )
    .unwrap();
}

fn meta() -> Meta {
    meta_of(TOY, "gpt_oss")
}

/// The pools' schemes of the install `dir`.
fn pool_schemes(dir: &Path) -> Vec<String> {
    manifest(dir)["expert_pools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["scheme"].as_str().unwrap().to_string())
        .collect()
}

/// `gturbo run DIR --backend BACKEND --prompt-ids PROMPT --max-tokens 24 EXTRA…`: the
/// greedy tokens.
fn greedy(dir: &Path, backend: &str, extra: &[&str]) -> Vec<u32> {
    let prompt = csv(&meta().prompt);
    let mut args = vec!["--backend", backend, "--prompt-ids", &prompt];
    args.extend_from_slice(&["--max-tokens", "24"]);
    args.extend_from_slice(extra);
    let (doc, footer) = cli::run_json(dir, &args);
    assert_eq!(doc["runner"], "gpt_oss", "{footer}");
    ids(&doc["tokens"])
}

#[test]
fn the_default_install_keeps_the_experts_mxfp4_and_decodes_24_tokens_on_the_cpu() {
    let i = installs();
    assert_eq!(pool_schemes(&i.default), ["mxfp4_g32", "mxfp4_g32"]);
    assert_eq!(pool_schemes(&i.bf16), ["passthrough", "passthrough"]);
    let tokens = greedy(&i.default, "cpu", &["--allow-unmeasured"]);
    assert_eq!(tokens.len(), 24);
}

/// Greedy tokens (the CLI) and every position's logits (prompt and cached decode, both
/// expert modes) of `dir` on `backend` against the goldens.
fn matches_transformers<B: Ops + 'static>(dir: &Path, name: &str, backend: &B) {
    assert_eq!(greedy(dir, name, &[]), meta().greedy, "{}", dir.display());
    logits_vs_golden_of(TOY, dir, backend, ExpertMode::Slots(2));
    logits_vs_golden_of(TOY, dir, backend, ExpertMode::Resident);
}

#[test]
fn mxfp4_experts_match_transformers_on_the_cpu() {
    let i = installs();
    assert_eq!(pool_schemes(&i.spliced), ["mxfp4_g32", "mxfp4_g32"]);
    matches_transformers(&i.spliced, "cpu", &Cpu::new(2));
}

#[test]
fn the_bf16_install_of_mxfp4_experts_matches_transformers_on_the_cpu() {
    matches_transformers(&installs().bf16, "cpu", &Cpu::new(2));
}

#[cfg(feature = "gpu")]
#[test]
fn mxfp4_experts_match_transformers_on_the_gpu_with_expert_slots_and_resident_experts() {
    const TEST: &str =
        "mxfp4_experts_match_transformers_on_the_gpu_with_expert_slots_and_resident_experts";
    let Some(gpu) = crate::gpu::gpu(TEST) else {
        return;
    };
    let i = installs();
    matches_transformers(&i.spliced, "gpu", &gpu);
    let want = meta().greedy;
    for mode in [&["--expert-cache-slots", "2"][..], &["--resident-experts"]] {
        assert_eq!(greedy(&i.spliced, "gpu", mode), want, "{mode:?}");
    }
    matches_transformers(&i.bf16, "gpu", &gpu);
    let default = greedy(&i.default, "gpu", &["--allow-unmeasured"]);
    assert_eq!(default, greedy(&i.default, "cpu", &["--allow-unmeasured"]));
}
