//! A thread's in-flight record: in the slot it owns (`heaptrace_common::InFlightSlot`), or in
//! the hash map (INFLIGHT) where another thread owns its slot.
//!
//! A thread takes a slot only while it has no record in the map, so its record is in one
//! place at a time: a call in flight never loses its window to a slot taken in a nested call.
use heaptrace_common::{InFlight, InFlightSlot};

use crate::maps::{INFLIGHT, INFLIGHT_SLOTS, cas, exchange, inflight_slots_mask};

#[inline(always)]
fn slot(id: u64) -> Option<&'static mut InFlightSlot> {
    let p = INFLIGHT_SLOTS.get_ptr_mut(id as u32 & inflight_slots_mask())?;
    // SAFETY: map value pointer, valid for the program's run; its record is read and written
    // only by the thread that owns the slot.
    Some(unsafe { &mut *p })
}

/// This thread's record (`id`: its pid_tgid), if it has one.
#[inline(always)]
pub fn get(id: u64) -> Option<&'static mut InFlight> {
    if let Some(s) = slot(id) {
        // SAFETY: an aligned read of a map value.
        if unsafe { core::ptr::read_volatile(&s.owner) } == id {
            return Some(&mut s.rec);
        }
    }
    // SAFETY: map value pointer; only this thread reads or writes its own entry.
    INFLIGHT.get_ptr_mut(id).map(|p| unsafe { &mut *p })
}

/// Takes this thread's slot, if free, with `rec` in it; false if another thread owns it. Call
/// only for a thread with no record (`get` found none).
#[inline(always)]
pub fn claim(id: u64, rec: &InFlight) -> bool {
    let Some(s) = slot(id) else {
        return false;
    };
    // A plain read first: an owned slot costs no locked instruction.
    // SAFETY: an aligned read of a map value.
    let won = unsafe { core::ptr::read_volatile(&s.owner) } == 0 && cas(&mut s.owner, 0, id);
    if won {
        s.rec = *rec;
    }
    won
}

/// Gives up this thread's slot and record: it is exiting.
#[inline(always)]
pub fn release(id: u64) {
    if let Some(s) = slot(id) {
        // SAFETY: as above.
        if unsafe { core::ptr::read_volatile(&s.owner) } == id {
            // The record stays: whoever claims the slot next writes a whole one.
            exchange(&mut s.owner, 0); // only the owner frees its slot
        }
    }
    // Most exiting threads on the host have no record: the delete then just fails.
    let _ = INFLIGHT.remove(&id);
}
