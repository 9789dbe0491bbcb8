//! The live slots as user space sees them (`heaptrace_common::live`): the kernel's array mapped
//! into memory, read where processes end or exec, and emptied of their blocks in place.
//!
//! The programs change slots while this reads them. A slot is taken as holding a block only if
//! its state is the same before and after its fields were read and is the state of the key
//! read, so a slot emptied and filled again meanwhile is never mistaken for another block. A
//! slot is emptied by compare-and-swap from the state read: only slots of processes gone (or of
//! an image before an exec) are emptied, whose blocks no program frees any more.
use std::sync::atomic::Ordering;

use aya::Ebpf;
use heaptrace_common::{
    LiveBlock, LiveKey,
    live::{BUSY, EMPTY, LiveSlot, state},
    maps,
};

use crate::{bpf::mmap_array::MappedArray, error::Result};

/// A block held in a slot: where, and the state it was read in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    pub index: u32,
    pub state: u64,
    pub key: LiveKey,
    pub block: LiveBlock,
}

pub struct LiveSlots(MappedArray<LiveSlot>);

impl LiveSlots {
    /// Maps the loaded object's slot array.
    pub fn map(ebpf: &Ebpf) -> Result<LiveSlots> {
        MappedArray::map(ebpf, maps::LIVE_SLOTS).map(LiveSlots)
    }

    /// The slots mapped (the array's length).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The blocks held in slots whose keys `want` accepts.
    pub fn held_where(&self, mut want: impl FnMut(&LiveKey) -> bool) -> Vec<Held> {
        let mut out = Vec::new();
        for i in 0..self.len() {
            let before = self.0.first_word(i).load(Ordering::Acquire);
            if before == EMPTY || before == BUSY {
                continue;
            }
            let slot = self.0.read(i);
            let after = self.0.first_word(i).load(Ordering::Acquire);
            if after != before || state(&slot.key) != before || !want(&slot.key) {
                continue;
            }
            out.push(Held {
                index: i as u32,
                state: before,
                key: slot.key,
                block: slot.block,
            });
        }
        out
    }

    /// Empties the slots of these blocks, each only if it still holds the block as read.
    pub fn empty(&self, held: &[Held]) {
        for h in held {
            let _ = self.0.first_word(h.index as usize).compare_exchange(
                h.state,
                EMPTY,
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Slots in ordinary memory, laid out as the kernel's array.
    fn table(slots: &mut [LiveSlot]) -> std::mem::ManuallyDrop<LiveSlots> {
        std::mem::ManuallyDrop::new(LiveSlots(std::mem::ManuallyDrop::into_inner(
            MappedArray::over(slots),
        )))
    }

    fn slot(tgid: u32, epoch: u32, ptr: u64, size: u64) -> LiveSlot {
        let key = LiveKey { tgid, epoch, ptr };
        LiveSlot {
            state: state(&key),
            key,
            block: LiveBlock {
                size,
                ts_ns: 0,
                tid: tgid,
                func: 0,
                stack_id: 0,
                seq: 0,
            },
        }
    }

    #[test]
    fn only_whole_blocks_of_the_wanted_processes_are_read_and_emptied() {
        let empty = LiveSlot {
            state: EMPTY,
            ..slot(0, 0, 0, 0)
        };
        let busy = LiveSlot {
            state: BUSY,
            ..slot(7, 1, 0x10, 1)
        };
        // A slot whose state is not its key's: read while a program refilled it.
        let torn = LiveSlot {
            key: LiveKey {
                tgid: 7,
                epoch: 1,
                ptr: 0x30,
            },
            ..slot(8, 1, 0x30, 3)
        };
        let mut slots = [
            slot(7, 1, 0x10, 16),
            empty,
            slot(8, 1, 0x20, 32),
            busy,
            torn,
            slot(7, 1, 0x40, 64),
        ];
        let t = table(&mut slots);
        let held = t.held_where(|k| k.tgid == 7);
        let sizes: Vec<u64> = held.iter().map(|h| h.block.size).collect();
        assert_eq!(sizes, [16, 64]);
        assert_eq!(held[1].index, 5);
        t.empty(&held);
        assert!(t.held_where(|k| k.tgid == 7).is_empty());
        assert_eq!(t.held_where(|_| true).len(), 1, "process 8's block stays");
    }

    #[test]
    fn a_slot_refilled_since_it_was_read_is_not_emptied() {
        let mut slots = [slot(7, 1, 0x10, 16)];
        let t = table(&mut slots);
        let held = t.held_where(|_| true);
        // The block was freed and another took the slot before the empty.
        t.0.first_word(0)
            .store(state(&slot(9, 1, 0x90, 1).key), Ordering::Release);
        t.empty(&held);
        assert_ne!(t.0.first_word(0).load(Ordering::Acquire), EMPTY);
    }
}
