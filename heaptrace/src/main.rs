use std::process::ExitCode;

use clap::Parser as _;

fn main() -> ExitCode {
    let cli = heaptrace::cli::Cli::parse();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let result = match &cli.subcommand {
        Some(heaptrace::cli::Command::Probes(args)) => heaptrace::cmd::probes::run(args),
        None => heaptrace::run::run(cli),
    };
    match result {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("heaptrace: error: {e}");
            ExitCode::FAILURE
        }
    }
}
