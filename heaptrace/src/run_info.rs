//! What a run is: the mode its probes collect in, what it traces, the rule for temporaries,
//! and the one description of it that the JSON document, the live view and the recording
//! header share. Plain values, imported by every stage; they import nothing of heaptrace.
use std::fmt;

use heaptrace_common::Func;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// What the probes collect. From counts on, each mode adds to the one before, and costs more.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// The cheapest: per-function calls and bytes and the exact size histogram, malloc counted
    /// at its entry (no return probe); no live blocks, leaks, latency or reservations.
    Calls,
    /// Per-function calls, bytes, failures; live blocks and leaks.
    Counts,
    /// + the exact size histogram and per-function latency.
    Sizes,
    /// + the user stack of each allocation: sites, leaks, temporaries, peak and lifetimes.
    #[default]
    Stacks,
}

impl Mode {
    pub const ALL: [Mode; 4] = [Mode::Calls, Mode::Counts, Mode::Sizes, Mode::Stacks];

    pub fn name(self) -> &'static str {
        match self {
            Mode::Calls => "calls",
            Mode::Counts => "counts",
            Mode::Sizes => "sizes",
            Mode::Stacks => "stacks",
        }
    }

    pub fn from_name(name: &str) -> Option<Mode> {
        Mode::ALL.into_iter().find(|m| m.name() == name)
    }

    /// Whether malloc is counted at its entry, with no return probe and no live blocks.
    pub fn at_entry(self) -> bool {
        self == Mode::Calls
    }

    /// Whether allocations are kept by site, with their stacks.
    pub fn has_stacks(self) -> bool {
        self == Mode::Stacks
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Benchmark baselines (`--floor`, hidden): a mode's probes with programs that only count, or
/// only walk the stack. Not a mode a user traces in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Floor {
    /// Stacks mode's probes; the programs walk the stack at the return and count.
    Bare,
    /// The probes of counts and sizes modes; the programs only count.
    BareTraps,
    /// Calls mode's probes (no return probe on malloc); the programs only count.
    BareEntry,
    /// Stacks mode's probes; the programs read one word of the user stack at the return and
    /// count: what the least an exact stack needs costs, with no walk.
    BareRead,
}

impl Floor {
    /// The mode whose probes the floor puts on.
    pub fn probes_of(self) -> Mode {
        match self {
            Floor::Bare => Mode::Stacks,
            Floor::BareTraps => Mode::Counts,
            Floor::BareEntry => Mode::Calls,
            Floor::BareRead => Mode::Stacks,
        }
    }
}

/// What a trace follows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TargetKind {
    /// A running process, `-p PID`.
    #[default]
    Pid,
    /// Every process, `--all`.
    All,
    /// A command heaptrace started, `-- CMD`.
    Command,
}

impl TargetKind {
    pub const ALL: [TargetKind; 3] = [TargetKind::Pid, TargetKind::All, TargetKind::Command];

    pub fn name(self) -> &'static str {
        match self {
            TargetKind::Pid => "pid",
            TargetKind::All => "all",
            TargetKind::Command => "command",
        }
    }

    pub fn from_name(name: &str) -> Option<TargetKind> {
        TargetKind::ALL.into_iter().find(|m| m.name() == name)
    }
}

/// What collected a run's figures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Collector {
    /// eBPF uprobes on the allocator, counting in kernel maps (the default).
    #[default]
    Kernel,
    /// The preloaded library of `--in-process`, counting in a region shared with heaptrace.
    InProcess,
    /// The same library loaded into a running process (`-p PID --in-process`) and the malloc
    /// family redirected to it in every module's GOT.
    InProcessAttached,
}

impl Collector {
    pub const ALL: [Collector; 3] = [
        Collector::Kernel,
        Collector::InProcess,
        Collector::InProcessAttached,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Collector::Kernel => "kernel",
            Collector::InProcess => "in-process",
            Collector::InProcessAttached => "in-process-attached",
        }
    }

    /// Counted by the library in the process, however it got there.
    pub fn in_process(self) -> bool {
        self != Collector::Kernel
    }

    /// A recording's name for it; the empty name of recordings before format 11 is the
    /// kernel's.
    pub fn from_name(name: &str) -> Option<Collector> {
        match name {
            "" => Some(Collector::Kernel),
            _ => Collector::ALL.into_iter().find(|c| c.name() == name),
        }
    }
}

/// A run as every output describes it: what it traced and how.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunInfo {
    pub mode: Mode,
    pub target: TargetKind,
    /// The process traced (none under `--all`).
    pub pids: Vec<u32>,
    /// A launched command's argv.
    pub command: Vec<String>,
    /// `--comm` and `--cgroup`: what a system-wide trace was narrowed to.
    pub comm: Option<String>,
    pub cgroup: Option<String>,
    pub interval_ms: u64,
    /// The allocator's file, as the target sees it.
    pub provider: String,
    /// Family members probed as another at the same address: (alias, probed as).
    pub aliases: Vec<(Func, Func)>,
    pub temporary: Temporary,
    /// `--sample-bytes` (0: every allocation).
    pub sample_bytes: u64,
    /// `--latency-every`: one call in this many was timed (0 or 1: every call).
    pub latency_every: u32,
    pub collector: Collector,
}

impl RunInfo {
    /// The base name of the allocator's file: frames in it are the allocator's own.
    pub fn allocator_module(&self) -> &str {
        self.provider.rsplit('/').next().unwrap_or(&self.provider)
    }
}

/// What makes a freed block temporary. heaptrace counts it as heaptrack does: a block freed by
/// the thread that allocated it with fewer than N of that thread's allocations and frees in
/// between (N = 1, the default: none, heaptrack's rule), exactly, from a per-thread count with
/// no clock read. Recordings of formats 7 to 11 counted allocations only (memray's rule, which
/// a free in between does not reset), and those before 7 a block freed within a time of its
/// allocation; each is shown with its rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Temporary {
    /// Fewer than this many of the freeing thread's allocations and frees in between
    /// (`--temporary-allocs`).
    Events(u32),
    /// Fewer than this many of the freeing thread's allocations in between (recordings of
    /// formats 7 to 11).
    Allocs(u32),
    /// Freed within this many milliseconds of its allocation (recordings before format 7).
    WithinMs(u64),
}

impl Default for Temporary {
    fn default() -> Temporary {
        Temporary::Events(1)
    }
}

impl Temporary {
    /// The rule's fields in the JSON document's `temporary` object.
    pub fn json(&self) -> Vec<(&'static str, Value)> {
        match *self {
            Temporary::Events(n) => vec![
                ("rule", json!("freed by its own thread")),
                ("allocations_and_frees_between_below", json!(n)),
            ],
            Temporary::Allocs(n) => vec![
                ("rule", json!("freed by its own thread")),
                ("allocations_between_below", json!(n)),
            ],
            Temporary::WithinMs(ms) => vec![("threshold_ms", json!(ms))],
        }
    }
}

impl fmt::Display for Temporary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Temporary::Events(1) => write!(
                f,
                "freed before its thread's next allocation or free (heaptrack's rule)"
            ),
            Temporary::Events(n) => write!(
                f,
                "freed with fewer than {n} allocations and frees of its thread in between"
            ),
            Temporary::Allocs(1) => write!(f, "freed before its thread's next allocation"),
            Temporary::Allocs(n) => write!(
                f,
                "freed with fewer than {n} allocations of its thread in between"
            ),
            Temporary::WithinMs(ms) => write!(f, "freed within {ms} ms"),
        }
    }
}
