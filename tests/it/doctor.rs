//! `gturbo doctor` (issue 12 point 4): the checks and their JSON for a sound install,
//! a broken manifest, a damaged layout, a family short of disk and memory (figures
//! injected with GTURBO_TEST_FREE_DISK_BYTES and GTURBO_TEST_RAM_BYTES), and a family
//! that cannot be planned offline.

use std::path::Path;
use std::process::Output;

use gturbo_testkit::replica::{Qwen3MoeSpec, write_qwen3_moe};
use serde_json::Value;

use crate::support::cli::{gturbo, install, text};
use crate::support::temp_dir;

const GIB: u64 = 1 << 30;

fn doctor(args: &[&str], env: &[(&str, String)]) -> Output {
    let mut c = gturbo();
    c.arg("doctor").args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn json(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(o)))
}

/// The check `id` of a report.
fn get<'a>(v: &'a Value, id: &str) -> &'a Value {
    v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == id)
        .unwrap_or_else(|| panic!("no check {id} in {v}"))
}

/// Every check that is not ok or info says what to do next; ok ones do not.
fn next_rule_holds(v: &Value) {
    for c in v["checks"].as_array().unwrap() {
        let needs = c["status"] == "warn" || c["status"] == "fail";
        assert_eq!(c["next"].is_string(), needs, "{c}");
    }
}

fn ram(gib: u64) -> (&'static str, String) {
    ("GTURBO_TEST_RAM_BYTES", (gib * GIB).to_string())
}

/// A tiny Qwen3-MoE snapshot and its INT4 install.
fn installed(tmp: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let snap = tmp.join("snap");
    write_qwen3_moe(&snap, &Qwen3MoeSpec::tiny()).unwrap();
    let out = tmp.join("m.gturbo");
    install("qwen3_moe", &snap, &out, &[]);
    (snap, out)
}

#[test]
fn doctor_on_a_sound_install_is_all_ok() {
    let tmp = temp_dir();
    let (_, out) = installed(tmp.path());
    let dir = out.to_str().unwrap();
    let o = doctor(&[dir, "--json"], &[ram(64)]);
    assert!(o.status.success(), "{}", text(&o));
    let v = json(&o);
    assert_eq!(v["schema_version"], 1);
    assert_eq!(v["kind"], "install");
    assert_eq!(v["ok"], true);
    next_rule_holds(&v);
    for id in [
        "os", "manifest", "layout", "receipt", "runner", "memory", "auto",
    ] {
        assert_eq!(get(&v, id)["status"], "ok", "{id}: {}", get(&v, id));
    }
    assert_eq!(get(&v, "manifest")["facts"]["family"], "qwen3_moe");
    assert_eq!(get(&v, "manifest")["facts"]["scheme"], "int4_g64");
    assert_eq!(
        get(&v, "layout")["facts"]["failures"],
        serde_json::json!([])
    );
    assert_eq!(get(&v, "receipt")["facts"]["vouches"], true);
    assert_eq!(get(&v, "ram")["facts"]["bytes"], 64 * GIB);
    assert_eq!(get(&v, "ram")["facts"]["source"], "GTURBO_TEST_RAM_BYTES");
    assert_eq!(get(&v, "auto")["facts"]["profile"], "int4");
    assert_eq!(get(&v, "quality")["status"], "info");
    assert_eq!(get(&v, "quality")["facts"]["recorded"], false);
    let kernels = get(&v, "cpu")["facts"]["kernels"].as_str().unwrap();
    assert!(kernels == "cpu-avx2" || kernels == "cpu", "{kernels}");
    // The footprint is the resident file plus 2 of 8 experts per layer.
    let m: Value =
        serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    let resident = std::fs::metadata(out.join("resident.bin")).unwrap().len();
    let stride: u64 = m["expert_pools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["stride"].as_u64().unwrap() * 2)
        .sum();
    assert_eq!(
        get(&v, "memory")["facts"]["footprint_bytes"],
        resident + stride
    );
    // The text form: one line per check.
    let t = doctor(&[dir], &[ram(40)]);
    assert!(t.status.success(), "{}", text(&t));
    let s = String::from_utf8_lossy(&t.stdout);
    assert!(
        s.lines()
            .any(|l| l.starts_with("ok    manifest  qwen3_moe install")),
        "{s}"
    );
    assert!(
        s.contains("--quant auto would choose mixed-3-4: 40.0 GiB RAM is 32–47 GiB"),
        "{s}"
    );
}

#[test]
fn doctor_names_a_broken_manifest_and_a_damaged_layout() {
    let tmp = temp_dir();
    let (_, out) = installed(tmp.path());
    let dir = out.to_str().unwrap();
    // A pool file one byte short: the layout fails, the receipt no longer vouches.
    let pool = out.join("packed_experts/layer_00.bin");
    let len = std::fs::metadata(&pool).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&pool)
        .unwrap()
        .set_len(len - 1)
        .unwrap();
    let o = doctor(&[dir, "--json"], &[ram(64)]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let v = json(&o);
    assert_eq!(v["ok"], false);
    next_rule_holds(&v);
    let layout = get(&v, "layout");
    assert_eq!(layout["status"], "fail");
    assert!(
        layout["summary"]
            .as_str()
            .unwrap()
            .contains("packed_experts/layer_00.bin"),
        "{layout}"
    );
    assert!(layout["next"].as_str().unwrap().contains("verify-install"));
    assert_eq!(get(&v, "receipt")["status"], "warn");
    assert!(String::from_utf8_lossy(&o.stderr).contains("doctor: layout failed"));

    // A manifest that is not JSON.
    std::fs::write(out.join("manifest.json"), b"{not json").unwrap();
    let o = doctor(&[dir, "--json"], &[ram(64)]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let v = json(&o);
    next_rule_holds(&v);
    let m = get(&v, "manifest");
    assert_eq!(m["status"], "fail");
    assert!(
        m["summary"].as_str().unwrap().contains("manifest.json"),
        "{m}"
    );
    assert!(m["next"].as_str().unwrap().contains("--overwrite"), "{m}");
    // The machine's checks still ran.
    assert_eq!(get(&v, "os")["status"], "ok");
    let t = doctor(&[dir], &[ram(64)]);
    let s = String::from_utf8_lossy(&t.stdout);
    assert!(
        s.lines()
            .any(|l| l.starts_with("FAIL  manifest  manifest.json")),
        "{s}"
    );
    assert!(
        s.lines()
            .any(|l| l.trim_start().starts_with("-> reinstall it")),
        "{s}"
    );
}

#[test]
fn doctor_on_a_family_checks_disk_and_memory_against_its_plan() {
    let tmp = temp_dir();
    let snap = tmp.path().join("snap");
    write_qwen3_moe(&snap, &Qwen3MoeSpec::tiny()).unwrap();
    let target = tmp.path().join("here/q.gturbo");
    let args = [
        "qwen3_moe",
        "--from",
        snap.to_str().unwrap(),
        "--out",
        target.to_str().unwrap(),
        "--json",
    ];
    // Plenty of both.
    let o = doctor(
        &args,
        &[
            ram(64),
            ("GTURBO_TEST_FREE_DISK_BYTES", (10 * GIB).to_string()),
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    let v = json(&o);
    assert_eq!(v["kind"], "family");
    next_rule_holds(&v);
    let plan = get(&v, "plan");
    assert_eq!(plan["status"], "ok");
    assert_eq!(plan["facts"]["profile"], "int4");
    let total = plan["facts"]["install_bytes"].as_u64().unwrap();
    // The same bytes a dry run at int4 predicts.
    let dry = gturbo()
        .args([
            "-q",
            "install",
            "--family",
            "qwen3_moe",
            "x/y",
            "--dry-run",
            "--json",
            "--from",
        ])
        .arg(&snap)
        .output()
        .unwrap();
    let dry: Value = serde_json::from_slice(&dry.stdout).unwrap();
    assert_eq!(dry["outputs"]["total"].as_u64(), Some(total));
    let disk = get(&v, "disk");
    assert_eq!(disk["status"], "ok");
    // Measured at the nearest folder that exists; the install's reserve is 64 MiB here.
    assert_eq!(disk["facts"]["path"], tmp.path().display().to_string());
    assert_eq!(disk["facts"]["needed_bytes"], total + (64 << 20));
    assert_eq!(get(&v, "runner")["status"], "ok");
    assert_eq!(get(&v, "auto")["facts"]["profile"], "int4");

    // Too little disk and too little RAM.
    let o = doctor(
        &args,
        &[
            ("GTURBO_TEST_RAM_BYTES", "1000".into()),
            ("GTURBO_TEST_FREE_DISK_BYTES", "1000".into()),
        ],
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let v = json(&o);
    next_rule_holds(&v);
    let disk = get(&v, "disk");
    assert_eq!(disk["status"], "fail", "{disk}");
    assert_eq!(disk["facts"]["free_bytes"], 1000);
    assert!(disk["next"].as_str().unwrap().contains("--out"), "{disk}");
    // Auto finds no profile that fits 1000 bytes: the plan at int4 still gives sizes.
    assert_eq!(get(&v, "plan")["status"], "ok", "{}", get(&v, "plan"));
    assert_eq!(
        get(&v, "plan")["facts"]["install_bytes"].as_u64(),
        Some(total)
    );
    assert_eq!(get(&v, "memory")["status"], "fail");
    let auto = get(&v, "auto");
    assert_eq!(auto["status"], "fail", "{auto}");
    assert!(
        auto["summary"]
            .as_str()
            .unwrap()
            .contains("no profile fits"),
        "{auto}"
    );
}

#[test]
fn doctor_offline_says_the_plan_needs_the_hub_and_still_checks_the_machine() {
    let o = doctor(
        &["qwen3_moe", "--endpoint", "http://127.0.0.1:9", "--json"],
        &[ram(40)],
    );
    // Nothing failed: the plan and disk are unknown (warn), the rest stands.
    assert!(o.status.success(), "{}", text(&o));
    let v = json(&o);
    next_rule_holds(&v);
    let plan = get(&v, "plan");
    assert_eq!(plan["status"], "warn");
    assert!(
        plan["summary"]
            .as_str()
            .unwrap()
            .contains("needs the shard headers from the hub"),
        "{plan}"
    );
    assert!(
        plan["next"].as_str().unwrap().contains("--from DIR"),
        "{plan}"
    );
    assert_eq!(get(&v, "disk")["status"], "warn");
    let auto = get(&v, "auto");
    assert_eq!(auto["facts"]["profile"], "mixed-3-4");
    assert!(
        auto["summary"]
            .as_str()
            .unwrap()
            .contains("size is unknown"),
        "{auto}"
    );
    // An unknown target is a usage error.
    let o = doctor(&["no_such_family"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}
