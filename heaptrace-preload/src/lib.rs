//! heaptrace's in-process fast path: preloaded into a launched command (`heaptrace
//! --in-process -- CMD`), it interposes the malloc family and counts each call into the
//! region the daemon shares with it (`heaptrace_common::inproc`), with no trap and no lock.
//!
//! no_std, so that nothing here can allocate: an allocation would call back into malloc.
//! Every entry point passes the call on to the next definition (`real`), and counts it only
//! when the region is mapped, counting is on, this is the process that took the region (not
//! a fork of it) and the call is not nested in one already being counted on its thread.
#![no_std]

mod count;
mod live;
mod real;
mod region;
mod stack;
mod thread;
mod unwind;

use core::ffi::c_void;

use heaptrace_common::Func;

use crate::count::Call;

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    // SAFETY: no preconditions; a bug here must not leave the target running on corrupt state.
    unsafe { libc::abort() }
}

/// The caller's frame: this function's frame pointer (the library is built with frame
/// pointers), whose saved return address is the allocation's first frame.
macro_rules! frame {
    () => {{
        let fp: usize;
        // SAFETY: reads a register.
        unsafe { core::arch::asm!("mov {}, rbp", out(reg) fp, options(nomem, nostack)) };
        fp
    }};
}

/// # Safety
/// The C contract of malloc.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn malloc(size: usize) -> *mut c_void {
    let fp = frame!();
    let Some(call) = Call::begin_alloc(fp) else {
        return unsafe { real::malloc(size) };
    };
    let p = unsafe { real::malloc(size) };
    call.allocated(Func::Malloc, size as u64, p as u64);
    p
}

/// # Safety
/// The C contract of calloc.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn calloc(n: usize, each: usize) -> *mut c_void {
    let fp = frame!();
    let Some(call) = Call::begin_alloc(fp) else {
        return unsafe { real::calloc(n, each) };
    };
    let p = unsafe { real::calloc(n, each) };
    let size = (n as u64).saturating_mul(each as u64);
    call.allocated(Func::Calloc, size, p as u64);
    p
}

/// # Safety
/// The C contract of realloc.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn realloc(old: *mut c_void, size: usize) -> *mut c_void {
    let fp = frame!();
    if real::is_bootstrap(old) {
        return unsafe { real::realloc_bootstrap(old, size) };
    }
    let Some(call) = Call::begin_alloc(fp) else {
        return unsafe { real::realloc(old, size) };
    };
    // Out of the live table before the block can be handed out again.
    let held = call.take(old as u64);
    let p = unsafe { real::realloc(old, size) };
    call.reallocated(old as u64, size as u64, p as u64, held);
    p
}

/// # Safety
/// The C contract of reallocarray.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn reallocarray(old: *mut c_void, n: usize, each: usize) -> *mut c_void {
    let fp = frame!();
    if real::is_bootstrap(old) {
        return match n.checked_mul(each) {
            Some(size) => unsafe { real::realloc_bootstrap(old, size) },
            None => core::ptr::null_mut(),
        };
    }
    let Some(call) = Call::begin_alloc(fp) else {
        return unsafe { real::reallocarray(old, n, each) };
    };
    let Some(size) = n.checked_mul(each) else {
        // Refused before anything is freed: a failed realloc.
        let p = unsafe { real::reallocarray(old, n, each) };
        call.reallocated(old as u64, u64::MAX, p as u64, None);
        return p;
    };
    let held = call.take(old as u64);
    let p = unsafe { real::reallocarray(old, n, each) };
    call.reallocated(old as u64, size as u64, p as u64, held);
    p
}

/// # Safety
/// The C contract of free.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn free(p: *mut c_void) {
    if p.is_null() || real::is_bootstrap(p) {
        return;
    }
    let Some(call) = Call::begin(0) else {
        return unsafe { real::free(p) };
    };
    let held = call.take(p as u64);
    unsafe { real::free(p) };
    call.freed(held);
}

/// # Safety
/// The C contract of posix_memalign.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn posix_memalign(out: *mut *mut c_void, align: usize, size: usize) -> i32 {
    let fp = frame!();
    let Some(call) = Call::begin_alloc(fp) else {
        return unsafe { real::posix_memalign(out, align, size) };
    };
    let r = unsafe { real::posix_memalign(out, align, size) };
    let p = if r == 0 { (unsafe { *out }) as u64 } else { 0 };
    call.allocated(Func::PosixMemalign, size as u64, p);
    r
}

/// # Safety
/// The C contract of aligned_alloc.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn aligned_alloc(align: usize, size: usize) -> *mut c_void {
    let fp = frame!();
    let Some(call) = Call::begin_alloc(fp) else {
        return unsafe { real::aligned_alloc(align, size) };
    };
    let p = unsafe { real::aligned_alloc(align, size) };
    call.allocated(Func::AlignedAlloc, size as u64, p as u64);
    p
}

/// # Safety
/// The C contract of memalign.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memalign(align: usize, size: usize) -> *mut c_void {
    let fp = frame!();
    let Some(call) = Call::begin_alloc(fp) else {
        return unsafe { real::memalign(align, size) };
    };
    let p = unsafe { real::memalign(align, size) };
    call.allocated(Func::Memalign, size as u64, p as u64);
    p
}

/// # Safety
/// The C contract of valloc.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn valloc(size: usize) -> *mut c_void {
    let fp = frame!();
    let Some(call) = Call::begin_alloc(fp) else {
        return unsafe { real::valloc(size) };
    };
    let p = unsafe { real::valloc(size) };
    call.allocated(Func::Valloc, size as u64, p as u64);
    p
}

/// # Safety
/// The C contract of pvalloc.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pvalloc(size: usize) -> *mut c_void {
    let fp = frame!();
    let Some(call) = Call::begin_alloc(fp) else {
        return unsafe { real::pvalloc(size) };
    };
    let p = unsafe { real::pvalloc(size) };
    call.allocated(Func::Pvalloc, size as u64, p as u64);
    p
}
