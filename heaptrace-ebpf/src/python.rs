//! Python frames at an allocation: for a process whose CPython user space found (`PY_PROCS`),
//! the walk appends after the native frames a mark and two words per Python frame
//! (`heaptrace_common::python`), innermost first: the thread's state (found once by its id in
//! its pid namespace, then cached per thread), its current frame, and each caller's.
//!
//! A frame a `bpf_loop` step, as the native walk's; each reads its code object's first 256
//! bytes and its name's head. Frames come in windows: a thread pushes its frames on its data
//! stack one after another, so one read of the innermost frame and what lies below it
//! usually holds its callers too (each read costs ~0.07 us here).
use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, generated},
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray},
};
use heaptrace_common::{
    STACK_FRAMES, StoredStack,
    python::{
        OWNED_BY_CSTACK, PATH_CFRAME, PY_FRAMES_MAX, PY_MARK, PyProc, frame_word, identity_word,
        name_words,
    },
    stack::hash_step,
};

/// Each Python process's interpreter, by tgid (user space writes it when it finds one).
#[map(name = "PY_PROCS")]
pub static PY_PROCS: HashMap<u32, PyProc> = HashMap::with_max_entries(1024, 1);

/// 1 once user space put any process in `PY_PROCS`: until then no walk looks there (a hash
/// lookup an allocation, for nothing, on a host with no Python traced).
#[map(name = "PY_ON")]
pub static PY_ON: Array<u32> = Array::with_max_entries(1, 0);

/// Each thread's state, by its global thread id: (tgid << 32 | namespaced id, state).
#[map(name = "PY_THREADS")]
pub static PY_THREADS: LruHashMap<u32, [u64; 2]> = LruHashMap::with_max_entries(16384, 0);

/// This CPU's last thread found in `PY_THREADS`, as (its global id, then its entry there):
/// most allocations here come from the thread of the one before, and this read costs no hash
/// lookup (~50 ns). Checked as the map's entries are.
#[map(name = "PY_THREAD_LAST")]
static PY_THREAD_LAST: PerCpuArray<[u64; 3]> = PerCpuArray::with_max_entries(1, 0);

/// Words of a code object read at once (a power of two). Every offset read lies within them,
/// and a frame's within 128 bytes of its first: user space checks (`unwind/python.rs`).
pub const CODE_WORDS: usize = 32;
/// Frames read at once: the frame walked next and up to this much below it, within the
/// pages the frame itself lies in (a read never faults where the frame's own would not).
const WINDOW_WORDS: usize = 64;
const WINDOW_BYTES: u64 = 8 * WINDOW_WORDS as u64;
const PAGE: u64 = 4096;
/// Words of a thread's state read at once where its id and its frame's pointer both lie in
/// them (every version supported: below 168 bytes): one read instead of two a walk.
const TSTATE_WORDS: usize = 32;

#[repr(C)]
pub struct PyScratch {
    window: [u64; WINDOW_WORDS],
    /// Where `window` was read from, its bytes read (0: none yet in this walk), and whose
    /// (a walk preempted by another process's on this CPU does not read its window).
    window_at: u64,
    window_len: u64,
    window_tgid: u64,
    /// What of a frame the walk reads: its bytes `span_lo` to `span_hi`.
    span_lo: u64,
    span_hi: u64,
    code: [u64; CODE_WORDS],
    tstate: [u64; TSTATE_WORDS],
    /// The state `tstate` holds the words of, or 0.
    tstate_at: u64,
    /// The frame to read next, then the next's.
    next: u64,
    n: u64,
    hash: u64,
}

#[map(name = "PY_SCRATCH")]
static PY_SCRATCH: PerCpuArray<PyScratch> = PerCpuArray::with_max_entries(1, 0);

/// Whether user space found CPython in process `tgid` (its frames are walked).
#[inline(always)]
pub fn is_python(tgid: u32) -> bool {
    PY_ON.get(0).is_some_and(|on| *on != 0) && PY_PROCS.get_ptr(&tgid).is_some()
}

/// Threads looked through at most to find one's state.
const THREADS_MAX: u32 = 256;

fn read<const N: usize>(to: &mut [u64; N], from: u64) -> bool {
    // SAFETY: bpf_probe_read_user checks the user address; the size is the buffer's.
    unsafe {
        generated::bpf_probe_read_user(
            to.as_mut_ptr().cast(),
            (N * 8) as u32,
            from as *const core::ffi::c_void,
        ) == 0
    }
}

fn read_u64(from: u64) -> Option<u64> {
    let mut w = [0u64; 1];
    read(&mut w, from).then_some(w[0])
}

/// The `width`-byte value at byte `at` of the window (little-endian, not crossing a word): the
/// index masked, behind `black_box`, so that LLVM keeps the mask the verifier bounds it by.
#[inline(always)]
fn window_field(w: &[u64; WINDOW_WORDS], at: u64, width: u32) -> u64 {
    let v = w[core::hint::black_box(at >> 3) as usize & (WINDOW_WORDS - 1)] >> ((at & 7) * 8);
    if width >= 8 {
        v
    } else {
        v & ((1u64 << (width * 8)) - 1)
    }
}

/// Where the frame at `at` begins in the window (its byte `span_lo`), read now if the window
/// does not hold it; None if it cannot be read.
#[inline(always)]
fn in_window(sc: &mut PyScratch, tgid: u64, at: u64) -> Option<u64> {
    let from = at.checked_add(sc.span_lo)?;
    let end = at.checked_add(sc.span_hi)?;
    if sc.window_tgid == tgid
        && from >= sc.window_at
        && end <= sc.window_at.wrapping_add(sc.window_len)
    {
        return Some(from - sc.window_at);
    }
    let start = end.saturating_sub(WINDOW_BYTES).max(from & !(PAGE - 1));
    let len = core::hint::black_box(end - start);
    if len == 0 || len > WINDOW_BYTES {
        return None;
    }
    sc.window_len = 0;
    // SAFETY: bpf_probe_read_user checks the user address; `len` fits the window.
    let ok = unsafe {
        generated::bpf_probe_read_user(
            sc.window.as_mut_ptr().cast(),
            len as u32,
            start as *const core::ffi::c_void,
        ) == 0
    };
    if !ok {
        return None;
    }
    (sc.window_at, sc.window_len, sc.window_tgid) = (start, len, tgid);
    Some(from - start)
}

/// The `width`-byte value at byte `off` of `words` (little-endian, not crossing a word).
/// The index is masked, not compared: a compared one reached the verifier unbounded.
#[inline(always)]
fn field<const N: usize>(words: &[u64; N], off: u32, width: u32) -> u64 {
    if off >= (N * 8) as u32 {
        return 0;
    }
    let w = words[((off >> 3) as usize) & (N - 1)];
    let v = w >> ((off & 7) * 8);
    if width >= 8 {
        v
    } else {
        v & ((1u64 << (width * 8)) - 1)
    }
}

/// This thread's id in the process's pid namespace.
fn ns_tid(p: &PyProc) -> Option<u32> {
    if p.ns_ino == 0 {
        return Some(bpf_get_current_pid_tgid() as u32);
    }
    let mut info = aya_ebpf::bindings::bpf_pidns_info { pid: 0, tgid: 0 };
    // SAFETY: `info` is ours, of the size given.
    let r = unsafe {
        generated::bpf_get_ns_current_pid_tgid(
            p.ns_dev,
            p.ns_ino,
            &mut info,
            core::mem::size_of::<aya_ebpf::bindings::bpf_pidns_info>() as u32,
        )
    };
    (r == 0).then_some(info.pid)
}

struct Search {
    at: u64,
    want: u32,
    p: *const PyProc,
    found: u64,
}

extern "C" fn search_step(_i: u64, ctx: *mut core::ffi::c_void) -> i64 {
    // SAFETY: `thread_state`'s Search, alive for the loop.
    let s = unsafe { &mut *ctx.cast::<Search>() };
    // SAFETY: a PY_PROCS value, alive for the program's run.
    let p = unsafe { &*s.p };
    if s.at == 0 {
        return 1;
    }
    let mut id = [0u64; 1];
    if !read(&mut id, s.at + u64::from(p.native_thread_id)) {
        return 1;
    }
    if id[0] as u32 == s.want {
        s.found = s.at;
        return 1;
    }
    match read_u64(s.at + u64::from(p.thread_next)) {
        Some(next) => s.at = next,
        None => return 1,
    }
    0
}

/// Whether a thread state's id and frame pointer lie in its first [`TSTATE_WORDS`].
#[inline(always)]
fn tstate_fits(p: &PyProc) -> bool {
    let within = |off: u32| off < (TSTATE_WORDS * 8 - 8) as u32;
    let frame = if p.frame_path == PATH_CFRAME {
        p.cframe
    } else {
        p.current_frame
    };
    within(p.native_thread_id) && within(frame)
}

/// The calling thread's `PyThreadState`, 0 if it has none (yet). Found by the cache, its
/// first words are left in `sc.tstate` (`tstate_at`) where they hold what the walk needs.
fn thread_state(tgid: u32, p: &PyProc, sc: &mut PyScratch) -> u64 {
    sc.tstate_at = 0;
    let tid = bpf_get_current_pid_tgid() as u32;
    let Some(ns) = ns_tid(p) else { return 0 };
    let key = u64::from(tgid) << 32 | u64::from(ns);
    let last = PY_THREAD_LAST.get_ptr_mut(0);
    // SAFETY: this CPU's value, copied (a task preempting this one may rewrite it: the state's
    // own id is checked below all the same).
    let (in_last, cached) = match last.map(|l| unsafe { *l }) {
        Some([t, k, state]) if t == u64::from(tid) && k == key => (true, Some(state)),
        // SAFETY: a copy of the value.
        _ => (
            false,
            unsafe { PY_THREADS.get(&tid) }
                .filter(|v| v[0] == key)
                .map(|v| v[1]),
        ),
    };
    if let Some(state) = cached {
        // Still this thread's (a state freed and reused for another thread says so).
        let mine = if tstate_fits(p) && read(&mut sc.tstate, state) {
            let mine = field(&sc.tstate, p.native_thread_id, 4) as u32 == ns;
            sc.tstate_at = if mine { state } else { 0 };
            mine
        } else {
            read_u64(state + u64::from(p.native_thread_id)).is_some_and(|id| id as u32 == ns)
        };
        if mine {
            if let (false, Some(l)) = (in_last, last) {
                // SAFETY: this CPU's value.
                unsafe { *l = [u64::from(tid), key, state] };
            }
            return state;
        }
    }
    let Some(interp) = read_u64(p.runtime + u64::from(p.interpreters_head)) else {
        return 0;
    };
    let Some(head) = read_u64(interp + u64::from(p.threads_head)) else {
        return 0;
    };
    let mut s = Search {
        at: head,
        want: ns,
        p,
        found: 0,
    };
    // SAFETY: the callback is a static function; its context lives on this stack.
    unsafe {
        generated::bpf_loop(
            THREADS_MAX,
            search_step as *mut core::ffi::c_void,
            (&raw mut s).cast(),
            0,
        )
    };
    if s.found != 0 {
        let _ = PY_THREADS.insert(&tid, &[key, s.found], 0);
        if let Some(l) = last {
            // SAFETY: this CPU's value.
            unsafe { *l = [u64::from(tid), key, s.found] };
        }
    }
    s.found
}

struct Walk {
    tgid: u64,
    p: *const PyProc,
    scratch: *mut PyScratch,
    stack: *mut StoredStack,
}

/// One Python frame: 0 to go on, 1 to stop.
extern "C" fn frame_step(_i: u64, ctx: *mut core::ffi::c_void) -> i64 {
    // SAFETY: `append`'s Walk; map values alive for the program's run.
    let (tgid, p, sc, st) = unsafe {
        let w = &*ctx.cast::<Walk>();
        (w.tgid, &*w.p, &mut *w.scratch, &mut *w.stack)
    };
    let at = sc.next;
    let n = sc.n;
    if at == 0 || n + 2 > STACK_FRAMES as u64 - 1 {
        return 1;
    }
    let Some(base) = in_window(sc, tgid, at) else {
        return 1;
    };
    // Offsets from the span's start (user space keeps every one within FRAME_BYTES of it).
    let f = |off: u32, width: u32| {
        let rel = u64::from(off).wrapping_sub(sc.span_lo);
        window_field(&sc.window, base.wrapping_add(rel), width)
    };
    let owner = f(p.owner, 1) as u8;
    let code = f(p.code, 8);
    let ip = f(p.instruction, 8);
    let mut entry = p.is_entry != u32::MAX && f(p.is_entry, 1) != 0;
    sc.next = f(p.previous, 8);
    if owner == OWNED_BY_CSTACK {
        return 0;
    }
    if p.is_entry == u32::MAX && sc.next != 0 {
        // 3.12+: the shim below an evaluation's first frame (the next step's frame, so
        // the window read for it here serves that step too).
        let rel = u64::from(p.owner).wrapping_sub(sc.span_lo);
        entry = in_window(sc, tgid, sc.next).is_some_and(|b| {
            window_field(&sc.window, b.wrapping_add(rel), 1) as u8 == OWNED_BY_CSTACK
        });
    }
    if code == 0 || !read(&mut sc.code, code) {
        return 1;
    }
    let start = code + u64::from(p.code_start);
    let unit = if ip > start { (ip - start) / 2 } else { 0 };
    let first = frame_word(code, unit, entry);
    let qualname = field(&sc.code, p.qualname, 8);
    let id = identity_word(
        field(&sc.code, p.first_line, 4) as u32,
        qualname,
        qualname_words(p, qualname),
    );
    let (Some(a), Some(b)) = (
        st.ips.get_mut(n as usize).map(|s| s as *mut u64),
        st.ips.get_mut(n as usize + 1).map(|s| s as *mut u64),
    ) else {
        return 1;
    };
    // SAFETY: slots of the scratch stack, checked above.
    unsafe {
        *a = first;
        *b = id;
    }
    sc.hash = hash_step(hash_step(sc.hash, first), id);
    sc.n = n + 2;
    0
}

/// The bytes of a frame the walk reads its fields from: (first, past the last), 8-aligned.
#[inline(always)]
fn frame_span(p: &PyProc) -> (u64, u64) {
    let mut lo = p.code.min(p.previous).min(p.instruction).min(p.owner);
    let mut hi = (p.code.max(p.previous).max(p.instruction) + 8).max(p.owner + 1);
    if p.is_entry != u32::MAX {
        (lo, hi) = (lo.min(p.is_entry), hi.max(p.is_entry + 1));
    }
    (u64::from(lo & !7), u64::from((hi + 7) & !7))
}

/// Bytes of a `co_qualname` read at once from its offset 16: its length, hash, state and
/// its first 8 characters (at 40 from 3.12, at 48 in 3.11).
const NAME_HEAD: u32 = 40;

/// [`name_words`] of the string at `qualname`: one read where its characters begin at 40 or
/// 48 (each read is most of a frame's cost), else two.
#[inline(always)]
fn qualname_words(p: &PyProc, qualname: u64) -> u64 {
    // Constant indexes: a variable one into the stack is refused by the verifier.
    let word = match p.str_data {
        40 => Some(3),
        48 => Some(4),
        _ => None,
    };
    // Not zeroed first: LLVM zeroes with a call to a byte loop (~30 ns a frame here).
    let mut head = core::mem::MaybeUninit::<[u64; 5]>::uninit();
    if let Some(word) = word {
        // SAFETY: bpf_probe_read_user checks the user address; the size is `head`'s.
        let ok = unsafe {
            generated::bpf_probe_read_user(
                head.as_mut_ptr().cast(),
                NAME_HEAD,
                qualname.wrapping_add(16) as *const core::ffi::c_void,
            ) == 0
        };
        if ok {
            // SAFETY: all of it read just now.
            let head = unsafe { head.assume_init() };
            let text = if word == 3 { head[3] } else { head[4] };
            return name_words(head[0], head[2] as u32, text);
        }
    }
    let mut head = [0u64; 4];
    if !read(&mut head, qualname.wrapping_add(16)) {
        return 0;
    }
    let text = read_u64(qualname.wrapping_add(u64::from(p.str_data))).unwrap_or(0);
    name_words(head[0], head[2] as u32, text)
}

/// The process exec'ed: the interpreter user space found was the old image's, and reading
/// it in the new one (a Python's subprocess) walks junk at every allocation. A new image that
/// is Python gets its entry at user space's next read of its mappings.
#[inline(always)]
pub fn exec(tgid: u32) {
    if PY_ON.get(0).is_some_and(|on| *on != 0) {
        let _ = PY_PROCS.remove(&tgid);
    }
}

/// Appends the Python frames of the calling thread of `tgid` to `stack` (frames `n` on,
/// hash `hash` so far): the mark, then two words a frame. Returns the new (n, hash).
///
/// The work is a one-step `bpf_loop`: the verifier checks a callback once, where inlined
/// into the return program it followed it on each of the program's paths (500k instructions
/// verified instead of 230k).
#[inline(always)]
pub fn append(tgid: u32, stack: &mut StoredStack, n: u64, hash: u64) -> (u64, u64) {
    if PY_ON.get(0).is_none_or(|on| *on == 0) {
        return (n, hash);
    }
    let mut a = Append {
        tgid,
        stack,
        n,
        hash,
    };
    // SAFETY: the callback is a static function; its context lives on this stack.
    unsafe {
        generated::bpf_loop(
            1,
            append_step as *mut core::ffi::c_void,
            (&raw mut a).cast(),
            0,
        )
    };
    (a.n, a.hash)
}

struct Append {
    tgid: u32,
    stack: *mut StoredStack,
    n: u64,
    hash: u64,
}

#[inline(never)]
extern "C" fn append_step(_i: u64, ctx: *mut core::ffi::c_void) -> i64 {
    // SAFETY: `append`'s Append, alive for the loop; its stack is a map value.
    let a = unsafe { &mut *ctx.cast::<Append>() };
    // SAFETY: as above.
    let stack = unsafe { &mut *a.stack };
    (a.n, a.hash) = append_now(a.tgid, stack, a.n, a.hash);
    1
}

#[inline(always)]
fn append_now(tgid: u32, stack: &mut StoredStack, n: u64, hash: u64) -> (u64, u64) {
    // SAFETY: a map value pointer, alive for the program's run.
    let Some(p) = (unsafe { PY_PROCS.get(&tgid) }) else {
        return (n, hash);
    };
    let Some(sc) = PY_SCRATCH.get_ptr_mut(0) else {
        return (n, hash);
    };
    // SAFETY: this CPU's scratch, ours for the program's run.
    let tstate = thread_state(tgid, p, unsafe { &mut *sc });
    if tstate == 0 || n + 3 > STACK_FRAMES as u64 - 1 {
        return (n, hash);
    }
    // SAFETY: as above.
    let words = unsafe { &(*sc).tstate };
    let at = |off: u32| match unsafe { (*sc).tstate_at } == tstate {
        true => Some(field(words, off, 8)),
        false => read_u64(tstate + u64::from(off)),
    };
    let frame = if p.frame_path == PATH_CFRAME {
        at(p.cframe)
            .filter(|c| *c != 0)
            .and_then(|c| read_u64(c + u64::from(p.current_frame)))
    } else {
        at(p.current_frame)
    };
    let Some(frame) = frame.filter(|f| *f != 0) else {
        return (n, hash);
    };
    let Some(slot) = stack.ips.get_mut(n as usize) else {
        return (n, hash);
    };
    *slot = PY_MARK;
    // SAFETY: this CPU's scratch, alive for the program's run.
    let s = unsafe { &mut *sc };
    s.next = frame;
    s.window_len = 0;
    (s.span_lo, s.span_hi) = frame_span(p);
    s.n = n + 1;
    s.hash = hash_step(hash, PY_MARK);
    let mut w = Walk {
        tgid: u64::from(tgid),
        p,
        scratch: sc,
        stack,
    };
    // SAFETY: the callback is a static function; its context lives on this stack.
    unsafe {
        generated::bpf_loop(
            PY_FRAMES_MAX * 2,
            frame_step as *mut core::ffi::c_void,
            (&raw mut w).cast(),
            0,
        )
    };
    // SAFETY: as above.
    let s = unsafe { &*sc };
    (s.n, s.hash)
}
