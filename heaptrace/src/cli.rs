//! Command-line arguments.
use std::time::Duration;

use clap::{Parser, ValueEnum};

/// What the probes collect (each mode adds to the one before, and costs more).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Per-function calls, bytes, failures; live blocks and leaks.
    Counts,
    /// + the exact size histogram and per-function latency.
    Sizes,
    /// + the user stack of each allocation: sites, leaks, temporaries, peak and lifetimes.
    Stacks,
}

impl Mode {
    pub fn kernel(self) -> u32 {
        match self {
            Mode::Counts => heaptrace_common::mode::COUNTS,
            Mode::Sizes => heaptrace_common::mode::SIZES,
            Mode::Stacks => heaptrace_common::mode::STACKS,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Mode::Counts => "counts",
            Mode::Sizes => "sizes",
            Mode::Stacks => "stacks",
        }
    }
}

#[derive(Parser, Debug)]
#[command(
    name = "heaptrace",
    version,
    about = "Trace every malloc-family call of live processes with eBPF uprobes",
    after_help = "Examples:\n  heaptrace -p 1234\n  heaptrace -- ./prog args\n  heaptrace --all --json out.json"
)]
pub struct Cli {
    /// Attach to a running process (and all its threads).
    #[arg(short, long, value_name = "PID", conflicts_with_all = ["all", "command"])]
    pub pid: Option<u32>,

    /// Trace every process on the host that uses the host's libc.
    #[arg(long, conflicts_with = "command")]
    pub all: bool,

    /// Time between rounds (e.g. 1s, 500ms, 2).
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub interval: Duration,

    /// Print a line per round and a final summary instead of the live view (the default when
    /// stdout is not a terminal).
    #[arg(long)]
    pub no_tui: bool,

    /// Where a launched command's stdout and stderr go. With the live view they go to
    /// /dev/null unless this is given (and its stdin is /dev/null); without it, they stay
    /// heaptrace's.
    #[arg(long, value_name = "FILE")]
    pub output: Option<std::path::PathBuf>,

    /// Do not print the per-round lines (the final summary is still printed).
    #[arg(short, long)]
    pub quiet: bool,

    /// Write a JSON document at exit to FILE ("-" for stdout).
    #[arg(long, value_name = "FILE")]
    pub json: Option<String>,

    /// What to collect.
    #[arg(long, value_enum, default_value = "stacks")]
    pub mode: Mode,

    /// How many sites the text views list.
    #[arg(long, default_value_t = 10, value_name = "N")]
    pub top: usize,

    /// A block freed within this time of its allocation is temporary (default: the interval).
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub temporary: Option<Duration>,

    /// Frames kept per stack, innermost first (the kernel walks at most 127).
    #[arg(long, default_value_t = 127, value_name = "FRAMES",
          value_parser = clap::value_parser!(u32).range(1..=127))]
    pub stack_depth: u32,

    /// Capacity of the kernel's stack map (distinct user stacks).
    #[arg(long, default_value_t = 16384, value_name = "STACKS")]
    pub stack_map_size: u32,

    /// Capacity of the kernel's site map ((process, stack, function) entries).
    #[arg(long, default_value_t = 16384, value_name = "SITES")]
    pub site_map_size: u32,

    /// Capacity of the kernel's live-allocation map (blocks tracked at once).
    #[arg(long, default_value_t = 1 << 20, value_name = "BLOCKS")]
    pub live_map_size: u32,

    /// Capacity of the exact size histogram ((process, function, size) entries).
    #[arg(long, default_value_t = 32768, value_name = "ENTRIES")]
    pub size_map_size: u32,

    /// Print where each probe was attached.
    #[arg(short, long)]
    pub verbose: bool,

    /// The command to launch and trace (after --).
    #[arg(last = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, scale) = if let Some(n) = s.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60.0)
    } else {
        (s, 1.0)
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("not a duration: {s:?} (try 1s or 500ms)"))?;
    let secs = v * scale;
    if !(0.001..=3600.0).contains(&secs) {
        return Err(format!("duration {s:?} out of range (1ms to 1h)"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_durations() {
        assert_eq!(parse_duration("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("5ms"), Ok(Duration::from_millis(5)));
        assert!(parse_duration("0").is_err());
        assert!(parse_duration("fast").is_err());
    }

    #[test]
    fn target_flags_conflict() {
        assert!(Cli::try_parse_from(["heaptrace", "-p", "1", "--all"]).is_err());
        assert!(Cli::try_parse_from(["heaptrace", "--all", "--", "ls"]).is_err());
        let c = Cli::try_parse_from(["heaptrace", "--", "ls", "-l"]).unwrap();
        assert_eq!(c.command, vec!["ls", "-l"]);
    }
}
