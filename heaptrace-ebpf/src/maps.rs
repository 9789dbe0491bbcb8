//! The maps, the globals the loader sets, and the small helpers every program shares.
use core::intrinsics::{AtomicOrdering, atomic_cxchg, atomic_xadd, atomic_xchg};

mod stacks;
mod unwind;
pub use stacks::*;
pub use unwind::*;

use aya_ebpf::{
    helpers::{bpf_get_current_comm, bpf_get_smp_processor_id},
    macros::map,
    maps::{Array, HashMap, PerCpuArray, PerCpuHashMap, RingBuf},
};
use heaptrace_common::{
    FUNC_COUNT, InFlight, InFlightSlot, LOSS_COUNT, LatencyHist, LiveBlock, LiveKey, Loss, MemCall,
    ProcCounters, SiteCounters, SiteKey, SizeKey, fills,
    keyed::{SiteSlot, SizeSlot},
    live::LiveSlot,
    procs::{self, ProcSlot},
    sampling,
};

/// Create only: two CPUs adding the same new key must not overwrite each other's counts.
pub const BPF_NOEXIST: u64 = 1;
/// Allocate entries on demand: the map's bound is its capacity, not its footprint.
const BPF_F_NO_PREALLOC: u32 = 1;
/// An array user space can mmap.
pub(crate) const BPF_F_MMAPABLE: u32 = 1 << 10;

/// heaptrace's own tgid, set by the loader: heaptrace never traces itself.
#[unsafe(no_mangle)]
static SELF_TGID: u32 = 0;

/// One of `heaptrace_common::mode`.
#[unsafe(no_mangle)]
static MODE: u32 = heaptrace_common::mode::STACKS;

/// `--sample-bytes` (0: every allocation is sampled) and it times ln 2 in Q16.
///
/// Mutable (.data), unlike the globals above: LLVM merges an anonymous constant into a
/// constant global of the same value, and the `&0u64` the size histogram inserts was merged
/// into a read-only `SAMPLE_BYTES = 0`, so every new size entry started at the sampling rate
/// the loader wrote there. A mutable global is never a merge target.
#[unsafe(no_mangle)]
static mut SAMPLE_BYTES: u64 = 0;

#[unsafe(no_mangle)]
static mut SAMPLE_SCALE: u64 = 0;

/// `--latency-every`: one call in this many, on average, is timed for the latency histograms
/// and, in stacks mode, its block's lifetime (1: every call). Mutable (.data) for the reason
/// given at SAMPLE_BYTES.
#[unsafe(no_mangle)]
static mut LATENCY_EVERY: u32 = 1;

/// See `heaptrace_common::globals::TEMPORARY_ALLOCS`.
#[unsafe(no_mangle)]
static TEMPORARY_ALLOCS: u32 = 1;

/// See `heaptrace_common::globals::RESERVATIONS`.
#[unsafe(no_mangle)]
static RESERVATIONS: u32 = 0;

#[inline(always)]
pub fn reservations() -> bool {
    // SAFETY: a plain read of a global the loader wrote before load.
    unsafe { core::ptr::read_volatile(&RESERVATIONS) != 0 }
}

/// See `heaptrace_common::globals::WATCH_TGID`.
#[unsafe(no_mangle)]
static WATCH_TGID: u32 = 0;

#[inline(always)]
pub fn watch_tgid() -> u32 {
    // SAFETY: a plain read of a global the loader wrote before load.
    unsafe { core::ptr::read_volatile(&WATCH_TGID) }
}

/// Bare mode: see `heaptrace_common::globals::BARE_STACK`.
#[unsafe(no_mangle)]
static BARE_STACK: u32 = 1;

#[inline(always)]
pub fn bare_stack() -> u32 {
    // SAFETY: a plain read of a global the loader wrote before load.
    unsafe { core::ptr::read_volatile(&BARE_STACK) }
}

/// Calls mode: see `heaptrace_common::globals::CALLS_MODE`.
#[unsafe(no_mangle)]
static CALLS_MODE: u32 = 0;

// Capacities are defaults; the loader may resize them (map_max_entries) from the command line.
#[map(name = "PROCS")]
pub static PROCS: PerCpuHashMap<u32, ProcCounters> = PerCpuHashMap::with_max_entries(4096, 0);

/// Process counters in slots, a row per CPU, before PROCS (`heaptrace_common::procs`).
/// Mappable: user space reads the slots every round and frees those of processes gone.
#[map(name = "PROC_SLOTS")]
pub static PROC_SLOTS: Array<ProcSlot> = Array::with_max_entries(1, BPF_F_MMAPABLE);

/// See `heaptrace_common::globals::PROC_SLOTS_SHIFT`.
#[unsafe(no_mangle)]
static PROC_SLOTS_SHIFT: u32 = 0;

/// See `heaptrace_common::globals::SLOT_CPUS`.
#[unsafe(no_mangle)]
static SLOT_CPUS: u32 = 0;

#[inline(always)]
pub fn slot_cpus() -> u32 {
    // SAFETY: a plain read of a global the loader wrote before load.
    unsafe { core::ptr::read_volatile(&SLOT_CPUS) }
}

/// Site counters in slots, a row per CPU, before SITES (`heaptrace_common::keyed`).
#[map(name = "SITE_SLOTS")]
pub static SITE_SLOTS: Array<SiteSlot> = Array::with_max_entries(1, BPF_F_MMAPABLE);

/// See `heaptrace_common::globals::SITE_SLOTS_SHIFT`.
#[unsafe(no_mangle)]
static SITE_SLOTS_SHIFT: u32 = 0;

#[inline(always)]
pub fn site_slots_shift() -> u32 {
    // SAFETY: a plain read of a global the loader wrote before load.
    unsafe { core::ptr::read_volatile(&SITE_SLOTS_SHIFT) }
}

/// Size counts in slots, a row per CPU, before SIZES (`heaptrace_common::keyed`).
#[map(name = "SIZE_SLOTS")]
pub static SIZE_SLOTS: Array<SizeSlot> = Array::with_max_entries(1, BPF_F_MMAPABLE);

/// See `heaptrace_common::globals::SIZE_SLOTS_SHIFT`.
#[unsafe(no_mangle)]
static SIZE_SLOTS_SHIFT: u32 = 0;

#[inline(always)]
pub fn size_slots_shift() -> u32 {
    // SAFETY: a plain read of a global the loader wrote before load.
    unsafe { core::ptr::read_volatile(&SIZE_SLOTS_SHIFT) }
}

/// Values a new map entry starts from, in memory the programs never write: built on the stack,
/// a struct of 300 bytes is zeroed by a memset, a loop over its bytes that the verifier follows
/// through wherever a program may create an entry (start-up time). Mutable, so that LLVM merges
/// no constant of the same value into them (see SAMPLE_BYTES).
static mut PROC_ZERO: ProcCounters = ProcCounters::ZERO;
static mut SITE_ZERO: SiteCounters = SiteCounters::ZERO;

#[inline(always)]
pub fn site_zero() -> &'static SiteCounters {
    // SAFETY: a value nothing writes.
    unsafe { &*(&raw const SITE_ZERO) }
}

#[map(name = "SIZES")]
pub static SIZES: PerCpuHashMap<SizeKey, u64> = PerCpuHashMap::with_max_entries(65536, 0);

#[map(name = "LIVE")]
pub static LIVE: HashMap<LiveKey, LiveBlock> =
    HashMap::with_max_entries(1 << 20, BPF_F_NO_PREALLOC);

/// Live blocks in slots, one per key hash, before the hash map (`live.rs`). Mappable: user
/// space reads and empties the slots of processes gone in place.
#[map(name = "LIVE_SLOTS")]
pub static LIVE_SLOTS: Array<LiveSlot> = Array::with_max_entries(1, BPF_F_MMAPABLE);

/// See `heaptrace_common::globals::LIVE_SLOTS_MASK`.
#[unsafe(no_mangle)]
static LIVE_SLOTS_MASK: u32 = 0;

#[inline(always)]
pub fn live_slots_mask() -> u32 {
    // SAFETY: a plain read of a global the loader wrote before load.
    unsafe { core::ptr::read_volatile(&LIVE_SLOTS_MASK) }
}

/// In-flight records of the threads that own a slot (`inflight.rs`). Mappable: user space
/// frees the slots of threads gone without their exit being seen.
#[map(name = "INFLIGHT_SLOTS")]
pub static INFLIGHT_SLOTS: Array<InFlightSlot> = Array::with_max_entries(1, BPF_F_MMAPABLE);

/// See `heaptrace_common::globals::INFLIGHT_SLOTS_MASK`.
#[unsafe(no_mangle)]
static INFLIGHT_SLOTS_MASK: u32 = 0;

#[inline(always)]
pub fn inflight_slots_mask() -> u32 {
    // SAFETY: a plain read of a global the loader wrote before load.
    unsafe { core::ptr::read_volatile(&INFLIGHT_SLOTS_MASK) }
}

#[map(name = "INFLIGHT")]
pub static INFLIGHT: HashMap<u64, InFlight> = HashMap::with_max_entries(16384, 0);

#[map(name = "LOSSES")]
pub static LOSSES: PerCpuArray<u64> = PerCpuArray::with_max_entries(LOSS_COUNT as u32, 0);

/// Entries created in SITES, SIZES and FRAMES (`heaptrace_common::fills`).
#[map(name = "FILLS")]
pub static FILLS: PerCpuArray<u64> = PerCpuArray::with_max_entries(fills::COUNT, 0);

// Preallocated: without preallocation, fresh per-CPU elements were seen to vanish under bursts
// of inserts (kernel 6.18), and a count that drops silently is worse than a bounded one.
#[map(name = "SITES")]
pub static SITES: PerCpuHashMap<SiteKey, SiteCounters> = PerCpuHashMap::with_max_entries(16384, 0);

#[map(name = "LATENCY")]
pub static LATENCY: PerCpuArray<LatencyHist> = PerCpuArray::with_max_entries(FUNC_COUNT as u32, 0);

/// Process starts and exits, for user space to attach new allocator files and clean up.
#[map(name = "EVENTS")]
pub static EVENTS: RingBuf = RingBuf::with_byte_size(64 * 1024, 0);

/// Byte sampling: bytes left until the next sample. Per CPU rather than per thread: an array
/// lookup is the cheapest state a probe can have, and the exponential gap is memoryless, so an
/// allocation of s bytes is sampled with probability 1 - exp(-s/N) whichever threads' bytes
/// came before it on its CPU. 0 means not drawn yet.
#[map(name = "SAMPLE_LEFT")]
pub static SAMPLE_LEFT: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Latency sampling: calls left until the next timed one (0: not drawn yet). Per CPU, as
/// SAMPLE_LEFT.
#[map(name = "LATENCY_LEFT")]
pub static LATENCY_LEFT: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

/// log2(1 + j/1024) in Q32, filled by the loader (see heaptrace_common::sampling).
#[map(name = "LOG2_TABLE")]
pub static LOG2_TABLE: Array<u64> = Array::with_max_entries(sampling::TABLE_LEN as u32, 0);

/// The switch every allocator program reads first (`heaptrace_common::maps::COUNTING`): user
/// space turns it on once every link is in place, and off before the first is removed, so that
/// no allocation is counted whose release the attach or detach order lets pass unseen.
#[map(name = "COUNTING")]
pub static COUNTING: Array<u32> = Array::with_max_entries(1, 0);

#[inline(always)]
pub fn counting() -> bool {
    // An array lookup the verifier inlines: a bounds check and a load.
    COUNTING.get(0).is_some_and(|on| *on != 0)
}

/// Memory syscalls of traced processes between entry and exit, by thread id.
#[map(name = "MEMCALLS")]
pub static MEMCALLS: HashMap<u32, MemCall> = HashMap::with_max_entries(4096, 0);

/// Memory syscalls of traced processes and the sites of the allocator calls that made them.
#[map(name = "MEMEVENTS")]
pub static MEMEVENTS: RingBuf = RingBuf::with_byte_size(256 * 1024, 0);

/// Execs of traced processes, by tgid: a process's current image is its epoch 1 + this (see
/// `ProcCounters::epoch`). Only processes that had counters get an entry; user space removes
/// it when the process is forgotten.
#[map(name = "EXECS")]
pub static EXECS: HashMap<u32, u32> = HashMap::with_max_entries(4096, 0);

/// Calls counted in bare mode (entries, returns, frees).
#[map(name = "BARE")]
pub static BARE: PerCpuArray<u64> = PerCpuArray::with_max_entries(3, 0);

#[inline(always)]
pub fn bare_count(i: u32) {
    if let Some(p) = BARE.get_ptr_mut(i) {
        // SAFETY: map value pointer.
        add(unsafe { &mut *p }, 1);
    }
}

#[inline(always)]
pub fn add(counter: &mut u64, v: u64) {
    // SAFETY: the pointer comes from a live map value, aligned for u64.
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(counter, v) };
}

#[inline(always)]
pub fn add32(counter: &mut u32, v: u32) {
    // SAFETY: the pointer comes from a live map value, aligned for u32.
    unsafe { atomic_xadd::<u32, u32, { AtomicOrdering::Relaxed }>(counter, v) };
}

/// Compare-and-swap: true if `word` was `old` and is now `new`.
#[inline(always)]
pub fn cas(word: &mut u64, old: u64, new: u64) -> bool {
    // SAFETY: the pointer comes from a live map value, aligned for u64.
    unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(word, old, new)
    }
    .1
}

/// An atomic exchange, for a slot's state or owner set after the fields it guards were written
/// or read: it orders those accesses before it.
#[inline(always)]
pub fn exchange(word: &mut u64, new: u64) {
    // SAFETY: as above.
    unsafe { atomic_xchg::<u64, { AtomicOrdering::SeqCst }>(word, new) };
}

#[inline(always)]
pub fn lose(kind: Loss) {
    lose_index(kind as u32);
}

/// A loss by its index (`Loss as u32`): one path for the verifier, where a `Loss` chosen on
/// several made one each.
#[inline(always)]
pub fn lose_index(kind: u32) {
    if let Some(p) = LOSSES.get_ptr_mut(kind) {
        // SAFETY: map value pointer, valid for the program's run.
        add(unsafe { &mut *p }, 1);
    }
}

#[inline(always)]
pub fn self_tgid() -> u32 {
    // SAFETY: a plain read of a global the loader wrote before load.
    unsafe { core::ptr::read_volatile(&SELF_TGID) }
}

#[inline(always)]
pub fn mode() -> u32 {
    // SAFETY: as above.
    unsafe { core::ptr::read_volatile(&MODE) }
}

#[inline(always)]
pub fn calls_mode() -> bool {
    // SAFETY: as above.
    unsafe { core::ptr::read_volatile(&CALLS_MODE) != 0 }
}

/// Whether an allocation of `size` bytes is sampled: always when sampling is off; otherwise
/// when it crosses this CPU's countdown, which is then drawn again. Read and written without
/// an atomic: a probe preempted between the two by another allocation on the same CPU can
/// only make one gap a little longer or shorter, not bias which sizes get sampled.
#[inline(always)]
pub fn sampled(size: u64) -> bool {
    // SAFETY: a plain read of a global the loader wrote before load; nothing writes it later.
    let n = unsafe { core::ptr::read_volatile(&raw const SAMPLE_BYTES) };
    if n == 0 {
        return true;
    }
    let Some(left) = SAMPLE_LEFT.get_ptr_mut(0) else {
        return true;
    };
    // SAFETY: map value pointer, valid for the program's run.
    let left = unsafe { &mut *left };
    let mut cur = *left;
    if cur == 0 {
        cur = draw_gap();
    }
    if size < cur {
        *left = cur - size;
        return false;
    }
    *left = draw_gap();
    true
}

#[inline(always)]
fn draw_gap() -> u64 {
    // SAFETY: as above.
    let scale = unsafe { core::ptr::read_volatile(&raw const SAMPLE_SCALE) };
    // SAFETY: no preconditions.
    let random = unsafe { aya_ebpf::helpers::bpf_get_prandom_u32() };
    sampling::gap(random, scale, |j| LOG2_TABLE.get(j).copied())
}

/// Whether to time this call for its function's latency histogram. The clock read costs
/// ~45 ns here (a helper and the clocksource behind an indirect call), two a call: the most
/// of what sizes mode adds to counts mode. The gaps between timed calls are drawn uniform over
/// 1..=2N-1 (mean N), so no loop's calls fall in step with them. A plain decrement, as
/// `sampled`: a probe preempted between the read and the write only moves one gap.
#[inline(always)]
pub fn latency_due() -> bool {
    // SAFETY: a plain read of a global the loader wrote before load; nothing writes it later.
    let n = unsafe { core::ptr::read_volatile(&raw const LATENCY_EVERY) };
    if n <= 1 {
        return true;
    }
    let Some(left) = LATENCY_LEFT.get_ptr_mut(0) else {
        return true;
    };
    // SAFETY: map value pointer, valid for the program's run.
    let left = unsafe { &mut *left };
    let cur = *left;
    if cur > 1 {
        *left = cur - 1;
        return false;
    }
    // SAFETY: no preconditions.
    let random = unsafe { aya_ebpf::helpers::bpf_get_prandom_u32() };
    *left = 1 + random % (2 * n - 1);
    true
}

#[inline(always)]
pub fn temporary_allocs() -> u32 {
    // SAFETY: as above.
    unsafe { core::ptr::read_volatile(&TEMPORARY_ALLOCS) }
}

/// Looks up a per-CPU counter struct, creating it zeroed on first use, and counting the
/// creation in FILLS at `fill` (`fills::NONE`: not counted). Returns None (and the caller
/// counts the loss) when the map is full.
#[inline(always)]
pub fn get_or_insert<K, V>(
    map: &PerCpuHashMap<K, V>,
    key: &K,
    zero: &V,
    fill: u32,
) -> Option<&'static mut V> {
    if let Some(p) = map.get_ptr_mut(key) {
        // SAFETY: map value pointer.
        return Some(unsafe { &mut *p });
    }
    // EEXIST means another CPU created it first: fine, the lookup below finds it.
    if map.insert(key, zero, BPF_NOEXIST).is_ok()
        && let Some(n) = FILLS.get_ptr_mut(fill)
    {
        // SAFETY: map value pointer, valid for the program's run.
        add(unsafe { &mut *n }, 1);
    }
    // SAFETY: map value pointer.
    map.get_ptr_mut(key).map(|p| unsafe { &mut *p })
}

/// This process's counters on this CPU, created on first use, with its epoch known: in its
/// slot, or in the process map where another process owns the slot.
#[inline(always)]
pub fn proc_counters(tgid: u32) -> Option<&'static mut ProcCounters> {
    let pc = match proc_slot(tgid) {
        Some(pc) => pc,
        None => match PROCS.get_ptr_mut(tgid) {
            // SAFETY: map value pointer.
            Some(p) => unsafe { &mut *p },
            None => {
                // SAFETY: a value nothing writes.
                let zero = unsafe { &*(&raw const PROC_ZERO) };
                let Some(pc) = get_or_insert(&PROCS, &tgid, zero, fills::NONE) else {
                    lose(Loss::ProcessMap);
                    return None;
                };
                if pc.comm[0] == 0
                    && let Ok(comm) = bpf_get_current_comm()
                {
                    pc.comm = comm;
                }
                pc
            }
        },
    };
    // An insert fills only this CPU's copy (the others start zeroed), and a slot is one CPU's:
    // each looks the epoch up once. Racing writers on one CPU write the same value.
    if pc.epoch == 0 {
        // SAFETY: the value is copied out at once.
        let execs = unsafe { EXECS.get(tgid) }.copied().unwrap_or(0);
        pc.epoch = u64::from(execs) + 1;
    }
    Some(pc)
}

/// The process slots' geometry: the CPUs with a row, and log2 of a row's slots.
#[inline(always)]
fn proc_slot_rows() -> (u32, u32) {
    // SAFETY: plain reads of globals the loader wrote before load.
    (slot_cpus(), unsafe {
        core::ptr::read_volatile(&PROC_SLOTS_SHIFT)
    })
}

/// The slot of `tgid` on this CPU, taken if it is free; None if another owns it (or user space
/// is emptying it, or the table is off).
#[inline(always)]
fn proc_slot(tgid: u32) -> Option<&'static mut ProcCounters> {
    // SAFETY: no preconditions (the verifier inlines it).
    let cpu = unsafe { bpf_get_smp_processor_id() };
    let (cpus, shift) = proc_slot_rows();
    if cpu >= cpus {
        return None;
    }
    let s = PROC_SLOTS.get_ptr_mut(procs::index(cpu, tgid, shift))?;
    // SAFETY: map value pointer, valid for the program's run; only programs on this CPU write
    // the counters while the slot is owned.
    let s = unsafe { &mut *s };
    // SAFETY: an aligned read of a map value.
    let owner = unsafe { core::ptr::read_volatile(&s.owner) };
    if owner == u64::from(tgid) {
        return Some(&mut s.counters);
    }
    if owner != procs::FREE || !cas(&mut s.owner, procs::FREE, u64::from(tgid)) {
        return None;
    }
    // A free slot's counters are zero (user space empties a slot before it frees it).
    if let Ok(comm) = bpf_get_current_comm() {
        s.counters.comm = comm;
    }
    // And a zero entry in the map, once a process: what `has_counters` looks up, rather than
    // every CPU's slot on every memory syscall of the host's processes. User space sums it
    // with the slots (it adds nothing) and deletes it with them.
    // SAFETY: a value nothing writes.
    let _ = PROCS.insert(&tgid, unsafe { &*(&raw const PROC_ZERO) }, BPF_NOEXIST);
    Some(&mut s.counters)
}

/// Whether `tgid` has counters (it allocated while traced): it has an entry in the map, a zero
/// one where its counters are in slots (`proc_slot`). Where the map was full for that entry,
/// its slot on this CPU still says so.
#[inline(always)]
pub fn has_counters(tgid: u32) -> bool {
    // SAFETY: the value is not used.
    if unsafe { PROCS.get(tgid) }.is_some() {
        return true;
    }
    // SAFETY: no preconditions (the verifier inlines it).
    let cpu = unsafe { bpf_get_smp_processor_id() };
    let (cpus, shift) = proc_slot_rows();
    cpu < cpus
        && PROC_SLOTS
            .get(procs::index(cpu, tgid, shift))
            .is_some_and(|s| s.owner == u64::from(tgid))
}

/// An exec: marks `tgid`'s slots on every CPU stale (its earlier image's counters, which user
/// space drops and frees). No program of the process runs meanwhile: its other threads are
/// gone, and this one is in the exec. Returns whether it had any.
#[inline(always)]
pub fn stale_proc_slots(tgid: u32) -> bool {
    let (cpus, shift) = proc_slot_rows();
    let mut had = false;
    for cpu in 0..procs::MAX_CPUS {
        if cpu >= cpus {
            break;
        }
        if let Some(s) = PROC_SLOTS.get_ptr_mut(procs::index(cpu, tgid, shift)) {
            // SAFETY: map value pointer, valid for the program's run.
            let owner = unsafe { &mut (*s).owner };
            had |= cas(owner, u64::from(tgid), u64::from(tgid) | procs::STALE);
        }
    }
    had
}
