//! Signal handlers. A handler can run in the middle of an allocator call (between its entry
//! probe and its return probe), and its own calls then enter below the interrupted call's
//! stack pointer, as a call nested inside it would (realloc(NULL, n) calling malloc). So the
//! delivery of a signal to a handler sets the call in flight aside (in `SIGNAL_SAVED`) and
//! leaves an empty record, in which the handler's calls and frees are counted as any others.
//! The call is put back at the thread's first probe at or above `HANDLER_GAP` below the
//! call's stack pointer: the handler has returned (or jumped out).
//!
//! Why the gap tells them apart: the kernel puts a handler's frame below the interrupted stack
//! pointer's 128-byte red zone, an FPU save area (512 bytes at least) and the signal frame
//! (440 bytes), so a handler's probes fire more than 1,080 bytes below the interrupted call's
//! entry. The interrupted call's own later probes (its return, the calls it makes inside, such
//! as posix_memalign's malloc) fire within its own few frames, well under 1 KiB below
//! (glibc calls malloc from realloc and the aligned functions one or two frames down). A handler on an alternate stack (`SA_ONSTACK`) may run
//! anywhere: a call it interrupts is counted as lost (`in_flight`) rather than told apart.
//!
//! Nothing here costs the allocator calls more than a load of `InFlight::level` and a branch,
//! unless a handler interrupted one of the thread's calls.
use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_kernel},
    macros::{map, raw_tracepoint},
    maps::HashMap,
    programs::RawTracePointContext,
};
use heaptrace_common::{InFlight, Loss};

use crate::{inflight, maps::lose};

/// Calls that can be set aside at once: handlers interrupting handlers' calls.
const SAVED_LEVELS: usize = 4;

/// A probe at or above this many bytes below the call set aside is not a handler's.
const HANDLER_GAP: u64 = 1024;

/// `sa_flags`: the handler runs on the alternate signal stack.
const SA_ONSTACK: u64 = 0x0800_0000;

/// The calls a thread's signal handlers interrupted, innermost at `InFlight::level` - 1; an
/// entry lives while one is set aside.
#[map(name = "SIGNAL_SAVED")]
static SIGNAL_SAVED: HashMap<u64, [InFlight; SAVED_LEVELS]> = HashMap::with_max_entries(4096, 0);

/// signal_deliver(sig, info, ka): in the thread about to run the handler, before its frame is
/// set up. Fires for ignored and default actions too.
#[raw_tracepoint(tracepoint = "signal_deliver")]
pub fn on_signal_deliver(ctx: RawTracePointContext) -> i32 {
    let id = bpf_get_current_pid_tgid();
    let Some(f) = inflight::get(id) else {
        return 0; // no record, no call in flight
    };
    if f.sp == 0 {
        return 0; // the handler's calls are the only ones in flight
    }
    let ka: u64 = ctx.arg(2);
    // `struct k_sigaction` begins with `sa.sa_handler`, then `sa_flags`.
    // SAFETY: bpf_probe_read_kernel checks the addresses.
    let handler = unsafe { bpf_probe_read_kernel(ka as *const u64) }.unwrap_or(0);
    // SAFETY: as above.
    let flags = unsafe { bpf_probe_read_kernel((ka + 8) as *const u64) }.unwrap_or(0);
    if handler <= 1 {
        return 0; // SIG_DFL, SIG_IGN: no handler runs
    }
    let level = usize::from(f.level);
    if flags & SA_ONSTACK != 0 || level >= SAVED_LEVELS {
        lose(Loss::InFlight);
        return 0;
    }
    let slots = match SIGNAL_SAVED.get_ptr_mut(&id) {
        Some(p) => p,
        None => {
            let empty = [InFlight::NONE; SAVED_LEVELS];
            if SIGNAL_SAVED.insert(&id, &empty, 0).is_err() {
                lose(Loss::InFlight);
                return 0;
            }
            let Some(p) = SIGNAL_SAVED.get_ptr_mut(&id) else {
                return 0;
            };
            p
        }
    };
    // SAFETY: map value pointer; only this thread reads or writes its own entry.
    let slots = unsafe { &mut *slots };
    let Some(slot) = slots.get_mut(level) else {
        return 0;
    };
    *slot = *f;
    f.sp = 0;
    f.flags = 0;
    f.level += 1;
    0
}

/// At a probe of a thread with a call set aside (`f.level` not 0), `sp` its stack pointer:
/// puts the innermost call set aside back if the probe is not its handler's.
#[inline(never)]
pub fn resume(id: u64, f: &mut InFlight, sp: u64) {
    let Some(slots) = SIGNAL_SAVED.get_ptr_mut(&id) else {
        f.level = 0;
        return;
    };
    // SAFETY: map value pointer; only this thread reads or writes its own entry.
    let slots = unsafe { &mut *slots };
    let level = usize::from(f.level) - 1;
    let Some(saved) = slots.get(level) else {
        return;
    };
    if sp < saved.sp.wrapping_sub(HANDLER_GAP) {
        return; // the handler's own
    }
    f.arg = saved.arg;
    f.size = saved.size;
    f.sp = saved.sp;
    f.ts_ns = saved.ts_ns;
    f.func = saved.func;
    f.flags = saved.flags;
    f.level = level as u16;
    if level == 0 {
        let _ = SIGNAL_SAVED.remove(&id);
    }
}

/// The thread is gone (exit) or its handlers are (exec): its calls set aside with them.
#[inline(always)]
pub fn forget(id: u64) {
    if let Some(f) = inflight::get(id)
        && f.level != 0
    {
        f.level = 0;
        let _ = SIGNAL_SAVED.remove(&id);
    }
}
