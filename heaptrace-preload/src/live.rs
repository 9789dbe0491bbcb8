//! The live-block table, shared by every thread (a block may be freed by another thread
//! than its own): open addressing on the block's address, a slot claimed with a
//! compare-and-swap, a freed block's slot left as a tombstone that a later insert takes.
use core::sync::atomic::{AtomicU64, Ordering};

use heaptrace_common::inproc::{
    self, BUSY, EMPTY, GONE, LIVE_RETRIES, LIVE_RETRY_PROBES, LiveEntry, PROBES,
};

use crate::region::Region;

fn slot(r: &Region, i: usize) -> *mut LiveEntry {
    r.at::<LiveEntry>(r.layout.live + i * core::mem::size_of::<LiveEntry>())
}

fn key(e: *mut LiveEntry) -> &'static AtomicU64 {
    // SAFETY: the key word of an entry in the mapping.
    unsafe { AtomicU64::from_ptr(&raw mut (*e).key) }
}

/// The runs of slots a block's address may be in, in order: `(first, length)` of its own
/// (`inproc::live_slot`), then the retries (`inproc::LIVE_RETRIES`).
fn runs(ptr: u64, slots: u32) -> impl Iterator<Item = (usize, usize)> {
    let own = (inproc::live_slot(ptr, slots), PROBES as usize);
    let retries = (1..=LIVE_RETRIES).map(move |n| {
        (
            inproc::live_retry_slot(ptr, n, slots),
            LIVE_RETRY_PROBES as usize,
        )
    });
    core::iter::once(own).chain(retries)
}

/// Puts a block in; false if no slot was free in any of its runs (the table is full).
pub fn insert(r: &Region, block: LiveEntry) -> bool {
    let slots = r.fixed.live;
    for (first, len) in runs(block.key, slots) {
        for p in 0..len {
            let e = slot(r, (first + p) & (slots as usize - 1));
            let k = key(e);
            let mut seen = k.load(Ordering::Acquire);
            while seen == EMPTY || seen == GONE {
                match k.compare_exchange(seen, BUSY, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => {
                        // SAFETY: the slot is this thread's until its key is published.
                        unsafe {
                            (*e).size = block.size;
                            (*e).stack_id = block.stack_id;
                            (*e).func = block.func;
                            (*e).tid = block.tid;
                            (*e).seq = block.seq;
                            (*e).ts_ns = block.ts_ns;
                        }
                        k.store(block.key, Ordering::Release);
                        return true;
                    }
                    Err(now) => seen = now,
                }
            }
        }
    }
    false
}

/// Takes a block out, if it is in: only the one caller that swaps its key out gets it (a
/// double free by the program counts once). An empty slot ends the search: the insert took
/// the first free or freed slot of the runs, and an empty one stays empty.
pub fn take(r: &Region, ptr: u64) -> Option<LiveEntry> {
    let slots = r.fixed.live;
    for (first, len) in runs(ptr, slots) {
        for p in 0..len {
            let e = slot(r, (first + p) & (slots as usize - 1));
            let k = key(e);
            match k.load(Ordering::Acquire) {
                EMPTY => return None,
                seen if seen == ptr => {
                    // SAFETY: published with the key (Acquire above); unchanged while it is in.
                    let block = unsafe { *e };
                    if k.compare_exchange(ptr, GONE, Ordering::AcqRel, Ordering::Relaxed)
                        .is_ok()
                    {
                        return Some(LiveEntry { key: ptr, ..block });
                    }
                    return None;
                }
                _ => {}
            }
        }
    }
    None
}
