fn main() -> std::process::ExitCode {
    gturbo::cli::main()
}
