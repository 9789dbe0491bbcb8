//! The signals that end or pass through a trace (SIGINT, SIGTERM, SIGHUP), with who sent them.
//!
//! A terminal's Ctrl-C or hang-up comes from the kernel to the whole foreground process group,
//! a launched command included; `kill`, `timeout` or systemd send to heaptrace alone. Only the
//! latter must be passed on, or the command would get the signal twice. tokio's signal streams
//! do not say who sent a signal, so a handler of our own writes each signal's number and
//! whether the kernel sent it (`si_code == SI_KERNEL`) to a pipe the daemon reads.
use std::{
    fmt,
    io::{self, IsTerminal as _},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    sync::{
        OnceLock,
        atomic::{AtomicI32, Ordering},
    },
};

use tokio::io::unix::AsyncFd;

/// `si_code` of a signal the kernel sent (a terminal's), not `kill(2)`.
const SI_KERNEL: i32 = 0x80;

/// The signals heaptrace handles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sig {
    Int,
    Term,
    Hup,
}

impl Sig {
    pub const ALL: [Sig; 3] = [Sig::Int, Sig::Term, Sig::Hup];

    pub fn number(self) -> i32 {
        match self {
            Sig::Int => libc::SIGINT,
            Sig::Term => libc::SIGTERM,
            Sig::Hup => libc::SIGHUP,
        }
    }

    fn from_number(n: i32) -> Option<Sig> {
        Sig::ALL.into_iter().find(|s| s.number() == n)
    }
}

impl fmt::Display for Sig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Sig::Int => "SIGINT",
            Sig::Term => "SIGTERM",
            Sig::Hup => "SIGHUP",
        })
    }
}

/// One signal received.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Received {
    pub sig: Sig,
    /// From the kernel: a terminal's, sent to the whole foreground process group.
    pub from_terminal: bool,
    /// When the handler ran (`launch::monotonic_ns`): one sending that reaches heaptrace
    /// twice (to it, then to its group) comes twice within microseconds.
    pub at_ns: u64,
}

/// A record on the pipe: the signal, whether the kernel sent it, when.
const RECORD: usize = 10;

/// The pipe's write end, for the handler; -1 before `install`.
static WRITE_FD: AtomicI32 = AtomicI32::new(-1);
/// heaptrace's pid: a child forked before its exec runs the handler too, and must not write.
static OWNER: AtomicI32 = AtomicI32::new(0);
static READ_FD: OnceLock<OwnedFd> = OnceLock::new();

extern "C" fn on_signal(sig: i32, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: async-signal-safe calls only (getpid, write, errno); `info` is the kernel's.
    unsafe {
        let errno = *libc::__errno_location();
        if libc::getpid() == OWNER.load(Ordering::Relaxed) {
            let kernel = !info.is_null() && (*info).si_code == SI_KERNEL;
            let mut rec = [0u8; RECORD];
            rec[0] = sig as u8;
            rec[1] = kernel as u8;
            rec[2..].copy_from_slice(&crate::targets::launch::monotonic_ns().to_ne_bytes());
            libc::write(
                WRITE_FD.load(Ordering::Relaxed),
                rec.as_ptr().cast(),
                rec.len(),
            );
        }
        *libc::__errno_location() = errno;
    }
}

/// Installs the handlers, once a process; from then on the three signals are only recorded.
pub fn install() -> io::Result<()> {
    if READ_FD.get().is_some() {
        return Ok(());
    }
    let mut fds = [0i32; 2];
    // SAFETY: a valid 2-element array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: descriptors just made; the write end lives as long as the process.
    let read = unsafe { OwnedFd::from_raw_fd(fds[0]) };
    // SAFETY: getpid has no preconditions.
    OWNER.store(unsafe { libc::getpid() }, Ordering::Relaxed);
    WRITE_FD.store(fds[1], Ordering::Relaxed);
    let _ = READ_FD.set(read);
    for s in Sig::ALL {
        // SAFETY: a zeroed sigaction is valid; the handler is async-signal-safe.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_signal as *const () as usize;
            act.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
            libc::sigemptyset(&mut act.sa_mask);
            if libc::sigaction(s.number(), &act, std::ptr::null_mut()) != 0 {
                return Err(io::Error::last_os_error());
            }
        }
    }
    Ok(())
}

/// A signal received and not yet taken, without waiting (before the daemon's loop runs).
pub fn take_pending() -> Option<Received> {
    let fd = READ_FD.get()?;
    read_one(fd.as_raw_fd())
}

fn read_one(fd: i32) -> Option<Received> {
    let mut rec = [0u8; RECORD];
    // SAFETY: reading into a buffer of the size given; the pipe is non-blocking. Records are
    // written whole (under PIPE_BUF), so read whole.
    let n = unsafe { libc::read(fd, rec.as_mut_ptr().cast(), rec.len()) };
    if n != RECORD as isize {
        return None;
    }
    let mut at = [0u8; 8];
    at.copy_from_slice(&rec[2..]);
    Some(Received {
        sig: Sig::from_number(rec[0] as i32)?,
        from_terminal: rec[1] != 0,
        at_ns: u64::from_ne_bytes(at),
    })
}

/// The daemon's side of the pipe.
pub struct Signals {
    fd: AsyncFd<OwnedFd>,
}

impl Signals {
    /// Needs `install` first and a tokio runtime with I/O.
    pub fn new() -> io::Result<Signals> {
        let fd = READ_FD
            .get()
            .ok_or_else(|| io::Error::other("signal handlers not installed"))?;
        // A copy of the read end: the reactor owns what it watches.
        let fd = fd.try_clone()?;
        // SAFETY: we own the copy and keep it open while it is registered.
        Ok(Signals {
            fd: unsafe { AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)?,
        })
    }

    /// The next signal.
    pub async fn recv(&self) -> Received {
        loop {
            if let Some(r) = read_one(self.fd.get_ref().as_raw_fd()) {
                return r;
            }
            match self.fd.readable().await {
                Ok(mut guard) => guard.clear_ready(),
                Err(_) => std::future::pending::<()>().await,
            }
        }
    }
}

/// After a hang-up: a terminal that is gone fails every write with EIO, and the summary's
/// `eprintln!` would panic on it. stdout and stderr then go to /dev/null; the JSON document
/// and the recording are files, and still written.
pub fn leave_hung_up_terminal() {
    for fd in [libc::STDOUT_FILENO, libc::STDERR_FILENO] {
        // SAFETY: borrowing a standard descriptor for a check.
        let f = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        if !f.is_terminal() {
            continue;
        }
        // A zero-length write reaches the tty's write, which fails once it was hung up.
        // SAFETY: writing nothing from a valid pointer.
        let r = unsafe { libc::write(fd, [0u8; 1].as_ptr().cast(), 0) };
        if r < 0
            && let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null")
        {
            // SAFETY: replacing a standard descriptor with /dev/null.
            unsafe { libc::dup2(null.as_raw_fd(), fd) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signal_sent_by_kill_is_recorded_as_not_the_terminals() {
        install().unwrap();
        while take_pending().is_some() {}
        // To this thread (tgkill), so the handler has run when raise returns; kill(2) to the
        // process may be taken by another of the test binary's threads later. Its si_code is
        // SI_TKILL: not the kernel's.
        let before = crate::targets::launch::monotonic_ns();
        // SAFETY: signalling ourselves; the handler is installed.
        unsafe { libc::raise(libc::SIGHUP) };
        let got = take_pending().unwrap();
        assert_eq!((got.sig, got.from_terminal), (Sig::Hup, false));
        assert!(got.at_ns >= before, "{got:?}");
        assert_eq!(take_pending(), None);
    }
}
