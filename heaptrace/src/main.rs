use std::process::ExitCode;

use clap::Parser as _;

fn main() -> ExitCode {
    let cli = heaptrace::cli::Cli::parse();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    match heaptrace::run::run(cli) {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("heaptrace: error: {e}");
            ExitCode::FAILURE
        }
    }
}
