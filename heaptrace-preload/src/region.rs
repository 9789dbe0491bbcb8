//! The region shared with the daemon, mapped at the first call: its descriptor, size and
//! token come from the environment (`inproc::ENV`). Anything that does not check out leaves
//! the library passing every call straight through.
use core::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicU32, AtomicU64, Ordering};

use heaptrace_common::inproc::{self, Header, Layout};

use crate::real;

pub struct Region {
    pub base: *mut u8,
    pub layout: Layout,
    pub pid: u32,
    /// The header's settings as the region was taken. The program can write its header;
    /// calls read these instead, so that what it writes there never sends a call outside
    /// the mapping.
    pub fixed: Fixed,
}

/// The settings a call reads, copied from the header once.
#[derive(Clone, Copy)]
pub struct Fixed {
    pub mode: u32,
    pub threads: u32,
    pub sites: u32,
    pub site_index: u32,
    pub live: u32,
    pub sizes: u32,
    pub shared_sizes: u32,
    pub depth: u32,
    pub latency_every: u32,
    pub temporary_allocs: u32,
    pub count_as: [u32; heaptrace_common::FUNC_COUNT],
}

impl Fixed {
    const ZERO: Fixed = Fixed {
        mode: 0,
        threads: 0,
        sites: 0,
        site_index: 0,
        live: 0,
        sizes: 0,
        shared_sizes: 0,
        depth: 0,
        latency_every: 0,
        temporary_allocs: 0,
        count_as: [0; heaptrace_common::FUNC_COUNT],
    };

    fn of(h: &Header) -> Fixed {
        Fixed {
            mode: h.mode,
            threads: h.threads,
            sites: h.sites,
            site_index: h.site_index,
            live: h.live,
            sizes: h.sizes,
            shared_sizes: h.shared_sizes,
            depth: h.depth,
            latency_every: h.latency_every,
            temporary_allocs: h.temporary_allocs,
            count_as: h.count_as,
        }
    }
}

// SAFETY: the region is shared memory; every access to it goes through atomics or a thread's
// own slot.
unsafe impl Sync for Region {}

impl Region {
    pub fn header_ptr(&self) -> *mut Header {
        self.base as *mut Header
    }

    /// Whether calls are to be counted now.
    #[inline(always)]
    pub fn counting(&self) -> bool {
        // SAFETY: a u32 of the header, read atomically.
        let state = unsafe { AtomicU32::from_ptr(&raw mut (*self.header_ptr()).state) };
        state.load(Ordering::Relaxed) == inproc::state::COUNTING && !FORKED.load(Ordering::Relaxed)
    }

    pub fn at<T>(&self, offset: usize) -> *mut T {
        // SAFETY: offsets come from `layout`, within the mapping.
        unsafe { self.base.add(offset) as *mut T }
    }
}

const NOT_TRIED: i32 = 0;
const MAPPING: i32 = 1;
const DONE: i32 = 2;
static INIT: AtomicI32 = AtomicI32::new(NOT_TRIED);
static MAPPER: AtomicI32 = AtomicI32::new(0);
static REGION: AtomicPtr<Region> = AtomicPtr::new(core::ptr::null_mut());
static mut THE_REGION: Region = Region::EMPTY;

impl Region {
    const EMPTY: Region = Region {
        base: core::ptr::null_mut(),
        layout: Layout {
            thread_stride: 0,
            threads: 0,
            sizes_at: 0,
            sites_at: 0,
            latency_at: 0,
            index: 0,
            stacks: 0,
            stack_stride: 0,
            live: 0,
            lifetimes: 0,
            shared_sizes_at: 0,
            shared_sizes: 0,
            unwind: 0,
            caches: 0,
            rows: 0,
            unwind_rows: 0,
            bytes: 0,
        },
        pid: 0,
        fixed: Fixed::ZERO,
    };
}
/// Set in a fork's child: it counts nothing (the region is its parent's).
static FORKED: AtomicBool = AtomicBool::new(false);

/// The region, once mapped; None before, while mapping on this thread, or if there is none.
#[inline(always)]
pub fn get() -> Option<&'static Region> {
    if INIT.load(Ordering::Acquire) == DONE {
        let r = REGION.load(Ordering::Relaxed);
        // SAFETY: set once, before DONE, to a static.
        return unsafe { r.as_ref() };
    }
    init()
}

#[cold]
fn init() -> Option<&'static Region> {
    if !real::ready() {
        return None;
    }
    let me = real::gettid();
    match INIT.compare_exchange(NOT_TRIED, MAPPING, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => {
            MAPPER.store(me, Ordering::Relaxed);
            if let Some(r) = map() {
                // SAFETY: written once, by the one thread that won INIT, before it is published.
                unsafe {
                    THE_REGION = r;
                    REGION.store(&raw mut THE_REGION, Ordering::Relaxed);
                }
                crate::thread::init();
            }
            INIT.store(DONE, Ordering::Release);
        }
        Err(MAPPING) if MAPPER.load(Ordering::Relaxed) == me => return None,
        Err(_) => {
            while INIT.load(Ordering::Acquire) != DONE {
                // SAFETY: no preconditions.
                unsafe { libc::sched_yield() };
            }
        }
    }
    let r = REGION.load(Ordering::Relaxed);
    // SAFETY: as in `get`.
    unsafe { r.as_ref() }
}

extern "C" fn forked_child() {
    FORKED.store(true, Ordering::Relaxed);
}

/// Parses `FD:SIZE:TOKEN` (decimal, decimal, 32 hex digits).
fn parse(s: &[u8]) -> Option<(i32, u64, [u64; 2])> {
    let mut parts = s.split(|b| *b == b':');
    let fd = dec(parts.next()?)?;
    let size = dec(parts.next()?)?;
    let token = parts.next()?;
    if parts.next().is_some() || token.len() != 32 {
        return None;
    }
    Some((
        i32::try_from(fd).ok()?,
        size,
        [hex(&token[..16])?, hex(&token[16..])?],
    ))
}

fn dec(s: &[u8]) -> Option<u64> {
    if s.is_empty() || s.len() > 19 {
        return None;
    }
    s.iter().try_fold(0u64, |n, b| {
        b.is_ascii_digit().then(|| n * 10 + u64::from(b - b'0'))
    })
}

fn hex(s: &[u8]) -> Option<u64> {
    s.iter().try_fold(0u64, |n, b| {
        let d = (*b as char).to_digit(16)?;
        Some(n << 4 | u64::from(d))
    })
}

/// Regions taken by attaches, one each: a region stays mapped after its detach, since a call
/// that was running then may still count into it.
const MAX_ATTACHES: usize = 64;
static mut ATTACHED: [Region; MAX_ATTACHES] = [const { Region::EMPTY }; MAX_ATTACHES];
static ATTACHES: AtomicU32 = AtomicU32::new(0);

/// Attached to a running process: the region heaptrace made in it, at descriptor `fd`, mapped
/// and taken as `map` does from the environment, and made the one calls count into (an
/// earlier attach's is left as it is). False if it does not check out, if the process has a
/// region from its environment (it was launched by heaptrace), or after `MAX_ATTACHES`.
pub fn adopt(fd: i32, size: u64, token: [u64; 2]) -> bool {
    let n = ATTACHES.load(Ordering::Relaxed) as usize;
    if n >= MAX_ATTACHES || (n == 0 && get().is_some()) {
        return false;
    }
    let Some(r) = map_fd(fd, size, token) else {
        return false;
    };
    // SAFETY: one attach at a time (heaptrace's call, on one thread), into a slot no call
    // has seen; published after it is written.
    unsafe {
        let slot = &raw mut ATTACHED[n];
        *slot = r;
        ATTACHES.store(n as u32 + 1, Ordering::Relaxed);
        REGION.store(slot, Ordering::Release);
    }
    // A key of its own: the values of an earlier one are slots of an earlier region.
    crate::thread::init();
    INIT.store(DONE, Ordering::Release);
    true
}

/// Maps the region and takes it for this process; None if anything does not check out.
fn map() -> Option<Region> {
    // SAFETY: a NUL-terminated name; getenv does not allocate.
    let env = unsafe { libc::getenv(c"HEAPTRACE_INPROC".as_ptr()) };
    if env.is_null() {
        return None;
    }
    // SAFETY: getenv returns a NUL-terminated string.
    let (fd, size, token) = parse(unsafe { core::ffi::CStr::from_ptr(env) }.to_bytes())?;
    map_fd(fd, size, token)
}

fn map_fd(fd: i32, size: u64, token: [u64; 2]) -> Option<Region> {
    // SAFETY: a plain struct for fstat to fill.
    let mut st: libc::stat = unsafe { core::mem::zeroed() };
    // SAFETY: fstat on any number is harmless; it only fills `st`.
    if unsafe { libc::fstat(fd, &mut st) } != 0
        || st.st_mode & libc::S_IFMT != libc::S_IFREG
        || st.st_size as u64 != size
        || size < inproc::HEADER_BYTES as u64
    {
        return None;
    }
    // SAFETY: a new shared mapping of a regular file of the size checked.
    let base = unsafe {
        libc::mmap(
            core::ptr::null_mut(),
            size as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        tell_failure(fd, token, inproc::failure::MAP);
        return None;
    }
    let r = take(base as *mut u8, fd, size, token);
    if r.is_none() {
        // SAFETY: the mapping just made.
        unsafe { libc::munmap(base, size as usize) };
    }
    r
}

/// Tells the daemon why the region could not be taken, in its header, if the descriptor is
/// the region (its token checks out).
fn tell_failure(fd: i32, token: [u64; 2], why: u32) {
    // SAFETY: a new shared mapping of the first page, whose size was checked.
    let page = unsafe {
        libc::mmap(
            core::ptr::null_mut(),
            inproc::HEADER_BYTES,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if page == libc::MAP_FAILED {
        return;
    }
    let h = page as *mut Header;
    // SAFETY: the header's page, just mapped; its words read and written whole.
    unsafe {
        if (*h).magic == inproc::MAGIC && (*h).token == token {
            AtomicU32::from_ptr(&raw mut (*h).failure).store(why, Ordering::Release);
        }
        libc::munmap(page, inproc::HEADER_BYTES);
    }
}

fn take(base: *mut u8, fd: i32, size: u64, token: [u64; 2]) -> Option<Region> {
    // SAFETY: at least a header's bytes are mapped (checked by the caller).
    let h = unsafe { &*(base as *const Header) };
    let layout = Layout::of_header(h)?;
    if h.magic != inproc::MAGIC
        || h.version != inproc::VERSION
        || h.token != token
        || h.bytes != size
        || layout.bytes as u64 > size
    {
        return None;
    }
    // SAFETY: no preconditions.
    let pid = unsafe { libc::getpid() } as u32;
    // SAFETY: a u32 of the mapped header.
    let owner = unsafe { AtomicU32::from_ptr(&raw mut (*(base as *mut Header)).owner) };
    match owner.compare_exchange(0, pid, Ordering::AcqRel, Ordering::Relaxed) {
        Ok(_) => {}
        // The traced process exec'ed: its earlier image, and every thread of it, is gone.
        Err(o) if o == pid => start_over(base, fd, &layout)?,
        // Another process's region: this one is a fork's exec.
        Err(_) => return None,
    }
    // SAFETY: registers a handler; no allocation for the first handlers.
    unsafe { libc::pthread_atfork(None, None, Some(forked_child)) };
    let fixed = Fixed::of(h);
    Some(Region {
        base,
        layout,
        pid,
        fixed,
    })
}

/// A new image of the traced process takes the region over: everything but the header and
/// the unwind rows is emptied (`Layout::emptied_at_exec`: the file's pages given back, not
/// written), the header's shared counts zeroed, and the epoch moved on, so that the daemon
/// drops what the earlier image counted. The epoch is 0 while this runs: a read of the region
/// meanwhile is not taken.
fn start_over(base: *mut u8, fd: i32, layout: &Layout) -> Option<()> {
    let h = base as *mut Header;
    // SAFETY: words of the mapped header; no thread of an earlier image runs any more.
    unsafe {
        let epoch = AtomicU32::from_ptr(&raw mut (*h).epoch);
        let next = epoch.swap(0, Ordering::AcqRel).wrapping_add(1).max(1);
        let (from, to) = layout.emptied_at_exec();
        let punched = libc::fallocate(
            fd,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            from as i64,
            (to - from) as i64,
        ) == 0;
        if !punched {
            epoch.store(next - 1, Ordering::Release);
            return None;
        }
        (*h).threads_used = 0;
        (*h).sites_used = 0;
        (*h).losses = [0; heaptrace_common::LOSS_COUNT];
        (*h).peak_live = 0;
        (*h).peak_max = 0;
        (*h).peak_size = 0;
        (*h).peak_stack = heaptrace_common::NO_SITE as i64;
        (*h).peak_seq = 0;
        (*h).peak_pending = 0;
        // The earlier image's interpreter is gone: the daemon finds the new one's.
        AtomicU64::from_ptr(&raw mut (*h).py_seq).store(0, Ordering::Release);
        epoch.store(next, Ordering::Release);
    }
    Some(())
}
