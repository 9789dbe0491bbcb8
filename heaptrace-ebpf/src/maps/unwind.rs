//! The unwind tables' maps and the stack walk's state (`stacks.rs`, `unwind.rs`).
use aya_ebpf::{
    btf_maps::{Array as BtfArray, ArrayOfMaps},
    macros::{btf_map, map},
    maps::{Array, HashMap, PerCpuArray},
};
use heaptrace_common::unwind::{CHUNK_ROWS, MAX_CHUNKS, Module, ProcModules, Row};

use super::{BPF_F_MMAPABLE, BPF_F_NO_PREALLOC};

/// 1: unwind tables are loaded (`UNWIND_CHUNKS`, `UNWIND_PROCS`); see
/// `heaptrace_common::globals::UNWIND`.
#[unsafe(no_mangle)]
static UNWIND: u32 = 0;

#[inline(always)]
pub fn unwind_on() -> bool {
    // SAFETY: a plain read of a global the loader wrote before load.
    unsafe { core::ptr::read_volatile(&UNWIND) != 0 }
}

/// Every file's unwind rows (`heaptrace_common::unwind::Row`), each file's together, in
/// chunks of `CHUNK_ROWS` rows that user space creates as the rows need them, and writes in
/// place (mappable) before a process's modules point at them.
#[btf_map]
pub static UNWIND_CHUNKS: ArrayOfMaps<
    BtfArray<Row, { CHUNK_ROWS as usize }, { BPF_F_MMAPABLE as usize }>,
    { MAX_CHUNKS as usize },
> = ArrayOfMaps::new();

/// Each traced process's code mappings with their files' rows, by tgid.
#[map(name = "UNWIND_PROCS")]
pub static UNWIND_PROCS: HashMap<u32, ProcModules> =
    HashMap::with_max_entries(1, BPF_F_NO_PREALLOC);

/// The rules of frames walked before, a row per CPU (`heaptrace_common::unwind::rule_tag`).
#[map(name = "UNWIND_CACHE")]
pub static UNWIND_CACHE: Array<[u64; 2]> = Array::with_max_entries(1, 0);

/// A stack walk's state between its frames (`stacks::walk`).
#[repr(C)]
pub struct WalkState {
    pub pc: u64,
    pub sp: u64,
    pub fp: u64,
    pub hash: u64,
    /// Frames taken.
    pub n: u64,
    /// Where the chunk was read from (1: not yet), its bytes, and the reads into it.
    pub base: u64,
    pub len: u64,
    pub reads: u64,
    /// Why the walk stopped, where that is a loss (a `Loss` index), else 0.
    pub cut: u64,
    /// Bit 0: a frame was in a module whose table did not fit; bit 1: in one whose table was
    /// not loaded yet.
    pub no_room: u64,
    /// A walk by mapping (`vma.rs`): the last module found, for the next frames in the same
    /// file (`end` 0: none yet).
    pub last: Module,
}

#[map(name = "WALK")]
pub static WALK: PerCpuArray<WalkState> = PerCpuArray::with_max_entries(1, 0);
