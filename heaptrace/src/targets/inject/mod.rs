//! `heaptrace -p PID --in-process`: heaptrace's library loaded into a running process with
//! ptrace alone (no debugger), and its malloc family redirected to it.
//!
//! One thread is stopped at a safe point (`stop`); on it, libc's functions are called
//! (`call`): `memfd_create` for the library and for the region, both made in the target so
//! that a process in another mount namespace gets them without any path (heaptrace writes
//! them through /proc/PID/fd), `dlopen("/proc/self/fd/N")`, `dlsym`, then the library's
//! `heaptrace_attach`, which maps the region and writes every module's GOT. The thread gets
//! its registers back and is let go; if heaptrace dies at any moment, the thread goes on by
//! itself (see `call`).
use std::{
    fs::File,
    os::unix::fs::OpenOptionsExt as _,
    time::{Duration, Instant},
};

mod call;
mod libc;
mod loaded;
mod memfd;
mod notice;
mod stop;
mod sys;

use self::call::{Arg, Trampoline, call};

/// Why `pid` cannot be loaded into, in one line; None if it can be tried.
pub fn refusal(pid: u32) -> Option<String> {
    let status = match std::fs::read_to_string(format!("/proc/{pid}/status")) {
        Ok(s) => s,
        Err(_) => return Some(format!("-p {pid}: no such process")),
    };
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
            .unwrap_or("")
            .to_string()
    };
    if field("State:").starts_with('T') || field("State:").starts_with('t') {
        return Some(format!(
            "-p {pid} is stopped: --in-process loads nothing into a stopped process; \
             continue it first (kill -CONT {pid})"
        ));
    }
    let tracer = field("TracerPid:");
    if tracer != "0" && !tracer.is_empty() {
        return Some(format!(
            "-p {pid} is traced by pid {tracer} (a debugger?): --in-process cannot load into \
             it; detach that tracer first, or leave out --in-process"
        ));
    }
    let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .unwrap_or(0);
    if scope >= 3 || (scope >= 1 && !crate::targets::access::Privileges::own().sees_other_users()) {
        return Some(format!(
            "kernel.yama.ptrace_scope is {scope}: it forbids the ptrace --in-process -p needs{}; \
             leave out --in-process to trace -p {pid} with probes",
            if scope >= 3 {
                ""
            } else {
                " without CAP_SYS_PTRACE"
            }
        ));
    }
    None
}

/// The library loaded and attached.
pub struct Loaded {
    /// `heaptrace_detach` in the target.
    pub detach: u64,
    pub redirected: u32,
    /// GOT entries found that could not be written.
    pub lost: u32,
    /// Stop to let go.
    pub took: Duration,
}

/// Where an attach's time went (stop to let go), for the debug log.
#[derive(Debug, Default)]
struct Phases {
    /// A thread stopped at a safe point; threads stopped and let go before it.
    stop: Duration,
    passed_over: u32,
    /// The library's memfd filled and opened (nothing when an earlier attach left it).
    library: Duration,
    /// The region made in the target and the library's attach (the GOT written).
    region: Duration,
    /// The trampoline removed and the thread let go.
    release: Duration,
    /// The ptrace stops the calls took: one a round trip between heaptrace and the thread.
    stops: u32,
}

/// What the caller makes of the region once it exists in the target: its size and token.
pub type MakeRegion<'a> = &'a mut dyn FnMut(File) -> crate::error::Result<(u64, [u64; 2])>;

fn err(pid: u32, reason: impl std::fmt::Display) -> crate::error::Error {
    crate::error::Error::Inject {
        pid,
        reason: reason.to_string(),
    }
}

/// Loads `library` into `pid`, makes the region there (`make_region`) and attaches.
pub fn load(pid: u32, library: &[u8], make_region: MakeRegion) -> crate::error::Result<Loaded> {
    let found = libc::find(pid).map_err(|r| err(pid, r))?;
    // Read before the stop: the library stays once loaded, and nothing else loads it.
    let earlier = match loaded::find(pid, library) {
        Some(sym) => Ok(sym),
        None => Err(loaded::instances(pid)),
    };
    let _boosted = sys::Boosted::own();
    let start = Instant::now();
    let mut phases = Phases::default();
    let held = stop::safe_thread(pid, &found.avoid).map_err(|r| err(pid, r))?;
    (phases.stop, phases.passed_over) = (start.elapsed(), held.passed_over);
    let tramp = Trampoline::install(pid, found.scratch, &held).map_err(|e| err(pid, e))?;
    let result = load_on(
        pid,
        &held,
        &tramp,
        &found.funcs,
        (library, earlier),
        make_region,
        &mut phases,
    );
    let releasing = Instant::now();
    phases.stops = tramp.stops();
    // The trampoline's bytes back, then the thread: the order heaptrace can die in safely.
    let removed = tramp.remove(pid);
    let released = held.release();
    phases.release = releasing.elapsed();
    log::debug!("pid {pid}: attach took {:?}: {phases:?}", start.elapsed());
    let (detach, redirected, lost) = result?;
    removed.map_err(|e| err(pid, format!("cannot remove the trampoline: {e}")))?;
    released.map_err(|e| err(pid, format!("cannot let the thread go: {e}")))?;
    Ok(Loaded {
        detach,
        redirected,
        lost,
        took: start.elapsed(),
    })
}

fn load_on(
    pid: u32,
    held: &stop::Held,
    tramp: &Trampoline,
    f: &libc::Funcs,
    (library, earlier): (&[u8], Earlier),
    make_region: MakeRegion,
    phases: &mut Phases,
) -> crate::error::Result<(u64, u32, u32)> {
    let c = |func: u64, args: &[Arg]| call(pid, held, tramp, func, args).map_err(|e| err(pid, e));
    let start = Instant::now();
    let sym = match earlier {
        Ok(sym) => sym,
        Err(instances) => load_library(pid, &c, f, library, instances)?,
    };
    phases.library = start.elapsed();
    let attached = attach_region(pid, &c, f, &sym, make_region);
    phases.region = start.elapsed() - phases.library;
    attached
}

type Call<'a> = &'a dyn Fn(u64, &[Arg]) -> crate::error::Result<u64>;

/// This build's library as an earlier attach left it, or how many heaptrace libraries the
/// process has loaded (`loaded::instances`).
type Earlier = Result<loaded::Symbols, usize>;

/// The library written into a memfd made in the target and opened there (`instances`
/// loaded before); its functions.
fn load_library(
    pid: u32,
    c: Call,
    f: &libc::Funcs,
    library: &[u8],
    instances: usize,
) -> crate::error::Result<loaded::Symbols> {
    let lib_fd = memfd::create(pid, c, f.memfd_create, c"heaptrace-preload")?;
    let opened = (|| {
        memfd::fill(pid, lib_fd, library).map_err(|e| err(pid, e))?;
        // The loader takes a name it has loaded for that library again: an earlier build's,
        // loaded from a descriptor of the same number, is told apart by its slashes.
        let slashes = "/".repeat(instances + 1);
        let path = format!("/proc/self/fd{slashes}{lib_fd}\0");
        let mode = (::libc::RTLD_NOW | ::libc::RTLD_LOCAL) as u64;
        let handle = c(f.dlopen, &[Arg::Bytes(path.as_bytes()), Arg::Num(mode)])?;
        if handle == 0 {
            let why = c(f.dlerror, &[])?;
            return Err(err(pid, format!("dlopen failed: {}", read_cstr(pid, why))));
        }
        Ok(())
    })();
    // Mapped by the loader by now, or not needed.
    let _ = c(f.close, &[Arg::Num(lib_fd)]);
    opened?;
    loaded::find(pid, library)
        .ok_or_else(|| err(pid, "the library loaded is not found in its maps"))
}

/// The region made in the target, then the library's attach called with it.
fn attach_region(
    pid: u32,
    c: Call,
    f: &libc::Funcs,
    sym: &loaded::Symbols,
    make_region: MakeRegion,
) -> crate::error::Result<(u64, u32, u32)> {
    let region_fd = memfd::create(pid, c, f.memfd_create, c"heaptrace-inproc")?;
    let made = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(::libc::O_CLOEXEC)
        .open(format!("/proc/{pid}/fd/{region_fd}"))
        .map_err(|e| err(pid, format!("cannot open the region made in it: {e}")))
        .and_then(make_region);
    let (size, token) = match made {
        Ok(m) => m,
        Err(e) => {
            let _ = c(f.close, &[Arg::Num(region_fd)]);
            return Err(e);
        }
    };
    let ours = sym.ours_bytes();
    // The library closes the descriptor, whatever it finds.
    let r = c(
        sym.attach,
        &[
            Arg::Num(region_fd),
            Arg::Num(size),
            Arg::Num(token[0]),
            Arg::Num(token[1]),
            Arg::Bytes(&ours),
        ],
    )? as i64;
    if r < 0 {
        return Err(err(
            pid,
            format!(
                "the library refused the region ({r}): the process has a region of a \
                 launched --in-process run, or was attached to too many times (64)"
            ),
        ));
    }
    Ok((sym.detach, r as u32, (r >> 32) as u32))
}

/// A C string of the target's memory, up to 256 bytes.
fn read_cstr(pid: u32, at: u64) -> String {
    if at == 0 {
        return "no reason given".into();
    }
    let b = sys::read_mem(pid, at, 256).unwrap_or_default();
    let end = b.iter().position(|x| *x == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// Tries of the detach: another thread may be redirecting a module it loaded.
const DETACH_TRIES: u32 = 20;

/// Writes back every GOT entry the attach redirected (`heaptrace_detach` at `detach`).
pub fn unload(pid: u32, detach: u64) -> crate::error::Result<std::time::Duration> {
    let found = libc::find(pid).map_err(|r| err(pid, r))?;
    let _boosted = sys::Boosted::own();
    let start = Instant::now();
    for _ in 0..DETACH_TRIES {
        let held = stop::safe_thread(pid, &found.avoid).map_err(|r| err(pid, r))?;
        let tramp = Trampoline::install(pid, found.scratch, &held).map_err(|e| err(pid, e))?;
        let result = call(pid, &held, &tramp, detach, &[]);
        let removed = tramp.remove(pid);
        let released = held.release();
        let done = result.map_err(|e| err(pid, e))? as i64 == 0;
        removed.map_err(|e| err(pid, e))?;
        released.map_err(|e| err(pid, e))?;
        if done {
            return Ok(start.elapsed());
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    Err(err(
        pid,
        format!(
            "its GOT entries were being redirected for a module it loaded each of \
             {DETACH_TRIES} times: left redirected, counting off"
        ),
    ))
}
