//! The unwind tables loaded for the walks: each file's rows once, however many traced
//! processes map it, and each process's code mappings pointing at them. Kept in step with the
//! mappings the daemon reads (`symbolize::modules::Modules`): a process's entry is written
//! when its code mappings change, and a file's rows are given back when no process maps it.
//! Where they go is a [`Store`]: the kernel's maps (`UNWIND_ROWS`, `UNWIND_PROCS`) or an
//! in-process region's unwind area (`super::region`).
use std::{
    collections::HashMap,
    os::unix::fs::MetadataExt as _,
    time::{Duration, Instant},
};

use aya::maps::{HashMap as BpfHashMap, MapData};
use heaptrace_common::{
    maps,
    unwind::{MAX_MODULES, MODULE_NO_ROOM, MODULE_PENDING, Module, ProcModules, Row},
};

use super::{
    space::RowSpace,
    table::{self, Segment},
};
use crate::{
    bpf::mmap_array::MappedArray,
    error::{Error, Result},
};

/// Files larger than this are not read for their tables (walked by frame pointer).
const MAX_FILE_BYTES: u64 = 1 << 30;

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
    fn write_rows(&mut self, first: u32, rows: &[Row]);
    fn set_entry(&mut self, pid: u32, entry: &ProcModules);
    fn remove_entry(&mut self, pid: u32);
    /// The processes it holds entries of (the kernel's: those it gave forks too).
    fn entries(&self) -> Vec<u32> {
        Vec::new()
    }
}

/// The kernel's maps, which the return program reads.
struct Kernel {
    rows: MappedArray<Row>,
    procs: BpfHashMap<MapData, u32, ProcModules>,
}

impl Store for Kernel {
    fn capacity(&self) -> u32 {
        self.rows.len() as u32
    }

    fn write_rows(&mut self, first: u32, rows: &[Row]) {
        for (i, r) in rows.iter().enumerate() {
            self.rows.write(first as usize + i, *r);
        }
    }

    fn set_entry(&mut self, pid: u32, entry: &ProcModules) {
        if let Err(e) = self.procs.insert(pid, entry, 0) {
            log::debug!("unwind tables of {pid}: {e}");
        }
    }

    fn remove_entry(&mut self, pid: u32) {
        let _ = self.procs.remove(&pid);
    }

    fn entries(&self) -> Vec<u32> {
        self.procs.keys().filter_map(|k| k.ok()).collect()
    }
}

pub struct Tables {
    store: Box<dyn Store>,
    space: RowSpace,
    files: HashMap<FileKey, FileEntry>,
    pids: HashMap<u32, Proc>,
    /// The last entry's `ProcModules::version`.
    version: u32,
    pub stats: TableStats,
}

impl Tables {
    /// Takes the loaded object's unwind maps (`probe::LoadOptions::unwinds`).
    pub fn take(ebpf: &mut aya::Ebpf) -> Result<Tables> {
        let rows: MappedArray<Row> = MappedArray::map(ebpf, maps::UNWIND_ROWS)?;
        let map = ebpf
            .take_map(maps::UNWIND_PROCS)
            .ok_or_else(|| Error::Map {
                map: maps::UNWIND_PROCS,
                reason: "missing from the object".into(),
            })?;
        let procs = BpfHashMap::try_from(map).map_err(|e| Error::Map {
            map: maps::UNWIND_PROCS,
            reason: e.to_string(),
        })?;
        Ok(Tables::new(Box::new(Kernel { rows, procs })))
    }

    /// Tables kept in `store`.
    pub fn new(store: Box<dyn Store>) -> Tables {
        Tables {
            space: RowSpace::new(store.capacity()),
            store,
            files: HashMap::new(),
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
        let code = code_mappings(maps);
        if self.pids.get(&pid).is_some_and(|p| p.signature == code) {
            return;
        }
        let unknown: Vec<&CodeMapping> = code
            .iter()
            .filter(|m| !self.files.contains_key(&m.file))
            .collect();
        if !unknown.is_empty() {
            self.write_entry(pid, &code, true);
            for m in unknown {
                if !self.files.contains_key(&m.file) {
                    let path = format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.end);
                    let entry = self.read_file(&path);
                    self.files.insert(m.file, entry);
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
            let entry = self.read_file(&path.to_string_lossy());
            self.files.insert(key, entry);
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
    /// says are gone (under `--all` no event says a fork ended, or that it was there).
    pub fn sweep(&mut self, alive: impl Fn(u32) -> bool) {
        for pid in self.store.entries() {
            if !self.pids.contains_key(&pid) && !alive(pid) {
                self.store.remove_entry(pid);
            }
        }
    }

    fn release(&mut self, f: FileKey) {
        let Some(e) = self.files.get_mut(&f) else {
            return;
        };
        e.users = e.users.saturating_sub(1);
        if e.users > 0 {
            return;
        }
        if let Placement::Rows { first, rows } = e.placement {
            // A walk on another CPU may still read them as this file's for a moment: a wrong
            // row there ends its stack early or in frames user space cuts (not code).
            self.space.give(first, rows);
            self.stats.files -= 1;
            self.stats.rows -= u64::from(rows);
        }
        self.files.remove(&f);
    }

    /// Reads the file at `path` and places its table. A mapped file is read through
    /// `/proc/PID/map_files`: the very file the process maps, whatever its path says now (a
    /// container's, one replaced since).
    fn read_file(&mut self, path: &str) -> FileEntry {
        let start = Instant::now();
        let unusable = FileEntry {
            placement: Placement::Unusable,
            segments: Vec::new(),
            users: 0,
        };
        let Some(file) = open_bounded(path) else {
            self.stats.unusable += 1;
            return unusable;
        };
        // Only the headers and the unwind sections are read, not the whole file.
        let cache = object::ReadCache::new(file);
        let built = table::build(&cache);
        self.stats.read += 1;
        self.stats.build += start.elapsed();
        let t = match built {
            Ok(t) => t,
            Err(e) => {
                log::debug!("no unwind table for {path}: {e}");
                self.stats.unusable += 1;
                return unusable;
            }
        };
        let placement = if t.frame_pointers() {
            self.stats.frame_pointers += 1;
            Placement::FramePointers
        } else {
            self.place(&t.rows)
        };
        log::debug!(
            "unwind table of {path}: {} rows, {:?}, {placement:?}, {:?}",
            t.rows.len(),
            t.stats,
            start.elapsed()
        );
        FileEntry {
            placement,
            segments: t.segments,
            users: 0,
        }
    }

    /// Writes `rows` into the store's where there is room.
    fn place(&mut self, rows: &[Row]) -> Placement {
        let n = rows.len() as u32;
        let Some(first) = (n > 0).then(|| self.space.take(n)).flatten() else {
            self.stats.no_room += u32::from(n > 0);
            return if n > 0 {
                Placement::NoRoom
            } else {
                Placement::Unusable
            };
        };
        self.store.write_rows(first, rows);
        self.stats.files += 1;
        self.stats.rows += u64::from(n);
        Placement::Rows { first, rows: n }
    }

    /// Rows free in the store.
    pub fn free_rows(&self) -> u64 {
        self.space.free_rows()
    }
}

/// The file at `path`, if it is a regular file no larger than [`MAX_FILE_BYTES`].
fn open_bounded(path: &str) -> Option<std::fs::File> {
    let f = std::fs::File::open(path).ok()?;
    let meta = f.metadata().ok()?;
    (meta.is_file() && meta.size() <= MAX_FILE_BYTES).then_some(f)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_mappings_are_the_executable_file_mappings() {
        let maps = "55d0c0000000-55d0c0001000 r--p 00000000 fe:01 11 /bin/prog\n\
                    55d0c0001000-55d0c0003000 r-xp 00001000 fe:01 11 /bin/prog\n\
                    7f0000000000-7f0000001000 r-xp 00000000 00:00 0 \n\
                    7f1000000000-7f1000020000 r-xp 00028000 103:02 2 /lib/libc.so.6 (deleted)\n\
                    7ffd00000000-7ffd00021000 r-xp 00000000 00:00 0 [vdso]\n";
        let code = code_mappings(maps);
        assert_eq!(code.len(), 2, "{code:?}");
        assert_eq!(code[0].start, 0x55d0c0001000);
        assert_eq!(code[0].offset, 0x1000);
        assert_eq!(
            code[1].file,
            FileKey {
                dev: 0x103 << 32 | 2,
                inode: 2
            }
        );
    }
}
