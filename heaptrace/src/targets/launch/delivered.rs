//! The signals a launched command got, as its tracer saw them delivered (its
//! signal-delivery-stops): the daemon passes a signal on only if the command did not get it
//! by itself (sent to its whole process group, as `timeout` and `kill -- -PGID` do).
use std::sync::atomic::{AtomicU64, Ordering};

/// Signal numbers 1 to 64.
const SIGNALS: usize = 65;

/// When the command last got each signal, in `monotonic_ns`; 0 never. Written by the tracer
/// thread, read by the daemon.
pub struct Delivered {
    last: [AtomicU64; SIGNALS],
}

impl Default for Delivered {
    fn default() -> Delivered {
        Delivered {
            last: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl Delivered {
    /// The command got `sig` now.
    pub(super) fn note(&self, sig: i32) {
        if let Some(slot) = usize::try_from(sig).ok().and_then(|s| self.last.get(s)) {
            slot.store(monotonic_ns().max(1), Ordering::Relaxed);
        }
    }

    /// Whether the command got `sig` at `ns` or later.
    pub fn since(&self, sig: i32, ns: u64) -> bool {
        usize::try_from(sig)
            .ok()
            .and_then(|s| self.last.get(s))
            .is_some_and(|t| {
                let t = t.load(Ordering::Relaxed);
                t != 0 && t >= ns
            })
    }
}

/// CLOCK_MONOTONIC in nanoseconds: async-signal-safe, so a signal handler can stamp with it.
pub fn monotonic_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill; clock_gettime is async-signal-safe.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signal_counts_from_when_it_was_delivered() {
        let d = Delivered::default();
        let before = monotonic_ns();
        assert!(!d.since(libc::SIGINT, 0));
        d.note(libc::SIGINT);
        assert!(d.since(libc::SIGINT, before));
        assert!(!d.since(libc::SIGINT, monotonic_ns() + 1));
        assert!(!d.since(libc::SIGTERM, 0));
        d.note(0);
        d.note(99);
    }
}
