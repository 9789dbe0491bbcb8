//! `--stop`: every thread of the target held still with ptrace (PTRACE_SEIZE, then
//! PTRACE_INTERRUPT), so the walk sees one consistent heap; detached when dropped. Unlike
//! SIGSTOP, the target's parent sees nothing, and no signal is left pending.
use std::collections::HashSet;
use std::time::{Duration, Instant};

pub struct Frozen {
    tids: Vec<i32>,
}

/// How long a thread may take to stop (one in a system call stops when it returns).
const STOP_WAIT: Duration = Duration::from_secs(2);

pub fn freeze(pid: u32) -> Result<Frozen, String> {
    let mut frozen = Frozen { tids: Vec::new() };
    let mut seen = HashSet::new();
    // Threads started while we seize the others: go round until no new one appears.
    for _ in 0..64 {
        let tids = threads(pid).map_err(|e| format!("cannot list process {pid}'s threads: {e}"))?;
        let new: Vec<i32> = tids.into_iter().filter(|t| seen.insert(*t)).collect();
        if new.is_empty() {
            return Ok(frozen);
        }
        for tid in new {
            // SAFETY: ptrace requests on a thread id; the kernel checks our right to trace.
            let r = unsafe { libc::ptrace(libc::PTRACE_SEIZE, tid, 0, 0) };
            if r != 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::ESRCH) {
                    continue; // ended meanwhile
                }
                return Err(format!("cannot stop process {pid} (thread {tid}): {e}"));
            }
            frozen.tids.push(tid);
            // SAFETY: as above, on a thread we now trace.
            unsafe { libc::ptrace(libc::PTRACE_INTERRUPT, tid, 0, 0) };
            wait_stopped(tid)?;
        }
    }
    Err(format!(
        "process {pid} starts threads faster than they can be stopped"
    ))
}

fn wait_stopped(tid: i32) -> Result<(), String> {
    let deadline = Instant::now() + STOP_WAIT;
    loop {
        let mut status = 0;
        // SAFETY: waits for a thread we trace, without blocking.
        let r = unsafe { libc::waitpid(tid, &mut status, libc::__WALL | libc::WNOHANG) };
        if r == tid || r < 0 {
            return Ok(()); // stopped, or gone
        }
        if Instant::now() > deadline {
            return Err(format!("thread {tid} did not stop within {STOP_WAIT:?}"));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn threads(pid: u32) -> std::io::Result<Vec<i32>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        if let Some(t) = e?.file_name().to_str().and_then(|s| s.parse().ok()) {
            out.push(t);
        }
    }
    Ok(out)
}

impl Drop for Frozen {
    fn drop(&mut self) {
        for &tid in &self.tids {
            // SAFETY: detaching a thread we seized lets it run on as before.
            unsafe { libc::ptrace(libc::PTRACE_DETACH, tid, 0, 0) };
        }
    }
}
