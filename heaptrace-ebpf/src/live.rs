//! Live blocks: a slot each where its key's slot is free, else the hash map (LIVE).
//! Why, and the slot states: `heaptrace_common::live`.
//!
//! A slot changes hands only by compare-and-swap, so two programs never fill or empty one slot
//! at once (two CPUs, or a program preempted on a kernel with full preemption); whichever finds
//! it in another state goes to the hash map. Only the free of a block empties its slot, and a
//! block's free cannot overlap its allocation's return: malloc hands the address out again only
//! after free's entry probe has run.
use heaptrace_common::{
    LiveBlock, LiveKey,
    live::{BUSY, EMPTY, LiveSlot, index, state},
};

use crate::maps::{LIVE_SLOTS, cas, exchange, live_slots_mask};

#[inline(always)]
fn slot(state: u64) -> Option<&'static mut LiveSlot> {
    let p = LIVE_SLOTS.get_ptr_mut(index(state, live_slots_mask()))?;
    // SAFETY: map value pointer, valid for the program's run; its fields are written only by
    // the program that moved its state to BUSY.
    Some(unsafe { &mut *p })
}

/// Puts a new block in its slot; false if another key holds it (the caller uses the hash
/// map). A block of the same key there is replaced, as the hash map's update replaces one: the
/// allocator handed the address out again, so its free was not seen.
#[inline(always)]
pub fn insert(key: &LiveKey, block: &LiveBlock) -> bool {
    let st = state(key);
    let Some(s) = slot(st) else {
        return false;
    };
    // A plain read first: a taken slot costs no locked instruction.
    // SAFETY: an aligned read of a map value.
    let was = unsafe { core::ptr::read_volatile(&s.state) };
    if (was != EMPTY && was != st) || !cas(&mut s.state, was, BUSY) {
        return false;
    }
    if was == st && s.key != *key {
        exchange(&mut s.state, st); // another key of the same state (never seen): left as it was
        return false;
    }
    s.key = *key;
    s.block = *block;
    exchange(&mut s.state, st);
    true
}

/// Takes a block out of its slot; None if it is not there (the caller looks in the hash map).
#[inline(always)]
pub fn take(key: &LiveKey) -> Option<LiveBlock> {
    let st = state(key);
    let s = slot(st)?;
    // SAFETY: as above.
    if unsafe { core::ptr::read_volatile(&s.state) } != st || !cas(&mut s.state, st, BUSY) {
        return None;
    }
    if s.key != *key {
        // Another key of the same 64-bit state (never seen): its slot, left as it was.
        exchange(&mut s.state, st);
        return None;
    }
    let block = s.block;
    exchange(&mut s.state, EMPTY);
    Some(block)
}
