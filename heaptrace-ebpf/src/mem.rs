//! The memory behind malloc: mmap, munmap, mremap and brk of traced processes.
//!
//! Where the process's libc (or a static binary) has the syscall wrappers, a uprobe sits on the
//! instruction after each wrapper's `syscall`: there the kernel's result is in rax and
//! the arguments are still in their registers, so one probe sees the whole syscall, and only
//! traced processes' memory syscalls pay for it. Otherwise the syscall tracepoints (no tracefs,
//! no kprobes needed) run on every syscall of the host, including the one each uretprobe makes
//! to return, and keep what a traced process does.
//!
//! The syscall happens deep inside the allocator, where the frame-pointer walk is useless
//! (Debian's libc has no frame pointers). So the syscall only marks the thread's in-flight
//! allocator call; that call's return probe, where the stack walk works, reports its site, and
//! user space pairs the two by thread. Syscalls outside any allocator call (free's munmap of an
//! mmapped chunk, the program's own mappings) are reported without a site, except a Python
//! process's pymalloc arenas (`pymalloc_arena`), whose stack is taken at the syscall.
use aya_ebpf::{
    EbpfContext as _,
    bindings::pt_regs,
    helpers::{bpf_get_attach_cookie, bpf_get_current_pid_tgid},
    macros::{btf_tracepoint, uprobe},
    programs::{BtfTracePointContext, ProbeContext},
};
use heaptrace_common::{Func, INFLIGHT_RESERVED, Loss, MemCall, MemEvent, mem};

use crate::maps::{MEMCALLS, MEMEVENTS, lose, self_tgid};

/// Errors come back as -4095..-1 in the return register.
const MAX_ERRNO: u64 = 4095;

#[inline(always)]
fn is_mem_syscall(nr: u64) -> bool {
    nr == mem::MMAP as u64
        || nr == mem::MUNMAP as u64
        || nr == mem::BRK as u64
        || nr == mem::MREMAP as u64
}

/// Runs on every syscall of the host: the syscall number test comes first. BTF tracepoints
/// (tp_btf), not plain raw ones: the register file is then a typed pointer the program reads
/// with plain loads, where a raw tracepoint needs a helper call per field, which made every
/// syscall of the host about 250 ns slower here.
#[btf_tracepoint(function = "sys_enter")]
pub fn mem_sys_enter(ctx: BtfTracePointContext) -> i32 {
    let nr: u64 = ctx.arg(1);
    if is_mem_syscall(nr) {
        enter(&ctx, nr as u32);
    }
    0
}

/// A memory syscall's wrapper, just after its `syscall` instruction; the cookie is the
/// syscall's number. munmap's and mremap's wrappers also have one at their entry (the cookie
/// has `mem::COOKIE_BEGIN`), where their first two arguments are the range they release.
#[uprobe]
pub fn mem_syscall(ctx: ProbeContext) -> u32 {
    // SAFETY: the helper only reads the cookie of the link that runs this program.
    let cookie = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) };
    let nr = cookie as u32;
    let id = bpf_get_current_pid_tgid();
    let Some(func) = traced_call(id) else {
        return 0;
    };
    // SAFETY: the context's register file, valid for the program's run.
    let (args, ret) = unsafe {
        let r = &*ctx.regs;
        ([r.rdi, r.rsi, r.rdx, r.r10], r.rax)
    };
    if cookie & mem::COOKIE_BEGIN != 0 {
        begin(id, nr, func, args);
        return 0;
    }
    if func == mem::NO_FUNC && pymalloc_arena(id, nr, args, ret) {
        arena(&ctx, id, args, ret);
        return 0;
    }
    done(id, MemCall { nr, func, args }, ret);
    0
}

/// Whether this mmap made a pymalloc arena: CPython maps each with `mmap(NULL, ARENA_SIZE,
/// PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS)` outside any allocator call (its
/// object allocator is its own), in a process user space found CPython in. Stacks mode only.
#[inline(always)]
fn pymalloc_arena(id: u64, nr: u32, args: [u64; 4], ret: u64) -> bool {
    const PROT_RW: u64 = 3;
    const PRIVATE_ANONYMOUS: u64 = 0x22;
    nr == mem::MMAP
        && ret <= u64::MAX - MAX_ERRNO
        && args == [0, mem::PYMALLOC_ARENA, PROT_RW, PRIVATE_ANONYMOUS]
        && crate::maps::mode() == heaptrace_common::mode::STACKS
        && crate::python::is_python((id >> 32) as u32)
}

/// A pymalloc arena: reported as a call of its own (`mem::PYMALLOC`) that made one mmap, with
/// the stack at the syscall (through libc's wrapper by its unwind rows, then the interpreter
/// and the Python frames of the line whose object needed a new arena) as its site.
#[inline(always)]
fn arena(ctx: &ProbeContext, id: u64, args: [u64; 4], ret: u64) {
    let (tgid, tid) = ((id >> 32) as u32, id as u32);
    let (stack_id, _) = crate::sites::stack_id(ctx, tgid);
    let call = MemCall {
        nr: mem::MMAP,
        func: mem::PYMALLOC,
        args,
    };
    done(id, call, ret);
    report(MemEvent {
        kind: mem::CALL_END,
        tgid,
        tid,
        func: mem::PYMALLOC,
        args: [i64::from(stack_id) as u64, 0, 0, 0],
        ret: 0,
    });
}

/// The allocator call a memory syscall of this thread is part of (`mem::NO_FUNC`: none), or
/// None when the syscall is not traced.
#[inline(always)]
fn traced_call(id: u64) -> Option<u32> {
    let tgid = (id >> 32) as u32;
    if tgid == self_tgid() {
        return None;
    }
    // In an allocator call: traced. Otherwise traced only if the process allocated before
    // (it has counters); the rest of the host is not our business.
    match crate::inflight::get(id) {
        Some(f) if f.sp != 0 => Some(u32::from(f.func)),
        _ if crate::maps::has_counters(tgid) => Some(mem::NO_FUNC),
        _ => None,
    }
}

#[inline(always)]
fn enter(ctx: &BtfTracePointContext, nr: u32) {
    let id = bpf_get_current_pid_tgid();
    let Some(func) = traced_call(id) else {
        return;
    };
    let regs: *const pt_regs = ctx.arg(0);
    // SAFETY: a BTF-typed pointer to the syscall's register file: the verifier checks loads.
    let args = unsafe { [(*regs).rdi, (*regs).rsi, (*regs).rdx, (*regs).r10] };
    if mem::releases(nr) {
        begin(id, nr, func, args);
    }
    let call = MemCall { nr, func, args };
    if MEMCALLS.insert(id as u32, call, 0).is_err() {
        lose(Loss::MemEvents);
    }
}

#[btf_tracepoint(function = "sys_exit")]
pub fn mem_sys_exit(ctx: BtfTracePointContext) -> i32 {
    let regs: *const pt_regs = ctx.arg(0);
    // SAFETY: as in enter.
    let nr = unsafe { (*regs).orig_rax };
    if is_mem_syscall(nr) {
        let ret: u64 = ctx.arg(1);
        exit(ret);
    }
    0
}

#[inline(always)]
fn exit(ret: u64) {
    let id = bpf_get_current_pid_tgid();
    let tid = id as u32;
    // SAFETY: copied out before the delete.
    let Some(call) = (unsafe { MEMCALLS.get(tid) }).copied() else {
        return;
    };
    let _ = MEMCALLS.remove(tid);
    done(id, call, ret);
}

/// munmap or mremap of a traced process is about to run (see `mem::BEGIN`).
#[inline(always)]
fn begin(id: u64, nr: u32, func: u32, args: [u64; 4]) {
    report(MemEvent {
        kind: nr | mem::BEGIN,
        tgid: (id >> 32) as u32,
        tid: id as u32,
        func,
        args,
        ret: 0,
    });
}

/// A memory syscall of a traced process has returned `ret`.
#[inline(always)]
fn done(id: u64, call: MemCall, ret: u64) {
    if ret > u64::MAX - MAX_ERRNO {
        // Failed: nothing changed. What a begun munmap or mremap released is mapped still.
        if mem::releases(call.nr) {
            report(MemEvent {
                kind: call.nr | mem::FAILED,
                tgid: (id >> 32) as u32,
                tid: id as u32,
                func: call.func,
                args: call.args,
                ret,
            });
        }
        return;
    }
    if call.func != mem::NO_FUNC
        && call.func != mem::PYMALLOC
        && let Some(f) = crate::inflight::get(id)
    {
        f.flags |= INFLIGHT_RESERVED;
    }
    report(MemEvent {
        kind: call.nr,
        tgid: (id >> 32) as u32,
        tid: id as u32,
        func: call.func,
        args: call.args,
        ret,
    });
}

/// The return of an allocator call that made memory syscalls: its site (`stack_id`, as
/// `sites::stack_id` gave it, or NO_SITE outside stacks mode), for user space to attribute
/// them.
#[inline(always)]
pub fn call_end(tgid: u32, tid: u32, func: Func, stack_id: i32) {
    report(MemEvent {
        kind: mem::CALL_END,
        tgid,
        tid,
        func: func as u32,
        args: [i64::from(stack_id) as u64, 0, 0, 0],
        ret: 0,
    });
}

/// The process exec'ed (see `mem::EXEC`).
#[inline(always)]
pub fn exec(tgid: u32) {
    report(MemEvent {
        kind: mem::EXEC,
        tgid,
        tid: tgid,
        func: mem::NO_FUNC,
        args: [0; 4],
        ret: 0,
    });
}

#[inline(always)]
fn report(ev: MemEvent) {
    if MEMEVENTS.output(ev, 0).is_err() {
        lose(Loss::MemEvents);
    }
}
