//! Parsing with a way out where clap alone leaves a newcomer stuck: a bare `heaptrace` gets the
//! short usage and examples, and a command name where a target was expected
//! (`heaptrace ls -l`) gets the line that would trace it (`heaptrace -- ls -l`).
use std::ffi::OsString;

use clap::{
    CommandFactory as _, Parser as _,
    error::{ContextKind, ContextValue, ErrorKind},
};

use super::{Cli, examples};

/// Why parsing stopped before anything ran.
pub enum Stop {
    /// clap's own message (help, version, a usage error): `Error::exit` prints it.
    Clap(clap::Error),
    /// Said already on stderr; exit with this code.
    Said(u8),
}

/// The command line, parsed; or what was said instead.
pub fn parse(args: Vec<OsString>) -> Result<Cli, Stop> {
    if args.len() <= 1 {
        crate::say!("{}", bare_usage());
        return Err(Stop::Said(2));
    }
    Cli::try_parse_from(&args).map_err(|e| {
        let text: Vec<String> = args
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        match command_hint(&text, &e) {
            Some(hint) => {
                crate::say!("heaptrace: error: {hint}");
                Stop::Said(2)
            }
            None => Stop::Clap(e),
        }
    })
}

/// The short usage, the examples and where the options are explained.
pub fn bare_usage() -> String {
    let usage = Cli::command().render_usage();
    format!(
        "{usage}\n\n{}\n\n`heaptrace -h` lists the options, `heaptrace --help` explains them.",
        examples::TRACE
    )
}

/// For a word clap took for an unknown command or argument (`ls` in `heaptrace -q ls -l`):
/// the line that traces it as a command. None where clap says better (an option it does not
/// know, a subcommand it has a near match for).
pub fn command_hint(args: &[String], e: &clap::Error) -> Option<String> {
    if !matches!(
        e.kind(),
        ErrorKind::InvalidSubcommand | ErrorKind::UnknownArgument
    ) || e.get(ContextKind::SuggestedSubcommand).is_some()
    {
        return None;
    }
    let word = match e
        .get(ContextKind::InvalidSubcommand)
        .or_else(|| e.get(ContextKind::InvalidArg))?
    {
        ContextValue::String(s) => s.clone(),
        _ => return None,
    };
    if word.starts_with('-') {
        return None;
    }
    let at = args.iter().skip(1).position(|a| *a == word)? + 1;
    // A typo of a command ("reprot") is more likely than a program of that name.
    if let Some(near) = Cli::command()
        .get_subcommands()
        .map(|c| c.get_name().to_string())
        .find(|name| edit_distance(name, &word) <= 2)
    {
        let mut line = vec!["heaptrace".to_string(), near];
        line.extend(args[at + 1..].iter().map(|a| quote(a)));
        return Some(format!(
            "'{word}' is not a command of heaptrace: did you mean `{}`?",
            line.join(" ")
        ));
    }
    let mut line = vec!["heaptrace".to_string()];
    line.extend(args[1..at].iter().map(|a| quote(a)));
    line.push("--".into());
    line.extend(args[at..].iter().map(|a| quote(a)));
    Some(format!(
        "'{word}' is not an option or a command of heaptrace; to trace it, put it after --: \
         did you mean `{}`?",
        line.join(" ")
    ))
}

/// A word as a shell would need it.
fn quote(a: &str) -> String {
    let plain = !a.is_empty()
        && a.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b));
    if plain {
        a.to_string()
    } else {
        format!("'{}'", a.replace('\'', r"'\''"))
    }
}

/// Levenshtein distance, for the few short names of the commands.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}
