//! Command-line interface.
use std::process::ExitCode;
/// Entry point of the `gturbo` binary.
pub fn main() -> ExitCode {
    ExitCode::SUCCESS
}
