//! Loaded into a running process by heaptrace (`heaptrace -p PID --in-process`), through
//! ptrace: the calls heaptrace makes in it. The launched path's environment is not there;
//! the region's descriptor, size and token come as arguments, and the malloc family is
//! redirected in every module's GOT (`got`) instead of by preloading. The library is never
//! unloaded: after the detach its functions are reached by no entry, and inert.
use crate::{got, real, region};

/// Why an attach failed (negative results of `heaptrace_attach`).
pub mod failed {
    pub const NO_MALLOC: i64 = -1;
    pub const REGION: i64 = -2;
    pub const NOT_OURS: i64 = -3;
}

/// Maps the region at `fd` (closed here either way: heaptrace holds its own descriptor),
/// resolves the functions the process calls now and redirects them to `ours` (this
/// library's, in the order of `got::NAMES`, read by heaptrace from its symbols). Returns the entries
/// redirected in its low 32 bits and those found but not redirected in its high ones, or a
/// negative `failed` value with nothing redirected.
#[unsafe(no_mangle)]
pub extern "C" fn heaptrace_attach(
    fd: i32,
    size: u64,
    token0: u64,
    token1: u64,
    ours: *const [usize; 10],
) -> i64 {
    let resolved = real::resolve_global();
    let adopted = resolved && region::adopt(fd, size, [token0, token1]);
    // SAFETY: the region's descriptor, made for this call; its mapping outlives it.
    unsafe { libc::close(fd) };
    if !resolved {
        return failed::NO_MALLOC;
    }
    if !adopted {
        return failed::REGION;
    }
    // SAFETY: heaptrace passes ten words on the calling thread's stack.
    let Some(written) = got::redirect(unsafe { &*ours }) else {
        return failed::NOT_OURS;
    };
    let written = written as i64;
    let lost = got::lost() as i64;
    lost << 32 | written.min(u32::MAX as i64)
}

/// Writes back every entry redirected: the process calls its allocator directly again.
/// -1: another thread was redirecting a module loaded later (`later`); to be tried again.
#[unsafe(no_mangle)]
pub extern "C" fn heaptrace_detach() -> i64 {
    if got::restore() { 0 } else { -1 }
}
