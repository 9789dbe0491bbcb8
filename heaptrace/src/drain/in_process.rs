//! The daemon's side of `--in-process`: the region the preloaded library counts into
//! (`heaptrace_common::inproc`), created here as a memfd the launched command inherits, and
//! read each round into the same Snapshot the kernel's maps give. Threads' slots are summed as
//! the kernel's per-CPU counters are.
//!
//! The region's arrays are read with `pread`, not through the mapping: a page the target
//! never wrote reads as zeros without the kernel giving it memory.
use std::{
    fs::File,
    os::{
        fd::{AsRawFd as _, FromRawFd as _},
        unix::fs::FileExt as _,
    },
    sync::atomic::{AtomicU32, AtomicU64, Ordering},
};

use heaptrace_common::{
    FUNC_COUNT, LOSS_COUNT, NO_SITE,
    inproc::{self, Header, Layout, StackHead, ThreadHead},
};

use crate::error::{Error, Result};

mod before_attach;
mod check;
mod read;

/// The most address space a region takes in the command (1 TiB): beyond, a mapping that
/// could fail or crowd it out. The defaults take about 300 MiB.
const MAX_REGION: usize = 1 << 40;

/// The region's capacities, from the command line.
#[derive(Clone, Copy, Debug)]
pub struct Capacities {
    pub threads: u32,
    pub sites: u32,
    pub live: u32,
    /// Each thread's size table, and the shared one behind them (0: none).
    pub sizes: u32,
    pub shared_sizes: u32,
    pub depth: u32,
    /// Rows of the unwind area (0: none, stacks by frame pointer only).
    pub unwind_rows: u32,
    /// `--latency-every` (0: no call timed).
    pub latency_every: u32,
}

pub struct Region {
    file: File,
    header: *mut Header,
    len: usize,
    layout: Layout,
    token: [u64; 2],
    /// The traced process, once launched.
    pid: u32,
    /// Each stack id's function, as read from its record (a site's key needs it).
    funcs: Vec<u32>,
    /// The process's name, as last seen alive.
    comm: String,
    /// The last whole read, given again while a new image starts the region over, and the
    /// image it was of.
    last: crate::drain::round::Snapshot,
    epoch: u32,
    /// What the region was made with: every read is sized from these, never from the
    /// header, which the target can write (`check`).
    caps: Capacities,
    made: Header,
    /// Things found wrong in the region (`check::bad` flags), and how many times.
    bad: AtomicU64,
    faults: AtomicU64,
    /// Execs of the command held and started over here.
    execs: u32,
    /// Run once as counting stops (an attached process's GOT written back).
    on_stop: Option<Box<dyn FnOnce()>>,
    /// The region lives on in a process heaptrace attached to (mapped for good by the
    /// library): its pages are given back when heaptrace is done with it.
    empty_at_drop: bool,
}

impl Drop for Region {
    fn drop(&mut self) {
        if self.empty_at_drop {
            let body = inproc::HEADER_BYTES as i64;
            // SAFETY: punches a hole in our own descriptor of the file; the target's mapping
            // reads zeros there from now on.
            unsafe {
                libc::fallocate(
                    self.file.as_raw_fd(),
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    body,
                    self.len as i64 - body,
                )
            };
        }
    }
}

fn new_memfd() -> Result<File> {
    // SAFETY: a name; the descriptor is owned by the File below.
    let fd = unsafe { libc::memfd_create(c"heaptrace-inproc".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io_err("memfd_create")(std::io::Error::last_os_error()));
    }
    // SAFETY: a new descriptor, ours alone.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// A new shared mapping of the region's header page, read and write.
fn map_header(file: &File) -> std::io::Result<*mut Header> {
    // SAFETY: a new shared mapping of the first page of a file at least that long.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            inproc::HEADER_BYTES,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if map == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(map.cast())
}

fn io_err(what: &str) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::Io(std::io::Error::new(e.kind(), format!("{what}: {e}")))
}

impl Region {
    /// A new region: `mode` is `heaptrace_common::mode`, `count_as` each function's counted
    /// name (aliases), `temporary_allocs` the rule for temporaries.
    pub fn create(
        caps: Capacities,
        mode: u32,
        count_as: [u32; FUNC_COUNT],
        temporary_allocs: u32,
    ) -> Result<Region> {
        Region::create_in(None, caps, mode, count_as, temporary_allocs)
    }

    /// The region in `file` (a memfd made in an attached process) or, None, in a new memfd.
    pub fn create_in(
        file: Option<File>,
        caps: Capacities,
        mode: u32,
        count_as: [u32; FUNC_COUNT],
        temporary_allocs: u32,
    ) -> Result<Region> {
        let site_index = (caps.sites.clamp(1, 1 << 22) * 2).next_power_of_two();
        let layout = Layout::of(
            caps.threads,
            caps.sites,
            site_index,
            caps.live,
            caps.sizes,
            caps.shared_sizes,
            caps.depth,
        )
        .and_then(|l| l.with_unwind(caps.unwind_rows, caps.threads))
        .ok_or_else(|| {
            Error::Usage(format!(
                "--in-process: --in-process-threads {}, --stack-map-size {}, --live-map-size {} \
                 or --stack-depth {} is out of its range",
                caps.threads, caps.sites, caps.live, caps.depth
            ))
        })?;
        if layout.bytes > MAX_REGION {
            return Err(Error::Usage(format!(
                "--in-process: the region for --in-process-threads {} and --stack-map-size {} \
                 would take {} of the command's address space (at most {}): lower either",
                caps.threads,
                caps.sites,
                crate::view::units::bytes(layout.bytes as i64),
                crate::view::units::bytes(MAX_REGION as i64)
            )));
        }
        let file = match file {
            Some(f) => f,
            None => new_memfd()?,
        };
        file.set_len(layout.bytes as u64)
            .map_err(io_err("sizing the region"))?;
        let mut token = [0u64; 2];
        // SAFETY: fills the 16 bytes given.
        if unsafe { libc::getrandom(token.as_mut_ptr().cast(), 16, 0) } != 16 {
            return Err(io_err("getrandom")(std::io::Error::last_os_error()));
        }
        let header = Header {
            magic: inproc::MAGIC,
            version: inproc::VERSION,
            mode,
            token,
            owner: 0,
            state: inproc::state::OFF,
            epoch: 1,
            temporary_allocs,
            threads: caps.threads,
            sites: caps.sites,
            site_index,
            live: caps.live,
            sizes: caps.sizes,
            depth: caps.depth,
            count_as,
            latency_every: caps.latency_every,
            threads_used: 0,
            sites_used: 0,
            losses: [0; LOSS_COUNT],
            peak_live: 0,
            peak_max: 0,
            peak_size: 0,
            peak_stack: NO_SITE as i64,
            bytes: layout.bytes as u64,
            unwind_rows: caps.unwind_rows,
            failure: 0,
            raw_thread_calls: 0,
            nested_calls: 0,
            shared_sizes: caps.shared_sizes,
            _pad: 0,
            peak_seq: 0,
            peak_pending: 0,
            py_seq: 0,
            python: Default::default(),
            _reserved: [0; 2],
        };
        let header_ptr = map_header(&file).map_err(io_err("mapping the region"))?;
        // SAFETY: the page just mapped, nobody else's yet.
        unsafe { header_ptr.write(header) };
        let made = header;
        Ok(Region {
            file,
            header: header_ptr,
            len: layout.bytes,
            layout,
            token,
            pid: 0,
            funcs: Vec::new(),
            comm: String::new(),
            last: Default::default(),
            epoch: 1,
            caps,
            made,
            bad: AtomicU64::new(0),
            faults: AtomicU64::new(0),
            execs: 0,
            on_stop: None,
            empty_at_drop: false,
        })
    }

    /// The region's size and token, as the attached library checks them.
    pub fn size_and_token(&self) -> (u64, [u64; 2]) {
        (self.len as u64, self.token)
    }

    /// The descriptor the command inherits, and the environment entry that names it.
    pub fn handoff(&self) -> (i32, String) {
        let fd = self.file.as_raw_fd();
        let env = format!(
            "{}={fd}:{}:{:016x}{:016x}",
            inproc::ENV,
            self.len,
            self.token[0],
            self.token[1]
        );
        (fd, env)
    }

    /// `f` runs once, as counting stops at the end, before the last read; the region's
    /// pages are given back once heaptrace is done with it (it stays mapped in the target).
    pub fn on_stop(&mut self, f: Box<dyn FnOnce()>) {
        self.on_stop = Some(f);
        self.empty_at_drop = true;
    }

    /// Counting off, after `on_stop`'s hook.
    pub fn stop_counting(&mut self) {
        if let Some(f) = self.on_stop.take() {
            f();
        }
        self.set_counting(false);
    }

    pub fn set_pid(&mut self, pid: u32) {
        self.pid = pid;
    }

    /// The region's unwind area, to keep the tables of process `pid` in; None without one.
    pub fn unwind_store(&self, pid: u32) -> Result<Option<crate::unwind::region::RegionStore>> {
        use std::os::fd::AsFd as _;
        crate::unwind::region::RegionStore::map(self.file.as_fd(), &self.layout, pid)
    }

    /// Where the library's walk in process `pid` finds its CPython (the header's `python`).
    pub fn python_store(&self, pid: u32) -> Result<PyStore> {
        PyStore::map(&self.file, pid)
    }

    fn word(&self, f: impl Fn(*mut Header) -> *mut u32) -> &AtomicU32 {
        // SAFETY: a u32 of the mapped header, which lives as long as self.
        unsafe { AtomicU32::from_ptr(f(self.header)) }
    }

    /// Counting on (after the command is launched and everything is ready) or off (the trace
    /// ends: the library passes every call straight through from then on).
    pub fn set_counting(&self, on: bool) {
        let state = if on {
            inproc::state::COUNTING
        } else {
            inproc::state::OFF
        };
        self.word(|h| unsafe { &raw mut (*h).state })
            .store(state, Ordering::Release);
    }

    /// The pid that took the region: 0 if the library never ran (a static or set-user-ID
    /// program, or one that made no call).
    pub fn owner(&self) -> u32 {
        self.word(|h| unsafe { &raw mut (*h).owner })
            .load(Ordering::Acquire)
    }

    /// The command exec'ed: its earlier image is gone, the new one has not run. Everything
    /// but the header and the unwind rows is emptied (`Layout::emptied_at_exec`: the file's
    /// pages given back), the header's shared counts zeroed and the epoch moved on, so that
    /// the next read starts the process over; the new image's library takes the region as a
    /// first one does (owner 0).
    pub fn start_over(&mut self) -> Result<()> {
        self.execs += 1;
        let (from, to) = self.layout.emptied_at_exec();
        // SAFETY: punches a hole in our own file, past the header.
        let r = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                from as i64,
                (to - from) as i64,
            )
        };
        if r != 0 {
            return Err(io_err("emptying the region")(
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: the mapped header; the target's library is not running (held at the exec).
        unsafe {
            let h = self.header;
            (*h).threads_used = 0;
            (*h).sites_used = 0;
            (*h).losses = [0; LOSS_COUNT];
            (*h).peak_live = 0;
            (*h).peak_max = 0;
            (*h).peak_size = 0;
            (*h).peak_stack = NO_SITE as i64;
            (*h).raw_thread_calls = 0;
            (*h).nested_calls = 0;
            (*h).failure = 0;
            // The new image finds its interpreter again (`PyStore`).
            AtomicU64::from_ptr(&raw mut (*h).py_seq).store(0, Ordering::Release);
            (*h).epoch = (*h).epoch.wrapping_add(1).max(1);
            AtomicU32::from_ptr(&raw mut (*h).owner).store(0, Ordering::Release);
        }
        Ok(())
    }

    fn header(&self) -> Header {
        // SAFETY: the mapped header; a racy copy of words each read whole.
        unsafe { std::ptr::read_volatile(self.header) }
    }

    fn read<T: Copy + Default>(&self, offset: usize, n: usize) -> Result<Vec<T>> {
        let size = std::mem::size_of::<T>();
        let mut buf = vec![0u8; n * size];
        self.file
            .read_exact_at(&mut buf, offset as u64)
            .map_err(io_err("reading the region"))?;
        Ok(buf
            .chunks_exact(size)
            // SAFETY: plain #[repr(C)] data of integers: any bytes are a value.
            .map(|c| unsafe { std::ptr::read_unaligned(c.as_ptr() as *const T) })
            .collect())
    }

    /// Thread slots to read: as many as were taken, within the daemon's own count.
    fn threads_used(&self, h: &Header) -> usize {
        (h.threads_used as usize).min(self.caps.threads as usize)
    }

    /// The byte offsets of the thread slots to read: those taken, and the shared one once a
    /// call counted in it.
    fn slots(&self, h: &Header) -> Result<Vec<usize>> {
        let mut out: Vec<usize> = (0..self.threads_used(h))
            .map(|i| self.layout.thread(i))
            .collect();
        let owner = self.read::<u32>(self.layout.shared(), 1)?;
        if owner.first() == Some(&inproc::SHARED_OWNER) {
            out.push(self.layout.shared());
        }
        Ok(out)
    }

    /// Stacks stored, within the daemon's own count.
    fn sites_used(&self, h: &Header) -> usize {
        (h.sites_used as usize).min(self.caps.sites as usize)
    }

    fn thread_heads(&self, h: &Header) -> Result<Vec<ThreadHead>> {
        self.slots(h)?
            .into_iter()
            .map(|at| {
                let bytes = self.read::<u8>(at, std::mem::size_of::<ThreadHead>())?;
                // SAFETY: as in `read`.
                Ok(unsafe { std::ptr::read_unaligned(bytes.as_ptr() as *const ThreadHead) })
            })
            .collect()
    }

    /// The function of each stack stored since the last look.
    fn learn_funcs(&mut self, used: usize) -> Result<()> {
        while self.funcs.len() < used {
            let id = self.funcs.len();
            let at = self.layout.stacks + id * self.layout.stack_stride;
            let head = self.read::<u8>(at, std::mem::size_of::<StackHead>())?;
            // SAFETY: as in `read`.
            let head: StackHead = unsafe { std::ptr::read_unaligned(head.as_ptr() as *const _) };
            // A function no call names is the target's writing: the site is left out.
            self.found(check::bad::STACK, head.func as usize >= FUNC_COUNT);
            self.funcs.push(head.func);
        }
        Ok(())
    }
}

/// The header's `python`, written for the library's walk (`unwind::python::Walks`): a mapping
/// of the header page of its own, so that it can live in the symbolizer's modules.
pub struct PyStore {
    header: std::ptr::NonNull<Header>,
    /// The process the region counts: another's interpreter is not its to hold.
    pid: u32,
}

// SAFETY: a shared mapping this one owner writes; the target only reads `python`.
unsafe impl Send for PyStore {}

impl Drop for PyStore {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, used by nothing else.
        unsafe { libc::munmap(self.header.as_ptr().cast(), inproc::HEADER_BYTES) };
    }
}

impl PyStore {
    fn map(file: &File, pid: u32) -> Result<PyStore> {
        let p = map_header(file).map_err(io_err("mapping the region's header"))?;
        Ok(PyStore {
            header: std::ptr::NonNull::new(p).expect("mmap returned null"),
            pid,
        })
    }

    fn seq(&self) -> &AtomicU64 {
        // SAFETY: a word of the mapped header, which lives as long as self.
        unsafe { AtomicU64::from_ptr(&raw mut (*self.header.as_ptr()).py_seq) }
    }

    /// `p` (or none) under the seqlock: odd while it changes, then the next even number.
    fn publish(&mut self, p: Option<heaptrace_common::python::PyProc>) {
        let seq = self.seq();
        let before = seq.load(Ordering::Relaxed);
        seq.store(before | 1, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Release);
        // SAFETY: the header's `python`, written only here; the library copies it under
        // the seqlock.
        unsafe {
            std::ptr::write_volatile(
                &raw mut (*self.header.as_ptr()).python,
                p.unwrap_or_default(),
            )
        };
        let next = if p.is_some() { (before | 1) + 1 } else { 0 };
        seq.store(next, Ordering::Release);
    }
}

impl crate::unwind::python::Walks for PyStore {
    fn insert(&mut self, pid: u32, p: heaptrace_common::python::PyProc) -> bool {
        if pid != self.pid {
            return false;
        }
        self.publish(Some(p));
        true
    }

    fn remove(&mut self, pid: u32) {
        if pid == self.pid {
            self.publish(None);
        }
    }
}
