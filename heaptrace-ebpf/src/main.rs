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

mod entries;
mod filter;
mod forks;
mod inflight;
mod keyed;
mod live;
mod maps;
mod mem;
mod oom;
mod peak;
mod preempt;
mod proc_state;
mod procs;
mod py_hold;
mod python;
mod signals;
mod sites;
mod sizes;
mod stacks;
mod threads;
mod unwind;
mod vma;

use aya_ebpf::{
    EbpfContext as _,
    helpers::{
        bpf_get_attach_cookie, bpf_get_current_pid_tgid, bpf_get_prandom_u32, bpf_ktime_get_ns,
        bpf_probe_read_user,
    },
    macros::{uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext},
};
use heaptrace_common::{
    BEFORE_ATTACH, COOKIE_NO_RETURN, COOKIE_PUSHES, FUNC_COUNT, Func, INFLIGHT_RESERVED, InFlight,
    LiveBlock, LiveKey, Loss, MAX_REQUEST, NO_SITE, NOT_SAMPLED, ProcCounters, mode,
};

use crate::{
    maps::{INFLIGHT, LIVE, add, calls_mode, counting, lose, mode, proc_counters, self_tgid},
    preempt::{Atomic, Count, PreemptOff},
};

const BPF_ANY: u64 = 0;

#[inline(always)]
pub(crate) fn stack_pointer(regs: *mut aya_ebpf::bindings::pt_regs) -> u64 {
    // SAFETY: the context's register file, valid for the program's run.
    unsafe { (*regs).rsp }
}

/// The entry probe's attach cookie (`heaptrace_common::COOKIE_*`); 0 when none was set.
#[inline(always)]
fn cookie(ctx: &ProbeContext) -> u64 {
    // SAFETY: the helper only reads the cookie of the link that runs this program.
    unsafe { bpf_get_attach_cookie(ctx.as_ptr()) }
}

/// The stack pointer at the probed function's entry. An entry probe placed past N pushes (see
/// heaptrace's `placement`) sees rsp 8*N lower; N is in the cookie.
#[inline(always)]
fn entry_sp(ctx: &ProbeContext, cookie: u64) -> u64 {
    stack_pointer(ctx.regs).wrapping_add((cookie & COOKIE_PUSHES).wrapping_mul(8))
}

/// Entry of an allocating function: remember its arguments until it returns. A call entered at
/// or below the stack pointer of the call in flight on this thread is nested inside it and is
/// left to the outer call: small-alignment posix_memalign calls malloc (lower stack pointer),
/// and realloc(NULL, n) tail-calls it (`jmp`: the same stack pointer). A call entered above it
/// means the recorded call's return was never seen; the stale record is replaced. A signal
/// handler's calls are not nested: the delivery set the interrupted call aside (signals.rs).
#[inline(always)]
pub(crate) fn enter(ctx: &ProbeContext, func: Func, size: u64, arg: u64) -> Result<(), i64> {
    if !counting() {
        return Ok(()); // before every link is in place, or detaching: see maps::COUNTING
    }
    if mode() == mode::BARE {
        maps::bare_count(0);
        return Ok(());
    }
    let id = bpf_get_current_pid_tgid();
    if (id >> 32) as u32 == self_tgid() || filter::excluded(id) {
        return Ok(());
    }
    // Only calls mode's malloc has a cookie to read: a function with a return probe has its
    // entry probe where the return address is at [rsp] (no push before it; heaptrace's
    // `placement::choose`), and only a function without one is counted at its entry. The
    // helper call costs ~20 ns here (a kernel return, under the SRSO mitigation): BENCHMARKS.md,
    // *Fewer helper calls*.
    let cookie = if calls_mode() { cookie(ctx) } else { 0 };
    let sp = entry_sp(ctx, cookie);
    if cookie & COOKIE_NO_RETURN != 0 {
        count_at_entry(id, func, size, sp);
        return Ok(());
    }
    let ts_ns = if mode() >= mode::SIZES && !calls_mode() && maps::latency_due() {
        // SAFETY: no preconditions.
        unsafe { bpf_ktime_get_ns() }
    } else {
        0
    };
    let rec = InFlight {
        arg,
        size,
        sp,
        ts_ns,
        func: func as u16,
        level: 0,
        flags: 0,
        seq: 0,
        verdict: heaptrace_common::filter::UNKNOWN,
        cgroup: 0,
    };
    // Each thread keeps its one entry: later calls overwrite it in place (no insert, no delete,
    // no bucket lock); a completed call leaves sp = 0. The entry goes when the thread exits
    // (threads.rs).
    if let Some(f) = inflight::get(id) {
        if f.level != 0 {
            signals::resume(id, f, sp);
        }
        if f.sp != 0 && sp <= f.sp {
            return Ok(()); // nested in the call in flight
        }
        *f = InFlight {
            seq: f.seq,
            level: f.level,
            verdict: f.verdict,
            cgroup: f.cgroup,
            ..rec
        };
        return Ok(());
    }
    // A thread's first call. Its count starts anywhere: a thread id reused after its thread
    // exited then almost never finds the dead thread's blocks at its count (temporaries).
    let rec = InFlight {
        // SAFETY: no preconditions.
        seq: unsafe { bpf_get_prandom_u32() },
        ..rec
    };
    if !inflight::claim(id, &rec) && INFLIGHT.insert(id, rec, BPF_ANY).is_err() {
        lose(Loss::InFlight);
    }
    Ok(())
}

/// Calls mode, a function without a return probe (malloc): counted here. Nested calls are
/// told apart as in `enter`, by the window of an outer call (which has a return probe), and a
/// window below this call is stale (its return was never seen) and closed, as `enter` replaces
/// it. Only a request no allocator can satisfy is known to fail here.
#[inline(always)]
fn count_at_entry(id: u64, func: Func, size: u64, sp: u64) {
    match inflight::get(id) {
        Some(f) => {
            if f.level != 0 {
                signals::resume(id, f, sp);
            }
            if f.sp != 0 {
                if sp <= f.sp {
                    return; // nested in the call in flight
                }
                f.sp = 0;
            }
        }
        // A slot with no call in flight: this thread's later calls and frees find it there
        // rather than missing in the hash map.
        None => {
            let _ = inflight::claim(id, &InFlight::NONE);
        }
    }
    let tgid = (id >> 32) as u32;
    let Some(pc) = proc_counters(tgid) else {
        return;
    };
    let fc = &mut pc.funcs[func as usize];
    add(&mut fc.calls, 1);
    if size > MAX_REQUEST {
        add(&mut fc.failed, 1);
        return;
    }
    add(&mut fc.bytes, size);
    sizes::count(&Atomic, tgid, pc.epoch as u32, func, size, NO_SITE);
}

/// One return program for every allocating function: the in-flight record says which one.
#[uretprobe]
pub fn alloc_return(ctx: RetProbeContext) -> u32 {
    // Also here, not only at the entry: a call entered before the detach began and returning
    // after it could be handed an address whose free was let pass, and count it twice.
    if !counting() {
        return 0;
    }
    if mode() == mode::BARE {
        sites::bare_stack(&ctx);
        return 0;
    }
    let _ = try_alloc_return(&ctx);
    0
}

/// What one completed call needs to account itself.
struct Call<'a> {
    /// Preemption off from here on: the counters take plain adds.
    count: &'a PreemptOff,
    pc: &'a mut ProcCounters,
    tgid: u32,
    epoch: u32,
    tid: u32,
    func: Func,
    /// The call's entry time where it was timed (`maps::latency_due`), else 0.
    now: u64,
    /// The thread's allocations before this call's (`InFlight::seq`): realloc releases its old
    /// block at this count, so realloc(p) right after p's malloc makes p temporary, as a free
    /// would.
    seq: u32,
}

fn try_alloc_return(ctx: &RetProbeContext) -> Result<(), i64> {
    let id = bpf_get_current_pid_tgid();
    let Some(f) = inflight::get(id) else {
        return Ok(()); // entry not seen (attached mid-call) or lost (counted at entry)
    };
    if f.level != 0 {
        signals::resume(id, f, stack_pointer(ctx.regs));
    }
    let rec = *f;
    if rec.sp == 0 {
        return Ok(()); // no call in flight (already completed, e.g. by a tail-called inner)
    }
    // A nested call returns with the stack pointer still below the outer call's entry; the
    // outer call returns above it (its return address popped). A tail-called inner function
    // returns straight to the outer caller: its return probe runs first and completes the
    // outer record (which names the outer function); the outer probe then finds nothing.
    if stack_pointer(ctx.regs) <= rec.sp {
        return Ok(());
    }
    f.sp = 0;
    // Bounded, not matched: the verifier must see the index into the counters bounded, and a
    // match gave it one state per function, each followed through the rest of the program
    // (the stack walk among it: start-up time).
    if rec.func as usize >= FUNC_COUNT || rec.func == Func::Free as u16 {
        return Ok(());
    }
    // SAFETY: Func is repr(u32) with every value below FUNC_COUNT a variant.
    let func: Func = unsafe { core::mem::transmute::<u32, Func>(u32::from(rec.func)) };
    let ret: u64 = ctx.ret();
    // The block the call returned (0: none): posix_memalign returns an error number and
    // writes the block through memptr.
    let ptr = match func {
        Func::PosixMemalign if ret as u32 == 0 => {
            // SAFETY: bpf_probe_read_user validates the user address.
            unsafe { bpf_probe_read_user(rec.arg as *const u64) }.unwrap_or(0)
        }
        Func::PosixMemalign => 0,
        _ => ret,
    };
    // A block comes back (and is counted, `allocated` and `realloc_return`) exactly where ptr
    // is not 0. Written here, not once the block is tracked: a record found in the slot or in
    // the hash map is a pointer into one of two maps, and one kept live to the end made the
    // verifier follow every later path twice (start-up time: 114k -> 225k instructions).
    if ptr != 0 {
        f.seq = rec.seq.wrapping_add(1);
    }
    let reserved = rec.flags & INFLIGHT_RESERVED != 0;
    // Byte sampling leaves a block out of the sites and the live map (stacks mode only).
    let sampled = ptr != 0 && (mode() < mode::STACKS || maps::sampled(rec.size));
    // The stack first, before any counter is looked up: the verifier follows the walk's loop
    // once for each state it can reach it in, and every lookup with two places to find its
    // counters (a slot, or the map) multiplies those states (start-up time). One walk serves
    // the block's site and the memory syscalls the call made.
    let tgid = (id >> 32) as u32;
    let stack = if mode() >= mode::STACKS && (sampled || reserved) {
        sites::stack_id(ctx, tgid)
    } else {
        (NO_SITE, true)
    };
    if reserved {
        mem::call_end(tgid, id as u32, func, stack.0);
    }
    // After the walk: its reads may fault in pages, and need not run with preemption off.
    let count = PreemptOff::take();
    let Some(pc) = proc_counters(tgid) else {
        return Ok(());
    };
    count.add(&mut pc.funcs[func as usize].calls, 1);
    let now = if rec.ts_ns != 0 {
        // SAFETY: no preconditions.
        let now = unsafe { bpf_ktime_get_ns() };
        sizes::latency(&count, func, now.wrapping_sub(rec.ts_ns));
        now
    } else {
        0
    };
    let epoch = pc.epoch as u32;
    let mut call = Call {
        count: &count,
        pc,
        tgid,
        epoch,
        tid: id as u32,
        func,
        now,
        seq: rec.seq,
    };
    let block = match func {
        Func::Realloc => realloc_return(&mut call, rec, ret),
        _ => allocated(&mut call, rec.size, ptr),
    };
    if let Some(ptr) = block {
        let stack = if sampled { stack } else { (NOT_SAMPLED, true) };
        track(&mut call, ptr, rec.size, stack);
    }
    Ok(())
}

/// Counts a completed call; the block to track, unless it failed.
#[inline(always)]
fn allocated(call: &mut Call<'_>, size: u64, ptr: u64) -> Option<u64> {
    let fc = &mut call.pc.funcs[call.func as usize];
    if ptr == 0 {
        call.count.add(&mut fc.failed, 1);
        return None;
    }
    call.count.add(&mut fc.bytes, size);
    Some(ptr)
}

/// Counts a new block at its site and size, and remembers it in the live map. `stack`: its
/// stack's id and whether it was stored whole (`sites::stack_id`), [`NOT_SAMPLED`] where byte
/// sampling (stacks mode only) left the block out: counted in the size histogram only, with no
/// stack, no site and no live-map entry (its free will miss the live map); [`NO_SITE`] in the
/// other modes.
#[inline(always)]
fn track(call: &mut Call<'_>, ptr: u64, size: u64, (stack_id, whole): (i32, bool)) {
    let sampled = stack_id != NOT_SAMPLED;
    // The process's peak entry, first: its peak number is what the site folds at.
    let peak = if sampled && !calls_mode() {
        peak::entry(call.tgid)
    } else {
        None
    };
    let proc = (call.tgid, call.epoch, peak::seq(&peak));
    if mode() >= mode::STACKS && sampled {
        if !whole {
            lose(Loss::Stack);
        }
        sites::allocated(call.count, proc, call.func, size, stack_id);
    }
    if mode() >= mode::SIZES {
        sizes::count(call.count, call.tgid, call.epoch, call.func, size, stack_id);
    }
    if !sampled || calls_mode() {
        return; // calls mode keeps no live map
    }
    let key = LiveKey {
        tgid: call.tgid,
        epoch: call.epoch,
        ptr,
    };
    // Lifetimes only of the calls timed for latency: two clock reads a block were ~90 ns of
    // stacks mode's ~540 a pair here (BENCHMARKS.md, *Lifetimes of the timed calls*).
    let block = LiveBlock {
        size,
        ts_ns: call.now,
        tid: call.tid,
        func: call.func as u32,
        stack_id,
        seq: call.seq,
    };
    if !live::insert(&key, &block) && LIVE.insert(key, block, BPF_ANY).is_err() {
        lose(Loss::LiveMap);
        if mode() >= mode::STACKS {
            sites::untracked(call.count, proc, call.func, stack_id, size);
        }
        return;
    }
    call.count.add(&mut call.pc.live_blocks, 1);
    call.count.add(&mut call.pc.live_bytes, size);
    peak::grew(peak, call.epoch, size, stack_id);
}

/// Forgets a block; returns its size if it was known (never in calls mode: no live map).
/// `freer`: the releasing thread's id and allocations so far (`InFlight::seq`), for
/// temporaries; (0, 0) for a thread with no record, which allocated nothing seen (no thread
/// that runs user code has id 0).
#[inline(always)]
fn untrack(
    c: &impl Count,
    pc: &mut ProcCounters,
    tgid: u32,
    ptr: u64,
    freer: (u32, u32),
) -> Option<u64> {
    if calls_mode() {
        return None;
    }
    // A block of an earlier image of the process (before an exec) is never this image's.
    let epoch = pc.epoch as u32;
    let key = LiveKey { tgid, epoch, ptr };
    let block = match live::take(&key) {
        Some(block) => block,
        None => {
            // SAFETY: the value is copied out before the remove.
            let Some(block) = (unsafe { LIVE.get(key) }).copied() else {
                c.add(&mut pc.untracked_frees, 1);
                return None;
            };
            let _ = LIVE.remove(key);
            block
        }
    };
    c.add(&mut pc.live_blocks, u64::MAX); // -1, wrapping
    c.add(&mut pc.live_bytes, block.size.wrapping_neg());
    let seq = peak::shrank(tgid, block.size);
    // A block live before attach has no site to count its free at (`BEFORE_ATTACH`).
    if block.stack_id != NO_SITE && block.stack_id != BEFORE_ATTACH {
        sites::released(c, (tgid, epoch, seq), &block, freer);
    }
    Some(block.size)
}

/// realloc's four outcomes: new block (old NULL), free (size 0, NULL back), failure (NULL back,
/// old block stays live), move (new address: free old + allocate new) or resize in place.
/// Returns the block to track.
#[inline(always)]
fn realloc_return(call: &mut Call<'_>, rec: InFlight, ret: u64) -> Option<u64> {
    let old = rec.arg;
    let tgid = call.tgid;
    let freer = (call.tid, call.seq);
    if ret == 0 {
        if old != 0 && rec.size == 0 {
            call.count.add(&mut call.pc.realloc_frees, 1);
            if let Some(sz) = untrack(call.count, call.pc, tgid, old, freer) {
                call.count.add(&mut call.pc.realloc_released_bytes, sz);
            }
        } else {
            call.count
                .add(&mut call.pc.funcs[Func::Realloc as usize].failed, 1);
        }
        return None;
    }
    call.count
        .add(&mut call.pc.funcs[Func::Realloc as usize].bytes, rec.size);
    if old != 0 {
        if ret == old {
            call.count.add(&mut call.pc.realloc_in_place, 1);
        } else {
            call.count.add(&mut call.pc.realloc_moves, 1);
        }
        if let Some(sz) = untrack(call.count, call.pc, tgid, old, freer) {
            call.count.add(&mut call.pc.realloc_released_bytes, sz);
        }
    }
    Some(ret)
}

#[uprobe]
pub fn free_entry(ctx: ProbeContext) -> u32 {
    if !counting() {
        return 0;
    }
    if mode() == mode::BARE {
        maps::bare_count(2);
        return 0;
    }
    let ptr: u64 = ctx.arg(0).unwrap_or(0);
    let _ = try_free(&ctx, ptr);
    0
}

fn try_free(ctx: &ProbeContext, ptr: u64) -> Result<(), i64> {
    if ptr == 0 {
        return Ok(()); // free(NULL) and frees of failed allocations do nothing
    }
    let id = bpf_get_current_pid_tgid();
    let tgid = (id >> 32) as u32;
    if tgid == self_tgid() || filter::excluded(id) {
        return Ok(());
    }
    // A free inside realloc (realloc(p, 0), moves of mmapped blocks) belongs to the realloc.
    // The stack pointer at free's entry (the cookie says how many pushes ran before the
    // probe) only where a call is in flight: the cookie's helper call is not free.
    let mut rec = inflight::get(id);
    if let Some(f) = rec.as_deref_mut()
        && f.level != 0
    {
        signals::resume(id, f, entry_sp(ctx, cookie(ctx)));
    }
    if rec
        .as_ref()
        .is_some_and(|f| f.sp != 0 && entry_sp(ctx, cookie(ctx)) <= f.sp)
    {
        return Ok(());
    }
    // Not an Option: two states of the rest of the program for the verifier. A free moves the
    // thread's count on as an allocation does: a block freed after another free of its thread
    // is not temporary (heaptrack's rule).
    let freer = rec.map_or((0, 0), |f| {
        let seq = f.seq;
        f.seq = seq.wrapping_add(1);
        (id as u32, seq)
    });
    let count = PreemptOff::take();
    let Some(pc) = proc_counters(tgid) else {
        return Ok(());
    };
    count.add(&mut pc.funcs[Func::Free as usize].calls, 1);
    if let Some(sz) = untrack(&count, pc, tgid, ptr, freer) {
        count.add(&mut pc.funcs[Func::Free as usize].bytes, sz);
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
