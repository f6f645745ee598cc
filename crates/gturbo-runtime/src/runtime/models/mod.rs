//! The models: each composes `layers` over the backend's ops (`kernels`) for one
//! architecture, and [`open`] is the one place that turns an install into a runnable
//! [`Model`]: the capability gate's runner table ([`crate::runtime::gate::RUNNERS`])
//! names each runner's [`Arch`], and [`open`] builds that architecture's model. No
//! caller names a family or a runner.
//!
//! - [`decoder`]: one transformer decoder parametrised by the install's axes (llama,
//!   qwen3, qwen3_moe; Mixtral through [`mixtral`]'s names and routing).
//! - [`deepseek_v3`]: DeepSeek-V3 and Kimi-K2: multi-head latent attention, sigmoid
//!   group-limited routing, a shared expert, dense first layers.
//! - [`glm4_moe`]: GLM-4.5, 4.5-Air and 4.6 through the decoder: q/k/v biases, QK norm
//!   when `use_qk_norm`, partial rotary, sigmoid routing with a correction bias, a
//!   shared expert, dense first layers.
//! - [`flash_next`]: Qwen3.8-Flash-Next (`qwen4_exp`): hyper-connections, gated delta
//!   net, indexed attention, the PLE n-gram embedding.
//! - [`gpt_oss`]: gpt-oss: attention sinks, alternating sliding windows, biases on
//!   every projection, top-k-then-softmax routing, the clamped SwiGLU.
//! - [`qwen3_next`]: Qwen3-Next: gated DeltaNet and gated full attention, softmax-routed
//!   experts with a gated shared expert.

pub mod decoder;
pub mod deepseek_v3;
pub mod flash_next;
pub mod glm4_moe;
pub mod gpt_oss;
pub mod mixtral;
pub mod qwen3_next;
pub mod state;

use std::any::Any;

use super::error::RunError;
use super::gate::Arch;
use super::generate::{LanguageModel, Stat};
use super::kernels::Ops;
use super::load::Install;
use state::SessionData;

/// A loaded model, whatever its architecture and backend: what `gturbo run`, `eval`
/// and a server drive.
pub trait Model {
    /// Vocabulary size (the logits' width).
    fn vocab(&self) -> usize;
    /// An empty session (its device buffers are made by the first forward pass).
    fn session(&self) -> Session;
    /// Run `tokens` after the session's state: the logits of every position when
    /// `all`, else of the last one.
    fn forward(&self, s: &mut Session, tokens: &[u32], all: bool) -> Result<Vec<f32>, RunError>;
    /// A copy of `s` (its caches and recurrent state) that continues independently: a
    /// snapshot to restore later, or a shared prefix to branch from.
    fn snapshot(&self, s: &Session) -> Result<Session, RunError>;
    /// Bytes `s` holds (host or device): what keeping a snapshot of it costs. A session
    /// of another model holds nothing this model can count: 0.
    fn session_bytes(&self, s: &Session) -> u64;
    /// `s`'s state on the host, independent of the backend (to save it).
    fn export_session(&self, s: &Session) -> Result<SessionData, RunError>;
    /// A session holding `d` (from [`Model::export_session`] of this model, on any
    /// backend); state that does not fit this model is an error.
    fn import_session(&self, d: &SessionData) -> Result<Session, RunError>;
    /// The backend's name (an adapter's name on a GPU).
    fn backend_name(&self) -> String;
    /// Device memory the backend holds, on a GPU.
    fn device_memory_bytes(&self) -> Option<u64>;
    /// The model's own figures for the run footer after `positions` tokens.
    fn stats(&self, positions: usize) -> Vec<Stat>;
}

/// One sequence's state of some [`Model`]: its KV caches and recurrent state, and the
/// tokens seen. Only the model that made it can read it.
pub struct Session {
    state: Box<dyn Any>,
    /// Tokens already in the state.
    pub pos: usize,
}

impl<M> Model for M
where
    M: LanguageModel,
    M::Session: 'static,
{
    fn vocab(&self) -> usize {
        LanguageModel::vocab(self)
    }

    fn session(&self) -> Session {
        Session {
            state: Box::new(self.new_session()),
            pos: 0,
        }
    }

    fn forward(&self, s: &mut Session, tokens: &[u32], all: bool) -> Result<Vec<f32>, RunError> {
        let state = state_of::<M>(&mut s.state)?;
        let logits = self.run(state, tokens, all)?;
        s.pos += tokens.len();
        Ok(logits)
    }

    fn snapshot(&self, s: &Session) -> Result<Session, RunError> {
        let state = s
            .state
            .downcast_ref::<M::Session>()
            .ok_or_else(foreign_session)?;
        Ok(Session {
            state: Box::new(self.copy_session(state)?),
            pos: s.pos,
        })
    }

    fn session_bytes(&self, s: &Session) -> u64 {
        s.state
            .downcast_ref::<M::Session>()
            .map_or(0, |state| LanguageModel::session_bytes(self, state))
    }

    fn export_session(&self, s: &Session) -> Result<SessionData, RunError> {
        let state = s
            .state
            .downcast_ref::<M::Session>()
            .ok_or_else(foreign_session)?;
        let d = LanguageModel::export_session(self, state)?;
        debug_assert_eq!(d.pos, s.pos);
        Ok(d)
    }

    fn import_session(&self, d: &SessionData) -> Result<Session, RunError> {
        Ok(Session {
            state: Box::new(LanguageModel::import_session(self, d)?),
            pos: d.pos,
        })
    }

    fn backend_name(&self) -> String {
        LanguageModel::backend_name(self)
    }

    fn device_memory_bytes(&self) -> Option<u64> {
        LanguageModel::device_memory_bytes(self)
    }

    fn stats(&self, positions: usize) -> Vec<Stat> {
        LanguageModel::stats(self, positions)
    }
}

fn state_of<M: LanguageModel>(state: &mut Box<dyn Any>) -> Result<&mut M::Session, RunError>
where
    M::Session: 'static,
{
    state
        .downcast_mut::<M::Session>()
        .ok_or_else(foreign_session)
}

fn foreign_session() -> RunError {
    RunError::Input(super::error::InputError::ForeignSession)
}

/// The generation loop drives any [`Model`].
impl LanguageModel for dyn Model + '_ {
    type Session = Session;
    fn new_session(&self) -> Session {
        self.session()
    }
    fn run(&self, s: &mut Session, tokens: &[u32], all: bool) -> Result<Vec<f32>, RunError> {
        self.forward(s, tokens, all)
    }
    fn copy_session(&self, s: &Session) -> Result<Session, RunError> {
        self.snapshot(s)
    }
    fn session_bytes(&self, s: &Session) -> u64 {
        Model::session_bytes(self, s)
    }
    fn export_session(&self, s: &Session) -> Result<SessionData, RunError> {
        Model::export_session(self, s)
    }
    fn import_session(&self, d: &SessionData) -> Result<Session, RunError> {
        Model::import_session(self, d)
    }
    fn vocab(&self) -> usize {
        Model::vocab(self)
    }
    fn backend_name(&self) -> String {
        Model::backend_name(self)
    }
    fn device_memory_bytes(&self) -> Option<u64> {
        Model::device_memory_bytes(self)
    }
    fn stats(&self, positions: usize) -> Vec<Stat> {
        Model::stats(self, positions)
    }
}

/// The model of `install`'s architecture (the runner the gate chose), its weights
/// bound on `backend`.
pub fn open<'a, B: Ops + 'static>(
    install: &'a Install,
    backend: &'a B,
) -> Result<Box<dyn Model + 'a>, RunError> {
    Ok(match install.runner.arch {
        Arch::Decoder => Box::new(decoder::Model::new(install, backend)?),
        Arch::FlashNext => Box::new(flash_next::model::FlashModel::new(install, backend)?),
        Arch::Mixtral => Box::new(mixtral::open(install, backend)?),
        Arch::DeepseekV3 => Box::new(deepseek_v3::Model::new(install, backend)?),
        Arch::Glm4Moe => Box::new(glm4_moe::open(install, backend)?),
        Arch::Qwen3Next => Box::new(qwen3_next::Qwen3NextModel::new(install, backend)?),
        Arch::GptOss => Box::new(gpt_oss::GptOss::new(install, backend)?),
    })
}
