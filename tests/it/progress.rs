//! Machine progress output: `gturbo install --json` on a real install prints JSON Lines
//! on stdout (phases, the plan, byte progress, the outcome), one object per line.

use gturbo_testkit::replica::{self, FlashNextSpec};
use serde_json::Value;

use crate::support::cli::gturbo;
use crate::support::{sha256_hex, temp_dir};

#[test]
fn json_install_prints_json_lines_ending_in_done() {
    let tmp = temp_dir();
    let dir = tmp.path().join("snapshot");
    replica::write_flash_next(&dir, &FlashNextSpec::scaled()).unwrap();
    let index_sha = sha256_hex(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap());
    let out = tmp.path().join("m.gturbo");
    let o = gturbo()
        .args(["install", "qwen38flashnext", "--json", "--from"])
        .arg(&dir)
        .args(["--index-sha256", &index_sha, "--out"])
        .arg(&out)
        .env_remove("GTURBO_NO_PROGRESS")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let stdout = String::from_utf8(o.stdout).unwrap();
    let events: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    for e in &events {
        assert_eq!(e["schema_version"], 1, "{e}");
    }
    let phases: Vec<&str> = events
        .iter()
        .filter(|e| e["event"] == "phase")
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        phases,
        [
            "resolve",
            "plan",
            "resume-check",
            "stream",
            "tokenizer",
            "hash",
            "publish"
        ]
    );

    let plan = events.iter().find(|e| e["event"] == "plan").unwrap();
    let source_bytes = plan["report"]["reads"]["source_bytes"].as_u64().unwrap();
    let progress: Vec<&Value> = events.iter().filter(|e| e["event"] == "progress").collect();
    let last = progress.last().expect("at least one progress event");
    assert_eq!(last["bytes_done"].as_u64(), Some(source_bytes));
    assert_eq!(last["bytes_total"].as_u64(), Some(source_bytes));

    let done = events.last().unwrap();
    assert_eq!(done["event"], "done", "last line: {done}");
    assert_eq!(done["out"].as_str(), Some(out.to_str().unwrap()));
    assert_eq!(done["bytes_read"].as_u64(), Some(source_bytes));
    assert_eq!(done["reads_kept"], 0);
    assert_eq!(done["reads_fetched"], done["reads_total"]);
    assert!(out.join("manifest.json").is_file());
    // Nothing on stdout but the events; stderr has no progress lines in JSON mode.
    assert!(!stderr.contains("gturbo: stream:"), "{stderr}");
}
