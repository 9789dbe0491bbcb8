//! The true peak: each process's live heap kept at every tracked allocation and release, and
//! the highest it reached, taken at the allocation that reached it (not at a round's end).
//!
//! One counter a process for all CPUs: a peak is a maximum of a sum, which per-CPU counters
//! cannot give without summing them at each call. An atomic add on a line the process's CPUs
//! share each allocation and release, in the process's slot (`proc_state.rs`) or, where it
//! has none, in the map: BENCHMARKS.md, *The true peak*.
use aya_ebpf::{macros::map, maps::HashMap};
use heaptrace_common::{Loss, ProcPeak};

use crate::maps::{BPF_NOEXIST, lose};

/// By tgid, for processes without a slot (`proc_state.rs`). Preallocated, as SITES: the
/// loader sizes it as the process map.
#[map]
pub static PEAKS: HashMap<u32, ProcPeak> = HashMap::with_max_entries(4096, 0);

/// Never written: what a new entry starts from (see `maps::PROC_ZERO`).
static mut PEAK_ZERO: ProcPeak = ProcPeak::ZERO;

/// `tgid`'s entry, created where missing; None where the map is full.
#[inline(always)]
pub fn entry(tgid: u32) -> Option<&'static mut ProcPeak> {
    if let Some(s) = crate::proc_state::of(tgid) {
        return Some(&mut s.peak);
    }
    if let Some(p) = PEAKS.get_ptr_mut(&tgid) {
        // SAFETY: map value pointer, valid for the program's run.
        return Some(unsafe { &mut *p });
    }
    // SAFETY: a value nothing writes.
    let _ = PEAKS.insert(&tgid, unsafe { &*(&raw const PEAK_ZERO) }, BPF_NOEXIST);
    // SAFETY: as above.
    PEAKS.get_ptr_mut(&tgid).map(|p| unsafe { &mut *p })
}

/// The peak number site counters fold at (`ProcPeak::seq`), 0 without an entry.
#[inline(always)]
pub fn seq(p: &Option<&'static mut ProcPeak>) -> u32 {
    // SAFETY: an aligned read of a map value.
    p.as_ref()
        .map_or(0, |p| unsafe { core::ptr::read_volatile(&p.seq) })
}

/// A block of `size` bytes became live in image `epoch` of the process of entry `p`
/// (`entry`), from stack `stack_id`.
#[inline(always)]
pub fn grew(p: Option<&'static mut ProcPeak>, epoch: u32, size: u64, stack_id: i32) {
    let Some(p) = p else {
        lose(Loss::ProcessMap);
        return;
    };
    crate::maps::add(&mut p.blocks, 1);
    // The add's old value is not to be had (`--cpu generic` has no fetching add): read after
    // it. Another CPU's add or release in between makes it a value `live` had a moment later.
    crate::maps::add(&mut p.live, size);
    // SAFETY: an aligned read of a map value.
    let now = unsafe { core::ptr::read_volatile(&p.live) };
    // Compared as signed: a release seen before its block's allocation on another CPU can
    // take `live` below 0 for a moment.
    // SAFETY: an aligned read of a map value.
    if (now as i64) > unsafe { core::ptr::read_volatile(&p.max) } as i64 {
        // Plain stores: two CPUs reaching a new peak at once keep one of the two, each a peak
        // the process did reach.
        // The sites' figures of the peak follow the last to store `pending`'s 1 and the
        // release that moves `seq` on (docs/accuracy.md, *Peak*).
        p.max = now;
        p.max_size = size;
        p.max_stack = stack_id;
        p.epoch = epoch;
        // SAFETY: an aligned read of a map value.
        p.max_blocks = unsafe { core::ptr::read_volatile(&p.blocks) };
        p.pending = 1;
    }
}

/// A block of `size` bytes of `tgid` was released. Returns the peak number its site is to
/// fold at: moved on first where this is the first release since a new high, so that the
/// sites keep their figures of before it.
#[inline(always)]
pub fn shrank(tgid: u32, size: u64) -> u32 {
    let p = match crate::proc_state::of(tgid) {
        Some(s) => &mut s.peak,
        None => match PEAKS.get_ptr_mut(&tgid) {
            // SAFETY: map value pointer, valid for the program's run.
            Some(p) => unsafe { &mut *p },
            None => return 0,
        },
    };
    // SAFETY: an aligned read of a map value.
    if unsafe { core::ptr::read_volatile(&p.pending) } != 0 {
        // Plain stores: two CPUs' releases at once may move it on twice; a site touched
        // between the two keeps its figures of that moment (a few blocks off the peak).
        p.pending = 0;
        p.seq = p.seq.wrapping_add(1).max(1);
    }
    crate::maps::add(&mut p.live, size.wrapping_neg());
    crate::maps::add(&mut p.blocks, u64::MAX);
    // SAFETY: an aligned read of a map value.
    unsafe { core::ptr::read_volatile(&p.seq) }
}

/// An exec: the new image starts with no live heap and no peak.
#[inline(always)]
pub fn exec(tgid: u32) {
    let _ = PEAKS.remove(&tgid);
}
