//! The subcommands, one module each: `trace` (the default: a live trace, or `record`),
//! `report`, `probes`, `heap`, and `help` (completions and the manual page). Each turns its arguments into calls of the stages and returns an exit
//! code; `main` only parses and dispatches.
pub mod heap;
pub mod help;
pub mod probes;
pub mod report;
pub mod trace;

/// Writes a command's output to stdout. A reader that stops early (`| head`) ends the
/// command quietly (`Error::is_broken_pipe`), where `print!` would panic.
pub fn out(text: &str) -> crate::error::Result<()> {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(text.as_bytes())?;
    Ok(stdout.flush()?)
}
