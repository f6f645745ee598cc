//! `quality.json`: a measured quality result of an install against a reference install
//! of the same model, written by `gturbo eval --record` and covered by the receipt.
//!
//! The file names the manifest it measured (`manifest_sha256`) and the reference's
//! manifest, and holds the figures `gturbo eval` prints: mean and largest KL(A‖B) of
//! the next-token distributions in nats and the top-1 agreement over the positions of
//! a text (whose SHA-256 it records). The receipt lists it (`quality`: path, bytes,
//! SHA-256), so a quality file that was edited, copied from another install, or left
//! behind by a rebuilt install is refused by `verify-install` and ignored by `run`
//! (FORMAT.md, "quality.json").

use serde::{Deserialize, Serialize};

/// File name inside the `.gturbo` directory.
pub const FILE_NAME: &str = "quality.json";
/// Always `gturbo-quality`.
pub const FORMAT: &str = "gturbo-quality";
/// Current version.
pub const VERSION: u32 = 1;
/// Largest `quality.json` a reader accepts.
pub const MAX_BYTES: u64 = 64 * 1024;

/// The reference a quality result was measured against.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QualityReference {
    /// The reference install's model id.
    pub model_id: String,
    /// SHA-256 of the reference's `manifest.json`.
    pub manifest_sha256: String,
    /// The reference's default scheme (`passthrough` for a `--quant bf16` install).
    pub scheme: String,
}

/// A recorded quality result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quality {
    /// Always [`FORMAT`].
    pub format: String,
    /// [`VERSION`].
    pub version: u32,
    /// SHA-256 of the measured install's `manifest.json`.
    pub manifest_sha256: String,
    /// What it was measured against.
    pub reference: QualityReference,
    /// SHA-256 of the text fed to both.
    pub text_sha256: String,
    /// Tokens of the text used.
    pub tokens: u64,
    /// Positions compared.
    pub positions: u64,
    /// Mean KL(install ‖ reference) in nats.
    pub mean_kl_nats: f64,
    /// Largest KL at one position.
    pub max_kl_nats: f64,
    /// Share of positions whose argmax agrees.
    pub top1_agreement: f64,
    /// Tool version that measured it.
    pub tool_version: String,
    /// When, as seconds since the Unix epoch.
    pub measured_at_unix: u64,
}

impl Quality {
    /// Canonical bytes (sorted keys, two-space indent, trailing newline).
    pub fn to_canonical_bytes(&self) -> Vec<u8> {
        super::json::to_pretty(self)
            .expect("a Quality always serializes: derived impls over strings and numbers")
    }

    /// Parse and check the format fields and that the figures are finite and in range.
    pub fn parse(bytes: &[u8]) -> Result<Quality, String> {
        let q: Quality = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        if q.format != FORMAT || q.version != VERSION {
            return Err(format!(
                "format {:?} version {}; expected {FORMAT:?} version {VERSION}",
                q.format, q.version
            ));
        }
        let ok = |v: f64| v.is_finite() && v >= 0.0;
        if !ok(q.mean_kl_nats) || !ok(q.max_kl_nats) || !(0.0..=1.0).contains(&q.top1_agreement) {
            return Err("figures out of range (KL ≥ 0, top-1 in [0, 1])".into());
        }
        Ok(q)
    }

    /// One line for the run footer.
    pub fn summary(&self) -> String {
        format!(
            "mean KL {:.4} nats (max {:.3}), top-1 {:.1}% vs {} ({}) over {} positions",
            self.mean_kl_nats,
            self.max_kl_nats,
            100.0 * self.top1_agreement,
            self.reference.model_id,
            self.reference.scheme,
            self.positions
        )
    }
}
