//! An allocation's stack: walked by frame pointer within the thread's stack, then stored once
//! in the stack table (an index of hashes, each to a dense id whose record holds the return
//! addresses), shared by every thread.
use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use heaptrace_common::{
    Loss, STACK_FRAMES,
    inproc::{self, BUSY, EMPTY, IndexEntry, LOST_STACK, PROBES, StackHead, ThreadHead},
};

use crate::{count::lose, region::Region};

/// Return addresses from the frame of the library's entry point `fp`, innermost first: the
/// first is the allocation's caller. A frame pointer is followed only upwards and within the
/// thread's stack, so a function built without frame pointers (its rbp any value) ends the
/// walk and is never read through. Returns how many and whether the depth cut it.
fn walk(t: *mut ThreadHead, fp: usize, ips: &mut [u64]) -> (usize, bool) {
    // SAFETY: the thread's own slot.
    let (lo, hi) = unsafe { ((*t).stack_lo as usize, (*t).stack_hi as usize) };
    if fp < lo || fp.saturating_add(16) > hi || ips.is_empty() {
        return (0, false); // on another stack (a signal's): nothing read
    }
    let mut fp = fp;
    let mut n = 0;
    loop {
        // SAFETY: fp is within [lo, hi - 16], the thread's mapped stack above the current
        // frame (the entry point's own frame first).
        let (next, ret) = unsafe { (*(fp as *const usize), *((fp + 8) as *const u64)) };
        if ret == 0 {
            return (n, false);
        }
        if n == ips.len() {
            return (n, true);
        }
        ips[n] = ret;
        n += 1;
        if next <= fp || next % 8 != 0 || next.saturating_add(16) > hi {
            return (n, false);
        }
        fp = next;
    }
}

fn index(r: &Region, i: usize) -> *mut IndexEntry {
    r.at::<IndexEntry>(r.layout.index + i * core::mem::size_of::<IndexEntry>())
}

fn record(r: &Region, id: u32) -> *mut StackHead {
    r.at::<StackHead>(r.layout.stacks + id as usize * r.layout.stack_stride)
}

fn frames<'a>(h: *mut StackHead, len: usize) -> &'a mut [u64] {
    // SAFETY: the record's frames follow its head, `depth` of them (len <= depth).
    unsafe { core::slice::from_raw_parts_mut(h.add(1) as *mut u64, len) }
}

/// The stack id of an allocation by `func` made from the frame `fp`: its stored stack's, or
/// `LOST_STACK` when the table has no room for it.
pub fn site(r: &Region, t: *mut ThreadHead, func: u32, fp: usize) -> i32 {
    let mut ips = [0u64; STACK_FRAMES];
    let depth = (r.header().depth as usize).min(STACK_FRAMES);
    let (n, cut) = walk(t, fp, &mut ips[..depth]);
    if cut {
        lose(r, Loss::StackDepth);
    }
    let ips = &ips[..n];
    let key = inproc::stack_key(func, ips);
    let slots = r.header().site_index as usize;
    for p in 0..PROBES as usize {
        let e = index(r, (key as usize + p) & (slots - 1));
        // SAFETY: the key word of an index entry.
        let k = unsafe { AtomicU64::from_ptr(&raw mut (*e).key) };
        let mut seen = k.load(Ordering::Acquire);
        if seen == EMPTY {
            match k.compare_exchange(EMPTY, BUSY, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return store(r, e, k, key, func, ips, cut),
                Err(now) => seen = now,
            }
        }
        if seen == key {
            // SAFETY: the id was written before the key was published.
            let id = unsafe { (*e).id };
            let h = record(r, id);
            // SAFETY: a record published with its key.
            let same =
                unsafe { (*h).func == func && (*h).len as usize == n } && frames(h, n) == ips;
            if same {
                return id as i32;
            }
        }
    }
    lose(r, Loss::Stack);
    LOST_STACK
}

/// Stores a new stack under the index entry `e` (claimed): its record first, then the key.
fn store(
    r: &Region,
    e: *mut IndexEntry,
    k: &AtomicU64,
    key: u64,
    func: u32,
    ips: &[u64],
    cut: bool,
) -> i32 {
    // SAFETY: a u32 of the header.
    let used = unsafe { AtomicU32::from_ptr(&raw mut (*r.header_ptr()).sites_used) };
    let sites = r.header().sites;
    // Checked first so that the count never wraps; past the capacity it only says "full".
    let id = if used.load(Ordering::Acquire) < sites {
        used.fetch_add(1, Ordering::AcqRel)
    } else {
        sites
    };
    if id >= sites {
        k.store(EMPTY, Ordering::Release);
        lose(r, Loss::Stack);
        return LOST_STACK;
    }
    let h = record(r, id);
    // SAFETY: record `id` is this thread's to write: no one else got the id.
    unsafe {
        (*h).func = func;
        (*h).len = ips.len() as u32;
        (*h).whole = u32::from(!cut);
        (*e).id = id;
    }
    frames(h, ips.len()).copy_from_slice(ips);
    k.store(key, Ordering::Release);
    id as i32
}
