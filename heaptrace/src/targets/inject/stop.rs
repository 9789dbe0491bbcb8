//! One thread of the target stopped at a safe point, through ptrace (`PTRACE_SEIZE`, which
//! lets the thread go on its own if heaptrace dies). Only the thread called through is
//! stopped: the others run on, so that a lock one of them holds is let go as usual and a
//! call made in the stopped one cannot wait on it forever.
//!
//! A safe point: the thread is not inside the allocator or the dynamic loader, whose locks
//! it may hold and which a call through it would enter again. Without unwinding, a thread
//! counts as safe when its instruction pointer is outside libc and the loader, or when it
//! waits in a system call of libc that the allocator never makes while holding a lock.
use std::time::Duration;

use super::sys;

/// System calls the allocator makes while it may hold an arena's lock.
const ALLOCATOR_SYSCALLS: [u64; 6] = [
    libc::SYS_mmap as u64,
    libc::SYS_mprotect as u64,
    libc::SYS_munmap as u64,
    libc::SYS_brk as u64,
    libc::SYS_mremap as u64,
    libc::SYS_madvise as u64,
];
/// Passes over the threads before giving up, a few milliseconds apart.
const TRIES: u32 = 100;
const PAUSE: Duration = Duration::from_millis(3);

/// Address ranges [start, end) of code a call must not start from.
#[derive(Debug, Default)]
pub struct Unsafe {
    /// The dynamic loader's code: never.
    pub loader: Vec<(u64, u64)>,
    /// libc's code: only from a system call the allocator does not make.
    pub libc: Vec<(u64, u64)>,
}

impl Unsafe {
    pub fn allows(&self, regs: &libc::user_regs_struct) -> bool {
        let within = |r: &[(u64, u64)]| r.iter().any(|(a, b)| regs.rip >= *a && regs.rip < *b);
        if within(&self.loader) {
            return false;
        }
        if !within(&self.libc) {
            return true;
        }
        let in_syscall = regs.orig_rax as i64 >= 0;
        in_syscall && !ALLOCATOR_SYSCALLS.contains(&regs.orig_rax)
    }
}

/// A thread held stopped, with its registers and extended state as it was stopped.
pub struct Held {
    pub tid: u32,
    pub regs: libc::user_regs_struct,
    pub xstate: Vec<u8>,
    /// Threads stopped and let go before this one (not at a safe point).
    pub passed_over: u32,
    released: bool,
}

impl Held {
    /// Its registers as they are to be given back: a system call it was stopped in is made
    /// to start again, as the kernel would (the thread is let go from another stop than the
    /// one it was taken at).
    pub fn resumable(&self) -> libc::user_regs_struct {
        let mut r = self.regs;
        if r.orig_rax as i64 >= 0 {
            match r.rax as i64 {
                // ERESTARTSYS, ERESTARTNOINTR, ERESTARTNOHAND
                -514..=-512 => {
                    r.rax = r.orig_rax;
                    r.rip -= 2;
                }
                // ERESTART_RESTARTBLOCK
                -516 => {
                    r.rax = libc::SYS_restart_syscall as u64;
                    r.rip -= 2;
                }
                _ => {}
            }
        }
        r.orig_rax = u64::MAX;
        r
    }

    /// Its registers and extended state given back, then the thread let go.
    pub fn release(mut self) -> std::io::Result<()> {
        self.released = true;
        let restored = sys::set_regs(self.tid, &self.resumable())
            .and_then(|_| sys::set_xstate(self.tid, &self.xstate));
        // Let go even if the restore failed: a thread held forever is worse.
        let detached = sys::detach(self.tid);
        restored.and(detached)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if !self.released {
            let _ = sys::set_regs(self.tid, &self.resumable());
            let _ = sys::set_xstate(self.tid, &self.xstate);
            let _ = sys::detach(self.tid);
        }
    }
}

/// The thread ids of `pid`, main thread first.
fn threads(pid: u32) -> Vec<u32> {
    let mut tids: Vec<u32> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    tids.sort_by_key(|t| (*t != pid, *t));
    tids.truncate(4096);
    tids
}

/// One thread of `pid` stopped at a safe point; Err(reason) when none was, after `TRIES`
/// passes over its threads, or when the process cannot be traced.
pub fn safe_thread(pid: u32, avoid: &Unsafe) -> Result<Held, String> {
    let mut last_err = None;
    let mut passed_over = 0;
    for _ in 0..TRIES {
        let tids = threads(pid);
        if tids.is_empty() {
            return Err("the process is gone".into());
        }
        for tid in tids {
            match sys::seize_stopped(tid) {
                Ok(regs) => {
                    if avoid.allows(&regs) {
                        let xstate = match sys::xstate(tid) {
                            Ok(x) => x,
                            Err(e) => {
                                let _ = sys::detach(tid);
                                return Err(format!("cannot read thread {tid}'s state: {e}"));
                            }
                        };
                        return Ok(Held {
                            tid,
                            regs,
                            xstate,
                            passed_over,
                            released: false,
                        });
                    }
                    passed_over += 1;
                    let _ = sys::detach(tid);
                }
                // A thread that ended meanwhile; any other error is said if none works.
                Err(e) => last_err = Some(e),
            }
        }
        std::thread::sleep(PAUSE);
    }
    Err(match last_err {
        Some(e) => format!("cannot stop a thread: {e}"),
        None => {
            format!("no thread was outside the allocator and the dynamic loader in {TRIES} tries")
        }
    })
}
