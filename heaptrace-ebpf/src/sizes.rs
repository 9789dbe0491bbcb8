//! Sizes mode: the size histogram, by size (and site in stacks mode), and the functions'
//! latency histograms.
use heaptrace_common::{Func, Loss, SizeKey, fills, log2_bucket};

use crate::{
    keyed,
    maps::{LATENCY, SIZE_SLOTS, SIZES, get_or_insert, lose, round, size_slots_shift},
    preempt::Count,
};

/// Counts an allocation of `size` bytes: in its slot on this CPU, or in the map.
#[inline(always)]
pub fn count(c: &impl Count, tgid: u32, epoch: u32, func: Func, size: u64, stack_id: i32) {
    let key = SizeKey {
        tgid,
        func: func as u16,
        round: round(),
        size,
        stack_id,
        epoch,
    };
    let n = match keyed::counters(&SIZE_SLOTS, size_slots_shift(), &key) {
        Some(n) => Some(n),
        None => get_or_insert(&SIZES, &key, &0u64, fills::SIZES),
    };
    match n {
        Some(n) => c.add(n, 1),
        None => lose(Loss::SizeHistogram),
    }
}

/// Counts a timed call's latency, `ns`, in its function's histogram.
#[inline(always)]
pub fn latency(c: &impl Count, func: Func, ns: u64) {
    if let Some(h) = LATENCY.get_ptr_mut(func as u32) {
        let b = log2_bucket(ns);
        // SAFETY: map value pointer; b < LOG2_BUCKETS.
        c.add(unsafe { &mut (*h).buckets[b] }, 1);
    }
}
