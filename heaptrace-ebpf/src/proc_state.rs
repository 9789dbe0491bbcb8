//! Processes' shared state in slots before the hash maps PEAKS and UNWIND_PROCS: why, and
//! when a slot is claimed, in `heaptrace_common::proc_state`.
use aya_ebpf::{macros::map, maps::Array};
use heaptrace_common::{
    ProcPeak,
    proc_state::{FREE, ProcState},
};

use crate::maps::{BPF_F_MMAPABLE, cas};

/// Mappable: user space reads the peaks, writes the unwind words and frees the slots.
#[map(name = "PROC_STATE")]
pub static PROC_STATE: Array<ProcState> = Array::with_max_entries(1, BPF_F_MMAPABLE);

/// See `heaptrace_common::globals::PROC_STATE_MASK`.
#[unsafe(no_mangle)]
static PROC_STATE_MASK: u32 = 0;

/// `tgid`'s slot, where it owns one.
#[inline(always)]
pub fn of(tgid: u32) -> Option<&'static mut ProcState> {
    // SAFETY: a plain read of a global the loader wrote before load.
    let mask = unsafe { core::ptr::read_volatile(&PROC_STATE_MASK) };
    let s = PROC_STATE.get_ptr_mut(tgid & mask)?;
    // SAFETY: map value pointer, valid for the program's run.
    let s = unsafe { &mut *s };
    // SAFETY: an aligned read of a map value.
    (unsafe { core::ptr::read_volatile(&s.owner) } == u64::from(tgid)).then_some(s)
}

/// Gives `tgid` its slot where it is free (or its own already), starting from no peak and
/// the unwind word `unwind`. Only where no other thread of the process counts: at an exec, or
/// at a fork before the child runs (see `heaptrace_common::proc_state`).
#[inline(always)]
pub fn claim(tgid: u32, unwind: u64) {
    // SAFETY: as in `of`.
    let mask = unsafe { core::ptr::read_volatile(&PROC_STATE_MASK) };
    let Some(s) = PROC_STATE.get_ptr_mut(tgid & mask) else {
        return;
    };
    // SAFETY: as in `of`.
    let s = unsafe { &mut *s };
    // SAFETY: an aligned read of a map value.
    let owner = unsafe { core::ptr::read_volatile(&s.owner) };
    if owner != u64::from(tgid) && (owner != FREE || !cas(&mut s.owner, FREE, u64::from(tgid))) {
        return; // another's: this process keeps its peak in the map
    }
    let p = &mut s.peak;
    let zero = ProcPeak::ZERO;
    p.live = 0;
    p.max = 0;
    p.max_size = 0;
    p.max_stack = zero.max_stack;
    p.epoch = 0;
    p.seq = 0;
    p.pending = 0;
    p.blocks = 0;
    p.max_blocks = 0;
    s.unwind = unwind;
    // An entry an earlier process of this tgid left: the slot holds its peak from now on.
    let _ = crate::peak::PEAKS.remove(&tgid);
}
