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
    /// A signal trampoline (`__restore_rt`, its FDE marked `S`): the interrupted frame's
    /// registers are in the `ucontext` at the frame's sp (the handler's return popped),
    /// at [`super::SIGNAL_RIP`], [`super::SIGNAL_RSP`] and [`super::SIGNAL_RBP`].
    pub const SIGNAL: u8 = 4;
}

/// Where x86-64 Linux's signal frame keeps the interrupted registers, from the trampoline's
/// sp: `ucontext.uc_mcontext` is 40 bytes in (flags, link, the 24-byte `stack_t`), and its
/// registers run r8..r15, rdi, rsi, rbp (10), rbx, rdx, rax, rcx, rsp (15), rip (16).
pub const SIGNAL_RBP: u64 = 40 + 8 * 10;
pub const SIGNAL_RSP: u64 = 40 + 8 * 15;
pub const SIGNAL_RIP: u64 = 40 + 8 * 16;

/// From `pc` (the file's virtual address, less nothing: the module's bias is added at run
/// time) to the next row's: how to find the caller's frame.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Row {
    pub pc: u32,
    /// The CFA's offset from its register, in words (CFA offsets are multiples of 8): its low
    /// 16 bits ([`Row::cfa_words`]).
    pub cfa: u16,
    /// [`kind`] in [`KIND_BITS`], the CFA offset's high bits in [`CFA_HIGH_BITS`], and
    /// `RULE_*` flags where it is a cached frame-pointer rule.
    pub kind: u8,
    /// 0: rbp is unchanged in the caller; k: the caller's rbp is saved at CFA - 8k.
    pub rbp: u8,
}

const _: () = assert!(core::mem::size_of::<Row>() == 8);

/// The bits of [`Row::kind`] that are its [`kind`].
pub const KIND_BITS: u8 = 0x07;
/// The bits of [`Row::kind`] that hold the CFA's offset past `cfa`'s 16 bits: a frame of up
/// to 2 MiB (rustc's `run_compiler` closures take 527 KiB).
pub const CFA_HIGH_BITS: u8 = 0x18;
const CFA_HIGH_SHIFT: u32 = 3;

impl Row {
    /// A rule of `kind` with the CFA `words` words past its register; None past 2 MiB.
    pub fn new(pc: u32, kind: u8, words: u64, rbp: u8) -> Option<Row> {
        let high = u8::try_from(words >> 16)
            .ok()
            .filter(|h| *h <= CFA_HIGH_BITS >> CFA_HIGH_SHIFT)?;
        Some(Row {
            pc,
            cfa: words as u16,
            kind: kind | high << CFA_HIGH_SHIFT,
            rbp,
        })
    }

    /// Its [`kind`].
    #[inline(always)]
    pub fn rule(&self) -> u8 {
        self.kind & KIND_BITS
    }

    /// The CFA's offset from its register, in words.
    #[inline(always)]
    pub fn cfa_words(&self) -> u64 {
        u64::from(self.cfa) | u64::from((self.kind & CFA_HIGH_BITS) >> CFA_HIGH_SHIFT) << 16
    }
}

/// The rows' index space is cut in chunks of `1 << CHUNK_SHIFT` rows (2 MiB), each an array
/// map created when rows are first written into it: memory as the tables need it, up to
/// `--unwind-table-size`. A row's chunk is its index's high bits, its place in it the low.
pub const CHUNK_SHIFT: u32 = 18;
pub const CHUNK_ROWS: u32 = 1 << CHUNK_SHIFT;
/// Chunks at most: 64 M rows (512 MiB).
pub const MAX_CHUNKS: u32 = 256;

/// The most code mappings of a process that get unwind tables; the others walk by frame
/// pointer (and count in `Loss::UnwindTable`).
pub const MAX_MODULES: usize = 64;

/// Module flags.
pub const MODULE_NO_ROOM: u32 = 1;
/// Its file's table is being read: the entry was written with the files known already first
/// (`Loss::UnwindLate` for walks through it).
pub const MODULE_PENDING: u32 = 2;

/// A code mapping of a process: its addresses, the bias that turns them into the file's
/// virtual addresses, and its file's rows in `UNWIND_CHUNKS` (none: a frame-pointer walk).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Module {
    pub start: u64,
    pub end: u64,
    /// Run-time address less file virtual address.
    pub bias: u64,
    /// The index of the file's first row (across `UNWIND_CHUNKS`, or in the in-process area).
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
    /// A number user space gives each entry it writes, never twice in a run (from 1): the
    /// rule cache's entries name the entry they were found in ([`rule_tag`]).
    pub version: u32,
    pub modules: [Module; MAX_MODULES],
}

impl Default for ProcModules {
    fn default() -> Self {
        ProcModules {
            count: 0,
            version: 0,
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

/// The rule cache: the rule a frame's address was last found to have, so that a frame seen
/// before costs one lookup where the module's and the row's binary searches took some twenty
/// (a libc frame: ~50 ns of program time here; BENCHMARKS.md, *Many live blocks*). A row of
/// `1 << RULE_CACHE_SHIFT` entries per CPU, each two words: the [`rule_tag`] of the address
/// and the process's [`ProcModules::version`], and the tag's high half with the rule
/// ([`rule_word`]). A new version (the process's mappings written again, its files' rows
/// elsewhere) has new tags, so no entry outlives the rows it was read from. The tag's half in
/// both words: an entry half written by one program and half by another (preempted on its
/// CPU) is taken only where the two tags share that half.
pub const RULE_CACHE_SHIFT: u32 = 10;

/// The rule of a frame walked by frame pointer: its module has no rows ([`rule_word`]).
pub const RULE_FRAME_POINTER: u8 = 0x80;
/// With [`RULE_FRAME_POINTER`]: its module's table did not fit ([`MODULE_NO_ROOM`]).
pub const RULE_NO_ROOM: u8 = 0x40;
/// With [`RULE_FRAME_POINTER`]: its module's table was not loaded yet ([`MODULE_PENDING`]).
pub const RULE_PENDING: u8 = 0x20;

/// The tag of address `pc` in modules of `version`: never 0 (an empty entry).
#[inline(always)]
pub fn rule_tag(pc: u64, version: u32) -> u64 {
    let v = u64::from(version).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    crate::keyed::mix(crate::keyed::mix(pc) ^ v)
}

/// The index of `tag`'s entry in `cpu`'s row.
#[inline(always)]
pub fn rule_index(cpu: u32, tag: u64) -> u32 {
    (cpu << RULE_CACHE_SHIFT) | ((tag >> 2) as u32 & ((1 << RULE_CACHE_SHIFT) - 1))
}

/// An entry's second word: the tag's high half, a row's `cfa`, `rbp` and `kind` (or
/// [`RULE_FRAME_POINTER`], with [`RULE_NO_ROOM`]); the row's `pc` is not kept.
#[inline(always)]
pub fn rule_word(tag: u64, row: &Row) -> u64 {
    (tag & !0xffff_ffff)
        | (u64::from(row.cfa) << 16)
        | (u64::from(row.rbp) << 8)
        | u64::from(row.kind)
}

/// The rule an entry holds for `tag`, if it is that tag's.
#[inline(always)]
pub fn cached_rule(entry: &[u64; 2], tag: u64) -> Option<Row> {
    let w = entry[1];
    if entry[0] != tag || (w ^ tag) >> 32 != 0 {
        return None;
    }
    Some(Row {
        pc: 0,
        cfa: (w >> 16) as u16,
        kind: w as u8,
        rbp: (w >> 8) as u8,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cached_rule_is_its_tags_alone() {
        let row = Row {
            pc: 0x1234,
            cfa: 0x1f0,
            kind: kind::RSP,
            rbp: 3,
        };
        let tag = rule_tag(0x7f00_0012_3456, 7);
        let entry = [tag, rule_word(tag, &row)];
        assert_eq!(cached_rule(&entry, tag), Some(Row { pc: 0, ..row }));
        assert_ne!(rule_tag(0x7f00_0012_3456, 8), tag, "another version");
        assert_ne!(rule_tag(0x7f00_0012_3457, 7), tag, "another address");
        assert_eq!(cached_rule(&[0, 0], tag), None, "an empty entry");
        // Half written by another program: the first word's tag, the second's of another.
        let other = rule_tag(0x7f00_0012_3456, 9);
        assert_eq!(cached_rule(&[tag, rule_word(other, &row)], tag), None);
        let fp = Row {
            kind: RULE_FRAME_POINTER | RULE_NO_ROOM,
            ..Row::default()
        };
        assert_eq!(cached_rule(&[tag, rule_word(tag, &fp)], tag), Some(fp));
        assert_ne!(rule_tag(0, 0), 0);
        assert_eq!(rule_index(1, 0) >> RULE_CACHE_SHIFT, 1);
    }
}

/// A file by the kernel's identity of it, for a walk in a process that has no entry yet
/// (`FILE_ROWS`): its superblock's device as user space numbers it (`major << 32 | minor`)
/// and its inode number.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FileRowsKey {
    pub dev: u64,
    pub ino: u64,
}

/// A loaded file's rows, for walks that find its mapping themselves (`bpf_find_vma`). The
/// size and modification time tell the file read from another that took its inode since.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FileRows {
    /// As in [`Module`]; `rows` 0: built with frame pointers.
    pub first: u32,
    pub rows: u32,
    /// Its executable segment's virtual address less its file offset: a mapping's bias is
    /// its start less its file offset less this.
    pub delta: u64,
    pub size: u64,
    pub mtime_sec: i64,
    pub mtime_nsec: u64,
}

const _: () = assert!(core::mem::size_of::<FileRows>() == 40);

/// `FILE_ROWS` entries at most: the files with rows, in use or idle.
pub const FILE_ROWS_ENTRIES: u32 = 4096;

/// Where `bpf_find_vma`'s walk reads, in the running kernel (`VMA_OFFSETS`, from its BTF):
/// `vm_area_struct`'s `vm_start`, `vm_end`, `vm_pgoff`, `vm_file`; `file`'s `f_inode`;
/// `inode`'s `i_ino`, `i_sb`, `i_size`, its modification time's seconds and nanoseconds;
/// `super_block`'s `s_dev`.
pub mod vma {
    pub const VM_START: usize = 0;
    pub const VM_END: usize = 1;
    pub const VM_PGOFF: usize = 2;
    pub const VM_FILE: usize = 3;
    pub const F_INODE: usize = 4;
    pub const I_INO: usize = 5;
    pub const I_SB: usize = 6;
    pub const I_SIZE: usize = 7;
    pub const I_MTIME_SEC: usize = 8;
    pub const I_MTIME_NSEC: usize = 9;
    pub const S_DEV: usize = 10;
    pub const COUNT: usize = 11;
}
