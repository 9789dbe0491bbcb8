//! The definitions this library stands in front of: the next `malloc`, `free`, ... after it
//! in the lookup order (`dlsym(RTLD_NEXT)`), found at the first call. dlsym itself may
//! allocate (its error buffer, with calloc): calls made while it runs on the resolving thread
//! are served from a static buffer, never freed.
use core::{
    ffi::{CStr, c_void},
    sync::atomic::{AtomicI32, AtomicU32, AtomicUsize, Ordering},
};

type Malloc = unsafe extern "C" fn(usize) -> *mut c_void;
type Calloc = unsafe extern "C" fn(usize, usize) -> *mut c_void;
type Realloc = unsafe extern "C" fn(*mut c_void, usize) -> *mut c_void;
type ReallocArray = unsafe extern "C" fn(*mut c_void, usize, usize) -> *mut c_void;
type Free = unsafe extern "C" fn(*mut c_void);
type PosixMemalign = unsafe extern "C" fn(*mut *mut c_void, usize, usize) -> i32;
type Aligned = unsafe extern "C" fn(usize, usize) -> *mut c_void;

/// The functions, in this order.
const NAMES: [&CStr; 10] = [
    c"malloc",
    c"calloc",
    c"realloc",
    c"reallocarray",
    c"free",
    c"posix_memalign",
    c"aligned_alloc",
    c"memalign",
    c"valloc",
    c"pvalloc",
];
static FNS: [AtomicUsize; 10] = [const { AtomicUsize::new(0) }; 10];

const UNRESOLVED: u32 = 0;
const RESOLVING: u32 = 1;
const RESOLVED: u32 = 2;
static STATE: AtomicU32 = AtomicU32::new(UNRESOLVED);
static RESOLVER: AtomicI32 = AtomicI32::new(0);

pub fn gettid() -> i32 {
    // SAFETY: no preconditions.
    unsafe { libc::syscall(libc::SYS_gettid) as i32 }
}

/// Whether the functions are known; false on the thread resolving them, while it does.
pub fn ready() -> bool {
    match STATE.load(Ordering::Acquire) {
        RESOLVED => true,
        RESOLVING if RESOLVER.load(Ordering::Relaxed) == gettid() => false,
        _ => {
            resolve();
            STATE.load(Ordering::Acquire) == RESOLVED
        }
    }
}

#[cold]
fn resolve() {
    let me = gettid();
    if STATE
        .compare_exchange(UNRESOLVED, RESOLVING, Ordering::AcqRel, Ordering::Acquire)
        .is_ok()
    {
        RESOLVER.store(me, Ordering::Relaxed);
        for (name, slot) in NAMES.iter().zip(FNS.iter()) {
            // SAFETY: a NUL-terminated name; RTLD_NEXT is valid in a shared object.
            let f = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) };
            slot.store(f as usize, Ordering::Relaxed);
        }
        if FNS[0].load(Ordering::Relaxed) == 0 || FNS[4].load(Ordering::Relaxed) == 0 {
            // No malloc behind us (cannot happen with a libc loaded): nothing to pass calls to.
            // SAFETY: no preconditions.
            unsafe { libc::abort() };
        }
        STATE.store(RESOLVED, Ordering::Release);
        return;
    }
    while STATE.load(Ordering::Acquire) != RESOLVED {
        // SAFETY: no preconditions.
        unsafe { libc::sched_yield() };
    }
}

const BOOT_BYTES: usize = 1 << 16;
#[repr(align(16))]
struct Boot(#[allow(dead_code)] [u8; BOOT_BYTES]);
static mut BOOT: Boot = Boot([0; BOOT_BYTES]);
static BOOT_USED: AtomicUsize = AtomicUsize::new(0);

fn boot_base() -> usize {
    core::ptr::addr_of!(BOOT) as usize
}

pub fn is_bootstrap(p: *mut c_void) -> bool {
    let p = p as usize;
    p >= boot_base() && p < boot_base() + BOOT_BYTES
}

/// `size` bytes of the static buffer, zeroed, after a 16-byte header holding the size.
fn boot_alloc(size: usize) -> *mut c_void {
    let need = (size.saturating_add(16 + 15)) & !15;
    let at = BOOT_USED.fetch_add(need, Ordering::Relaxed);
    if at.saturating_add(need) > BOOT_BYTES {
        return core::ptr::null_mut();
    }
    let base = boot_base() + at;
    // SAFETY: within the buffer, which nothing else hands out.
    unsafe { *(base as *mut usize) = size };
    (base + 16) as *mut c_void
}

/// The function at `i` of `NAMES`, if the allocator behind has it (a libc without
/// pvalloc, say: the call then fails as that libc would refuse it).
fn get(i: usize) -> Option<usize> {
    Some(FNS[i].load(Ordering::Relaxed)).filter(|f| *f != 0)
}

macro_rules! forward {
    ($name:ident, $i:expr, $t:ty, ($($a:ident: $at:ty),*) -> $r:ty, boot: $boot:expr, none: $none:expr) => {
        /// # Safety
        /// The C contract of the function named.
        pub unsafe fn $name($($a: $at),*) -> $r {
            if !ready() {
                return $boot;
            }
            match get($i) {
                // SAFETY: resolved to the named function, whose type this is.
                Some(f) => unsafe { core::mem::transmute::<usize, $t>(f)($($a),*) },
                None => $none,
            }
        }
    };
}

const NULL: *mut c_void = core::ptr::null_mut();

forward!(malloc, 0, Malloc, (size: usize) -> *mut c_void, boot: boot_alloc(size), none: NULL);
forward!(calloc, 1, Calloc, (n: usize, each: usize) -> *mut c_void,
    boot: n.checked_mul(each).map_or(NULL, boot_alloc), none: NULL);
forward!(realloc, 2, Realloc, (p: *mut c_void, size: usize) -> *mut c_void,
    boot: boot_alloc(size), none: NULL);
// An older libc without reallocarray: realloc with the product checked.
forward!(reallocarray, 3, ReallocArray, (p: *mut c_void, n: usize, each: usize) -> *mut c_void,
boot: n.checked_mul(each).map_or(NULL, boot_alloc),
none: match n.checked_mul(each) {
    Some(size) => unsafe { realloc(p, size) },
    None => NULL,
});
/// # Safety
/// The C contract of free.
pub unsafe fn free(p: *mut c_void) {
    // While dlsym runs, a leak: the block is of the real allocator, never seen here.
    if ready()
        && let Some(f) = get(4)
    {
        // SAFETY: resolved to free.
        unsafe { core::mem::transmute::<usize, Free>(f)(p) }
    }
}
forward!(posix_memalign, 5, PosixMemalign, (out: *mut *mut c_void, align: usize, size: usize) -> i32,
    boot: libc::ENOMEM, none: libc::ENOMEM);
forward!(aligned_alloc, 6, Aligned, (align: usize, size: usize) -> *mut c_void, boot: NULL, none: NULL);
forward!(memalign, 7, Aligned, (align: usize, size: usize) -> *mut c_void, boot: NULL, none: NULL);
forward!(valloc, 8, Malloc, (size: usize) -> *mut c_void, boot: NULL, none: NULL);
forward!(pvalloc, 9, Malloc, (size: usize) -> *mut c_void, boot: NULL, none: NULL);

/// A block of the static buffer moved to the real allocator (or within the buffer, while
/// dlsym runs).
///
/// # Safety
/// `old` is a block of the static buffer.
pub unsafe fn realloc_bootstrap(old: *mut c_void, size: usize) -> *mut c_void {
    // SAFETY: `old` is a block of the buffer: its size is in the word before it.
    let had = unsafe { *((old as usize - 16) as *const usize) };
    let new = unsafe { malloc(size) };
    if !new.is_null() {
        // SAFETY: both blocks hold at least the bytes copied.
        unsafe { core::ptr::copy_nonoverlapping(old as *const u8, new as *mut u8, had.min(size)) };
    }
    new
}

/// Attached to a running process (`attach`): the functions its modules call now, the first
/// definitions in its global scope (libc's, or an allocator linked or preloaded before it),
/// which this library, loaded local, is not part of (`got::defined`). Before any call can
/// reach it.
pub fn resolve_global() -> bool {
    ready();
    for (name, slot) in NAMES.iter().zip(FNS.iter()) {
        let f = crate::got::defined(name, name.to_bytes());
        slot.store(f, Ordering::Relaxed);
    }
    let ok = FNS[0].load(Ordering::Relaxed) != 0 && FNS[4].load(Ordering::Relaxed) != 0;
    STATE.store(RESOLVED, Ordering::Release);
    ok
}
