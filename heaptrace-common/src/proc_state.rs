//! Each traced process's state that all its CPUs share (its peak, [`ProcPeak`], and which
//! unwind entry it has) in a slot of one array, indexed by its tgid's low bits: an inlined
//! array access where the hash maps `PEAKS` and `UNWIND_PROCS` took a lookup each (~40 ns of
//! program time a malloc+free pair apiece; BENCHMARKS.md, *Many live blocks*).
//!
//! A process's peak is a maximum of one sum, so it must live in one place for the whole
//! process: the slot or the map, never both. So a slot is claimed only where no thread of the
//! process can be counting: in the kernel at an exec (the old image's other threads are gone)
//! and at a followed fork (the child has not run yet), for the processes a launched command or
//! `-p` traces; in user space before counting starts, for the processes taken in then (`-p`
//! and its descendants, `--all`'s scan). A process whose slot another owns, or one `--all`
//! finds later, keeps its peak in the map. User space frees the slots of processes gone.

use crate::ProcPeak;

/// A free slot, the only owner the kernel claims.
pub const FREE: u64 = 0;
/// A slot user space is emptying.
pub const BUSY: u64 = u64::MAX;

/// At most this many slots: 128 KiB.
pub const MAX_SLOTS: u32 = 1024;

/// One process's slot. The owner and the unwind word share a cache line that only changes
/// when they do; the peak, written at every tracked allocation and release, has its own.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcState {
    /// A tgid, [`FREE`] or [`BUSY`].
    pub owner: u64,
    /// The process's unwind entry ([`unwind_word`]); 0: look it up in `UNWIND_PROCS`.
    pub unwind: u64,
    pub _line: [u64; 6],
    pub peak: ProcPeak,
    pub _pad: u64,
}

const _: () = assert!(core::mem::size_of::<ProcState>() == 128);

impl ProcState {
    /// A free slot: all zero bytes, as the kernel creates the array and user space frees it
    /// (a claim then starts the peak from `ProcPeak::ZERO`).
    pub const ZERO: ProcState = ProcState {
        owner: FREE,
        unwind: 0,
        _line: [0; 6],
        peak: ProcPeak {
            max_stack: 0,
            ..ProcPeak::ZERO
        },
        _pad: 0,
    };
}

/// The slots for a process map of `proc_map_size` processes: the largest power of two up to
/// a quarter of it, at most [`MAX_SLOTS`].
pub fn slots(proc_map_size: u32) -> u32 {
    let want = (proc_map_size / 4).clamp(1, MAX_SLOTS);
    1 << (31 - want.leading_zeros())
}

/// The tgid bits an unwind word keeps (pid_max is at most 2^22).
const TGID_BITS: u64 = 0xff_ffff;

/// `tgid`'s unwind entry `version` of `count` modules (`heaptrace_common::unwind::ProcModules`)
/// in one word, written whole: the process's tgid in it, so a word written for a process whose
/// slot has changed hands since is told apart. Never 0 for a tgid above 0.
#[inline(always)]
pub fn unwind_word(tgid: u32, version: u32, count: u32) -> u64 {
    u64::from(version) | (u64::from(count) & 0xff) << 32 | (u64::from(tgid) & TGID_BITS) << 40
}

/// The version and module count a word holds for `tgid`, if it holds `tgid`'s.
#[inline(always)]
pub fn unwind_of(word: u64, tgid: u32) -> Option<(u32, u32)> {
    if word == 0 || word >> 40 != u64::from(tgid) & TGID_BITS {
        return None;
    }
    Some((word as u32, (word >> 32) as u32 & 0xff))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_word_is_its_process_alone() {
        let w = unwind_word(4242, 7, 12);
        assert_eq!(unwind_of(w, 4242), Some((7, 12)));
        assert_eq!(unwind_of(w, 4243), None);
        assert_eq!(unwind_of(0, 4242), None);
        assert_ne!(unwind_word(1, 0, 0), 0);
        assert_eq!(
            unwind_of(unwind_word(1 << 22, 3, 64), 1 << 22),
            Some((3, 64))
        );
    }

    #[test]
    fn slots_are_a_quarter_of_the_map_in_a_power_of_two() {
        assert_eq!(slots(4096), 1024);
        assert_eq!(slots(u32::MAX), MAX_SLOTS);
        assert_eq!(slots(1000), 128);
        assert_eq!(slots(0), 1);
    }
}
