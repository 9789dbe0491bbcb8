//! Each thread's slot in the region, found through a pthread key (no allocation for the
//! first keys, and no thread-local storage that a no_std library could not reach). A thread
//! takes a free slot at its first counted call and gives it back at its exit; the next thread
//! adds on to its counters, which stay cumulative.
use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use heaptrace_common::inproc::ThreadHead;

use crate::region::Region;

static mut KEY: libc::pthread_key_t = 0;
static KEY_OK: AtomicU32 = AtomicU32::new(0);
/// The key's value for a thread that found no free slot: its calls are not counted.
const NO_SLOT: usize = 1;
/// The key's value while the thread takes a slot: a call made meanwhile (the C library's,
/// reading the thread's stack bounds) is heaptrace's own, and goes through uncounted.
const CLAIMING: usize = 2;

/// Why a call has no slot to count in.
pub enum NoSlot {
    /// Every slot is taken (`Loss::InFlight`, `--in-process-threads`).
    Full,
    /// Before the key exists, or while this thread takes its slot: the library's own calls.
    Own,
}

unsafe extern "C" {
    /// The main thread's stack pointer at the program's start (the dynamic loader's).
    static __libc_stack_end: *mut core::ffi::c_void;
}

/// Creates the key, once the region is mapped (again at each attach to a running process,
/// while no GOT entry leads to the library).
pub fn init() {
    // SAFETY: KEY is written here, before any thread looks it up (KEY_OK) or while none can.
    if unsafe { libc::pthread_key_create(&raw mut KEY, Some(exit)) } == 0 {
        KEY_OK.store(1, Ordering::Release);
    }
}

/// Gives the slot back at the thread's exit. Calls the thread makes after this (later
/// destructors) take a slot again, and its key's value makes the C library run this once
/// more (up to its limit of rounds).
extern "C" fn exit(v: *mut core::ffi::c_void) {
    if v as usize > CLAIMING {
        // SAFETY: a slot this thread owns.
        let owner = unsafe { AtomicU32::from_ptr(&raw mut (*(v as *mut ThreadHead)).owner) };
        owner.store(0, Ordering::Release);
    }
}

/// Threads taking a slot now, by id: a call one of them makes meanwhile is the library's
/// own. The key's own value cannot say so at first: past the C library's first 32 keys
/// (a process that made many, or attached to many times), `pthread_setspecific` allocates
/// the key's second level with calloc, which leads back here.
const CLAIMERS: usize = 64;
static CLAIMING_TIDS: [AtomicU32; CLAIMERS] = [const { AtomicU32::new(0) }; CLAIMERS];

/// This thread's slot, taking one if it has none.
#[inline(always)]
pub fn current(r: &Region) -> Result<*mut ThreadHead, NoSlot> {
    if KEY_OK.load(Ordering::Acquire) == 0 {
        return Err(NoSlot::Own);
    }
    // SAFETY: KEY is set (KEY_OK).
    let v = unsafe { libc::pthread_getspecific(KEY) } as usize;
    match v {
        0 => claim(r),
        NO_SLOT => Err(NoSlot::Full),
        CLAIMING => Err(NoSlot::Own),
        _ => Ok(v as *mut ThreadHead),
    }
}

/// A slot taken for this thread, with its id among the claimers meanwhile.
#[cold]
fn claim(r: &Region) -> Result<*mut ThreadHead, NoSlot> {
    let tid = crate::real::gettid() as u32;
    if CLAIMING_TIDS
        .iter()
        .any(|t| t.load(Ordering::Acquire) == tid)
    {
        return Err(NoSlot::Own);
    }
    // No room to say so: uncounted, tried again at its next call.
    let Some(mine) = CLAIMING_TIDS.iter().find(|t| {
        t.compare_exchange(0, tid, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    }) else {
        return Err(NoSlot::Own);
    };
    let got = claim_as(r, tid);
    mine.store(0, Ordering::Release);
    got.ok_or(NoSlot::Full)
}

fn claim_as(r: &Region, tid: u32) -> Option<*mut ThreadHead> {
    // SAFETY: KEY is set.
    unsafe { libc::pthread_setspecific(KEY, CLAIMING as *const core::ffi::c_void) };
    let slot = (0..r.fixed.threads as usize)
        .map(|i| r.at::<ThreadHead>(r.layout.thread(i)))
        .find(|t| take(*t, 0, tid))
        .or_else(|| steal(r, tid));
    let Some(t) = slot else {
        // SAFETY: KEY is set.
        unsafe { libc::pthread_setspecific(KEY, NO_SLOT as *const core::ffi::c_void) };
        return None;
    };
    let used = (t as usize - r.base as usize - r.layout.threads) / r.layout.thread_stride + 1;
    // SAFETY: a u32 of the header.
    let high = unsafe { AtomicU32::from_ptr(&raw mut (*r.header_ptr()).threads_used) };
    high.fetch_max(used as u32, Ordering::AcqRel);
    let (lo, hi) = stack_bounds(r, tid);
    // SAFETY: the slot is this thread's now.
    unsafe {
        AtomicU64::from_ptr(&raw mut (*t).stack_lo).store(lo, Ordering::Relaxed);
        AtomicU64::from_ptr(&raw mut (*t).stack_hi).store(hi, Ordering::Relaxed);
        AtomicU64::from_ptr(&raw mut (*t).alt_window).store(0, Ordering::Relaxed);
        libc::pthread_setspecific(KEY, t as *const core::ffi::c_void);
    }
    Some(t)
}

/// Whether the call on frame `fp` is made by another thread than the slot's owner: a thread
/// made by a raw `clone` shares its creator's pthread data, key values included. A frame on
/// the owner's stack is the owner's; one elsewhere (a signal's stack, a coroutine's, or
/// another thread's) is told apart by the thread id, once per MiB of stack for the owner.
#[inline(always)]
pub fn foreign(t: *mut ThreadHead, fp: usize) -> bool {
    let fp = fp as u64;
    // SAFETY: words of the slot, written by its owner at its claim.
    let (lo, hi) = unsafe { ((*t).stack_lo, (*t).stack_hi) };
    if fp >= lo && fp < hi {
        return false;
    }
    off_stack(t, fp)
}

#[cold]
fn off_stack(t: *mut ThreadHead, fp: u64) -> bool {
    // SAFETY: words of the slot, read and written whole.
    let (window, owner) = unsafe {
        (
            AtomicU64::from_ptr(&raw mut (*t).alt_window),
            AtomicU32::from_ptr(&raw mut (*t).owner).load(Ordering::Relaxed),
        )
    };
    let w = (fp >> 20) + 1;
    if window.load(Ordering::Relaxed) == w {
        return false;
    }
    if crate::real::gettid() as u32 != owner {
        return true;
    }
    window.store(w, Ordering::Relaxed);
    false
}

fn take(t: *mut ThreadHead, from: u32, tid: u32) -> bool {
    // SAFETY: a u32 of a slot.
    let owner = unsafe { AtomicU32::from_ptr(&raw mut (*t).owner) };
    owner
        .compare_exchange(from, tid, Ordering::AcqRel, Ordering::Relaxed)
        .is_ok()
}

/// A slot whose owner is gone without giving it back (it allocated after its key's
/// destructors ran): the kernel says the thread no longer exists.
fn steal(r: &Region, tid: u32) -> Option<*mut ThreadHead> {
    (0..r.fixed.threads as usize)
        .map(|i| r.at::<ThreadHead>(r.layout.thread(i)))
        .find(|t| {
            // SAFETY: a u32 of a slot.
            let owner =
                unsafe { AtomicU32::from_ptr(&raw mut (**t).owner) }.load(Ordering::Acquire);
            // SAFETY: a signal 0 only checks that the thread exists.
            let gone = owner != 0
                && unsafe { libc::syscall(libc::SYS_tgkill, r.pid, owner, 0) } != 0
                && unsafe { *libc::__errno_location() } == libc::ESRCH;
            gone && take(*t, owner, tid)
        })
}

/// The addresses between which this thread's frames lie; a walk reads nothing outside them.
/// The main thread's: below its start (`__libc_stack_end`), within the stack size limit (the
/// kernel maps nothing else there). Another thread's: its stack as the C library allocated it
/// (`pthread_getattr_np`, whose own allocation goes through uncounted), up to its descriptor.
/// A frame elsewhere (a signal's alternate stack, a coroutine's) is not walked past.
fn stack_bounds(r: &Region, tid: u32) -> (u64, u64) {
    if tid == r.pid {
        // SAFETY: reads a static of the dynamic loader.
        let hi = unsafe { __libc_stack_end as u64 };
        // SAFETY: a plain struct for getrlimit to fill.
        let mut lim: libc::rlimit = unsafe { core::mem::zeroed() };
        // SAFETY: fills `lim`.
        let size = if unsafe { libc::getrlimit(libc::RLIMIT_STACK, &mut lim) } == 0 {
            lim.rlim_cur.clamp(1 << 20, 1 << 26)
        } else {
            8 << 20
        };
        return (hi.saturating_sub(size), hi);
    }
    // SAFETY: attr is initialised by pthread_getattr_np before it is read, and destroyed.
    unsafe {
        let me = libc::pthread_self();
        let mut attr: libc::pthread_attr_t = core::mem::zeroed();
        if libc::pthread_getattr_np(me, &mut attr) != 0 {
            return (0, 0);
        }
        let (mut addr, mut size) = (core::ptr::null_mut(), 0usize);
        let got = libc::pthread_attr_getstack(&attr, &mut addr, &mut size) == 0;
        libc::pthread_attr_destroy(&mut attr);
        if !got {
            return (0, 0);
        }
        let lo = addr as u64;
        let hi = lo.saturating_add(size as u64).min(me as u64);
        (lo, hi)
    }
}
