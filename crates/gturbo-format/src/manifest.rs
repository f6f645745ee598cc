//! `manifest.json`: the last file an install writes, the first one verify and run read.
//!
//! Canonical JSON (sorted keys, two-space indent). It names every file with its size
//! and SHA-256, the source pins, the architecture axes a runner must support, the pool
//! geometry and what quantization was applied.
//!
//! # Keys and versions
//! Every key is snake_case, as in the resident index, the receipt, the plan and the
//! family files. Version 1.0 (a manifest without `minor_version`) spelled two keys in
//! camelCase, `quantizedAtInstall` and `arch.requiredAxes`; version 1.1 renamed them
//! and changed nothing else. A reader of 1.1 reads both: each version must use its own
//! spelling ([`Manifest::parse`] refuses a mix), and the parsed [`Manifest`] is the
//! same.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::pools::{ExpertPool, RowPool};
use super::{LayoutError, Scheme};

/// Format tag.
pub const FORMAT: &str = "gturbo";
/// Current manifest version.
pub const VERSION: u32 = 1;
/// Current minor version: `1` since every key is snake_case (1.1). A manifest without
/// `minor_version` is 1.0.
pub const MINOR_VERSION: u32 = 1;
/// The version-1.0 spellings of the keys 1.1 renamed: (1.0 key, 1.1 key), the nested
/// one as a dotted path.
pub const RENAMED_IN_1_1: [(&str, &str); 2] = [
    ("quantizedAtInstall", "quantized_at_install"),
    ("arch.requiredAxes", "arch.required_axes"),
];
/// File name inside the `.gturbo` directory.
pub const FILE_NAME: &str = "manifest.json";
/// Largest manifest a reader accepts.
pub const MAX_MANIFEST_BYTES: u64 = 64 << 20;

/// The manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Always `gturbo`.
    pub format: String,
    /// Manifest version.
    pub version: u32,
    /// Minor version; 0 (the key absent) for a version 1.0 manifest.
    #[serde(default)]
    pub minor_version: u32,
    /// Family id.
    pub family: String,
    /// Model id (`org/name`).
    pub model_id: String,
    /// Where the weights came from.
    pub source: ManifestSource,
    /// Architecture axes.
    pub arch: ManifestArch,
    /// Fingerprint of the plan that produced this install.
    pub plan_fingerprint: String,
    /// Quantization applied at install time.
    #[serde(alias = "quantizedAtInstall")]
    pub quantized_at_install: QuantizedAtInstall,
    /// Every file except the manifest and the receipt, sorted by path.
    pub files: Vec<ManifestFile>,
    /// The resident weights file.
    pub resident: ManifestResident,
    /// Expert pools.
    pub expert_pools: Vec<ExpertPool>,
    /// Row pools.
    pub row_pools: Vec<RowPool>,
    /// Sidecar name → `carried` or `skipped`.
    pub sidecars: BTreeMap<String, String>,
    /// Source tensors not installed.
    pub excluded_tensors: u64,
    /// Tool that wrote the install.
    pub tool: ManifestTool,
}

/// Source pins.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestSource {
    /// `org/name`.
    pub repo: String,
    /// Revision asked for.
    pub revision: String,
    /// Resolved commit.
    pub commit: Option<String>,
    /// SHA-256 of the index.
    pub index_sha256: Option<String>,
}

/// Architecture.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestArch {
    /// `model_type`.
    pub model_type: String,
    /// Axis values from the config.
    pub axes: BTreeMap<String, serde_json::Value>,
    /// Capabilities a runner must implement.
    #[serde(alias = "requiredAxes")]
    pub required_axes: Vec<String>,
}

/// Quantization record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuantizedAtInstall {
    /// Default scheme (`int4_g64`), or `passthrough` for a `--quant bf16` install.
    pub scheme: Scheme,
    /// Bits of the default scheme (0 for passthrough).
    pub bits: u32,
    /// Group size.
    pub group_size: u32,
    /// Pattern → scheme overrides applied.
    pub overrides: Vec<(String, Scheme)>,
    /// The parity reference the quantizer is held to.
    pub parity_gate: String,
    /// Measured quality gate (mean KL vs a reference install), when run.
    pub quality_gate: Option<serde_json::Value>,
}

/// One file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestFile {
    /// Path inside the directory, `/`-separated.
    pub path: String,
    /// Size in bytes.
    pub bytes: u64,
    /// SHA-256, lowercase hex.
    pub sha256: String,
    /// `resident`, `experts`, `rows`, `tokenizer`.
    pub kind: String,
}

/// Resident file summary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestResident {
    /// Path.
    pub file: String,
    /// Payload start.
    pub payload_start: u64,
    /// Entries.
    pub entries: u64,
}

/// Tool identity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestTool {
    /// `gturbo`.
    pub name: String,
    /// Crate version.
    pub version: String,
}

impl Manifest {
    /// Parse manifest bytes: at most [`MAX_MANIFEST_BYTES`], JSON with known keys only
    /// (serde_json's nesting limit stops hostile depth), the `gturbo` format at
    /// [`VERSION`]. Consistency of the numbers is checked separately (the pools'
    /// `layout_errors`, and verify-install's checks against the disk).
    pub fn parse(bytes: &[u8]) -> Result<Manifest, LayoutError> {
        if bytes.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(LayoutError::new(
                "size",
                format!(
                    "{} bytes; a manifest may have at most {MAX_MANIFEST_BYTES}",
                    bytes.len()
                ),
            ));
        }
        // Read the tag and version first, so a newer manifest says so instead of
        // failing on a key this version does not know.
        #[derive(Deserialize)]
        struct Tag {
            format: Option<serde_json::Value>,
            version: Option<serde_json::Value>,
            minor_version: Option<serde_json::Value>,
            #[serde(rename = "quantizedAtInstall")]
            quantized_camel: Option<serde::de::IgnoredAny>,
            quantized_at_install: Option<serde::de::IgnoredAny>,
            arch: Option<serde_json::Value>,
        }
        if let Ok(tag) = serde_json::from_slice::<Tag>(bytes) {
            if tag.format.as_ref().and_then(|v| v.as_str()) != Some(FORMAT) {
                return Err(LayoutError::new(
                    "format",
                    format!("{:?}; expected {FORMAT:?}", tag.format),
                ));
            }
            if tag.version.as_ref().and_then(|v| v.as_u64()) != Some(VERSION as u64) {
                return Err(LayoutError::new(
                    "version",
                    format!(
                        "{}; this gturbo reads version {VERSION}",
                        tag.version.map_or("missing".to_string(), |v| v.to_string())
                    ),
                ));
            }
            let minor = match &tag.minor_version {
                None => 0,
                Some(v) => match v.as_u64() {
                    Some(m) if m <= MINOR_VERSION as u64 => m,
                    _ => {
                        return Err(LayoutError::new(
                            "minor_version",
                            format!(
                                "{v}; this gturbo reads version {VERSION}.0 to {VERSION}.{MINOR_VERSION}"
                            ),
                        ));
                    }
                },
            };
            // Each version uses its own spelling of the renamed keys.
            let arch_has = |k: &str| tag.arch.as_ref().is_some_and(|a| a.get(k).is_some());
            let (camel, snake) = (arch_has("requiredAxes"), arch_has("required_axes"));
            let present = [
                (
                    tag.quantized_camel.is_some(),
                    tag.quantized_at_install.is_some(),
                ),
                (camel, snake),
            ];
            for ((old, new), (has_old, has_new)) in RENAMED_IN_1_1.iter().zip(present) {
                if minor == 0 && has_new {
                    return Err(LayoutError::new(
                        *new,
                        format!(
                            "a version {VERSION}.0 manifest (no minor_version) names this key {old}; \
                             {new} is the version {VERSION}.1 spelling"
                        ),
                    ));
                }
                if minor >= 1 && has_old {
                    return Err(LayoutError::new(
                        *old,
                        format!(
                            "the version {VERSION}.0 spelling; a version {VERSION}.{minor} manifest names this key {new}"
                        ),
                    ));
                }
            }
        }
        serde_json::from_slice(bytes).map_err(|e| {
            LayoutError::new(
                format!("line {} column {}", e.line(), e.column()),
                format!("not a valid manifest: {e}"),
            )
        })
    }

    /// Canonical bytes ([`super::json::to_pretty`]: sorted keys, two-space indent,
    /// trailing newline).
    pub fn to_canonical_bytes(&self) -> Vec<u8> {
        super::json::to_pretty(self).expect(
            "a Manifest always serializes: derived impls over strings, integers, \
             string-keyed maps and serde_json::Values",
        )
    }

    /// The key of the quantization record as this manifest's version spells it, for
    /// messages about it.
    pub fn quantized_at_install_key(&self) -> &'static str {
        if self.minor_version == 0 {
            RENAMED_IN_1_1[0].0
        } else {
            RENAMED_IN_1_1[0].1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_manifest_bytes_are_refused_cleanly() {
        let e = Manifest::parse(br#"{"format":"gturbo","version":2}"#).unwrap_err();
        assert_eq!(e.to_string(), "version: 2; this gturbo reads version 1");
        let e = Manifest::parse(br#"{"format":"safetensors","version":1}"#).unwrap_err();
        assert_eq!(e.field, "format");
        let e = Manifest::parse(br#"{"format":"gturbo","version":1}"#).unwrap_err();
        assert!(e.detail.contains("missing field"), "{e}");
        // 100,000 levels of nesting inside a free-form value: serde_json's recursion
        // limit answers, the stack does not overflow.
        let deep = format!(
            r#"{{"format":"gturbo","version":1,"arch":{{"axes":{{"x":{}}}}}}}"#,
            "[".repeat(100_000)
        );
        let e = Manifest::parse(deep.as_bytes()).unwrap_err();
        assert!(e.detail.contains("recursion limit exceeded"), "{e}");
        let big = vec![b' '; (MAX_MANIFEST_BYTES + 1) as usize];
        assert_eq!(Manifest::parse(&big).unwrap_err().field, "size");
        assert!(Manifest::parse(b"\xff\xfe").is_err());
    }

    /// The seed manifest of the fuzz script: a consistent version 1.1 manifest.
    fn seed() -> String {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../scripts/fuzz.sh"
        ))
        .unwrap();
        let start = text.find("<<'JSON'\n").unwrap() + 8;
        let end = text[start..].find("\nJSON\n").unwrap() + start;
        text[start..end].to_string()
    }

    /// The same manifest as version 1.0 wrote it: no minor_version, two camelCase keys.
    fn as_1_0(v1_1: &str) -> String {
        let mut v: serde_json::Value = serde_json::from_str(v1_1).unwrap();
        let o = v.as_object_mut().unwrap();
        o.remove("minor_version").unwrap();
        let q = o.remove("quantized_at_install").unwrap();
        o.insert("quantizedAtInstall".into(), q);
        let arch = o["arch"].as_object_mut().unwrap();
        let r = arch.remove("required_axes").unwrap();
        arch.insert("requiredAxes".into(), r);
        serde_json::to_string(&v).unwrap()
    }

    #[test]
    fn every_key_is_written_in_snake_case_with_the_minor_version() {
        let m = Manifest::parse(seed().as_bytes()).unwrap();
        assert_eq!(m.minor_version, MINOR_VERSION);
        let text = String::from_utf8(m.to_canonical_bytes()).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["minor_version"], 1);
        assert!(v["quantized_at_install"].is_object());
        assert!(v["arch"]["required_axes"].is_array());
        fn keys(v: &serde_json::Value, out: &mut Vec<String>) {
            match v {
                serde_json::Value::Object(o) => {
                    for (k, x) in o {
                        out.push(k.clone());
                        keys(x, out);
                    }
                }
                serde_json::Value::Array(a) => a.iter().for_each(|x| keys(x, out)),
                _ => {}
            }
        }
        let mut all = Vec::new();
        // `arch.axes` and `sidecars` hold names from elsewhere (config.json, the
        // family), not manifest keys.
        let mut shell = v.clone();
        shell["arch"]["axes"] = serde_json::json!({});
        shell["sidecars"] = serde_json::json!({});
        keys(&shell, &mut all);
        assert!(
            all.iter().all(|k| k
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')),
            "{all:?}"
        );
        assert!(text.ends_with("}\n") && text.starts_with("{\n  \"arch\": {"));
    }

    /// Installs written before 1.1 are read as they are, into the same manifest.
    #[test]
    fn a_version_1_0_manifest_reads_into_the_same_manifest() {
        let new = Manifest::parse(seed().as_bytes()).unwrap();
        let old = Manifest::parse(as_1_0(&seed()).as_bytes()).unwrap();
        assert_eq!(old.minor_version, 0);
        assert_eq!(
            Manifest {
                minor_version: MINOR_VERSION,
                ..old.clone()
            },
            new
        );
        assert_eq!(old.quantized_at_install_key(), "quantizedAtInstall");
        assert_eq!(new.quantized_at_install_key(), "quantized_at_install");
    }

    #[test]
    fn each_version_must_use_its_own_spelling() {
        // 1.1 with a 1.0 key.
        let mixed = seed().replace("\"required_axes\"", "\"requiredAxes\"");
        let e = Manifest::parse(mixed.as_bytes()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "arch.requiredAxes: the version 1.0 spelling; a version 1.1 manifest names this key arch.required_axes"
        );
        // 1.0 with a 1.1 key.
        let mixed = as_1_0(&seed()).replace("\"quantizedAtInstall\"", "\"quantized_at_install\"");
        let e = Manifest::parse(mixed.as_bytes()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "quantized_at_install: a version 1.0 manifest (no minor_version) names this key quantizedAtInstall; quantized_at_install is the version 1.1 spelling"
        );
        // A newer minor version.
        let newer = seed().replace("\"minor_version\":1", "\"minor_version\":2");
        let e = Manifest::parse(newer.as_bytes()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "minor_version: 2; this gturbo reads version 1.0 to 1.1"
        );
        let odd = seed().replace("\"minor_version\":1", "\"minor_version\":\"1\"");
        assert_eq!(
            Manifest::parse(odd.as_bytes()).unwrap_err().field,
            "minor_version"
        );
    }
}
