//! heaptrace's eBPF programs: thin `#[uprobe]`/`#[uretprobe]` shims over `try_*` functions.
//!
//! Everything is aggregated in the kernel into cumulative per-CPU counters; user space reads
//! them every round and takes differences (see `heaptrace::drain`). Per-CPU values are updated
//! with atomic adds because a uprobe program is preemptible: another task on the same CPU can run
//! the same program in the middle of an update.
#![no_std]
#![no_main]
// The bpf target has no compare-and-swap, so core's AtomicU64::fetch_add is not offered; the
// intrinsic lowers to the BPF atomic add instruction.
#![allow(internal_features)]
#![feature(core_intrinsics)]

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use aya_ebpf::{
    EbpfContext as _,
    helpers::{
        bpf_get_attach_cookie, bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns,
        bpf_probe_read_user,
    },
    macros::{map, uprobe, uretprobe},
    maps::{HashMap, PerCpuArray, PerCpuHashMap},
    programs::{ProbeContext, RetProbeContext},
};
use heaptrace_common::{
    FnCounters, Func, InFlight, LOSS_COUNT, LiveBlock, LiveKey, Loss, ProcCounters, SizeKey,
};

const BPF_ANY: u64 = 0;
/// Create only: two CPUs adding the same new key must not overwrite each other's counts.
const BPF_NOEXIST: u64 = 1;
/// Allocate live-map entries on demand: the map's bound is its capacity, not its footprint.
const BPF_F_NO_PREALLOC: u32 = 1;

/// heaptrace's own tgid, set by the loader: heaptrace never traces itself.
#[unsafe(no_mangle)]
static SELF_TGID: u32 = 0;

// Capacities are defaults; the loader may resize them (set_max_entries) from the command line.
#[map(name = "PROCS")]
static PROCS: PerCpuHashMap<u32, ProcCounters> = PerCpuHashMap::with_max_entries(4096, 0);

#[map(name = "SIZES")]
static SIZES: PerCpuHashMap<SizeKey, u64> = PerCpuHashMap::with_max_entries(32768, 0);

#[map(name = "LIVE")]
static LIVE: HashMap<LiveKey, LiveBlock> = HashMap::with_max_entries(1 << 20, BPF_F_NO_PREALLOC);

#[map(name = "INFLIGHT")]
static INFLIGHT: HashMap<u64, InFlight> = HashMap::with_max_entries(16384, 0);

#[map(name = "LOSSES")]
static LOSSES: PerCpuArray<u64> = PerCpuArray::with_max_entries(LOSS_COUNT as u32, 0);

#[inline(always)]
fn add(counter: &mut u64, v: u64) {
    // SAFETY: the pointer comes from a live map value, aligned for u64.
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(counter, v) };
}

#[inline(always)]
fn lose(kind: Loss) {
    if let Some(p) = LOSSES.get_ptr_mut(kind as u32) {
        // SAFETY: map value pointer, valid for the program's run.
        add(unsafe { &mut *p }, 1);
    }
}

#[inline(always)]
fn self_tgid() -> u32 {
    // SAFETY: a plain read of a global the loader wrote before load.
    unsafe { core::ptr::read_volatile(&SELF_TGID) }
}

/// This process's counters on this CPU, created on first use.
#[inline(always)]
fn proc_counters(tgid: u32) -> Option<&'static mut ProcCounters> {
    if let Some(p) = PROCS.get_ptr_mut(tgid) {
        // SAFETY: map value pointer.
        return Some(unsafe { &mut *p });
    }
    let mut fresh = ProcCounters::ZERO;
    if let Ok(comm) = bpf_get_current_comm() {
        fresh.comm = comm;
    }
    // EEXIST means another CPU created it first: fine, the lookup below finds it.
    let _ = PROCS.insert(tgid, fresh, BPF_NOEXIST);
    match PROCS.get_ptr_mut(tgid) {
        // SAFETY: map value pointer.
        Some(p) => Some(unsafe { &mut *p }),
        None => {
            lose(Loss::ProcessMap);
            None
        }
    }
}

#[inline(always)]
fn count_size(tgid: u32, func: Func, size: u64) {
    let key = SizeKey {
        tgid,
        func: func as u32,
        size,
    };
    if let Some(p) = SIZES.get_ptr_mut(key) {
        // SAFETY: map value pointer.
        add(unsafe { &mut *p }, 1);
        return;
    }
    if SIZES.insert(key, 0u64, BPF_NOEXIST).is_err() && SIZES.get_ptr_mut(key).is_none() {
        lose(Loss::SizeHistogram);
        return;
    }
    if let Some(p) = SIZES.get_ptr_mut(key) {
        // SAFETY: map value pointer.
        add(unsafe { &mut *p }, 1);
    }
}

#[inline(always)]
fn track(pc: &mut ProcCounters, tgid: u32, tid: u32, ptr: u64, size: u64, func: Func) {
    let key = LiveKey { tgid, _pad: 0, ptr };
    let block = LiveBlock {
        size,
        ts_ns: unsafe { bpf_ktime_get_ns() },
        tid,
        func: func as u32,
    };
    if LIVE.insert(key, block, BPF_ANY).is_err() {
        lose(Loss::LiveMap);
        return;
    }
    add(&mut pc.live_blocks, 1);
    add(&mut pc.live_bytes, size);
}

/// Forgets a block; returns its size if it was known.
#[inline(always)]
fn untrack(pc: &mut ProcCounters, tgid: u32, ptr: u64) -> Option<u64> {
    let key = LiveKey { tgid, _pad: 0, ptr };
    // SAFETY: the value is copied out before the remove.
    let size = unsafe { LIVE.get(key) }.map(|b| b.size);
    match size {
        Some(size) => {
            let _ = LIVE.remove(key);
            add(&mut pc.live_blocks, u64::MAX); // -1, wrapping
            add(&mut pc.live_bytes, size.wrapping_neg());
            Some(size)
        }
        None => {
            add(&mut pc.untracked_frees, 1);
            None
        }
    }
}

/// Entry of an allocating function: remember its arguments until it returns. A call entered at
/// or below the stack pointer of the call in flight on this thread is nested inside it and is
/// left to the outer call: small-alignment posix_memalign calls malloc (lower stack pointer),
/// and realloc(NULL, n) tail-calls it (`jmp`: the same stack pointer). A call entered above it
/// means the recorded call's return was never seen; the stale record is replaced.
#[inline(always)]
fn enter(ctx: &ProbeContext, func: Func, size: u64, arg: u64) -> Result<(), i64> {
    let id = bpf_get_current_pid_tgid();
    if (id >> 32) as u32 == self_tgid() {
        return Ok(());
    }
    let sp = entry_sp(ctx);
    // SAFETY: map value; only this thread reads or writes its own entry.
    if let Some(f) = unsafe { INFLIGHT.get(id) } {
        if sp <= f.sp {
            return Ok(());
        }
    }
    let rec = InFlight {
        arg,
        size,
        sp,
        func: func as u32,
        _pad: 0,
    };
    if INFLIGHT.insert(id, rec, BPF_ANY).is_err() {
        lose(Loss::InFlight);
    }
    Ok(())
}

#[inline(always)]
fn stack_pointer(regs: *mut aya_ebpf::bindings::pt_regs) -> u64 {
    // SAFETY: the context's register file, valid for the program's run.
    unsafe { (*regs).rsp }
}

/// The stack pointer at the probed function's entry. An entry probe placed past N pushes (see
/// heaptrace's `placement`) sees rsp 8*N lower; the loader passes N as the attach cookie, which
/// reads 0 when none was set.
#[inline(always)]
fn entry_sp(ctx: &ProbeContext) -> u64 {
    // SAFETY: the helper only reads the cookie of the link that runs this program.
    let pushes = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) };
    stack_pointer(ctx.regs).wrapping_add(pushes.wrapping_mul(8))
}

#[uprobe]
pub fn malloc_entry(ctx: ProbeContext) -> u32 {
    let size: u64 = ctx.arg(0).unwrap_or(0);
    let _ = enter(&ctx, Func::Malloc, size, 0);
    0
}

#[uprobe]
pub fn calloc_entry(ctx: ProbeContext) -> u32 {
    let n: u64 = ctx.arg(0).unwrap_or(0);
    let each: u64 = ctx.arg(1).unwrap_or(0);
    // An overflowing product fails inside calloc; the size recorded then does not matter.
    let _ = enter(&ctx, Func::Calloc, n.wrapping_mul(each), 0);
    0
}

#[uprobe]
pub fn realloc_entry(ctx: ProbeContext) -> u32 {
    let old: u64 = ctx.arg(0).unwrap_or(0);
    let size: u64 = ctx.arg(1).unwrap_or(0);
    let _ = enter(&ctx, Func::Realloc, size, old);
    0
}

#[uprobe]
pub fn posix_memalign_entry(ctx: ProbeContext) -> u32 {
    let memptr: u64 = ctx.arg(0).unwrap_or(0);
    let size: u64 = ctx.arg(2).unwrap_or(0);
    let _ = enter(&ctx, Func::PosixMemalign, size, memptr);
    0
}

#[uprobe]
pub fn aligned_alloc_entry(ctx: ProbeContext) -> u32 {
    let size: u64 = ctx.arg(1).unwrap_or(0);
    let _ = enter(&ctx, Func::AlignedAlloc, size, 0);
    0
}

#[uprobe]
pub fn memalign_entry(ctx: ProbeContext) -> u32 {
    let size: u64 = ctx.arg(1).unwrap_or(0);
    let _ = enter(&ctx, Func::Memalign, size, 0);
    0
}

#[uprobe]
pub fn valloc_entry(ctx: ProbeContext) -> u32 {
    let size: u64 = ctx.arg(0).unwrap_or(0);
    let _ = enter(&ctx, Func::Valloc, size, 0);
    0
}

#[uprobe]
pub fn pvalloc_entry(ctx: ProbeContext) -> u32 {
    let size: u64 = ctx.arg(0).unwrap_or(0);
    let _ = enter(&ctx, Func::Pvalloc, size, 0);
    0
}

/// One return program for every allocating function: the in-flight record says which one.
#[uretprobe]
pub fn alloc_return(ctx: RetProbeContext) -> u32 {
    let ret: u64 = ctx.ret();
    let _ = try_alloc_return(ret, stack_pointer(ctx.regs));
    0
}

fn try_alloc_return(ret: u64, sp: u64) -> Result<(), i64> {
    let id = bpf_get_current_pid_tgid();
    // SAFETY: map value, copied out; only this thread touches its own entry.
    let Some(rec) = (unsafe { INFLIGHT.get(id) }).copied() else {
        return Ok(()); // entry not seen (attached mid-call) or lost (counted at entry)
    };
    // A nested call returns with the stack pointer still below the outer call's entry; the
    // outer call returns above it (its return address popped). A tail-called inner function
    // returns straight to the outer caller: its return probe runs first and completes the
    // outer record (which names the outer function); the outer probe then finds nothing.
    if sp <= rec.sp {
        return Ok(());
    }
    let _ = INFLIGHT.remove(id);
    // A match, not a table lookup: the verifier must see the index bounded.
    let func = match rec.func {
        0 => Func::Malloc,
        1 => Func::Calloc,
        2 => Func::Realloc,
        4 => Func::PosixMemalign,
        5 => Func::AlignedAlloc,
        6 => Func::Memalign,
        7 => Func::Valloc,
        8 => Func::Pvalloc,
        _ => return Ok(()),
    };
    let tgid = (id >> 32) as u32;
    let tid = id as u32;
    let Some(pc) = proc_counters(tgid) else {
        return Ok(());
    };
    let fc: &mut FnCounters = &mut pc.funcs[func as usize];
    add(&mut fc.calls, 1);

    match func {
        Func::Realloc => realloc_return(pc, tgid, tid, rec, ret),
        Func::PosixMemalign => {
            // Returns an error number; the block is written through memptr.
            let ptr = if ret as u32 == 0 {
                // SAFETY: bpf_probe_read_user validates the user address.
                unsafe { bpf_probe_read_user(rec.arg as *const u64) }.unwrap_or(0)
            } else {
                0
            };
            allocated(pc, tgid, tid, func, rec.size, ptr);
        }
        _ => allocated(pc, tgid, tid, func, rec.size, ret),
    }
    Ok(())
}

#[inline(always)]
fn allocated(pc: &mut ProcCounters, tgid: u32, tid: u32, func: Func, size: u64, ptr: u64) {
    let fc = &mut pc.funcs[func as usize];
    if ptr == 0 {
        add(&mut fc.failed, 1);
        return;
    }
    add(&mut fc.bytes, size);
    count_size(tgid, func, size);
    track(pc, tgid, tid, ptr, size, func);
}

/// realloc's four outcomes: new block (old NULL), free (size 0, NULL back), failure (NULL back,
/// old block stays live), move (new address: free old + allocate new) or resize in place.
#[inline(always)]
fn realloc_return(pc: &mut ProcCounters, tgid: u32, tid: u32, rec: InFlight, ret: u64) {
    let old = rec.arg;
    if ret == 0 {
        if old != 0 && rec.size == 0 {
            add(&mut pc.realloc_frees, 1);
            if let Some(sz) = untrack(pc, tgid, old) {
                add(&mut pc.realloc_released_bytes, sz);
            }
        } else {
            add(&mut pc.funcs[Func::Realloc as usize].failed, 1);
        }
        return;
    }
    add(&mut pc.funcs[Func::Realloc as usize].bytes, rec.size);
    count_size(tgid, Func::Realloc, rec.size);
    if old != 0 {
        if ret == old {
            add(&mut pc.realloc_in_place, 1);
        } else {
            add(&mut pc.realloc_moves, 1);
        }
        if let Some(sz) = untrack(pc, tgid, old) {
            add(&mut pc.realloc_released_bytes, sz);
        }
    }
    track(pc, tgid, tid, ret, rec.size, Func::Realloc);
}

#[uprobe]
pub fn free_entry(ctx: ProbeContext) -> u32 {
    let ptr: u64 = ctx.arg(0).unwrap_or(0);
    let _ = try_free(ptr, entry_sp(&ctx));
    0
}

fn try_free(ptr: u64, sp: u64) -> Result<(), i64> {
    if ptr == 0 {
        return Ok(()); // free(NULL) and frees of failed allocations do nothing
    }
    let id = bpf_get_current_pid_tgid();
    let tgid = (id >> 32) as u32;
    if tgid == self_tgid() {
        return Ok(());
    }
    // A free inside realloc (realloc(p, 0), moves of mmapped blocks) belongs to the realloc.
    // SAFETY: map value; only this thread touches its own entry.
    if unsafe { INFLIGHT.get(id) }.is_some_and(|f| sp <= f.sp) {
        return Ok(());
    }
    let Some(pc) = proc_counters(tgid) else {
        return Ok(());
    };
    add(&mut pc.funcs[Func::Free as usize].calls, 1);
    if let Some(sz) = untrack(pc, tgid, ptr) {
        add(&mut pc.funcs[Func::Free as usize].bytes, sz);
    }
    Ok(())
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
