//! Types shared by the eBPF programs and the user-space daemon.
//!
//! Every struct is `#[repr(C)]` with explicit padding fields, and its size is asserted at compile
//! time, so the two sides (compiled for different targets) always agree on the layout.
#![no_std]

pub mod filter;
pub mod inproc;
pub mod keyed;
pub mod live;
pub mod procs;
pub mod sampling;
pub mod stack;
pub mod unwind;

pub use stack::{CALLER_ID_BASE, STACK_FRAMES, StoredStack};

/// Functions of the malloc family heaptrace probes, as indexes into [`ProcCounters::funcs`].
///
/// `Memalign` gets its own slot because some allocators (jemalloc) define it apart from
/// `aligned_alloc`; where both are one address (glibc) it is probed once, as `AlignedAlloc`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Func {
    Malloc = 0,
    Calloc = 1,
    Realloc = 2,
    Free = 3,
    PosixMemalign = 4,
    AlignedAlloc = 5,
    Memalign = 6,
    Valloc = 7,
    Pvalloc = 8,
}

pub const FUNC_COUNT: usize = 9;

// Every value below FUNC_COUNT is a variant: the kernel side turns a bounded u32 into a Func.
const _: () = assert!(Func::Pvalloc as usize == FUNC_COUNT - 1);

impl Func {
    pub const ALL: [Func; FUNC_COUNT] = [
        Func::Malloc,
        Func::Calloc,
        Func::Realloc,
        Func::Free,
        Func::PosixMemalign,
        Func::AlignedAlloc,
        Func::Memalign,
        Func::Valloc,
        Func::Pvalloc,
    ];

    /// The C symbol name.
    pub const fn name(self) -> &'static str {
        match self {
            Func::Malloc => "malloc",
            Func::Calloc => "calloc",
            Func::Realloc => "realloc",
            Func::Free => "free",
            Func::PosixMemalign => "posix_memalign",
            Func::AlignedAlloc => "aligned_alloc",
            Func::Memalign => "memalign",
            Func::Valloc => "valloc",
            Func::Pvalloc => "pvalloc",
        }
    }

    pub const fn from_u32(v: u32) -> Option<Func> {
        if (v as usize) < FUNC_COUNT {
            Some(Func::ALL[v as usize])
        } else {
            None
        }
    }
}

/// Per-function counters. `calls` counts every outermost call (free(NULL) excluded),
/// `bytes` the bytes requested by successful calls (for `free`: bytes released of known blocks),
/// `failed` the calls that returned NULL / an error.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FnCounters {
    pub calls: u64,
    pub bytes: u64,
    pub failed: u64,
}

/// Cumulative counters of one process (per CPU in the kernel; user space sums the CPUs).
///
/// `live_blocks`/`live_bytes` are signed deltas stored as wrapping u64: a block allocated on one
/// CPU and freed on another leaves +1 on the first and -1 on the second; the sum is exact.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcCounters {
    pub funcs: [FnCounters; FUNC_COUNT],
    pub live_blocks: u64,
    pub live_bytes: u64,
    /// Frees (and realloc moves/frees) of pointers not in the live map: allocated before attach,
    /// lost to a full live map, or handed to free() by libc itself (glibc's thread teardown
    /// frees the chunks cached in the thread's tcache, which the program had already freed).
    pub untracked_frees: u64,
    /// realloc that returned a new address (a free of the old block + an allocation).
    pub realloc_moves: u64,
    /// realloc that kept the address (a resize).
    pub realloc_in_place: u64,
    /// realloc(p, 0) with p != NULL: a free.
    pub realloc_frees: u64,
    /// Bytes of known blocks released by realloc (moves and realloc(p, 0)).
    pub realloc_released_bytes: u64,
    /// Command name (task comm) of the thread that first allocated.
    pub comm: [u8; 16],
    /// Which image of the process these counters belong to: 1 + the number of its execs seen
    /// while traced (0 until this CPU's copy has looked it up). The keys of its sizes, sites
    /// and live blocks carry it, so that what an image left behind in those maps is told apart
    /// from what the next image counts.
    pub epoch: u64,
}

impl ProcCounters {
    pub const ZERO: ProcCounters = ProcCounters {
        funcs: [FnCounters {
            calls: 0,
            bytes: 0,
            failed: 0,
        }; FUNC_COUNT],
        live_blocks: 0,
        live_bytes: 0,
        untracked_frees: 0,
        realloc_moves: 0,
        realloc_in_place: 0,
        realloc_frees: 0,
        realloc_released_bytes: 0,
        comm: [0; 16],
        epoch: 0,
    };
}

/// Key of the exact size histogram: (process, function, requested size, allocation site's
/// stack id: [`NO_SITE`] outside stacks mode).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SizeKey {
    pub tgid: u32,
    pub func: u32,
    pub size: u64,
    pub stack_id: i32,
    /// [`ProcCounters::epoch`] of the image that counted it.
    pub epoch: u32,
}

/// Key of the live-allocation map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LiveKey {
    pub tgid: u32,
    /// [`ProcCounters::epoch`] of the image that allocated it.
    pub epoch: u32,
    pub ptr: u64,
}

/// A block allocated and not yet freed.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveBlock {
    pub size: u64,
    /// The allocation's time where its call was timed (`--latency-every`), for its lifetime;
    /// 0 otherwise.
    pub ts_ns: u64,
    pub tid: u32,
    pub func: u32,
    /// The allocation site's stack id ([`NO_SITE`] outside stacks mode, negative errno when the
    /// stack could not be stored).
    pub stack_id: i32,
    /// The allocating thread's [`InFlight::seq`] before this block: a free by the same thread
    /// with fewer than `globals::TEMPORARY_ALLOCS` allocations in between makes it temporary.
    pub seq: u32,
}

/// `LiveBlock::stack_id` of a block allocated while no stacks were collected.
pub const NO_SITE: i32 = i32::MIN;

/// Stack id of an allocation that byte sampling (`--sample-bytes`) left out: it is counted in
/// the per-function counters and the size histogram, under this id, and nowhere else.
pub const NOT_SAMPLED: i32 = i32::MIN + 1;

/// Stack id of a block that was live when heaptrace attached (`-p`): put in the live map by
/// user space from a census of the heap, its size known, its site and function not. Its free
/// is a free of a known block, counted at no site.
pub const BEFORE_ATTACH: i32 = i32::MIN + 2;

/// `LiveBlock::func` of a block live before attach: no function of the family.
pub const BEFORE_ATTACH_FUNC: u32 = u32::MAX;

/// What the probes collect; each mode adds to the one before and pays only for what it adds.
pub mod mode {
    /// Per-function counters and the live-block map.
    pub const COUNTS: u32 = 0;
    /// + the exact size histogram and the per-function latency histogram.
    pub const SIZES: u32 = 1;
    /// + the user stack of every allocation, aggregated per (process, stack, function).
    pub const STACKS: u32 = 2;
    /// Benchmark baseline, not a tracing mode: the same probes, programs that only walk the
    /// user stack at the return and count calls. What heaptrace's real work costs is the
    /// difference.
    pub const BARE: u32 = 255;
}

/// Buckets of the power-of-two histograms: bucket `b` holds values in `[2^(b-1), 2^b)`,
/// bucket 0 holds 0, the last bucket everything from `2^(LOG2_BUCKETS-2)` up.
pub const LOG2_BUCKETS: usize = 32;

/// The number of significant bits of `v` (0 for 0). BPF has no count-leading-zeros
/// instruction, and a binary search made the verifier follow each result on its own path
/// through the rest of a program (a result is an index, so its value is kept): the top bit is
/// smeared down and the ones counted instead, with no branch.
#[inline(always)]
pub fn bit_length(v: u64) -> u32 {
    let mut x = v;
    x |= x >> 1;
    x |= x >> 2;
    x |= x >> 4;
    x |= x >> 8;
    x |= x >> 16;
    x |= x >> 32;
    x -= (x >> 1) & 0x5555_5555_5555_5555;
    x = (x & 0x3333_3333_3333_3333) + ((x >> 2) & 0x3333_3333_3333_3333);
    x = (x + (x >> 4)) & 0x0f0f_0f0f_0f0f_0f0f;
    (x.wrapping_mul(0x0101_0101_0101_0101) >> 56) as u32
}

/// The bucket of `v`: the number of significant bits, capped at the last bucket.
#[inline(always)]
pub fn log2_bucket(v: u64) -> usize {
    let r = bit_length(v) as usize;
    if r >= LOG2_BUCKETS {
        LOG2_BUCKETS - 1
    } else {
        r
    }
}

/// The smallest value that lands in bucket `b`.
pub const fn log2_bucket_floor(b: usize) -> u64 {
    if b == 0 { 0 } else { 1u64 << (b - 1) }
}

/// An allocation site: the process, the user stack (id in the stack map) and the function.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SiteKey {
    pub tgid: u32,
    /// Stored stack id (see [`CALLER_ID_BASE`]), or a negative errno when the stack could not be stored ("stack lost").
    pub stack_id: i32,
    pub func: u32,
    /// [`ProcCounters::epoch`] of the image that allocated there.
    pub epoch: u32,
}

/// Cumulative counters of one allocation site (per CPU in the kernel).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SiteCounters {
    /// Successful allocations and the bytes they requested.
    pub calls: u64,
    pub bytes: u64,
    /// Blocks of this site released (free, realloc move or realloc(p, 0)) and their bytes.
    /// Live blocks and bytes are calls - frees - untracked and bytes - freed_bytes -
    /// untracked_bytes: derived in user space rather than kept, two atomic adds fewer on every
    /// allocation and free.
    pub frees: u64,
    pub freed_bytes: u64,
    /// Blocks freed by their allocating thread with fewer than `globals::TEMPORARY_ALLOCS` of
    /// its allocations in between.
    pub temp_blocks: u64,
    pub temp_bytes: u64,
    /// Blocks counted here that the live map refused (full), and their bytes: their frees
    /// cannot be told to be this site's, so they leave the live figures at once.
    pub untracked: u64,
    pub untracked_bytes: u64,
    // No size histogram: the exact one (SIZES) is keyed by stack too, and user space folds a
    // site's from it. One atomic add less per allocation, and a site is 40 % smaller on every
    // CPU (the map is per CPU and preallocated).
    /// Lifetimes of released blocks whose allocation was timed (`--latency-every`), in units
    /// of 1024 ns (~us), power-of-two buckets.
    pub lifetimes: [u64; LOG2_BUCKETS],
}

impl SiteCounters {
    pub const ZERO: SiteCounters = SiteCounters {
        calls: 0,
        bytes: 0,
        frees: 0,
        freed_bytes: 0,
        temp_blocks: 0,
        temp_bytes: 0,
        untracked: 0,
        untracked_bytes: 0,
        lifetimes: [0; LOG2_BUCKETS],
    };
}

/// Time from entry to return of one call, per function: power-of-two buckets of nanoseconds.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LatencyHist {
    pub buckets: [u64; LOG2_BUCKETS],
}

/// An outermost allocation call between its entry and return probe, keyed by thread
/// (pid_tgid). `sp` is the stack pointer at entry: a call entered with a lower stack pointer is
/// nested inside it (realloc(NULL, n) runs malloc's code); a call at or above it means the
/// record is stale (its return was never seen) and is replaced.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InFlight {
    /// realloc: the old pointer; posix_memalign: the address of `memptr`.
    pub arg: u64,
    pub size: u64,
    pub sp: u64,
    /// Entry time (0 in counts mode, which measures no latency).
    pub ts_ns: u64,
    pub func: u32,
    /// [`INFLIGHT_RESERVED`] once the call made a memory syscall (mmap, brk, ...).
    pub flags: u32,
    /// The thread's allocations so far (wrapping, from a random start): kept from call to
    /// call, for temporaries.
    pub seq: u32,
    /// Whether the thread's process is traced, where a filter applies (one of [`filter`]'s
    /// verdicts): kept from call to call, judged again at an exec.
    pub verdict: u32,
    /// The cgroup a [`filter::EXCLUDED_CGROUP`] verdict was taken in: a thread moved out of it
    /// is judged again.
    pub cgroup: u64,
}

/// One slot of the in-flight array: the thread that owns it (its pid_tgid; 0 when free) and
/// its record. A thread takes the slot of its thread id's low bits once, with a
/// compare-and-swap, and keeps it until it exits; a thread whose slot another owns keeps its
/// record in the in-flight hash map. Only the owner reads or writes the record: an array
/// lookup instead of a hash lookup at each entry, return and free (BENCHMARKS.md, *Slots
/// before the hash maps*).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InFlightSlot {
    pub owner: u64,
    pub rec: InFlight,
}

/// The in-flight slots for an in-flight map of `inflight_map_size` threads: the largest power
/// of two up to it, at most 65,536 (4 MiB).
pub fn inflight_slots(inflight_map_size: u32) -> u32 {
    let want = inflight_map_size.clamp(1, 1 << 16);
    1 << (31 - want.leading_zeros())
}

impl InFlight {
    /// No call in flight.
    pub const NONE: InFlight = InFlight {
        arg: 0,
        size: 0,
        sp: 0,
        ts_ns: 0,
        func: 0,
        flags: 0,
        seq: 0,
        verdict: filter::UNKNOWN,
        cgroup: 0,
    };
}

/// `InFlight::flags`: the call changed the process's mappings; its return reports its site so
/// user space can attribute the reservation to it.
pub const INFLIGHT_RESERVED: u32 = 1;

/// Indexes of the per-CPU loss counters: every bounded map that can fill counts what it dropped.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loss {
    /// An allocation could not be recorded in the live map (full): its free will be untracked.
    LiveMap = 0,
    /// A (process, function, size) triple did not fit in the size histogram.
    SizeHistogram = 1,
    /// A call could not be recorded in the in-flight map: it was not counted.
    InFlight = 2,
    /// A process did not fit in the process map: its calls were not counted.
    ProcessMap = 3,
    /// An allocation's stack could not be stored (stack map full or a hash collision): it is
    /// counted under its caller alone (a site whose last frame says more frames were lost),
    /// or, when even that could not be stored, under a "stack lost" site of its process and
    /// function.
    Stack = 4,
    /// A site did not fit in the site map: its allocations are missing from the per-site views.
    SiteMap = 5,
    /// A process start did not fit in the event ring: a new allocator file it uses may be
    /// attached late (when another process using it starts).
    ProcessEvents = 6,
    /// A memory syscall (mmap, munmap, mremap, brk) or its call's site did not fit in the
    /// memory-event ring or the syscall map: the reserved-memory figures may be off.
    MemEvents = 7,
    /// A stack was cut at a frame whose unwind row has no rule heaptrace follows (a DWARF
    /// expression: a signal frame, a PLT stub) or at an address no row covers.
    UnwindNoRule = 8,
    /// A stack walked through a module whose unwind table did not fit (`--unwind-table-size`,
    /// or more code mappings than a process's table holds): by frame pointer there, and
    /// likely cut.
    UnwindTable = 9,
    /// A stack was cut at the walk's depth (127 frames) with frames left.
    StackDepth = 10,
}

pub const LOSS_COUNT: usize = 11;

impl Loss {
    pub const ALL: [Loss; LOSS_COUNT] = [
        Loss::LiveMap,
        Loss::SizeHistogram,
        Loss::InFlight,
        Loss::ProcessMap,
        Loss::Stack,
        Loss::SiteMap,
        Loss::ProcessEvents,
        Loss::MemEvents,
        Loss::UnwindNoRule,
        Loss::UnwindTable,
        Loss::StackDepth,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Loss::LiveMap => "live_map",
            Loss::SizeHistogram => "size_histogram",
            Loss::InFlight => "in_flight",
            Loss::ProcessMap => "process_map",
            Loss::Stack => "stack",
            Loss::SiteMap => "site_map",
            Loss::ProcessEvents => "process_events",
            Loss::MemEvents => "mem_events",
            Loss::UnwindNoRule => "unwind_no_rule",
            Loss::UnwindTable => "unwind_table",
            Loss::StackDepth => "stack_depth",
        }
    }
}

/// A process's live heap as the kernel keeps it at each tracked allocation and release, and
/// the highest it reached, with the allocation that reached it (`maps::PEAKS`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcPeak {
    /// Live bytes now (wrapping adds: a release is an add of the negated size).
    pub live: u64,
    /// The highest `live` reached.
    pub max: u64,
    /// The size and stack id ([`NO_SITE`] outside stacks mode) of the allocation that
    /// reached `max`.
    pub max_size: u64,
    pub max_stack: i32,
    pub epoch: u32,
}

impl ProcPeak {
    pub const ZERO: ProcPeak = ProcPeak {
        live: 0,
        max: 0,
        max_size: 0,
        max_stack: NO_SITE,
        epoch: 0,
    };
}

/// A process started (exec) or forked (followed processes only), from the scheduler's
/// tracepoints.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcEvent {
    /// [`PROC_EXEC`], [`PROC_FORK`] or [`PROC_OOM`].
    pub kind: u32,
    pub tgid: u32,
    /// Its cgroup (v2) id, read in the kernel: a process may be gone before user space could
    /// read /proc.
    pub cgroup_id: u64,
    /// Its new command name, for the same reason.
    pub comm: [u8; 16],
}

pub const PROC_EXEC: u32 = 1;
/// A followed process forked ([`globals::FOLLOW_FORKS`]): `tgid` is the new process, `comm`
/// and `cgroup_id` its parent's, which it has until it execs.
pub const PROC_FORK: u32 = 2;
/// The kernel's OOM killer chose `tgid` as its victim (`oom/mark_victim`; SIGKILL is sent
/// already); `comm` and `cgroup_id` are zero: the task that ran into the limit is not it.
pub const PROC_OOM: u32 = 3;

/// `globals::OOM_VICTIM`: the victim's `task_struct` (newer kernels; its tgid read at
/// `TASK_TGID`), or its pid (before).
pub const OOM_TASK: u32 = 1;
pub const OOM_PID: u32 = 2;

/// The memory syscalls heaptrace follows (x86-64 numbers), and the kinds of [`MemEvent`].
pub mod mem {
    pub const MMAP: u32 = 9;
    pub const MUNMAP: u32 = 11;
    pub const BRK: u32 = 12;
    pub const MREMAP: u32 = 25;
    /// Not a syscall: an allocator call that made memory syscalls returned; `args[0]` is its
    /// site's stack id (as i64; `NO_SITE` outside stacks mode).
    pub const CALL_END: u32 = 0x100;
    /// Not a syscall: the process exec'ed, after the events of its earlier image and before
    /// any of its new one's. What the earlier image mapped is gone; its break is no longer the
    /// process's.
    pub const EXEC: u32 = 0x101;
    /// `MemEvent::func` of a syscall made outside any allocator call.
    pub const NO_FUNC: u32 = u32::MAX;
    /// Or'ed into munmap's and mremap's number: the syscall is about to run (`ret` 0). Their
    /// release of the old range is applied here, before the kernel frees it for another
    /// thread's mmap, whose event could otherwise come first.
    pub const BEGIN: u32 = 0x1000;
    /// Or'ed into munmap's and mremap's number: the syscall failed; the range is mapped still.
    pub const FAILED: u32 = 0x2000;
    /// Attach cookie flag of a wrapper's entry probe (the cookie's low bits: the number).
    pub const COOKIE_BEGIN: u64 = 1 << 32;

    /// Whether syscall `nr` gives a range back (munmap, mremap): reported as it begins too.
    #[inline(always)]
    pub fn releases(nr: u32) -> bool {
        nr == MUNMAP || nr == MREMAP
    }
}

/// A memory syscall of a traced process, reported at its (successful) return, or the end of
/// the allocator call that made it; munmap and mremap are also reported as they begin, and when
/// they fail (see [`mem::BEGIN`]).
///
/// `args`: mmap (addr, len, prot, flags); munmap (addr, len); mremap (old addr, old len, new
/// len, flags); brk (requested break). `ret`: mmap/mremap the address, brk the new break.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemEvent {
    /// A syscall number of [`mem`], or [`mem::CALL_END`].
    pub kind: u32,
    pub tgid: u32,
    pub tid: u32,
    /// The allocator function in flight on the thread ([`Func`] index), or [`mem::NO_FUNC`].
    pub func: u32,
    pub args: [u64; 4],
    pub ret: u64,
}

/// A memory syscall between its entry and exit, by thread.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemCall {
    pub nr: u32,
    pub func: u32,
    pub args: [u64; 4],
}

/// Map names, shared so that a rename on one side cannot silently break the other.
pub mod maps {
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
    pub const FRAMES: &str = "FRAMES";
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
    /// One u32: 1 while the programs count, 0 before every probe is in place and from the
    /// start of the detach (see heaptrace's `probe::Probes::enable`).
    pub const COUNTING: &str = "COUNTING";
    pub const UNWIND_ROWS: &str = "UNWIND_ROWS";
    pub const UNWIND_PROCS: &str = "UNWIND_PROCS";
    pub const UNWIND_CACHE: &str = "UNWIND_CACHE";
}

/// Globals set by the loader before the programs are loaded.
pub mod globals {
    /// heaptrace's own tgid: never traced.
    pub const SELF_TGID: &str = "SELF_TGID";
    /// One of [`super::mode`].
    pub const MODE: &str = "MODE";
    /// A block freed by the thread that allocated it, with fewer than this many of that
    /// thread's allocations in between, is temporary (1: none in between).
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
    /// Bare mode (a benchmark floor): 1 walks the user stack at the return, 0 only counts.
    pub const BARE_STACK: &str = "BARE_STACK";
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
    /// log2 of the process slots per CPU (see [`super::procs`]).
    pub const PROC_SLOTS_SHIFT: &str = "PROC_SLOTS_SHIFT";
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
}

/// Calls the loader rewrites before any kernel sees the programs: aya cannot call kfuncs, so
/// a program calls these helper numbers, which no kernel has, and heaptrace's `bpf::kfunc`
/// replaces each such call with a call of the kfunc named (its BTF id in vmlinux), or with a
/// no-op where the kernel lacks it (then [`globals::PREEMPT_OFF`] is 0 and every add stays atomic).
pub mod preempt {
    /// `bpf_preempt_disable` (Linux 6.10+).
    pub const PREEMPT_DISABLE: i32 = 0x6874_0001;
    /// `bpf_preempt_enable`.
    pub const PREEMPT_ENABLE: i32 = 0x6874_0002;
}

/// An entry probe's attach cookie: the pushes executed before the probe point (see
/// heaptrace's `placement`) in the low bits, and this bit when the function has no return
/// probe (calls mode's malloc): the call is counted at its entry and opens no in-flight window.
pub const COOKIE_NO_RETURN: u64 = 1 << 32;
pub const COOKIE_PUSHES: u64 = 0xffff_ffff;

/// The largest request an allocator can satisfy: glibc and jemalloc refuse anything above
/// PTRDIFF_MAX without trying. Calls mode, which does not see malloc return, counts such a
/// request as failed at the entry; it sees no other failure of malloc.
pub const MAX_REQUEST: u64 = i64::MAX as u64;

// Layouts are part of the kernel/user contract: no implicit padding allowed.
const _: () = assert!(core::mem::size_of::<FnCounters>() == 24);
const _: () = assert!(core::mem::size_of::<ProcCounters>() == 24 * FUNC_COUNT + 7 * 8 + 16 + 8);
const _: () = assert!(core::mem::size_of::<SizeKey>() == 24);
const _: () = assert!(core::mem::size_of::<LiveKey>() == 16);
const _: () = assert!(core::mem::size_of::<LiveBlock>() == 32);
const _: () = assert!(core::mem::size_of::<InFlight>() == 56);
const _: () = assert!(core::mem::size_of::<InFlightSlot>() == 64);
const _: () = assert!(core::mem::size_of::<SiteKey>() == 16);
const _: () = assert!(core::mem::size_of::<StoredStack>() == 8 * (1 + STACK_FRAMES));
const _: () = assert!(core::mem::size_of::<SiteCounters>() == 8 * 8 + 8 * LOG2_BUCKETS);
const _: () = assert!(core::mem::size_of::<LatencyHist>() == 8 * LOG2_BUCKETS);
const _: () = assert!(core::mem::size_of::<ProcEvent>() == 32);
const _: () = assert!(core::mem::size_of::<MemEvent>() == 56);
const _: () = assert!(core::mem::size_of::<MemCall>() == 40);

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: all are #[repr(C)], made only of integers, with no padding (asserted above).
    unsafe impl aya::Pod for FnCounters {}
    unsafe impl aya::Pod for ProcCounters {}
    unsafe impl aya::Pod for SizeKey {}
    unsafe impl aya::Pod for LiveKey {}
    unsafe impl aya::Pod for LiveBlock {}
    unsafe impl aya::Pod for live::LiveSlot {}
    unsafe impl aya::Pod for procs::ProcSlot {}
    unsafe impl aya::Pod for keyed::SiteSlot {}
    unsafe impl aya::Pod for keyed::SizeSlot {}
    unsafe impl aya::Pod for InFlight {}
    unsafe impl aya::Pod for ProcPeak {}
    unsafe impl aya::Pod for InFlightSlot {}
    unsafe impl aya::Pod for SiteKey {}
    unsafe impl aya::Pod for StoredStack {}
    unsafe impl aya::Pod for SiteCounters {}
    unsafe impl aya::Pod for LatencyHist {}
    unsafe impl aya::Pod for MemEvent {}
    unsafe impl aya::Pod for unwind::Row {}
    unsafe impl aya::Pod for unwind::ProcModules {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bit_length_counts_significant_bits() {
        for v in [0u64, 1, 2, 3, 255, 256, 1 << 40, u64::MAX]
            .into_iter()
            .chain((0..64).flat_map(|b| [1u64 << b, (1u64 << b) - 1, (1u64 << b) | 1]))
        {
            assert_eq!(bit_length(v), 64 - v.leading_zeros(), "{v:#x}");
        }
    }

    #[test]
    fn inflight_slots_are_a_power_of_two_up_to_the_map() {
        assert_eq!(inflight_slots(16384), 16384);
        assert_eq!(inflight_slots(10000), 8192);
        assert_eq!(inflight_slots(u32::MAX), 1 << 16);
        assert_eq!(inflight_slots(1), 1);
        assert_eq!(inflight_slots(0), 1);
    }

    #[test]
    fn log2_buckets_hold_their_floors() {
        assert_eq!(log2_bucket(0), 0);
        assert_eq!(log2_bucket(1), 1);
        assert_eq!(log2_bucket(2), 2);
        assert_eq!(log2_bucket(3), 2);
        assert_eq!(log2_bucket(1000), 10);
        assert_eq!(log2_bucket(1024), 11);
        assert_eq!(log2_bucket(u64::MAX), LOG2_BUCKETS - 1);
        for b in 0..LOG2_BUCKETS {
            assert_eq!(log2_bucket(log2_bucket_floor(b)), b);
        }
    }
}
