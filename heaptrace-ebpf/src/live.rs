//! Live blocks: a slot each where its key's slot is free, else the hash map (LIVE).
//! Why, and the slot states: `heaptrace_common::live`.
//!
//! A slot changes hands only by compare-and-swap, so two programs never fill or empty one slot
//! at once (two CPUs, or a program preempted on a kernel with full preemption); whichever finds
//! it in another state goes to the hash map. Only the free of a block empties its slot, and a
//! block's free cannot overlap its allocation's return: malloc hands the address out again only
//! after free's entry probe has run.
use core::intrinsics::{AtomicOrdering, atomic_cxchg, atomic_xchg};

use heaptrace_common::{
    LiveBlock, LiveKey,
    live::{BUSY, EMPTY, LiveSlot, index, state},
};

use crate::maps::{LIVE_SLOTS, live_slots_mask};

#[inline(always)]
fn slot(state: u64) -> Option<&'static mut LiveSlot> {
    let p = LIVE_SLOTS.get_ptr_mut(index(state, live_slots_mask()))?;
    // SAFETY: map value pointer, valid for the program's run; its fields are written only by
    // the program that moved its state to BUSY.
    Some(unsafe { &mut *p })
}

/// Compare-and-swap of a slot's state; true if it was `old` and is now `new`.
#[inline(always)]
fn swap_state(s: &mut LiveSlot, old: u64, new: u64) -> bool {
    // SAFETY: an aligned u64 of a map value.
    unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
            &mut s.state,
            old,
            new,
        )
    }
    .1
}

/// Sets a slot's state after its fields were written or read: an atomic exchange, which orders
/// those accesses before it.
#[inline(always)]
fn set_state(s: &mut LiveSlot, new: u64) {
    // SAFETY: as above.
    unsafe { atomic_xchg::<u64, { AtomicOrdering::SeqCst }>(&mut s.state, new) };
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
    if (was != EMPTY && was != st) || !swap_state(s, was, BUSY) {
        return false;
    }
    if was == st && s.key != *key {
        set_state(s, st); // another key of the same state (never seen): left as it was
        return false;
    }
    s.key = *key;
    s.block = *block;
    set_state(s, st);
    true
}

/// Takes a block out of its slot; None if it is not there (the caller looks in the hash map).
#[inline(always)]
pub fn take(key: &LiveKey) -> Option<LiveBlock> {
    let st = state(key);
    let s = slot(st)?;
    // SAFETY: as above.
    if unsafe { core::ptr::read_volatile(&s.state) } != st || !swap_state(s, st, BUSY) {
        return None;
    }
    if s.key != *key {
        // Another key of the same 64-bit state (never seen): its slot, left as it was.
        set_state(s, st);
        return None;
    }
    let block = s.block;
    set_state(s, EMPTY);
    Some(block)
}
