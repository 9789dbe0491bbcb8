//! `heaptrace completions SHELL` and `heaptrace man [COMMAND]`: generated from the same clap
//! definitions as `--help`, so they never disagree with it.
use clap::CommandFactory as _;

use crate::{
    cli::{Cli, CompletionsArgs, ManArgs},
    error::{Error, Result},
};

pub fn completions(args: &CompletionsArgs) -> Result<i32> {
    let mut buf = Vec::new();
    clap_complete::generate(args.shell, &mut Cli::command(), "heaptrace", &mut buf);
    super::out(&String::from_utf8_lossy(&buf))?;
    Ok(0)
}

pub fn man(args: &ManArgs) -> Result<i32> {
    let top = Cli::command();
    let cmd = match &args.command {
        None => top,
        Some(name) => {
            let names: Vec<String> = top
                .get_subcommands()
                .map(|c| c.get_name().to_string())
                .collect();
            let Some(sub) = top.find_subcommand(name) else {
                return Err(Error::Usage(format!(
                    "no command {name:?}: one of {}",
                    names.join(", ")
                )));
            };
            // The page's name says whose it is: heaptrace-report(1).
            sub.clone()
                .name(format!("heaptrace-{}", sub.get_name()))
                .version(env!("CARGO_PKG_VERSION"))
        }
    };
    let mut buf = Vec::new();
    clap_mangen::Man::new(cmd).render(&mut buf)?;
    super::out(&String::from_utf8_lossy(&buf))?;
    Ok(0)
}
