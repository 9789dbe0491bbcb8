//! How the trampoline tells heaptrace that a call is done.
//!
//! Tracing the thread's system calls (`PTRACE_SYSCALL`) stops it at each one the call makes,
//! and each stop is a round trip: the thread gives up its CPU, heaptrace wakes, and the thread
//! waits for a CPU again, which on a loaded machine can take a scheduler tick or many (a
//! dlopen makes some 15 system calls, the library's attach 10). Instead the call runs
//! untraced (`PTRACE_CONT`) and the trampoline sends its own thread a signal the process
//! ignores: traced, the thread stops at its delivery and heaptrace drops it; with heaptrace
//! gone, the kernel discards it (an ignored signal is never queued). A signal is used only
//! when the process neither catches nor (on that thread) blocks it, read from /proc just
//! before each call; otherwise the call is traced as before and the trampoline's system call
//! sends nothing (signal 0). A thread under a seccomp filter is always traced: its filter may
//! refuse `tgkill` (or kill for it), and a traced call is stopped at its entry, before the
//! filter runs.
use std::io;

/// Signals ignored by default, whose only effect is a handler's: no job control (SIGCONT),
/// nothing a parent waits on (SIGCHLD).
const CANDIDATES: [i32; 2] = [libc::SIGURG, libc::SIGWINCH];

/// A signal mask of a /proc status line (`SigCgt:\t0000000000004000`), bit n-1 for signal n.
fn mask(status: &str, field: &str) -> Option<u64> {
    let hex = status.lines().find_map(|l| l.strip_prefix(field))?.trim();
    u64::from_str_radix(hex, 16).ok()
}

/// The signal the trampoline is to send thread `tid` of `pid` at the end of a call; None
/// where none is safe to send (caught or blocked), or the status cannot be read.
pub fn signal(pid: u32, tid: u32) -> io::Result<Option<i32>> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status"))?;
    Ok(pick(&status))
}

fn pick(status: &str) -> Option<i32> {
    // Seccomp mode 0: none; 1 strict, 2 filter. Unknown: as if filtered.
    let seccomp = status
        .lines()
        .find_map(|l| l.strip_prefix("Seccomp:"))
        .map(str::trim);
    if seccomp != Some("0") {
        return None;
    }
    let caught = mask(status, "SigCgt:")?;
    let blocked = mask(status, "SigBlk:")?;
    CANDIDATES
        .into_iter()
        .find(|s| (caught | blocked) & (1 << (s - 1)) == 0)
}

#[cfg(test)]
mod tests {
    use super::pick;

    fn status(blk: u64, cgt: u64) -> String {
        format!(
            "Name:\tx\nSigPnd:\t0000000000000000\nSigBlk:\t{blk:016x}\nSigIgn:\t0000000000001000\n\
             SigCgt:\t{cgt:016x}\nCapInh:\t0000000000000000\nSeccomp:\t0\n"
        )
    }

    #[test]
    fn a_signal_neither_caught_nor_blocked() {
        let bit = |s: i32| 1u64 << (s - 1);
        assert_eq!(pick(&status(0, 0)), Some(libc::SIGURG));
        assert_eq!(pick(&status(0, bit(libc::SIGURG))), Some(libc::SIGWINCH));
        assert_eq!(pick(&status(bit(libc::SIGURG), 0)), Some(libc::SIGWINCH));
        assert_eq!(pick(&status(bit(libc::SIGWINCH), bit(libc::SIGURG))), None);
        // A Go program catches every signal.
        assert_eq!(pick(&status(0, 0xffff_fffe_7fff_feff)), None);
        assert_eq!(pick("Name:\tx\n"), None);
        // A seccomp filter may refuse (or kill for) the signal's system call.
        assert_eq!(
            pick(&status(0, 0).replace("Seccomp:\t0", "Seccomp:\t2")),
            None
        );
    }
}
