//! Where code was: each traced process's executable mappings, remembered while it lives, so
//! that its stacks can be turned into (module, file offset) and symbolized after it exits.
//! Each mapped file is opened (safely: `targets::target_file`) when its mapping is first
//! read, and held while a process known here maps it: its frames are named from that very
//! file, which a process in a container or one that is gone no longer leads to by path.
use std::{
    collections::HashMap,
    path::Path,
    sync::{Arc, Weak},
};

use crate::targets::{
    maps::MapsEntry,
    target_file::{FileId, TargetFile},
};

/// One executable file mapping of a process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    /// File offset of `start`.
    pub offset: u64,
    pub path: Arc<Path>,
    /// The file mapped, opened; None when it could not be (it is not named then).
    pub file: Option<Arc<TargetFile>>,
}

/// A code address resolved to the file it belongs to. The path is shared with the mapping it
/// came from: a stack holds one location per frame, and a profile thousands of stacks.
/// Compared and hashed by the path's bytes, not `Path`'s components: every frame of a new
/// stack is looked up by it, and parsing the components was a tenth of the daemon's time
/// beside a Rust build under `--all`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Location {
    pub path: Arc<Path>,
    pub offset: u64,
    /// The file itself, what its frames are named from (the same path in two containers is
    /// two files).
    #[serde(skip)]
    pub file: Option<Arc<TargetFile>>,
}

impl Location {
    fn key(&self) -> (&[u8], u64, &Option<Arc<TargetFile>>) {
        (
            self.path.as_os_str().as_encoded_bytes(),
            self.offset,
            &self.file,
        )
    }
}

impl PartialEq for Location {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl Eq for Location {}

impl std::hash::Hash for Location {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.key().hash(state);
    }
}

impl PartialOrd for Location {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Location {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.key().cmp(&other.key())
    }
}

/// Executable mappings per process, as last read while the process was alive.
#[derive(Default)]
pub struct Modules {
    procs: HashMap<u32, Vec<Mapping>>,
    /// The ranges of the process's code mappings, file-backed or not (a JIT's), sorted: a
    /// return address points into one of them.
    code: HashMap<u32, Vec<(u64, u64)>>,
    /// Processes whose mappings were read only at their exec (`keep_early`), and those of them
    /// found gone at the last `prune_early`.
    early: std::collections::HashSet<u32>,
    early_gone: std::collections::HashSet<u32>,
    /// The kernel's unwind tables, kept in step with every read of a process's mappings.
    /// Shared with the exec watch's reader thread (`Tables::sync_known`).
    pub unwind: Option<crate::unwind::loaded::Shared>,
    /// CPython processes' interpreters, for the walk's Python frames and their names.
    pub python: Option<crate::unwind::python::Interpreters>,
    files: OpenFiles,
}

/// The files of mappings opened, by identity, while something holds them: a file mapped by
/// many processes (libc) is opened once.
#[derive(Default)]
pub struct OpenFiles {
    held: HashMap<FileId, Weak<TargetFile>>,
}

/// A process's mappings read right at its exec, and their files opened then: a process of a
/// millisecond is gone by the time the daemon takes them, and a container's files can be
/// reached through it alone.
#[derive(Clone, Debug, Default)]
pub struct EarlyRead {
    pub maps: String,
    pub files: Vec<Arc<TargetFile>>,
}

impl OpenFiles {
    /// The file of `entry`, opened unless held already (None: it could not be).
    fn get(
        &mut self,
        pid: u32,
        dir: &mut Option<String>,
        e: &MapsEntry,
    ) -> Option<Arc<TargetFile>> {
        if let Some(f) = self.held.get(&e.id).and_then(Weak::upgrade) {
            return Some(f);
        }
        let dir = dir.get_or_insert_with(|| crate::targets::procfs::space_dir(pid));
        let f = Arc::new(open(pid, dir, e)?);
        self.held.insert(e.id, Arc::downgrade(&f));
        Some(f)
    }

    /// The files of the executable mappings of `maps`, process `pid`'s, read just now.
    pub fn read(&mut self, pid: u32, maps: String) -> EarlyRead {
        let mut dir = None;
        let mut files: Vec<Arc<TargetFile>> = Vec::new();
        for e in crate::targets::maps::parse(&maps).iter().filter(|e| e.exec) {
            if !files.iter().any(|f| f.id() == e.id)
                && let Some(f) = self.get(pid, &mut dir, e)
            {
                files.push(f);
            }
        }
        self.forget_released();
        EarlyRead { maps, files }
    }

    fn forget_released(&mut self) {
        self.held.retain(|_, f| f.strong_count() > 0);
    }
}

/// The files of `mappings` as the unwind tables read them: through the descriptors held here,
/// which a process gone (or in another mount namespace) does not take with it.
pub fn table_files<'a>(
    files: impl Iterator<Item = &'a Arc<TargetFile>>,
) -> Vec<crate::unwind::loaded::Opened> {
    let mut out: Vec<crate::unwind::loaded::Opened> = Vec::new();
    for f in files {
        let id = f.id();
        let dev = u64::from(id.major) << 32 | u64::from(id.minor);
        if !out.iter().any(|o| o.dev == dev && o.inode == id.ino) {
            out.push(crate::unwind::loaded::Opened {
                dev,
                inode: id.ino,
                path: f.attach_path(),
            });
        }
    }
    out
}

/// The waits before each read again of a process the start found before its libraries were
/// mapped (its loader maps them within milliseconds).
const STARTING_READS: [std::time::Duration; 3] = [
    std::time::Duration::from_millis(2),
    std::time::Duration::from_millis(4),
    std::time::Duration::from_millis(14),
];

/// The lowest address a mapping can have (the kernel's default `vm.mmap_min_addr`), and the
/// highest user address on x86-64 (47 bits).
const LOWEST: u64 = 0x1_0000;
const HIGHEST: u64 = 0x7fff_ffff_ffff;

impl Modules {
    /// Reads the process's mappings again (if it is still alive); keeps the last good read.
    pub fn refresh(&mut self, pid: u32) {
        if let Ok(maps) = crate::targets::procfs::maps(pid) {
            self.keep(pid, &maps);
        }
    }

    /// Keeps the mappings of a process read right after its exec (`daemon::exec_watch`): its executable
    /// and the dynamic loader, its libraries not yet. A process of a few milliseconds may be
    /// gone before a later read; with this one its executable's frames are named all the same.
    /// The read is not the whole picture: `knows` says no until another read, and `not_code`
    /// does not cut a stack at an address outside it.
    pub fn keep_early(&mut self, pid: u32, read: &EarlyRead) {
        if self.knows(pid) {
            return; // read whole since
        }
        self.keep_with(pid, &read.maps, &read.files);
        self.early.insert(pid);
    }

    fn keep(&mut self, pid: u32, maps: &str) {
        self.keep_with(pid, maps, &[]);
    }

    /// Keeps `maps`, their files among `opened` or opened now.
    fn keep_with(&mut self, pid: u32, maps: &str, opened: &[Arc<TargetFile>]) {
        let parsed = self.parse_maps(pid, maps, opened);
        if let Some(t) = &self.unwind
            && !parsed.is_empty()
            && let Ok(mut t) = t.lock()
        {
            t.sync_with(
                pid,
                maps,
                &table_files(parsed.iter().filter_map(|m| m.file.as_ref())),
            );
        }
        if let Some(p) = &mut self.python
            && !parsed.is_empty()
        {
            p.sync(pid, maps);
        }
        if !parsed.is_empty() {
            self.procs.insert(pid, parsed);
            self.code.insert(pid, code_ranges(maps));
            self.early.remove(&pid);
        }
    }

    /// Reads the mappings of a process that just started until they settle: the dynamic
    /// loader maps every needed library before the program runs, so once `lib` is mapped and
    /// two reads agree, later reads rarely add anything (dlopen excepted, caught each round).
    pub fn settle(&mut self, pid: u32, lib: &std::path::Path, budget: std::time::Duration) {
        let start = std::time::Instant::now();
        let mut last: Option<String> = None;
        while start.elapsed() < budget {
            let Ok(maps) = crate::targets::procfs::maps(pid) else {
                return; // gone
            };
            if maps.contains(&*lib.to_string_lossy()) && last.as_deref() == Some(&maps) {
                break;
            }
            self.keep(pid, &maps);
            last = Some(maps);
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// Reads the mappings of processes the trace takes in as it starts (the `-p` process, its
    /// running descendants, those the scan of `--all` found), before counting is on: their
    /// unwind tables are then in place for their first counted call.
    /// One in its first milliseconds after an exec, its libraries not mapped yet, has no
    /// entry from that read (`loader_done`), nor an exec event to read it again by: it is
    /// read again here a few times, or else it would walk late until the daemon's first
    /// round (a compile loop's cc1plus, all of its life).
    pub fn take_in(&mut self, pids: impl IntoIterator<Item = u32>) {
        let mut starting = Vec::new();
        for pid in pids {
            if let Ok(maps) = crate::targets::procfs::maps(pid) {
                if !maps.is_empty() && !crate::unwind::loaded::loader_done(&maps) {
                    starting.push(pid);
                }
                self.keep(pid, &maps);
            }
        }
        for wait in STARTING_READS {
            if starting.is_empty() {
                break;
            }
            std::thread::sleep(wait);
            starting.retain(|&pid| {
                let Ok(maps) = crate::targets::procfs::maps(pid) else {
                    return false;
                };
                self.keep(pid, &maps);
                !maps.is_empty() && !crate::unwind::loaded::loader_done(&maps)
            });
        }
    }

    /// The processes whose mappings were read: each is forgotten once found gone, its unwind
    /// entry with it (a pid reused by another process must not find it).
    pub fn pids(&self) -> impl Iterator<Item = u32> + '_ {
        self.procs.keys().copied()
    }

    /// Whether the process's mappings were read since its libraries were mapped.
    pub fn knows(&self, pid: u32) -> bool {
        self.procs.contains_key(&pid) && !self.early.contains(&pid)
    }

    pub fn resolve(&self, pid: u32, addr: u64) -> Option<Location> {
        let maps = self.procs.get(&pid)?;
        maps.iter()
            .find(|m| addr >= m.start && addr < m.end)
            .map(|m| Location {
                path: m.path.clone(),
                offset: addr - m.start + m.offset,
                file: m.file.clone(),
            })
    }

    /// Whether `addr`, read as a return address in a stack of `pid`, cannot be one: a
    /// frame-pointer walk that went through code built without frame pointers reads on through
    /// whatever the frame pointer register held (a heap object, text), and every frame from
    /// there on is noise. Not code: outside the user address range, or outside the code
    /// mappings as last read. (Code unmapped since, a library dlclose'd, is taken for noise
    /// too: it could not be named anyway.) With the mappings not read, only the range tells.
    pub fn not_code(&self, pid: u32, addr: u64) -> bool {
        if !(LOWEST..=HIGHEST).contains(&addr) {
            return true;
        }
        let Some(code) = self.code.get(&pid).filter(|_| !self.early.contains(&pid)) else {
            return false;
        };
        let i = code.partition_point(|(start, _)| *start <= addr);
        i == 0 || addr >= code[i - 1].1
    }

    pub fn forget(&mut self, pid: u32) {
        if let Some(t) = &self.unwind
            && let Ok(mut t) = t.lock()
        {
            t.forget(pid);
        }
        if let Some(p) = &mut self.python {
            p.forget(pid);
        }
        self.procs.remove(&pid);
        self.code.remove(&pid);
        self.early.remove(&pid);
        self.early_gone.remove(&pid);
    }

    /// Removes the unwind entries the kernel gave forks never read here, once they are gone,
    /// and those the exec watch's threads wrote. A process read here is not looked at: the
    /// daemon forgets it at its end (`forget`), and a read of /proc a round for each would
    /// double the daemon's own.
    pub fn sweep(&mut self) {
        if let Some(t) = &self.unwind
            && let Ok(mut t) = t.lock()
        {
            let procs = &self.procs;
            t.sweep(|p| procs.contains_key(&p) || crate::targets::procfs::alive(p));
        }
    }

    /// Forgets the processes read only at their exec that were gone at the last call too: a
    /// process that never allocated is never forgotten at its end, as the others are. One
    /// call's grace, for the stacks of its last allocations, read the round after.
    pub fn prune_early(&mut self, alive: impl Fn(u32) -> bool) {
        let gone: std::collections::HashSet<u32> =
            self.early.iter().copied().filter(|p| !alive(*p)).collect();
        for p in gone.intersection(&self.early_gone) {
            if let Some(t) = &self.unwind
                && let Ok(mut t) = t.lock()
            {
                t.forget(*p);
            }
            if let Some(py) = &mut self.python {
                py.forget(*p);
            }
            self.procs.remove(p);
            self.code.remove(p);
            self.early.remove(p);
        }
        self.early_gone = gone
            .into_iter()
            .filter(|p| self.early.contains(p))
            .collect();
    }
}

/// The ranges of the mappings with execute permission, in address order (as the kernel lists
/// them).
fn code_ranges(maps: &str) -> Vec<(u64, u64)> {
    maps.lines()
        .filter_map(|line| {
            let mut cols = line.split_whitespace();
            let (range, perms) = (cols.next()?, cols.next()?);
            if !perms.contains('x') {
                return None;
            }
            let (lo, hi) = range.split_once('-')?;
            Some((
                u64::from_str_radix(lo, 16).ok()?,
                u64::from_str_radix(hi, 16).ok()?,
            ))
        })
        .collect()
}

impl Modules {
    /// The executable file mappings of `maps`, each with its file (among `opened`, or held,
    /// or opened now).
    fn parse_maps(&mut self, pid: u32, maps: &str, opened: &[Arc<TargetFile>]) -> Vec<Mapping> {
        let mut dir = None;
        let mut paths: HashMap<&Path, Arc<Path>> = HashMap::new();
        let entries = crate::targets::maps::parse(maps);
        let mut out = Vec::new();
        for e in entries.iter().filter(|e| e.exec) {
            let file = match opened.iter().find(|f| f.id() == e.id) {
                Some(f) => Some(f.clone()),
                None => self.files.get(pid, &mut dir, e),
            };
            let path = paths
                .entry(&e.path)
                .or_insert_with(|| e.path.as_path().into());
            out.push(Mapping {
                start: e.start,
                end: e.end,
                offset: e.offset,
                path: path.clone(),
                file,
            });
        }
        self.files.forget_released();
        out
    }
}

/// The file of `entry`: through the process while it lives, else (gone) through its path
/// here if that leads to the same file; a suspect one is skipped (said and counted).
fn open(pid: u32, dir: &str, entry: &MapsEntry) -> Option<TargetFile> {
    use crate::targets::target_file;
    match TargetFile::mapped(dir, entry) {
        Ok(f) => Some(f),
        Err(e) if e.suspect() => {
            target_file::skip(pid, &entry.path, Some(entry.id), &e);
            None
        }
        Err(_) => TargetFile::host_as(entry)
            .inspect_err(|e| log::debug!("pid {pid}: {} not named: {e}", entry.path.display()))
            .ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_are_one_by_path_bytes_and_offset() {
        use std::hash::BuildHasher;
        let at = |path: &str, offset| Location {
            path: Path::new(path).into(),
            offset,
            file: None,
        };
        let h = std::collections::hash_map::RandomState::new();
        let (a, b) = (at("/usr/lib/libc.so.6", 16), at("/usr/lib/libc.so.6", 16));
        assert!(
            a == b && h.hash_one(&a) == h.hash_one(&b),
            "separate Arcs, one location"
        );
        assert_ne!(a, at("/usr/lib/libc.so.6", 24));
        assert_ne!(a, at("/usr/lib/libm.so.6", 16));
        assert!(at("/a", 99) < at("/b", 1), "ordered by path first");
    }

    #[test]
    fn resolves_addresses_to_file_offsets() {
        let mut m = Modules::default();
        let parsed = m.parse_maps(
            1,
            "55d0c0000000-55d0c0001000 r--p 00000000 fe:01 1 /bin/prog\n\
                 55d0c0001000-55d0c0003000 r-xp 00001000 fe:01 1 /bin/prog\n\
                 7f0000000000-7f0000001000 r-xp 00028000 fe:01 2 /lib/libc.so.6\n",
            &[],
        );
        m.procs.insert(1, parsed);
        assert_eq!(
            m.resolve(1, 0x55d0c0001010),
            Some(Location {
                path: Path::new("/bin/prog").into(),
                offset: 0x1010,
                file: None,
            })
        );
        assert_eq!(m.resolve(1, 0x7f0000000100).unwrap().offset, 0x28100);
        assert_eq!(m.resolve(1, 0x55d0c0000010), None, "not executable");
        assert_eq!(m.resolve(2, 0x55d0c0001010), None, "unknown process");
    }

    #[test]
    fn return_addresses_outside_code_mappings_are_not_code() {
        let mut m = Modules::default();
        m.keep(
            1,
            "55d0c0000000-55d0c0001000 r--p 00000000 fe:01 1 /bin/prog\n\
             55d0c0001000-55d0c0003000 r-xp 00001000 fe:01 1 /bin/prog\n\
             55d0c1000000-55d0c1021000 rw-p 00000000 00:00 0 [heap]\n\
             7f0000000000-7f0000001000 r-xp 00000000 00:00 0 \n\
             7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]\n",
        );
        assert!(!m.not_code(1, 0x55d0c0001010), "the executable's code");
        assert!(!m.not_code(1, 0x7f0000000100), "anonymous code (a JIT's)");
        assert!(m.not_code(1, 0x30203e206874), "in no mapping (text again)");
        assert!(m.not_code(1, 0x55d0c1000800), "the heap");
        assert!(m.not_code(1, 0x55d0c0000010), "read-only data");
        assert!(m.not_code(1, 0x7ffd00000100), "the stack");
        assert!(m.not_code(1, 0x7265762f766e6579), "text, not an address");
        assert!(m.not_code(1, 0x10), "below any mapping");
        assert!(
            m.not_code(2, 0x10) && !m.not_code(2, 0x55d0c1000800),
            "maps not read"
        );
    }

    fn early(maps: &str) -> EarlyRead {
        EarlyRead {
            maps: maps.into(),
            files: Vec::new(),
        }
    }

    #[test]
    fn mappings_read_at_exec_name_the_executable_and_cut_nothing() {
        let at_exec = "55d0c0001000-55d0c0003000 r-xp 00001000 fe:01 1 /bin/prog\n\
                       7f1000000000-7f1000020000 r-xp 00001000 fe:01 3 /lib/ld.so\n";
        let mut m = Modules::default();
        m.keep_early(1, &early(at_exec));
        assert_eq!(m.resolve(1, 0x55d0c0001010).unwrap().offset, 0x1010);
        assert!(!m.knows(1), "its libraries are not read yet");
        assert!(
            !m.not_code(1, 0x7f0000000100),
            "libc, not mapped yet: not noise"
        );
        assert!(m.not_code(1, 0x10), "outside user space all the same");
        // A later read is the whole picture, and is not replaced by an exec-time one.
        m.keep(
            1,
            "55d0c0001000-55d0c0003000 r-xp 00001000 fe:01 1 /bin/prog\n\
             7f0000000000-7f0000001000 r-xp 00028000 fe:01 2 /lib/libc.so.6\n",
        );
        assert!(m.knows(1));
        m.keep_early(1, &early(at_exec));
        assert_eq!(m.resolve(1, 0x7f0000000100).unwrap().offset, 0x28100);
        // An exec-time read of a process gone for two calls is dropped; a whole read stays
        // until the process is forgotten at its end.
        m.keep_early(2, &early(at_exec));
        m.prune_early(|_| false);
        assert!(m.resolve(2, 0x55d0c0001010).is_some(), "one call's grace");
        m.prune_early(|_| false);
        assert!(m.resolve(2, 0x55d0c0001010).is_none());
        assert!(m.knows(1));
    }

    #[test]
    fn reads_own_mappings() {
        let mut m = Modules::default();
        let me = std::process::id();
        m.refresh(me);
        assert!(m.knows(me));
        let f = reads_own_mappings as *const () as u64;
        let loc = m.resolve(me, f).expect("own code is mapped");
        assert_eq!(*loc.path, *std::env::current_exe().unwrap());
    }
}
