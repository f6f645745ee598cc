//! Developer tools for tests and demos; not part of what users install.
//!
//! - `gturbo-dev hub ...`: serve snapshot directories as a local HF-compatible hub.
//! - `gturbo-dev replica ...`: write Qwen3.8-Flash-Next replicas and other fixtures.

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("hub") => gturbo::testkit::hub::cli_main(&args[1..]),
        Some("replica") => gturbo::testkit::replica::cli_main(&args[1..]),
        _ => {
            eprintln!("usage: gturbo-dev hub --help | gturbo-dev replica --help");
            std::process::ExitCode::from(2)
        }
    }
}
