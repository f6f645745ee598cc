//! Issue 13 ("hostile world, round two"), the install's side, through the real binary
//! on small `--from` snapshots: links planted beside or inside the output are refused
//! and their targets untouched, a kill after the publish rename is recognised, a
//! changed plan says what changed, non-finite passthrough tensors and oversized
//! tokenizer files are refused, and absurd architecture axes are refused at install,
//! verify and run alike, by one set of rules.

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use gturbo_testkit::replica::{self, Qwen3MoeSpec, Qwen3Spec};
use serde_json::Value;

use crate::support::cli::{error_line, gturbo, install_cmd, text, try_install};
use crate::support::temp_dir;

/// A tiny dense Qwen3 snapshot (one file, no index) under `tmp/snap`.
fn qwen3_snapshot(tmp: &Path) -> PathBuf {
    let snap = tmp.join("snap");
    replica::write_qwen3(&snap, &Qwen3Spec::tiny()).unwrap();
    snap
}

/// Every file under `dir` (links not followed) with its bytes, sorted by path.
fn tree(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let t = std::fs::symlink_metadata(&p).unwrap().file_type();
            let rel = p.strip_prefix(dir).unwrap().display().to_string();
            if t.is_dir() {
                stack.push(p);
            } else {
                out.push((rel, std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

fn suffixed(out: &Path, s: &str) -> PathBuf {
    PathBuf::from(format!("{}{s}", out.display()))
}

/// Item 2: a link at each path gturbo creates beside the output (the lock, the
/// journal, the staging directory, the output itself) and inside the staging directory
/// is refused naming the path, before anything is written through it: the link's
/// target keeps its bytes, and nothing is published.
#[test]
fn issue13_planted_links_are_refused_naming_the_path_and_targets_stay_untouched() {
    let tmp = temp_dir();
    let snap = qwen3_snapshot(tmp.path());
    let out = tmp.path().join("m.gturbo");
    let victim = tmp.path().join("victim.txt");
    std::fs::write(&victim, b"precious bytes, not a lock or a journal").unwrap();
    let victim_dir = tmp.path().join("victim_dir");
    std::fs::create_dir(&victim_dir).unwrap();
    std::fs::write(victim_dir.join("keep.bin"), b"keep me").unwrap();
    let before = tree(&victim_dir);

    let refused = |link: &Path, extra: &[&str]| {
        let o = try_install("qwen3", &snap, &out, extra);
        assert_eq!(o.status.code(), Some(2), "{}: {}", link.display(), text(&o));
        assert!(
            error_line(&o).starts_with(&format!(
                "gturbo: error: {}: a symbolic link, where gturbo creates its own",
                link.display()
            )),
            "{}",
            text(&o)
        );
        assert!(!text(&o).contains("panicked"), "{}", text(&o));
        assert_eq!(
            std::fs::read(&victim).unwrap(),
            b"precious bytes, not a lock or a journal"
        );
        assert_eq!(tree(&victim_dir), before);
        // Nothing was published; the output path is absent or still the planted link.
        assert!(std::fs::symlink_metadata(&out).map_or(true, |m| m.file_type().is_symlink()));
    };

    for (suffix, target) in [
        (".partial.lock", &victim),
        (".partial.journal", &victim),
        (".partial", &victim_dir),
    ] {
        let link = suffixed(&out, suffix);
        symlink(target, &link).unwrap();
        refused(&link, &["-q"]);
        std::fs::remove_file(&link).unwrap();
        // Left by the refused run besides the link: the lock file, a regular file.
        let _ = std::fs::remove_file(suffixed(&out, ".partial.lock"));
    }
    // A dangling link at the journal: its target is not created either.
    let journal = suffixed(&out, ".partial.journal");
    let nowhere = tmp.path().join("nowhere");
    symlink(&nowhere, &journal).unwrap();
    refused(&journal, &["-q"]);
    assert!(!nowhere.exists());
    std::fs::remove_file(&journal).unwrap();

    // The output itself: never replaced by, published as, or written through a link.
    symlink(&victim_dir, &out).unwrap();
    refused(&out, &["-q"]);
    refused(&out, &["-q", "--overwrite"]);
    std::fs::remove_file(&out).unwrap();

    // Inside the staging directory of an interrupted install.
    let o = install_cmd("qwen3", &snap, &out, &["-q"])
        .env("GTURBO_TEST_ABORT_AFTER_READS", "1")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(137), "{}", text(&o));
    let staging = suffixed(&out, ".partial");
    let resident = staging.join("resident.bin");
    std::fs::remove_file(&resident).unwrap();
    symlink(&victim, &resident).unwrap();
    refused(&resident, &["-q"]);
    std::fs::remove_file(&resident).unwrap();
    let tokenizer = staging.join("tokenizer");
    // The copied files come while the reads run: what the killed run copied goes.
    if tokenizer.exists() {
        std::fs::remove_dir_all(&tokenizer).unwrap();
    }
    symlink(&victim_dir, &tokenizer).unwrap();
    refused(&tokenizer, &["-q"]);
    std::fs::remove_file(&tokenizer).unwrap();

    // With every link gone the same command installs, into a real directory, and
    // leaves nothing beside it.
    let o = try_install("qwen3", &snap, &out, &["-q"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(std::fs::symlink_metadata(&out).unwrap().is_dir());
    for s in [".partial", ".partial.lock", ".partial.journal"] {
        assert!(std::fs::symlink_metadata(suffixed(&out, s)).is_err(), "{s}");
    }
    assert_eq!(tree(&victim_dir), before);
}

/// Item 8: a kill after the publish rename, before the journal and the lock are
/// removed: the rerun verifies the published install, removes the leftovers and
/// succeeds, where it used to refuse with "already exists". A published install that
/// no longer verifies is refused, naming what failed.
#[test]
fn issue13_a_kill_after_the_publish_rename_is_recognised_and_cleaned_up() {
    let tmp = temp_dir();
    let snap = qwen3_snapshot(tmp.path());
    let out = tmp.path().join("m.gturbo");
    let o = install_cmd("qwen3", &snap, &out, &["-q"])
        .env("GTURBO_TEST_EXIT_AFTER_PUBLISH", "1")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(137), "{}", text(&o));
    let (journal, lock) = (
        suffixed(&out, ".partial.journal"),
        suffixed(&out, ".partial.lock"),
    );
    assert!(out.is_dir() && journal.is_file() && lock.is_file());
    let published = tree(&out);

    let o = try_install("qwen3", &snap, &out, &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains(&format!(
            "gturbo: {} was already installed by an interrupted run of this plan: verified, leftovers removed, nothing fetched",
            out.display()
        )),
        "{}",
        text(&o)
    );
    assert!(!journal.exists() && !lock.exists());
    assert_eq!(tree(&out), published, "the install is left as published");
    // Now a plain rerun refuses as before.
    let o = try_install("qwen3", &snap, &out, &["-q"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(error_line(&o).ends_with("already exists; pass --overwrite to replace it"));

    // Leftovers beside an install that does not verify: refused, the failure named,
    // and nothing removed.
    let out2 = tmp.path().join("d.gturbo");
    let o = install_cmd("qwen3", &snap, &out2, &["-q"])
        .env("GTURBO_TEST_EXIT_AFTER_PUBLISH", "1")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(137), "{}", text(&o));
    let resident = out2.join("resident.bin");
    let mut bytes = std::fs::read(&resident).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&resident, &bytes).unwrap();
    let o = try_install("qwen3", &snap, &out2, &["-q"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let line = error_line(&o);
    assert!(
        line.starts_with(&format!(
            "gturbo: error: {} already exists: a run of this plan published it but stopped before cleaning up, and it does not verify (resident.bin",
            out2.display()
        )),
        "{line}"
    );
    assert!(suffixed(&out2, ".partial.journal").exists());
}

/// Item 9: a rerun whose plan differs names what changed, by flag.
#[test]
fn issue13_a_changed_plan_says_what_changed() {
    let tmp = temp_dir();
    let snap = qwen3_snapshot(tmp.path());
    let out = tmp.path().join("m.gturbo");
    let o = install_cmd("qwen3", &snap, &out, &["-q"])
        .env("GTURBO_TEST_ABORT_AFTER_READS", "1")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(137), "{}", text(&o));
    let o = try_install(
        "qwen3",
        &snap,
        &out,
        &["-q", "--quant", "bf16", "--no-verify-source"],
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        error_line(&o).contains(
            " (changed: --no-verify-source: was not set, now set; --quant: was int4, now bf16); refusing to mix them"
        ),
        "{}",
        text(&o)
    );
}

/// Byte offset and length of `tensor`'s data in the safetensors file `path`.
fn tensor_span(path: &Path, tensor: &str) -> (usize, usize) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let off = &header[tensor]["data_offsets"];
    let (a, b) = (off[0].as_u64().unwrap(), off[1].as_u64().unwrap());
    (8 + n + a as usize, (b - a) as usize)
}

/// Item 12: NaN or inf in a passthrough float tensor (a norm) is refused like one in
/// a matrix, naming the shard, the tensor and the element; nothing is published.
#[test]
fn issue13_non_finite_passthrough_tensors_are_refused_naming_tensor_and_file() {
    let tmp = temp_dir();
    let snap = qwen3_snapshot(tmp.path());
    let file = snap.join("model.safetensors");
    let pristine = std::fs::read(&file).unwrap();
    for (tensor, element, bf16) in [
        (
            "model.layers.1.post_attention_layernorm.weight",
            5usize,
            0x7fc0u16,
        ), // NaN
        ("model.layers.0.self_attn.k_norm.weight", 63, 0xff80), // -inf
        ("model.norm.weight", 0, 0x7f80),                       // +inf
    ] {
        let (at, _) = tensor_span(&file, tensor);
        let mut bytes = pristine.clone();
        bytes[at + 2 * element..at + 2 * element + 2].copy_from_slice(&bf16.to_le_bytes());
        std::fs::write(&file, &bytes).unwrap();
        for quant in ["int4", "bf16"] {
            let out = tmp.path().join(format!("nan-{quant}.gturbo"));
            let o = try_install("qwen3", &snap, &out, &["-q", "--quant", quant]);
            assert_eq!(o.status.code(), Some(1), "{tensor}: {}", text(&o));
            assert_eq!(
                error_line(&o),
                format!(
                    "gturbo: error: model.safetensors: tensor `{tensor}`: non-finite weight (inf or NaN) at element {element}; refusing to install a defective checkpoint"
                ),
            );
            assert!(!out.exists());
        }
    }
    std::fs::write(&file, &pristine).unwrap();
    let o = try_install("qwen3", &snap, &tmp.path().join("ok.gturbo"), &["-q"]);
    assert!(o.status.success(), "{}", text(&o));
}

/// Item 14: a tokenizer file larger than any real one (2 GB, sparse) is refused at
/// plan time, from its listed size, before any weight is read: no staging directory.
#[test]
fn issue13_an_oversized_tokenizer_file_is_refused_before_any_weight_streams() {
    let tmp = temp_dir();
    let snap = qwen3_snapshot(tmp.path());
    let f = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(snap.join("tokenizer.json"))
        .unwrap();
    f.set_len(2_000_000_000).unwrap();
    drop(f);
    let out = tmp.path().join("m.gturbo");
    for extra in [&["-q", "--dry-run"][..], &["-q"]] {
        let o = try_install("qwen3", &snap, &out, extra);
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        assert_eq!(
            error_line(&o),
            "gturbo: error: tokenizer.json: 2000000000 bytes, more than the 67108864 a tokenizer.json may have; refusing before any weight is read"
        );
        assert!(!suffixed(&out, ".partial").exists() && !out.exists());
    }
}

/// A tiny qwen3_moe snapshot whose config.json has `edits` applied.
fn moe_snapshot(tmp: &Path, name: &str, edits: &[(&str, Value)]) -> PathBuf {
    let snap = tmp.join(name);
    replica::write_qwen3_moe(&snap, &Qwen3MoeSpec::tiny()).unwrap();
    let path = snap.join("config.json");
    let mut config: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    for (k, v) in edits {
        config[*k] = v.clone();
    }
    std::fs::write(&path, serde_json::to_vec(&config).unwrap()).unwrap();
    snap
}

/// Items 5, 11, 13: absurd, mistyped or inconsistent architecture values in
/// config.json are refused when the install is planned (dry run and real install
/// alike), naming file, field and bound, with the rules the runtime applies.
#[test]
fn issue13_absurd_config_axes_are_refused_at_plan_time_naming_field_and_bound() {
    let tmp = temp_dir();
    let big = Value::from(1_000_000_000_000u64);
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "num_hidden_layers",
            Value::from(1_000_000_000u64),
            "1000000000 is out of range (at most 1024) (axis `num_layers`)",
        ),
        (
            "num_experts",
            big.clone(),
            "1000000000000 is out of range (at most 65536) (axis `num_experts`)",
        ),
        (
            "num_experts",
            serde_json::json!(16.5),
            "16.5 is not an integer (axis `num_experts`)",
        ),
        (
            "hidden_size",
            Value::from(0),
            "0 is out of range (at least 1) (axis `hidden_size`)",
        ),
        (
            "num_experts_per_tok",
            Value::from(0),
            "0 is out of range (at least 1) (axis `num_experts_per_tok`)",
        ),
        (
            "num_experts_per_tok",
            Value::from(99),
            "99 is more than num_experts 8 (axis `num_experts_per_tok`)",
        ),
        (
            "vocab_size",
            big,
            "1000000000000 is out of range (at most 16777216) (axis `vocab_size`)",
        ),
        (
            "rms_norm_eps",
            serde_json::json!("tiny"),
            "expected a number, found \"tiny\" (axis `rms_norm_eps`)",
        ),
        // Against the tensors present: the checkpoint holds 2 layers, 8 experts.
        (
            "num_hidden_layers",
            Value::from(3),
            "3 layers, but the checkpoint's tensors hold layers 0..=1 (2) (axis `num_layers`)",
        ),
        (
            "num_experts",
            Value::from(16),
            "16 experts, but packed_experts/layer_00.bin holds 8 (axis `num_experts`)",
        ),
    ];
    for (i, (field, value, detail)) in cases.into_iter().enumerate() {
        let snap = moe_snapshot(tmp.path(), &format!("snap{i}"), &[(field, value.clone())]);
        let out = tmp.path().join(format!("m{i}.gturbo"));
        for extra in [&["-q", "--dry-run"][..], &["-q"]] {
            let o = try_install("qwen3_moe", &snap, &out, extra);
            assert_eq!(o.status.code(), Some(2), "{field}={value}: {}", text(&o));
            assert_eq!(
                error_line(&o),
                format!("gturbo: error: config.json: field `{field}`: {detail}"),
                "{field}={value}"
            );
            assert!(!out.exists() && !suffixed(&out, ".partial").exists());
        }
    }
}

/// Item 5: an install whose manifest axis is edited to a billion layers: `run` and
/// `eval` refuse it with a clear error naming the field, exit 1 (they used to abort
/// with SIGABRT, exit 134, on a 600 GB allocation), and `verify-install` names it too.
#[test]
fn issue13_an_absurd_manifest_axis_is_refused_by_run_eval_and_verify() {
    let tmp = temp_dir();
    let snap = moe_snapshot(tmp.path(), "snap", &[]);
    let out = tmp.path().join("m.gturbo");
    let o = try_install("qwen3_moe", &snap, &out, &["-q"]);
    assert!(o.status.success(), "{}", text(&o));
    let path = out.join("manifest.json");
    let mut m: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    m["arch"]["axes"]["num_layers"] = Value::from(1_000_000_000u64);
    std::fs::write(&path, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    // The same words from the manifest checks that loading applies and verify-install.
    let text_file = tmp.path().join("eval.txt");
    std::fs::write(&text_file, "hello world, a short text to evaluate").unwrap();
    let want = "manifest.json: arch.axes.num_layers: 1000000000 is out of range (at most 1024)";
    for args in [
        vec![
            "run",
            out.to_str().unwrap(),
            "--prompt-ids",
            "1,2",
            "--max-tokens",
            "1",
        ],
        vec![
            "eval",
            out.to_str().unwrap(),
            out.to_str().unwrap(),
            "--text",
            text_file.to_str().unwrap(),
        ],
    ] {
        let o = gturbo().args(&args).output().unwrap();
        // Exit 1, the install at fault (it was 134, SIGABRT).
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", text(&o));
        assert!(text(&o).contains(want), "{args:?}: {}", text(&o));
    }
    let o = gturbo().arg("verify-install").arg(&out).output().unwrap();
    assert_ne!(o.status.code(), Some(0), "{}", text(&o));
    assert!(
        text(&o).contains(
            "manifest.json: arch.axes.num_layers: 1000000000 is out of range (at most 1024)"
        ),
        "{}",
        text(&o)
    );
    // A manifest naming more layers than the install holds is refused at run too.
    m["arch"]["axes"]["num_layers"] = Value::from(1);
    std::fs::write(&path, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    let o = gturbo()
        .args([
            "run",
            out.to_str().unwrap(),
            "--prompt-ids",
            "1,2",
            "--max-tokens",
            "1",
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains(
            "arch.axes.num_layers (family qwen3_moe): 1, but the install holds tensors of layer 1"
        ),
        "{}",
        text(&o)
    );
}

/// Every file under `dir` and its bytes, links and all, or `None` when it is gone: what
/// a refused command must leave as it was.
fn snapshot_of(dir: &Path) -> Option<Vec<(String, Vec<u8>)>> {
    dir.exists().then(|| tree(dir))
}

/// Issue 22, defect 1: `--overwrite` used to delete whatever `--out` named. An output
/// that is, holds or lies inside the `--from` folder is refused whatever the flags, and
/// `--overwrite` replaces only a `.gturbo` install gturbo published; the source and the
/// user's files stay byte for byte.
#[test]
fn issue22_overwrite_removes_only_what_gturbo_made_and_never_the_source() {
    let tmp = temp_dir();
    let snap = qwen3_snapshot(tmp.path());
    let source = snapshot_of(&snap).unwrap();
    let canonical = std::fs::canonicalize(&snap).unwrap();
    let from = canonical.display().to_string();

    // The source folder itself, its parent, a folder inside it, and a staging
    // directory that would be the source: refused with or without --overwrite.
    let parent = tmp.path().to_path_buf();
    let before_parent = snapshot_of(&parent).unwrap();
    let inside = snap.join("m.gturbo");
    for (out, how, harm) in [
        (snap.clone(), "is", "replace the source with the install"),
        (
            parent.clone(),
            "holds",
            "remove the source with the old output",
        ),
        (inside.clone(), "lies inside", "write into the source"),
    ] {
        for extra in [&["-q"][..], &["-q", "--overwrite"][..]] {
            let o = try_install("qwen3", &snap, &out, extra);
            assert_eq!(o.status.code(), Some(2), "{}: {}", out.display(), text(&o));
            assert_eq!(
                error_line(&o),
                format!(
                    "gturbo: error: --out {} {how} the source folder --from {from}; refusing (an install there would {harm})",
                    out.display()
                ),
                "{}",
                text(&o)
            );
            assert_eq!(snapshot_of(&snap).unwrap(), source, "{}", out.display());
        }
    }
    assert!(!inside.exists());
    assert_eq!(snapshot_of(&parent).unwrap(), before_parent);
    // `--out snap.gturbo` is fine, but `--out X` whose staging directory `X.partial`
    // would be the source is not (`--discard-partial` would remove it).
    let snap_partial = tmp.path().join("src.partial");
    std::fs::rename(&snap, &snap_partial).unwrap();
    let out = tmp.path().join("src");
    let o = try_install("qwen3", &snap_partial, &out, &["-q", "--discard-partial"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        error_line(&o).starts_with(&format!(
            "gturbo: error: --out {} is the source folder --from {}",
            out.display(),
            std::fs::canonicalize(&snap_partial).unwrap().display()
        )),
        "{}",
        text(&o)
    );
    assert_eq!(snapshot_of(&snap_partial).unwrap(), source);
    std::fs::rename(&snap_partial, &snap).unwrap();

    // A folder of the user's own files: left as it is, the refusal names what is in it.
    let mine = tmp.path().join("thesis");
    std::fs::create_dir(&mine).unwrap();
    std::fs::write(mine.join("thesis.txt"), b"four years of work").unwrap();
    std::fs::create_dir(mine.join("figures")).unwrap();
    std::fs::write(mine.join("figures/fig1.png"), b"not a png").unwrap();
    let theirs = snapshot_of(&mine).unwrap();
    let o = try_install("qwen3", &snap, &mine, &["-q", "--overwrite"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        error_line(&o).starts_with(&format!(
            "gturbo: error: {}: not a .gturbo install (no manifest.json); --overwrite",
            mine.display()
        )),
        "{}",
        text(&o)
    );
    assert!(
        error_line(&o).ends_with(
            "--overwrite replaces only a .gturbo install that gturbo made, so it is left as it is (it holds 2 entries: figures/, thesis.txt)"
        ),
        "{}",
        text(&o)
    );
    assert_eq!(snapshot_of(&mine).unwrap(), theirs);
    for s in [".partial", ".partial.lock", ".partial.journal"] {
        assert!(
            !suffixed(&mine, s).exists(),
            "{s} left beside a refused output"
        );
    }

    // A published install is replaced; one that also holds a user's file is not, and
    // one whose manifest is gone (no longer recognisably gturbo's) is not either.
    let out = tmp.path().join("m.gturbo");
    let o = try_install("qwen3", &snap, &out, &["-q"]);
    assert!(o.status.success(), "{}", text(&o));
    let o = try_install("qwen3", &snap, &out, &["-q", "--overwrite"]);
    assert!(o.status.success(), "{}", text(&o));
    std::fs::write(out.join("notes.md"), b"my notes on this model").unwrap();
    let o = try_install("qwen3", &snap, &out, &["-q", "--overwrite"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        error_line(&o).starts_with(&format!(
            "gturbo: error: {}: a .gturbo install that also holds a file the manifest does not list (notes.md); --overwrite replaces only",
            out.display()
        )),
        "{}",
        text(&o)
    );
    assert_eq!(
        std::fs::read(out.join("notes.md")).unwrap(),
        b"my notes on this model"
    );
    std::fs::remove_file(out.join("notes.md")).unwrap();
    std::fs::remove_file(out.join("verified-install.json")).unwrap();
    let o = try_install("qwen3", &snap, &out, &["-q", "--overwrite"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        error_line(&o)
            .contains("not a .gturbo install that gturbo published (no verified-install.json)"),
        "{}",
        text(&o)
    );
    assert!(out.join("manifest.json").exists());
    // An empty folder holds nothing to lose: replaced.
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let o = try_install("qwen3", &snap, &empty, &["-q", "--overwrite"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(empty.join("manifest.json").exists());
    assert_eq!(snapshot_of(&snap).unwrap(), source);
}
