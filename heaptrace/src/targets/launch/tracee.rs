//! A seized child's stops, from its exec to its exit: held at its exit, at later execs and at
//! each image's start for the daemon; job control left to work; signals noted and delivered.
//!
//! Every signal the command takes stops it in its tracer (a signal-delivery-stop) for a round
//! trip through this thread. A command that takes signals faster than that (an `ITIMER_REAL`
//! of 50 us) would make no progress, so past `STORM_STOPS` in `STORM_WINDOW_NS` it is let go
//! of (`PTRACE_DETACH`, its signal delivered) and from then on only waited for, as the parent
//! it still is: no longer held at its exit or later execs.
use std::{
    collections::{HashMap, HashSet},
    io::{self, Read as _},
    sync::mpsc,
    time::Duration,
};

use super::{
    Event, Link, monotonic_ns,
    newborn::{Newborns, Startup, startup_stop},
    wait_exit,
};
use crate::exit_status::ExitStatus;

/// How long the child may be held at its exit, whatever the daemon is doing.
pub(crate) const EXIT_HOLD: Duration = Duration::from_secs(5);
/// How long an exec'ed image may wait for its allocator's probes, its unwind tables and its
/// interpreter (a few hundred milliseconds, but the daemon takes the event only between two
/// rounds, and a round naming a big library's first stacks took seconds in a loaded debug
/// build: past 5 s, a Python's new image ran its first lines before its interpreter was read).
pub(crate) const EXEC_HOLD: Duration = Duration::from_secs(20);

/// A syscall stop, as `PTRACE_O_TRACESYSGOOD` marks it.
pub(crate) const SYSCALL_STOP: i32 = libc::SIGTRAP | 0x80;
/// set_tid_address on x86-64: glibc's loader (and musl, and a static glibc) sets up the main
/// thread with it once every library the program starts with is mapped.
pub(crate) const SYS_SET_TID_ADDRESS: i64 = 218;
/// orig_rax's word in the tracee's user area (`struct user_regs_struct`).
pub(crate) const ORIG_RAX_OFFSET: usize = 15 * 8;
/// Syscall stops a new image is followed through, at most, looking for set_tid_address.
pub(crate) const STARTUP_STOPS: u32 = 2000;

/// Signal-delivery-stops within `STORM_WINDOW_NS` past which the command is let go of: a stop
/// costs tens of microseconds (two switches through this thread, more on a busy host), so
/// 256 a second cost it a few percent at most, and a faster stream would be slowed or stalled.
const STORM_STOPS: usize = 256;
const STORM_WINDOW_NS: u64 = 1_000_000_000;

/// Tells the daemon about a stop and waits for its acknowledgement (or the timeout). An
/// acknowledgement that came after an earlier stop's timeout is not taken for this one's.
pub(crate) fn hold(
    events: &tokio::sync::mpsc::UnboundedSender<Event>,
    event: Event,
    ack: &mpsc::Receiver<()>,
    timeout: Duration,
) {
    while ack.try_recv().is_ok() {}
    let what = format!("{event:?}");
    if events.send(event).is_ok() && ack.recv_timeout(timeout).is_err() {
        log::debug!("{what}: no acknowledgement within {timeout:?}, let go");
    }
}

/// Whether a `PTRACE_EVENT_STOP` is a group-stop: only those stay stopped (`PTRACE_LISTEN`).
/// The others (SIGTRAP: a SIGCONT reached the command, or ended its group-stop) must be
/// resumed, or it stays stopped for good.
pub(crate) fn group_stop(sig: i32) -> bool {
    matches!(
        sig,
        libc::SIGSTOP | libc::SIGTSTP | libc::SIGTTIN | libc::SIGTTOU
    )
}

/// When the last `STORM_STOPS` signal-delivery-stops came.
pub(crate) struct Storm {
    times: Vec<u64>,
    next: usize,
}

impl Storm {
    pub(crate) fn new() -> Storm {
        Storm {
            times: vec![0; STORM_STOPS],
            next: 0,
        }
    }

    /// A signal-delivery-stop at `now`: the stops a second, if the last `STORM_STOPS` came
    /// within `STORM_WINDOW_NS`.
    pub(crate) fn stop(&mut self, now: u64) -> Option<u32> {
        let oldest = std::mem::replace(&mut self.times[self.next], now);
        self.next = (self.next + 1) % STORM_STOPS;
        let span = now.saturating_sub(oldest);
        (oldest != 0 && span < STORM_WINDOW_NS)
            .then(|| (STORM_STOPS as u64 * 1_000_000_000 / span.max(1)).min(u32::MAX as u64) as u32)
    }
}

/// A seized child, followed until it is gone: the state its stops share.
pub(super) struct Tracee {
    pid: i32,
    /// The close-on-exec status pipe, watched until exec's outcome is known.
    status: std::fs::File,
    /// Told how exec went, once; None after.
    started: Option<mpsc::Sender<std::result::Result<(), i32>>>,
    link: Link,
    /// Execs seen: the first is the command's own.
    execs: u32,
    /// Syscall stops of a new image followed to its start (`Event::Started`); None when not
    /// following one.
    startup: Option<u32>,
    storm: Storm,
    /// Gone (reaped): the forks followed are still waited for.
    gone: bool,
    /// The forks followed, traced by this thread: their stops are passed on, never held.
    kids: HashSet<i32>,
    /// New processes on their way (their fork event and their first stop).
    newborns: Newborns,
    /// Followed forks that exec'ed, followed from syscall to syscall to their image's start
    /// (`Event::ForkStarted`), with the stops seen.
    kid_startup: HashMap<i32, u32>,
}

impl Tracee {
    pub(super) fn new(
        pid: i32,
        status: std::fs::File,
        started: mpsc::Sender<std::result::Result<(), i32>>,
        link: Link,
    ) -> Tracee {
        Tracee {
            pid,
            status,
            started: Some(started),
            link,
            execs: 0,
            startup: None,
            storm: Storm::new(),
            gone: false,
            kids: HashSet::new(),
            newborns: Newborns::default(),
            kid_startup: HashMap::new(),
        }
    }

    /// Waits for the child's stops until it is gone (once let go of, for its end alone), and
    /// then for the forks followed until they are gone too.
    pub(super) fn run(mut self) {
        loop {
            if self.exec_failed() {
                return;
            }
            let mut status = 0;
            // This thread's own child and tracees only: never another thread's children.
            let wait_flags = if self.started.is_some() {
                libc::__WALL | libc::__WNOTHREAD | libc::WNOHANG
            } else {
                libc::__WALL | libc::__WNOTHREAD
            };
            // SAFETY: waiting for our own child and tracees.
            let r = unsafe { libc::waitpid(-1, &mut status, wait_flags) };
            if r == 0 {
                continue; // WNOHANG, nothing yet
            }
            if r < 0 {
                if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                if !self.gone {
                    let _ = self.link.events.send(Event::Exited(None));
                }
                return;
            }
            if r != self.pid {
                self.other(r, status);
                continue;
            }
            if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
                self.exec_done();
                self.gone = true;
                let _ = self
                    .link
                    .events
                    .send(Event::Exited(ExitStatus::from_wait(status)));
                continue; // on to the forks followed, until none is left (ECHILD)
            }
            if libc::WIFSTOPPED(status) {
                self.stopped(status);
            }
        }
    }

    /// A stop or end of a process other than the command: a fork of it.
    fn other(&mut self, pid: i32, status: i32) {
        if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
            self.kid_startup.remove(&pid);
            if self.kids.remove(&pid)
                && let Some(f) = super::forks::of(&self.link.forks)
            {
                f.gone(pid as u32);
            }
            return;
        }
        if !libc::WIFSTOPPED(status) {
            return;
        }
        if !self.kids.contains(&pid) {
            // A new process's first stop: settled once its parent's event told how it came.
            if let Some(vfork) = self.newborns.first_stop(pid) {
                self.settle(pid, vfork);
            }
            return;
        }
        let (sig, event) = (libc::WSTOPSIG(status), status >> 16);
        if sig == SYSCALL_STOP && event == 0 {
            self.kid_syscall_stop(pid);
            return;
        }
        let resume = match event {
            libc::PTRACE_EVENT_FORK | libc::PTRACE_EVENT_VFORK => {
                self.forked(pid, event);
                0
            }
            libc::PTRACE_EVENT_EXEC => {
                // Its libraries are not mapped yet: followed to their start, as the
                // command's new images are, so that their unwind tables go in first.
                self.kid_startup.insert(pid, 0);
                // SAFETY: a followed fork, traced by this thread, in its exec stop.
                unsafe { libc::ptrace(libc::PTRACE_SYSCALL, pid, 0, 0) };
                return;
            }
            // SAFETY: a followed fork, traced by this thread, in a group-stop.
            libc::PTRACE_EVENT_STOP if group_stop(sig) => unsafe {
                libc::ptrace(libc::PTRACE_LISTEN, pid, 0, 0);
                return;
            },
            0 if self.link.finalize.ours(pid, sig) => {
                let event = Event::Finalizing(pid as u32);
                hold(&self.link.events, event, &self.link.ack, EXIT_HOLD);
                0
            }
            0 if sig != SYSCALL_STOP => sig,
            _ => 0,
        };
        // SAFETY: resuming a followed fork, traced by this thread and stopped.
        unsafe { libc::ptrace(libc::PTRACE_CONT, pid, 0, resume as libc::c_long) };
    }

    /// A syscall stop of a followed fork's new image: at its first set_tid_address, holds it
    /// for the daemon (`Event::ForkStarted`) and lets it run on; after `STARTUP_STOPS`
    /// without one, lets it run on.
    fn kid_syscall_stop(&mut self, pid: i32) {
        let Some(stops) = self.kid_startup.get_mut(&pid) else {
            // SAFETY: resuming a followed fork, traced by this thread and stopped.
            unsafe { libc::ptrace(libc::PTRACE_CONT, pid, 0, 0) };
            return;
        };
        match startup_stop(pid, stops) {
            Startup::Follow => return,
            Startup::Started => {
                self.kid_startup.remove(&pid);
                let event = Event::ForkStarted(pid as u32);
                hold(&self.link.events, event, &self.link.ack, EXEC_HOLD);
            }
            Startup::GaveUp => {
                self.kid_startup.remove(&pid);
            }
        }
        // SAFETY: as above.
        unsafe { libc::ptrace(libc::PTRACE_CONT, pid, 0, 0) };
    }

    /// A fork event in `parent`: the new process is settled now if its first stop came
    /// already, else at that stop.
    fn forked(&mut self, parent: i32, event: i32) {
        if let Some((child, vfork)) = self.newborns.fork_event(parent, event) {
            self.settle(child, vfork);
        }
    }

    /// A new process, held before its first instruction: followed (kept traced) or let go
    /// of, as the probe stage decides.
    fn settle(&mut self, pid: i32, vfork: bool) {
        let followed =
            super::forks::of(&self.link.forks).is_some_and(|f| f.forked(pid as u32, vfork));
        if followed {
            self.kids.insert(pid);
            // SAFETY: resuming a new process traced by this thread, in its first stop.
            unsafe { libc::ptrace(libc::PTRACE_CONT, pid, 0, 0) };
        } else {
            // SAFETY: letting go of a new process traced by this thread, in its first stop.
            unsafe { libc::ptrace(libc::PTRACE_DETACH, pid, 0, 0) };
        }
    }

    /// Until exec succeeded (the close-on-exec pipe hangs up) or failed (an errno on it).
    /// True if it failed: the child is reaped and `started` told.
    fn exec_failed(&mut self) -> bool {
        if let Some(tx) = self.started.take() {
            match exec_outcome(&mut self.status) {
                Some(Ok(())) => {
                    let _ = tx.send(Ok(()));
                }
                Some(Err(errno)) => {
                    wait_exit(self.pid);
                    let _ = tx.send(Err(errno));
                    return true;
                }
                None => self.started = Some(tx),
            }
        }
        false
    }

    /// The child got past exec (it is exiting, or gone) before the pipe said so.
    fn exec_done(&mut self) {
        if let Some(tx) = self.started.take() {
            let _ = tx.send(Ok(()));
        }
    }

    /// A ptrace stop: holds the child at its exit and at later execs, leaves a group-stop
    /// stopped, delivers signals.
    fn stopped(&mut self, status: i32) {
        let (pid, sig, event) = (self.pid, libc::WSTOPSIG(status), status >> 16);
        if sig == SYSCALL_STOP && event == 0 {
            self.syscall_stop();
            return;
        }
        match event {
            libc::PTRACE_EVENT_EXIT => {
                self.exec_done();
                hold(&self.link.events, Event::Exiting, &self.link.ack, EXIT_HOLD);
                self.resume(0);
            }
            libc::PTRACE_EVENT_EXEC => {
                self.execs += 1;
                // The first is the command's own, attached for already.
                if self.execs > 1 {
                    hold(&self.link.events, Event::Exec, &self.link.ack, EXEC_HOLD);
                }
                // Followed from syscall to syscall until its libraries are mapped.
                self.startup = Some(0);
                self.resume(0);
            }
            libc::PTRACE_EVENT_FORK | libc::PTRACE_EVENT_VFORK => {
                self.forked(pid, event);
                self.resume(0);
            }
            // A group stop (SIGSTOP, SIGTSTP...): left stopped until SIGCONT.
            // SAFETY: our own seized child, in a group-stop.
            libc::PTRACE_EVENT_STOP if group_stop(sig) => unsafe {
                libc::ptrace(libc::PTRACE_LISTEN, pid, 0, 0);
            },
            // A signal on its way.
            0 => self.signal_stop(sig),
            // Any other stop (SIGCONT, the end of a group-stop) goes on.
            _ => self.resume(0),
        }
    }

    /// A signal-delivery-stop: noted for the daemon and delivered; past `STORM_STOPS` a
    /// second, delivered as the command is let go of.
    fn signal_stop(&mut self, sig: i32) {
        if self.link.finalize.ours(self.pid, sig) {
            // The probe's signal, not the program's: held, then dropped.
            let event = Event::Finalizing(self.pid as u32);
            hold(&self.link.events, event, &self.link.ack, EXIT_HOLD);
            self.resume(0);
            return;
        }
        self.link.delivered.note(sig);
        let Some(per_second) = self.storm.stop(monotonic_ns()) else {
            self.resume(sig);
            return;
        };
        // SAFETY: detaching our own seized child, in a signal-delivery-stop.
        if unsafe { libc::ptrace(libc::PTRACE_DETACH, self.pid, 0, sig as libc::c_long) } != 0 {
            log::debug!(
                "cannot let pid {} go: {}",
                self.pid,
                io::Error::last_os_error()
            );
            self.resume(sig);
            return;
        }
        self.startup = None;
        let _ = self.link.events.send(Event::Released { per_second });
    }

    /// Lets the child go on (delivering `sig`, unless 0): to its next syscall while its
    /// start is followed.
    fn resume(&self, sig: i32) {
        let request = match self.startup {
            Some(_) => libc::PTRACE_SYSCALL,
            None => libc::PTRACE_CONT,
        };
        // SAFETY: resuming our own seized, stopped child.
        unsafe { libc::ptrace(request, self.pid, 0, sig as libc::c_long) };
    }

    /// A syscall stop of an image followed from its exec: at its first set_tid_address, holds
    /// it for the daemon (`Event::Started`) and lets it run on untraced; after
    /// `STARTUP_STOPS` without one, lets it go.
    fn syscall_stop(&mut self) {
        let pid = self.pid;
        let stops = self.startup.map_or(STARTUP_STOPS, |n| n + 1);
        // SAFETY: reading a word of our stopped tracee's user area.
        let nr = unsafe { libc::ptrace(libc::PTRACE_PEEKUSER, pid, ORIG_RAX_OFFSET, 0) };
        if nr != SYS_SET_TID_ADDRESS && stops < STARTUP_STOPS {
            self.startup = Some(stops);
            self.resume(0);
            return;
        }
        self.startup = None;
        if nr == SYS_SET_TID_ADDRESS {
            hold(&self.link.events, Event::Started, &self.link.ack, EXEC_HOLD);
        }
        self.resume(0);
    }
}

/// Whether exec has happened yet: waits a little on the close-on-exec pipe. Some(Ok) once it
/// hangs up (exec succeeded), Some(Err(errno)) if the child wrote why exec failed, None if
/// neither yet.
fn exec_outcome(f: &mut std::fs::File) -> Option<std::result::Result<(), i32>> {
    use std::os::fd::AsRawFd as _;
    let mut pfd = libc::pollfd {
        fd: f.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut pfd, 1, 20) };
    if n <= 0 {
        return None;
    }
    let mut buf = [0u8; 4];
    match f.read(&mut buf) {
        Ok(4) => Some(Err(i32::from_ne_bytes(buf))),
        _ => Some(Ok(())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_storm_is_that_many_stops_within_the_window() {
        let mut s = Storm::new();
        let step = STORM_WINDOW_NS / STORM_STOPS as u64;
        // One stop short of the window's worth: never a storm.
        for i in 1..=(4 * STORM_STOPS as u64) {
            assert_eq!(s.stop(i * (step + 10)), None, "{i}");
        }
        let mut s = Storm::new();
        let mut got = None;
        for i in 1..=(STORM_STOPS as u64 + 1) {
            got = s.stop(i * 50_000);
        }
        // 50 us apart: 20,000 a second.
        assert_eq!(got, Some(20_000));
    }
}
