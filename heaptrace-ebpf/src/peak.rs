//! The true peak: each process's live heap kept at every tracked allocation and release, and
//! the highest it reached, taken at the allocation that reached it (not at a round's end).
//!
//! One counter a process for all CPUs: a peak is a maximum of a sum, which per-CPU counters
//! cannot give without summing them at each call. An atomic add on a line the process's CPUs
//! share, and a hash lookup, each allocation and release: BENCHMARKS.md, *The true peak*.
use aya_ebpf::{macros::map, maps::HashMap};
use heaptrace_common::{Loss, ProcPeak};

use crate::maps::{BPF_NOEXIST, lose};

/// By tgid. Preallocated, as SITES: the loader sizes it as the process map.
#[map]
pub static PEAKS: HashMap<u32, ProcPeak> = HashMap::with_max_entries(4096, 0);

/// Never written: what a new entry starts from (see `maps::PROC_ZERO`).
static mut PEAK_ZERO: ProcPeak = ProcPeak::ZERO;

#[inline(always)]
fn entry(tgid: u32) -> Option<&'static mut ProcPeak> {
    if let Some(p) = PEAKS.get_ptr_mut(&tgid) {
        // SAFETY: map value pointer, valid for the program's run.
        return Some(unsafe { &mut *p });
    }
    // SAFETY: a value nothing writes.
    let _ = PEAKS.insert(&tgid, unsafe { &*(&raw const PEAK_ZERO) }, BPF_NOEXIST);
    // SAFETY: as above.
    PEAKS.get_ptr_mut(&tgid).map(|p| unsafe { &mut *p })
}

/// A block of `size` bytes became live in `tgid`'s image `epoch`, from stack `stack_id`.
#[inline(always)]
pub fn grew(tgid: u32, epoch: u32, size: u64, stack_id: i32) {
    let Some(p) = entry(tgid) else {
        lose(Loss::ProcessMap);
        return;
    };
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
        p.max = now;
        p.max_size = size;
        p.max_stack = stack_id;
        p.epoch = epoch;
    }
}

/// A block of `size` bytes of `tgid` was released.
#[inline(always)]
pub fn shrank(tgid: u32, size: u64) {
    if let Some(p) = PEAKS.get_ptr_mut(&tgid) {
        // SAFETY: map value pointer, valid for the program's run.
        crate::maps::add(unsafe { &mut (*p).live }, size.wrapping_neg());
    }
}

/// An exec: the new image starts with no live heap and no peak.
#[inline(always)]
pub fn exec(tgid: u32) {
    let _ = PEAKS.remove(&tgid);
}
