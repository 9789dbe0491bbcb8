//! Execs: a raw tracepoint, which needs no tracefs. System-wide, every exec is a process to
//! look at; with one process traced, its own execs start it over as its new command (a wrapper
//! script's `exec`). Exits need no event: each round already finds which processes are gone.
use aya_ebpf::{
    helpers::{bpf_get_current_cgroup_id, bpf_get_current_comm, bpf_get_current_pid_tgid},
    macros::raw_tracepoint,
    programs::RawTracePointContext,
};
use aya_log_ebpf::warn;
use heaptrace_common::{Loss, PROC_EXEC, ProcEvent};

use crate::maps::{EVENTS, EXECS, PROCS, lose, reservations, self_tgid, watch_tgid};

#[inline(always)]
fn report(ctx: &RawTracePointContext, kind: u32) {
    let id = bpf_get_current_pid_tgid();
    let tgid = (id >> 32) as u32;
    if tgid == self_tgid() {
        return;
    }
    let event = ProcEvent {
        kind,
        tgid,
        // SAFETY: no preconditions.
        cgroup_id: unsafe { bpf_get_current_cgroup_id() },
        comm: bpf_get_current_comm().unwrap_or([0; 16]),
    };
    if EVENTS.output(event, 0).is_err() {
        lose(Loss::ProcessEvents);
        // Rare (user space drains the ring every few ms) and never on an allocation's path:
        // what aya-log is for here.
        warn!(
            ctx,
            "process event ring full: the start of pid {} was not reported", tgid
        );
    }
}

/// A traced process that execs starts over as its new image: its counters go, and its epoch
/// moves on so that the sizes, sites and live blocks of the image it was are kept apart (user
/// space drops them). This runs in the exec before the new image's first instruction, with the
/// old image's other threads already gone, so no call of either image is counted in the other.
/// The event goes out after the reset: when user space reads it, the reset is done.
#[inline(always)]
fn restart(tgid: u32) {
    let in_slots = crate::maps::stale_proc_slots(tgid);
    // SAFETY: the value is copied out at once.
    if !in_slots && unsafe { PROCS.get(tgid) }.is_none() {
        return; // never counted anything: nothing to start over
    }
    // SAFETY: as above.
    let execs = unsafe { EXECS.get(tgid) }.copied().unwrap_or(0);
    if EXECS.insert(tgid, execs.wrapping_add(1), 0).is_err() {
        // Without a new epoch the new image's sizes and sites would add to the old ones'.
        lose(Loss::ProcessMap);
    }
    let _ = PROCS.remove(tgid);
    crate::peak::exec(tgid);
    if reservations() {
        // In the memory events' own order: user space drops the earlier image's mappings and
        // break exactly between its events and the new image's.
        crate::mem::exec(tgid);
    }
}

#[raw_tracepoint(tracepoint = "sched_process_exec")]
pub fn on_exec(ctx: RawTracePointContext) -> i32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    let watched = watch_tgid();
    if watched != 0 && tgid != watched {
        return 0; // one process traced: the host's other execs are not its business
    }
    if crate::forks::following() && !crate::forks::followed(tgid) {
        return 0; // a process tree traced: likewise
    }
    if tgid != self_tgid() {
        restart(tgid);
        crate::unwind::exec(tgid);
        crate::python::exec(tgid);
        if watched != 0 || crate::forks::following() {
            // The one moment no other thread of the process counts (`proc_state.rs`).
            crate::proc_state::claim(tgid, 0);
        }
        crate::filter::exec(bpf_get_current_pid_tgid());
        // The image's handlers are gone, and with them the calls they interrupted.
        crate::signals::forget(bpf_get_current_pid_tgid());
    }
    report(&ctx, PROC_EXEC);
    0
}
