//! Commands other than tracing itself (which is `run`), one module each.
pub mod probes;
pub mod report;

/// Writes a command's output to stdout. A reader that stops early (`| head`) ends the
/// command quietly (`Error::is_broken_pipe`), where `print!` would panic.
pub fn out(text: &str) -> crate::error::Result<()> {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(text.as_bytes())?;
    Ok(stdout.flush()?)
}
