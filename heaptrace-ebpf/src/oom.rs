//! OOM kills: the kernel's `oom/mark_victim` tracepoint, raw (no tracefs needed), reports the
//! victim on the process-event ring. It fires after the OOM killer sent the victim SIGKILL,
//! before the victim runs another user instruction: its blocks in the live map are its heap
//! at the kill. Rare, and never on an allocation's path.
use aya_ebpf::{macros::raw_tracepoint, programs::RawTracePointContext};
use heaptrace_common::{Loss, OOM_PID, OOM_TASK, PROC_OOM, ProcEvent};

use crate::maps::{EVENTS, lose, self_tgid, watch_tgid};

/// See `heaptrace_common::globals::OOM_VICTIM`.
#[unsafe(no_mangle)]
static OOM_VICTIM: u32 = 0;

/// mark_victim(task, uid) on newer kernels, mark_victim(pid) before.
#[raw_tracepoint(tracepoint = "mark_victim")]
pub fn on_oom(ctx: RawTracePointContext) -> i32 {
    // SAFETY: a plain read of a global the loader wrote before load.
    let how = unsafe { core::ptr::read_volatile(&OOM_VICTIM) };
    let tgid = match how {
        OOM_TASK => match crate::forks::tgid_of(ctx.arg::<u64>(0)) {
            Some(t) => t,
            None => return 0,
        },
        OOM_PID => ctx.arg::<u64>(0) as u32,
        _ => return 0,
    };
    let watched = watch_tgid();
    if tgid == 0 || tgid == self_tgid() || (watched != 0 && tgid != watched) {
        return 0;
    }
    if crate::forks::following() && !crate::forks::followed(tgid) {
        return 0;
    }
    let event = ProcEvent {
        kind: PROC_OOM,
        tgid,
        cgroup_id: 0,
        comm: [0; 16],
    };
    if EVENTS.output(event, 0).is_err() {
        lose(Loss::ProcessEvents);
    }
    0
}
