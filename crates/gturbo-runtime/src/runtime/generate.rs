//! The generation loop, its footer figures, and the two-install comparison behind
//! `gturbo eval`.

use std::time::Instant;

use super::error::{InputError, RunError};
use super::models::state::{SessionData, bad_snapshot};

/// What the generation loop and `gturbo eval` need of a runner: a session and a
/// forward pass over it. Each model implements it over any backend; `models::Model`
/// is its object-safe face.
pub trait LanguageModel {
    /// Per-sequence state (KV caches, recurrent state).
    type Session;
    /// An empty session.
    fn new_session(&self) -> Self::Session;
    /// Run `tokens` after the session's state: the logits of every position when
    /// `all`, else of the last one.
    fn run(&self, s: &mut Self::Session, tokens: &[u32], all: bool) -> Result<Vec<f32>, RunError>;
    /// A copy of `s` that continues independently of it.
    fn copy_session(&self, s: &Self::Session) -> Result<Self::Session, RunError>;
    /// Bytes `s` holds (host or device): what keeping a copy of it costs (a server's
    /// snapshot cache is bounded by these).
    fn session_bytes(&self, s: &Self::Session) -> u64;
    /// `s`'s state on the host, independent of the backend (a snapshot saved to
    /// disk). By default: a model that cannot.
    fn export_session(&self, _s: &Self::Session) -> Result<SessionData, RunError> {
        Err(bad_snapshot("this model cannot save its sessions"))
    }
    /// A session holding `d`, checked against the model's geometry.
    fn import_session(&self, _d: &SessionData) -> Result<Self::Session, RunError> {
        Err(bad_snapshot("this model cannot load saved sessions"))
    }
    /// Vocabulary size (the logits' width).
    fn vocab(&self) -> usize;
    /// The backend's name.
    fn backend_name(&self) -> String;
    /// Device memory the backend holds, on a GPU.
    fn device_memory_bytes(&self) -> Option<u64>;
    /// The model's own footer figures after `positions` tokens (none by default).
    fn stats(&self, _positions: usize) -> Vec<Stat> {
        Vec::new()
    }
}

/// One figure a model adds to the run footer: its text, and its JSON key and value.
#[derive(Debug, Clone, PartialEq)]
pub struct Stat {
    /// Footer text (`row cache 98.0% hits (…)`).
    pub text: String,
    /// Key in `--json` output.
    pub key: &'static str,
    /// Value in `--json` output.
    pub value: serde_json::Value,
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// A stop token (end of sequence / end of turn) was sampled.
    Eos,
    /// `max_tokens` were generated.
    MaxTokens,
}

impl StopReason {
    /// Label used by the footer and `--json`.
    pub fn label(self) -> &'static str {
        match self {
            StopReason::Eos => "eos",
            StopReason::MaxTokens => "max-tokens",
        }
    }
}

/// What one generation did.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// Generated token ids (the stop token included when one was sampled).
    pub tokens: Vec<u32>,
    /// Why it stopped.
    pub stop: StopReason,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Seconds spent in prefill.
    pub prefill_s: f64,
    /// Seconds spent decoding after the first token.
    pub decode_s: f64,
}

impl Generation {
    /// Prompt tokens per second of prefill.
    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_s.max(1e-9)
    }

    /// Generated tokens per second of decode (tokens after the first over the time
    /// spent producing them).
    pub fn decode_tok_s(&self) -> f64 {
        self.tokens.len().saturating_sub(1) as f64 / self.decode_s.max(1e-9)
    }
}

/// Generate after `prompt`: prefill in one batched forward pass, then one token at a
/// time. `pick` chooses the next token from the logits; `on_token` sees each token as
/// it is produced (to stream it). Stops after a token in `stop_ids` or `max_tokens`.
pub fn generate<M: LanguageModel + ?Sized>(
    model: &M,
    prompt: &[u32],
    max_tokens: usize,
    stop_ids: &[u32],
    pick: impl FnMut(&[f32]) -> u32,
    mut on_token: impl FnMut(u32),
) -> Result<Generation, RunError> {
    if prompt.is_empty() {
        return Err(InputError::EmptyPrompt.into());
    }
    let mut s = model.new_session();
    let (g, _) = generate_in(model, &mut s, prompt, max_tokens, stop_ids, pick, |t| {
        on_token(t);
        true
    })?;
    Ok(g)
}

/// [`generate`] continuing the session `s` (a restored snapshot of a prompt's first
/// tokens, say): `prompt` is the rest of the prompt, prefilled in one pass, and it
/// must not be empty (its last logits pick the first token). `on_token` returns
/// whether to go on: `false` ends the generation after that token (a server's client
/// went away, a stop string appeared). The flag says whether `on_token` ended it.
pub fn generate_in<M: LanguageModel + ?Sized>(
    model: &M,
    s: &mut M::Session,
    prompt: &[u32],
    max_tokens: usize,
    stop_ids: &[u32],
    mut pick: impl FnMut(&[f32]) -> u32,
    mut on_token: impl FnMut(u32) -> bool,
) -> Result<(Generation, bool), RunError> {
    if prompt.is_empty() {
        return Err(InputError::EmptyPrompt.into());
    }
    let t0 = Instant::now();
    let mut logits = model.run(s, prompt, false)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut tokens = Vec::new();
    let mut stop = StopReason::MaxTokens;
    let mut ended = false;
    while tokens.len() < max_tokens {
        let t = pick(&logits);
        tokens.push(t);
        if !on_token(t) {
            ended = true;
            break;
        }
        if stop_ids.contains(&t) {
            stop = StopReason::Eos;
            break;
        }
        if tokens.len() == max_tokens {
            break;
        }
        logits = model.run(s, &[t], false)?;
    }
    let g = Generation {
        tokens,
        stop,
        prompt_tokens: prompt.len(),
        prefill_s,
        decode_s: t1.elapsed().as_secs_f64(),
    };
    Ok((g, ended))
}

pub use super::sample::argmax;

/// Peak resident set size of this process in bytes (`VmHWM`), where the OS says it.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// How two models' next-token distributions agree over the same tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Agreement {
    /// Positions compared.
    pub positions: usize,
    /// Mean KL(A‖B) in nats.
    pub mean_kl: f64,
    /// Largest KL at one position.
    pub max_kl: f64,
    /// Share of positions where both argmaxes agree.
    pub top1: f64,
}

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln() + m;
    x.iter().map(|&v| v as f64 - lse).collect()
}

/// Compare per-position logits `a` and `b` (`positions × vocab` each).
pub fn agreement(a: &[f32], b: &[f32], vocab: usize) -> Agreement {
    let positions = a.len().min(b.len()) / vocab.max(1);
    let (mut sum, mut max, mut same) = (0.0f64, 0.0f64, 0usize);
    for p in 0..positions {
        let (ra, rb) = (
            &a[p * vocab..(p + 1) * vocab],
            &b[p * vocab..(p + 1) * vocab],
        );
        let (la, lb) = (log_softmax(ra), log_softmax(rb));
        let kl: f64 = la.iter().zip(&lb).map(|(x, y)| x.exp() * (x - y)).sum();
        sum += kl;
        max = max.max(kl);
        same += usize::from(argmax(ra) == argmax(rb));
    }
    Agreement {
        positions,
        mean_kl: sum / positions.max(1) as f64,
        max_kl: max,
        top1: same as f64 / positions.max(1) as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agreement_of_identical_and_shifted_distributions() {
        let a = [0.0f32, 1.0, 2.0, 0.5, 3.0, 1.0];
        let same = agreement(&a, &a, 3);
        assert_eq!((same.positions, same.top1), (2, 1.0));
        assert!(same.mean_kl.abs() < 1e-12);
        // A uniform B against A's first row: KL = sum p log(p * 3).
        let b = [0.0f32; 6];
        let r = agreement(&a[..3], &b[..3], 3);
        let p: Vec<f64> = log_softmax(&a[..3]).iter().map(|l| l.exp()).collect();
        let want: f64 = p.iter().map(|p| p * (p * 3.0).ln()).sum();
        assert!((r.mean_kl - want).abs() < 1e-9, "{} vs {want}", r.mean_kl);
        assert_eq!(r.top1, 0.0, "uniform argmax is 0, A's is 2");
    }
}
