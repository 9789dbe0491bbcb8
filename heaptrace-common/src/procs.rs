//! The process counters' slots: a direct-mapped table per CPU in front of the process map.
//!
//! Every counted call adds to its process's counters on its CPU. In the per-CPU hash map
//! (PROCS) that is a hash lookup at the return and another at the free, about 115 ns of
//! program time per malloc+free pair on this project's machine (BENCHMARKS.md, *Slots before
//! the process map*). A slot is an array element, which the verifier inlines.
//!
//! The table is one mappable array of `CPUs x slots` ([`index`]): each CPU has its own row, so
//! a slot is written by programs on one CPU only, as a per-CPU map's value is, and user space
//! can read and free a single CPU's slot in place (a per-CPU map's value is written for all
//! CPUs at once, which would race the programs on the other CPUs). A process takes the slot of
//! its tgid's low bits in its CPU's row with a compare-and-swap of [`ProcSlot::owner`] and
//! keeps it until user space frees it when the process is gone. A process whose slot another
//! owns on that CPU counts in the hash map there, as every process did: the table adds room
//! and never refuses a process the map would take. A process's counters are the sum of its
//! slots and its map entry, over every CPU.

use crate::ProcCounters;

/// A free slot, the only owner a program claims.
pub const FREE: u64 = 0;
/// A slot user space is emptying; programs pass it by (to the hash map).
pub const BUSY: u64 = u64::MAX;
/// Set in the owner of a slot whose process exec'ed: the counters are an earlier image's, which
/// user space no longer reads and frees; the new image counts elsewhere meanwhile.
pub const STALE: u64 = 1 << 32;

/// At most this many CPUs (an exec's program marks the slots of every CPU in a bounded loop):
/// on a machine with more, the table is off and every process counts in the hash map.
pub const MAX_CPUS: u32 = 256;

/// At most this many slots per CPU: 76 KiB of kernel memory per CPU, allocated at load.
pub const MAX_SLOTS: u32 = 256;

/// One slot: its owner (a tgid; [`FREE`], [`BUSY`], or a tgid with [`STALE`]) and the owner's
/// counters on that slot's CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcSlot {
    pub owner: u64,
    pub counters: ProcCounters,
}

const _: () = assert!(core::mem::size_of::<ProcSlot>() == 8 + core::mem::size_of::<ProcCounters>());

/// The slots per CPU for a process map of `proc_map_size` processes: the largest power of two
/// up to a sixteenth of it, at most [`MAX_SLOTS`].
pub fn slots(proc_map_size: u32) -> u32 {
    let want = (proc_map_size / 16).clamp(1, MAX_SLOTS);
    1 << (31 - want.leading_zeros())
}

/// The array index of `tgid`'s slot on `cpu`, in a table of `1 << shift` slots per CPU.
#[inline(always)]
pub fn index(cpu: u32, tgid: u32, shift: u32) -> u32 {
    (cpu << shift) | (tgid & ((1 << shift) - 1))
}

/// The tgid that owns a slot of this owner word, if a live process does (not free, busy or
/// stale).
#[inline(always)]
pub fn owner_tgid(owner: u64) -> Option<u32> {
    if owner == FREE || owner >> 32 != 0 {
        None
    } else {
        Some(owner as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_a_sixteenth_of_the_map_in_a_power_of_two() {
        assert_eq!(slots(4096), 256);
        assert_eq!(slots(u32::MAX), MAX_SLOTS);
        assert_eq!(slots(1000), 32);
        assert_eq!(slots(16), 1);
        assert_eq!(slots(0), 1);
    }

    #[test]
    fn each_cpu_has_its_own_row() {
        assert_eq!(index(0, 4242, 8), 4242 & 255);
        assert_eq!(index(1, 4242, 8), 256 + (4242 & 255));
        assert_eq!(index(3, 7, 0), 3);
        // Neighbouring tgids take neighbouring slots of a row.
        assert_eq!(index(1, 4243, 8), index(1, 4242, 8) + 1);
    }

    #[test]
    fn only_a_live_process_owns_a_slot() {
        assert_eq!(owner_tgid(FREE), None);
        assert_eq!(owner_tgid(BUSY), None);
        assert_eq!(owner_tgid(STALE | 4242), None);
        assert_eq!(owner_tgid(4242), Some(4242));
        assert_eq!(owner_tgid(u64::from(u32::MAX)), Some(u32::MAX));
    }
}
