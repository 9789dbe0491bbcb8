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
//! Nothing is owed at the end: when heaptrace exits, even killed, the kernel lets go of every
//! tracee it had (`exit_ptrace`), none of them killed (no `PTRACE_O_EXITKILL`).
use std::{
    collections::{HashMap, HashSet},
    io,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
        mpsc,
    },
};

use super::launch::{Forks, Storm, group_stop, monotonic_ns};

const OPTIONS: libc::c_int = libc::PTRACE_O_TRACEFORK | libc::PTRACE_O_TRACEVFORK;

/// The tree's processes as the seize left them.
pub struct Seized {
    /// Seized: their forks are held.
    pub held: Vec<u32>,
    /// Not seized, and why (another tracer has it, or it ended).
    pub refused: Vec<(u32, io::Error)>,
    /// How many were let go of since, for the signals they were sent.
    pub released: Arc<AtomicU32>,
}

/// Seizes `pids` on a thread of its own (ptrace requests must come from the tracer), which
/// then holds each of their forks for `forks` until heaptrace exits or the tree is gone.
pub fn seize(pids: &[u32], forks: Arc<dyn Forks>) -> io::Result<Seized> {
    let (tx, rx) = mpsc::channel();
    let pids = pids.to_vec();
    let released = Arc::new(AtomicU32::new(0));
    let counter = released.clone();
    std::thread::Builder::new()
        .name("heaptrace-tree".into())
        .spawn(move || {
            let mut tree = Tree::new(forks, counter);
            let (held, refused) = tree.seize(&pids);
            let _ = tx.send((held, refused));
            tree.run();
        })?;
    let (held, refused) = rx
        .recv()
        .map_err(|_| io::Error::other("the tracer thread ended"))?;
    Ok(Seized {
        held,
        refused,
        released,
    })
}

/// The tracer thread's state: the processes it holds and those on their way.
struct Tree {
    forks: Arc<dyn Forks>,
    /// Seized (main threads), each with its signal stops' times.
    kids: HashMap<i32, Storm>,
    /// New processes seen stopped before their parent's fork event.
    early: HashSet<i32>,
    /// Fork events seen before the new process's first stop: whether each was a vfork.
    pending: HashMap<i32, bool>,
    released: Arc<AtomicU32>,
}

impl Tree {
    fn new(forks: Arc<dyn Forks>, released: Arc<AtomicU32>) -> Tree {
        Tree {
            forks,
            kids: HashMap::new(),
            early: HashSet::new(),
            pending: HashMap::new(),
            released,
        }
    }

    fn seize(&mut self, pids: &[u32]) -> (Vec<u32>, Vec<(u32, io::Error)>) {
        let (mut held, mut refused) = (Vec::new(), Vec::new());
        for &pid in pids {
            // SAFETY: seizing a process by pid; no memory is passed.
            let r = unsafe { libc::ptrace(libc::PTRACE_SEIZE, pid as i32, 0, OPTIONS) };
            if r == 0 {
                self.kids.insert(pid as i32, Storm::new());
                held.push(pid);
            } else {
                refused.push((pid, io::Error::last_os_error()));
            }
        }
        (held, refused)
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
            match self.pending.remove(&pid) {
                Some(vfork) => self.settle(pid, vfork),
                None => {
                    self.early.insert(pid);
                }
            }
            return;
        }
        let (sig, event) = (libc::WSTOPSIG(status), status >> 16);
        let resume = match event {
            libc::PTRACE_EVENT_FORK | libc::PTRACE_EVENT_VFORK => {
                self.forked(pid, event);
                0
            }
            // SAFETY: our tracee, in a group-stop: left stopped until SIGCONT.
            libc::PTRACE_EVENT_STOP if group_stop(sig) => unsafe {
                libc::ptrace(libc::PTRACE_LISTEN, pid, 0, 0);
                return;
            },
            0 => {
                if self.storm(pid, sig) {
                    return;
                }
                sig
            }
            _ => 0,
        };
        // SAFETY: resuming our stopped tracee.
        unsafe { libc::ptrace(libc::PTRACE_CONT, pid, 0, resume as libc::c_long) };
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
        self.released.fetch_add(1, Ordering::Relaxed);
        log::debug!("pid {pid} let go of: {per_second} signals a second");
        true
    }

    /// A fork event in `parent`: the new process is settled now if its first stop came
    /// already, else at that stop.
    fn forked(&mut self, parent: i32, event: i32) {
        let mut msg: libc::c_ulong = 0;
        // SAFETY: our stopped tracee, in a fork event stop; msg is a valid out-pointer.
        if unsafe { libc::ptrace(libc::PTRACE_GETEVENTMSG, parent, 0, &mut msg) } != 0 {
            return;
        }
        let child = msg as i32;
        let vfork = event == libc::PTRACE_EVENT_VFORK;
        if self.early.remove(&child) {
            self.settle(child, vfork);
        } else {
            self.pending.insert(child, vfork);
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
