//! The stack maps: the stacks stored (`STACK_OWNERS`, `FRAMES`), the per-CPU cache of recent
//! ones, the walk's scratch, and the one-frame fallback (`CALLERS`); see `stacks.rs`.
use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, PerCpuArray},
};
use heaptrace_common::StoredStack;

use super::{BPF_F_MMAPABLE, BPF_F_NO_PREALLOC};

/// Which stack (its hash) holds each id (`stacks.rs`): every stack stored and not freed, 8
/// bytes of value where FRAMES's are 1 KiB. Allocated on demand.
#[map(name = "STACK_OWNERS")]
pub static STACK_OWNERS: HashMap<u32, u64> = HashMap::with_max_entries(16384, BPF_F_NO_PREALLOC);

/// The frames of stacks stored since user space last read them, by id (`stacks.rs`): it reads
/// and deletes them every round. Allocated on demand.
#[map(name = "FRAMES")]
pub static FRAMES: HashMap<u32, StoredStack> = HashMap::with_max_entries(16384, BPF_F_NO_PREALLOC);

/// Which id recently found stacks have, a row per CPU (`heaptrace_common::stack::cache_word`).
/// Mappable: user space clears the words of a generation before it starts it.
#[map(name = "STACK_CACHE")]
pub static STACK_CACHE: Array<u64> = Array::with_max_entries(1, BPF_F_MMAPABLE);

/// The stack cache's generation, moved on by user space at every round's read and after it
/// frees stacks; also the round generation of site and size keys (`round`).
#[map(name = "STACK_GEN")]
pub static STACK_GEN: Array<u64> = Array::with_max_entries(1, BPF_F_MMAPABLE);

/// The round generation of the keys a call counts under now (`heaptrace_common::round_gen`):
/// one inlined array lookup.
#[inline(always)]
pub fn round() -> u16 {
    STACK_GEN.get_ptr(0).map_or(0, |g| {
        // SAFETY: map value pointer; user space writes it whole.
        heaptrace_common::round_gen(unsafe { core::ptr::read_volatile(g) })
    })
}

/// See `heaptrace_common::globals::STACK_CACHE_SHIFT`.
#[unsafe(no_mangle)]
static STACK_CACHE_SHIFT: u32 = 0;

#[inline(always)]
pub fn stack_cache_shift() -> u32 {
    // SAFETY: a plain read of a global the loader wrote before load.
    unsafe { core::ptr::read_volatile(&STACK_CACHE_SHIFT) }
}

/// Where a stack is walked before it is known whether it is new: 1 KiB, too much for the
/// program's 512-byte stack.
#[map(name = "STACK_SCRATCH")]
pub static STACK_SCRATCH: PerCpuArray<StoredStack> = PerCpuArray::with_max_entries(1, 0);

/// Words of user stack a walk reads at most at once (`stacks::walk`): a frame is two words, and
/// nested frames lie close, so one read serves several. A read costs its call more than its
/// bytes (~0.15 us a call and ~0.08 ns a byte on the AMD VM): the first read of a walk takes
/// [`FIRST_CHUNK_WORDS`], which serve most stacks; a walk that goes past them is deep, and
/// takes all of these at each further read.
pub const CHUNK_WORDS: usize = 256;
pub const FIRST_CHUNK_WORDS: usize = 64;

/// The user stack a walk reads its frames from, and the count of the reads into it on this
/// CPU.
#[map(name = "STACK_CHUNK")]
pub static STACK_CHUNK: PerCpuArray<[u64; CHUNK_WORDS + 1]> = PerCpuArray::with_max_entries(1, 0);

/// Stacks of one frame, the caller (the kernel walks no deeper than a map's value holds): where
/// FRAMES takes no whole stack (full, or both of a stack's ids taken), the allocation keeps
/// its caller. Few distinct callers exist; their stacks, not.
#[map(name = "CALLERS")]
pub static CALLERS: CallerStacks = CallerStacks::with_max_entries(8192);

/// A stack trace map of one-frame stacks: aya-ebpf's `StackTrace` holds 127 frames.
#[repr(transparent)]
pub struct CallerStacks(core::cell::UnsafeCell<aya_ebpf::bindings::bpf_map_def>);

// SAFETY: the definition is read by the loader and the kernel, never written by the program.
unsafe impl Sync for CallerStacks {}

impl CallerStacks {
    const fn with_max_entries(max_entries: u32) -> CallerStacks {
        CallerStacks(core::cell::UnsafeCell::new(
            aya_ebpf::bindings::bpf_map_def {
                type_: aya_ebpf::bindings::bpf_map_type::BPF_MAP_TYPE_STACK_TRACE,
                key_size: 4,
                value_size: 8,
                max_entries,
                map_flags: 0,
                id: 0,
                pinning: 0,
            },
        ))
    }

    pub fn as_ptr(&self) -> *mut core::ffi::c_void {
        self.0.get().cast()
    }
}
