//! `gturbo run`: load an install through the capability gate and generate.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use clap::Args;

use super::Failure;
use crate::format::quality::Quality;
use crate::runtime::RunError;
use crate::runtime::experts::ExpertMode;
use crate::runtime::generate::{self, Generation, Stat};
use crate::runtime::kernels::Cpu;
use crate::runtime::load::{self, DEFAULT_ROW_CACHE_ROWS, Install, LoadOptions};
use crate::runtime::models::{self, Model};
use crate::runtime::sample::{Sampler, SamplerConfig};
use crate::runtime::text::{TextCodec, TextError, harmony_final};
use crate::verify::{self, VerifyFailure};

/// Where `gturbo run` computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendChoice {
    /// The GPU when a hardware adapter exists and the model loads into its memory,
    /// else the CPU (software adapters such as llvmpipe are not picked).
    Auto,
    /// The CPU kernels.
    Cpu,
    /// The GPU (wgpu: Metal, Vulkan, DX12); an error when there is none.
    Gpu,
}

/// Flags of `gturbo run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The `.gturbo` directory.
    #[arg(required_unless_present = "list_adapters")]
    pub dir: Option<PathBuf>,
    /// List the GPU adapters wgpu sees (best first, as `--adapter` numbers them) and exit.
    #[arg(long)]
    pub list_adapters: bool,
    #[command(flatten)]
    pub model: ModelArgs,
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
    /// Print one JSON document (token ids, text, figures) instead of streaming text.
    #[arg(long)]
    pub json: bool,
}

/// How an install is opened and where it computes: the flags `gturbo run` and
/// `gturbo serve` share.
#[derive(Debug, Args)]
pub struct ModelArgs {
    /// Where to compute.
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// The GPU adapter: its number in `--list-adapters` or part of its name
    /// (default: the first).
    #[arg(long)]
    pub adapter: Option<String>,
    /// Routed-expert blobs kept in memory (an LRU cache filled by reads).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub expert_cache_slots: u64,
    /// Map every expert pool instead of caching blobs.
    #[arg(long, conflicts_with = "expert_cache_slots")]
    pub resident_experts: bool,
    /// Rows each n-gram row cache keeps (installs with row pools; an LRU filled by reads).
    #[arg(long, default_value_t = DEFAULT_ROW_CACHE_ROWS as u64,
          value_parser = clap::value_parser!(u64).range(1..=1 << 28))]
    pub row_cache_rows: u64,
    /// Run a quantized install whose family requires a recorded quality result
    /// although none is recorded (the footer then says "quality: not measured").
    #[arg(long)]
    pub allow_unmeasured: bool,
    /// Compute threads (default: all cores; at most 4 per core).
    #[arg(long, value_parser = super::parse_threads)]
    pub threads: Option<usize>,
}

/// Gate refusals and damaged installs exit 1; I/O errors and input the install
/// cannot run (an empty or too long prompt, a token id outside the vocabulary) exit 2.
impl From<RunError> for Failure {
    fn from(e: RunError) -> Failure {
        Failure {
            code: if e.is_refusal() { 1 } else { 2 },
            message: e.to_string(),
        }
    }
}

pub(super) fn threads(t: Option<usize>) -> usize {
    t.unwrap_or_else(super::cores).max(1)
}

pub(super) fn open(
    dir: &Path,
    experts: ExpertMode,
    row_cache_rows: usize,
) -> Result<Install, Failure> {
    let opts = LoadOptions {
        experts,
        row_cache_rows,
    };
    Ok(load::open(dir, opts)?)
}

/// The prompt's token ids, and the codec when the prompt was text.
fn prompt_ids(args: &RunArgs, dir: &Path) -> Result<(Vec<u32>, Option<TextCodec>), Failure> {
    if let Some(ids) = &args.prompt_ids {
        // Ids alone need no tokenizer; the output is then decoded only if one loads.
        return Ok((ids.clone(), TextCodec::load(dir).ok()));
    }
    let codec = TextCodec::load(dir).map_err(text_failure)?;
    // A rendered chat prompt already holds its special tokens: `encode_chat` adds none.
    let ids = match (&args.prompt, &args.chat) {
        (Some(p), _) => codec.encode(p).map_err(text_failure)?,
        (None, Some(user)) => {
            let rendered = codec
                .chat_prompt(args.system.as_deref(), user)
                .map_err(text_failure)?;
            codec.encode_chat(&rendered).map_err(text_failure)?
        }
        (None, None) => {
            return Err(Failure::usage(
                "give --prompt TEXT, --chat TEXT or --prompt-ids IDS",
            ));
        }
    };
    Ok((ids, Some(codec)))
}

pub(super) fn text_failure(e: TextError) -> Failure {
    Failure::usage(e.to_string())
}

/// `gturbo run`.
pub fn run_cmd(args: RunArgs) -> Result<(), Failure> {
    if args.list_adapters {
        return list_adapters();
    }
    let Some(dir) = args.dir.clone() else {
        return Err(Failure::usage("give the install directory"));
    };
    with_model(&args.model, &dir, |install, model, quality| {
        run_on(&args, &dir, install, model, quality)
    })
}

/// Open the install at `dir` as `args` say, pass its quality gate, build its model on
/// the backend `args` pick, and hand them to `f` (on this thread: a model borrows its
/// install and backend).
pub(super) fn with_model<T>(
    args: &ModelArgs,
    dir: &Path,
    f: impl FnOnce(&Install, &dyn Model, &QualityNote) -> Result<T, Failure>,
) -> Result<T, Failure> {
    let experts = if args.resident_experts {
        ExpertMode::Resident
    } else {
        ExpertMode::Slots(args.expert_cache_slots as usize)
    };
    let install = open(dir, experts, args.row_cache_rows as usize)?;
    let quality = quality_gate(&install, args.allow_unmeasured)?;
    // The one place that names a backend; the model is the gate's choice.
    let auto = match args.backend {
        BackendChoice::Cpu => None,
        BackendChoice::Gpu => Some(false),
        BackendChoice::Auto => Some(true),
    };
    if let Some(auto) = auto {
        #[cfg(feature = "gpu")]
        if let Some(gpu) = gpu_backend(args, auto)? {
            match loaded_on_gpu(models::open(&install, &gpu), &gpu)? {
                Ok(m) => return f(&install, m.as_ref(), &quality),
                Err(e) => {
                    let why = format!("the model does not load on {}: {e}", gpu.adapter().name);
                    gpu_unusable(auto, why)?;
                }
            }
        }
        #[cfg(not(feature = "gpu"))]
        gpu_unusable(
            auto,
            "this gturbo was built without the `gpu` feature".into(),
        )?;
    }
    let cpu = Cpu::new(threads(args.threads));
    let model = models::open(&install, &cpu)?;
    f(&install, model.as_ref(), &quality)
}

/// A model built on the GPU, its uploads finished: `Ok(Err(why))` when the device
/// failed (wgpu reports no memory size, so whether a model fits is learnt by uploading
/// it; an allocation failure surfaces at `finish`), and the CPU path's own failure
/// (same message, same exit code) when the install or the input is at fault, which no
/// backend would change.
#[cfg(feature = "gpu")]
fn loaded_on_gpu<M>(
    made: Result<M, RunError>,
    gpu: &crate::runtime::kernels::gpu::Gpu,
) -> Result<Result<M, String>, Failure> {
    match made {
        Ok(m) => Ok(gpu.finish().map(|()| m).map_err(|e| e.to_string())),
        Err(RunError::Backend(e)) => Ok(Err(e.to_string())),
        Err(e) => Err(e.into()),
    }
}

/// What the footer says of the backend a run used: its name (with the adapter and its
/// API for a GPU) and the device memory it holds.
struct OnBackend {
    name: String,
    device_memory_bytes: Option<u64>,
}

/// What the run footer says about quality: the recorded result, "not measured", or
/// why a file there was not accepted.
pub(super) enum QualityNote {
    Recorded(Box<Quality>),
    NotMeasured,
    Rejected(VerifyFailure),
}

impl QualityNote {
    fn text(&self) -> String {
        match self {
            QualityNote::Recorded(q) => format!("quality: {}", q.summary()),
            QualityNote::NotMeasured => "quality: not measured".into(),
            QualityNote::Rejected(f) => format!("quality: record rejected ({f})"),
        }
    }

    fn json(&self) -> serde_json::Value {
        match self {
            QualityNote::Recorded(q) => serde_json::to_value(q).unwrap_or_default(),
            QualityNote::NotMeasured => serde_json::Value::Null,
            QualityNote::Rejected(f) => serde_json::json!({ "rejected": f.to_string() }),
        }
    }
}

/// The rule of FORMAT.md ("quality.json"): an install whose manifest says
/// `quantized_at_install.quality_gate.required_for_run` (written at install for a
/// quantized install of a family whose quant policy asks for it) runs only with a
/// recorded quality result the receipt covers, unless `allow` (`--allow-unmeasured`).
fn quality_gate(install: &Install, allow: bool) -> Result<QualityNote, Failure> {
    let note = match verify::recorded_quality(&install.dir) {
        Ok(Some(q)) => QualityNote::Recorded(Box::new(q)),
        Ok(None) => QualityNote::NotMeasured,
        Err(f) => QualityNote::Rejected(f),
    };
    let required = install
        .manifest
        .quantized_at_install
        .quality_gate
        .as_ref()
        .and_then(|g| g.get("required_for_run"))
        .and_then(serde_json::Value::as_bool)
        .unwrap_or(false);
    if required && !allow && !matches!(note, QualityNote::Recorded(_)) {
        let why = match &note {
            QualityNote::Rejected(f) => format!("the recorded one was not accepted: {f}"),
            _ => "none is recorded".into(),
        };
        return Err(Failure {
            code: 1,
            message: format!(
                "{}: family {} requires a recorded quality result before a quantized install \
                 runs (manifest.json quantized_at_install.quality_gate.required_for_run); {why}; \
                 measure it with `gturbo eval {} REFERENCE --text FILE --record`, or pass \
                 --allow-unmeasured",
                install.dir.display(),
                install.manifest.family,
                install.dir.display()
            ),
        });
    }
    Ok(note)
}

/// With `--backend auto`, a log line (the CPU takes over); with `--backend gpu`, the
/// error.
fn gpu_unusable(auto: bool, why: String) -> Result<(), Failure> {
    if auto {
        tracing::info!("backend auto: the CPU, since {why}");
        Ok(())
    } else {
        Err(Failure {
            code: 2,
            message: format!("--backend gpu: {why}"),
        })
    }
}

/// Whether a hardware GPU may be present. On Linux a GPU driver exposes a device node
/// (`/dev/dri/renderD*`, `/dev/nvidia*`); without one `auto` does not start Vulkan at
/// all, which keeps a CPU-only run as fast and as quiet as before (a software Vulkan
/// driver costs start-up time and may print to stderr). Elsewhere wgpu is asked.
#[cfg(feature = "gpu")]
pub(super) fn may_have_gpu() -> bool {
    if !cfg!(target_os = "linux") {
        return true;
    }
    let has = |dir: &str, prefix: &str| {
        std::fs::read_dir(dir).is_ok_and(|d| {
            d.flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with(prefix))
        })
    };
    has("/dev/dri", "renderD") || has("/dev", "nvidia")
}

/// The GPU `--adapter` names (with `auto` and no `--adapter`, the first hardware
/// one: a software adapter such as llvmpipe is far slower than the CPU kernels), or
/// `None` where `auto` falls back to the CPU.
#[cfg(feature = "gpu")]
fn gpu_backend(
    args: &ModelArgs,
    auto: bool,
) -> Result<Option<crate::runtime::kernels::gpu::Gpu>, Failure> {
    use crate::runtime::kernels::gpu::{Gpu, GpuOptions, list_adapters};
    let mut opts = GpuOptions {
        adapter: args.adapter.clone(),
        ..Default::default()
    };
    if auto && opts.adapter.is_none() {
        if !may_have_gpu() {
            gpu_unusable(auto, "there is no GPU device node".into())?;
            return Ok(None);
        }
        match list_adapters().into_iter().find(|a| a.device_type != "Cpu") {
            Some(a) => opts.adapter = Some(a.index.to_string()),
            None => {
                gpu_unusable(auto, "there is no hardware GPU adapter".into())?;
                return Ok(None);
            }
        }
    }
    match Gpu::new(&opts) {
        Ok(g) => Ok(Some(g)),
        Err(e) => {
            gpu_unusable(auto, e.to_string())?;
            Ok(None)
        }
    }
}

/// `gturbo run --list-adapters`.
fn list_adapters() -> Result<(), Failure> {
    #[cfg(feature = "gpu")]
    {
        let all = crate::runtime::kernels::gpu::list_adapters();
        if all.is_empty() {
            println!("no GPU adapters (wgpu looked for Vulkan, Metal and DX12 devices)");
        }
        for a in all {
            println!("{a}");
        }
        Ok(())
    }
    #[cfg(not(feature = "gpu"))]
    Err(Failure::usage(
        "this gturbo was built without the `gpu` feature",
    ))
}

/// Generate with `model` (over `install`), streaming the text, then print the footer.
fn run_on(
    args: &RunArgs,
    dir: &Path,
    install: &Install,
    model: &dyn Model,
    quality: &QualityNote,
) -> Result<(), Failure> {
    let (prompt, codec) = prompt_ids(args, dir)?;
    let stop_ids: Vec<u32> = codec
        .as_ref()
        .map(|c| c.stop_ids().to_vec())
        .unwrap_or_default();
    let mut sampler = Sampler::new(SamplerConfig {
        temperature: args.temperature,
        top_k: (args.top_k > 0).then_some(args.top_k),
        top_p: (args.top_p < 1.0).then_some(args.top_p),
        seed: args.seed,
    });
    let mut out = std::io::stdout().lock();
    let json = args.json;
    // A harmony chat (gpt-oss) answers in channels: only the final one is shown, once
    // the answer is complete, so nothing streams.
    let harmony = args.chat.is_some() && codec.as_ref().is_some_and(TextCodec::is_harmony);
    let json = json || harmony;
    // Stop tokens are not printed; everything else streams as soon as it is text.
    let mut stream = codec.as_ref().map(|c| c.stream_decoder(true));
    let mut text = String::new();
    let g = generate::generate(
        model,
        &prompt,
        args.max_tokens,
        &stop_ids,
        |logits| sampler.sample(logits),
        |t| {
            let piece = match &mut stream {
                Some(d) if !stop_ids.contains(&t) => d.push(t).unwrap_or_default(),
                Some(_) => String::new(),
                None => format!("{t} "),
            };
            text.push_str(&piece);
            if !json {
                let _ = write!(out, "{piece}");
                let _ = out.flush();
            }
        },
    )?;
    if let Some(d) = &mut stream {
        let rest = d.finish().unwrap_or_default();
        text.push_str(&rest);
        if !json {
            let _ = write!(out, "{rest}");
        }
    }
    if let (true, Some(c)) = (harmony, &codec) {
        let decoded = c.decode(&g.tokens, false).map_err(text_failure)?;
        text = harmony_final(&decoded).unwrap_or_default().to_string();
        if !args.json {
            let _ = write!(out, "{text}");
        }
    }
    if !args.json {
        let _ = writeln!(out);
    }
    // The last sampled token is never fed back: the state holds the rest.
    let positions = g.prompt_tokens + g.tokens.len().saturating_sub(1);
    let mut parts = model.stats(positions);
    parts.push(Stat {
        text: quality.text(),
        key: "quality",
        value: quality.json(),
    });
    let backend = OnBackend {
        name: model.backend_name(),
        device_memory_bytes: model.device_memory_bytes(),
    };
    footer(
        install, &backend, &g, args.json, &prompt, &text, &parts, &mut out,
    );
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn footer(
    install: &Install,
    backend: &OnBackend,
    g: &Generation,
    json: bool,
    prompt: &[u32],
    text: &str,
    parts: &[Stat],
    out: &mut impl std::io::Write,
) {
    let stats = install.experts.stats();
    let rss = generate::peak_rss_bytes();
    let hit = stats.hit_rate();
    let device = backend.device_memory_bytes;
    let on = match device {
        Some(b) => format!(
            "{}, device memory {:.1} MiB",
            backend.name,
            b as f64 / (1 << 20) as f64
        ),
        None => backend.name.to_string(),
    };
    let mut line = format!(
        "[{} via {} on {}] stop: {}; prompt {} tokens, generated {}; prefill {:.1} tok/s, decode {:.1} tok/s; peak RSS {}; expert cache {}",
        install.manifest.family,
        install.runner.name,
        on,
        g.stop.label(),
        g.prompt_tokens,
        g.tokens.len(),
        g.prefill_tok_s(),
        g.decode_tok_s(),
        rss.map_or("n/a".into(), |b| format!(
            "{:.1} MiB",
            b as f64 / (1 << 20) as f64
        )),
        stats.text(),
    );
    for p in parts {
        line.push_str("; ");
        line.push_str(&p.text);
    }
    eprintln!("{line}");
    if json {
        let doc = serde_json::json!({
            "family": install.manifest.family,
            "runner": install.runner.name,
            "backend": backend.name,
            "device_memory_bytes": device,
            "prompt_ids": prompt,
            "tokens": g.tokens,
            "text": text,
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
        let mut doc = doc;
        for p in parts {
            doc[p.key] = p.value.clone();
        }
        let _ = writeln!(out, "{}", super::json_text(&doc));
    }
}
