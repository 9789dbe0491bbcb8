pub const MMAP: u32 = 9;
pub const MUNMAP: u32 = 11;
pub const BRK: u32 = 12;
pub const MREMAP: u32 = 25;
/// Not a syscall: an allocator call that made memory syscalls returned; `args[0]` is its
/// site's stack id (as i64; `NO_SITE` outside stacks mode).
pub const CALL_END: u32 = 0x100;
/// Not a syscall: the process exec'ed, after the events of its earlier image and before
/// any of its new one's. What the earlier image mapped is gone; its break is no longer the
/// process's.
pub const EXEC: u32 = 0x101;
/// `MemEvent::func` of a syscall made outside any allocator call.
pub const NO_FUNC: u32 = u32::MAX;
/// `MemEvent::func` of a pymalloc arena's mmap (outside any allocator call, in a Python
/// process, stacks mode): followed by its own `CALL_END`, with the stack at the syscall.
pub const PYMALLOC: u32 = u32::MAX - 1;
/// The size of a pymalloc arena (CPython 3.10 on, 64-bit): 1 MiB.
pub const PYMALLOC_ARENA: u64 = 1 << 20;
/// Or'ed into munmap's and mremap's number: the syscall is about to run (`ret` 0). Their
/// release of the old range is applied here, before the kernel frees it for another
/// thread's mmap, whose event could otherwise come first.
pub const BEGIN: u32 = 0x1000;
/// Or'ed into munmap's and mremap's number: the syscall failed; the range is mapped still.
pub const FAILED: u32 = 0x2000;
/// Attach cookie flag of a wrapper's entry probe (the cookie's low bits: the number).
pub const COOKIE_BEGIN: u64 = 1 << 32;

/// Whether syscall `nr` gives a range back (munmap, mremap): reported as it begins too.
#[inline(always)]
pub fn releases(nr: u32) -> bool {
    nr == MUNMAP || nr == MREMAP
}
