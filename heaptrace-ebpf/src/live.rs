//! Live blocks: a slot each where its key's slot is free, else the hash map (LIVE).
//! Why, and the slot states: `heaptrace_common::live`.
//!
//! A slot changes hands only by compare-and-swap, so two programs never fill or empty one slot
//! at once (two CPUs, or a program preempted on a kernel with full preemption); whichever finds
//! it in another state goes to the hash map. Only the free of a block empties its slot, and a
//! block's free cannot overlap its allocation's return: malloc hands the address out again only
//! after free's entry probe has run.
//!
//! The owner hands a slot back with a plain store of its state (`publish`), not a locked
//! exchange (~7 ns each, two a malloc+free pair): on x86-64, the only architecture heaptrace
//! probes, a store is never seen before the loads and stores ahead of it (TSO), and the
//! fields' accesses are volatile, so the compiler keeps them ahead of it too. User space reads
//! a slot's state before and after its fields (`heaptrace::liveslots`).
use heaptrace_common::{
    LiveBlock, LiveKey,
    live::{BUSY, EMPTY, LiveSlot, index, state},
};

use crate::maps::{LIVE_SLOTS, cas, live_slots_mask};

#[inline(always)]
fn slot(key: &LiveKey) -> Option<&'static mut LiveSlot> {
    let p = LIVE_SLOTS.get_ptr_mut(index(key, live_slots_mask()))?;
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
    let Some(s) = slot(key) else {
        return false;
    };
    // A plain read first: a taken slot costs no locked instruction.
    // SAFETY: an aligned read of a map value.
    let was = unsafe { core::ptr::read_volatile(&s.state) };
    if (was != EMPTY && was != st) || !cas(&mut s.state, was, BUSY) {
        return false;
    }
    // SAFETY: aligned accesses of a map value this program owns while it is BUSY.
    unsafe {
        if was == st && core::ptr::read_volatile(&s.key) != *key {
            publish(&mut s.state, st); // another key of the same state (never seen): as it was
            return false;
        }
        core::ptr::write_volatile(&mut s.key, *key);
        core::ptr::write_volatile(&mut s.block, *block);
    }
    publish(&mut s.state, st);
    true
}

/// Takes a block out of its slot; None if it is not there (the caller looks in the hash map).
#[inline(always)]
pub fn take(key: &LiveKey) -> Option<LiveBlock> {
    let st = state(key);
    let s = slot(key)?;
    // SAFETY: as above.
    if unsafe { core::ptr::read_volatile(&s.state) } != st || !cas(&mut s.state, st, BUSY) {
        return None;
    }
    // SAFETY: as in `insert`.
    let (held, block) = unsafe {
        (
            core::ptr::read_volatile(&s.key),
            core::ptr::read_volatile(&s.block),
        )
    };
    if held != *key {
        // Another key of the same 64-bit state (never seen): its slot, left as it was.
        publish(&mut s.state, st);
        return None;
    }
    publish(&mut s.state, EMPTY);
    Some(block)
}

/// A slot's new state, after its fields were written or read (see the module's comment).
#[inline(always)]
fn publish(state: &mut u64, new: u64) {
    // SAFETY: an aligned store to a map value this program owns while it is BUSY.
    unsafe { core::ptr::write_volatile(state, new) };
}
