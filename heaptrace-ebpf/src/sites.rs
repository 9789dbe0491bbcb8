//! Stacks mode: per allocation site (process, user stack, function) counters.
//!
//! The stack is taken at the return probe: there the instruction pointer is the return address
//! in the immediate caller and the frame pointer is the caller's, so the frame-pointer walk
//! starts at the caller. (At malloc's entry the walk would miss it: glibc's malloc does not
//! begin with `push %rbp`.) Only successful allocations pay for a stack.
use aya_ebpf::{EbpfContext, programs::RetProbeContext};
use heaptrace_common::{
    CALLER_ID_BASE, Func, LiveBlock, Loss, SiteCounters, SiteKey, fills,
    globals::{BARE_READ, BARE_WALK},
    log2_bucket,
};

use crate::{
    keyed,
    maps::{
        CALLERS, SITE_SLOTS, SITES, get_or_insert, lose, round, site_slots_shift, site_zero,
        temporary_allocs,
    },
    preempt::Count,
};

const BPF_F_USER_STACK: u64 = 1 << 8;

/// The id of the user stack at this probe (a return probe's, or `mem.rs`'s pymalloc arenas'),
/// stored, and whether it was stored whole:
/// false where it took its caller alone, or nothing (a negative id).
#[inline(always)]
pub fn stack_id(ctx: &impl EbpfContext, tgid: u32) -> (i32, bool) {
    match store_stack(ctx, tgid) {
        Ok((id, whole)) => (id as i32, whole),
        Err(e) => (if e < 0 { e } else { -1 }, false),
    }
}

/// `key`'s site counters on this CPU: in its slot, or in the map, created where missing. None
/// where the map is full.
#[inline(always)]
fn site_counters(key: &SiteKey) -> Option<&'static mut SiteCounters> {
    match keyed::counters(&SITE_SLOTS, site_slots_shift(), key) {
        Some(c) => Some(c),
        None => get_or_insert(&SITES, key, site_zero(), fills::SITES),
    }
}

/// Counts an allocation at its site; `seq`, its process's peak number (`ProcPeak::seq`).
#[inline(always)]
pub fn allocated(
    c: &impl Count,
    (tgid, epoch, seq): (u32, u32, u32),
    func: Func,
    size: u64,
    stack_id: i32,
) {
    let key = SiteKey {
        tgid,
        stack_id,
        func: func as u16,
        round: round(),
        epoch,
    };
    let Some(site) = site_counters(&key) else {
        lose(Loss::SiteMap);
        return;
    };
    site.fold_peak(seq);
    c.add(&mut site.calls, 1);
    c.add(&mut site.bytes, size);
}

/// A block counted at its site that the live map refused: its free will not find it, so the
/// site's live figures must not wait for it.
#[inline(always)]
pub fn untracked(
    c: &impl Count,
    (tgid, epoch, seq): (u32, u32, u32),
    func: Func,
    stack_id: i32,
    size: u64,
) {
    let key = SiteKey {
        tgid,
        stack_id,
        func: func as u16,
        round: round(),
        epoch,
    };
    if let Some(site) = site_counters(&key) {
        site.fold_peak(seq);
        c.add(&mut site.untracked, 1);
        c.add(&mut site.untracked_bytes, size);
    }
}

/// The id of the user stack at this return probe, stored (`stacks.rs`), and true; or, where
/// no whole stack can be stored (`stacks::store`), the id of its first frame alone (CALLERS) and false.
#[inline(always)]
fn store_stack(ctx: &impl EbpfContext, tgid: u32) -> Result<(i64, bool), i32> {
    match crate::stacks::store(ctx, tgid) {
        Ok(id) => Ok((i64::from(id), true)),
        Err(e) => {
            // A walk no deeper than the map's one-frame values: the caller alone, and no fault
            // at the end of the chain (see stacks.rs).
            // SAFETY: a stack trace map's definition and this program's context.
            let id = unsafe {
                aya_ebpf::helpers::bpf_get_stackid(ctx.as_ptr(), CALLERS.as_ptr(), BPF_F_USER_STACK)
            };
            if id < 0 {
                return Err(e);
            }
            Ok((id + i64::from(CALLER_ID_BASE), false))
        }
    }
}

/// Bare mode: the stack walk, or one read of the caller's stack (the least an exact stack
/// takes), or neither (the traps' floor alone); and a count.
#[inline(always)]
pub fn bare_stack(ctx: &RetProbeContext) {
    match crate::maps::bare_stack() {
        BARE_WALK => {
            let tgid = (aya_ebpf::helpers::bpf_get_current_pid_tgid() >> 32) as u32;
            let _ = crate::stacks::walk(ctx, tgid);
        }
        BARE_READ => {
            // The word at the caller's stack pointer: the page the walk begins in.
            let sp = crate::stack_pointer(ctx.regs) & !7;
            // SAFETY: bpf_probe_read_user validates the user address.
            let _ = unsafe { aya_ebpf::helpers::bpf_probe_read_user(sp as *const u64) };
        }
        _ => {}
    }
    crate::maps::bare_count(1);
}

/// Counts the release of a block at the site that allocated it, by the thread `freer` (its id
/// and its allocations and frees so far; see `untrack`). Temporary, as heaptrack counts it:
/// freed by its own thread with fewer than `TEMPORARY_ALLOCS` of that thread's allocations and
/// frees in between (by default none). Exact, and no clock read. A thread id reused after its thread exited (pid
/// wrap) starts its count at random (`enter`): one of the dead thread's blocks freed by it is
/// taken for temporary with odds of N in 2^32.
#[inline(always)]
pub fn released(
    c: &impl Count,
    (tgid, epoch, peak_seq): (u32, u32, u32),
    block: &LiveBlock,
    (tid, seq): (u32, u32),
) {
    let key = SiteKey {
        tgid,
        stack_id: block.stack_id,
        func: block.func as u16,
        round: round(),
        epoch,
    };
    // Created where missing: the allocation may have been counted in a slot on another CPU, or
    // in an earlier round (its key retired since). Its site's counters are the sum over all
    // CPUs, slots and map, and the rounds.
    let Some(site) = site_counters(&key) else {
        lose(Loss::SiteMap);
        return;
    };
    site.fold_peak(peak_seq);
    c.add(&mut site.frees, 1);
    c.add(&mut site.freed_bytes, block.size);
    if block.ts_ns != 0 {
        // SAFETY: no preconditions.
        let lifetime = unsafe { aya_ebpf::helpers::bpf_ktime_get_ns() }.wrapping_sub(block.ts_ns);
        c.add32(&mut site.lifetimes[log2_bucket(lifetime >> 10)], 1);
    }
    // The thread's allocations and frees in between: its count now, less the count before this
    // block and this block itself.
    let between = seq.wrapping_sub(block.seq).wrapping_sub(1);
    if block.tid == tid && between < temporary_allocs() {
        c.add(&mut site.temp_blocks, 1);
        c.add(&mut site.temp_bytes, block.size);
    }
}
