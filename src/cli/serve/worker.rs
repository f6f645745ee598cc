//! The generation thread of `gturbo serve`: it owns the model (which borrows its
//! install and backend, and is not `Send`), takes one [`Job`] at a time from a bounded
//! queue, restores the longest cached prefix, prefills the rest (keeping a snapshot at
//! each boundary the job names), and streams [`Event`]s back. A job whose client went
//! away (its event receiver dropped) stops at the next token.

use std::sync::mpsc::Receiver;

use tokio::sync::mpsc::UnboundedSender;

use super::cache::PrefixCache;
use super::disk::DiskCache;
use super::error::ApiError;
use crate::runtime::RunError;
use crate::runtime::error::InputError;
use crate::runtime::generate::{self, StopReason};
use crate::runtime::models::{Model, Session};
use crate::runtime::sample::{Sampler, SamplerConfig};
use crate::runtime::text::TextCodec;

/// How one request samples and when it stops.
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// 0 is greedy.
    pub temperature: f32,
    /// Nucleus bound (`None`: all tokens).
    pub top_p: Option<f32>,
    /// Keep only the k most likely tokens (Anthropic's `top_k`).
    pub top_k: Option<usize>,
    /// The sampler's seed.
    pub seed: u64,
    /// Strings that end the answer (not included in it).
    pub stop: Vec<String>,
}

/// One request for the worker.
pub struct Job {
    /// The whole prompt's token ids.
    pub prompt: Vec<u32>,
    /// Prompt lengths worth a snapshot (the end of the system prompt, of each earlier
    /// turn), ascending.
    pub boundaries: Vec<usize>,
    pub params: Params,
    /// Where the events go; dropped by a client that went away.
    pub events: UnboundedSender<Event>,
}

/// Why an answer ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finish {
    /// The model's end-of-turn token.
    Eos,
    /// `max_tokens`, or the model's context, reached.
    Length,
    /// This stop string appeared.
    Stop(String),
}

/// What a job reports, in order: `Started`, `Text`s, then `Done`; or `Failed` (before
/// `Started` when the request itself is at fault).
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The prompt is in: its length and how much of it came from a snapshot.
    Started { prompt_tokens: usize, cached: usize },
    /// More answer text.
    Text(String),
    /// The answer is complete.
    Done { tokens: usize, finish: Finish },
    /// The job failed.
    Failed(ApiError),
}

/// The snapshots kept: in memory, and on disk with `--cache-dir`.
pub struct Store {
    cache: PrefixCache<Session>,
    disk: Option<DiskCache>,
}

impl Store {
    /// A store of at most `cache_bytes` in memory (and on disk), holding the sound
    /// snapshots `disk` has for `model`.
    pub fn new(model: &dyn Model, cache_bytes: u64, disk: Option<DiskCache>) -> Store {
        let mut cache = PrefixCache::new(cache_bytes);
        if let Some(d) = &disk {
            for (tokens, s) in d.load(model) {
                let bytes = model.session_bytes(&s);
                cache.insert(tokens, s, bytes);
            }
        }
        Store { cache, disk }
    }

    /// The longest held prefix of `prompt` shorter than it, copied to continue
    /// (`None`: none held).
    fn restore(
        &mut self,
        model: &dyn Model,
        prompt: &[u32],
    ) -> Result<Option<(Session, usize)>, RunError> {
        let Some((snap, n)) = self.cache.longest(prompt) else {
            return Ok(None);
        };
        let s = model.snapshot(snap)?;
        if let Some(d) = &self.disk {
            d.touch(&prompt[..n]);
        }
        Ok(Some((s, n)))
    }

    /// Keep `s`, the state after `tokens` (and write it to disk).
    fn keep(&mut self, model: &dyn Model, tokens: Vec<u32>, s: Session) {
        if !self.cache.enabled() {
            return;
        }
        if let Some(d) = &self.disk {
            match model.export_session(&s) {
                Ok(state) => d.save(&tokens, state),
                Err(e) => eprintln!("warning: a snapshot was not written to --cache-dir: {e}"),
            }
        }
        let bytes = model.session_bytes(&s);
        self.cache.insert(tokens, s, bytes);
    }
}

/// Serve jobs until every sender is gone.
pub fn run(model: &dyn Model, codec: &TextCodec, jobs: Receiver<Job>, mut store: Store) {
    let cache = &mut store;
    for job in jobs {
        if job.events.is_closed() {
            continue; // the client left while the job was queued
        }
        let events = job.events.clone();
        // A panic in one job (a bug) fails that job, not the server: its session is
        // its own, and a snapshot is only kept once complete.
        let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            serve(model, codec, cache, job)
        }));
        let failed = match served {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e),
            Err(_) => Some(ApiError::server(
                "generation failed (a panic; see the server log)",
            )),
        };
        if let Some(e) = failed {
            let _ = events.send(Event::Failed(e));
        }
        tracing::debug!(
            snapshots = cache.cache.len(),
            bytes = cache.cache.bytes(),
            "snapshot cache"
        );
    }
}

/// A runtime error while running a prompt of `prompt` tokens as the API reports it:
/// the prompt's fault (too long, a token the model lacks) is the client's (400),
/// anything else the server's (500).
fn api_error(prompt: usize, e: RunError) -> ApiError {
    match e {
        RunError::Input(InputError::SequenceTooLong { max, .. }) => ApiError::context(format!(
            "the prompt has {prompt} tokens; the model's context is {max}"
        )),
        RunError::Input(e) => ApiError::invalid(e.to_string()),
        e => ApiError::server(e.to_string()),
    }
}

/// The session for `job`'s prompt up to its last snapshot boundary: the longest cached
/// prefix restored, then a prefill to each boundary past it, keeping a snapshot at each
/// (`None` when the client left meanwhile). Also returns how many tokens were restored.
fn restore_prefix(
    model: &dyn Model,
    cache: &mut Store,
    job: &Job,
) -> Result<Option<(Session, usize)>, ApiError> {
    let prompt = &job.prompt;
    let (mut s, cached) = cache
        .restore(model, prompt)
        .map_err(|e| api_error(prompt.len(), e))?
        .unwrap_or_else(|| (model.session(), 0));
    if cache.cache.enabled() {
        for &b in job
            .boundaries
            .iter()
            .filter(|&&b| b > cached && b < prompt.len())
        {
            if job.events.is_closed() {
                return Ok(None);
            }
            let from = s.pos;
            model
                .forward(&mut s, &prompt[from..b], false)
                .map_err(|e| api_error(prompt.len(), e))?;
            if !cache.cache.contains(&prompt[..b]) {
                let snap = model.snapshot(&s).map_err(|e| api_error(prompt.len(), e))?;
                cache.keep(model, prompt[..b].to_vec(), snap);
            }
        }
    }
    Ok(Some((s, cached)))
}

fn serve(
    model: &dyn Model,
    codec: &TextCodec,
    cache: &mut Store,
    job: Job,
) -> Result<(), ApiError> {
    let prompt = &job.prompt;
    if prompt.is_empty() {
        return Err(ApiError::invalid("the prompt encodes to no tokens"));
    }
    let Some((mut s, cached)) = restore_prefix(model, cache, &job)? else {
        return Ok(()); // the client left during the prefill
    };
    let p = &job.params;
    let mut sampler = Sampler::new(SamplerConfig {
        temperature: p.temperature,
        top_k: p.top_k,
        top_p: p.top_p,
        seed: p.seed,
    });
    let stop_ids = codec.stop_ids();
    let mut decoder = codec.stream_decoder(true);
    let mut stops = StopMatcher::new(&p.stop);
    let events = &job.events;
    let mut started = false;
    let mut sampled = 0usize;
    let mut stopped: Option<String> = None;
    let rest = &prompt[s.pos..];
    let done = generate::generate_in(
        model,
        &mut s,
        rest,
        p.max_tokens,
        stop_ids,
        |logits| sampler.sample(logits),
        |t| {
            sampled += 1;
            if !started {
                started = true;
                let _ = events.send(Event::Started {
                    prompt_tokens: prompt.len(),
                    cached,
                });
            }
            if stop_ids.contains(&t) {
                return true;
            }
            let piece = decoder.push(t).unwrap_or_default();
            let (text, hit) = stops.push(&piece);
            if !text.is_empty() && events.send(Event::Text(text)).is_err() {
                return false;
            }
            if hit.is_some() {
                stopped = hit;
                return false;
            }
            !events.is_closed()
        },
    );
    let (g, _) = match done {
        Ok(g) => g,
        // The context ran out while generating: the answer ends there.
        Err(RunError::Input(InputError::SequenceTooLong { .. })) if started => {
            let _ = events.send(Event::Done {
                tokens: sampled,
                finish: Finish::Length,
            });
            return Ok(());
        }
        Err(e) => return Err(api_error(prompt.len(), e)),
    };
    if events.is_closed() {
        return Ok(());
    }
    let finish = match (stopped, g.stop) {
        (Some(s), _) => Finish::Stop(s),
        (None, StopReason::Eos) => Finish::Eos,
        (None, StopReason::MaxTokens) => Finish::Length,
    };
    if !matches!(finish, Finish::Stop(_)) {
        let tail = decoder.finish().unwrap_or_default();
        let (mut text, _) = stops.push(&tail);
        text.push_str(&stops.finish());
        if !text.is_empty() {
            let _ = events.send(Event::Text(text));
        }
    }
    let _ = events.send(Event::Done {
        tokens: g.tokens.len(),
        finish,
    });
    keep_conversation(model, cache, prompt, &g.tokens, s);
    Ok(())
}

/// Keeps `s`, the conversation so far, for its next turn: the prompt and the answer's
/// tokens that are in the state (the last sampled token is not).
fn keep_conversation(
    model: &dyn Model,
    cache: &mut Store,
    prompt: &[u32],
    answer: &[u32],
    s: Session,
) {
    if s.pos > prompt.len() {
        let mut key = prompt.to_vec();
        key.extend_from_slice(&answer[..s.pos - prompt.len()]);
        cache.keep(model, key, s);
    }
}

/// Holds back answer text that may be the start of a stop string, and cuts the answer
/// where one appears.
pub struct StopMatcher<'a> {
    stops: &'a [String],
    /// Text received and not yet released.
    held: String,
    done: bool,
}

impl<'a> StopMatcher<'a> {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: &'a [String]) -> StopMatcher<'a> {
        StopMatcher {
            stops,
            held: String::new(),
            done: false,
        }
    }

    /// Add `piece`: the text now safe to release, and the stop string when one
    /// appeared (the text is then everything before it, and nothing more comes).
    pub fn push(&mut self, piece: &str) -> (String, Option<String>) {
        if self.done {
            return (String::new(), None);
        }
        self.held.push_str(piece);
        let first = self
            .stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|(at, _)| *at);
        if let Some((at, s)) = first {
            self.done = true;
            let text = self.held[..at].to_string();
            self.held.clear();
            return (text, Some(s.clone()));
        }
        // Release all but the longest tail that begins some stop string.
        let keep_from = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops
                    .iter()
                    .any(|s| !s.is_empty() && s.starts_with(tail))
            })
            .unwrap_or(self.held.len());
        let text = self.held[..keep_from].to_string();
        self.held.drain(..keep_from);
        (text, None)
    }

    /// The text still held (no stop string completed it).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_cut_the_answer_and_their_starts_are_held_back() {
        let stops = vec!["END".to_string(), "\n\n".to_string(), String::new()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("Paris is"), ("Paris is".into(), None));
        assert_eq!(m.push(" nice E"), (" nice ".into(), None));
        assert_eq!(m.push("N"), (String::new(), None));
        assert_eq!(m.push("Dgame"), (String::new(), Some("END".into())));
        assert_eq!(m.push("more"), (String::new(), None));
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("a\n"), ("a".into(), None));
        assert_eq!(m.push("b"), ("\nb".into(), None));
        assert_eq!(m.push("é\n"), ("é".into(), None));
        assert_eq!(m.finish(), "\n");
        let none: Vec<String> = Vec::new();
        let mut m = StopMatcher::new(&none);
        assert_eq!(m.push("x"), ("x".into(), None));
    }
}
