//! The unwind tables loaded for the walks: each file's rows once, however many traced
//! processes map it, and each process's code mappings pointing at them. Kept in step with the
//! mappings the daemon reads (`symbolize::modules::Modules`): a process's entry is written
//! when its code mappings change. A file no process maps any more keeps its rows while the
//! space allows (`IDLE_FILES` of them, oldest given back first): a compile loop execs the same
//! compiler again and again, and its next process then starts with its tables in place.
//! Where they go is a [`Store`]: the kernel's maps (`UNWIND_CHUNKS`, `UNWIND_PROCS`) or an
//! in-process region's unwind area (`super::region`).
use std::{
    collections::{HashMap, VecDeque},
    os::unix::fs::MetadataExt as _,
    time::Duration,
};

use heaptrace_common::unwind::{
    FileRows, FileRowsKey, MAX_MODULES, MODULE_NO_ROOM, MODULE_PENDING, Module, ProcModules, Row,
};

use super::{
    space::RowSpace,
    table::{self, Segment},
};
use crate::error::Result;

/// Files larger than this are not read for their tables (walked by frame pointer).
const MAX_FILE_BYTES: u64 = 1 << 30;

/// Files no process maps that keep their tables, for the next process that maps them.
const IDLE_FILES: usize = 256;

/// A file, by device and inode: the same for every process that maps it.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
struct FileKey {
    dev: u64,
    inode: u64,
}

/// What a file's frames are walked with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Placement {
    /// Its rows, in the kernel's array.
    Rows { first: u32, rows: u32 },
    /// Built with frame pointers: no table needed.
    FramePointers,
    /// Its table did not fit in `--unwind-table-size`.
    NoRoom,
    /// No unwind information, or not a file heaptrace could read.
    Unusable,
}

struct FileEntry {
    placement: Placement,
    segments: Vec<Segment>,
    /// Processes whose entries point at it.
    users: u32,
    /// The file as read: an idle entry is used again only for the same file, not another
    /// that took its inode since.
    stamp: Option<Stamp>,
}

/// What tells a file apart from a later one with its device and inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    fn of(meta: &std::fs::Metadata) -> Stamp {
        Stamp {
            size: meta.size(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }
}

/// A process's code mappings as last written, and the files they map.
struct Proc {
    signature: Vec<CodeMapping>,
    files: Vec<FileKey>,
}

/// What loading tables has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TableStats {
    /// Files whose tables are loaded now, and their rows.
    pub files: u32,
    pub rows: u64,
    /// Files read, and the time that took (read and built).
    pub read: u32,
    pub build: Duration,
    /// Files walked by frame pointer: built with them, without unwind information, or whose
    /// table did not fit (at the time each was read).
    pub frame_pointers: u32,
    pub unusable: u32,
    pub no_room: u32,
    /// Process entries that held their first `MAX_MODULES` tables only.
    pub modules_over: u32,
    /// Files mapped again while idle, their tables used without reading them.
    pub reused: u32,
}

/// A code mapping of a file, from /proc/PID/maps.
#[derive(Clone, Debug, PartialEq, Eq)]
struct CodeMapping {
    start: u64,
    end: u64,
    offset: u64,
    file: FileKey,
}

/// Where rows and process entries go. A file's rows are written before an entry points at
/// them, and written over only after no entry does.
pub trait Store: Send {
    /// Rows it holds.
    fn capacity(&self) -> u32;
    /// False where they could not be written (no memory for them).
    fn write_rows(&mut self, first: u32, rows: &[Row]) -> bool;
    fn set_entry(&mut self, pid: u32, entry: &ProcModules);
    fn remove_entry(&mut self, pid: u32);
    /// The processes it holds entries of (the kernel's: those it gave forks too).
    fn entries(&self) -> Vec<u32> {
        Vec::new()
    }
    /// A file's rows by its identity (None: given back), for walks that find a frame's
    /// mapping themselves.
    fn set_file(&mut self, _key: FileRowsKey, _rows: Option<FileRows>) {}
}

/// The tables as the daemon and the exec watch's reader thread share them.
pub type Shared = std::sync::Arc<std::sync::Mutex<Tables>>;

pub struct Tables {
    store: Box<dyn Store>,
    space: RowSpace,
    files: HashMap<FileKey, FileEntry>,
    /// Files no process maps, oldest first.
    idle: VecDeque<FileKey>,
    pids: HashMap<u32, Proc>,
    /// The last entry's `ProcModules::version`.
    version: u32,
    pub stats: TableStats,
}

impl Tables {
    /// Takes the loaded object's unwind maps (`probe::LoadOptions::unwinds`), to hold up to
    /// `rows` rows.
    pub fn take(ebpf: &mut aya::Ebpf, rows: u32) -> Result<Tables> {
        Ok(Tables::new(Box::new(kernel::Kernel::take(ebpf, rows)?)))
    }

    /// Tables kept in `store`.
    pub fn new(store: Box<dyn Store>) -> Tables {
        Tables {
            space: RowSpace::new(store.capacity()),
            store,
            files: HashMap::new(),
            idle: VecDeque::new(),
            pids: HashMap::new(),
            version: 0,
            stats: TableStats::default(),
        }
    }

    /// Brings `pid`'s entry in step with its mappings (`/proc/PID/maps`), loading the tables of
    /// files not seen before. Nothing is done while its code mappings stay the same. The
    /// files known already go in first: a process starting up allocates while the others
    /// are read.
    pub fn sync(&mut self, pid: u32, maps: &str) {
        self.sync_with(pid, maps, &[]);
    }

    /// `sync`, reading the files `opened` holds through it (`Opened`).
    pub fn sync_with(&mut self, pid: u32, maps: &str, opened: &[Opened]) {
        if !loader_done(maps) {
            return;
        }
        let code = code_mappings(maps);
        if self.pids.get(&pid).is_some_and(|p| p.signature == code) {
            return;
        }
        let mut seen = std::collections::HashSet::new();
        for m in code.iter().filter(|m| seen.insert(m.file)) {
            self.check_idle(pid, m, opened);
            // Not to be given back for the room of this process's other files, read below:
            // its entry points at them from the first write on.
            self.idle.retain(|k| *k != m.file);
        }
        let unknown: Vec<&CodeMapping> = code
            .iter()
            .filter(|m| !self.files.contains_key(&m.file))
            .collect();
        if !unknown.is_empty() {
            self.write_entry(pid, &code, true);
            for m in unknown {
                if !self.files.contains_key(&m.file) {
                    let to = ToRead::of(pid, m, opened);
                    let entry = self.entry_of(to.read());
                    self.files.insert(m.file, entry);
                    self.publish(m.file);
                }
            }
        }
        self.write_entry(pid, &code, false);
        let mut files: Vec<FileKey> = code.iter().map(|m| m.file).collect();
        files.sort();
        files.dedup();
        for f in &files {
            if let Some(e) = self.files.get_mut(f) {
                e.users += 1;
            }
        }
        let old = self.pids.insert(
            pid,
            Proc {
                signature: code,
                files,
            },
        );
        for f in old.map(|p| p.files).unwrap_or_default() {
            self.release(f);
        }
    }

    /// `sync` where every file `pid` maps has its table already (no file to read): true if
    /// so. The exec watch's reader thread writes a new process's entry this way within a
    /// millisecond of its exec, where the daemon may be busy with a round for a tenth of a
    /// second, its walks late all that while.
    pub fn sync_known(&mut self, pid: u32, maps: &str) -> bool {
        let known = code_mappings(maps)
            .iter()
            .all(|m| self.files.contains_key(&m.file));
        if known {
            self.sync(pid, maps);
        }
        known
    }

    /// Loads the table of the file at `path` before any traced process maps it (a launched
    /// command's executable and allocator): its entry then takes no reading when it starts.
    pub fn preload(&mut self, path: &std::path::Path) {
        let Ok(meta) = std::fs::metadata(path) else {
            return;
        };
        let dev = meta.dev();
        let key = FileKey {
            dev: u64::from(libc::major(dev)) << 32 | u64::from(libc::minor(dev)),
            inode: meta.ino(),
        };
        if !self.files.contains_key(&key) {
            let entry = self.entry_of(Built::at(key, path.to_string_lossy().into_owned()));
            self.files.insert(key, entry);
            self.publish(key);
            self.idle.push_back(key);
            self.trim_idle();
        }
    }

    /// Gives back the idle table of `m`'s file where the file mapped now is not the one read:
    /// a file deleted since, whose inode a new one took.
    /// A process gone, whose file `opened` does not hold, cannot tell: its idle table stays
    /// (its entry is walked by no one).
    fn check_idle(&mut self, pid: u32, m: &CodeMapping, opened: &[Opened]) {
        let Some(e) = self.files.get(&m.file) else {
            return;
        };
        if e.users > 0 {
            return;
        }
        let Some(now) = ToRead::of(pid, m, opened).stamp() else {
            return;
        };
        if Some(now) == e.stamp {
            self.stats.reused += 1;
        } else {
            self.evict(m.file);
        }
    }

    /// Writes `pid`'s entry: its mappings of files with a table (or whose table did not fit),
    /// and with `pending` those of files not read yet (their walks are counted late).
    fn write_entry(&mut self, pid: u32, code: &[CodeMapping], pending: bool) {
        let mut modules = Vec::new();
        for m in code {
            let Some(entry) = self.files.get(&m.file) else {
                if pending {
                    modules.push(Module {
                        start: m.start,
                        end: m.end,
                        flags: MODULE_PENDING,
                        ..Module::default()
                    });
                }
                continue;
            };
            let module = match entry.placement {
                Placement::Rows { first, rows } => match bias(&entry.segments, m) {
                    Some(bias) => Module {
                        bias,
                        first,
                        rows,
                        ..Module::default()
                    },
                    None => continue,
                },
                Placement::NoRoom => Module {
                    flags: MODULE_NO_ROOM,
                    ..Module::default()
                },
                Placement::FramePointers | Placement::Unusable => continue,
            };
            modules.push(Module {
                start: m.start,
                end: m.end,
                ..module
            });
        }
        modules.sort_by_key(|m| m.start);
        if modules.len() > MAX_MODULES {
            self.stats.modules_over += u32::from(!pending);
            modules.truncate(MAX_MODULES);
        }
        self.version += 1;
        let mut entry = ProcModules {
            count: modules.len() as u32,
            version: self.version,
            ..ProcModules::default()
        };
        entry.modules[..modules.len()].copy_from_slice(&modules);
        self.store.set_entry(pid, &entry);
    }

    /// Drops `pid`'s entry (it ended or exec'ed), and the tables no process maps any more.
    /// The entry goes from the store even where this never wrote one: the kernel gives a
    /// followed process's fork its parent's (heaptrace-ebpf's `unwind::inherit`), and a fork
    /// gone before its mappings were read leaves that behind.
    pub fn forget(&mut self, pid: u32) {
        self.store.remove_entry(pid);
        let Some(p) = self.pids.remove(&pid) else {
            return;
        };
        for f in p.files {
            self.release(f);
        }
    }

    /// Removes the entries the kernel gave forks that this never wrote, of processes `alive`
    /// says are gone (under `--all` no event says a fork ended, or that it was there), and
    /// those written for processes gone that the daemon never took in (the exec watch's
    /// threads write entries of processes too short for its reads).
    pub fn sweep(&mut self, alive: impl Fn(u32) -> bool) {
        for pid in self.store.entries() {
            if !self.pids.contains_key(&pid) && !alive(pid) {
                self.store.remove_entry(pid);
            }
        }
        let gone: Vec<u32> = self.pids.keys().copied().filter(|p| !alive(*p)).collect();
        for pid in gone {
            self.forget(pid);
        }
    }

    /// File `f`'s rows by its identity, for the walks of processes with no entry yet: where
    /// its executable segments share one bias and its table is in place (or not needed).
    fn publish(&mut self, f: FileKey) {
        let Some(e) = self.files.get(&f) else {
            return;
        };
        let (first, rows) = match e.placement {
            Placement::Rows { first, rows } => (first, rows),
            Placement::FramePointers => (0, 0),
            Placement::NoRoom | Placement::Unusable => return,
        };
        let mut deltas = e
            .segments
            .iter()
            .filter(|s| s.exec)
            .map(|s| s.vaddr.wrapping_sub(s.offset));
        let (Some(delta), Some(stamp)) = (deltas.next(), e.stamp) else {
            return;
        };
        if deltas.any(|d| d != delta) {
            return;
        }
        let rows = FileRows {
            first,
            rows,
            delta,
            size: stamp.size,
            mtime_sec: stamp.mtime.0,
            mtime_nsec: stamp.mtime.1 as u64,
        };
        self.store.set_file(file_rows_key(f), Some(rows));
    }

    fn release(&mut self, f: FileKey) {
        let Some(e) = self.files.get_mut(&f) else {
            return;
        };
        e.users = e.users.saturating_sub(1);
        if e.users > 0 {
            return;
        }
        // A table that did not fit may fit next time.
        if e.placement == Placement::NoRoom || e.stamp.is_none() {
            self.evict(f);
            return;
        }
        self.idle.push_back(f);
        self.trim_idle();
    }

    /// Keeps at most `IDLE_FILES` idle files.
    fn trim_idle(&mut self) {
        while self.idle.len() > IDLE_FILES {
            let Some(f) = self.idle.pop_front() else {
                break;
            };
            self.evict(f);
        }
    }

    /// Forgets file `f` and gives its rows back.
    fn evict(&mut self, f: FileKey) {
        self.idle.retain(|k| *k != f);
        let Some(e) = self.files.remove(&f) else {
            return;
        };
        self.store.set_file(file_rows_key(f), None);
        if let Placement::Rows { first, rows } = e.placement {
            // A walk on another CPU may still read them as this file's for a moment: a wrong
            // row there ends its stack early or in frames user space cuts (not code).
            self.space.give(first, rows);
            self.stats.files -= 1;
            self.stats.rows -= u64::from(rows);
        }
    }

    /// Writes `rows` into the store's where there is room.
    fn place(&mut self, rows: &[Row]) -> Placement {
        let n = rows.len() as u32;
        let mut first = (n > 0).then(|| self.space.take(n)).flatten();
        // Idle files' rows go first, the longest idle first, until these fit.
        while first.is_none() && n > 0 && n <= self.store.capacity() {
            let Some(f) = self.idle.pop_front() else {
                break;
            };
            self.evict(f);
            first = self.space.take(n);
        }
        let Some(first) = first else {
            self.stats.no_room += u32::from(n > 0);
            return if n > 0 {
                Placement::NoRoom
            } else {
                Placement::Unusable
            };
        };
        if !self.store.write_rows(first, rows) {
            self.space.give(first, n);
            self.stats.no_room += 1;
            return Placement::NoRoom;
        }
        self.stats.files += 1;
        self.stats.rows += u64::from(n);
        Placement::Rows { first, rows: n }
    }

    /// Rows free in the store.
    pub fn free_rows(&self) -> u64 {
        self.space.free_rows()
    }
}

fn file_rows_key(f: FileKey) -> FileRowsKey {
    FileRowsKey {
        dev: f.dev,
        ino: f.inode,
    }
}

/// The bias of mapping `m`: run-time address less the file's virtual address.
fn bias(segments: &[Segment], m: &CodeMapping) -> Option<u64> {
    let t = table::FileTable {
        segments: segments.to_vec(),
        ..table::FileTable::default()
    };
    t.bias(m.start, m.offset)
}

/// The executable mappings of files in /proc/PID/maps, in its order.
/// Whether the dynamic loader has mapped the libraries (glibc's loader maps libc among them;
/// musl's loader is its libc; a static program has none). An entry from a read between an
/// exec and then would lack the libraries mapped next, and their frames would be walked by
/// frame pointer without being counted: until then there is no entry, and each walk is
/// counted late (`lost.unwind_late`).
pub(crate) fn loader_done(maps: &str) -> bool {
    let has = |name: &str| {
        maps.lines()
            .filter_map(|l| l.rsplit('/').next())
            .any(|f| f.starts_with(name))
    };
    !has("ld-linux") || has("libc.so")
}

fn code_mappings(maps: &str) -> Vec<CodeMapping> {
    maps.lines()
        .filter_map(|line| {
            let mut cols = line.split_whitespace();
            let (range, perms, offset, dev, inode) = (
                cols.next()?,
                cols.next()?,
                cols.next()?,
                cols.next()?,
                cols.next()?,
            );
            let path = cols.next()?;
            if !perms.contains('x') || !path.starts_with('/') {
                return None;
            }
            let (lo, hi) = range.split_once('-')?;
            let (major, minor) = dev.split_once(':')?;
            let inode: u64 = inode.parse().ok()?;
            (inode != 0).then_some(())?;
            Some(CodeMapping {
                start: u64::from_str_radix(lo, 16).ok()?,
                end: u64::from_str_radix(hi, 16).ok()?,
                offset: u64::from_str_radix(offset, 16).ok()?,
                file: FileKey {
                    dev: u64::from_str_radix(major, 16).ok()? << 32
                        | u64::from_str_radix(minor, 16).ok()?,
                    inode,
                },
            })
        })
        .collect()
}

mod kernel;
mod read;
pub use read::{Built, Opened, ToRead};
#[cfg(test)]
mod tests;
