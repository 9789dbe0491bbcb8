//! The entry programs of the allocating functions: each reads its function's arguments and
//! hands them to `enter`.
use aya_ebpf::{macros::uprobe, programs::ProbeContext};
use heaptrace_common::Func;

use crate::enter;

#[uprobe]
pub fn malloc_entry(ctx: ProbeContext) -> u32 {
    let size: u64 = ctx.arg(0).unwrap_or(0);
    let _ = enter(&ctx, Func::Malloc, size, 0);
    0
}

#[uprobe]
pub fn calloc_entry(ctx: ProbeContext) -> u32 {
    let n: u64 = ctx.arg(0).unwrap_or(0);
    let each: u64 = ctx.arg(1).unwrap_or(0);
    // An overflowing product fails inside calloc: recorded as a request that cannot succeed.
    // Not checked_mul: LLVM lowers overflow checks (and `n > MAX / each`, which it recognizes)
    // to a 128-bit multiply from compiler_builtins, a call BPF cannot make. A volatile read of
    // the quotient keeps the division.
    let limit = if each == 0 { u64::MAX } else { u64::MAX / each };
    // SAFETY: a read of a local.
    let limit = unsafe { core::ptr::read_volatile(&limit) };
    let size = if n > limit {
        u64::MAX
    } else {
        n.wrapping_mul(each)
    };
    let _ = enter(&ctx, Func::Calloc, size, 0);
    0
}

#[uprobe]
pub fn realloc_entry(ctx: ProbeContext) -> u32 {
    let old: u64 = ctx.arg(0).unwrap_or(0);
    let size: u64 = ctx.arg(1).unwrap_or(0);
    let _ = enter(&ctx, Func::Realloc, size, old);
    0
}

// Allocators with other signatures (`--allocator-symbols rust`) get entry programs of their own
// rather than an argument index in the attach cookie: the cookie already carries the probe's
// push count, and a fixed register per program keeps each program trivial for the verifier.
// `__rust_alloc(size, align)` and `__rust_dealloc(ptr, size, align)` read their first argument
// like malloc and free, and use those programs.

/// `__rust_alloc_zeroed(size, align)`: a zeroed allocation of `size` bytes, counted as calloc.
#[uprobe]
pub fn alloc_zeroed_entry(ctx: ProbeContext) -> u32 {
    let size: u64 = ctx.arg(0).unwrap_or(0);
    let _ = enter(&ctx, Func::Calloc, size, 0);
    0
}

/// `__rust_realloc(ptr, old_size, align, new_size)`, counted as realloc.
#[uprobe]
pub fn rust_realloc_entry(ctx: ProbeContext) -> u32 {
    let old: u64 = ctx.arg(0).unwrap_or(0);
    let size: u64 = ctx.arg(3).unwrap_or(0);
    let _ = enter(&ctx, Func::Realloc, size, old);
    0
}

#[uprobe]
pub fn posix_memalign_entry(ctx: ProbeContext) -> u32 {
    let memptr: u64 = ctx.arg(0).unwrap_or(0);
    let size: u64 = ctx.arg(2).unwrap_or(0);
    let _ = enter(&ctx, Func::PosixMemalign, size, memptr);
    0
}

#[uprobe]
pub fn aligned_alloc_entry(ctx: ProbeContext) -> u32 {
    let size: u64 = ctx.arg(1).unwrap_or(0);
    let _ = enter(&ctx, Func::AlignedAlloc, size, 0);
    0
}

#[uprobe]
pub fn memalign_entry(ctx: ProbeContext) -> u32 {
    let size: u64 = ctx.arg(1).unwrap_or(0);
    let _ = enter(&ctx, Func::Memalign, size, 0);
    0
}

#[uprobe]
pub fn valloc_entry(ctx: ProbeContext) -> u32 {
    let size: u64 = ctx.arg(0).unwrap_or(0);
    let _ = enter(&ctx, Func::Valloc, size, 0);
    0
}

#[uprobe]
pub fn pvalloc_entry(ctx: ProbeContext) -> u32 {
    let size: u64 = ctx.arg(0).unwrap_or(0);
    let _ = enter(&ctx, Func::Pvalloc, size, 0);
    0
}
