//! What a tracer shares between a launched command's (`tracee.rs`) and a seized tree's
//! (`targets::seized`): the processes its tracees fork, met at their parent's fork event and
//! at their own first stop in either order, and the new images it follows from their exec to
//! their start.
use std::collections::{HashMap, HashSet};

use super::tracee::{ORIG_RAX_OFFSET, STARTUP_STOPS, SYS_SET_TID_ADDRESS};

/// New processes on their way: each is settled once both its parent's event and its own first
/// stop have come.
#[derive(Default)]
pub(crate) struct Newborns {
    /// Seen stopped before their parent's fork event.
    early: HashSet<i32>,
    /// Fork events seen before the new process's first stop: whether each was a vfork.
    pending: HashMap<i32, bool>,
}

impl Newborns {
    /// An unknown process's first stop: Some(vfork) if its parent's event came already.
    pub(crate) fn first_stop(&mut self, pid: i32) -> Option<bool> {
        let vfork = self.pending.remove(&pid);
        if vfork.is_none() {
            self.early.insert(pid);
        }
        vfork
    }

    /// A fork event (`PTRACE_EVENT_FORK` or `_VFORK`) in `parent`: the new process and whether
    /// it was a vfork, if its first stop came already.
    pub(crate) fn fork_event(&mut self, parent: i32, event: i32) -> Option<(i32, bool)> {
        let mut msg: libc::c_ulong = 0;
        // SAFETY: our stopped tracee, in a fork event stop; msg is a valid out-pointer.
        if unsafe { libc::ptrace(libc::PTRACE_GETEVENTMSG, parent, 0, &mut msg) } != 0 {
            return None;
        }
        let child = msg as i32;
        let vfork = event == libc::PTRACE_EVENT_VFORK;
        if self.early.remove(&child) {
            return Some((child, vfork));
        }
        self.pending.insert(child, vfork);
        None
    }
}

/// Where a new image followed from its exec stands at one of its syscall stops.
pub(crate) enum Startup {
    /// Followed on to its next syscall (`PTRACE_SYSCALL` done).
    Follow,
    /// At its first `set_tid_address`: its libraries are mapped, none of their code has run.
    Started,
    /// No such syscall in `STARTUP_STOPS` stops: let run on.
    GaveUp,
}

/// One syscall stop of `pid`'s new image, `stops` counting them.
pub(crate) fn startup_stop(pid: i32, stops: &mut u32) -> Startup {
    *stops += 1;
    // SAFETY: reading a word of a stopped tracee's user area.
    let nr = unsafe { libc::ptrace(libc::PTRACE_PEEKUSER, pid, ORIG_RAX_OFFSET, 0) };
    if nr == SYS_SET_TID_ADDRESS {
        return Startup::Started;
    }
    if *stops >= STARTUP_STOPS {
        return Startup::GaveUp;
    }
    // SAFETY: resuming a stopped tracee to its next syscall.
    unsafe { libc::ptrace(libc::PTRACE_SYSCALL, pid, 0, 0) };
    Startup::Follow
}
