//! The malloc family redirected in a running process (`heaptrace -p PID --in-process`): the
//! GOT entry of each of its functions, in every loaded module but this library, is written
//! with this library's function, and the value it held kept to be written back at the
//! detach. `JUMP_SLOT` (calls through the PLT) and `GLOB_DAT` (`-fno-plt`, and libc's own
//! malloc and free) both. Everything read here is the process's memory: every count is
//! bounded and a module whose dynamic section does not check out is left alone.
use core::{
    ffi::{c_int, c_void},
    sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
};

/// The entries written at most; beyond, left alone (`lost`).
const MAX_SLOTS: usize = 4096;
/// The relocations read at most in one table: a bigger one is not a module's.
const MAX_RELOCS: usize = 1 << 20;
const R_X86_64_GLOB_DAT: u32 = 6;
const R_X86_64_JUMP_SLOT: u32 = 7;
const DT_NULL: i64 = 0;
const DT_PLTRELSZ: i64 = 2;
const DT_STRTAB: i64 = 5;
const DT_SYMTAB: i64 = 6;
const DT_RELA: i64 = 7;
const DT_RELASZ: i64 = 8;
const DT_STRSZ: i64 = 10;
const DT_JMPREL: i64 = 23;
const PT_LOAD: u32 = 1;
const PT_DYNAMIC: u32 = 2;
const PT_GNU_RELRO: u32 = 0x6474e552;

#[derive(Clone, Copy)]
struct Slot {
    at: usize,
    old: usize,
    /// In the module's RELRO pages: made writable around each write.
    relro: bool,
}

static mut SLOTS: [Slot; MAX_SLOTS] = [Slot {
    at: 0,
    old: 0,
    relro: false,
}; MAX_SLOTS];
static USED: AtomicUsize = AtomicUsize::new(0);
/// Entries found that could not be written (no room, or a page that would not open).
static LOST: AtomicUsize = AtomicUsize::new(0);

#[repr(C)]
struct Dyn {
    tag: i64,
    val: u64,
}

#[repr(C)]
struct Rela {
    offset: u64,
    info: u64,
    addend: i64,
}

#[repr(C)]
struct Sym {
    name: u32,
    info: u8,
    other: u8,
    shndx: u16,
    value: u64,
    size: u64,
}

/// The functions redirected, in the order heaptrace gives their addresses in this library.
/// Taken here, `malloc as usize` would be the process's first definition (libc's), as for
/// any symbol a shared library exports; heaptrace reads them from the library's own symbols.
pub const NAMES: [&[u8]; 10] = [
    b"malloc",
    b"calloc",
    b"realloc",
    b"reallocarray",
    b"free",
    b"posix_memalign",
    b"aligned_alloc",
    b"memalign",
    b"valloc",
    b"pvalloc",
];
static OURS: [AtomicUsize; 10] = [const { AtomicUsize::new(0) }; 10];

fn ours(name: &[u8]) -> Option<usize> {
    if name == b"dlsym" {
        return Some(crate::later::dlsym as *const () as usize);
    }
    let i = NAMES.iter().position(|n| *n == name)?;
    Some(OURS[i].load(Ordering::Relaxed)).filter(|f| *f != 0)
}

/// Held while entries are written or written back: by the attach, the detach, and a
/// `dlsym` that found modules loaded since the last pass (`later`), on any thread.
static WRITING: AtomicBool = AtomicBool::new(false);
/// Redirected, and not written back since.
static ATTACHED: AtomicBool = AtomicBool::new(false);
/// The loader's count of modules loaded (`dlpi_adds`) at the last pass.
static ADDS: AtomicU64 = AtomicU64::new(0);

/// Takes `WRITING`, trying at most `tries` times (yielding between): false if not taken.
fn lock(tries: u32) -> bool {
    for _ in 0..tries {
        if WRITING
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            return true;
        }
        // SAFETY: no preconditions.
        unsafe { libc::sched_yield() };
    }
    false
}

fn unlock() {
    WRITING.store(false, Ordering::Release);
}

unsafe extern "C" fn adds(info: *mut libc::dl_phdr_info, size: usize, out: *mut c_void) -> c_int {
    if size >= core::mem::offset_of!(libc::dl_phdr_info, dlpi_subs) {
        // SAFETY: the loader's record, which has the field (`size` says so); `out` a u64.
        unsafe { *(out as *mut u64) = (*info).dlpi_adds };
    }
    1
}

/// The loader's count of modules loaded so far (0 if it keeps none).
fn loads() -> u64 {
    let mut n = 0u64;
    // SAFETY: a callback that reads one field of the first module's record.
    unsafe { libc::dl_iterate_phdr(Some(adds), &mut n as *mut u64 as *mut c_void) };
    n
}

/// Called after each `dlsym` of a handle while attached: the modules loaded since the last
/// pass get their entries redirected. Entries already redirected are skipped (their value
/// is already this library's).
pub fn after_dlsym() {
    if !ATTACHED.load(Ordering::Acquire) || loads() == ADDS.load(Ordering::Relaxed) {
        return;
    }
    if !lock(u32::MAX) {
        return;
    }
    // Written back meanwhile: nothing to redirect any more.
    if ATTACHED.load(Ordering::Acquire) {
        ADDS.store(loads(), Ordering::Relaxed);
        let own = redirect as *const () as *mut c_void;
        // SAFETY: as in `redirect`.
        unsafe { libc::dl_iterate_phdr(Some(each), own) };
    }
    unlock();
}

/// A module as loaded: where each of its segments is, to check its own pointers against.
struct Module {
    base: usize,
    phdrs: &'static [libc::Elf64_Phdr],
}

impl Module {
    /// Whether `[at, at + len)` lies in one of its loaded segments.
    fn holds(&self, at: usize, len: usize) -> bool {
        let Some(end) = at.checked_add(len) else {
            return false;
        };
        self.phdrs.iter().any(|p| {
            let lo = self.base.wrapping_add(p.p_vaddr as usize);
            p.p_type == PT_LOAD && at >= lo && end <= lo.saturating_add(p.p_memsz as usize)
        })
    }

    /// A pointer of its dynamic section: relocated by the loader in place on most modules,
    /// not on those whose section is read-only (the vDSO).
    fn ptr(&self, v: u64) -> usize {
        let v = v as usize;
        if v < self.base { v + self.base } else { v }
    }

    /// The pages the loader made read-only after relocating (as `_dl_protect_relro` rounds).
    fn relro(&self) -> (usize, usize) {
        let page = 4096;
        self.phdrs
            .iter()
            .find(|p| p.p_type == PT_GNU_RELRO)
            .map_or((0, 0), |p| {
                let lo = self.base.wrapping_add(p.p_vaddr as usize);
                (lo & !(page - 1), (lo + p.p_memsz as usize) & !(page - 1))
            })
    }
}

/// The relocation tables of a module, and its symbols and names, checked to lie within it.
struct Tables {
    symtab: usize,
    strtab: usize,
    strsz: usize,
    rela: (usize, usize),
    jmprel: (usize, usize),
}

fn tables(m: &Module) -> Option<Tables> {
    let dynamic = m.phdrs.iter().find(|p| p.p_type == PT_DYNAMIC)?;
    let at = m.base.wrapping_add(dynamic.p_vaddr as usize);
    let n = (dynamic.p_memsz as usize / core::mem::size_of::<Dyn>()).min(1024);
    if !m.holds(at, n * core::mem::size_of::<Dyn>()) {
        return None;
    }
    let mut t = Tables {
        symtab: 0,
        strtab: 0,
        strsz: 0,
        rela: (0, 0),
        jmprel: (0, 0),
    };
    for i in 0..n {
        // SAFETY: within the module's loaded segments (checked above).
        let d = unsafe { &*((at as *const Dyn).add(i)) };
        match d.tag {
            DT_NULL => break,
            DT_SYMTAB => t.symtab = m.ptr(d.val),
            DT_STRTAB => t.strtab = m.ptr(d.val),
            DT_STRSZ => t.strsz = d.val as *const () as usize,
            DT_RELA => t.rela.0 = m.ptr(d.val),
            DT_RELASZ => t.rela.1 = d.val as *const () as usize,
            DT_JMPREL => t.jmprel.0 = m.ptr(d.val),
            DT_PLTRELSZ => t.jmprel.1 = d.val as *const () as usize,
            _ => {}
        }
    }
    (t.symtab != 0 && t.strtab != 0 && m.holds(t.strtab, t.strsz)).then_some(t)
}

/// The name of symbol `i`, if it lies within the module's string table.
fn name(m: &Module, t: &Tables, i: usize) -> Option<&'static [u8]> {
    let sym = t
        .symtab
        .checked_add(i.checked_mul(core::mem::size_of::<Sym>())?)?;
    if !m.holds(sym, core::mem::size_of::<Sym>()) {
        return None;
    }
    // SAFETY: within the module (checked).
    let off = unsafe { (*(sym as *const Sym)).name } as usize;
    if off >= t.strsz {
        return None;
    }
    let room = t.strsz - off;
    // SAFETY: within the string table, which lies in the module (checked by `tables`).
    let bytes = unsafe { core::slice::from_raw_parts((t.strtab + off) as *const u8, room) };
    let len = bytes.iter().position(|b| *b == 0)?;
    Some(&bytes[..len])
}

/// Writes `value` at `at`, making its read-only (RELRO) page writable around the write.
fn write(at: usize, value: usize, protected: bool) -> bool {
    let page = at & !4095;
    // SAFETY: a page of the module's own data, given back its protection after.
    unsafe {
        if protected
            && libc::mprotect(
                page as *mut c_void,
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
            ) != 0
        {
            return false;
        }
        core::sync::atomic::AtomicUsize::from_ptr(at as *mut usize).store(value, Ordering::Release);
        if protected {
            libc::mprotect(page as *mut c_void, 4096, libc::PROT_READ);
        }
    }
    true
}

/// Every malloc-family entry of one relocation table redirected.
fn redirect_table(m: &Module, t: &Tables, (at, size): (usize, usize)) {
    let n = (size / core::mem::size_of::<Rela>()).min(MAX_RELOCS);
    if at == 0 || !m.holds(at, n * core::mem::size_of::<Rela>()) {
        return;
    }
    let relro = m.relro();
    for i in 0..n {
        // SAFETY: within the module (checked).
        let r = unsafe { &*((at as *const Rela).add(i)) };
        let kind = r.info as u32;
        if kind != R_X86_64_JUMP_SLOT && kind != R_X86_64_GLOB_DAT {
            continue;
        }
        let Some(f) = name(m, t, (r.info >> 32) as usize).and_then(ours) else {
            continue;
        };
        let slot = m.base.wrapping_add(r.offset as usize);
        if !m.holds(slot, 8) || !slot.is_multiple_of(8) {
            continue;
        }
        let used = USED.load(Ordering::Relaxed);
        if used >= MAX_SLOTS {
            LOST.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        // SAFETY: an aligned word of the module's data (checked).
        let old = unsafe { core::ptr::read_volatile(slot as *const usize) };
        if old == f {
            continue;
        }
        let page = slot & !4095;
        let protected = page >= relro.0 && page < relro.1;
        if write(slot, f, protected) {
            // SAFETY: one writer (`WRITING` held); entries below USED only.
            unsafe {
                SLOTS[used] = Slot {
                    at: slot,
                    old,
                    relro: protected,
                }
            };
            USED.store(used + 1, Ordering::Release);
        } else {
            LOST.fetch_add(1, Ordering::Relaxed);
        }
    }
}

unsafe extern "C" fn each(info: *mut libc::dl_phdr_info, _: usize, own: *mut c_void) -> c_int {
    // SAFETY: the loader's record of one module, valid during the callback.
    let info = unsafe { &*info };
    if info.dlpi_phdr.is_null() || info.dlpi_phnum == 0 || info.dlpi_phnum > 256 {
        return 0;
    }
    let m = Module {
        base: info.dlpi_addr as *const () as usize,
        // SAFETY: the loader's program headers of the module, which stay mapped.
        phdrs: unsafe { core::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize) },
    };
    // This library's own entries (it calls none of the family) stay as they are.
    if m.holds(own as usize, 1) {
        return 0;
    }
    if let Some(t) = tables(&m) {
        redirect_table(&m, &t, t.rela);
        redirect_table(&m, &t, t.jmprel);
    }
    0
}

/// Checks that each of `ours` lies in this library's code (found by the address of a
/// function of it), and keeps them.
unsafe extern "C" fn check_ours(
    info: *mut libc::dl_phdr_info,
    _: usize,
    data: *mut c_void,
) -> c_int {
    // SAFETY: as in `each`; `data` is the addresses given to `redirect`.
    let (info, ours) = unsafe { (&*info, &*(data as *const [usize; 10])) };
    if info.dlpi_phdr.is_null() || info.dlpi_phnum == 0 || info.dlpi_phnum > 256 {
        return 0;
    }
    let m = Module {
        base: info.dlpi_addr as usize,
        // SAFETY: as in `each`.
        phdrs: unsafe { core::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize) },
    };
    if !m.holds(redirect as *const () as usize, 1) {
        return 0;
    }
    if ours.iter().all(|f| m.holds(*f, 1)) {
        for (slot, f) in OURS.iter().zip(ours) {
            slot.store(*f, Ordering::Relaxed);
        }
    }
    1
}

/// Redirects every loaded module's entries to `ours` (this library's functions, in the
/// order of `NAMES`); returns how many were written. None if `ours` are not this library's.
pub fn redirect(ours: &[usize; 10]) -> Option<usize> {
    // SAFETY: callbacks that only read the modules' loaded memory, bounded.
    unsafe { libc::dl_iterate_phdr(Some(check_ours), ours as *const _ as *mut c_void) };
    OURS[0]
        .load(Ordering::Relaxed)
        .checked_sub(0)
        .filter(|f| *f != 0)?;
    let own = redirect as *const () as *mut c_void;
    if !lock(u32::MAX) {
        return None;
    }
    ADDS.store(loads(), Ordering::Relaxed);
    // SAFETY: as above.
    unsafe { libc::dl_iterate_phdr(Some(each), own) };
    ATTACHED.store(true, Ordering::Release);
    unlock();
    Some(USED.load(Ordering::Acquire))
}

/// Writes back every entry redirected, last first (an entry written twice gets its first
/// value back), and forgets them. False if a pass of another thread (`after_dlsym`) held
/// the entries all along (the caller tries again later).
pub fn restore() -> bool {
    // Bounded: the thread heaptrace calls through may be one stopped inside a pass.
    if !lock(10_000) {
        return false;
    }
    ATTACHED.store(false, Ordering::Release);
    let used = USED.swap(0, Ordering::AcqRel);
    for i in (0..used).rev() {
        // SAFETY: entries below the count taken, written by `redirect`.
        let s = unsafe { SLOTS[i] };
        write(s.at, s.old, s.relro);
    }
    unlock();
    true
}

/// Entries found that could not be redirected.
pub fn lost() -> usize {
    LOST.load(Ordering::Relaxed)
}

/// Where `name` (`bare`, its bytes) is defined for the process: its global scope's first
/// definition, but for a non-PIE executable that calls it, whose symbol is its own PLT entry
/// (the canonical address), which would lead back here once the GOT is written: then the
/// first module after it, in load order, that defines it itself (libc, or an allocator
/// linked before it). Not this library, nor another heaptrace library.
pub fn defined(name: &core::ffi::CStr, bare: &[u8]) -> usize {
    // SAFETY: a NUL-terminated name.
    let first = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) } as usize;
    let mut look = Lookup {
        name,
        bare,
        first,
        index: 0,
        canonical: false,
        found: 0,
    };
    // SAFETY: a callback that reads the modules' loaded memory, bounded, and looks up
    // symbols by handle (before any GOT entry leads here: its allocations are libc's).
    unsafe { libc::dl_iterate_phdr(Some(definer), &mut look as *mut Lookup as *mut c_void) };
    if look.canonical { look.found } else { first }
}

struct Lookup<'a> {
    name: &'a core::ffi::CStr,
    bare: &'a [u8],
    first: usize,
    index: usize,
    /// `first` is the executable's PLT entry.
    canonical: bool,
    found: usize,
}

/// Whether a relocation table of `m` imports `bare` (a JUMP_SLOT or GLOB_DAT of it).
fn imports(m: &Module, t: &Tables, (at, size): (usize, usize), bare: &[u8]) -> bool {
    let n = (size / core::mem::size_of::<Rela>()).min(MAX_RELOCS);
    if at == 0 || !m.holds(at, n * core::mem::size_of::<Rela>()) {
        return false;
    }
    (0..n).any(|i| {
        // SAFETY: within the module (checked).
        let r = unsafe { &*((at as *const Rela).add(i)) };
        let kind = r.info as u32;
        (kind == R_X86_64_JUMP_SLOT || kind == R_X86_64_GLOB_DAT)
            && name(m, t, (r.info >> 32) as usize) == Some(bare)
    })
}

unsafe extern "C" fn definer(info: *mut libc::dl_phdr_info, _: usize, data: *mut c_void) -> c_int {
    // SAFETY: the loader's record of one module; `data` is the Lookup of `defined`.
    let (info, look) = unsafe { (&*info, &mut *(data as *mut Lookup)) };
    let index = look.index;
    look.index += 1;
    if info.dlpi_phdr.is_null() || info.dlpi_phnum == 0 || info.dlpi_phnum > 256 {
        return 0;
    }
    let m = Module {
        base: info.dlpi_addr as usize,
        // SAFETY: as in `each`.
        phdrs: unsafe { core::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize) },
    };
    if index == 0 {
        look.canonical = m.holds(look.first, 1)
            && tables(&m).is_some_and(|t| {
                imports(&m, &t, t.jmprel, look.bare) || imports(&m, &t, t.rela, look.bare)
            });
        return if look.canonical { 0 } else { 1 };
    }
    if info.dlpi_name.is_null() || m.holds(redirect as *const () as usize, 1) {
        return 0;
    }
    // SAFETY: a loaded module's name, NUL-terminated; RTLD_NOLOAD loads nothing.
    let h = unsafe { libc::dlopen(info.dlpi_name, libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
    if h.is_null() {
        return 0;
    }
    // SAFETY: a handle just taken, given back below.
    let (f, ours) = unsafe {
        (
            libc::dlsym(h, look.name.as_ptr()) as usize,
            libc::dlsym(h, c"heaptrace_preload_library".as_ptr()) as usize,
        )
    };
    // SAFETY: the handle's reference, taken above.
    unsafe { libc::dlclose(h) };
    if f != 0 && m.holds(f, 1) && !m.holds(ours, 1) {
        look.found = f;
        return 1;
    }
    0
}
