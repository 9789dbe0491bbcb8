//! Types shared by the eBPF programs and the user-space daemon.
//!
//! Every struct is `#[repr(C)]` with explicit padding fields, and its size is asserted at compile
//! time, so the two sides (compiled for different targets) always agree on the layout.
#![no_std]

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
    };
}

/// Key of the exact size histogram: (process, function, requested size).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SizeKey {
    pub tgid: u32,
    pub func: u32,
    pub size: u64,
}

/// Key of the live-allocation map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LiveKey {
    pub tgid: u32,
    pub _pad: u32,
    pub ptr: u64,
}

/// A block allocated and not yet freed.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveBlock {
    pub size: u64,
    pub ts_ns: u64,
    pub tid: u32,
    pub func: u32,
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
    pub func: u32,
    pub _pad: u32,
}

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
}

pub const LOSS_COUNT: usize = 4;

impl Loss {
    pub const ALL: [Loss; LOSS_COUNT] = [
        Loss::LiveMap,
        Loss::SizeHistogram,
        Loss::InFlight,
        Loss::ProcessMap,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Loss::LiveMap => "live_map",
            Loss::SizeHistogram => "size_histogram",
            Loss::InFlight => "in_flight",
            Loss::ProcessMap => "process_map",
        }
    }
}

/// Map names, shared so that a rename on one side cannot silently break the other.
pub mod maps {
    pub const PROCS: &str = "PROCS";
    pub const SIZES: &str = "SIZES";
    pub const LIVE: &str = "LIVE";
    pub const INFLIGHT: &str = "INFLIGHT";
    pub const LOSSES: &str = "LOSSES";
}

/// Globals set by the loader before the programs are loaded.
pub mod globals {
    /// heaptrace's own tgid: never traced.
    pub const SELF_TGID: &str = "SELF_TGID";
}

// Layouts are part of the kernel/user contract: no implicit padding allowed.
const _: () = assert!(core::mem::size_of::<FnCounters>() == 24);
const _: () = assert!(core::mem::size_of::<ProcCounters>() == 24 * FUNC_COUNT + 7 * 8 + 16);
const _: () = assert!(core::mem::size_of::<SizeKey>() == 16);
const _: () = assert!(core::mem::size_of::<LiveKey>() == 16);
const _: () = assert!(core::mem::size_of::<LiveBlock>() == 24);
const _: () = assert!(core::mem::size_of::<InFlight>() == 32);

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: all are #[repr(C)], made only of integers, with no padding (asserted above).
    unsafe impl aya::Pod for FnCounters {}
    unsafe impl aya::Pod for ProcCounters {}
    unsafe impl aya::Pod for SizeKey {}
    unsafe impl aya::Pod for LiveKey {}
    unsafe impl aya::Pod for LiveBlock {}
    unsafe impl aya::Pod for InFlight {}
}
