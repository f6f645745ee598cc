//! Developer tools for tests, benchmarks and the demo; not part of what users install
//! (`cargo build -p gturbo-testkit` builds it to `target/<profile>/gturbo-dev`).
//!
//! - `gturbo-dev hub ...`: serve snapshot directories as a local HF-compatible hub.
//! - `gturbo-dev replica ...`: write Qwen3.8-Flash-Next replicas and other fixtures.

use clap::Parser as _;
use gturbo_testkit::{hub, replica};

/// Developer tools for gturbo's tests and demo (not installed with gturbo).
#[derive(Debug, clap::Parser)]
#[command(name = "gturbo-dev")]
enum Cli {
    /// Serve snapshot directories as a local Hugging Face-compatible hub. Prints the
    /// base URL on the first line of stdout, then serves until killed.
    Hub(hub::HubArgs),
    /// Write a Hugging Face snapshot directory and print one summary line.
    Replica(replica::ReplicaArgs),
}

fn main() -> std::process::ExitCode {
    match Cli::parse() {
        Cli::Hub(args) => hub::cli_main(args),
        Cli::Replica(args) => replica::cli_main(&args),
    }
}
