//! A census of glibc's heap read from outside: a running process's memory or a core file's.
//!
//! `memory` (and `core`) read the target, `layout` knows glibc's structures by version,
//! `locate` finds `main_arena` and `mp_` (symbols, or code patterns), `walk` goes through the
//! arenas, heaps, bins and tcaches, `census` sums it up; `stop` holds a process still for an
//! exact walk. docs/heap-census.md explains the method and its limits.
pub mod census;
pub mod core;
pub mod layout;
pub mod locate;
pub mod memory;
pub mod stop;
pub mod walk;
mod walk_free;

use std::path::{Path, PathBuf};

use self::census::{About, Census, Source};
use self::memory::{Memory as _, Region};

/// Why there is no census.
#[derive(Debug, thiserror::Error)]
pub enum HeapError {
    #[error(
        "{who} allocates with {path}, not glibc's malloc: heaptrace heap reads glibc's heap only"
    )]
    OtherAllocator { who: String, path: PathBuf },
    /// glibc's malloc linked into the executable: it is glibc's, but there is no libc.so.6
    /// whose version banner says which layout its structures have.
    #[error(
        "{who} is statically linked with glibc's malloc (in {path}): heaptrace heap reads the \
         heap of a shared glibc (libc.so.6) only, whose banner gives its version and layout; \
         tracing it works"
    )]
    StaticGlibc { who: String, path: PathBuf },
    #[error("{0} maps no glibc (libc.so.6)")]
    NoGlibc(String),
    #[error("{0}")]
    Unsupported(String),
    #[error("{0}")]
    Unreadable(String),
}

/// A running process's mappings and its glibc's malloc state, located and checked; one
/// clear error where its allocator is another or its glibc cannot be read.
fn live_glibc(
    pid: u32,
    symbols: bool,
) -> Result<(Vec<Region>, locate::Located, memory::Live), HeapError> {
    let who = format!("process {pid}");
    let provider = crate::targets::allocator::for_pid(pid)
        .map_err(|e| HeapError::Unreadable(e.to_string()))?;
    if !is_glibc(&provider.path) {
        return Err(other_allocator(who, &provider.file, provider.path));
    }
    let regions =
        memory::live_regions(pid).map_err(|e| HeapError::Unreadable(format!("{who}: {e}")))?;
    let base = base_of(&regions, &provider.path).ok_or_else(|| HeapError::NoGlibc(who.clone()))?;
    let at = locate::locate_file(&provider.file, base, symbols).map_err(HeapError::Unsupported)?;
    let mem = memory::Live::new(pid);
    check_main_arena(&mem, &at)?;
    Ok((regions, at, mem))
}

/// The census of a running process; `stop`: held still with ptrace for the walk;
/// `symbols`: use libc's debug symbols where installed.
pub fn of_process(pid: u32, stop: bool, symbols: bool) -> Result<Census, HeapError> {
    let (regions, at, mem) = live_glibc(pid, symbols)?;
    let (frozen, busy) = if stop {
        let (f, busy) = freeze_unlocked(pid, &mem, &at)?;
        (Some(f), busy)
    } else {
        (None, 0)
    };
    let mut w = walk::walk(&mem, &at, &regions, !stop).map_err(HeapError::Unreadable)?;
    drop(frozen);
    warn_locked(&mut w, busy);
    Ok(census::census(
        w,
        About {
            source: Source::Pid(pid),
            glibc: at.layout.version,
            found_by: at.found_by,
            exact: stop,
        },
    ))
}

/// The blocks a process holds, read with every thread stopped; the process stays stopped
/// until `Held::frozen` is dropped, so that nothing it allocates or frees is missed between
/// this walk and what the caller does next (`heaptrace -p` puts the blocks in its live map
/// and turns counting on meanwhile).
pub struct Held {
    pub frozen: stop::Frozen,
    pub blocks: Vec<walk::Block>,
    /// Arenas locked each time the process was stopped (a thread inside malloc): their walk
    /// may have missed or miscounted a block.
    pub locked_arenas: usize,
    pub warnings: Vec<String>,
}

/// The blocks `pid` holds now, the process stopped (see [`Held`]).
pub fn blocks_of_process(pid: u32, symbols: bool) -> Result<Held, HeapError> {
    // Located before the stop: reading libc's file and its code takes a while.
    let (_, at, mem) = live_glibc(pid, symbols)?;
    let (frozen, busy) = freeze_unlocked(pid, &mem, &at)?;
    // Mapped blocks come and go with their own mappings: read the map again, stopped.
    let regions = memory::live_regions(pid)
        .map_err(|e| HeapError::Unreadable(format!("process {pid}: {e}")))?;
    let mut w = walk::walk_blocks(&mem, &at, &regions, false).map_err(HeapError::Unreadable)?;
    warn_locked(&mut w, busy);
    Ok(Held {
        frozen,
        blocks: w.blocks,
        locked_arenas: busy,
        warnings: w.warnings,
    })
}

/// Stops every thread of `pid`, again and again (a thread stopped inside malloc leaves its
/// arena half updated) until no arena's lock is held, at most STOP_ATTEMPTS times; then
/// the arenas still locked.
fn freeze_unlocked(
    pid: u32,
    mem: &memory::Live,
    at: &locate::Located,
) -> Result<(stop::Frozen, usize), HeapError> {
    let mut busy = 0;
    for _ in 0..STOP_ATTEMPTS {
        let f = stop::freeze(pid).map_err(HeapError::Unreadable)?;
        mem.refresh();
        busy = walk::locked_arenas(mem, at);
        if busy == 0 {
            return Ok((f, 0));
        }
        drop(f);
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let f = stop::freeze(pid).map_err(HeapError::Unreadable)?;
    mem.refresh();
    Ok((f, busy))
}

fn warn_locked(w: &mut walk::Walk, busy: usize) {
    if busy > 0 {
        w.warnings.push(format!(
            "{busy} arenas were locked each time the process was stopped ({STOP_ATTEMPTS} \
             times): a thread was inside malloc"
        ));
    }
}

/// The census of a core file (the kernel's or gdb's `gcore`), with the libc it names read
/// from this host.
pub fn of_core(path: &Path, symbols: bool) -> Result<Census, HeapError> {
    let core = core::Core::open(path)
        .map_err(|e| HeapError::Unreadable(format!("{}: {e}", path.display())))?;
    let who = format!("core file {}", path.display());
    if let Some((file, other)) = core_allocator(&core.regions) {
        return Err(other_allocator(who, &file, other));
    }
    let libc = core
        .regions
        .iter()
        .filter_map(|r| r.file.as_ref())
        .find(|p| is_glibc(p))
        .cloned()
        .ok_or_else(|| HeapError::NoGlibc(who.clone()))?;
    let base = base_of(&core.regions, &libc).ok_or_else(|| HeapError::NoGlibc(who.clone()))?;
    let at = locate::locate(&libc, base, symbols).map_err(HeapError::Unsupported)?;
    check_same_libc(&core, &libc, base)?;
    check_main_arena(&core, &at)?;
    let w = walk::walk(&core, &at, &core.regions, false).map_err(HeapError::Unreadable)?;
    Ok(census::census(
        w,
        About {
            source: Source::Core(path.into()),
            glibc: at.layout.version,
            found_by: at.found_by,
            exact: true,
        },
    ))
}

/// How many times `--stop` stops the process to find no arena locked.
const STOP_ATTEMPTS: u32 = 50;

fn is_glibc(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n == "libc.so.6")
}

/// Where the file's first byte is mapped.
fn base_of(regions: &[Region], file: &Path) -> Option<u64> {
    regions
        .iter()
        .find(|r| r.file.as_deref() == Some(file) && r.offset == 0)
        .map(|r| r.start)
}

/// Why the allocator in `path` is not read: another allocator, or glibc's linked statically.
fn other_allocator(
    who: String,
    file: &crate::targets::target_file::TargetFile,
    path: PathBuf,
) -> HeapError {
    if has_glibc_malloc(file) {
        HeapError::StaticGlibc { who, path }
    } else {
        HeapError::OtherAllocator { who, path }
    }
}

/// Whether a file holds glibc's malloc, by the messages only its malloc prints (an
/// executable, so no libc.so.6 name or version banner to go by).
fn has_glibc_malloc(file: &crate::targets::target_file::TargetFile) -> bool {
    const GLIBC_ONLY: [&[u8]; 2] = [
        b"malloc(): unaligned tcache chunk detected",
        b"corrupted size vs. prev_size",
    ];
    let Ok(data) = file.read_at(0, file.size().min(256 << 20) as usize) else {
        return false;
    };
    GLIBC_ONLY
        .iter()
        .all(|m| data.windows(m.len()).any(|w| w == *m))
}

/// The first file of a core's mappings (the executable first, libc last) that defines malloc,
/// if it is not libc: a static binary, a preloaded jemalloc.
fn core_allocator(
    regions: &[Region],
) -> Option<(crate::targets::target_file::TargetFile, PathBuf)> {
    let mut files: Vec<&PathBuf> = Vec::new();
    for f in regions.iter().filter_map(|r| r.file.as_ref()) {
        if !files.contains(&f) {
            files.push(f);
        }
    }
    for f in files {
        let name = f.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if is_glibc(f) || name.starts_with("ld-linux") {
            continue;
        }
        if !std::fs::metadata(f).is_ok_and(|m| m.is_file()) {
            continue;
        }
        let Ok(tf) = crate::targets::target_file::TargetFile::host(f) else {
            continue;
        };
        if crate::targets::elf::alloc_sites(&tf)
            .ok()
            .is_some_and(|s| crate::targets::elf::defines_malloc(&s))
        {
            return Some((tf, f.clone()));
        }
    }
    None
}

/// The libc on this host must be the one the core ran with: their build ids agree (the
/// kernel dumps each library's first page, where the id is).
fn check_same_libc(core: &core::Core, libc: &Path, base: u64) -> Result<(), HeapError> {
    use memory::Memory as _;
    use object::Object as _;
    let data = locate::read_regular(libc, 256 << 20).map_err(HeapError::Unreadable)?;
    let file = object::File::parse(&*data).map_err(|e| HeapError::Unreadable(e.to_string()))?;
    let Some(id) = file.build_id().ok().flatten() else {
        return Ok(());
    };
    let Some(at) = data.windows(id.len()).position(|w| w == id) else {
        return Ok(());
    };
    let mut buf = vec![0u8; id.len()];
    if core.read(base + at as u64, &mut buf) && buf != id {
        return Err(HeapError::Unsupported(format!(
            "{} on this host is not the libc the core ran with (build ids differ)",
            libc.display()
        )));
    }
    Ok(())
}

/// main_arena's `next` list must lead back to it: a wrong address (another build, a wrong
/// pattern) is refused here rather than walked.
fn check_main_arena(mem: &dyn memory::Memory, at: &locate::Located) -> Result<(), HeapError> {
    let mut a = at.main_arena;
    for _ in 0..4096 {
        a = mem.u64_at(a + at.layout.next).ok_or_else(|| {
            HeapError::Unsupported(format!(
                "cannot read the arena list from main_arena at {:#x}",
                at.main_arena
            ))
        })?;
        if a == at.main_arena {
            return Ok(());
        }
    }
    Err(HeapError::Unsupported(format!(
        "the arena list from {:#x} does not come back: not glibc's main_arena; refusing to guess",
        at.main_arena
    )))
}
