//! Finding a frame's unwind row: the process's module that holds the address, then the row in
//! its file's table, each by a binary search of a fixed number of steps
//! (`heaptrace_common::unwind`).
//!
//! Branch-free steps: LLVM unrolls them, and the verifier follows one path through them. With a
//! branch a step, it followed every combination (hundreds of thousands of instructions).
use heaptrace_common::unwind::{MAX_MODULES, MODULE_STEPS, Module, ProcModules, ROW_STEPS, Row};

use crate::maps::{NO_MODULES, UNWIND_PROCS, UNWIND_ROWS, unwind_on};

/// The process's modules, where tables are on and it has any; else none (an empty list).
/// Never None in practice: an empty list rather than an Option, because LLVM computed the
/// address of an optional entry's fields before its null check, which the verifier refuses.
#[inline(always)]
pub fn modules(tgid: u32) -> Option<&'static ProcModules> {
    if unwind_on() {
        // SAFETY: a map value, read only; user space replaces a process's entry whole.
        if let Some(pm) = unsafe { UNWIND_PROCS.get(&tgid) } {
            return Some(pm);
        }
    }
    NO_MODULES.get(0)
}

/// 1 where `a <= b`, else 0, for values below 2^63, without a branch: the sign of b - a,
/// through `black_box` so that LLVM does not turn it back into a comparison (a branch on BPF).
#[inline(always)]
fn at_most(a: u64, b: u64) -> u64 {
    1 - (core::hint::black_box(b.wrapping_sub(a)) >> 63)
}

/// The module that holds `pc`.
#[inline(always)]
pub fn module(pm: &ProcModules, pc: u64) -> Option<&Module> {
    let count = u64::from(pm.count).min(MAX_MODULES as u64);
    if count == 0 || pc >= 1 << 63 {
        return None;
    }
    // The last entry with start <= pc is in [base, base + len).
    let (mut base, mut len) = (0u64, count);
    for _ in 0..MODULE_STEPS {
        if len <= 1 {
            break;
        }
        let half = len / 2;
        let m = pm.modules.get((base + half) as usize)?;
        base += half * at_most(m.start, pc);
        len -= half;
    }
    let m = pm.modules.get(base as usize)?;
    (m.start <= pc && pc < m.end).then_some(m)
}

/// The row of `module`'s table that holds `pc`.
#[inline(always)]
pub fn row(m: &Module, pc: u64) -> Option<Row> {
    let rel = pc.wrapping_sub(m.bias);
    if rel > u64::from(u32::MAX) || m.rows == 0 {
        return None;
    }
    // The last row with pc <= rel is in [base, base + len).
    let (mut base, mut len) = (u64::from(m.first), u64::from(m.rows));
    for _ in 0..ROW_STEPS {
        // Done: a small table takes a few steps. An exit, not a fork: the verifier follows
        // each step's exit once.
        if len <= 1 {
            break;
        }
        let half = len / 2;
        let r = UNWIND_ROWS.get((base + half) as u32)?;
        base += half * at_most(u64::from(r.pc), rel);
        len -= half;
    }
    let r = UNWIND_ROWS.get(base as u32)?;
    (u64::from(r.pc) <= rel).then_some(*r)
}
