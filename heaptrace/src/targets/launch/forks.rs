//! What becomes of a launched command's forks. Its tracer is told of each fork
//! (`PTRACE_O_TRACEFORK`, `PTRACE_O_TRACEVFORK`) and the new process starts stopped, traced:
//! it is held there, before its first instruction, while the probe stage either gives it
//! links of its own (followed) or takes the inherited breakpoints out of its copy of the text
//! (not followed), then kept traced or let go of.
use std::sync::{Arc, Mutex};

/// The probe stage's side of a fork, called from the tracer thread with the new process held.
pub trait Forks: Send + Sync {
    /// A process a traced one just forked, stopped before its first instruction; `vfork`: it
    /// runs in its parent's memory until it execs or exits. True: followed (its tracer keeps
    /// it, to hold its own forks); false: let go of.
    fn forked(&self, pid: u32, vfork: bool) -> bool;
    /// A followed process ended.
    fn gone(&self, pid: u32);
}

/// Where the probe stage puts its `Forks` once attached; empty, forks are let go of as they
/// are (nothing was probed for them).
pub type ForkSlot = Arc<Mutex<Option<Arc<dyn Forks>>>>;

/// The `Forks` in the slot, if any.
pub(super) fn of(slot: &ForkSlot) -> Option<Arc<dyn Forks>> {
    slot.lock().ok().and_then(|s| s.clone())
}
