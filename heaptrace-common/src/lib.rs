//! Types shared by the eBPF programs and the user-space daemon.
//!
//! Every struct is `#[repr(C)]` with explicit padding fields, and its size is asserted at compile
//! time, so the two sides (compiled for different targets) always agree on the layout.
#![no_std]

pub mod filter;
pub mod histogram;
pub mod inproc;
pub mod keyed;
pub mod live;
pub mod proc_state;
pub mod procs;
pub mod python;
pub mod sampling;
pub mod stack;
pub mod unwind;

pub use histogram::{LOG2_BUCKETS, bit_length, log2_bucket, log2_bucket_floor};
pub use stack::{CALLER_ID_BASE, NO_ROOM_FRAME, STACK_FRAMES, StoredStack};

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

/// The round generation a site or size key of a call made now carries: the stack cache's
/// generation (`stack::CACHE_GEN_MASK`, 15 bits), which user space moves on at every round's
/// read (and after it frees stacks, also while it drains). A key of another generation than
/// the current one was last written before the move, about a round ago: user space takes its
/// last figures, keeps them, and deletes it, so the maps hold the keys of about two rounds,
/// not of the whole run (docs/kernel.md, *Rounds*).
#[inline(always)]
pub fn round_gen(stack_gen: u64) -> u16 {
    (stack_gen & stack::CACHE_GEN_MASK) as u16
}

/// Key of the exact size histogram: (process, function, requested size, allocation site's
/// stack id: [`NO_SITE`] outside stacks mode).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SizeKey {
    pub tgid: u32,
    pub func: u16,
    /// The round generation it was counted in ([`round_gen`]).
    pub round: u16,
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
    /// with fewer than `globals::TEMPORARY_ALLOCS` allocations and frees in between makes it
    /// temporary.
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

/// An allocation site: the process, the user stack (id in the stack map) and the function.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SiteKey {
    pub tgid: u32,
    /// Stored stack id (see [`CALLER_ID_BASE`]), or a negative errno when the stack could not be stored ("stack lost").
    pub stack_id: i32,
    pub func: u16,
    /// The round generation it was counted in ([`round_gen`]).
    pub round: u16,
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
    /// of 1024 ns (~us), power-of-two buckets. 32 bits: a key counts for about two rounds
    /// (`round_gen`), far from 2^32 timed frees, and the daemon copies every site of the map
    /// for every CPU each round; 64-bit buckets were 256 of a site's 344 bytes.
    pub lifetimes: [u32; LOG2_BUCKETS],
    /// The peak's composition, folded lazily (memray's high-water mark): the process's
    /// [`ProcPeak::seq`] this entry last saw, and its live blocks and bytes (as the fields
    /// above give them, wrapping) before its first change after `seq` moved there. An entry
    /// whose `peak_seq` is the process's held those at the peak; any other, its figures now.
    pub peak_seq: u64,
    pub peak_blocks: u64,
    pub peak_bytes: u64,
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
        peak_seq: 0,
        peak_blocks: 0,
        peak_bytes: 0,
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
/// record is stale (its return was never seen) and is replaced. A signal handler's calls are
/// not nested: the delivery of the signal sets the call in flight aside (`level`), and the
/// thread's first probe back above the handler's frames puts it back (heaptrace-ebpf's
/// signals.rs).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InFlight {
    /// realloc: the old pointer; posix_memalign: the address of `memptr`.
    pub arg: u64,
    pub size: u64,
    pub sp: u64,
    /// Entry time (0 in counts mode, which measures no latency).
    pub ts_ns: u64,
    pub func: u16,
    /// Calls of the thread set aside for the signal handlers that interrupted them (0 nearly
    /// always): kept from call to call. 16 bits beside `func`: the record keeps its 56 bytes,
    /// one cache line a slot.
    pub level: u16,
    /// [`INFLIGHT_RESERVED`] once the call made a memory syscall (mmap, brk, ...).
    pub flags: u32,
    /// The thread's allocations and frees so far (wrapping, from a random start): kept from
    /// call to call, for temporaries.
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
        level: 0,
        flags: 0,
        seq: 0,
        verdict: filter::UNKNOWN,
        cgroup: 0,
    };
}

/// `InFlight::flags`: the call changed the process's mappings; its return reports its site so
/// user space can attribute the reservation to it.
pub const INFLIGHT_RESERVED: u32 = 1;

mod loss;
pub use loss::{LOSS_COUNT, Loss};

mod peak;
pub use peak::ProcPeak;

/// A process started (exec) or forked (followed processes only), from the scheduler's
/// tracepoints.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcEvent {
    /// [`PROC_EXEC`], [`PROC_FORK`], [`PROC_OOM`] or [`PROC_LEFT`].
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
/// The `-p` process ([`globals::WATCH_TGID`]) forked `tgid`, not followed: the child has its
/// parent's breakpoints (a copy of its text) and no link counts them; user space writes the
/// file's bytes back over them. `comm` and `cgroup_id` are the parent's.
pub const PROC_LEFT: u32 = 4;

/// `globals::OOM_VICTIM`: the victim's `task_struct` (newer kernels; its tgid read at
/// `TASK_TGID`), or its pid (before).
pub const OOM_TASK: u32 = 1;
pub const OOM_PID: u32 = 2;

/// The memory syscalls heaptrace follows (x86-64 numbers), and the kinds of [`MemEvent`].
pub mod mem;

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
pub mod maps;

/// Indexes of [`maps::FILLS`]: the maps whose entries the programs count as they create them.
pub mod fills {
    pub const SITES: u32 = 0;
    pub const SIZES: u32 = 1;
    /// Stacks whose frames were stored in FRAMES.
    pub const FRAMES: u32 = 2;
    pub const COUNT: u32 = 3;
    /// Creations not counted (the process map).
    pub const NONE: u32 = u32::MAX;
}

/// Globals set by the loader before the programs are loaded.
pub mod globals;

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
const _: () = assert!(core::mem::size_of::<SiteCounters>() == 11 * 8 + 4 * LOG2_BUCKETS);
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
    unsafe impl aya::Pod for proc_state::ProcState {}
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
    unsafe impl aya::Pod for unwind::FileRowsKey {}
    unsafe impl aya::Pod for unwind::FileRows {}
    unsafe impl aya::Pod for python::PyProc {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inflight_slots_are_a_power_of_two_up_to_the_map() {
        assert_eq!(inflight_slots(16384), 16384);
        assert_eq!(inflight_slots(10000), 8192);
        assert_eq!(inflight_slots(u32::MAX), 1 << 16);
        assert_eq!(inflight_slots(1), 1);
        assert_eq!(inflight_slots(0), 1);
    }
}
