//! The process slots as user space sees them (`heaptrace_common::procs`): the kernel's table
//! mapped into memory, read every round beside the process map, and freed in place.
//!
//! A slot's counters are written by programs on its CPU while this reads them. They are taken
//! as its owner's only if the owner is the same before and after they were read; each counter
//! is one aligned u64, as in a per-CPU map's read. Only slots no program writes any more are
//! freed: those of processes gone, and stale ones (an image before an exec), which the kernel
//! marked and no longer counts in. A slot is marked busy, zeroed, then freed, so the next
//! process to claim it starts from zero.
use std::sync::atomic::Ordering;

use aya::Ebpf;
use heaptrace_common::{
    ProcCounters, maps,
    procs::{BUSY, FREE, ProcSlot, STALE, owner_tgid},
};

use crate::{bpf::mmap_array::MappedArray, error::Result};

pub struct ProcSlots(MappedArray<ProcSlot>);

impl ProcSlots {
    /// Maps the loaded object's slot table.
    pub fn map(ebpf: &Ebpf) -> Result<ProcSlots> {
        MappedArray::map(ebpf, maps::PROC_SLOTS).map(ProcSlots)
    }

    #[cfg(test)]
    fn over(slots: &mut [ProcSlot]) -> std::mem::ManuallyDrop<ProcSlots> {
        std::mem::ManuallyDrop::new(ProcSlots(std::mem::ManuallyDrop::into_inner(
            MappedArray::over(slots),
        )))
    }

    /// The counters of every slot a running process owns, with its tgid (a process has one
    /// slot per CPU at most). Frees the stale slots met on the way: no one reads them again.
    pub fn owned(&self) -> Vec<(u32, ProcCounters)> {
        let mut out = Vec::new();
        for i in 0..self.0.len() {
            let before = self.0.first_word(i).load(Ordering::Acquire);
            if before == FREE {
                continue;
            }
            if before != BUSY && before & STALE != 0 {
                self.free(i, before);
                continue;
            }
            let Some(tgid) = owner_tgid(before) else {
                continue;
            };
            let slot = self.0.read(i);
            if self.0.first_word(i).load(Ordering::Acquire) == before {
                out.push((tgid, slot.counters));
            }
        }
        out
    }

    /// Frees the slots of the processes `gone` accepts; returns how many.
    pub fn free_where(&self, gone: impl Fn(u32) -> bool) -> usize {
        let mut freed = 0;
        for i in 0..self.0.len() {
            let owner = self.0.first_word(i).load(Ordering::Acquire);
            if owner_tgid(owner).is_some_and(&gone) && self.free(i, owner) {
                freed += 1;
            }
        }
        freed
    }

    /// Empties slot `i` if its owner is still `owner`: busy while its counters are zeroed, so
    /// no program claims it half-cleared.
    fn free(&self, i: usize, owner: u64) -> bool {
        let word = self.0.first_word(i);
        if word
            .compare_exchange(owner, BUSY, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        self.0.write(
            i,
            ProcSlot {
                owner: BUSY,
                counters: ProcCounters::ZERO,
            },
        );
        word.store(FREE, Ordering::Release);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(owner: u64, calls: u64) -> ProcSlot {
        let mut counters = ProcCounters::ZERO;
        counters.funcs[0].calls = calls;
        ProcSlot { owner, counters }
    }

    #[test]
    fn owned_slots_are_read_and_stale_ones_freed() {
        let mut slots = [
            slot(10, 5),
            slot(FREE, 0),
            slot(STALE | 10, 7),
            slot(BUSY, 9),
            slot(20, 3),
        ];
        let t = ProcSlots::over(&mut slots);
        let owned: Vec<(u32, u64)> = t
            .owned()
            .iter()
            .map(|(tgid, c)| (*tgid, c.funcs[0].calls))
            .collect();
        assert_eq!(owned, [(10, 5), (20, 3)]);
        // The stale slot was emptied and freed; the busy one (user space's own) left alone.
        assert_eq!(t.0.read(2), slot(FREE, 0));
        assert_eq!(t.0.read(3), slot(BUSY, 9));
    }

    #[test]
    fn only_the_slots_of_processes_gone_are_freed_and_zeroed() {
        let mut slots = [slot(10, 5), slot(20, 3), slot(10, 4), slot(STALE | 20, 1)];
        let t = ProcSlots::over(&mut slots);
        assert_eq!(t.free_where(|tgid| tgid == 10), 2);
        assert_eq!(t.0.read(0), slot(FREE, 0));
        assert_eq!(t.0.read(1), slot(20, 3));
        assert_eq!(t.0.read(2), slot(FREE, 0));
        // Stale slots are not a running process's: `owned` frees them, not this.
        assert_eq!(t.0.read(3), slot(STALE | 20, 1));
        assert_eq!(t.free_where(|tgid| tgid == 10), 0);
    }
}
