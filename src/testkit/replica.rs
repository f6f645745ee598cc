//! (in progress)

/// `gturbo-dev` subcommand entry point.
pub fn cli_main(_args: &[String]) -> std::process::ExitCode {
    std::process::ExitCode::from(2)
}
