//! `gturbo run` and `gturbo eval`: load an install through the capability gate and
//! generate, or compare two installs' next-token distributions.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use clap::Args;

use super::Failure;
use crate::runtime::experts::ExpertMode;
use crate::runtime::generate::{self, Generation};
use crate::runtime::kernels::{Backend, Cpu};
use crate::runtime::load::{self, Install, LoadError, LoadOptions};
use crate::runtime::model::Model;

/// Flags of `gturbo run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The `.gturbo` directory.
    pub dir: PathBuf,
    /// Plain prompt text (no chat template).
    #[arg(long, conflicts_with_all = ["chat", "prompt_ids"])]
    pub prompt: Option<String>,
    /// A user message, wrapped in the install's chat template.
    #[arg(long, conflicts_with = "prompt_ids")]
    pub chat: Option<String>,
    /// System message for --chat ("" for an empty one; default: the template's own).
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// The prompt as token ids, comma-separated (bypasses the tokenizer).
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub prompt_ids: Option<Vec<u32>>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Sample among the K most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Sample within the smallest set of tokens whose probability reaches P (1: all).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Routed-expert blobs kept in memory (an LRU cache filled by reads).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub expert_cache_slots: u64,
    /// Map every expert pool instead of caching blobs.
    #[arg(long, conflicts_with = "expert_cache_slots")]
    pub resident_experts: bool,
    /// Compute threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Print one JSON document (token ids, text, figures) instead of streaming text.
    #[arg(long)]
    pub json: bool,
}

impl From<LoadError> for Failure {
    fn from(e: LoadError) -> Failure {
        Failure {
            code: if e.is_refusal() { 1 } else { 2 },
            message: e.to_string(),
        }
    }
}

fn threads(t: Option<usize>) -> usize {
    t.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1)
}

fn open(dir: &Path, experts: ExpertMode) -> Result<Install, Failure> {
    Ok(load::open(dir, LoadOptions { experts })?)
}

/// `gturbo run`.
pub fn run_cmd(args: RunArgs) -> Result<(), Failure> {
    let experts = if args.resident_experts {
        ExpertMode::Resident
    } else {
        ExpertMode::Slots(args.expert_cache_slots as usize)
    };
    let install = open(&args.dir, experts)?;
    let backend = Cpu::new(threads(args.threads));
    let model = Model::new(&install, &backend)?;
    let (prompt, stop_ids): (Vec<u32>, Vec<u32>) =
        match (&args.prompt_ids, &args.prompt, &args.chat) {
            (Some(ids), _, _) => (ids.clone(), Vec::new()),
            (None, None, None) => {
                return Err(Failure::usage("give --prompt, --chat or --prompt-ids"));
            }
            _ => {
                return Err(Failure::usage(
                    "text prompts need the tokenizer, which is not wired in yet; use --prompt-ids",
                ));
            }
        };
    if args.temperature != 0.0 {
        return Err(Failure::usage(
            "only greedy decoding (--temperature 0) is wired in yet",
        ));
    }
    let mut out = std::io::stdout().lock();
    let json = args.json;
    let g = generate::generate(
        &model,
        &prompt,
        args.max_tokens,
        &stop_ids,
        generate::argmax,
        |t| {
            if !json {
                let _ = write!(out, "{t} ");
                let _ = out.flush();
            }
        },
    )?;
    if !json {
        let _ = writeln!(out);
    }
    footer(&install, &backend, &g, json, &prompt, &mut out);
    Ok(())
}

fn footer(
    install: &Install,
    backend: &dyn Backend,
    g: &Generation,
    json: bool,
    prompt: &[u32],
    out: &mut impl std::io::Write,
) {
    let stats = install.experts.stats();
    let rss = generate::peak_rss_bytes();
    let hit = stats.hit_rate();
    eprintln!(
        "[{} via {} on {}] stop: {}; prompt {} tokens, generated {}; prefill {:.1} tok/s, decode {:.1} tok/s; peak RSS {}; expert cache {}",
        install.manifest.family,
        install.runner.name,
        backend.name(),
        g.stop.label(),
        g.prompt_tokens,
        g.tokens.len(),
        g.prefill_tok_s(),
        g.decode_tok_s(),
        rss.map_or("n/a".into(), |b| format!(
            "{:.1} MiB",
            b as f64 / (1 << 20) as f64
        )),
        match hit {
            Some(r) => format!(
                "{:.1}% hits ({} hits, {} misses)",
                100.0 * r,
                stats.hits,
                stats.misses
            ),
            None => "unused".into(),
        }
    );
    if json {
        let doc = serde_json::json!({
            "family": install.manifest.family,
            "runner": install.runner.name,
            "prompt_ids": prompt,
            "tokens": g.tokens,
            "stop": g.stop.label(),
            "prompt_tokens": g.prompt_tokens,
            "generated_tokens": g.tokens.len(),
            "prefill_tok_s": g.prefill_tok_s(),
            "decode_tok_s": g.decode_tok_s(),
            "peak_rss_bytes": rss,
            "resident_bytes": install.resident_bytes,
            "expert_slot_bytes": install.experts.slot_bytes(),
            "expert_cache": { "hits": stats.hits, "misses": stats.misses, "hit_rate": hit },
        });
        let _ = writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(&doc).unwrap_or_default()
        );
    }
}
