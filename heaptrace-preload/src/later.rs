//! Modules loaded after the attach (`heaptrace -p PID --in-process`): their GOT entries are
//! redirected when the program first looks up a symbol in one (`dlsym` of a handle), before
//! it can call into it. `dlopen` itself is not redirected: glibc finds the module that
//! calls it by its return address, and takes that module's RUNPATH and `$ORIGIN` (and its
//! namespace) for the search; called from here, a library found by them would not be. A
//! `dlsym` of a handle does not depend on its caller, so it is called from here and the
//! new modules redirected after it returns; `RTLD_DEFAULT` and `RTLD_NEXT`, which do, are
//! passed on by a jump, the caller's return address untouched.
use core::ffi::{c_char, c_void};

/// The `dlsym` GOT entries lead here while attached.
///
/// # Safety
/// The C contract of dlsym.
#[unsafe(naked)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        // RTLD_DEFAULT (0) and RTLD_NEXT (-1): straight on to the real dlsym.
        "test rdi, rdi",
        "jz 2f",
        "cmp rdi, -1",
        "je 2f",
        "jmp {by_handle}",
        "2:",
        "jmp {real}",
        by_handle = sym by_handle,
        real = sym real_dlsym,
    )
}

/// A jump to libc's dlsym (through this library's own GOT, which nothing redirects), the
/// arguments and return address as they came.
#[unsafe(naked)]
unsafe extern "C" fn real_dlsym() {
    core::arch::naked_asm!("jmp qword ptr [rip + {got}@GOTPCREL]", got = sym libc::dlsym);
}

unsafe extern "C" fn by_handle(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    // SAFETY: the caller's arguments, as it passed them.
    let found = unsafe { libc::dlsym(handle, name) };
    crate::got::after_dlsym();
    found
}
