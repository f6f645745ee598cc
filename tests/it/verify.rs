//! `gturbo verify-install` through the real binary on a real install of the scaled
//! Flash-Next replica (resident file, expert pools with an MTP sidecar pool, a row
//! pool, tokenizer files): the pristine install passes and gets a fresh receipt; every
//! kind of damage and every hostile manifest is caught with a message naming the file
//! and the field or offset, exit code 1, and no panic.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::OnceLock;

use gturbo_testkit::replica::{self, FlashNextSpec};
use serde_json::Value;

use crate::support::cli::{gturbo, streams};
use crate::support::{rewrite_as_manifest_1_0, sha256_hex};

/// One pristine install per test run, copied by each test that damages it.
fn pristine() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("verify-pristine");
        let _ = std::fs::remove_dir_all(&root);
        let snap = root.join("snapshot");
        replica::write_flash_next(&snap, &FlashNextSpec::scaled()).unwrap();
        let index_sha =
            sha256_hex(&std::fs::read(snap.join("model.safetensors.index.json")).unwrap());
        let out = root.join("pristine.gturbo");
        let o = gturbo()
            .args(["-qq", "install", "qwen38flashnext", "--from"])
            .arg(&snap)
            .args(["--index-sha256", &index_sha, "--out"])
            .arg(&out)
            .output()
            .unwrap();
        assert!(o.status.success(), "install: {}", streams(&o));
        out
    })
}

/// A private copy of the pristine install (and a sibling directory for files that
/// must stay outside it).
struct Copy {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    outside: PathBuf,
}

fn copy() -> Copy {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m.gturbo");
    copy_tree(pristine(), &dir);
    let outside = tmp.path().join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    Copy {
        _tmp: tmp,
        dir,
        outside,
    }
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}

fn verify(dir: &Path, extra: &[&str]) -> Output {
    gturbo()
        .arg("verify-install")
        .arg(dir)
        .args(extra)
        .env("GTURBO_NO_PROGRESS", "1")
        .output()
        .unwrap()
}

/// Runs verify on a damaged copy: exit 1, no panic, and every expected line appears
/// among the failure lines.
fn assert_caught(dir: &Path, expected: &[&str]) -> String {
    let o = verify(dir, &[]);
    let out = streams(&o);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(!out.contains("panicked"), "{out}");
    assert!(out.contains("check") && out.contains("failed"), "{out}");
    for e in expected {
        assert!(
            out.lines().any(|l| l.contains(e)),
            "expected a line containing {e:?} in:\n{out}"
        );
    }
    out
}

fn flip(path: &Path, offset: u64) {
    let mut b = std::fs::read(path).unwrap();
    b[offset as usize] ^= 0x01;
    std::fs::write(path, b).unwrap();
}

fn manifest(dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap()
}

fn write_manifest(dir: &Path, m: &Value) {
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_vec_pretty(m).unwrap(),
    )
    .unwrap();
}

/// Edit the manifest and drop the receipt, so only the layout checks can catch it
/// (with the receipt, its manifest hash catches any edit too).
fn edit_manifest(dir: &Path, f: impl FnOnce(&mut Value)) {
    let mut m = manifest(dir);
    f(&mut m);
    write_manifest(dir, &m);
    std::fs::remove_file(dir.join("verified-install.json")).unwrap();
}

/// Rewrite resident.bin's JSON index in place (the payload start must not move).
fn edit_resident_index(dir: &Path, f: impl FnOnce(&mut Value)) {
    let path = dir.join("resident.bin");
    let mut b = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(b[8..16].try_into().unwrap()) as usize;
    let mut index: Value = serde_json::from_slice(&b[16..16 + n]).unwrap();
    f(&mut index);
    let json = serde_json::to_vec(&index).unwrap();
    let payload_start = manifest(dir)["resident"]["payload_start"].as_u64().unwrap() as usize;
    assert!(
        16 + json.len() <= payload_start,
        "edited index must fit the head"
    );
    b[8..16].copy_from_slice(&(json.len() as u64).to_le_bytes());
    b[16..payload_start].fill(0);
    b[16..16 + json.len()].copy_from_slice(&json);
    std::fs::write(&path, b).unwrap();
}

/// An install written before manifest 1.1 (camelCase keys, no `minor_version`, and a
/// receipt naming that manifest) verifies as it is: the receipt is rewritten with its
/// provenance, the manifest is left alone. A manifest mixing the spellings is refused.
#[test]
fn an_install_written_before_manifest_1_1_still_verifies() {
    let c = copy();
    let old = rewrite_as_manifest_1_0(&c.dir);
    let rpath = c.dir.join("verified-install.json");
    let mut r: Value = serde_json::from_slice(&std::fs::read(&rpath).unwrap()).unwrap();
    r["manifest_sha256"] = sha256_hex(&old).into();
    std::fs::write(&rpath, serde_json::to_vec_pretty(&r).unwrap()).unwrap();
    let o = verify(&c.dir, &["--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", streams(&o));
    let report: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["receipt"], "rewritten", "{report}");
    assert_eq!(std::fs::read(c.dir.join("manifest.json")).unwrap(), old);

    let c = copy();
    edit_manifest(&c.dir, |m| {
        let q = m
            .as_object_mut()
            .unwrap()
            .remove("quantized_at_install")
            .unwrap();
        m["quantizedAtInstall"] = q;
    });
    assert_caught(
        &c.dir,
        &[
            "manifest.json: quantizedAtInstall: the version 1.0 spelling; a version 1.1 manifest names this key quantized_at_install",
        ],
    );
}

#[test]
fn pristine_install_verifies_and_rewrites_the_receipt() {
    let c = copy();
    let m = manifest(&c.dir);
    let o = verify(&c.dir, &[]);
    let out = streams(&o);
    assert_eq!(o.status.code(), Some(0), "{out}");
    let files = m["files"].as_array().unwrap();
    let bytes: u64 = files
        .iter()
        .map(|f| f["bytes"].as_u64().unwrap())
        .sum::<u64>()
        + std::fs::metadata(c.dir.join("manifest.json"))
            .unwrap()
            .len();
    let stdout = String::from_utf8_lossy(&o.stdout);
    let summary = format!("verified {} files, {bytes} bytes, in ", files.len() + 1);
    assert!(stdout.starts_with(&summary), "{stdout}");
    assert!(stdout.trim_end().ends_with(" MB/s)"), "{stdout}");

    // The receipt now says verify-install proved it, with the hashes of the disk and
    // the provenance carried forward from the install's matching receipt.
    let r: Value =
        serde_json::from_slice(&std::fs::read(c.dir.join("verified-install.json")).unwrap())
            .unwrap();
    assert_eq!(r["verified_by"], "verify-install");
    assert_eq!(r["source_repo"], m["source"]["repo"]);
    assert_eq!(
        r["manifest_sha256"],
        sha256_hex(&std::fs::read(c.dir.join("manifest.json")).unwrap())
    );
    assert_eq!(r["files"].as_array().unwrap().len(), files.len());
    for (rf, mf) in r["files"].as_array().unwrap().iter().zip(files) {
        assert_eq!(rf["path"], mf["path"]);
        assert_eq!(
            rf["sha256"].as_str().unwrap(),
            sha256_hex(&std::fs::read(c.dir.join(mf["path"].as_str().unwrap())).unwrap())
        );
    }
    assert!(
        !std::fs::read_dir(&c.dir).unwrap().any(|e| e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .contains(".tmp")),
        "no temporary receipt left behind"
    );

    // Without a previous receipt the provenance is not carried forward.
    std::fs::remove_file(c.dir.join("verified-install.json")).unwrap();
    let o = verify(&c.dir, &["--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", streams(&o));
    let j: Value = serde_json::from_slice(&o.stdout).expect("--json prints one JSON object");
    assert_eq!(j["ok"], true);
    assert_eq!(j["failures"], Value::Array(vec![]));
    assert_eq!(j["files"], files.len() as u64 + 1);
    assert_eq!(j["bytes"], bytes);
    assert_eq!(j["receipt"], "rewritten_without_provenance");
    let r: Value =
        serde_json::from_slice(&std::fs::read(c.dir.join("verified-install.json")).unwrap())
            .unwrap();
    assert_eq!(r["source_repo"], "");
    assert_eq!(r["source_commit"], Value::Null);
}

#[test]
fn a_flipped_byte_in_each_file_kind_is_caught_by_name() {
    let payload_start = manifest(pristine())["resident"]["payload_start"]
        .as_u64()
        .unwrap();
    for (file, offset) in [
        ("resident.bin", payload_start + 100),
        ("packed_experts/layer_01.bin", 1000),
        ("packed_experts/mtp_layer_00.bin", 70_000),
        ("ple/layer_01_ngram_rows.bin", 500_000),
        ("tokenizer/tokenizer_config.json", 20),
    ] {
        let c = copy();
        flip(&c.dir.join(file), offset);
        let receipt_before = std::fs::read(c.dir.join("verified-install.json")).unwrap();
        let out = assert_caught(&c.dir, &[&format!("{file}: sha256: ")]);
        assert_eq!(out.matches(": sha256: ").count(), 1, "{out}");
        assert_eq!(
            std::fs::read(c.dir.join("verified-install.json")).unwrap(),
            receipt_before,
            "a failed verify leaves the receipt alone"
        );
    }
}

#[test]
fn a_flipped_byte_in_the_manifest_disagrees_with_the_receipt() {
    let c = copy();
    let path = c.dir.join("manifest.json");
    let bytes = std::fs::read(&path).unwrap();
    // Inside the model id: still valid JSON, consistent numbers.
    let at = bytes
        .windows(10)
        .position(|w| w == b"\"model_id\"")
        .unwrap()
        + 14;
    flip(&path, at as u64);
    assert_caught(
        &c.dir,
        &[
            "manifest.json: sha256: ",
            "(the manifest changed after it was verified)",
        ],
    );
}

#[test]
fn an_invalid_tokenizer_json_is_named_with_its_position() {
    let c = copy();
    let path = c.dir.join("tokenizer/tokenizer.json");
    let mut b = std::fs::read(&path).unwrap();
    b[0] = b'x';
    std::fs::write(&path, b).unwrap();
    assert_caught(
        &c.dir,
        &[
            "tokenizer/tokenizer.json: line 1 column 1: not valid JSON",
            "tokenizer/tokenizer.json: sha256: ",
        ],
    );
}

#[test]
fn truncated_appended_extra_and_missing_files_are_caught() {
    let c = copy();
    let pool = c.dir.join("packed_experts/layer_02.bin");
    let f = std::fs::OpenOptions::new().write(true).open(&pool).unwrap();
    f.set_len(524_288 - 16_384).unwrap();
    drop(f);
    let mut b = std::fs::read(c.dir.join("resident.bin")).unwrap();
    let len = b.len();
    b.push(0);
    std::fs::write(c.dir.join("resident.bin"), b).unwrap();
    std::fs::write(c.dir.join("extra.bin"), b"hello").unwrap();
    std::fs::write(c.dir.join("packed_experts/layer_09.bin"), b"").unwrap();
    std::fs::remove_file(c.dir.join("tokenizer/config.json")).unwrap();
    let out = assert_caught(
        &c.dir,
        &[
            "packed_experts/layer_02.bin: size: 507904 bytes on disk, the manifest lists 524288 (truncated)",
            &format!(
                "resident.bin: size: {} bytes on disk, the manifest lists {len} (longer)",
                len + 1
            ),
            "extra.bin: unexpected file, not listed in the manifest",
            "packed_experts/layer_09.bin: unexpected file, not listed in the manifest",
            "tokenizer/config.json: missing: listed in the manifest, not on disk",
        ],
    );
    // A file whose size is wrong is not hashed as well: one line says it.
    assert!(!out.contains("layer_02.bin: sha256"), "{out}");
}

#[test]
fn edited_manifest_numbers_are_caught_by_the_layout_checks() {
    // Stride: a page multiple, but not the blob rounded up to a page.
    let c = copy();
    edit_manifest(&c.dir, |m| m["expert_pools"][0]["stride"] = 81920.into());
    assert_caught(
        &c.dir,
        &[
            "manifest.json: expert_pools[0] (packed_experts/layer_00.bin).stride: 81920; blob_bytes 55296 rounded up to the page gives 65536",
            "manifest.json: expert_pools[0] (packed_experts/layer_00.bin).file_bytes: 524288; experts 8 × stride 81920 = 655360",
        ],
    );

    let c = copy();
    edit_manifest(&c.dir, |m| m["row_pools"][0]["rows_per_block"] = 50.into());
    assert_caught(
        &c.dir,
        &[
            "manifest.json: row_pools[0] (ple/layer_01_ngram_rows.bin).rows_per_block: 50; 16384 / row_bytes 320 gives 51",
        ],
    );

    let c = copy();
    edit_manifest(&c.dir, |m| {
        m["row_pools"][0]["shards"][1]["rows"] = 3112.into()
    });
    assert_caught(
        &c.dir,
        &[
            "manifest.json: row_pools[0] (ple/layer_01_ngram_rows.bin).shards[1].blocks: 61; 3112 rows at 51 per block need 62",
        ],
    );

    let c = copy();
    edit_manifest(&c.dir, |m| m["resident"]["payload_start"] = 49152.into());
    assert_caught(
        &c.dir,
        &["manifest.json: resident.payload_start: 49152; resident.bin's index of"],
    );

    let c = copy();
    edit_manifest(&c.dir, |m| {
        m["expert_pools"][1]["parts"][1]["offset"] = 18496.into()
    });
    assert_caught(
        &c.dir,
        &[
            "manifest.json: expert_pools[1] (packed_experts/layer_01.bin).parts[1].offset: 18496; the part must follow the previous one at 18432",
        ],
    );
}

#[test]
fn an_edited_tensor_offset_in_the_resident_index_is_caught() {
    let c = copy();
    let mut name = String::new();
    edit_resident_index(&c.dir, |ix| {
        let t = &mut ix["tensors"][1];
        name = t["name"].as_str().unwrap().to_string();
        let span = if t["data"].is_object() {
            "data"
        } else {
            "weights"
        };
        let off = t[span]["offset"].as_u64().unwrap();
        t[span]["offset"] = (off + 64).into();
    });
    assert_caught(
        &c.dir,
        &[
            &format!("resident.bin: index.tensors[1] ({name})."),
            "is not a multiple of 16384",
            "resident.bin: sha256: ",
        ],
    );

    // Overlapping entries: the second entry moved onto the first.
    let c = copy();
    edit_resident_index(&c.dir, |ix| {
        let t0 = ix["tensors"][0].clone();
        let first = if t0["data"].is_object() {
            "data"
        } else {
            "weights"
        };
        let t = &mut ix["tensors"][1];
        let span = if t["data"].is_object() {
            "data"
        } else {
            "weights"
        };
        t[span]["offset"] = t0[first]["offset"].clone();
    });
    assert_caught(
        &c.dir,
        &["resident.bin: index.tensors[", "overlaps tensors[0]"],
    );

    // Huge and negative shapes.
    let c = copy();
    edit_resident_index(&c.dir, |ix| {
        ix["tensors"][0]["shape"] = serde_json::json!([u64::MAX, u64::MAX]);
    });
    assert_caught(&c.dir, &["resident.bin: index.tensors[0] (", ").shape: "]);
    let c = copy();
    edit_resident_index(&c.dir, |ix| {
        ix["tensors"][0]["shape"] = serde_json::json!([-1, 4]);
    });
    assert_caught(
        &c.dir,
        &["resident.bin: byte 16 (index): not a valid index: invalid value: integer `-1`"],
    );
    // An index length past the end of the file.
    let c = copy();
    let path = c.dir.join("resident.bin");
    let mut b = std::fs::read(&path).unwrap();
    b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&path, b).unwrap();
    assert_caught(
        &c.dir,
        &["resident.bin: byte 8 (index length): 18446744073709551615 bytes"],
    );
}

#[test]
fn hostile_manifests_get_clear_errors_and_no_panic() {
    // Absurd sizes.
    let c = copy();
    edit_manifest(&c.dir, |m| {
        m["files"][0]["bytes"] = u64::MAX.into();
        m["expert_pools"][2]["experts"] = u64::MAX.into();
    });
    let first = manifest(&c.dir)["files"][0]["path"]
        .as_str()
        .unwrap()
        .to_string();
    assert_caught(
        &c.dir,
        &[
            &format!("{first}: size: "),
            "the manifest lists 18446744073709551615",
            "expert_pools[2] (packed_experts/layer_02.bin).file_bytes: 524288; experts 18446744073709551615 × stride 65536 = an overflow",
        ],
    );

    // A shard region past the end of the file.
    let c = copy();
    edit_manifest(&c.dir, |m| {
        m["row_pools"][0]["shards"][3]["offset"] = (u64::MAX - 10).into();
    });
    assert_caught(
        &c.dir,
        &[
            "row_pools[0] (ple/layer_01_ngram_rows.bin).shards[3]: region at 18446744073709551605 of 999424 bytes ends past file_bytes 3997696",
        ],
    );

    // Negative numbers in the manifest.
    let c = copy();
    edit_manifest(&c.dir, |m| {
        m["expert_pools"][0]["parts"][0]["rows"] = (-1).into()
    });
    assert_caught(
        &c.dir,
        &["manifest.json: line ", "invalid value: integer `-1`"],
    );

    // `..` and absolute paths: refused before any filesystem call.
    std::fs::write(c.outside.join("secret.bin"), b"secret").unwrap();
    for (path, why) in [
        ("../outside/secret.bin", "has a \"..\" component"),
        ("/etc/passwd", "is absolute"),
    ] {
        let c = copy();
        edit_manifest(&c.dir, |m| m["files"][0]["path"] = path.into());
        assert_caught(
            &c.dir,
            &[&format!("manifest.json: files[0].path: {path:?} {why}")],
        );
    }

    // Deep nesting: serde_json's recursion limit, not a stack overflow.
    let c = copy();
    let text = std::fs::read_to_string(c.dir.join("manifest.json")).unwrap();
    let deep = text.replacen(
        "\"axes\": {",
        &format!(
            "\"axes\": {{\"deep\": {}0{},",
            "[".repeat(50_000),
            "]".repeat(50_000)
        ),
        1,
    );
    std::fs::write(c.dir.join("manifest.json"), deep).unwrap();
    assert_caught(
        &c.dir,
        &["manifest.json: line ", "recursion limit exceeded"],
    );

    // A manifest over the size cap is refused before it is read.
    let c = copy();
    let f = std::fs::File::create(c.dir.join("manifest.json")).unwrap();
    f.set_len((64 << 20) + 1).unwrap();
    drop(f);
    assert_caught(
        &c.dir,
        &["manifest.json: size: 67108865 bytes; a manifest may have at most 67108864"],
    );

    // A newer format version.
    let c = copy();
    edit_manifest(&c.dir, |m| m["version"] = 2.into());
    assert_caught(
        &c.dir,
        &["manifest.json: version: 2; this gturbo reads version 1"],
    );
}

#[test]
fn symlinks_are_named_and_never_followed() {
    // A listed file replaced by a link to an identical copy outside the directory:
    // the bytes would hash right, but the link is refused.
    let c = copy();
    let cfg = c.dir.join("tokenizer/config.json");
    let outside = c.outside.join("config.json");
    std::fs::copy(&cfg, &outside).unwrap();
    std::fs::remove_file(&cfg).unwrap();
    std::os::unix::fs::symlink(&outside, &cfg).unwrap();
    assert_caught(
        &c.dir,
        &[
            "tokenizer/config.json: tokenizer/config.json is a symlink; verify-install never follows links",
        ],
    );

    // A directory on the way replaced by a link.
    let c = copy();
    let ple = c.dir.join("ple");
    let moved = c.outside.join("ple");
    std::fs::rename(&ple, &moved).unwrap();
    std::os::unix::fs::symlink(&moved, &ple).unwrap();
    assert_caught(
        &c.dir,
        &["ple/layer_01_ngram_rows.bin: ple is a symlink; verify-install never follows links"],
    );

    // The manifest itself as a link.
    let c = copy();
    let m = c.dir.join("manifest.json");
    let moved = c.outside.join("manifest.json");
    std::fs::rename(&m, &moved).unwrap();
    std::os::unix::fs::symlink(&moved, &m).unwrap();
    assert_caught(
        &c.dir,
        &["manifest.json: manifest.json is a symlink; verify-install never follows links"],
    );

    // An extra link is listed, not followed.
    let c = copy();
    std::os::unix::fs::symlink("/etc/passwd", c.dir.join("tokenizer/evil")).unwrap();
    assert_caught(
        &c.dir,
        &["tokenizer/evil: unexpected symlink (not followed), not listed in the manifest"],
    );
}

#[test]
fn the_receipt_vouches_for_sizes_only_while_it_matches() {
    let c = copy();
    assert_eq!(gturbo::verify::receipt_vouches(&c.dir), Ok(true));
    // A flipped byte keeps the sizes: trusting the receipt is the user's choice.
    flip(&c.dir.join("packed_experts/layer_00.bin"), 10);
    assert_eq!(gturbo::verify::receipt_vouches(&c.dir), Ok(true));
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(c.dir.join("packed_experts/layer_00.bin"))
        .unwrap();
    f.set_len(16384).unwrap();
    assert_eq!(gturbo::verify::receipt_vouches(&c.dir), Ok(false));

    let c = copy();
    let m = manifest(&c.dir);
    write_manifest(&c.dir, &m);
    assert_eq!(
        gturbo::verify::receipt_vouches(&c.dir),
        Ok(false),
        "reformatted manifest"
    );
    let c = copy();
    std::fs::remove_file(c.dir.join("verified-install.json")).unwrap();
    assert_eq!(gturbo::verify::receipt_vouches(&c.dir), Ok(false));
}

#[test]
fn usage_errors_exit_2() {
    let tmp = tempfile::tempdir().unwrap();
    let o = verify(&tmp.path().join("nope.gturbo"), &[]);
    assert_eq!(o.status.code(), Some(2), "{}", streams(&o));
    assert!(streams(&o).contains("nope.gturbo: not a directory"));
    let o = gturbo().arg("verify-install").output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    // An empty directory is an install with no manifest: damage, exit 1.
    let o = verify(tmp.path(), &[]);
    assert_eq!(o.status.code(), Some(1), "{}", streams(&o));
    assert!(
        streams(&o).contains("manifest.json: missing: not a .gturbo install, or an unfinished one"),
        "{}",
        streams(&o)
    );
}
