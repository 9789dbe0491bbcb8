//! The region an in-process trace (`heaptrace --in-process -- CMD`) shares between the
//! preloaded library (`heaptrace-preload`) and the daemon: a memfd the daemon creates and the
//! library maps. Every thread of the target writes only its own thread slot (counters, exact
//! sizes, per-site counters), with plain stores; the daemon reads the slots each round and sums
//! them, as it sums the kernel's per-CPU counters. Shared between threads, with atomic
//! operations: the live-block table (a block may be freed by another thread), the stack
//! table, the losses and the process's live-heap peak. docs/in-process.md has the design.
//!
//! All offsets follow from the header's capacities (`Layout::of`), so the two sides agree
//! whatever sizes the daemon chose.
use crate::{
    FUNC_COUNT, LOG2_BUCKETS, LOSS_COUNT, ProcCounters, STACK_FRAMES,
    unwind::{ProcModules, Row},
};

/// "HTINPROC", little-endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"HTINPROC");
pub const VERSION: u32 = 8;
/// The environment variable that hands the library its region: `FD:SIZE:TOKEN` (decimal,
/// decimal, 32 hex digits).
pub const ENV: &str = "HEAPTRACE_INPROC";

/// `Header::state`.
pub mod state {
    /// Calls go straight through, uncounted (before the daemon is ready, after it detached).
    pub const OFF: u32 = 0;
    pub const COUNTING: u32 = 1;
}

/// Key words of the shared tables: 0 is an empty slot, `BUSY` one being written, `GONE` one
/// whose block was freed (a live-table tombstone, taken again by a later insert).
pub const EMPTY: u64 = 0;
pub const BUSY: u64 = 1;
pub const GONE: u64 = 2;
/// The first key word that names an entry.
pub const FIRST_KEY: u64 = 3;

/// A thread adds its live-heap changes to the shared count once they reach this many bytes
/// either way (a block this large at once): one shared write per that many bytes, not one
/// per call. The peak is then within this much per thread, either way.
pub const PEAK_BATCH: u64 = 64 << 10;

/// Probes of an open-addressing table before an insert gives up (and counts a loss). A
/// lookup never looks further than an insert may have put the key.
pub const PROBES: u32 = 64;

pub const HEADER_BYTES: usize = 4096;

/// The most rows an unwind area holds (`--unwind-table-size`'s bound).
pub const MAX_UNWIND_ROWS: u32 = 1 << 26;

/// The first page of the region.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Header {
    pub magic: u64,
    pub version: u32,
    /// `crate::mode`: COUNTS, SIZES or STACKS.
    pub mode: u32,
    /// The random token of `ENV`: a descriptor that happens to have the number given is never
    /// taken for the region.
    pub token: [u64; 2],
    /// The pid that took the region (its first image's library): 0 until then. A process
    /// with another pid (a fork's exec) leaves it alone.
    pub owner: u32,
    /// `state`.
    pub state: u32,
    /// 1 + the execs of `owner` whose new image took the region over, each starting it over.
    pub epoch: u32,
    /// `--temporary-allocs`: a block freed by its allocating thread with fewer of that
    /// thread's allocations and frees in between is temporary.
    pub temporary_allocs: u32,
    /// Capacities: thread slots, sites (stacks), site index slots (a power of two), live
    /// table slots (a power of two), size entries per thread (a power of two), frames kept.
    pub threads: u32,
    pub sites: u32,
    pub site_index: u32,
    pub live: u32,
    pub sizes: u32,
    pub depth: u32,
    /// Which function each one is counted as (`Func` index): the provider's aliases (glibc's
    /// memalign is aligned_alloc).
    pub count_as: [u32; FUNC_COUNT],
    /// `--latency-every` (sizes and stacks modes): one allocating call in this many, at
    /// random, is timed, and its block's lifetime measured; 0: none.
    pub latency_every: u32,
    /// Thread slots ever taken (their high-water mark) and sites stored.
    pub threads_used: u32,
    pub sites_used: u32,
    pub losses: [u64; LOSS_COUNT],
    /// The process's live heap (wrapping adds), its highest, and the allocation that
    /// reached it.
    pub peak_live: u64,
    pub peak_max: u64,
    pub peak_size: u64,
    pub peak_stack: i64,
    /// The region's size in bytes.
    pub bytes: u64,
    /// Rows of the unwind area (`--unwind-table-size`); 0: no area, frame pointers only.
    pub unwind_rows: u32,
    /// Why the library of the process that last read the header could not take the region
    /// (`failure`): told to the daemon, which says it at the end. 0: none.
    pub failure: u32,
    /// Calls from threads that share another's pthread data (made by a raw `clone`): not
    /// counted, and counted here (shared, atomic).
    pub raw_thread_calls: u64,
    /// Calls made on a thread while its own call was being counted: a signal handler's that
    /// interrupted it. Not counted, and counted here (atomic).
    pub nested_calls: u64,
    /// Entries of the shared size table (a power of two, or 0: none), which takes the
    /// (function, size, stack) counts a thread's own table has no room for.
    pub shared_sizes: u32,
    pub _pad: u32,
    /// The peak's number and whether a new high waits for a release (as the kernel's
    /// `ProcPeak::seq` and `pending`): the sites' entries keep their figures at the peak.
    pub peak_seq: u64,
    pub peak_pending: u64,
    /// The process's CPython, for the walk's Python frames (`crate::python`), written by the
    /// daemon once it found it, under this seqlock (odd while it changes, 0: none).
    pub py_seq: u64,
    pub python: crate::python::PyProc,
    pub _reserved: [u64; 2],
}

/// `Header::failure`.
pub mod failure {
    /// The region's descriptor was there but could not be mapped whole (its address space:
    /// `ulimit -v`, or `vm.max_map_count`).
    pub const MAP: u32 = 1;
}

const _: () = assert!(core::mem::size_of::<Header>() <= HEADER_BYTES);

/// A thread slot's fixed part; its size entries and site counters follow it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ThreadHead {
    /// The thread id that owns the slot, 0 when free. A slot is only ever written by its
    /// owner; a slot freed keeps its counters, and the next owner adds on.
    pub owner: u32,
    /// Set while the library runs a call of this thread: a call made meanwhile (by the real
    /// allocator, or a signal handler) is nested and goes straight through, as the kernel
    /// path counts only the outermost call.
    pub busy: u32,
    /// The thread's allocations so far (for temporaries).
    pub seq: u64,
    /// The thread's stack: frames are followed only between these addresses.
    pub stack_lo: u64,
    pub stack_hi: u64,
    /// Allocating calls until the next timed one, and the random state that draws the gaps.
    pub countdown: u32,
    pub rng: u32,
    /// Live bytes this thread changed since it last added them to the header's shared live
    /// heap (wrapping, signed): added at `PEAK_BATCH` either way.
    pub live_delta: u64,
    /// 1 + the MiB of stack (address >> 20) of the owner's last call made off its own stack
    /// (a signal's, a coroutine's), found to be the owner's by its thread id: 0 none.
    pub alt_window: u64,
    pub counters: ProcCounters,
}

pub const THREAD_HEAD_BYTES: usize = 512;
const _: () = assert!(core::mem::size_of::<ThreadHead>() <= THREAD_HEAD_BYTES);

/// `ThreadHead::owner` of the shared slot (`Layout::shared`) once a call counted in it.
pub const SHARED_OWNER: u32 = u32::MAX;

/// An exact size count of one thread: (function, size, stack id) -> allocations.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SizeEntry {
    /// `FIRST_KEY` + the size (sizes above u64::MAX - 3 are counted as failures anyway).
    pub key: u64,
    /// Function index << 32 | stack id as u32.
    pub tag: u64,
    pub count: u64,
    pub _pad: u64,
}

/// The stack id of a site whose stack had no room in the stack table (`-ENOSPC`); its
/// counters are each thread's site entry `sites + function`.
pub const LOST_STACK: i32 = -28;

/// What one thread counted of one site.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SiteEntry {
    pub calls: u64,
    pub bytes: u64,
    pub frees: u64,
    pub freed_bytes: u64,
    pub temp_blocks: u64,
    pub temp_bytes: u64,
    pub untracked: u64,
    pub untracked_bytes: u64,
    /// The peak's composition, as the kernel's `SiteCounters::peak_seq` and the two after it.
    pub peak_seq: u64,
    pub peak_blocks: u64,
    pub peak_bytes: u64,
}

impl SiteEntry {
    /// As the kernel's site counters (`SiteCounters::fold_peak`): keeps the live figures of
    /// before the entry's first change since the header's peak number moved on to `seq`.
    #[inline(always)]
    pub fn fold_peak(&mut self, seq: u64) {
        if self.peak_seq != seq {
            (self.peak_blocks, self.peak_bytes) = self.live();
            self.peak_seq = seq;
        }
    }

    /// Live blocks and bytes now, wrapping.
    #[inline(always)]
    pub fn live(&self) -> (u64, u64) {
        crate::peak::live(
            (self.calls, self.frees, self.untracked),
            (self.bytes, self.freed_bytes, self.untracked_bytes),
        )
    }

    /// What this thread's entry adds to its site's live figures to give them at the peak
    /// `seq` (`crate::peak::correction`).
    pub fn at_peak_correction(&self, seq: u64, pending: bool) -> (u64, u64) {
        let kept = (self.peak_seq, self.peak_blocks, self.peak_bytes);
        crate::peak::correction(self.live(), kept, seq, pending)
    }
}

/// The site index: a stack's hash -> its id (its place in the stack records).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IndexEntry {
    pub key: u64,
    pub id: u32,
    pub _pad: u32,
}

/// A stored stack: one allocating function and its return addresses, innermost first.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct StackHead {
    pub func: u32,
    pub len: u32,
    /// 1: the walk reached the stack's end; 0: it was cut (depth, or a frame it could not
    /// follow).
    pub whole: u32,
    pub _pad: u32,
}

/// A live block.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LiveEntry {
    /// `EMPTY`, `BUSY`, `GONE`, or the block's address.
    pub key: u64,
    pub size: u64,
    /// Its site's stack id (`NO_SITE` outside stacks mode) and function.
    pub stack_id: i32,
    pub func: u32,
    /// The allocating thread and its allocation count at the block.
    pub tid: u32,
    pub seq: u32,
    /// When a timed allocation returned it (CLOCK_MONOTONIC, ns); 0: not timed.
    pub ts_ns: u64,
}

/// The unwind area's head: the process's code mappings with unwind tables (as the kernel
/// path's `UNWIND_PROCS` entry), which the daemon rewrites while the target's walks read
/// them; the rows follow. A seqlock: the daemon makes `generation` odd, rewrites `modules`,
/// then makes it even again; a walk keeps what it found only if `generation` was the same
/// even number before and after. A file's rows are written before a module entry points at
/// them, and rewritten (for another file) only after an entry that pointed at them is gone.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct UnwindHead {
    pub generation: u64,
    pub _pad: u64,
    pub modules: ProcModules,
}

/// Entries of a thread's unwind cache (a power of two).
pub const UNWIND_CACHE: usize = 64;

/// `UnwindEntry::row.kind` beyond `unwind::kind`: the frame is stepped by frame pointer (no
/// table for its module), and the same where its module's table did not fit.
/// Bits no table row sets (`unwind::KIND_BITS`, `unwind::CFA_HIGH_BITS`).
pub const CACHED_FP: u8 = 0x80;
pub const CACHED_FP_NO_ROOM: u8 = 0xc0;

/// A return address and what its frame is unwound with.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct UnwindEntry {
    /// 0: empty.
    pub pc: u64,
    pub row: Row,
}

/// A thread's cache of the rows its walks found, direct-mapped by return address: a walk
/// through the same frames again takes no binary search. Written by its thread alone; valid
/// for the modules' `generation` only, and cleared when a walk finds another.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct UnwindCache {
    pub generation: u64,
    pub _pad: u64,
    pub entries: [UnwindEntry; UNWIND_CACHE],
}

/// Where everything is, from the header's capacities.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub thread_stride: usize,
    pub threads: usize,
    pub sizes_at: usize,
    pub sites_at: usize,
    /// The thread's latency histograms: `FUNC_COUNT` of `LOG2_BUCKETS` counts.
    pub latency_at: usize,
    pub index: usize,
    pub stacks: usize,
    pub stack_stride: usize,
    pub live: usize,
    /// Each site's lifetimes (`sites + FUNC_COUNT` of `LOG2_BUCKETS` counts, shared: a block
    /// may be freed by any thread), in units of 1024 ns.
    pub lifetimes: usize,
    /// The shared size table (`shared_sizes` entries, claimed by compare-and-swap): the
    /// counts a thread's own size table had no room for within `PROBES`.
    pub shared_sizes_at: usize,
    pub shared_sizes: usize,
    /// The unwind area (`UnwindHead`, each thread's `UnwindCache` from `caches`, then
    /// `unwind_rows` rows at `rows`); all 0 without one.
    pub unwind: usize,
    pub caches: usize,
    pub rows: usize,
    pub unwind_rows: usize,
    pub bytes: usize,
}

const fn page(n: usize) -> usize {
    (n + 4095) & !4095
}

impl Layout {
    /// None if a capacity is out of its bounds (a hostile or broken header). `sizes` is each
    /// thread's size table, `shared_sizes` the one shared behind them (0: none).
    #[allow(clippy::too_many_arguments)]
    pub const fn of(
        threads: u32,
        sites: u32,
        site_index: u32,
        live: u32,
        sizes: u32,
        shared_sizes: u32,
        depth: u32,
    ) -> Option<Layout> {
        let ok = threads >= 1
            && threads <= 1 << 16
            && sites <= 1 << 22
            && site_index.is_power_of_two()
            && site_index >= 2 * sites
            && site_index <= 1 << 23
            && live.is_power_of_two()
            && live <= 1 << 28
            && sizes.is_power_of_two()
            && sizes <= 1 << 20
            && (shared_sizes == 0 || shared_sizes.is_power_of_two())
            && shared_sizes <= 1 << 24
            && depth as usize <= STACK_FRAMES;
        if !ok {
            return None;
        }
        let sizes_at = THREAD_HEAD_BYTES;
        let sites_at = sizes_at + sizes as usize * core::mem::size_of::<SizeEntry>();
        let site_entries = sites as usize + FUNC_COUNT;
        let latency_at = sites_at + site_entries * core::mem::size_of::<SiteEntry>();
        let thread_stride = page(latency_at + FUNC_COUNT * LOG2_BUCKETS * 8);
        let threads_at = HEADER_BYTES;
        // One slot more: the shared one (`Layout::shared`).
        let index = threads_at + (threads as usize + 1) * thread_stride;
        let stacks = page(index + site_index as usize * core::mem::size_of::<IndexEntry>());
        let stack_stride = core::mem::size_of::<StackHead>() + depth as usize * 8;
        let live_at = page(stacks + sites as usize * stack_stride);
        let lifetimes = page(live_at + live as usize * core::mem::size_of::<LiveEntry>());
        let shared_sizes_at = page(lifetimes + site_entries * LOG2_BUCKETS * 8);
        let entry = core::mem::size_of::<SizeEntry>();
        let bytes = page(shared_sizes_at + shared_sizes as usize * entry);
        Some(Layout {
            thread_stride,
            threads: threads_at,
            sizes_at,
            sites_at,
            latency_at,
            index,
            stacks,
            stack_stride,
            live: live_at,
            lifetimes,
            shared_sizes_at,
            shared_sizes: shared_sizes as usize,
            unwind: 0,
            caches: 0,
            rows: 0,
            unwind_rows: 0,
            bytes,
        })
    }

    /// With an unwind area of `rows` rows for `threads` thread slots at the end (none for 0
    /// rows); None past 2^26 rows.
    pub const fn with_unwind(self, rows: u32, threads: u32) -> Option<Layout> {
        if rows > MAX_UNWIND_ROWS {
            return None;
        }
        if rows == 0 {
            return Some(self);
        }
        let unwind = self.bytes;
        let caches = unwind + page(core::mem::size_of::<UnwindHead>());
        let rows_at = page(caches + threads as usize * core::mem::size_of::<UnwindCache>());
        let bytes = page(rows_at + rows as usize * core::mem::size_of::<Row>());
        Some(Layout {
            unwind,
            caches,
            rows: rows_at,
            unwind_rows: rows as usize,
            bytes,
            ..self
        })
    }

    pub const fn of_header(h: &Header) -> Option<Layout> {
        match Layout::of(
            h.threads,
            h.sites,
            h.site_index,
            h.live,
            h.sizes,
            h.shared_sizes,
            h.depth,
        ) {
            Some(l) => l.with_unwind(h.unwind_rows, h.threads),
            None => None,
        }
    }

    /// The bytes an exec empties (`start, end`): all but the header and the unwind rows. A
    /// file's rows serve any image that maps it, and the daemon, which placed them, keeps
    /// them for the new image; the unwind head and the threads' caches are the earlier
    /// image's, emptied with the rest.
    pub const fn emptied_at_exec(&self) -> (usize, usize) {
        let end = if self.unwind_rows > 0 {
            self.rows
        } else {
            self.bytes
        };
        (HEADER_BYTES, end)
    }

    /// The byte offset of thread slot `i`.
    pub const fn thread(&self, i: usize) -> usize {
        self.threads + i * self.thread_stride
    }

    /// The byte offset of the shared slot, after the thread slots: the calls of threads that
    /// have no slot of their own (made by a raw `clone`, sharing their creator's pthread
    /// data) count there, with atomic adds. Its owner is `SHARED_OWNER` once used.
    pub const fn shared(&self) -> usize {
        self.index - self.thread_stride
    }
}

/// The slot of `ptr` in a live table of `slots` (a power of two): its address in 16-byte units
/// (the allocators' alignment) plus an offset drawn from its 64 MiB region, as the kernel's live
/// slots are placed (`crate::live::index`). Blocks allocated one after another take
/// neighbouring slots, so a call touches the cache lines and pages its neighbours touched, and
/// a run of linear probing stays short; the regions' offsets keep the thread arenas' heaps
/// (64 MiB apart, their blocks at the same offsets) off each other's slots.
#[inline(always)]
pub fn live_slot(ptr: u64, slots: u32) -> usize {
    let region = crate::keyed::mix(ptr >> crate::live::REGION_SHIFT);
    ((ptr >> 4).wrapping_add(region >> 32)) as usize & (slots as usize - 1)
}

/// Where a block whose address's run of slots (`live_slot`, `PROBES` of them) has no room
/// looks next: `LIVE_RETRIES` runs of `LIVE_RETRY_PROBES` slots each, at places drawn from
/// its address. Blocks laid out by address pile up where the table's span of addresses
/// wraps over parts of the heap that are dense at the same offsets (a heap of 3 M blocks of
/// 32 bytes in a table of 4 M slots lost 100,000 in 2 runs of 8); these runs are spread over
/// the whole table instead. A lookup goes through the runs in the same order and stops at
/// an empty slot: an insert never went past one.
pub const LIVE_RETRIES: u32 = 15;
pub const LIVE_RETRY_PROBES: u32 = 16;

/// The first slot of retry run `n` (1-based) of `ptr` in a table of `slots`.
#[inline(always)]
pub fn live_retry_slot(ptr: u64, n: u32, slots: u32) -> usize {
    let h = crate::keyed::mix(ptr ^ (u64::from(n)).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    (h >> 16) as usize & (slots as usize - 1)
}

/// The hash of a stack's return addresses and function: never below `FIRST_KEY`.
#[inline(always)]
pub fn stack_key(func: u32, ips: &[u64]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ func as u64;
    for ip in ips {
        h = (h ^ ip).wrapping_mul(0x0000_0100_0000_01b3);
        h ^= h >> 29;
    }
    if h < FIRST_KEY { h + FIRST_KEY } else { h }
}

/// The slot of a size in a thread's size table of `slots` (a power of two).
#[inline(always)]
pub const fn size_slot(size: u64, tag: u64, slots: u32) -> usize {
    ((size ^ tag.rotate_left(17)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) as usize
        & (slots as usize - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_refuse_out_of_bound_capacities() {
        assert!(Layout::of(1024, 16384, 32768, 1 << 20, 4096, 65536, 127).is_some());
        assert!(Layout::of(0, 16384, 32768, 1 << 20, 4096, 65536, 127).is_none());
        assert!(Layout::of(4, 16384, 16384, 1 << 20, 4096, 65536, 127).is_none());
        assert!(Layout::of(4, 16, 32, 1000, 4096, 65536, 127).is_none());
        assert!(Layout::of(4, 16, 32, 1024, 4096, 65536, 128).is_none());
        assert!(Layout::of(4, 16, 32, 1024, 4096, 1000, 127).is_none());
        assert!(Layout::of(4, 16, 32, 1024, 4096, 1 << 25, 127).is_none());
        let l = Layout::of(4, 16, 32, 1024, 64, 256, 8).unwrap();
        assert!(l.live + 1024 * 40 <= l.lifetimes && l.lifetimes < l.shared_sizes_at);
        assert!(l.shared_sizes_at + 256 * 32 <= l.bytes);
        assert_eq!(l.thread(1) - l.thread(0), l.thread_stride);
        assert_eq!(l.shared(), l.thread(4));
        assert!(l.shared() + l.thread_stride <= l.index);
    }

    #[test]
    fn an_unwind_area_follows_the_rest_page_aligned() {
        let l = Layout::of(4, 16, 32, 1024, 64, 0, 8).unwrap();
        assert_eq!(l.with_unwind(0, 4), Some(l));
        let u = l.with_unwind(1000, 4).unwrap();
        assert_eq!(u.unwind, l.bytes);
        assert_eq!(u.unwind % 4096, 0);
        assert!(u.caches >= u.unwind + core::mem::size_of::<UnwindHead>());
        assert!(u.rows >= u.caches + 4 * core::mem::size_of::<UnwindCache>());
        assert_eq!(u.rows % 4096, 0);
        assert!(u.rows + 1000 * 8 <= u.bytes);
        assert!(l.with_unwind(MAX_UNWIND_ROWS + 1, 4).is_none());
    }

    /// tests/fixtures/hostile.c writes over these, by offset.
    #[test]
    fn the_offsets_a_hostile_fixture_writes_are_these() {
        use core::mem::offset_of;
        assert_eq!(offset_of!(Header, threads), 48);
        assert_eq!(offset_of!(Header, sites), 52);
        assert_eq!(offset_of!(Header, live), 60);
        assert_eq!(offset_of!(Header, sizes), 64);
        assert_eq!(offset_of!(Header, threads_used), 112);
        assert_eq!(offset_of!(Header, sites_used), 116);
        assert_eq!(offset_of!(Header, losses), 120);
        assert_eq!(offset_of!(Header, peak_max), 224);
        assert_eq!(offset_of!(Header, peak_stack), 240);
        assert_eq!(offset_of!(ThreadHead, counters), 56);
        assert_eq!(core::mem::size_of::<crate::FnCounters>(), 24);
    }

    #[test]
    fn stack_keys_are_never_reserved_words() {
        for f in 0..9 {
            assert!(stack_key(f, &[]) >= FIRST_KEY);
            assert!(stack_key(f, &[1, 2, 3]) >= FIRST_KEY);
        }
    }
}
