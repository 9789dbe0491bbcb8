//! The site and size slots as user space sees them (`heaptrace_common::keyed`): a kernel table
//! mapped into memory, read every round beside its hash map, and freed in place.
//!
//! A slot's counters are written by programs on its CPU while this reads them. They are taken
//! as its key's only if the state is the same before and after the read and is the state of
//! the key read; each counter is one aligned u64, as in a per-CPU map's read. Only the slots of
//! keys no program counts under any more are freed (processes gone, images before an exec):
//! busy, zeroed, empty, so the next key to take a slot starts from zero.
use std::sync::atomic::Ordering;

use aya::{Ebpf, Pod};
use heaptrace_common::keyed::{BUSY, EMPTY, Slot, SlotKey};

use crate::{bpf::mmap_array::MappedArray, error::Result};

pub struct KeyedSlots<K, V>(MappedArray<Slot<K, V>>);

impl<K: SlotKey + Pod, V: Pod> KeyedSlots<K, V> {
    /// Maps the loaded object's table `map`.
    pub fn map(ebpf: &Ebpf, map: &'static str) -> Result<KeyedSlots<K, V>> {
        MappedArray::map(ebpf, map).map(KeyedSlots)
    }

    #[cfg(test)]
    fn over(slots: &mut [Slot<K, V>]) -> std::mem::ManuallyDrop<KeyedSlots<K, V>> {
        std::mem::ManuallyDrop::new(KeyedSlots(std::mem::ManuallyDrop::into_inner(
            MappedArray::over(slots),
        )))
    }

    /// The slots holding a key, each read whole with the state it had before the read:
    /// (index, state, slot). The slot may hold another key by the time it is read.
    fn taken(&self) -> impl Iterator<Item = (usize, u64, Slot<K, V>)> + '_ {
        (0..self.0.len()).filter_map(|i| {
            let state = self.0.first_word(i).load(Ordering::Acquire);
            (state != EMPTY && state != BUSY).then(|| (i, state, self.0.read(i)))
        })
    }

    /// Every key held, with its counters on its slot's CPU (a key has one slot a CPU at most).
    pub fn held(&self) -> Vec<(K, V)> {
        self.taken()
            .filter(|(i, state, slot)| {
                self.0.first_word(*i).load(Ordering::Acquire) == *state
                    && slot.key.state() == *state
            })
            .map(|(_, _, slot)| (slot.key, slot.value))
            .collect()
    }

    /// Frees the slots of the keys `gone` accepts; returns those keys (one per slot freed).
    pub fn free_where(&self, gone: impl Fn(&K) -> bool) -> Vec<K> {
        let mut freed = Vec::new();
        for (i, state, slot) in self.taken() {
            if slot.key.state() != state || !gone(&slot.key) {
                continue;
            }
            let word = self.0.first_word(i);
            if word
                .compare_exchange(state, BUSY, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            // SAFETY: Pod types are plain integers: all zeroes is a value.
            let zero: Slot<K, V> = unsafe { std::mem::zeroed() };
            self.0.write(
                i,
                Slot {
                    state: BUSY,
                    ..zero
                },
            );
            word.store(EMPTY, Ordering::Release);
            freed.push(slot.key);
        }
        freed
    }
}

#[cfg(test)]
mod tests {
    use heaptrace_common::SiteKey;

    use super::*;

    fn key(tgid: u32, stack_id: i32) -> SiteKey {
        SiteKey {
            tgid,
            stack_id,
            func: 0,
            round: 0,
            epoch: 1,
        }
    }

    fn held(k: SiteKey, n: u64) -> Slot<SiteKey, u64> {
        Slot {
            state: k.state(),
            key: k,
            value: n,
        }
    }

    /// A slot as freed: all zeroes.
    fn empty() -> Slot<SiteKey, u64> {
        Slot {
            state: EMPTY,
            key: SiteKey {
                epoch: 0,
                ..key(0, 0)
            },
            value: 0,
        }
    }

    #[test]
    fn held_keys_are_read_and_torn_or_busy_slots_skipped() {
        let torn = Slot {
            state: key(30, 1).state(),
            ..held(key(31, 1), 9)
        };
        let busy = Slot {
            state: BUSY,
            ..held(key(40, 1), 9)
        };
        let mut slots = [
            held(key(10, 1), 5),
            empty(),
            torn,
            busy,
            held(key(20, 2), 3),
        ];
        let t = KeyedSlots::over(&mut slots);
        assert_eq!(t.held(), [(key(10, 1), 5), (key(20, 2), 3)]);
    }

    #[test]
    fn only_the_keys_gone_are_freed_and_zeroed() {
        let mut slots = [
            held(key(10, 1), 5),
            held(key(20, 1), 3),
            held(key(10, 2), 4),
        ];
        let t = KeyedSlots::over(&mut slots);
        assert_eq!(t.free_where(|k| k.tgid == 10), [key(10, 1), key(10, 2)]);
        assert_eq!(t.0.read(0), empty());
        assert_eq!(t.0.read(2), empty());
        assert_eq!(t.held(), [(key(20, 1), 3)]);
        assert!(t.free_where(|k| k.tgid == 10).is_empty());
    }
}
