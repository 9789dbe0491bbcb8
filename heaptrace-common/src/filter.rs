//! `--all --comm X` and `--all --cgroup X` in the kernel: which processes a system-wide trace
//! looks at.
//!
//! The probes of a system-wide trace fire in every process that maps the allocator. Filtered
//! in user space alone, every other process still paid for its stack walks and filled the
//! stack, site and live maps the matching processes needed (on a busy host, a filtered trace
//! lost its own stacks to the host's compilers). So each thread judges its process at its
//! first call and keeps the verdict in its in-flight record ([`super::InFlight::verdict`]); an
//! exec judges again. By name: its group leader's (what `/proc/PID/comm` shows, and what user
//! space judges by: a thread's own name may be anything, `pthread_setname_np`). By cgroup: the
//! verdict user space wrote for the thread's cgroup id (it knows the paths); a cgroup it has
//! not judged yet leaves the thread traced, and judged again at its next call. A thread left
//! out by its cgroup is judged again once it is in another (moved without an exec).
//!
//! The kernel only leaves out: user space judges every process it is shown again.

/// [`super::InFlight::verdict`]: not judged yet (no filter, or a record made before one).
pub const UNKNOWN: u32 = 0;
/// The thread's process is traced.
pub const TRACED: u32 = 1;
/// The thread's process is left out by its name: its calls stop at the record.
pub const EXCLUDED: u32 = 2;
/// Left out by its cgroup, [`super::InFlight::cgroup`], while the thread stays in it.
pub const EXCLUDED_CGROUP: u32 = 3;

/// A command name's bytes, as the kernel keeps it (TASK_COMM_LEN, NUL-terminated).
pub const COMM_LEN: usize = 16;

/// A pattern as the kernel compares it: its bytes and a mask of them, as a command name's 16
/// bytes read as two little-endian words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pattern {
    pub bytes: [u64; 2],
    pub mask: [u64; 2],
}

/// Whether the name `comm` (16 NUL-padded bytes as two little-endian words) contains
/// `pattern`: the pattern's masked bytes compared at each of the 16 places, in words. A place
/// too close to the end shifts in zeros, which a pattern (no NUL) never matches. Without a
/// branch until the end: the verifier follows both ways of every branch in the loop (a
/// byte-by-byte loop in a loop made every judging program ~5,000 instructions longer to
/// verify, one that stopped at the first match ~2,400).
#[inline(always)]
pub fn comm_contains(comm: [u64; 2], p: &Pattern) -> bool {
    let [lo, hi] = comm;
    // 1 while no place has matched: `x | -x` has its top bit set exactly where x is not 0.
    let mut missed = 1;
    for at in 0..COMM_LEN as u32 {
        let s = 8 * (at % 8);
        let (wlo, whi) = match at {
            0 => (lo, hi),
            1..8 => ((lo >> s) | (hi << (64 - s)), hi >> s),
            _ => (hi >> s, 0),
        };
        let differ = ((wlo & p.mask[0]) ^ p.bytes[0]) | ((whi & p.mask[1]) ^ p.bytes[1]);
        // Volatile: LLVM knows `x | -x < 0` for `x != 0` and would branch on it again.
        // SAFETY: a read of a local.
        let top = unsafe { core::ptr::read_volatile(&(differ | differ.wrapping_neg())) };
        missed &= top >> 63;
    }
    missed == 0
}

/// A command name's bytes as [`comm_contains`] reads them.
pub fn words(comm: &[u8; COMM_LEN]) -> [u64; 2] {
    let mut lo = [0; 8];
    let mut hi = [0; 8];
    lo.copy_from_slice(&comm[..8]);
    hi.copy_from_slice(&comm[8..]);
    [u64::from_le_bytes(lo), u64::from_le_bytes(hi)]
}

/// The pattern of `--comm text`; None if no command name can contain it (empty, longer than a
/// name, or with a NUL).
pub fn pattern(text: &str) -> Option<Pattern> {
    let b = text.as_bytes();
    if b.is_empty() || b.len() >= COMM_LEN || b.contains(&0) {
        return None;
    }
    let mut bytes = [0; COMM_LEN];
    let mut mask = [0; COMM_LEN];
    bytes[..b.len()].copy_from_slice(b);
    mask[..b.len()].fill(0xff);
    Some(Pattern {
        bytes: words(&bytes),
        mask: words(&mask),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contains(name: &str, text: &str) -> bool {
        let mut c = [0; COMM_LEN];
        c[..name.len()].copy_from_slice(name.as_bytes());
        comm_contains(words(&c), &pattern(text).unwrap())
    }

    #[test]
    fn a_name_contains_what_str_contains_says() {
        let names = [
            "allocs",
            "sh",
            "a",
            "fifteen-bytes-x",
            "aaab",
            "execfork",
            "ab",
        ];
        let texts = [
            "allocs", "llo", "s", "a", "b", "aab", "x", "-bytes-x", "allocsx", "ba",
        ];
        for n in names {
            for t in texts {
                assert_eq!(contains(n, t), n.contains(t), "{n:?} contains {t:?}");
            }
        }
    }

    #[test]
    fn a_match_never_runs_past_the_name() {
        // The bytes after the NUL are zero and no pattern has one.
        assert!(!contains("ab", "abc"));
        assert!(contains("fifteen-bytes-x", "x"));
        assert!(!contains("fifteen-bytes-x", "xy"));
    }

    #[test]
    fn no_name_can_contain_an_empty_long_or_nul_pattern() {
        assert_eq!(pattern(""), None);
        assert_eq!(pattern("sixteen-bytes-xx"), None);
        assert_eq!(pattern("a\0b"), None);
        let p = pattern("fifteen-bytes-x").unwrap();
        assert_eq!(p.mask, [u64::MAX, u64::MAX >> 8]);
    }
}
