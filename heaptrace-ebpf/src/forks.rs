//! Following forks (`-- CMD`, `-p PID --follow-forks`): the probes fire in every process that
//! maps the allocator, and only the processes in FOLLOWED count. Under `-p PID` alone, the
//! process's forks are reported (`PROC_LEFT`) for their inherited breakpoints to be removed. A raw tracepoint on
//! sched_process_fork adds each process a followed one forks, in the parent's fork, before the
//! child first runs: the child is counted from its first call. Judged once per thread and kept
//! in its in-flight record, as the `--all` filters are (`filter.rs`).
use aya_ebpf::{
    helpers::{bpf_get_current_cgroup_id, bpf_get_current_comm, bpf_probe_read_kernel},
    macros::{map, raw_tracepoint},
    maps::HashMap,
    programs::RawTracePointContext,
};
use heaptrace_common::{
    Loss, PROC_FORK, PROC_LEFT, ProcEvent,
    filter::{TRACED, UNKNOWN},
};

use crate::{
    inflight,
    maps::{EVENTS, lose},
};

/// See `heaptrace_common::globals::FOLLOW_FORKS`.
#[unsafe(no_mangle)]
static FOLLOW_FORKS: u32 = 0;
/// See `heaptrace_common::globals::TASK_PID`.
#[unsafe(no_mangle)]
static TASK_PID: u32 = 0;
#[unsafe(no_mangle)]
static TASK_TGID: u32 = 0;

/// Followed processes: tgid -> the tgid that forked it (a root: itself). User space seeds the
/// roots and removes the processes gone.
#[map]
pub static FOLLOWED: HashMap<u32, u32> = HashMap::with_max_entries(65536, 0);

#[inline(always)]
pub fn following() -> bool {
    // SAFETY: a plain read of a global the loader wrote before load.
    unsafe { core::ptr::read_volatile(&FOLLOW_FORKS) != 0 }
}

#[inline(always)]
pub fn followed(tgid: u32) -> bool {
    // SAFETY: the value is not used.
    unsafe { FOLLOWED.get(&tgid) }.is_some()
}

/// Whether the calling thread's process is left out (`id`: its pid_tgid): not followed. A
/// followed thread keeps its verdict in its record; a thread left out gets none (a lookup at
/// each call instead): the host's other threads must not fill the in-flight records the
/// followed ones need.
#[inline(always)]
pub fn excluded(id: u64) -> bool {
    let f = inflight::get(id);
    if f.as_ref().is_some_and(|f| f.verdict == TRACED) {
        return false;
    }
    if !followed((id >> 32) as u32) {
        return true;
    }
    if let Some(f) = f {
        f.verdict = TRACED;
    }
    false
}

/// A task's pid and tgid, read at the offsets the loader found in the kernel's BTF.
#[inline(always)]
fn ids_of(task: u64) -> Option<(u32, u32)> {
    // SAFETY: plain reads of globals the loader wrote before load.
    let (pid_at, tgid_at) = unsafe {
        (
            core::ptr::read_volatile(&TASK_PID),
            core::ptr::read_volatile(&TASK_TGID),
        )
    };
    // SAFETY: bpf_probe_read_kernel checks the addresses.
    let pid = unsafe { bpf_probe_read_kernel((task + u64::from(pid_at)) as *const u32) }.ok()?;
    // SAFETY: as above.
    let tgid = unsafe { bpf_probe_read_kernel((task + u64::from(tgid_at)) as *const u32) }.ok()?;
    Some((pid, tgid))
}

/// A task's process id (tgid), as [`ids_of`] reads it.
#[inline(always)]
pub fn tgid_of(task: u64) -> Option<u32> {
    ids_of(task).map(|(_, tgid)| tgid)
}

/// sched_process_fork(parent, child): runs in the parent, before the child is woken.
#[raw_tracepoint(tracepoint = "sched_process_fork")]
pub fn on_fork(ctx: RawTracePointContext) -> i32 {
    let parent = (aya_ebpf::helpers::bpf_get_current_pid_tgid() >> 32) as u32;
    let child: u64 = ctx.arg(1);
    let Some((pid, tgid)) = ids_of(child) else {
        return 0;
    };
    if tgid != parent {
        // Attached for this alone under `--all` with unwinding on.
        let _ = crate::unwind::inherit(parent, tgid);
    }
    if !following() || !followed(parent) {
        if tgid != parent && parent == crate::maps::watch_tgid() {
            report(PROC_LEFT, tgid);
        }
        return 0;
    }
    // A record left by a thread of this id whose exit was not seen holds a stale verdict.
    if let Some(f) = inflight::get((u64::from(tgid) << 32) | u64::from(pid)) {
        f.verdict = UNKNOWN;
    }
    if tgid == parent {
        return 0; // a new thread of the followed process
    }
    if FOLLOWED.insert(&tgid, &parent, 0).is_err() {
        lose(Loss::ProcessMap);
        return 0;
    }
    let unwind = crate::unwind::inherit(parent, tgid);
    crate::proc_state::claim(tgid, unwind);
    report(PROC_FORK, tgid);
    0
}

/// The new process `tgid`, to user space, with its parent's cgroup and name.
#[inline(always)]
fn report(kind: u32, tgid: u32) {
    let event = ProcEvent {
        kind,
        tgid,
        // SAFETY: no preconditions.
        cgroup_id: unsafe { bpf_get_current_cgroup_id() },
        comm: bpf_get_current_comm().unwrap_or([0; 16]),
    };
    if EVENTS.output(event, 0).is_err() {
        lose(Loss::ProcessEvents);
    }
}
