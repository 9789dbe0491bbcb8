//! The ptrace requests the injection makes, each a checked call.
use std::io;

const NT_X86_XSTATE: usize = 0x202;
/// The most extended state read (AVX-512 takes 2.7 KiB, AMX 11 KiB).
const XSTATE_MAX: usize = 16 << 10;

fn check(r: libc::c_long) -> io::Result<libc::c_long> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn ptrace(req: libc::c_uint, tid: u32, addr: usize, data: usize) -> io::Result<libc::c_long> {
    // SAFETY: each caller passes the addr/data its request takes.
    check(unsafe { libc::ptrace(req, tid as libc::pid_t, addr, data) })
}

/// How a traced thread stopped, or that it ended.
#[derive(Debug)]
pub enum Stop {
    /// At a system call's entry or exit (`PTRACE_O_TRACESYSGOOD`).
    Syscall,
    /// `PTRACE_INTERRUPT` or a group stop (`PTRACE_EVENT_STOP`).
    Event,
    /// About to get a signal.
    Signal(i32),
    /// Exited or killed.
    Ended,
}

pub fn wait(tid: u32) -> io::Result<Stop> {
    let mut status = 0;
    loop {
        // SAFETY: fills `status`.
        let r = unsafe { libc::waitpid(tid as libc::pid_t, &mut status, libc::__WALL) };
        if r >= 0 {
            break;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    if !libc::WIFSTOPPED(status) {
        return Ok(Stop::Ended);
    }
    let sig = libc::WSTOPSIG(status);
    Ok(if sig == libc::SIGTRAP | 0x80 {
        Stop::Syscall
    } else if status >> 16 == libc::PTRACE_EVENT_STOP {
        Stop::Event
    } else {
        Stop::Signal(sig)
    })
}

/// Seizes thread `tid` and stops it; its registers. Let go again on failure.
pub fn seize_stopped(tid: u32) -> io::Result<libc::user_regs_struct> {
    ptrace(
        libc::PTRACE_SEIZE,
        tid,
        0,
        libc::PTRACE_O_TRACESYSGOOD as usize,
    )?;
    let stopped = (|| loop {
        ptrace(libc::PTRACE_INTERRUPT, tid, 0, 0)?;
        match wait(tid)? {
            Stop::Event | Stop::Syscall => return regs(tid),
            Stop::Ended => return Err(io::Error::from_raw_os_error(libc::ESRCH)),
            // A signal on its way: delivered as it would have been, then stopped again.
            Stop::Signal(sig) => {
                ptrace(libc::PTRACE_CONT, tid, 0, sig as usize)?;
            }
        }
    })();
    if stopped.is_err() {
        let _ = detach(tid);
    }
    stopped
}

pub fn regs(tid: u32) -> io::Result<libc::user_regs_struct> {
    // SAFETY: a plain struct for the kernel to fill.
    let mut r: libc::user_regs_struct = unsafe { std::mem::zeroed() };
    ptrace(libc::PTRACE_GETREGS, tid, 0, &mut r as *mut _ as usize)?;
    Ok(r)
}

pub fn set_regs(tid: u32, r: &libc::user_regs_struct) -> io::Result<()> {
    ptrace(libc::PTRACE_SETREGS, tid, 0, r as *const _ as usize).map(drop)
}

/// The thread's extended (XSAVE) state, as the kernel gives it.
pub fn xstate(tid: u32) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; XSTATE_MAX];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    ptrace(
        libc::PTRACE_GETREGSET,
        tid,
        NT_X86_XSTATE,
        &mut iov as *mut _ as usize,
    )?;
    buf.truncate(iov.iov_len);
    Ok(buf)
}

pub fn set_xstate(tid: u32, x: &[u8]) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: x.as_ptr() as *mut _,
        iov_len: x.len(),
    };
    ptrace(
        libc::PTRACE_SETREGSET,
        tid,
        NT_X86_XSTATE,
        &mut iov as *mut _ as usize,
    )
    .map(drop)
}

/// Resumes the thread until its next signal, delivering `sig`.
pub fn resume(tid: u32, sig: i32) -> io::Result<()> {
    ptrace(libc::PTRACE_CONT, tid, 0, sig as usize).map(drop)
}

/// Resumes the thread until its next system call or signal, delivering `sig`.
pub fn resume_to_syscall(tid: u32, sig: i32) -> io::Result<()> {
    ptrace(libc::PTRACE_SYSCALL, tid, 0, sig as usize).map(drop)
}

pub fn detach(tid: u32) -> io::Result<()> {
    ptrace(libc::PTRACE_DETACH, tid, 0, 0).map(drop)
}

/// Thread `tid`'s nice value.
pub fn nice(tid: u32) -> io::Result<i32> {
    // -1 is a nice value too: errno tells.
    // SAFETY: plain calls; errno is this thread's.
    unsafe {
        *libc::__errno_location() = 0;
        let n = libc::getpriority(libc::PRIO_PROCESS, tid);
        match *libc::__errno_location() {
            0 => Ok(n),
            e => Err(io::Error::from_raw_os_error(e)),
        }
    }
}

pub fn set_nice(tid: u32, nice: i32) -> io::Result<()> {
    // SAFETY: a plain call.
    check(unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, nice) } as libc::c_long).map(drop)
}

/// The nice value heaptrace's own thread runs an attach at, and a held thread its calls at,
/// where heaptrace may set it (CAP_SYS_NICE): each ptrace stop hands the CPU from one to the
/// other, and at nice 0 on a loaded machine each would wait for the other runnable threads'
/// turns (ticks) at every hand-over.
pub const BOOST: i32 = -20;

/// The calling thread at `BOOST` while this lives, its nice value given back after.
pub struct Boosted(Option<i32>);

impl Boosted {
    pub fn own() -> Boosted {
        // SAFETY: no preconditions.
        let tid = unsafe { libc::gettid() } as u32;
        Boosted(
            nice(tid)
                .ok()
                .filter(|n| *n > BOOST && set_nice(tid, BOOST).is_ok()),
        )
    }
}

impl Drop for Boosted {
    fn drop(&mut self) {
        if let Some(n) = self.0 {
            // SAFETY: no preconditions.
            let _ = set_nice(unsafe { libc::gettid() } as u32, n);
        }
    }
}

/// `len` bytes of the target's memory at `at`.
pub fn read_mem(pid: u32, at: u64, len: usize) -> io::Result<Vec<u8>> {
    use std::os::unix::fs::FileExt as _;
    let f = std::fs::File::open(format!("/proc/{pid}/mem"))?;
    let mut buf = vec![0u8; len];
    f.read_exact_at(&mut buf, at)?;
    Ok(buf)
}

/// Writes `bytes` at `at` in the target's memory (read-only code pages included: the write
/// is the tracer's, and copies the page for this process alone).
pub fn write_mem(pid: u32, at: u64, bytes: &[u8]) -> io::Result<()> {
    use std::os::unix::fs::FileExt as _;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/proc/{pid}/mem"))?;
    f.write_all_at(bytes, at)
}
