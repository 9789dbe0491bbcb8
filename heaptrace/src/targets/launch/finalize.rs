//! Where the command is held at its Python's finalization (heaptrace-ebpf's `py_hold.rs`):
//! the daemon sets the address of `Py_FinalizeEx` and the signal the probe sends there; the
//! tracer takes a signal-delivery-stop of that signal within the function's first bytes for
//! the probe's, holds the command for the daemon and drops the signal. Any other stop of the
//! same signal (a real one, elsewhere) is delivered as usual.
use std::{collections::HashMap, sync::Mutex};

/// The probe's signal stop lands after the function's first instruction, emulated or
/// stepped out of line (at most 15 bytes).
const FIRST_BYTES: u64 = 16;

/// Set by the daemon, read by the tracer: for each process held (the command, its followed
/// forks), where its `Py_FinalizeEx` is and the probe's signal.
#[derive(Debug, Default)]
pub struct FinalizeHold {
    held: Mutex<HashMap<i32, (u64, i32)>>,
}

impl FinalizeHold {
    pub fn set(&self, pid: u32, at: u64, sig: i32) {
        if let Ok(mut h) = self.held.lock() {
            h.insert(pid as i32, (at, sig));
        }
    }

    /// `pid` is no longer held (it exec'ed, or ended).
    pub fn clear(&self, pid: u32) {
        if let Ok(mut h) = self.held.lock() {
            h.remove(&(pid as i32));
        }
    }

    /// Whether tracee `pid`, in a signal-delivery-stop of `sig`, stopped for the probe: then
    /// the hold is used up.
    pub(crate) fn ours(&self, pid: i32, sig: i32) -> bool {
        let Ok(mut held) = self.held.lock() else {
            return false;
        };
        let Some(&(at, want)) = held.get(&pid) else {
            return false;
        };
        if sig != want {
            return false;
        }
        // SAFETY: reading the registers of our own stopped tracee into a zeroed struct.
        let rip = unsafe {
            let mut regs: libc::user_regs_struct = std::mem::zeroed();
            if libc::ptrace(libc::PTRACE_GETREGS, pid, 0, &mut regs) != 0 {
                return false;
            }
            regs.rip
        };
        let ours = rip.wrapping_sub(at) < FIRST_BYTES;
        if ours {
            held.remove(&pid);
        }
        ours
    }
}

/// The signal the probe sends: one that `pid`'s main thread neither catches nor blocks
/// (ignored by default, so that one reaching an untraced thread does nothing), or None.
pub fn hold_signal(pid: u32) -> Option<i32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    pick_signal(&status)
}

/// `hold_signal` from the text of /proc/PID/status.
fn pick_signal(status: &str) -> Option<i32> {
    let mask = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
    };
    let taken = mask("SigCgt:")? | mask("SigBlk:")?;
    [libc::SIGURG, libc::SIGWINCH]
        .into_iter()
        .find(|s| taken & (1 << (s - 1)) == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(caught: u64, blocked: u64) -> String {
        format!("Name:\tpython3\nSigBlk:\t{blocked:016x}\nSigIgn:\t0\nSigCgt:\t{caught:016x}\n")
    }

    #[test]
    fn the_signal_is_one_the_process_neither_catches_nor_blocks() {
        let bit = |s: i32| 1u64 << (s - 1);
        assert_eq!(
            pick_signal(&status(bit(libc::SIGINT), 0)),
            Some(libc::SIGURG)
        );
        assert_eq!(
            pick_signal(&status(bit(libc::SIGURG), 0)),
            Some(libc::SIGWINCH)
        );
        assert_eq!(
            pick_signal(&status(0, bit(libc::SIGURG))),
            Some(libc::SIGWINCH)
        );
        let both = bit(libc::SIGURG) | bit(libc::SIGWINCH);
        assert_eq!(pick_signal(&status(both, 0)), None);
        assert_eq!(pick_signal("Name:\tx\n"), None, "no masks: not held");
    }
}
