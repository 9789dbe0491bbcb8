//! Python frames at an allocation, read in process as the kernel walk reads them
//! (`heaptrace-ebpf/src/python.rs`): after the native frames, `PY_MARK` and two words per
//! Python frame of the calling thread, innermost first (`heaptrace_common::python`), so that
//! the daemon names and splices them with the same code.
//!
//! Where the interpreter is comes from the daemon (the header's `python`, under its seqlock),
//! once it found it in the process's mappings. The thread's state is its own pthread key's
//! value (CPython's gilstate key, no search through other threads' states) and must name this
//! thread. Every word is read only from a page known to be readable: a page is checked once,
//! with `process_vm_readv` on this process (which fails where a read would fault), and
//! remembered; a pointer into a page that does not check out ends the walk there.
use core::sync::atomic::{AtomicU64, Ordering, fence};

use heaptrace_common::{
    STACK_FRAMES,
    inproc::ThreadHead,
    python::{
        OWNED_BY_CSTACK, PATH_CFRAME, PY_FRAMES_MAX, PY_MARK, PyProc, frame_word, identity_word,
        name_words,
    },
};

use crate::region::Region;

/// The interpreter the daemon found, copied under its seqlock; None before it found one (or
/// while it rewrites it).
#[inline(always)]
fn interpreter(r: &Region) -> Option<PyProc> {
    let h = r.header_ptr();
    // SAFETY: a word of the mapped header, read atomically.
    let seq = unsafe { AtomicU64::from_ptr(&raw mut (*h).py_seq) };
    let s = seq.load(Ordering::Acquire);
    if s == 0 || s & 1 != 0 {
        return None;
    }
    // SAFETY: plain integers of the mapped header; a torn copy is caught by the seqlock.
    let p = unsafe { core::ptr::read_volatile(&raw const (*h).python) };
    fence(Ordering::Acquire);
    (seq.load(Ordering::Relaxed) == s).then_some(p)
}

/// Pages known readable, by page number + 1, at a slot drawn from it. Shared by the threads
/// (any entry was checked by one of them); a page taken by another is checked again.
const PAGES: usize = 4096;
static READABLE: [AtomicU64; PAGES] = [const { AtomicU64::new(0) }; PAGES];

/// Whether the page of `at` can be read. A page checked once is taken as readable from then
/// on: the chain read is the calling thread's own, which CPython keeps whole while it runs
/// (a frame linked is live, its code object referenced), so only a chain CPython itself
/// broke could point into memory unmapped since.
#[inline(always)]
fn readable(pid: u32, at: u64) -> bool {
    let key = (at >> 12) + 1;
    let slot = &READABLE[(key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 52) as usize % PAGES];
    if slot.load(Ordering::Relaxed) == key {
        return true;
    }
    let ok = check(pid, at);
    if ok {
        slot.store(key, Ordering::Relaxed);
    }
    ok
}

/// One byte of `at` copied by the kernel, which says EFAULT where this process could not
/// read it (unmapped, or mapped without read permission).
#[cold]
fn check(pid: u32, at: u64) -> bool {
    let mut byte = 0u8;
    let local = libc::iovec {
        iov_base: (&raw mut byte).cast(),
        iov_len: 1,
    };
    let remote = libc::iovec {
        iov_base: at as *mut core::ffi::c_void,
        iov_len: 1,
    };
    // SAFETY: copies one byte into `byte`; the kernel checks the remote address. Every
    // argument is a full register's width (a variadic call leaves an i32's upper half as it
    // was, and the kernel reads the whole register).
    let n = unsafe {
        libc::syscall(
            libc::SYS_process_vm_readv,
            libc::c_long::from(pid),
            &raw const local,
            1 as libc::c_ulong,
            &raw const remote,
            1 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    n == 1
}

/// Reads of the process's memory that never fault.
struct Mem {
    pid: u32,
}

impl Mem {
    /// The `width`-byte value at `at` (little-endian, not crossing an aligned word).
    #[inline(always)]
    fn field(&self, at: u64, width: u32) -> Option<u64> {
        let word = at & !7;
        if !(0x1_0000..=0x7fff_ffff_fff8).contains(&word) || !readable(self.pid, word) {
            return None;
        }
        // SAFETY: an aligned word of a readable page (`readable`).
        let w = unsafe { core::ptr::read_volatile(word as *const u64) };
        let v = w >> ((at & 7) * 8);
        Some(if width >= 8 {
            v
        } else {
            v & ((1u64 << (width * 8)) - 1)
        })
    }

    #[inline(always)]
    fn word(&self, at: u64) -> Option<u64> {
        self.field(at, 8)
    }
}

/// The calling thread's `PyThreadState`: its value of CPython's gilstate key, if that state
/// names this thread (the slot's owner) as its own.
#[inline(always)]
fn thread_state(m: &Mem, p: &PyProc, t: *mut ThreadHead) -> Option<u64> {
    if p.tss_key == 0 {
        return None;
    }
    // The `Py_tss_t`: an int, 1 once the key is made, then the key.
    let tss = m.word(p.runtime.checked_add(u64::from(p.tss_key))?)?;
    if tss as u32 != 1 {
        return None;
    }
    // SAFETY: any key number is safe to ask for (glibc checks it against its bounds and
    // sequence numbers); no allocation.
    let state = unsafe { libc::pthread_getspecific((tss >> 32) as libc::pthread_key_t) } as u64;
    if state == 0 {
        return None;
    }
    let id = m.field(state.checked_add(u64::from(p.native_thread_id))?, 4)?;
    // SAFETY: the slot's owner, written at its claim by this very thread.
    let me = unsafe { (*t).owner };
    (id as u32 == me).then_some(state)
}

/// Appends the Python frames of the calling thread (slot `t`) to the native frames
/// `ips[..n]`: the mark, then two words a frame, innermost first, as the kernel walk does
/// (shim frames skipped, at most `PY_FRAMES_MAX` frames, within the stack's words). Returns
/// the new length.
pub fn append(r: &Region, t: *mut ThreadHead, ips: &mut [u64], n: usize) -> usize {
    let Some(p) = interpreter(r) else {
        return n;
    };
    let limit = ips.len().min(STACK_FRAMES - 1);
    if n + 3 > limit {
        return n;
    }
    let m = Mem { pid: r.pid };
    let Some(state) = thread_state(&m, &p, t) else {
        return n;
    };
    let frame = if p.frame_path == PATH_CFRAME {
        m.word(state + u64::from(p.cframe))
            .filter(|c| *c != 0)
            .and_then(|c| m.word(c + u64::from(p.current_frame)))
    } else {
        m.word(state + u64::from(p.current_frame))
    };
    let Some(frame) = frame.filter(|f| *f != 0) else {
        return n;
    };
    ips[n] = PY_MARK;
    frames(&m, &p, frame, ips, n + 1, limit)
}

/// The frames from `frame` on, into `ips[out..limit]`; the new length.
fn frames(m: &Mem, p: &PyProc, frame: u64, ips: &mut [u64], mut out: usize, limit: usize) -> usize {
    let off = |base: u64, o: u32| base.wrapping_add(u64::from(o));
    let (mut next, mut taken) = (frame, 0);
    for _ in 0..PY_FRAMES_MAX * 2 {
        if next == 0 || out + 2 > limit || taken == PY_FRAMES_MAX {
            break;
        }
        let at = next;
        let (Some(owner), Some(code), Some(ip), Some(previous)) = (
            m.field(off(at, p.owner), 1),
            m.word(off(at, p.code)),
            m.word(off(at, p.instruction)),
            m.word(off(at, p.previous)),
        ) else {
            break;
        };
        next = previous;
        if owner as u8 == OWNED_BY_CSTACK {
            continue;
        }
        let entry = if p.is_entry != u32::MAX {
            m.field(off(at, p.is_entry), 1).is_some_and(|e| e != 0)
        } else {
            // 3.12+: the shim below an evaluation's first frame.
            next != 0 && m.field(off(next, p.owner), 1) == Some(u64::from(OWNED_BY_CSTACK))
        };
        if code == 0 {
            break;
        }
        let (Some(first_line), Some(qualname)) = (
            m.field(off(code, p.first_line), 4),
            m.word(off(code, p.qualname)),
        ) else {
            break;
        };
        // As the kernel walk: 0 where the string's head cannot be read, its text 0 where
        // that cannot.
        let name = match (m.word(off(qualname, 16)), m.field(off(qualname, 32), 4)) {
            (Some(length), Some(state)) => {
                let text = m.word(off(qualname, p.str_data)).unwrap_or(0);
                name_words(length, state as u32, text)
            }
            _ => 0,
        };
        let start = off(code, p.code_start);
        let unit = if ip > start { (ip - start) / 2 } else { 0 };
        ips[out] = frame_word(code, unit, entry);
        ips[out + 1] = identity_word(first_line as u32, qualname, name);
        out += 2;
        taken += 1;
    }
    out
}
