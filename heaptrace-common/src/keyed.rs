//! Keyed counters in slots, a row per CPU, before the per-CPU hash maps of sites and sizes.
//!
//! Each allocation in stacks mode adds to its site's counters and its size's count, and each
//! free to its site's: per-CPU hash lookups of a 16- or 24-byte key (BENCHMARKS.md, *Slots
//! before the site and size maps*). A slot is an array element, which the verifier inlines.
//!
//! As with the process slots (`procs`), each CPU has its own row, so only programs on that CPU
//! write a slot's counters, and user space reads and frees single slots in place. A key's slot
//! in a row is picked by its hash. A slot's `state` is [`EMPTY`], [`BUSY`] while a program fills
//! it or user space empties it, or the [`SlotKey::state`] of the key it holds. A program takes
//! an empty slot with a compare-and-swap to busy, writes the key and publishes the key's state;
//! a key whose slot holds another counts in the hash map, as every key did. A key keeps its
//! slot until user space frees it, when its process is gone or has exec'ed (no program counts
//! under that key any more): busy, zeroed, empty. A key's counters are the sum of its slots and
//! its map entry over every CPU.
use crate::{SiteCounters, SiteKey, SizeKey};

/// A slot with no key: the only state a program claims.
pub const EMPTY: u64 = 0;
/// A slot being filled or emptied; programs pass it by (to the hash map).
pub const BUSY: u64 = 1;

/// The most kernel memory one table takes, over all CPUs, allocated at load.
pub const TABLE_BYTES: usize = 8 << 20;

/// One slot: its state, its key and the key's counters on that slot's CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot<K, V> {
    pub state: u64,
    pub key: K,
    pub value: V,
}

/// A site's counters on one CPU.
pub type SiteSlot = Slot<SiteKey, SiteCounters>;
/// A size's count on one CPU.
pub type SizeSlot = Slot<SizeKey, u64>;

// No implicit padding: both are shared with the kernel as plain integers.
const _: () =
    assert!(core::mem::size_of::<SiteSlot>() == 8 + 16 + core::mem::size_of::<SiteCounters>());
const _: () = assert!(core::mem::size_of::<SizeSlot>() == 8 + 24 + 8);

/// A key of a slot table.
pub trait SlotKey: Copy + PartialEq {
    /// A 64-bit hash of the whole key, never [`EMPTY`] or [`BUSY`]. A slot holding the key has
    /// this state; the key is compared too.
    fn state(&self) -> u64;
}

/// splitmix64's finalizer, with the two low bits set: never EMPTY or BUSY.
#[inline(always)]
pub fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^= x >> 33;
    x | 3
}

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// A (process, image) pair spread over 64 bits, to mix with the rest of a key.
#[inline(always)]
pub fn process(tgid: u32, epoch: u32) -> u64 {
    ((u64::from(tgid) << 32) | u64::from(epoch)).wrapping_mul(GOLDEN)
}

/// (stack, function, round generation) in distinct bits: a function index is below 256.
#[inline(always)]
fn site(stack_id: i32, func: u16, generation: u16) -> u64 {
    (u64::from(generation) << 40) | (u64::from(stack_id as u32) << 8) | u64::from(func & 0xff)
}

impl SlotKey for SiteKey {
    #[inline(always)]
    fn state(&self) -> u64 {
        mix(process(self.tgid, self.epoch) ^ site(self.stack_id, self.func, self.round))
    }
}

impl SlotKey for SizeKey {
    #[inline(always)]
    fn state(&self) -> u64 {
        let site = site(self.stack_id, self.func, self.round);
        mix(process(self.tgid, self.epoch) ^ self.size.wrapping_mul(GOLDEN).rotate_left(29) ^ site)
    }
}

/// The array index of a key of this state on `cpu`, in a table of `1 << shift` slots a CPU.
#[inline(always)]
pub fn index(cpu: u32, state: u64, shift: u32) -> u32 {
    (cpu << shift) | ((state >> 2) as u32 & ((1 << shift) - 1))
}

/// log2 of the slots a CPU for a hash map of `map_size` keys: the largest power of two up to a
/// sixteenth of it that keeps the table, `cpus` rows of `slot_bytes` slots, within
/// [`TABLE_BYTES`]; at least one.
pub fn shift(map_size: u32, slot_bytes: usize, cpus: u32) -> u32 {
    let budget = TABLE_BYTES / slot_bytes.max(1) / (cpus.max(1) as usize);
    let want = (map_size / 16)
        .min(budget.min(u32::MAX as usize) as u32)
        .max(1);
    31 - want.leading_zeros()
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::{collections::HashSet, vec::Vec};

    use super::*;
    use crate::LOG2_BUCKETS;

    fn site(tgid: u32, stack_id: i32, func: u16, epoch: u32) -> SiteKey {
        SiteKey {
            tgid,
            stack_id,
            func,
            round: 0,
            epoch,
        }
    }

    fn size(tgid: u32, size: u64, stack_id: i32) -> SizeKey {
        SizeKey {
            tgid,
            func: 0,
            round: 0,
            size,
            stack_id,
            epoch: 1,
        }
    }

    #[test]
    fn a_state_is_never_empty_or_busy_and_every_field_moves_it() {
        let k = site(100, 7, 0, 1);
        let states = [
            k.state(),
            site(101, 7, 0, 1).state(),
            site(100, 8, 0, 1).state(),
            site(100, 7, 1, 1).state(),
            site(100, 7, 0, 2).state(),
            site(100, -1, 0, 1).state(),
            SiteKey {
                round: 1,
                ..site(100, 7, 0, 1)
            }
            .state(),
        ];
        assert_eq!(states.iter().collect::<HashSet<_>>().len(), states.len());
        for s in states {
            assert!(s != EMPTY && s != BUSY);
        }
        assert_ne!(size(100, 64, 7).state(), size(100, 65, 7).state());
        assert_ne!(size(100, 64, 7).state(), size(100, 64, 8).state());
        let next = SizeKey {
            round: 1,
            ..size(100, 64, 7)
        };
        assert_ne!(size(100, 64, 7).state(), next.state());
    }

    /// One process's sizes 16 bytes apart, or its stacks' consecutive ids, spread over a row
    /// as random keys would: with as many keys as slots, about 1 - 1/e of the slots are used.
    #[test]
    fn neighbouring_keys_spread_over_a_row() {
        let shift = 12;
        let n = 1u32 << shift;
        let share = |states: Vec<u64>| {
            let used: HashSet<u32> = states.iter().map(|s| index(0, *s, shift)).collect();
            used.len() as f64 / f64::from(n)
        };
        let sizes = share(
            (0..n)
                .map(|i| size(4242, 16 * u64::from(i), 3).state())
                .collect(),
        );
        let sites = share((0..n).map(|i| site(4242, i as i32, 0, 1).state()).collect());
        for s in [sizes, sites] {
            assert!((0.61..0.655).contains(&s), "{s}");
        }
    }

    #[test]
    fn rows_are_a_sixteenth_of_the_map_within_the_budget() {
        let site_slot = core::mem::size_of::<SiteSlot>();
        assert_eq!(site_slot, 8 + 16 + 11 * 8 + 4 * LOG2_BUCKETS);
        assert_eq!(shift(24576, site_slot, 2), 10);
        // 64 CPUs: 8 MiB / 64 / 240 bytes = 546 slots a CPU, so 512.
        assert_eq!(shift(24576, site_slot, 64), 9);
        assert_eq!(shift(65536, 40, 2), 12);
        assert_eq!(shift(1, 40, 2), 0);
        assert_eq!(shift(65536, 1 << 30, 2), 0);
        assert_eq!(index(1, 0b10_1100, 2), 0b111);
    }
}
