//! heaptrace's in-process fast path: preloaded into a launched command (`heaptrace
//! --in-process -- CMD`), it interposes the malloc family and counts each call into the
//! region the daemon shares with it (`heaptrace_common::inproc`), with no trap and no lock.
//!
//! no_std, so that nothing here can allocate: an allocation would call back into malloc.
//! Every entry point passes the call on to the next definition (`real`), and counts it only
//! when the region is mapped, counting is on, this is the process that took the region (not
//! a fork of it) and the call is not nested in one already being counted on its thread.
#![no_std]

mod attach;
mod count;
mod got;
mod later;
mod live;
mod python;
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

/// Marks the file as heaptrace's own library (`targets::allocator`): a system-wide trace
/// probes the allocator behind it, never it.
#[unsafe(no_mangle)]
pub extern "C" fn heaptrace_preload_library() {}

/// Maps the region as the library is loaded, before the program's own code runs: a program
/// that closes or reuses descriptors before its first allocation is counted all the same.
#[used]
#[unsafe(link_section = ".init_array")]
static AT_LOAD: extern "C" fn() = at_load;

extern "C" fn at_load() {
    let _ = region::get();
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

/// An entry point that returns a block: passed on to the next definition, and counted as
/// `$func` of `$size` bytes.
macro_rules! allocating {
    ($name:ident($($a:ident: $t:ty),*) => $func:expr, $size:expr) => {
        /// # Safety
        /// The C contract of the function of this name.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($a: $t),*) -> *mut c_void {
            let fp = frame!();
            let Some(call) = Call::begin_alloc(fp) else {
                return unsafe { real::$name($($a),*) };
            };
            let p = unsafe { real::$name($($a),*) };
            call.allocated($func, $size, p as u64);
            p
        }
    };
}

allocating!(malloc(size: usize) => Func::Malloc, size as u64);
allocating!(calloc(n: usize, each: usize) => Func::Calloc, (n as u64).saturating_mul(each as u64));
allocating!(aligned_alloc(align: usize, size: usize) => Func::AlignedAlloc, size as u64);
allocating!(memalign(align: usize, size: usize) => Func::Memalign, size as u64);
allocating!(valloc(size: usize) => Func::Valloc, size as u64);
allocating!(pvalloc(size: usize) => Func::Pvalloc, size as u64);

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
    let fp = frame!();
    let Some(call) = Call::begin(fp) else {
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
