//! Starting a command before its first instruction, so the probes are in place before it
//! runs: fork, the child waits on a pipe, the parent attaches, then lets it exec.
//!
//! std's `Command::pre_exec` cannot do this (spawn waits for the exec), hence the raw fork.
//!
//! The child is also held at its exit, with ptrace (`PTRACE_O_TRACEEXIT`): its mappings are
//! still there, so the stacks of a command shorter than a round can be symbolized. And at each
//! exec after the first (`PTRACE_O_TRACEEXEC`: a wrapper script's `exec`), before the new
//! image's first instruction: an allocator in its executable (a static binary, jemalloc linked
//! in) is probed before it runs. And at each image's first `set_tid_address`, where its
//! dynamic loader has mapped the libraries it starts with and run none of their code (the
//! tracer follows its syscalls from its exec to there): their unwind tables go in before
//! their first allocation. One thread,
//! the tracer, forks, seizes and waits for the child; it passes every signal on and tells the
//! daemon when the child is exiting and when it has exited. If heaptrace dies, even by
//! SIGKILL, the kernel kills the child (`PTRACE_O_EXITKILL`, and `PR_SET_PDEATHSIG` once it
//! is no longer traced): a launched command never runs on untraced.
//!
//! Each process it forks (`fork`, `vfork`, not a thread) is held before its first instruction
//! while the probe stage decides what becomes of it (`forks.rs`): followed (kept traced, its
//! own forks held in turn) or let go of.
//!
//! Job control works as without heaptrace: a group-stop is left stopped (`PTRACE_LISTEN`)
//! until SIGCONT, and every other `PTRACE_EVENT_STOP` resumed. The signals it is delivered
//! are noted (`Delivered`) for the daemon. A command that takes signals faster than it can be
//! stopped for each is let go of (`tracee.rs`).
use std::{
    ffi::CString,
    io::{self, Read as _},
    os::{
        fd::{FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
    sync::{Arc, mpsc},
};

use crate::{
    error::{Error, Result},
    exit_status::ExitStatus,
};

/// What the tracer thread tells the daemon.
#[derive(Debug, PartialEq, Eq)]
pub enum Event {
    /// Stopped at its exit, mappings intact; it goes on when acknowledged (or after a timeout).
    Exiting,
    /// The command or a followed fork (this pid), stopped as its Python begins to finalize
    /// (`FinalizeHold`), its code objects not yet freed; it goes on when acknowledged (or
    /// after a timeout).
    Finalizing(u32),
    /// Stopped just after an exec (not the command's own): the new executable and its loader
    /// are mapped, none of its code has run; it goes on when acknowledged (or after a timeout).
    Exec,
    /// Stopped at an image's first `set_tid_address`, the dynamic loader's thread set-up: the
    /// libraries it starts with are mapped and none of their code has run (their unwind
    /// tables can go in before their first allocation). It goes on when acknowledged (or
    /// after a timeout).
    Started,
    /// A followed fork's new image (it exec'ed), stopped as `Started` is; it goes on when
    /// acknowledged (or after a timeout).
    ForkStarted(u32),
    /// Let go of: it took signals faster than it could be stopped for each (`per_second`).
    /// From here on it is waited for as a child, not held at its exit or later execs.
    Released { per_second: u32 },
    /// Gone; None if the wait for it failed.
    Exited(Option<ExitStatus>),
}

/// A child stopped before exec.
pub struct Stopped {
    pub pid: u32,
    resume: mpsc::Sender<bool>,
    started: mpsc::Receiver<std::result::Result<(), i32>>,
    events: Option<tokio::sync::mpsc::UnboundedReceiver<Event>>,
    ack: Option<mpsc::Sender<()>>,
    delivered: Arc<Delivered>,
    finalize: Arc<FinalizeHold>,
    cmd: String,
    forks: ForkSlot,
}

/// A running child: its tracer's events, and the way to let it go on at its exit.
pub struct Child {
    pub pid: u32,
    pub events: tokio::sync::mpsc::UnboundedReceiver<Event>,
    pub ack: mpsc::Sender<()>,
    /// The signals it got, as its tracer saw them delivered.
    pub delivered: Arc<Delivered>,
    /// Where its Python's finalization is held, once the daemon sets it.
    pub finalize: Arc<FinalizeHold>,
}

struct Prepared {
    exe: CString,
    args: Vec<CString>,
    /// The whole environment, when it is not this process's.
    env: Option<Vec<CString>>,
    /// Descriptors made inheritable in the child.
    keep_fds: Vec<i32>,
    /// (stdout+stderr, stdin) for the child, when redirected; the caller keeps them open.
    redirect: Option<(i32, i32)>,
}

/// Whether exec could run `exe`: a file with an execute bit (root needs one too).
pub fn check_executable(exe: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let m = std::fs::metadata(exe)?;
    if !m.is_file() || m.permissions().mode() & 0o111 == 0 {
        return Err(std::io::Error::from_raw_os_error(libc::EACCES));
    }
    Ok(())
}

pub fn spawn_stopped(
    exe: &Path,
    argv: &[impl AsRef<std::ffi::OsStr>],
    redirect: Option<&Redirect>,
) -> Result<Stopped> {
    spawn_stopped_with(exe, argv, redirect, None)
}

/// `spawn_stopped`, with what the command inherits besides.
pub fn spawn_stopped_with(
    exe: &Path,
    argv: &[impl AsRef<std::ffi::OsStr>],
    redirect: Option<&Redirect>,
    inherit: Option<&Inherit>,
) -> Result<Stopped> {
    use std::os::fd::AsRawFd as _;
    let cmd = argv
        .first()
        .map(|a| a.as_ref().to_string_lossy().into_owned())
        .unwrap_or_default();
    let exec_err = |reason: String| Error::Exec {
        cmd: cmd.clone(),
        reason,
        found: true,
    };
    let prepared = Prepared {
        exe: CString::new(exe.as_os_str().as_bytes()).map_err(|e| exec_err(e.to_string()))?,
        args: argv
            .iter()
            .map(|a| CString::new(a.as_ref().as_bytes()))
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| exec_err(e.to_string()))?,
        redirect: redirect.map(|r| (r.output.as_raw_fd(), r.input.as_raw_fd())),
        env: inherit
            .map(|i| {
                i.environment()
                    .into_iter()
                    .map(CString::new)
                    .collect::<std::result::Result<Vec<_>, _>>()
            })
            .transpose()
            .map_err(|e| exec_err(e.to_string()))?,
        keep_fds: inherit.map(|i| i.fds.clone()).unwrap_or_default(),
    };
    let (pid_tx, pid_rx) = mpsc::channel();
    let (resume_tx, resume_rx) = mpsc::channel();
    let (started_tx, started_rx) = mpsc::channel();
    let (event_tx, event_rx) = tokio::sync::mpsc::unbounded_channel();
    let (ack_tx, ack_rx) = mpsc::channel();
    let delivered = Arc::new(Delivered::default());
    let finalize = Arc::new(FinalizeHold::default());
    let forks = ForkSlot::default();
    let link = Link {
        events: event_tx,
        ack: ack_rx,
        delivered: delivered.clone(),
        finalize: finalize.clone(),
        forks: forks.clone(),
    };
    std::thread::Builder::new()
        .name("heaptrace-tracer".into())
        .spawn(move || tracer(prepared, pid_tx, resume_rx, started_tx, link))?;
    let pid = pid_rx
        .recv()
        .map_err(|_| exec_err("the tracer thread died".into()))?
        .map_err(exec_err)?;
    Ok(Stopped {
        pid,
        resume: resume_tx,
        started: started_rx,
        events: Some(event_rx),
        ack: Some(ack_tx),
        delivered,
        finalize,
        cmd,
        forks,
    })
}

impl Stopped {
    /// What becomes of its forks: held at each until `forks` has decided. Set before `resume`.
    pub fn on_forks(&self, forks: Arc<dyn Forks>) {
        if let Ok(mut slot) = self.forks.lock() {
            *slot = Some(forks);
        }
    }

    /// Lets the child exec; fails if exec failed.
    pub fn resume(mut self) -> Result<Child> {
        let _ = self.resume.send(true);
        match self.started.recv() {
            Ok(Ok(())) => Ok(Child {
                pid: self.pid,
                events: self.events.take().expect("events"),
                ack: self.ack.take().expect("ack"),
                delivered: self.delivered.clone(),
                finalize: self.finalize.clone(),
            }),
            Ok(Err(errno)) => Err(Error::Exec {
                cmd: self.cmd,
                reason: io::Error::from_raw_os_error(errno).to_string(),
                found: errno != libc::ENOENT,
            }),
            Err(_) => Err(Error::Exec {
                cmd: self.cmd,
                reason: "the tracer thread died".into(),
                found: true,
            }),
        }
    }

    /// Kills and reaps the child (attach failed).
    pub fn abort(self) {
        let _ = self.resume.send(false);
        let _ = self.started.recv();
    }
}

/// What the tracer thread shares with the daemon.
struct Link {
    events: tokio::sync::mpsc::UnboundedSender<Event>,
    ack: mpsc::Receiver<()>,
    delivered: Arc<Delivered>,
    finalize: Arc<FinalizeHold>,
    /// Told of each fork, with the new process held.
    forks: ForkSlot,
}

/// The tracer thread: every ptrace request and wait for the child happens here.
fn tracer(
    p: Prepared,
    pid_tx: mpsc::Sender<std::result::Result<u32, String>>,
    resume: mpsc::Receiver<bool>,
    started: mpsc::Sender<std::result::Result<(), i32>>,
    link: Link,
) {
    let held = match fork_held(&p) {
        Ok(held) => held,
        Err(e) => {
            let _ = pid_tx.send(Err(e.to_string()));
            return;
        }
    };
    let pid = held.pid;
    let seized = seize(pid);
    let _ = pid_tx.send(Ok(pid as u32));
    if !release(held.go, pid, &resume, &started) {
        return;
    }
    let status = std::fs::File::from(held.status);
    if seized {
        Tracee::new(pid, status, started, link).run();
    } else {
        untraced(pid, status, started, &link.events);
    }
}

/// A forked child waiting on its go pipe, and our ends of its two pipes.
struct Held {
    pid: i32,
    /// Written to (a byte) to let the child exec, closed to make it leave.
    go: OwnedFd,
    /// Close-on-exec in the child: EOF once exec succeeded, an errno if it failed.
    status: OwnedFd,
}

/// Forks the child, which waits on the go pipe before it execs.
fn fork_held(p: &Prepared) -> io::Result<Held> {
    let mut argv: Vec<*const libc::c_char> = p.args.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let envp: Option<Vec<*const libc::c_char>> = p.env.as_ref().map(|env| {
        env.iter()
            .map(|e| e.as_ptr())
            .chain(std::iter::once(std::ptr::null()))
            .collect()
    });
    // Two pipes: "go" (the child waits on it before exec, so the probes are in place first)
    // and "status" (close-on-exec: EOF once exec succeeded, an errno if it failed).
    let mut go = [0i32; 2];
    let mut st = [0i32; 2];
    // SAFETY: valid 2-element arrays.
    if unsafe { libc::pipe2(go.as_mut_ptr(), libc::O_CLOEXEC) } != 0
        || unsafe { libc::pipe2(st.as_mut_ptr(), libc::O_CLOEXEC) } != 0
    {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the child only calls async-signal-safe functions before exec or _exit.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        // SAFETY: in the child just forked, with arguments prepared before fork.
        unsafe { exec_when_told(go, st, p, &argv, envp.as_deref()) }
    }
    // SAFETY: the child's ends are its own now; ours become owned descriptors.
    let (go, status) = unsafe {
        libc::close(go[0]);
        libc::close(st[1]);
        (OwnedFd::from_raw_fd(go[1]), OwnedFd::from_raw_fd(st[0]))
    };
    Ok(Held { pid, go, status })
}

/// The child's side: waits for the go byte, then execs, or writes why it could not.
///
/// # Safety
/// Only in the child just forked: async-signal-safe calls only, on the pipes `fork_held` made.
unsafe fn exec_when_told(
    go: [i32; 2],
    st: [i32; 2],
    p: &Prepared,
    argv: &[*const libc::c_char],
    envp: Option<&[*const libc::c_char]>,
) -> ! {
    // SAFETY: async-signal-safe calls only; arguments were prepared before fork.
    unsafe {
        libc::close(go[1]);
        libc::close(st[0]);
        // Killed when its tracer thread ends: PTRACE_O_EXITKILL's guarantee, kept once it is
        // let go of (`Event::Released`).
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong);
        let mut b = 0u8;
        loop {
            let n = libc::read(go[0], (&mut b as *mut u8).cast(), 1);
            if n == 1 {
                break;
            }
            if n == 0 || *libc::__errno_location() != libc::EINTR {
                libc::_exit(127); // heaptrace gave up (attach failed) or died
            }
        }
        if let Some((out, input)) = p.redirect {
            // dup2 leaves the copies open across exec (the originals are close-on-exec).
            libc::dup2(out, 1);
            libc::dup2(out, 2);
            libc::dup2(input, 0);
        }
        for fd in &p.keep_fds {
            libc::fcntl(*fd, libc::F_SETFD, 0);
        }
        match envp {
            Some(envp) => libc::execve(p.exe.as_ptr(), argv.as_ptr(), envp.as_ptr()),
            None => libc::execv(p.exe.as_ptr(), argv.as_ptr()),
        };
        let errno = *libc::__errno_location();
        libc::write(st[1], (&errno as *const i32).cast(), 4);
        libc::_exit(127);
    }
}

/// Seizes the child to hold it at its exit and at later execs, and to take it along if
/// heaptrace dies; whether that worked. Without
/// ptrace (not permitted here), everything but the holds still works.
fn seize(pid: i32) -> bool {
    // SAFETY: seizing our own child, which is waiting on the go pipe.
    let seized = unsafe {
        libc::ptrace(
            libc::PTRACE_SEIZE,
            pid,
            0,
            (libc::PTRACE_O_TRACEEXIT
                | libc::PTRACE_O_TRACEEXEC
                | libc::PTRACE_O_TRACEFORK
                | libc::PTRACE_O_TRACEVFORK
                | libc::PTRACE_O_EXITKILL
                | libc::PTRACE_O_TRACESYSGOOD) as libc::c_ulong,
        )
    } == 0;
    if !seized {
        log::debug!(
            "cannot hold the child at exit: {}",
            io::Error::last_os_error()
        );
    }
    seized
}

/// Waits for the daemon's word and lets the child exec; false if it gave up (attach failed),
/// in which case the child was made to leave, reaped, and `started` told.
fn release(
    go: OwnedFd,
    pid: i32,
    resume: &mpsc::Receiver<bool>,
    started: &mpsc::Sender<std::result::Result<(), i32>>,
) -> bool {
    let mut go = std::fs::File::from(go);
    if resume.recv() != Ok(true) {
        drop(go); // the child reads EOF and leaves
        wait_exit(pid);
        let _ = started.send(Err(libc::ECANCELED));
        return false;
    }
    let _ = std::io::Write::write_all(&mut go, b"g");
    true
}

/// A child that could not be seized: tells how its exec went, then its exit.
fn untraced(
    pid: i32,
    mut status_pipe: std::fs::File,
    started: mpsc::Sender<std::result::Result<(), i32>>,
    events: &tokio::sync::mpsc::UnboundedSender<Event>,
) {
    let mut buf = [0u8; 4];
    if let Ok(4) = status_pipe.read(&mut buf) {
        wait_exit(pid);
        let _ = started.send(Err(i32::from_ne_bytes(buf)));
        return;
    }
    let _ = started.send(Ok(()));
    let mut status = 0;
    // SAFETY: waiting for our own child.
    while unsafe { libc::waitpid(pid, &mut status, 0) } < 0
        && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR)
    {}
    let _ = events.send(Event::Exited(ExitStatus::from_wait(status)));
}

/// Reaps the child, letting it through any stop (it may be held at its exit) on the way.
fn wait_exit(pid: i32) {
    loop {
        let mut status = 0;
        // SAFETY: waiting for our own child.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::__WALL) };
        if r != pid || libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
            return;
        }
        // SAFETY: our own stopped child; fails harmlessly if it is not traced.
        unsafe { libc::ptrace(libc::PTRACE_CONT, pid, 0, 0) };
    }
}

mod delivered;
mod finalize;
mod forks;
mod inherit;
mod newborn;
mod redirect;
mod tracee;
pub use delivered::{Delivered, monotonic_ns};
pub use finalize::{FinalizeHold, hold_signal};
pub use forks::{ForkSlot, Forks};
pub use inherit::Inherit;
pub(crate) use newborn::{Newborns, Startup, startup_stop};
pub use redirect::Redirect;
use tracee::Tracee;
pub(crate) use tracee::{EXEC_HOLD, EXIT_HOLD, SYSCALL_STOP, Storm, group_stop, hold};

#[cfg(test)]
mod tests;
