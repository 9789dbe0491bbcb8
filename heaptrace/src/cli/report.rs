//! The arguments of `heaptrace report`: what to show of a recording, and how.
use std::time::Duration;

use clap::{Args, ValueEnum};

use super::parse_duration;

/// The views of `heaptrace report`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum View {
    /// Program, counts per function, totals, blocks not freed, losses.
    Overview,
    /// A row per round: allocations, frees, live bytes, RSS, cumulative bytes.
    Timeline,
    /// Requested size -> count.
    Histogram,
    /// The stacks that allocated exactly --size bytes.
    Filter,
    /// The call tree of allocation sites (--reverse: from main down).
    Tree,
    /// The sites with the most calls and the most bytes.
    Hotspots,
    /// Folded stacks for a flame graph (--by count|bytes|live|temporary).
    Flame,
    /// Blocks not freed at the end, by site.
    Leaks,
    /// Blocks freed soon after their allocation, by site.
    Temporary,
    /// The highest live heap and the sites that held it.
    Peak,
    /// The memory behind malloc: what allocators reserved, and which sites made them.
    Memory,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    Text,
    Json,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum GroupBy {
    Process,
    Command,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FlameBy {
    Count,
    Bytes,
    Live,
    Temporary,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Export {
    /// gzipped profile.proto for `go tool pprof`.
    Pprof,
    /// Folded stacks, one line per stack.
    Folded,
    /// A flame graph (SVG, via inferno).
    Svg,
    /// Valgrind massif's text format, for ms_print.
    Massif,
    /// One self-contained HTML page (charts, flame graph, tables) to open offline.
    Html,
}

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// The recording to read.
    #[arg(value_name = "FILE")]
    pub file: std::path::PathBuf,

    /// What to show.
    #[arg(value_enum, default_value = "overview")]
    pub view: View,

    /// Text for people, JSON for programs.
    #[arg(long, value_enum, default_value = "text")]
    pub format: Format,

    /// `filter`: the request size to look for.
    #[arg(long, value_name = "BYTES")]
    pub size: Option<u64>,

    /// `tree`: from main down instead of from the allocation up.
    #[arg(long)]
    pub reverse: bool,

    /// How many sites to list.
    #[arg(long, default_value_t = 10, value_name = "N")]
    pub top: usize,

    /// `flame`: what the widths mean.
    #[arg(long, value_enum, default_value = "bytes")]
    pub by: FlameBy,

    /// `flame` and the folded and SVG exports: one graph of every process's stacks summed
    /// (by default each process, or command with `--group-by command`, has a root frame of
    /// its own when there are several).
    #[arg(long)]
    pub merge_processes: bool,

    /// Name frames by their qualified function name only.
    ///
    /// No return type, template arguments, parameters or file:line:
    /// `std::vector::_M_realloc_insert`.
    #[arg(long, conflicts_with = "full_names")]
    pub just_function_name: bool,

    /// Elide template arguments and parameters: `Pool<…>::make(…)`.
    ///
    /// The default of the text views; for JSON and the exports, which keep names whole
    /// otherwise.
    #[arg(long, conflicts_with = "full_names")]
    pub shorten_templates: bool,

    /// Name frames in full in the text views too (they elide template arguments and
    /// parameters by default).
    #[arg(long)]
    pub full_names: bool,

    #[command(flatten)]
    pub site_naming: super::SiteNaming,

    /// Only this process.
    #[arg(long, value_name = "PID")]
    pub pid: Option<u32>,

    /// Only rounds ending at or after this time since the start (e.g. 2s).
    #[arg(long, value_parser = parse_duration, value_name = "TIME")]
    pub from: Option<Duration>,

    /// Only rounds ending at or before this time since the start.
    #[arg(long, value_parser = parse_duration, value_name = "TIME")]
    pub to: Option<Duration>,

    /// Compare with another recording, per site.
    ///
    /// With the views overview and hotspots (ordered by the change in bytes allocated) or
    /// leaks (by the change in bytes leaked); FILE is the before, B.bin the after.
    #[arg(long, value_name = "B.bin")]
    pub diff: Option<std::path::PathBuf>,

    /// One row per process, or per command (the processes of a command run more than once
    /// as one, their sites merged by frames): every view.
    #[arg(long, value_enum, default_value = "process", value_name = "BY")]
    pub group_by: GroupBy,

    /// Symbolize the stored locations again (after installing debug info).
    #[arg(long)]
    pub resymbolize: bool,

    /// Write an export instead of a view.
    #[arg(long, value_enum, requires = "output")]
    pub export: Option<Export>,

    /// Where the export goes.
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<std::path::PathBuf>,

    /// Replace a file (or a symbolic link, never followed) already at -o.
    #[arg(long)]
    pub force: bool,
}
