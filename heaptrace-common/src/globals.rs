/// heaptrace's own tgid: never traced.
pub const SELF_TGID: &str = "SELF_TGID";
/// One of [`super::mode`].
pub const MODE: &str = "MODE";
/// A block freed by the thread that allocated it, with fewer than this many of that
/// thread's allocations and frees in between, is temporary (1: none in between).
pub const TEMPORARY_ALLOCS: &str = "TEMPORARY_ALLOCS";
/// `--sample-bytes`: the mean number of bytes between two sampled allocations; 0 samples
/// every allocation.
pub const SAMPLE_BYTES: &str = "SAMPLE_BYTES";
/// `--latency-every`: one call in this many, on average, is timed for the latency
/// histograms (1: every call).
pub const LATENCY_EVERY: &str = "LATENCY_EVERY";
/// SAMPLE_BYTES * ln 2 in Q16 (see [`super::sampling::gap`]).
pub const SAMPLE_SCALE: &str = "SAMPLE_SCALE";
/// Calls mode (1): a function without a return probe ([`super::COOKIE_NO_RETURN`]) is
/// counted at its entry, and nothing is kept in the live map.
pub const CALLS_MODE: &str = "CALLS_MODE";
/// Bare mode (a benchmark floor): [`BARE_WALK`] walks the user stack at the return,
/// [`BARE_READ`] reads one word of it, 0 only counts.
pub const BARE_STACK: &str = "BARE_STACK";
pub const BARE_WALK: u32 = 1;
pub const BARE_READ: u32 = 2;
/// The one process traced (`-p`, a launched command), whose execs alone are reported; 0
/// reports every exec (`--all`).
pub const WATCH_TGID: &str = "WATCH_TGID";
/// 1 when the memory syscalls are traced (the memory-event ring is read).
pub const RESERVATIONS: &str = "RESERVATIONS";
/// The live slots' count less one (a power of two less one; see [`super::live`]).
pub const LIVE_SLOTS_MASK: &str = "LIVE_SLOTS_MASK";
/// The in-flight slots' count less one (see [`super::InFlightSlot`]).
pub const INFLIGHT_SLOTS_MASK: &str = "INFLIGHT_SLOTS_MASK";
/// 1 when unwind tables are loaded for code without frame pointers (see [`super::unwind`]).
pub const UNWIND: &str = "UNWIND";
/// 1 when a walk in a process without an unwind entry finds each frame's file by its mapping
/// (`bpf_find_vma`) and its rows in `FILE_ROWS`; `VMA_OFFSETS` then holds where it reads
/// (see [`super::unwind::vma`]).
pub const VMA_ROWS: &str = "VMA_ROWS";
pub const VMA_OFFSETS: &str = "VMA_OFFSETS";
/// log2 of the process slots per CPU (see [`super::procs`]).
pub const PROC_SLOTS_SHIFT: &str = "PROC_SLOTS_SHIFT";
/// The process state slots' count less one (see [`super::proc_state`]).
pub const PROC_STATE_MASK: &str = "PROC_STATE_MASK";
/// log2 of the site slots per CPU (see [`super::keyed`]).
pub const SITE_SLOTS_SHIFT: &str = "SITE_SLOTS_SHIFT";
/// log2 of the size slots per CPU (see [`super::keyed`]).
pub const SIZE_SLOTS_SHIFT: &str = "SIZE_SLOTS_SHIFT";
/// log2 of the stack cache's words per CPU (see [`super::stack::cache_word`]).
pub const STACK_CACHE_SHIFT: &str = "STACK_CACHE_SHIFT";
/// The CPUs with a row in the slot tables ([`super::procs`], [`super::keyed`]): 0 when
/// the tables are off.
pub const SLOT_CPUS: &str = "SLOT_CPUS";
/// `--all --comm`: the pattern's bytes and mask ([`super::filter::Pattern`]); a zero mask
/// judges no thread (every process is traced).
pub const COMM_FILTER: &str = "COMM_FILTER";
pub const COMM_FILTER_MASK: &str = "COMM_FILTER_MASK";
/// Byte offsets in the running kernel's `task_struct` of `group_leader` and `comm` (from its
/// BTF): where a thread finds its process's name.
pub const TASK_GROUP_LEADER: &str = "TASK_GROUP_LEADER";
pub const TASK_COMM: &str = "TASK_COMM";
/// `--all --cgroup`: 1 when the kernel judges threads by their cgroup, from the verdicts
/// user space puts in `maps::CGROUP_VERDICTS` (see [`super::filter`]).
pub const CGROUP_FILTER: &str = "CGROUP_FILTER";
/// 1 when only the processes in `maps::FOLLOWED` are traced, and each one they fork is
/// added there at its fork (`-- CMD`, `-p PID --follow-forks`).
pub const FOLLOW_FORKS: &str = "FOLLOW_FORKS";
/// Byte offsets of `pid` and `tgid` in the running kernel's `task_struct`: the fork
/// program reads the new task's.
pub const TASK_PID: &str = "TASK_PID";
pub const TASK_TGID: &str = "TASK_TGID";
/// What the kernel's `oom/mark_victim` tracepoint passes first (its BTF says):
/// [`super::OOM_TASK`], [`super::OOM_PID`], or 0 where the victims are not reported.
pub const OOM_VICTIM: &str = "OOM_VICTIM";
/// 1 when the programs' [`super::preempt`] placeholders were rewritten into calls of the
/// kernel's `bpf_preempt_disable`/`bpf_preempt_enable`: a program counts on its CPU with
/// plain adds between them. 0: they are no-ops and every add is atomic.
pub const PREEMPT_OFF: &str = "PREEMPT_OFF";
