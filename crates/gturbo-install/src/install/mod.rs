//! The installer: [`prepare`] (resolve, gate the index, read config and headers, plan:
//! everything `--dry-run` does), then [`execute::execute`] (stream, transform, journal,
//! copy, hash, publish). This file is the facade: the limits every step shares and the
//! names the CLI uses; each step lives in a file of its own.

mod autojobs;
pub mod copied;
mod error;
pub mod execute;
mod finished;
mod journal;
mod prepare;
pub use crate::format::lock;
mod nofollow;
pub mod options;
pub mod pin;
mod publish;
mod resume;
pub mod source_hash;
mod stage;
mod stream;
mod tile;
mod window;

/// Free space an install keeps beyond its bytes (its preflight's rule; `gturbo doctor`
/// checks the same).
pub use stage::space_reserve;

pub use error::InstallError;
use error::{invalid, io_err};
pub use prepare::{IndexPin, PrepareSettings, Prepared, prepare, source_config};

/// The index file of a sharded repo.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The single file of an unsharded repo.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Largest index accepted (Flash-Next's is 171 KB).
pub const MAX_INDEX_BYTES: u64 = 64 << 20;
/// Largest `config.json` accepted.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;
/// Header reads in flight at once (fewer when their headers are large: [`HEADER_BUDGET`]).
pub const HEADER_CONCURRENCY: usize = 16;
/// The install's memory budget: its peak RSS at any `--jobs` (issue 9), headers
/// included (issue 22). Its shares: the reorder window's (192 MiB, `WINDOW_BUDGET`)
/// while data streams, [`HEADER_BUDGET`] while headers are read.
pub const MEMORY_BUDGET: u64 = 256 << 20;
/// What the header reads in flight may hold together ([`crate::header::HeaderBudget`]): the
/// reorder window's share of [`MEMORY_BUDGET`], since every header is read and parsed
/// before the first window place is made, and the rest of the budget (the runtime,
/// HTTP buffers) is there in both phases.
pub const HEADER_BUDGET: u64 = window::WINDOW_BUDGET;
