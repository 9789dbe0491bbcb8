//! A walk in a process user space has written no unwind entry for yet (its first
//! milliseconds after an exec under `--all`, before the reader has read its mappings): each
//! frame's file found by its mapping (`bpf_find_vma`), and its rows by the file's identity in
//! `FILE_ROWS`, which user space keeps for every file whose rows are loaded. A file it has
//! none for is walked by frame pointer and counted late, as before.
use aya_ebpf::{
    helpers::{bpf_probe_read_kernel, generated},
    macros::map,
    maps::HashMap,
};
use heaptrace_common::unwind::{FILE_ROWS_ENTRIES, FileRows, FileRowsKey, Module, vma};

/// See `heaptrace_common::globals::VMA_ROWS`.
#[unsafe(no_mangle)]
static VMA_ROWS: u32 = 0;
/// See `heaptrace_common::unwind::vma`.
#[unsafe(no_mangle)]
static VMA_OFFSETS: [u32; vma::COUNT] = [0; vma::COUNT];

#[map(name = "FILE_ROWS")]
pub static FILE_ROWS: HashMap<FileRowsKey, FileRows> =
    HashMap::with_max_entries(FILE_ROWS_ENTRIES, 0);

#[inline(always)]
pub fn on() -> bool {
    // SAFETY: a plain read of a global the loader wrote before load.
    unsafe { core::ptr::read_volatile(&VMA_ROWS) != 0 }
}

#[inline(always)]
fn offset(i: usize) -> u64 {
    // SAFETY: as above; `i` is a constant index below COUNT.
    u64::from(unsafe { core::ptr::read_volatile(&VMA_OFFSETS[i]) })
}

/// A kernel word at `base + offset(i)`; 0 where it cannot be read.
#[inline(always)]
fn word(base: u64, i: usize) -> u64 {
    // SAFETY: bpf_probe_read_kernel checks the address.
    unsafe { bpf_probe_read_kernel((base + offset(i)) as *const u64).unwrap_or(0) }
}

/// A 4-byte kernel field at `base + offset(i)`.
#[inline(always)]
fn word32(base: u64, i: usize) -> u64 {
    // SAFETY: as above.
    u64::from(unsafe { bpf_probe_read_kernel((base + offset(i)) as *const u32).unwrap_or(0) })
}

/// What the callback found of the mapping that holds the address.
#[repr(C)]
struct Found {
    start: u64,
    end: u64,
    pgoff: u64,
    key: FileRowsKey,
    size: u64,
    mtime_sec: i64,
    mtime_nsec: u64,
}

/// `bpf_find_vma`'s callback: the mapping's bounds and its file's identity.
#[inline(never)]
extern "C" fn seen(
    _task: *mut core::ffi::c_void,
    vma_ptr: *mut core::ffi::c_void,
    ctx: *mut core::ffi::c_void,
) -> i64 {
    // SAFETY: `module`'s Found, alive for the call.
    let f = unsafe { &mut *ctx.cast::<Found>() };
    let v = vma_ptr as u64;
    let file = word(v, vma::VM_FILE);
    if file == 0 {
        return 0; // anonymous memory: JIT code, no file
    }
    let inode = word(file, vma::F_INODE);
    let sb = word(inode, vma::I_SB);
    if inode == 0 || sb == 0 {
        return 0;
    }
    let dev = word32(sb, vma::S_DEV);
    f.start = word(v, vma::VM_START);
    f.end = word(v, vma::VM_END);
    f.pgoff = word(v, vma::VM_PGOFF);
    // The kernel's dev_t is major << 20 | minor; user space's key, major << 32 | minor.
    f.key = FileRowsKey {
        dev: (dev >> 20) << 32 | (dev & 0xf_ffff),
        ino: word(inode, vma::I_INO),
    };
    f.size = word(inode, vma::I_SIZE);
    f.mtime_sec = word(inode, vma::I_MTIME_SEC) as i64;
    f.mtime_nsec = word32(inode, vma::I_MTIME_NSEC);
    0
}

/// The module of the file mapped at `pc` in the calling process, where user space loaded its
/// rows (`rows` 0: a file built with frame pointers); None where it has none for it.
#[inline(always)]
pub fn module(pc: u64) -> Option<Module> {
    let mut f = Found {
        start: 0,
        end: 0,
        pgoff: 0,
        key: FileRowsKey::default(),
        size: 0,
        mtime_sec: 0,
        mtime_nsec: 0,
    };
    // SAFETY: the current task as a BTF pointer, a static callback of this object, and a
    // context on this stack for the call.
    let r = unsafe {
        generated::bpf_find_vma(
            generated::bpf_get_current_task_btf(),
            pc,
            seen as *mut core::ffi::c_void,
            (&raw mut f).cast(),
            0,
        )
    };
    if r != 0 || f.end <= pc || f.start > pc {
        return None;
    }
    // SAFETY: a map value, read only.
    let rows = unsafe { FILE_ROWS.get(&f.key) }?;
    if rows.size != f.size || rows.mtime_sec != f.mtime_sec || rows.mtime_nsec != f.mtime_nsec {
        return None; // another file took the inode of the one read
    }
    Some(Module {
        start: f.start,
        end: f.end,
        bias: f.start.wrapping_sub(f.pgoff << 12).wrapping_sub(rows.delta),
        first: rows.first,
        rows: rows.rows,
        flags: 0,
        _pad: 0,
    })
}
