//! Command-line arguments.
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::run_info::{Floor, Mode};

mod examples;
mod report;
pub mod suggest;

pub use report::{Export, FlameBy, Format, GroupBy, ReportArgs, View};

/// Tracing is the default command, given by its flags alone; other commands are subcommands.
/// `args_conflicts_with_subcommands` keeps the two apart: `heaptrace -p 1` traces,
/// `heaptrace probes -p 1` does not, and `heaptrace -- probes` launches a program named probes.
/// Help is wrapped at 80 columns; `-h` shows each option's first line, `--help` all of it.
#[derive(Parser, Debug)]
#[command(
    name = "heaptrace",
    version,
    about = "Trace every malloc-family call of live processes with eBPF uprobes",
    long_about = "Trace every malloc-family call of live processes with eBPF uprobes.\n\n\
                  Attach to a running process (-p), launch a command (-- CMD) or watch every \
                  process on the host (--all): exact calls, bytes, sizes, live blocks and \
                  leaks per function and per call site, in a live view, round lines, a JSON \
                  document or a recording for `heaptrace report`. Needs root (or CAP_BPF and \
                  CAP_PERFMON).",
    after_help = examples::TRACE,
    args_conflicts_with_subcommands = true,
    max_term_width = 80
)]
pub struct Cli {
    #[command(subcommand)]
    pub subcommand: Option<Command>,

    #[command(flatten)]
    pub trace: TraceArgs,
}

/// What to trace and how: the flags of tracing itself and of `record`.
/// How sites are named past allocator wrappers: tracing and `report` alike.
#[derive(Args, Debug, Clone, Default)]
pub struct SiteNaming {
    /// Name sites past functions matching REGEX, as allocator wrappers (repeatable).
    ///
    /// A site is named by its first frame outside the allocator and its wrappers (`zmalloc`,
    /// `xmalloc`); stacks keep every frame. Services' wrappers are known by name (Redis,
    /// nginx, PostgreSQL, CPython, GLib, SQLite), others detected: a function seen only
    /// right above the allocator, called from 4 or more functions. A caller of a --hide or
    /// known wrapper names a site.
    #[arg(long, value_name = "REGEX", value_parser = crate::profile::wrappers::parse_hide)]
    pub hide: Vec<regex::Regex>,

    /// Do not detect allocator wrappers nor use services' known ones: only `operator new`,
    /// Rust's allocation functions and --hide's are passed over.
    #[arg(long)]
    pub no_wrapper_detection: bool,
}

impl SiteNaming {
    /// The rule for a trace of the allocator in file `provider`.
    pub fn rule(&self, provider: &str) -> crate::profile::wrappers::WrapperRule {
        crate::profile::wrappers::WrapperRule::new(&self.hide, self.no_wrapper_detection, provider)
    }
}

/// Serving metrics and heap profiles over HTTP while tracing (docs/serving.md).
#[derive(Args, Debug, Clone, Default)]
pub struct ServeArgs {
    /// Serve /metrics (Prometheus) and /debug/pprof/heap and /allocs (Go's layout) at ADDR.
    ///
    /// ADDR is HOST:PORT or a port alone (127.0.0.1:PORT). Read-only. An address other than
    /// loopback needs --serve-token-file. See docs/serving.md for Prometheus, Parca and
    /// Grafana Alloy configurations.
    #[arg(long, value_name = "ADDR", value_parser = crate::serve::auth::parse_addr)]
    pub serve: Option<std::net::SocketAddr>,

    /// With --serve: requests must carry `Authorization: Bearer TOKEN`, TOKEN the file's
    /// first line (compared in constant time). Needed for an address other than loopback.
    #[arg(long, requires = "serve", value_name = "FILE")]
    pub serve_token_file: Option<std::path::PathBuf>,

    /// With --serve: processes given series of their own in /metrics, those that allocated
    /// the most bytes; the others are summed into one series (pid="other"), and
    /// heaptrace_serve_folded_processes says how many.
    #[arg(long, requires = "serve", default_value_t = 500, value_name = "N")]
    pub serve_max_processes: usize,
}

#[derive(Args, Debug, Clone)]
pub struct TraceArgs {
    /// Attach to a running process (and all its threads).
    #[arg(short, long, value_name = "PID", conflicts_with_all = ["all", "command"])]
    pub pid: Option<u32>,

    /// With -p: also trace the processes it forks (and those it forked already).
    ///
    /// Each from its first call, as its own process, at no other process's cost: the tree's
    /// processes are seized with ptrace (nothing stops; each signal they are sent passes
    /// through heaptrace), and each fork is held until it has probes of its own. A fork no
    /// tracer holds (made by a thread other than the main one) is counted from the kernel's
    /// report of it, and said. A launched command's forks are followed by default.
    #[arg(long, conflicts_with_all = ["all", "no_follow_forks"])]
    pub follow_forks: bool,

    /// With a command: trace it alone, not the processes it forks. Those run untraced, at
    /// their own speed (the probes' breakpoints they inherit are taken out at their fork).
    #[arg(long, conflicts_with_all = ["all", "pid"])]
    pub no_follow_forks: bool,

    /// Trace every process on the host that uses the host's libc.
    #[arg(long, conflicts_with = "command")]
    pub all: bool,

    /// With --all: only processes whose command name contains this.
    // `requires` alone lets `-p PID --comm X` through: clap drops a requirement on an
    // argument that conflicts with one given.
    #[arg(long, requires = "all", conflicts_with_all = ["pid", "command"], value_name = "NAME")]
    pub comm: Option<String>,

    /// With --all: ended processes kept one by one.
    ///
    /// Older ones, and the oldest while they hold more than 50,000 sites, are folded into one,
    /// `[N exited processes]`, whose sites are their stacks by frames (bounded memory).
    #[arg(long, default_value_t = 1000, value_name = "N")]
    pub keep_exited: usize,

    /// The summary's processes and sites: one row per process, or per command (the
    /// processes of a command run more than once as one, their sites merged by frames).
    #[arg(long, value_enum, default_value = "process", value_name = "BY")]
    pub group_by: GroupBy,

    /// With --all: write each OOM killer victim's report to DIR at once.
    ///
    /// A JSON document as --json's, of that process alone: its heap by site when it was
    /// killed. Named oom-PID-COMM-UNIXTIME.json.
    #[arg(long, requires = "all", value_name = "DIR")]
    pub oom_dir: Option<std::path::PathBuf>,

    /// With --all: only processes whose cgroup path contains this.
    ///
    /// A container's or a systemd unit's cgroup, judged in the kernel.
    #[arg(long, requires = "all", conflicts_with_all = ["pid", "command"], value_name = "PATH")]
    pub cgroup: Option<String>,

    /// Time between rounds (e.g. 1s, 500ms, 2).
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub interval: Duration,

    /// Round lines and a summary instead of the live view.
    ///
    /// The default when stdout is not a terminal, or heaptrace is not in its foreground.
    #[arg(long)]
    pub no_tui: bool,

    /// Where a launched command's stdout and stderr go.
    ///
    /// With the live view they go to /dev/null unless this is given (and its stdin is
    /// /dev/null); without the view, they stay heaptrace's.
    #[arg(long, value_name = "FILE")]
    pub command_output: Option<std::path::PathBuf>,

    /// No round lines, only the final summary.
    #[arg(short, long)]
    pub quiet: bool,

    /// Write the JSON document at exit to FILE ("-": stdout).
    #[arg(long, value_name = "FILE")]
    pub json: Option<String>,

    /// The JSON document's processes kept one by one: those that allocated the most.
    ///
    /// The others are folded into one, their sites merged by frames; totals stay exact and
    /// the document's `folded` says how many (a day of --all stays a document one can open).
    #[arg(long, default_value_t = 100, value_name = "N")]
    pub json_max_processes: u32,

    /// The JSON document's lists by stack (stacks, temporary, leaks): the N largest each.
    ///
    /// Each process's leaks by stack: N / 50. The document's `folded` says how many stacks
    /// were left out, and what they add up to.
    #[arg(long, default_value_t = 2000, value_name = "N")]
    pub json_max_stacks: u32,

    /// Replace a file already at an output path.
    ///
    /// `record -o`, --json, --command-output. Without it, heaptrace refuses to start. A
    /// symbolic link there is replaced, never followed.
    #[arg(long)]
    pub force: bool,

    /// What to collect.
    #[arg(long, value_enum, default_value = "stacks")]
    pub mode: Mode,

    /// Count inside the process: a library preloaded into the launched command, or loaded
    /// into a running one (-p, with ptrace), no probes.
    ///
    /// No trap per call, so an allocation-heavy program runs several times faster than
    /// under probes, and no root is needed for a launched command. For a dynamically linked
    /// program only (not --all); stacks by frame pointer. See docs/in-process.md.
    #[arg(long, conflicts_with_all = ["all"])]
    pub in_process: bool,

    /// --in-process: threads counted at once, each with counters of its own (a thread
    /// beyond them is counted in `lost.in_flight`).
    #[arg(long, default_value_t = 256, value_name = "THREADS",
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub in_process_threads: u32,

    /// Benchmarks only: a mode's probes with programs that only count (or walk the stack):
    /// the floor heaptrace's own programs are measured against. Overrides --mode.
    #[arg(long, value_enum, hide = true)]
    pub floor: Option<Floor>,

    /// Stacks mode: sample one allocation per N bytes allocated.
    ///
    /// A Poisson process over the allocated bytes, as tcmalloc and jemalloc sample. Only
    /// sampled allocations pay for a stack and a live-map entry; per-function counts and the
    /// size histogram stay exact, per-site, live and leak figures become unbiased estimates.
    /// 0 (the default) takes every allocation.
    #[arg(long, default_value_t = 0, value_name = "N",
          value_parser = crate::probe::sampling::parse_sample_bytes)]
    pub sample_bytes: u64,

    /// Sizes and stacks modes: time one allocating call in N.
    ///
    /// For the per-function latency percentiles and, in stacks mode, the lifetime percentiles
    /// of its block (the gaps between timed calls are random, mean N). Reading the clock twice
    /// a call is most of what sizes mode costs beyond counts mode; 1 times every call. Counts
    /// and temporaries are exact whatever N.
    #[arg(long, default_value_t = 16, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
    pub latency_every: u32,

    /// How many sites the text views list.
    #[arg(long, default_value_t = 10, value_name = "N")]
    pub top: usize,

    /// Name frames in full in the summary's site tables.
    ///
    /// They elide template arguments and parameters by default (`Pool<…>::make(…)`); the
    /// JSON document always has the full names.
    #[arg(long)]
    pub full_names: bool,

    #[command(flatten)]
    pub site_naming: SiteNaming,

    #[command(flatten)]
    pub serve: ServeArgs,

    /// What counts as temporary.
    ///
    /// A block freed by the thread that allocated it, with fewer than N of that thread's
    /// allocations and frees in between (1, the default: none between, heaptrack's rule).
    #[arg(long, default_value_t = 1, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..))]
    pub temporary_allocs: u32,

    /// Frames kept per stack, innermost first (at most 127).
    #[arg(long, default_value_t = 127, value_name = "FRAMES",
          value_parser = clap::value_parser!(u32).range(1..=127))]
    pub stack_depth: u32,

    /// Rows of unwind tables held at most, for stacks through code without frame pointers
    /// (8 bytes each; libc takes ~28k, python3 ~65k, rustc's libraries ~2.6M): a stack
    /// reaching a file whose table does not fit ends there, counted in `lost.unwind_table`.
    /// 0: frame pointers only.
    ///
    /// Default: 16777216 for the kernel's probes (at most 128 MiB, allocated 2 MiB at a time
    /// as tables need it), 4194304 with --in-process (the region's area).
    #[arg(long, value_name = "ROWS", value_parser = clap::value_parser!(u32).range(0..=1 << 26))]
    pub unwind_table_size: Option<u32>,

    /// Leave Python frames out of stacks.
    ///
    /// By default a stack of a CPython 3.11-3.13 process that passes through the interpreter
    /// shows the Python functions and lines (module `[python]`, docs/python.md): each
    /// allocation then also reads its thread's Python frames (~2 us with a few frames).
    #[arg(long)]
    pub no_python_frames: bool,

    /// A launched Python: count its small objects too (PYTHONMALLOC=malloc).
    ///
    /// CPython serves objects of up to 512 bytes from its own arenas (pymalloc), which
    /// malloc never sees: without this they are not counted. With it the command runs with
    /// PYTHONMALLOC=malloc, each object a malloc call of its own: every object counted, but
    /// on another allocator than the program's usual one (slower, its heap laid out
    /// differently). A launched command only.
    #[arg(long, conflicts_with_all = ["all", "pid"])]
    pub python_malloc: bool,

    /// Capacity of the stack map (distinct user stacks held at once).
    ///
    /// Default: 262144 for the kernel's probes (~100 bytes of kernel memory a stack held,
    /// allocated as stacks come, freed when their processes end or idle; the frames of half
    /// as many new stacks, at most 65536, between reads), 16384 with --in-process.
    #[arg(long, value_name = "STACKS",
          value_parser = clap::value_parser!(u32).range(1..=1 << 24))]
    pub stack_map_size: Option<u32>,

    /// Capacity of the site map ((process, stack, function) entries of about two rounds).
    ///
    /// Default: 65536, or less on hosts with many CPUs (the map is per CPU and preallocated;
    /// 64 MiB budget). It holds the sites counted in the last two rounds only: older ones are
    /// kept by heaptrace itself.
    #[arg(long, value_name = "SITES", value_parser = clap::value_parser!(u32).range(1..=1 << 22))]
    pub site_map_size: Option<u32>,

    /// Capacity of the live-block map (blocks tracked at once).
    ///
    /// Slots for a sixteenth more (at most 65,536) stand in front of it. Kernel memory: 16
    /// bytes a block of capacity from the start (64 MiB at the default) and ~105 bytes a
    /// block held. --in-process: a table of this many slots (a power of two) of 40 bytes, its
    /// pages used as written. A block with no room is counted in lost.live_map, and the live
    /// and peak figures are then lower bounds, marked so.
    #[arg(long, default_value_t = 1 << 22, value_name = "BLOCKS",
          value_parser = clap::value_parser!(u32).range(1..=1 << 26))]
    pub live_map_size: u32,

    /// Capacity of the size histogram map.
    ///
    /// Its entries are (process, function, size, stack) of about two rounds: older ones are
    /// kept by heaptrace itself. --in-process: a shared table of this many entries (a power
    /// of two, 32 bytes each) behind each thread's own of a sixteenth, pages used as written.
    #[arg(long, default_value_t = 65536, value_name = "ENTRIES",
          value_parser = clap::value_parser!(u32).range(1..=1 << 24))]
    pub size_map_size: u32,

    /// Print where each probe was attached.
    #[arg(short, long)]
    pub verbose: bool,

    /// Put every entry probe at its function's first instruction.
    ///
    /// Even where a later one would cost the target less (see `heaptrace probes`).
    #[arg(long)]
    pub probe_at_entry: bool,

    /// Do not trace the memory behind malloc (mmap, munmap, mremap, brk).
    ///
    /// It is traced with a probe in each syscall's libc wrapper, or, where the allocator's
    /// file has no such wrappers, with two syscall tracepoints, which add about 0.15 us to
    /// every syscall of every process on the host.
    #[arg(long)]
    pub no_reservations: bool,

    /// With -p: count the blocks live before the attach too (a census of its glibc heap).
    ///
    /// The target's threads are stopped while its heap is walked and the blocks in use are
    /// taken into the live figures and leaks ("allocated before attach"), so that their frees
    /// are of known blocks: about 2 s per million blocks here, hence not by default.
    #[arg(long, requires = "pid")]
    pub census: bool,

    /// Trace the memory behind malloc with the syscall tracepoints even where the wrappers
    /// could be probed (to compare the two).
    #[arg(long, hide = true)]
    pub syscall_tracepoints: bool,

    /// At the end, each kernel program's runs and mean run time.
    ///
    /// The kernel's BPF statistics, as bpftop shows them: what the probes' own work costs,
    /// traps aside. Counting adds two clock reads to every run of every BPF program on the
    /// host.
    #[arg(long)]
    pub probe_stats: bool,

    /// Probe a custom allocator instead of the malloc family.
    ///
    /// `prefix:PFX` (PFXmalloc, PFXfree, ...), `rust` (__rust_alloc, __rust_dealloc,
    /// __rust_realloc, __rust_alloc_zeroed) or `FUNC=SYMBOL,...` (e.g.
    /// malloc=my_alloc,free=my_free). With -p or a command; malloc and free are required.
    #[arg(long, value_name = "SPEC", value_parser = crate::targets::custom_symbols::parse,
          conflicts_with = "all")]
    pub allocator_symbols: Option<crate::targets::custom_symbols::Custom>,

    /// Capacity of the kernel's in-flight call map (threads with a call recorded). For tests:
    /// a small one shows that exited threads give their entries back.
    #[arg(long, default_value_t = 16384, value_name = "THREADS", hide = true,
          value_parser = clap::value_parser!(u32).range(1..=1 << 22))]
    pub inflight_map_size: u32,

    /// Process slots per CPU in front of the kernel's process map (a power of two, at most
    /// 256). For tests: one makes processes share it, and all but one count in the map.
    #[arg(long, value_name = "SLOTS", hide = true,
          default_value_t = heaptrace_common::procs::slots(4096))]
    pub proc_slots: u32,

    /// Attach perf-event uprobes even where uprobe_multi links are available (slower to
    /// detach; for benchmarks and tests of the fallback).
    #[arg(long, hide = true)]
    pub perf_uprobes: bool,

    /// Count with atomic adds only, even where the kernel lets the programs turn preemption
    /// off and add plainly (for benchmarks and tests of the fallback).
    #[arg(long, hide = true)]
    pub atomic_counters: bool,

    /// The command to launch and trace (after --).
    #[arg(last = true, value_name = "COMMAND")]
    // Bytes, not text: an argument need not be UTF-8, and reaches the command unchanged.
    pub command: Vec<std::ffi::OsString>,
}

impl TraceArgs {
    /// `--stack-map-size` for the kernel's probes: the kernel maps hold what a process's
    /// rounds name at once, allocated as stacks come (docs/kernel.md, *The stack walk*).
    pub fn kernel_stack_map_size(&self) -> u32 {
        self.stack_map_size.unwrap_or(1 << 18)
    }

    /// `--unwind-table-size` for the kernel's probes: a bound, allocated as used.
    pub fn kernel_unwind_rows(&self) -> u32 {
        self.unwind_table_size.unwrap_or(1 << 24)
    }

    /// `--unwind-table-size` with --in-process: the region's unwind area.
    pub fn in_process_unwind_rows(&self) -> u32 {
        self.unwind_table_size.unwrap_or(1 << 22)
    }

    /// `--stack-map-size` with --in-process: the region's stack table.
    pub fn in_process_stack_map_size(&self) -> u32 {
        self.stack_map_size.unwrap_or(16384)
    }
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Show where each probe would go and why; attaches nothing.
    #[command(after_help = examples::PROBES, max_term_width = 80)]
    Probes(ProbesArgs),
    /// Trace like `heaptrace` does and write every round to a recording.
    #[command(after_help = examples::RECORD, max_term_width = 80)]
    Record(Box<RecordArgs>),
    /// Answer questions about a recording: views, exports, comparisons.
    #[command(after_help = examples::REPORT, max_term_width = 80)]
    Report(ReportArgs),
    /// Count what glibc's heap holds now: a running process's or a core file's.
    #[command(after_help = examples::HEAP, max_term_width = 80)]
    Heap(HeapArgs),
    /// Print a shell completion script.
    #[command(after_help = examples::COMPLETIONS, max_term_width = 80)]
    Completions(CompletionsArgs),
    /// Print the manual page (roff).
    #[command(after_help = examples::MAN, max_term_width = 80)]
    Man(ManArgs),
}

#[derive(Args, Debug)]
pub struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

#[derive(Args, Debug)]
pub struct ManArgs {
    /// The command whose page to print (record, report, probes...); none: heaptrace's.
    #[arg(value_name = "COMMAND")]
    pub command: Option<String>,
}

#[derive(Args, Debug)]
pub struct RecordArgs {
    /// The recording to write.
    #[arg(short, long, value_name = "FILE")]
    pub output: std::path::PathBuf,

    #[command(flatten)]
    pub trace: TraceArgs,
}

#[derive(Args, Debug)]
pub struct HeapArgs {
    /// The running process whose heap to read.
    #[arg(
        short,
        long,
        value_name = "PID",
        conflicts_with = "core",
        required_unless_present = "core"
    )]
    pub pid: Option<u32>,

    /// A core file to read instead (gdb's gcore or the kernel's).
    ///
    /// Its libc is read from this host, and must be the same build.
    #[arg(long, value_name = "FILE")]
    pub core: Option<std::path::PathBuf>,

    /// Hold the process still (ptrace) during the walk, for an exact census.
    ///
    /// Without it the process runs on; a chunk that changes under the walk is read again,
    /// and what stays inconsistent is counted as unreadable, with a warning.
    #[arg(long, requires = "pid")]
    pub stop: bool,

    /// Write the census as JSON to FILE ("-": stdout, instead of the text).
    #[arg(long, value_name = "FILE")]
    pub json: Option<String>,

    /// Replace a file (or a symbolic link, never followed) already at --json.
    #[arg(long)]
    pub force: bool,

    /// How many block sizes the text lists.
    #[arg(long, default_value_t = 20, value_name = "N")]
    pub top: usize,

    /// Find malloc's state from code patterns even where debug symbols are installed (for
    /// tests of the way hosts without them work).
    #[arg(long, hide = true)]
    pub without_symbols: bool,
}

#[derive(Args, Debug)]
pub struct ProbesArgs {
    /// The process whose allocator to look at (default: the host's libc).
    #[arg(short, long, value_name = "PID")]
    pub pid: Option<u32>,

    /// The custom allocator functions to look for, as when tracing.
    #[arg(long, value_name = "SPEC", value_parser = crate::targets::custom_symbols::parse)]
    pub allocator_symbols: Option<crate::targets::custom_symbols::Custom>,

    /// The mode to plan for: in calls mode malloc has no return probe.
    #[arg(long, value_enum, default_value = "stacks")]
    pub mode: Mode,
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
mod tests;
