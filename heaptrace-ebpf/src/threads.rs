//! Thread exits: a thread's in-flight record, and its slot, go with it. A thread that dies mid-call (killed,
//! or pthread_exit from inside a wrapper) never reaches the return probe, and every thread
//! that ever called an allocator keeps its record otherwise; under thread churn the bounded
//! map would fill up and lose calls. A raw tracepoint, which needs no tracefs.
use aya_ebpf::{
    helpers::bpf_get_current_pid_tgid, macros::raw_tracepoint, programs::RawTracePointContext,
};

/// sched_process_exit fires in the exiting thread itself (do_exit), once per thread, after
/// which it never runs user code again: no probe can record a call for it afterwards.
#[raw_tracepoint(tracepoint = "sched_process_exit")]
pub fn on_thread_exit(_ctx: RawTracePointContext) -> i32 {
    let id = bpf_get_current_pid_tgid();
    crate::signals::forget(id);
    crate::inflight::release(id);
    0
}
