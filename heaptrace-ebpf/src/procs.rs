//! Process starts (system-wide mode): a raw tracepoint, which needs no tracefs. Exits need no
//! event: each round already finds which traced processes are gone.
use aya_ebpf::{
    helpers::bpf_get_current_pid_tgid, macros::raw_tracepoint, programs::RawTracePointContext,
};
use aya_log_ebpf::warn;
use heaptrace_common::{Loss, PROC_EXEC, ProcEvent};

use crate::maps::{EVENTS, lose, self_tgid};

#[inline(always)]
fn report(ctx: &RawTracePointContext, kind: u32) {
    let id = bpf_get_current_pid_tgid();
    let tgid = (id >> 32) as u32;
    if tgid == self_tgid() {
        return;
    }
    if EVENTS.output(ProcEvent { kind, tgid }, 0).is_err() {
        lose(Loss::ProcessEvents);
        // Rare (user space drains the ring every few ms) and never on an allocation's path:
        // what aya-log is for here.
        warn!(
            ctx,
            "process event ring full: the start of pid {} was not reported", tgid
        );
    }
}

#[raw_tracepoint(tracepoint = "sched_process_exec")]
pub fn on_exec(ctx: RawTracePointContext) -> i32 {
    report(&ctx, PROC_EXEC);
    0
}
