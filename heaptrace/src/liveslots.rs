//! The live slots as user space sees them (`heaptrace_common::live`): the kernel's array mapped
//! into memory, read where processes end or exec, and emptied of their blocks in place.
//!
//! The programs change slots while this reads them. A slot is taken as holding a block only if
//! its state is the same before and after its fields were read and is the state of the key
//! read, so a slot emptied and filled again meanwhile is never mistaken for another block. A
//! slot is emptied by compare-and-swap from the state read: only slots of processes gone (or of
//! an image before an exec) are emptied, whose blocks no program frees any more.
use std::{
    os::fd::{AsFd as _, AsRawFd as _},
    ptr::NonNull,
    sync::atomic::{AtomicU64, Ordering},
};

use aya::Ebpf;
use heaptrace_common::{
    LiveBlock, LiveKey,
    live::{BUSY, EMPTY, LiveSlot, state},
    maps,
};

use crate::error::{Error, Result};

/// A block held in a slot: where, and the state it was read in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    pub index: u32,
    pub state: u64,
    pub key: LiveKey,
    pub block: LiveBlock,
}

pub struct LiveSlots {
    base: NonNull<LiveSlot>,
    slots: usize,
    bytes: usize,
}

// SAFETY: the mapping is shared memory that the kernel also writes; every access goes through
// atomics or volatile reads, whichever thread makes it.
unsafe impl Send for LiveSlots {}
// SAFETY: as above.
unsafe impl Sync for LiveSlots {}

fn map_err(reason: impl ToString) -> Error {
    Error::Map {
        map: maps::LIVE_SLOTS,
        reason: reason.to_string(),
    }
}

impl LiveSlots {
    /// Maps the loaded object's slot array (created mappable).
    pub fn map(ebpf: &Ebpf) -> Result<LiveSlots> {
        let Some(aya::maps::Map::Array(data)) = ebpf.map(maps::LIVE_SLOTS) else {
            return Err(map_err("not an array in the object"));
        };
        let slots = data.info().map_err(map_err)?.max_entries();
        let page = 4096;
        let bytes = (slots as usize * size_of::<LiveSlot>()).div_ceil(page) * page;
        // SAFETY: a shared mapping of the map's fd (BPF_F_MMAPABLE), no larger than the array
        // rounded up to a page; it stays valid after the fd is closed, until munmap.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                data.fd().as_fd().as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(map_err(std::io::Error::last_os_error()));
        }
        Ok(LiveSlots {
            base: NonNull::new(p.cast()).ok_or_else(|| map_err("mapped at null"))?,
            slots: slots as usize,
            bytes,
        })
    }

    /// The slots mapped (the array's length).
    pub fn len(&self) -> usize {
        self.slots
    }

    pub fn is_empty(&self) -> bool {
        self.slots == 0
    }

    fn state(&self, i: usize) -> &AtomicU64 {
        // SAFETY: i < slots; `state` is a slot's first field, an aligned u64 in the mapping.
        unsafe { AtomicU64::from_ptr(self.base.as_ptr().add(i).cast()) }
    }

    /// The blocks held in slots whose keys `want` accepts.
    pub fn held_where(&self, mut want: impl FnMut(&LiveKey) -> bool) -> Vec<Held> {
        let mut out = Vec::new();
        for i in 0..self.slots {
            let before = self.state(i).load(Ordering::Acquire);
            if before == EMPTY || before == BUSY {
                continue;
            }
            // SAFETY: i < slots; a volatile read of plain integers the kernel may be writing
            // (a torn read is caught by the checks below).
            let slot = unsafe { self.base.as_ptr().add(i).read_volatile() };
            let after = self.state(i).load(Ordering::Acquire);
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
            let _ = self.state(h.index as usize).compare_exchange(
                h.state,
                EMPTY,
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
    }
}

impl Drop for LiveSlots {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.bytes) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Slots in ordinary memory, laid out as the kernel's array.
    fn table(slots: &mut [LiveSlot]) -> std::mem::ManuallyDrop<LiveSlots> {
        std::mem::ManuallyDrop::new(LiveSlots {
            base: NonNull::new(slots.as_mut_ptr()).unwrap(),
            slots: slots.len(),
            bytes: 0,
        })
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
                _pad: 0,
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
        t.state(0)
            .store(state(&slot(9, 1, 0x90, 1).key), Ordering::Release);
        t.empty(&held);
        assert_ne!(t.state(0).load(Ordering::Acquire), EMPTY);
    }
}
