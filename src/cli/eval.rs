//! `gturbo eval`: compare two installs of one model (say INT4 against `--quant bf16`)
//! by their next-token distributions, and optionally record the result as the quantized
//! install's quality.

use std::path::{Path, PathBuf};

use clap::Args;

use super::Failure;
use super::run::{open, text_failure, threads};
use crate::format::quality::{Quality, QualityReference};
use crate::runtime::experts::ExpertMode;
use crate::runtime::generate;
use crate::runtime::kernels::Cpu;
use crate::runtime::kernels::Ops;
use crate::runtime::load::{DEFAULT_ROW_CACHE_ROWS, Install};
use crate::runtime::models;
use crate::runtime::text::TextCodec;
use crate::verify;

/// Flags of `gturbo eval`.
#[derive(Debug, Args)]
pub struct EvalArgs {
    /// The install measured (e.g. INT4).
    pub dir_a: PathBuf,
    /// The reference install of the same model (e.g. `--quant bf16`).
    pub dir_b: PathBuf,
    /// Text file fed to both (tokenized with install A's tokenizer).
    #[arg(long)]
    pub text: PathBuf,
    /// Most tokens of the text used.
    #[arg(long, default_value_t = 512)]
    pub max_tokens: usize,
    /// Compute threads (default: all cores; at most 4 per core).
    #[arg(long, value_parser = super::parse_threads)]
    pub threads: Option<usize>,
    /// One JSON document instead of text.
    #[arg(long)]
    pub json: bool,
    /// Record the result in install A (`quality.json`, listed in its receipt).
    #[arg(long)]
    pub record: bool,
}

/// The per-position logits of `ids` under the install in `dir` on `backend`, with
/// the model its gate chose, and its vocabulary.
fn logits_of<B: Ops + 'static>(
    dir: &Path,
    ids: &[u32],
    backend: &B,
) -> Result<(Vec<f32>, usize, Install), Failure> {
    let install = open(dir, ExpertMode::Slots(64), DEFAULT_ROW_CACHE_ROWS)?;
    let (logits, vocab) = {
        let model = models::open(&install, backend)?;
        let mut s = model.session();
        (model.forward(&mut s, ids, true)?, model.vocab())
    };
    Ok((logits, vocab, install))
}

/// `gturbo eval`: mean KL(A‖B) and top-1 agreement of next-token distributions.
pub fn eval_cmd(args: EvalArgs) -> Result<(), Failure> {
    let text = std::fs::read_to_string(&args.text)
        .map_err(|e| Failure::usage(format!("{}: {e}", args.text.display())))?;
    let codec = TextCodec::load(&args.dir_a).map_err(text_failure)?;
    let mut ids = codec.encode(&text).map_err(text_failure)?;
    ids.truncate(args.max_tokens);
    if ids.len() < 2 {
        return Err(Failure::usage(format!(
            "{}: fewer than 2 tokens",
            args.text.display()
        )));
    }
    let cpu = Cpu::new(threads(args.threads));
    let (la, vocab, ia) = logits_of(&args.dir_a, &ids, &cpu)?;
    let (lb, vb, ib) = logits_of(&args.dir_b, &ids, &cpu)?;
    if vb != vocab {
        return Err(Failure::usage(format!(
            "{}: vocabulary {vb} differs from {}'s {vocab}",
            args.dir_b.display(),
            args.dir_a.display()
        )));
    }
    let logits = [la, lb];
    let a = generate::agreement(&logits[0], &logits[1], vocab);
    if args.json {
        let doc = serde_json::json!({
            "tokens": ids.len(),
            "positions": a.positions,
            "mean_kl_nats": a.mean_kl,
            "max_kl_nats": a.max_kl,
            "top1_agreement": a.top1,
        });
        println!("{}", super::json_text(&doc));
    } else {
        println!(
            "{} positions: mean KL(A||B) {:.5} nats (max {:.4}), top-1 agreement {:.1}%",
            a.positions,
            a.mean_kl,
            a.max_kl,
            100.0 * a.top1
        );
    }
    if args.record {
        let sha = |i: &Install| -> Result<String, Failure> {
            let b = std::fs::read(i.dir.join(crate::format::manifest::FILE_NAME))
                .map_err(|e| Failure::usage(format!("{}: {e}", i.dir.display())))?;
            Ok(crate::format::digest::sha256_hex(&b))
        };
        let q = Quality {
            format: crate::format::quality::FORMAT.into(),
            version: crate::format::quality::VERSION,
            manifest_sha256: sha(&ia)?,
            reference: QualityReference {
                model_id: ib.manifest.model_id.clone(),
                manifest_sha256: sha(&ib)?,
                scheme: ib.manifest.quantized_at_install.scheme.label(),
            },
            text_sha256: crate::format::digest::sha256_hex(text.as_bytes()),
            tokens: ids.len() as u64,
            positions: a.positions as u64,
            mean_kl_nats: a.mean_kl,
            max_kl_nats: a.max_kl,
            top1_agreement: a.top1,
            tool_version: env!("CARGO_PKG_VERSION").into(),
            measured_at_unix: std::time::SystemTime::now()
                .duration_since(std::time::SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        };
        // A's shared lock (taken when it was loaded) is held through the write, as
        // verify-install holds it while it replaces the receipt: an `install
        // --overwrite` of A cannot start between the measurement and its record, so
        // the result is never written into a directory being replaced.
        let dir = ia.dir.clone();
        drop(ib);
        verify::record_quality(&dir, &q).map_err(|f| Failure {
            code: 1,
            message: f.to_string(),
        })?;
        if !args.json {
            println!(
                "recorded in {}/{} (listed in the receipt)",
                dir.display(),
                crate::format::quality::FILE_NAME
            );
        }
    }
    Ok(())
}
