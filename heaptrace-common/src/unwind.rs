//! Unwind tables for code without frame pointers: compact rows built in user space from a
//! file's `.eh_frame`, stored once per file, and each traced process's code mappings pointing
//! at them. The return program looks a frame's module up, then its row (`heaptrace-ebpf`'s
//! `stacks.rs`); docs/unwinding.md has the design.

/// What a row says of the frame at the addresses it covers.
pub mod kind {
    /// No rule heaptrace can follow (a DWARF expression, a register other than rsp/rbp,
    /// addresses no FDE covers): the stack is cut there, and counted.
    pub const NONE: u8 = 0;
    /// CFA = rsp + 8 * `cfa`.
    pub const RSP: u8 = 1;
    /// CFA = rbp + 8 * `cfa`.
    pub const RBP: u8 = 2;
    /// The outermost frame (the return address is undefined: `_start`, a thread's start in
    /// `clone3`): the stack ends here, whole.
    pub const END: u8 = 3;
}

/// From `pc` (the file's virtual address, less nothing: the module's bias is added at run
/// time) to the next row's: how to find the caller's frame.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Row {
    pub pc: u32,
    /// The CFA's offset from its register, in words (CFA offsets are multiples of 8).
    pub cfa: u16,
    /// [`kind`].
    pub kind: u8,
    /// 0: rbp is unchanged in the caller; k: the caller's rbp is saved at CFA - 8k.
    pub rbp: u8,
}

const _: () = assert!(core::mem::size_of::<Row>() == 8);

/// The most code mappings of a process that get unwind tables; the others walk by frame
/// pointer (and count in `Loss::UnwindTable`).
pub const MAX_MODULES: usize = 64;

/// Module flags.
pub const MODULE_NO_ROOM: u32 = 1;

/// A code mapping of a process: its addresses, the bias that turns them into the file's
/// virtual addresses, and its file's rows in `UNWIND_ROWS` (none: a frame-pointer walk).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Module {
    pub start: u64,
    pub end: u64,
    /// Run-time address less file virtual address.
    pub bias: u64,
    /// The file's first row in `UNWIND_ROWS`.
    pub first: u32,
    /// Its rows; 0: walk by frame pointer (built with frame pointers, no unwind information,
    /// or [`MODULE_NO_ROOM`]).
    pub rows: u32,
    /// [`MODULE_NO_ROOM`].
    pub flags: u32,
    pub _pad: u32,
}

const _: () = assert!(core::mem::size_of::<Module>() == 40);

/// A process's code mappings that have a table or are flagged, sorted by address.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ProcModules {
    pub count: u32,
    pub _pad: u32,
    pub modules: [Module; MAX_MODULES],
}

impl Default for ProcModules {
    fn default() -> Self {
        ProcModules {
            count: 0,
            _pad: 0,
            modules: [Module::default(); MAX_MODULES],
        }
    }
}

/// Steps of the binary search for a module (2^6 = MAX_MODULES) and for a row (2^24 rows in
/// a file at most).
pub const MODULE_STEPS: u32 = 6;
pub const ROW_STEPS: u32 = 24;
/// The most rows a file may have.
pub const MAX_FILE_ROWS: u32 = 1 << ROW_STEPS;

const _: () = assert!(1 << MODULE_STEPS == MAX_MODULES);
