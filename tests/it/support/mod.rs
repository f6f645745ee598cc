//! Shared test helpers: temp dirs, small snapshot fixtures, the in-process hub, and the
//! path of the built `gturbo` binary; running that binary is in [`cli`]. Generic on
//! purpose; each test module uses a subset.
#![allow(dead_code)]

pub mod cli;
pub mod toy;

use std::path::{Path, PathBuf};

use gturbo_testkit::hub::{self, Hub, HubConfig, HubRepo};

/// The `gturbo` binary built for this test run.
pub fn gturbo_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_gturbo"))
}

/// A fresh temporary directory, removed on drop.
pub fn temp_dir() -> tempfile::TempDir {
    tempfile::tempdir().expect("create a temp dir")
}

/// A folder shared by the tests of one run (installs made once and read by several
/// tests), at a fixed place under the target's temp dir: emptied when first asked for
/// in a run and left for the next run to empty, so a run never leaves one more copy
/// behind (a kept `tempdir()` leaked one into /tmp per run: statics are never dropped).
pub fn run_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("shared")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create a shared test folder");
    dir
}

/// Write `bytes` to `dir/rel`, creating parent folders.
pub fn write_file(dir: &Path, rel: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(rel);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).expect("create parent dir");
    }
    std::fs::write(&path, bytes).expect("write fixture file");
    path
}

/// `len` deterministic pseudo-random bytes (xorshift64*, seeded).
pub fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// A minimal valid safetensors file, written by hand: one F32 tensor `w` of shape [2, 2].
pub fn tiny_safetensors() -> Vec<u8> {
    let mut header =
        br#"{"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#
            .to_vec();
    // The header is padded with spaces to a multiple of 8, as writers do.
    while !header.len().is_multiple_of(8) {
        header.push(b' ');
    }
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    for v in [1.0f32, -2.0, 0.5, 3.25] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// A small snapshot: `config.json`, `model.safetensors`, a 3 MB `weights/blob.bin` and a
/// nested `nested/deeper/tokenizer.json`. Returns `(path, content)` sorted by path.
pub fn write_small_snapshot(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let files: Vec<(String, Vec<u8>)> = vec![
        (
            "config.json".into(),
            br#"{"model_type":"llama","hidden_size":4,"num_hidden_layers":1}"#.to_vec(),
        ),
        ("model.safetensors".into(), tiny_safetensors()),
        (
            "nested/deeper/tokenizer.json".into(),
            br#"{"version":"1.0","model":{"type":"BPE","vocab":{}}}"#.to_vec(),
        ),
        ("weights/blob.bin".into(), pseudo_random(3_000_000, 7)),
    ];
    for (rel, bytes) in &files {
        write_file(dir, rel, bytes);
    }
    files
}

/// Start the in-process hub serving one repo from `dir`, with `config`'s other settings.
pub async fn start_hub(repo: &str, dir: &Path, config: HubConfig) -> (Hub, HubRepo) {
    let r = HubRepo::new(repo, dir);
    let hub = hub::start(HubConfig {
        repos: vec![r.clone()],
        ..config
    })
    .await
    .expect("start the test hub");
    (hub, r)
}

/// SHA-256 of `bytes`, lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    hex::encode(sha2::Sha256::digest(bytes))
}

/// Rewrite an install's manifest as manifest version 1.0 wrote it (no `minor_version`,
/// `quantizedAtInstall`, `arch.requiredAxes`), canonical as 1.0 wrote it too.
pub fn rewrite_as_manifest_1_0(dir: &Path) -> Vec<u8> {
    let path = dir.join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let o = m.as_object_mut().unwrap();
    assert_eq!(o.remove("minor_version"), Some(serde_json::Value::from(1)));
    let q = o.remove("quantized_at_install").unwrap();
    o.insert("quantizedAtInstall".into(), q);
    let arch = o["arch"].as_object_mut().unwrap();
    let r = arch.remove("required_axes").unwrap();
    arch.insert("requiredAxes".into(), r);
    let mut bytes = serde_json::to_vec_pretty(&m).unwrap();
    bytes.push(b'\n');
    std::fs::write(&path, &bytes).unwrap();
    bytes
}

/// The scaled Qwen3.8-Flash-Next replica (six shards, random weights) in a temp dir,
/// served by the test hub: the fixture of the network tests (`hostile_net`,
/// `line_rate`).
pub struct Replica {
    /// Holds the snapshot and every output the test writes beside it.
    pub tmp: tempfile::TempDir,
    /// The snapshot folder the hub serves.
    pub dir: PathBuf,
    /// SHA-256 of its `model.safetensors.index.json` (`--index-sha256`).
    pub index_sha: String,
}

impl Replica {
    /// The repo name the hub serves the replica as.
    pub const REPO: &'static str = "Qwen/Qwen3.8-Flash-Next";

    pub fn new() -> Replica {
        let tmp = temp_dir();
        let dir = tmp.path().join("snapshot");
        gturbo_testkit::replica::write_flash_next(
            &dir,
            &gturbo_testkit::replica::FlashNextSpec::scaled(),
        )
        .unwrap();
        let index_sha =
            sha256_hex(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap());
        Replica {
            tmp,
            dir,
            index_sha,
        }
    }

    /// A path beside the snapshot, for an output.
    pub fn out(&self, name: &str) -> PathBuf {
        self.tmp.path().join(name)
    }

    /// The shard file names, sorted.
    pub fn shards(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".safetensors"))
            .collect();
        v.sort();
        v
    }

    /// Publish these SHA-256s (the hub then never hashes the files itself), so the
    /// bytes served can differ from what is published.
    pub fn publish(&self, oids: &[(String, String)]) {
        let map: serde_json::Map<String, serde_json::Value> = oids
            .iter()
            .map(|(p, h)| (p.clone(), serde_json::Value::String(h.clone())))
            .collect();
        std::fs::write(self.oids_file(), serde_json::Value::Object(map).to_string()).unwrap();
    }

    /// Where [`Replica::publish`] keeps the published hashes: outside the served folder.
    pub fn oids_file(&self) -> PathBuf {
        self.tmp.path().join("oids.json")
    }

    /// The hub serving this replica, with the published hashes if any.
    pub async fn start(&self, config: HubConfig) -> (Hub, HubRepo) {
        let mut repo = HubRepo::new(Self::REPO, &self.dir);
        let oids = self.oids_file();
        repo.oids = oids.exists().then_some(oids);
        let hub = hub::start(HubConfig {
            repos: vec![repo.clone()],
            ..config
        })
        .await
        .expect("start the test hub");
        (hub, repo)
    }

    /// Every shard with the SHA-256 of its bytes as they are now.
    pub fn true_oids(&self) -> Vec<(String, String)> {
        self.shards()
            .into_iter()
            .map(|s| {
                let h = sha256_hex(&std::fs::read(self.dir.join(&s)).unwrap());
                (s, h)
            })
            .collect()
    }

    /// Byte offset (in the file) and length of a tensor's data in `shard`.
    pub fn tensor_span(&self, shard: &str, tensor: &str) -> (usize, usize) {
        let bytes = std::fs::read(self.dir.join(shard)).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        let off = &header[tensor]["data_offsets"];
        let (a, b) = (off[0].as_u64().unwrap(), off[1].as_u64().unwrap());
        (8 + n + a as usize, (b - a) as usize)
    }
}

/// The F32 tensors of a safetensors file (a golden): name → (shape, values).
pub fn f32_safetensors(
    path: &std::path::Path,
) -> std::collections::BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: std::collections::BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let usize_of = |v: &serde_json::Value| v.as_u64().unwrap() as usize;
    header
        .into_iter()
        .filter(|(_, v)| v["dtype"] == "F32")
        .map(|(k, v)| {
            let (a, b) = (
                usize_of(&v["data_offsets"][0]),
                usize_of(&v["data_offsets"][1]),
            );
            let vals = data[a..b]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            let shape = v["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(usize_of)
                .collect();
            (k, (shape, vals))
        })
        .collect()
}
