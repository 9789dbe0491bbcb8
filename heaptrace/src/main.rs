use std::process::ExitCode;

use clap::Parser as _;

// Not libc's malloc: under `--all` every call of the malloc heaptrace probes traps into its
// probes, heaptrace's own included (its programs return at once, the trap remains). Without
// transparent huge pages (`no_thp`), its peak RSS is the system allocator's.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = heaptrace::cli::Cli::parse();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    use heaptrace::cli::Command;
    let result = match &cli.subcommand {
        Some(Command::Probes(args)) => heaptrace::cmd::probes::run(args),
        Some(Command::Record(args)) => heaptrace::run::run(&args.trace, Some(&args.output)),
        Some(Command::Report(args)) => heaptrace::cmd::report::run(args),
        None => heaptrace::run::run(&cli.trace, None),
    };
    match result {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) if e.is_broken_pipe() => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("heaptrace: error: {e}");
            ExitCode::FAILURE
        }
    }
}
