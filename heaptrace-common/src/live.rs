//! The live blocks' slots: a direct-mapped table in front of the live hash map.
//!
//! A hash map insert takes a bucket lock and allocates an element, and a delete takes the lock
//! again: on this project's machine the live map's insert, lookup and delete were about 330 ns
//! of program time per malloc+free pair (2026-11-24, in BENCHMARKS.md's history), half of what
//! counts mode adds to its traps. A slot is an array element, which the verifier inlines,
//! and is claimed and released with one compare-and-swap each, without a lock.
//!
//! Each block has one slot, picked by its address ([`index`]); a block whose slot is taken
//! goes to the hash map as before, so the table adds room and never refuses a block the map
//! would take. A slot's `state` is [`EMPTY`], [`BUSY`] while one program fills or empties it,
//! or the [`state`] of the key it holds, which the free of that key alone can match.

use crate::{LiveBlock, LiveKey};

/// A slot with no block: the only state an insert claims.
pub const EMPTY: u64 = 0;
/// A slot a program is filling or emptying; others pass it by (to the hash map).
pub const BUSY: u64 = 1;

/// The most slots: 3.5 MiB of kernel memory, allocated at load.
pub const MAX_SLOTS: u32 = 1 << 16;

/// One slot of the `LIVE_SLOTS` array.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveSlot {
    pub state: u64,
    pub key: LiveKey,
    pub block: LiveBlock,
}

const _: () = assert!(core::mem::size_of::<LiveSlot>() == 56);

/// The state of a slot holding `key`: a 64-bit hash of the whole key (process, image, address),
/// never [`EMPTY`] or [`BUSY`]. Two keys of one state would need a 2^-62 collision; the free
/// checks the key anyway.
#[inline(always)]
pub fn state(key: &LiveKey) -> u64 {
    crate::keyed::mix(key.ptr ^ crate::keyed::process(key.tgid, key.epoch))
}

/// A region of the address space whose blocks keep their order in the slots: glibc's largest
/// heap (HEAP_MAX_SIZE, 64 MiB on 64-bit), so that each thread arena's heap has one offset.
pub const REGION_SHIFT: u32 = 26;

/// The slot of `key`, for a table of `mask + 1` slots: its address in 16-byte units (the
/// allocators' alignment), plus an offset drawn from a hash of its process and region. Blocks
/// allocated one after another take neighbouring slots: no two of a region's blocks less than
/// `16 * (mask + 1)` bytes apart share a slot, and a program touches a few cache lines and
/// pages of the table where a hash of the whole key touched a new one each call (threadtest's
/// 30,000 live blocks: 1 in 5 went to the hash map, and counts mode's programs took 744 ns a
/// pair against 325 with one live block; BENCHMARKS.md, *Many live blocks*). The regions'
/// offsets keep the arenas of a process, and processes, from landing on the same slots.
#[inline(always)]
pub fn index(key: &LiveKey, mask: u32) -> u32 {
    let region =
        crate::keyed::mix((key.ptr >> REGION_SHIFT) ^ crate::keyed::process(key.tgid, key.epoch));
    ((key.ptr >> 4) as u32).wrapping_add((region >> 32) as u32) & mask
}

/// The slots for `--live-map-size` blocks: the largest power of two up to a sixteenth of them,
/// at most [`MAX_SLOTS`]. The hash map keeps its capacity, so the blocks tracked at once are at
/// least `live_map_size` and at most a sixteenth more.
pub fn slots(live_map_size: u32) -> u32 {
    let want = (live_map_size / 16).clamp(1, MAX_SLOTS);
    1 << (31 - want.leading_zeros())
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec;

    use super::*;

    fn key(tgid: u32, epoch: u32, ptr: u64) -> LiveKey {
        LiveKey { tgid, epoch, ptr }
    }

    #[test]
    fn a_state_is_never_empty_or_busy() {
        for ptr in [0u64, 1, 16, 0x5555_5555_0000, u64::MAX] {
            for (tgid, epoch) in [(0, 0), (1, 1), (u32::MAX, 7)] {
                let s = state(&key(tgid, epoch, ptr));
                assert!(s != EMPTY && s != BUSY, "{tgid} {epoch} {ptr:#x}: {s:#x}");
            }
        }
    }

    #[test]
    fn the_process_and_image_change_the_state() {
        let a = state(&key(100, 1, 0x5555_0000_1000));
        assert_ne!(a, state(&key(101, 1, 0x5555_0000_1000)));
        assert_ne!(a, state(&key(100, 2, 0x5555_0000_1000)));
        assert_ne!(a, state(&key(100, 1, 0x5555_0000_1010)));
    }

    fn share(keys: impl Iterator<Item = LiveKey>) -> f64 {
        let mut used = vec![false; MAX_SLOTS as usize];
        for k in keys {
            used[index(&k, MAX_SLOTS - 1) as usize] = true;
        }
        used.iter().filter(|u| **u).count() as f64 / f64::from(MAX_SLOTS)
    }

    /// A heap's blocks, 16 bytes apart, fill the slots one each.
    #[test]
    fn neighbouring_blocks_take_a_slot_each() {
        let n = u64::from(MAX_SLOTS);
        let heap = (0..n).map(|i| key(4242, 1, 0x5555_5555_0010 + 16 * i));
        assert_eq!(share(heap), 1.0);
    }

    /// Two thread arenas' heaps (64 MiB apart, their blocks at the same offsets), and two
    /// processes' heaps at the same addresses, are not laid on the same slots.
    #[test]
    fn arenas_and_processes_take_other_slots() {
        let half = u64::from(MAX_SLOTS / 2);
        let at = |tgid, base: u64| (0..half).map(move |i| key(tgid, 1, base + 16 * i));
        let arenas = at(4242, 0x7f00_0000_0010).chain(at(4242, 0x7f00_0400_0010));
        let processes = at(4242, 0x5555_5555_0010).chain(at(4243, 0x5555_5555_0010));
        for (what, s) in [("arenas", share(arenas)), ("processes", share(processes))] {
            assert!(s > 0.5, "{what}: {s}");
        }
    }

    #[test]
    fn slots_are_a_sixteenth_of_the_map_in_a_power_of_two() {
        assert_eq!(slots(1 << 20), 1 << 16);
        assert_eq!(slots(u32::MAX), MAX_SLOTS);
        assert_eq!(slots(64), 4);
        assert_eq!(slots(100), 4);
        assert_eq!(slots(1), 1);
        assert_eq!(slots(0), 1);
    }
}
