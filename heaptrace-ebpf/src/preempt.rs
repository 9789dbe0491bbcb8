//! Counting on this CPU with preemption off: plain adds instead of atomic ones.
//!
//! Every counter a program adds to is its CPU's own (per-CPU maps, a row of slots per CPU),
//! and the program cannot move to another CPU, but it can be preempted (PREEMPT_DYNAMIC): a
//! plain read-modify-write interrupted there by the same program in another task loses that
//! task's update. So counters took atomic adds, a locked instruction each: about 15 a
//! malloc+free pair in stacks mode. Plain, a pair costs 36 ns less program time and 20-30 ns
//! less wall time here (BENCHMARKS.md, *Counting with preemption off*).
//!
//! A [`PreemptOff`] turns preemption off (the kernel's `bpf_preempt_disable` kfunc, Linux
//! 6.10+) for its lifetime, and its adds are plain. Adds made elsewhere stay atomic, and the
//! two mix safely: an atomic add is one instruction, and nothing runs on the CPU in the middle
//! of a plain one while preemption is off. Where the kernel lacks the kfuncs, the loader sets
//! PREEMPT_OFF to 0: the calls are no-ops and [`PreemptOff::add`] is atomic. The verifier knows the
//! global's value (a frozen read-only map) and follows only the branch taken.
use heaptrace_common::preempt::{PREEMPT_DISABLE, PREEMPT_ENABLE};

/// See `heaptrace_common::globals::PREEMPT_OFF`.
#[unsafe(no_mangle)]
static PREEMPT_OFF: u32 = 0;

#[inline(always)]
fn preempt_off() -> bool {
    // SAFETY: a plain read of a global the loader wrote before load.
    unsafe { core::ptr::read_volatile(&PREEMPT_OFF) != 0 }
}

/// A call of helper number `id`, which the loader rewrites (`heaptrace_common::preempt`).
#[inline(always)]
fn placeholder(id: i32) {
    // SAFETY: no kernel runs this call as written: the loader makes it a kfunc call (no
    // arguments, no result) or a no-op.
    unsafe {
        let f: unsafe extern "C" fn() = core::mem::transmute(id as usize);
        f()
    }
}

/// Adding to this CPU's counters.
pub trait Count {
    fn add(&self, counter: &mut u64, v: u64);
    fn add32(&self, counter: &mut u32, v: u32);
}

/// Atomic adds, wherever preemption may be on.
pub struct Atomic;

impl Count for Atomic {
    #[inline(always)]
    fn add(&self, counter: &mut u64, v: u64) {
        crate::maps::add(counter, v);
    }

    #[inline(always)]
    fn add32(&self, counter: &mut u32, v: u32) {
        crate::maps::add32(counter, v);
    }
}

/// Preemption off while it lives (where PREEMPT_OFF), and plain adds.
pub struct PreemptOff(());

impl PreemptOff {
    #[inline(always)]
    pub fn take() -> PreemptOff {
        if preempt_off() {
            placeholder(PREEMPT_DISABLE);
        }
        PreemptOff(())
    }
}

impl Count for PreemptOff {
    #[inline(always)]
    fn add(&self, counter: &mut u64, v: u64) {
        // The global is read again at each decision, never kept: the verifier then knows its
        // value at every branch, and sees preemption turned back on on every path.
        if preempt_off() {
            *counter = counter.wrapping_add(v);
        } else {
            crate::maps::add(counter, v);
        }
    }

    #[inline(always)]
    fn add32(&self, counter: &mut u32, v: u32) {
        if preempt_off() {
            *counter = counter.wrapping_add(v);
        } else {
            crate::maps::add32(counter, v);
        }
    }
}

impl Drop for PreemptOff {
    #[inline(always)]
    fn drop(&mut self) {
        if preempt_off() {
            placeholder(PREEMPT_ENABLE);
        }
    }
}
