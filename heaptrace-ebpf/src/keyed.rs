//! Site and size counters in slots, a row per CPU, before their per-CPU hash maps. Why, and the
//! slot states: `heaptrace_common::keyed`.
//!
//! A slot changes hands only by compare-and-swap, so two programs never fill one slot at once
//! (a program preempted on a kernel with full preemption); whichever finds it busy goes to the
//! hash map. Its counters are written only by programs on its CPU, with atomic adds.
use aya_ebpf::{helpers::bpf_get_smp_processor_id, maps::Array};
use heaptrace_common::keyed::{BUSY, EMPTY, Slot, SlotKey, index};

use crate::maps::{cas, exchange, slot_cpus};

/// `key`'s counters in its slot on this CPU, taken if the slot is empty; None if another key
/// holds it (or it is busy, or the tables are off): the caller uses the hash map.
#[inline(always)]
pub fn counters<K: SlotKey, V>(
    table: &Array<Slot<K, V>>,
    shift: u32,
    key: &K,
) -> Option<&'static mut V> {
    // SAFETY: no preconditions (the verifier inlines it).
    let cpu = unsafe { bpf_get_smp_processor_id() };
    if cpu >= slot_cpus() {
        return None;
    }
    let st = key.state();
    let s = table.get_ptr_mut(index(cpu, st, shift))?;
    // SAFETY: map value pointer, valid for the program's run; its key is written only by the
    // program that moved its state from EMPTY to BUSY.
    let s = unsafe { &mut *s };
    // SAFETY: an aligned read of a map value.
    let was = unsafe { core::ptr::read_volatile(&s.state) };
    if was == st {
        // Another key of the same 64-bit state (never seen) keeps the slot.
        return if s.key == *key {
            Some(&mut s.value)
        } else {
            None
        };
    }
    if was != EMPTY || !cas(&mut s.state, EMPTY, BUSY) {
        return None;
    }
    // An empty slot's counters are zero (user space empties a slot before it frees it).
    s.key = *key;
    exchange(&mut s.state, st);
    Some(&mut s.value)
}
