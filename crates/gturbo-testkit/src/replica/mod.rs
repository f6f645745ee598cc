//! Fixture generators that write Hugging Face snapshot directories: safetensors
//! shards, `model.safetensors.index.json` (when sharded), `config.json`,
//! `tokenizer.json`, `tokenizer_config.json` and `generation_config.json`.
//!
//! - [`write_flash_next`] with [`FlashNextSpec::full`]: a header-only replica of
//!   Qwen3.8-Flash-Next, 131 shards whose data regions are holes (a few MB on disk,
//!   ~360 GB apparent), for dry runs and plan tests. With [`FlashNextSpec::scaled`]:
//!   the same names and structure at ~28 MB of seeded random BF16, for real installs.
//!   The points the published facts leave open (vision tower, MTP, mixers, order)
//!   are settled in the `flash_next` module's doc.
//! - [`write_qwen3_moe`], [`write_qwen3`], [`write_llama`]: small random checkpoints
//!   of the plain families.
//! - [`write_flagship`]: header-only replicas of DeepSeek-V3, Kimi-K2-Thinking,
//!   gpt-oss-120b, GLM-4.5-Air, Qwen3-Next-80B-A3B and MiniMax-M2 in their real tensor
//!   names, shapes, dtypes and shard names (the `flagships` module cites each fact).
//!
//! The safetensors files are written by hand (the private `st` module), not through
//! gturbo's parser, so the fixtures check that parser rather than mirror it. Output is
//! a pure function of the spec: same seed, same bytes. This module owns nothing the
//! installer uses at run time.

mod families;
mod flagships;
mod flash_next;
mod hf_files;
mod st;

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

pub use families::{LlamaSpec, Qwen3MoeSpec, Qwen3Spec, write_llama, write_qwen3, write_qwen3_moe};
pub use flagships::{Flagship, write_flagship, write_kimi_tokenizer};
pub use flash_next::{FlashNextSpec, VisionSpec, write_flash_next};
pub use st::{DataMode, ShardRule};

/// What a generator wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaSummary {
    /// The snapshot directory.
    pub dir: PathBuf,
    /// Weight file names in shard order (`model-00001-of-00131.safetensors`, … or
    /// `model.safetensors`).
    pub shards: Vec<String>,
    /// `model.safetensors.index.json` when there is more than one shard.
    pub index: Option<String>,
    /// Every file written, sorted by name.
    pub files: Vec<String>,
    /// Tensors over all shards.
    pub tensors: usize,
    /// Sum of tensor data bytes (the index's `metadata.total_size`).
    pub total_size: u64,
    /// Sum of the lengths of all files written (sparse files count at full length).
    pub apparent_bytes: u64,
}

impl fmt::Display for ReplicaSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} files ({} shards), {} apparent bytes, {} tensors, total_size {}",
            self.dir.display(),
            self.files.len(),
            self.shards.len(),
            self.apparent_bytes,
            self.tensors,
            self.total_size
        )
    }
}

fn finish_summary(
    dir: &Path,
    ckpt: st::CheckpointFiles,
    extra: Vec<String>,
) -> io::Result<ReplicaSummary> {
    let mut files: Vec<String> = ckpt.shards.clone();
    files.extend(ckpt.index.clone());
    files.push("config.json".into());
    files.extend(extra);
    files.sort();
    let mut apparent_bytes = 0u64;
    for name in &files {
        apparent_bytes += std::fs::metadata(dir.join(name))?.len();
    }
    Ok(ReplicaSummary {
        dir: dir.to_path_buf(),
        shards: ckpt.shards,
        index: ckpt.index,
        files,
        tensors: ckpt.tensors,
        total_size: ckpt.total_size,
        apparent_bytes,
    })
}

/// Write a Hugging Face snapshot directory and print one summary line.
#[derive(Debug, clap::Args)]
#[command(after_help = "\
Kinds:
  flash-next --full      Qwen3.8-Flash-Next, 131 header-only shards (data regions are holes)
  flash-next --scaled    the same names and structure, small, seeded random BF16 data
  qwen3-moe|qwen3|llama  tiny random checkpoints; --shards 1 writes model.safetensors, no index
  deepseek-v3|kimi-k2-thinking|gpt-oss-120b|glm-4.5-air|qwen3-next-80b|minimax-m2
                         header-only replicas of the flagship MoE checkpoints (holes)
Exit codes: 0 written, 2 bad arguments or I/O error.")]
pub struct ReplicaArgs {
    /// What to write.
    kind: ReplicaKind,
    /// The snapshot directory to write.
    out: PathBuf,
    /// flash-next only: the full-size header-only replica.
    #[arg(long)]
    full: bool,
    /// flash-next only: the small replica with real random data.
    #[arg(long)]
    scaled: bool,
    /// Number of weight shards (the tiny families only).
    #[arg(long, value_name = "N")]
    shards: Option<usize>,
    /// Seed of the random data (the tiny families and `flash-next --scaled`).
    #[arg(long, value_name = "N")]
    seed: Option<u64>,
    /// flash-next --scaled only: n-gram rows 64 wide (stored at INT4 by an INT4 install).
    #[arg(long)]
    int4_rows: bool,
    /// flash-next --scaled only: routed experts per layer, their width and the stream
    /// width (the benchmark's larger model), e.g. `--experts 32 256 512`.
    #[arg(long, value_name = "E,I,H", value_delimiter = ',', num_args = 3)]
    experts: Option<Vec<u64>>,
    /// qwen3-moe only: the install benchmark's model instead of the tiny one (hidden
    /// 1024, 64 experts of width 512, vocab 32000, 4 shards), about 206 MB of BF16 per
    /// layer: 16 layers make 3.4 GB, 5 make 1.2 GB.
    #[arg(long)]
    bench: bool,
    /// With --bench: decoder layers (default 16).
    #[arg(long, value_name = "N", requires = "bench")]
    layers: Option<u64>,
}

/// The snapshot kinds `gturbo-dev replica` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ReplicaKind {
    /// Qwen3.8-Flash-Next (`--full` or `--scaled`).
    #[value(name = "flash-next")]
    FlashNext,
    /// A tiny random Qwen3-MoE checkpoint.
    #[value(name = "qwen3-moe")]
    Qwen3Moe,
    /// A tiny random Qwen3 checkpoint.
    #[value(name = "qwen3")]
    Qwen3,
    /// A tiny random Llama checkpoint.
    #[value(name = "llama")]
    Llama,
    /// deepseek-ai/DeepSeek-V3, header-only.
    #[value(name = "deepseek-v3")]
    DeepSeekV3,
    /// moonshotai/Kimi-K2-Thinking, header-only.
    #[value(name = "kimi-k2-thinking")]
    KimiK2Thinking,
    /// openai/gpt-oss-120b, header-only.
    #[value(name = "gpt-oss-120b")]
    GptOss120b,
    /// zai-org/GLM-4.5-Air, header-only.
    #[value(name = "glm-4.5-air")]
    Glm45Air,
    /// Qwen/Qwen3-Next-80B-A3B-Instruct, header-only.
    #[value(name = "qwen3-next-80b")]
    Qwen3Next80b,
    /// MiniMaxAI/MiniMax-M2, header-only.
    #[value(name = "minimax-m2")]
    MiniMaxM2,
}

impl ReplicaKind {
    fn name(self) -> &'static str {
        match self {
            Self::FlashNext => "flash-next",
            Self::Qwen3Moe => "qwen3-moe",
            Self::Qwen3 => "qwen3",
            Self::Llama => "llama",
            kind => kind.flagship().map_or("", |f| f.repo()),
        }
    }

    fn flagship(self) -> Option<Flagship> {
        Some(match self {
            Self::DeepSeekV3 => Flagship::DeepSeekV3,
            Self::KimiK2Thinking => Flagship::KimiK2Thinking,
            Self::GptOss120b => Flagship::GptOss120b,
            Self::Glm45Air => Flagship::Glm45Air,
            Self::Qwen3Next80b => Flagship::Qwen3Next80b,
            Self::MiniMaxM2 => Flagship::MiniMaxM2,
            _ => return None,
        })
    }
}

fn run(a: &ReplicaArgs) -> Result<ReplicaSummary, String> {
    let out = &a.out;
    let io_err = |e: io::Error| format!("{}: {e}", out.display());
    match a.kind {
        ReplicaKind::FlashNext => {
            let spec = match (a.full, a.scaled, a.int4_rows, &a.experts) {
                (true, false, false, None) => FlashNextSpec::full(),
                (false, true, false, None) => FlashNextSpec::scaled(),
                (false, true, true, None) => FlashNextSpec::scaled_int4_rows(),
                (false, true, false, Some(e)) => {
                    FlashNextSpec::scaled_with_experts(e[0], e[1], e[2])
                }
                (true, ..) if a.int4_rows || a.experts.is_some() => {
                    return Err("--int4-rows and --experts apply to --scaled only".into());
                }
                (false, true, true, Some(_)) => {
                    return Err("give one of --int4-rows, --experts".into());
                }
                _ => return Err("flash-next needs exactly one of --full, --scaled".into()),
            };
            if a.shards.is_some() {
                return Err("flash-next has a fixed shard rule; --shards is not accepted".into());
            }
            let spec = match a.seed {
                Some(seed) if a.scaled => spec.with_seed(seed),
                Some(_) => {
                    return Err("--seed only applies to --scaled (--full writes no data)".into());
                }
                None => spec,
            };
            write_flash_next(out, &spec).map_err(io_err)
        }
        kind if a.full || a.scaled => Err(format!(
            "{}: --full/--scaled apply to flash-next only",
            kind.name()
        )),
        ReplicaKind::Qwen3Moe => {
            let mut spec = if a.bench {
                Qwen3MoeSpec::bench(a.layers.unwrap_or(16))
            } else {
                Qwen3MoeSpec::tiny()
            };
            spec.shards = a.shards.unwrap_or(spec.shards);
            spec.seed = a.seed.unwrap_or(spec.seed);
            write_qwen3_moe(out, &spec).map_err(io_err)
        }
        ReplicaKind::Qwen3 => {
            let mut spec = Qwen3Spec::tiny();
            spec.shards = a.shards.unwrap_or(spec.shards);
            spec.seed = a.seed.unwrap_or(spec.seed);
            write_qwen3(out, &spec).map_err(io_err)
        }
        ReplicaKind::Llama => {
            let mut spec = LlamaSpec::tiny();
            spec.shards = a.shards.unwrap_or(spec.shards);
            spec.seed = a.seed.unwrap_or(spec.seed);
            write_llama(out, &spec).map_err(io_err)
        }
        kind => match kind.flagship() {
            Some(_) if a.shards.is_some() || a.seed.is_some() || a.bench => Err(format!(
                "{}: a header-only replica takes no --shards, --seed or --bench",
                kind.name()
            )),
            Some(f) => write_flagship(out, f).map_err(io_err),
            None => Err(format!("{}: unknown kind", kind.name())),
        },
    }
}

/// `gturbo-dev replica …`: writes one snapshot and prints its summary.
pub fn cli_main(args: &ReplicaArgs) -> ExitCode {
    match run(args) {
        Ok(summary) => {
            println!("{summary}");
            ExitCode::SUCCESS
        }
        Err(msg) => {
            eprintln!("gturbo-dev replica: {msg} (see `gturbo-dev replica --help`)");
            ExitCode::from(2)
        }
    }
}
