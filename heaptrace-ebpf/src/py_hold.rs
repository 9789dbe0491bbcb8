//! A launched Python's finalization, held: its code objects are freed by `Py_FinalizeEx`
//! before the process exits, so a script that ends within a round of its allocations would
//! leave them unnamed. A uprobe on `Py_FinalizeEx`, bound to the command's pid, sends the
//! calling thread the signal user space chose (one the process neither catches nor blocks);
//! the command's tracer stops it there, and the daemon names its stacks before it goes on.
use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, generated::bpf_send_signal_thread},
    macros::{map, uprobe},
    maps::HashMap,
    programs::ProbeContext,
};

/// The processes whose finalization is held, by tgid: the signal to send (once).
#[map(name = "PY_HOLD")]
static PY_HOLD: HashMap<u32, u32> = HashMap::with_max_entries(64, 0);

#[uprobe]
pub fn py_finalize(_ctx: ProbeContext) -> u32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    // SAFETY: a map value, copied out before the delete.
    let Some(sig) = (unsafe { PY_HOLD.get(&tgid) }).copied() else {
        return 0;
    };
    let _ = PY_HOLD.remove(&tgid);
    // SAFETY: no pointer arguments; the signal goes to the current thread.
    unsafe { bpf_send_signal_thread(sig) };
    0
}
