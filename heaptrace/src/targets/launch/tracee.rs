//! A seized child's stops, from its exec to its exit: held at its exit, at later execs and at
//! each image's start for the daemon; job control left to work; signals noted and delivered.
use std::{
    io::{self, Read as _},
    sync::mpsc,
    time::Duration,
};

use super::{Event, Link, wait_exit};
use crate::exit_status::ExitStatus;

/// How long the child may be held at its exit, whatever the daemon is doing.
const EXIT_HOLD: Duration = Duration::from_secs(5);
/// How long an exec'ed image may wait for its allocator's probes (attaching takes a few
/// hundred milliseconds at most).
const EXEC_HOLD: Duration = Duration::from_secs(5);

/// A syscall stop, as `PTRACE_O_TRACESYSGOOD` marks it.
const SYSCALL_STOP: i32 = libc::SIGTRAP | 0x80;
/// set_tid_address on x86-64: glibc's loader (and musl, and a static glibc) sets up the main
/// thread with it once every library the program starts with is mapped.
const SYS_SET_TID_ADDRESS: i64 = 218;
/// orig_rax's word in the tracee's user area (`struct user_regs_struct`).
const ORIG_RAX_OFFSET: usize = 15 * 8;
/// Syscall stops a new image is followed through, at most, looking for set_tid_address.
const STARTUP_STOPS: u32 = 2000;

/// Tells the daemon about a stop and waits for its acknowledgement (or the timeout). An
/// acknowledgement that came after an earlier stop's timeout is not taken for this one's.
fn hold(
    events: &tokio::sync::mpsc::UnboundedSender<Event>,
    event: Event,
    ack: &mpsc::Receiver<()>,
    timeout: Duration,
) {
    while ack.try_recv().is_ok() {}
    if events.send(event).is_ok() {
        let _ = ack.recv_timeout(timeout);
    }
}

/// Whether a `PTRACE_EVENT_STOP` is a group-stop: only those stay stopped (`PTRACE_LISTEN`).
/// The others (SIGTRAP: a SIGCONT reached the command, or ended its group-stop) must be
/// resumed, or it stays stopped for good.
fn group_stop(sig: i32) -> bool {
    matches!(
        sig,
        libc::SIGSTOP | libc::SIGTSTP | libc::SIGTTIN | libc::SIGTTOU
    )
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
        }
    }

    /// Waits for the child's stops until it is gone.
    pub(super) fn run(mut self) {
        loop {
            if self.exec_failed() {
                return;
            }
            let mut status = 0;
            let wait_flags = if self.started.is_some() {
                libc::__WALL | libc::WNOHANG
            } else {
                libc::__WALL
            };
            // SAFETY: waiting for our own child.
            let r = unsafe { libc::waitpid(self.pid, &mut status, wait_flags) };
            if r == 0 {
                continue; // WNOHANG, nothing yet
            }
            if r < 0 {
                if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                let _ = self.link.events.send(Event::Exited(None));
                return;
            }
            if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
                self.exec_done();
                let _ = self
                    .link
                    .events
                    .send(Event::Exited(ExitStatus::from_wait(status)));
                return;
            }
            if libc::WIFSTOPPED(status) {
                self.stopped(status);
            }
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

    /// A signal-delivery-stop: noted for the daemon, and delivered.
    fn signal_stop(&mut self, sig: i32) {
        self.link.delivered.note(sig);
        self.resume(sig);
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
