//! A running process tree (`-p PID --follow-forks`) seized with ptrace, so that each process
//! it forks is held before its first instruction while the probe stage gives it links of its
//! own (`launch::Forks`), as a launched command's forks are: no process outside the tree
//! traps.
//!
//! `PTRACE_SEIZE` stops nothing and sends nothing: the processes run on, and only their forks
//! (`PTRACE_O_TRACEFORK`, `TRACEVFORK`) and the signals they are sent stop them, for a round
//! trip through this thread. A process sent signals faster than that is let go of
//! (`PTRACE_DETACH`, as a launched command is, `launch::Storm`); its later forks are followed
//! from the kernel's report instead (`HeldForks::follow_late`). Only each process's main
//! thread is seized (as a launched command's): a fork by another thread is followed late too.
//! A process another tracer holds already (gdb, strace) cannot be seized: the same.
//!
//! An exec (`PTRACE_O_TRACEEXEC`) is followed from syscall to syscall to the new image's first
//! `set_tid_address` and held there for the daemon (`launch::Event::ForkStarted`), as a
//! launched command's followed forks are: its unwind tables go in before its first call.
//!
//! A Python of the tree is held as its finalization begins (`launch::FinalizeHold`, the
//! daemon's `hold_finalize`), as a launched command is: the probe's signal stop is taken
//! for a round, then dropped.
//!
//! Nothing is owed at the end: when heaptrace exits, even killed, the kernel lets go of every
//! tracee it had (`exit_ptrace`), none of them killed (no `PTRACE_O_EXITKILL`).
use std::{
    collections::HashMap,
    io,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
        mpsc,
    },
};

use super::launch::{
    EXEC_HOLD, EXIT_HOLD, Event, FinalizeHold, Forks, Newborns, SYSCALL_STOP, Startup, Storm,
    group_stop, hold, monotonic_ns, startup_stop,
};

const OPTIONS: libc::c_int = libc::PTRACE_O_TRACEFORK
    | libc::PTRACE_O_TRACEVFORK
    | libc::PTRACE_O_TRACEEXEC
    | libc::PTRACE_O_TRACESYSGOOD;

/// The daemon's side of the tree's holds: each new image started (`Event::ForkStarted`),
/// acknowledged once its tables are in; each Python finalizing (`Event::Finalizing`), once a
/// round is drained.
pub struct Holds {
    pub events: tokio::sync::mpsc::UnboundedReceiver<Event>,
    pub ack: mpsc::Sender<()>,
    pub finalize: Arc<FinalizeHold>,
}

/// The tree's processes as the seize left them.
pub struct Seized {
    /// Not seized, and why (another tracer has it, or it ended).
    pub refused: Vec<(u32, io::Error)>,
    /// How many were let go of since, for the signals they were sent.
    pub released: Arc<AtomicU32>,
}

/// Seizes `pids` on a thread of its own (ptrace requests must come from the tracer), which
/// then holds each of their forks for `forks`, and each new image for the daemon, until
/// heaptrace exits or the tree is gone.
pub fn seize(pids: &[u32], forks: Arc<dyn Forks>) -> io::Result<(Seized, Holds)> {
    let (tx, rx) = mpsc::channel();
    let (events_tx, events) = tokio::sync::mpsc::unbounded_channel();
    let (ack, ack_rx) = mpsc::channel();
    let pids = pids.to_vec();
    let released = Arc::new(AtomicU32::new(0));
    let counter = released.clone();
    let finalize = Arc::new(FinalizeHold::default());
    let held = finalize.clone();
    std::thread::Builder::new()
        .name("heaptrace-tree".into())
        .spawn(move || {
            let mut tree = Tree::new(forks, counter, (events_tx, ack_rx), held);
            let _ = tx.send(tree.seize(&pids));
            tree.run();
        })?;
    let refused = rx
        .recv()
        .map_err(|_| io::Error::other("the tracer thread ended"))?;
    let seized = Seized { refused, released };
    let holds = Holds {
        events,
        ack,
        finalize,
    };
    Ok((seized, holds))
}

/// The tracer thread's state: the processes it holds and those on their way.
struct Tree {
    forks: Arc<dyn Forks>,
    /// Seized (main threads), each with its signal stops' times.
    kids: HashMap<i32, Storm>,
    /// New processes on their way (their fork event and their first stop).
    newborns: Newborns,
    released: Arc<AtomicU32>,
    /// New images followed from their exec to their start, with the syscall stops seen.
    startup: HashMap<i32, u32>,
    daemon: (
        tokio::sync::mpsc::UnboundedSender<Event>,
        mpsc::Receiver<()>,
    ),
    /// Where each Python of the tree is held at its finalization (set by the daemon).
    finalize: Arc<FinalizeHold>,
}

impl Tree {
    fn new(
        forks: Arc<dyn Forks>,
        released: Arc<AtomicU32>,
        daemon: (
            tokio::sync::mpsc::UnboundedSender<Event>,
            mpsc::Receiver<()>,
        ),
        finalize: Arc<FinalizeHold>,
    ) -> Tree {
        Tree {
            forks,
            kids: HashMap::new(),
            newborns: Newborns::default(),
            released,
            startup: HashMap::new(),
            daemon,
            finalize,
        }
    }

    /// Seizes each of `pids`; those refused, with why.
    fn seize(&mut self, pids: &[u32]) -> Vec<(u32, io::Error)> {
        let mut refused = Vec::new();
        for &pid in pids {
            // SAFETY: seizing a process by pid; no memory is passed.
            let r = unsafe { libc::ptrace(libc::PTRACE_SEIZE, pid as i32, 0, OPTIONS) };
            if r == 0 {
                self.kids.insert(pid as i32, Storm::new());
            } else {
                refused.push((pid, io::Error::last_os_error()));
            }
        }
        refused
    }

    /// Waits for the tracees' stops until none is left.
    fn run(mut self) {
        loop {
            let mut status = 0;
            // SAFETY: waiting for this thread's tracees only.
            let r = unsafe { libc::waitpid(-1, &mut status, libc::__WALL | libc::__WNOTHREAD) };
            if r < 0 {
                if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                return; // ECHILD: the tree is gone, or let go of
            }
            if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
                self.startup.remove(&r);
                if self.kids.remove(&r).is_some() {
                    self.forks.gone(r as u32);
                }
            } else if libc::WIFSTOPPED(status) {
                self.stopped(r, status);
            }
        }
    }

    fn stopped(&mut self, pid: i32, status: i32) {
        if !self.kids.contains_key(&pid) {
            // A new process's first stop: settled once its parent's event told how it came.
            if let Some(vfork) = self.newborns.first_stop(pid) {
                self.settle(pid, vfork);
            }
            return;
        }
        let (sig, event) = (libc::WSTOPSIG(status), status >> 16);
        if sig == SYSCALL_STOP && event == 0 {
            self.syscall_stop(pid);
            return;
        }
        let resume = match event {
            libc::PTRACE_EVENT_FORK | libc::PTRACE_EVENT_VFORK => {
                self.forked(pid, event);
                0
            }
            libc::PTRACE_EVENT_EXEC => {
                // Its libraries are not mapped yet: followed to their start.
                self.startup.insert(pid, 0);
                // SAFETY: our tracee, in its exec stop.
                unsafe { libc::ptrace(libc::PTRACE_SYSCALL, pid, 0, 0) };
                return;
            }
            // SAFETY: our tracee, in a group-stop: left stopped until SIGCONT.
            libc::PTRACE_EVENT_STOP if group_stop(sig) => unsafe {
                libc::ptrace(libc::PTRACE_LISTEN, pid, 0, 0);
                return;
            },
            0 if self.finalize.ours(pid, sig) => {
                // The probe's signal, not the program's: held for a round, then dropped.
                let (events, ack) = &self.daemon;
                hold(events, Event::Finalizing(pid as u32), ack, EXIT_HOLD);
                0
            }
            0 => {
                if self.storm(pid, sig) {
                    return;
                }
                sig
            }
            _ => 0,
        };
        // A new image keeps being followed to its start through any other stop.
        let request = match self.startup.contains_key(&pid) {
            true => libc::PTRACE_SYSCALL,
            false => libc::PTRACE_CONT,
        };
        // SAFETY: resuming our stopped tracee.
        unsafe { libc::ptrace(request, pid, 0, resume as libc::c_long) };
    }

    /// A syscall stop of a new image: at its first set_tid_address, held for the daemon
    /// (`Event::ForkStarted`) and let run on; after `STARTUP_STOPS` without one, let run on.
    fn syscall_stop(&mut self, pid: i32) {
        let Some(stops) = self.startup.get_mut(&pid) else {
            // SAFETY: resuming our stopped tracee.
            unsafe { libc::ptrace(libc::PTRACE_CONT, pid, 0, 0) };
            return;
        };
        match startup_stop(pid, stops) {
            Startup::Follow => return,
            Startup::Started => {
                self.startup.remove(&pid);
                let (events, ack) = &self.daemon;
                hold(events, Event::ForkStarted(pid as u32), ack, EXEC_HOLD);
            }
            Startup::GaveUp => {
                self.startup.remove(&pid);
            }
        }
        // SAFETY: as above.
        unsafe { libc::ptrace(libc::PTRACE_CONT, pid, 0, 0) };
    }

    /// A signal-delivery-stop: true if it was one too many, the process let go of with it.
    fn storm(&mut self, pid: i32, sig: i32) -> bool {
        let Some(per_second) = self.kids.get_mut(&pid).and_then(|s| s.stop(monotonic_ns())) else {
            return false;
        };
        // SAFETY: detaching our tracee, in a signal-delivery-stop, delivering its signal.
        if unsafe { libc::ptrace(libc::PTRACE_DETACH, pid, 0, sig as libc::c_long) } != 0 {
            return false;
        }
        self.kids.remove(&pid);
        self.startup.remove(&pid);
        self.released.fetch_add(1, Ordering::Relaxed);
        log::debug!("pid {pid} let go of: {per_second} signals a second");
        true
    }

    /// A fork event in `parent`: the new process is settled now if its first stop came
    /// already, else at that stop.
    fn forked(&mut self, parent: i32, event: i32) {
        if let Some((child, vfork)) = self.newborns.fork_event(parent, event) {
            self.settle(child, vfork);
        }
    }

    /// A new process, held before its first instruction: followed (kept seized, its own forks
    /// held in turn) or let go of, as the probe stage decides.
    fn settle(&mut self, pid: i32, vfork: bool) {
        if self.forks.forked(pid as u32, vfork) {
            self.kids.insert(pid, Storm::new());
            // SAFETY: resuming a new tracee, in its first stop.
            unsafe { libc::ptrace(libc::PTRACE_CONT, pid, 0, 0) };
        } else {
            // SAFETY: letting go of a new tracee, in its first stop.
            unsafe { libc::ptrace(libc::PTRACE_DETACH, pid, 0, 0) };
        }
    }
}
