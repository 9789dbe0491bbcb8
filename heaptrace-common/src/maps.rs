pub const PROCS: &str = "PROCS";
pub const SIZES: &str = "SIZES";
pub const LIVE: &str = "LIVE";
pub const LIVE_SLOTS: &str = "LIVE_SLOTS";
pub const PROC_SLOTS: &str = "PROC_SLOTS";
pub const SITE_SLOTS: &str = "SITE_SLOTS";
pub const SIZE_SLOTS: &str = "SIZE_SLOTS";
pub const STACK_CACHE: &str = "STACK_CACHE";
pub const STACK_GEN: &str = "STACK_GEN";
pub const INFLIGHT: &str = "INFLIGHT";
pub const INFLIGHT_SLOTS: &str = "INFLIGHT_SLOTS";
pub const LOSSES: &str = "LOSSES";
/// Entries created in the site, size and frames maps, per CPU, by [`super::fills`] index: how
/// full they are getting between two reads (heaptrace's `drain::relief`).
pub const FILLS: &str = "FILLS";
pub const FRAMES: &str = "FRAMES";
pub const STACK_OWNERS: &str = "STACK_OWNERS";
pub const CALLERS: &str = "CALLERS";
pub const SITES: &str = "SITES";
pub const LATENCY: &str = "LATENCY";
pub const EVENTS: &str = "EVENTS";
pub const SAMPLE_LEFT: &str = "SAMPLE_LEFT";
pub const LOG2_TABLE: &str = "LOG2_TABLE";
pub const MEMCALLS: &str = "MEMCALLS";
pub const MEMEVENTS: &str = "MEMEVENTS";
pub const EXECS: &str = "EXECS";
pub const CGROUP_VERDICTS: &str = "CGROUP_VERDICTS";
/// The followed processes (tgid -> the tgid that forked it, or itself for a root), under
/// [`super::globals::FOLLOW_FORKS`].
pub const FOLLOWED: &str = "FOLLOWED";
/// Each process's live heap and its highest ([`super::ProcPeak`]), by tgid.
pub const PEAKS: &str = "PEAKS";
/// Processes' peaks and unwind entries in slots, before PEAKS and UNWIND_PROCS
/// ([`super::proc_state`]).
pub const PROC_STATE: &str = "PROC_STATE";
/// One u32: 1 while the programs count, 0 before every probe is in place and from the
/// start of the detach (see heaptrace's `probe::Probes::enable`).
pub const COUNTING: &str = "COUNTING";
pub const UNWIND_CHUNKS: &str = "UNWIND_CHUNKS";
pub const UNWIND_PROCS: &str = "UNWIND_PROCS";
pub const UNWIND_CACHE: &str = "UNWIND_CACHE";
pub const FILE_ROWS: &str = "FILE_ROWS";
pub const PY_PROCS: &str = "PY_PROCS";
pub const PY_ON: &str = "PY_ON";
/// Launched Pythons whose `Py_FinalizeEx` is held (tgid -> signal to send).
pub const PY_HOLD: &str = "PY_HOLD";
