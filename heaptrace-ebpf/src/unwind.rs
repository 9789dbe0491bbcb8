//! Finding a frame's unwind row: the process's module that holds the address, then the row in
//! its file's table, each by a binary search of a fixed number of steps
//! (`heaptrace_common::unwind`).
//!
//! Branch-free steps: LLVM unrolls them, and the verifier follows one path through them. With a
//! branch a step, it followed every combination (hundreds of thousands of instructions).
use aya_ebpf::helpers::bpf_get_smp_processor_id;
use heaptrace_common::{
    Loss,
    proc_state::{unwind_of, unwind_word},
    unwind::{
        CHUNK_ROWS, CHUNK_SHIFT, MAX_MODULES, MODULE_NO_ROOM, MODULE_PENDING, MODULE_STEPS, Module,
        ProcModules, ROW_STEPS, RULE_FRAME_POINTER, RULE_NO_ROOM, RULE_PENDING, Row, cached_rule,
        rule_index, rule_tag, rule_word,
    },
};

use crate::maps::{UNWIND_CACHE, UNWIND_CHUNKS, UNWIND_PROCS, slot_cpus, unwind_on};

/// What a walk needs of its process's unwind entry: which one it is and whether it has any
/// modules. The entry itself is looked up only where the rule cache has no rule (`rule`).
#[derive(Clone, Copy)]
pub struct Entry {
    pub tgid: u32,
    /// `ProcModules::version`, its rule cache tags' (`rule_tag`).
    pub version: u32,
    /// `ProcModules::count`: 0, no tables (or none for this process).
    pub count: u32,
}

/// The process's entry, where tables are on and it has one, from its slot's word
/// (`proc_state.rs`) or else from the map; else an entry of no modules. The flag: 1 where
/// tables are on and user space has written no entry for the process yet (its walk goes by
/// frame pointer only: `Loss::UnwindLate`).
#[inline(always)]
pub fn modules(tgid: u32) -> (Entry, u64) {
    let none = Entry {
        tgid,
        version: 0,
        count: 0,
    };
    if !unwind_on() {
        return (none, 0);
    }
    if let Some(s) = crate::proc_state::of(tgid) {
        // SAFETY: an aligned read of a map value, written whole.
        let word = unsafe { core::ptr::read_volatile(&s.unwind) };
        if let Some((version, count)) = unwind_of(word, tgid) {
            return (
                Entry {
                    tgid,
                    version,
                    count,
                },
                0,
            );
        }
    }
    // SAFETY: a map value, read only; user space replaces a process's entry whole.
    match unsafe { UNWIND_PROCS.get(&tgid) } {
        Some(pm) => (
            Entry {
                tgid,
                version: pm.version,
                count: pm.count,
            },
            0,
        ),
        // Each frame's file found by its mapping; late only where one has no rows loaded.
        None if crate::vma::on() => (
            Entry {
                count: BY_VMA,
                ..none
            },
            0,
        ),
        None => (none, 1),
    }
}

/// `Entry::count` of a process with no entry whose frames' files are found by their mappings
/// (`vma.rs`, [`rule_by_mapping`]).
pub const BY_VMA: u32 = u32::MAX;

/// A process forked `child`: its address space is a copy of the parent's, so the parent's
/// entry serves it from its first call, until user space writes its own (at its first read of
/// the child's mappings) or it execs. Where the parent has none, an entry left under the
/// child's pid by an earlier process goes. Returns the child's unwind word (`proc_state.rs`).
#[inline(always)]
pub fn inherit(parent: u32, child: u32) -> u64 {
    if !unwind_on() {
        return 0;
    }
    // SAFETY: a map value, passed as the new value: the helper copies it.
    match unsafe { UNWIND_PROCS.get(&parent) } {
        Some(pm) => {
            let _ = UNWIND_PROCS.insert(&child, pm, 0);
            unwind_word(child, pm.version, pm.count)
        }
        None => {
            let _ = UNWIND_PROCS.remove(&child);
            0
        }
    }
}

/// The process exec'ed: its entry described the image before, whose rows would misread the
/// new one's frames. Its new entry comes with user space's next read of its mappings.
#[inline(always)]
pub fn exec(tgid: u32) {
    if unwind_on() {
        if let Some(s) = crate::proc_state::of(tgid) {
            s.unwind = 0;
        }
        let _ = UNWIND_PROCS.remove(&tgid);
    }
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
        let r = table_row(base + half)?;
        base += half * at_most(u64::from(r.pc), rel);
        len -= half;
    }
    let r = table_row(base)?;
    (u64::from(r.pc) <= rel).then_some(*r)
}

/// Row `i` of the tables: in chunk `i >> CHUNK_SHIFT`.
#[inline(always)]
fn table_row(i: u64) -> Option<&'static Row> {
    let i = i as u32;
    UNWIND_CHUNKS.get_value(i >> CHUNK_SHIFT, &(i & (CHUNK_ROWS - 1)))
}

/// How to unwind the frame whose call is at `pc`: its row, or [`RULE_FRAME_POINTER`] (with
/// [`RULE_NO_ROOM`]) where its module has no rows or it is in none. Err: a module with rows
/// but none for `pc` (a `Loss` index). From the rule cache where it holds it
/// (`heaptrace_common::unwind::RULE_CACHE_SHIFT`).
#[inline(always)]
pub fn rule(e: &Entry, pc: u64) -> Result<Row, u64> {
    let walked = Row {
        kind: RULE_FRAME_POINTER,
        ..Row::default()
    };
    if e.count == 0 {
        return Ok(walked); // no tables (or none for this process): nothing to search
    }
    let tag = rule_tag(pc, e.version);
    let entry = cache_entry(tag);
    if let Some(c) = entry {
        let c = c.cast::<u64>();
        // SAFETY: aligned reads of a map value.
        let words = unsafe {
            [
                core::ptr::read_volatile(c),
                core::ptr::read_volatile(c.add(1)),
            ]
        };
        if let Some(r) = cached_rule(&words, tag) {
            return Ok(r);
        }
    }
    // The entry itself: replaced since (or gone) where its version is not the walk's, whose
    // rules are then not cached under the walk's tags.
    // SAFETY: a map value, read only; user space replaces a process's entry whole.
    // Gone (an exec since): its frames are walked by frame pointer. One map's value either
    // way, so that the verifier follows the searches once.
    let Some(pm) = (unsafe { UNWIND_PROCS.get(&e.tgid) }) else {
        return Ok(walked);
    };
    let found = match module(pm, pc) {
        Some(m) if m.rows != 0 => row(m, pc).ok_or(Loss::UnwindNoRule as u64)?,
        Some(m) if m.flags & MODULE_NO_ROOM != 0 => Row {
            kind: RULE_FRAME_POINTER | RULE_NO_ROOM,
            ..Row::default()
        },
        Some(m) if m.flags & MODULE_PENDING != 0 => Row {
            kind: RULE_FRAME_POINTER | RULE_PENDING,
            ..Row::default()
        },
        _ => walked,
    };
    if let Some(c) = entry
        && pm.version == e.version
    {
        let c = c.cast::<u64>();
        // SAFETY: aligned stores to a map value; see `cached_rule` for a program preempted
        // between the two by another on this CPU.
        unsafe {
            core::ptr::write_volatile(c, tag);
            core::ptr::write_volatile(c.add(1), rule_word(tag, &found));
        }
    }
    Ok(found)
}

/// [`rule`] for a process with no entry ([`BY_VMA`]): the frame's file found by its mapping,
/// and its rows where user space loaded them; else by frame pointer, counted late. Walked by
/// a loop of its own (`stacks::step_by_mapping`): in `rule`'s, the verifier followed every
/// path of the rest of the frame twice.
/// `last`: the module of the frame before, kept for the next (most frames of a walk are in
/// one or two files; a mapping's lookup costs more than the rest of the frame).
#[inline(always)]
pub fn rule_by_mapping(pc: u64, last: &mut Module) -> Result<Row, u64> {
    let found = if last.start <= pc && pc < last.end {
        Some(*last)
    } else {
        crate::vma::module(pc).inspect(|m| *last = *m)
    };
    match found {
        Some(m) if m.rows != 0 => row(&m, pc).ok_or(Loss::UnwindNoRule as u64),
        Some(_) => Ok(Row {
            kind: RULE_FRAME_POINTER,
            ..Row::default()
        }),
        None => Ok(Row {
            kind: RULE_FRAME_POINTER | RULE_PENDING,
            ..Row::default()
        }),
    }
}

/// `tag`'s entry in this CPU's row of the rule cache (None where the cache is off).
#[inline(always)]
fn cache_entry(tag: u64) -> Option<*mut [u64; 2]> {
    // SAFETY: no preconditions (the verifier inlines it).
    let cpu = unsafe { bpf_get_smp_processor_id() };
    if cpu >= slot_cpus() {
        return None;
    }
    // A map value pointer, valid for the program's run.
    UNWIND_CACHE.get_ptr_mut(rule_index(cpu, tag))
}
