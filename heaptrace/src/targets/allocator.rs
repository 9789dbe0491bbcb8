//! Which object provides `malloc` to a process: the executable (static binaries, programs with
//! their own allocator), a preloaded or linked allocator (jemalloc, tcmalloc), or libc.
use std::{
    fs,
    path::{Path, PathBuf},
    sync::Arc,
};

use heaptrace_common::Func;

use crate::{
    error::{Error, Result},
    targets::custom_symbols::{Abi, Custom},
    targets::elf::{self, FuncSite},
    targets::maps::MapsEntry,
    targets::target_file::{self, FileId, TargetFile},
};

/// The object whose malloc family heaptrace probes.
#[derive(Clone, Debug)]
pub struct Provider {
    /// The path as the target process sees it (for display).
    pub path: PathBuf,
    /// The file itself, opened safely: its sites were read from it, and its probes go on it.
    pub file: Arc<TargetFile>,
    pub sites: Vec<FuncSite>,
    /// How its functions take their arguments.
    pub abi: Abi,
}

/// The function heaptrace's own preload library (`heaptrace-preload`) defines to be told apart:
/// it defines the malloc family, and passes every call on to the allocator behind it, which
/// is the one to probe. Probes on it would count a `--in-process` run's calls twice and move
/// its entry points' first instructions out of line, where its frame-pointer walk loses them.
pub const PRELOAD_MARKER: &str = "heaptrace_preload_library";

/// Whether `file` is heaptrace's own preload library, by the function only it defines.
pub fn is_heaptrace_preload(file: &TargetFile) -> bool {
    let marker = [(Func::Malloc, PRELOAD_MARKER.to_string())];
    elf::named_sites(file, &marker).is_ok_and(|s| !s.is_empty())
}

impl Provider {
    fn load(file: Arc<TargetFile>) -> Result<Option<Provider>> {
        let sites = elf::alloc_sites(&file)?;
        if elf::defines_malloc(&sites) && is_heaptrace_preload(&file) {
            return Ok(None);
        }
        Ok(elf::defines_malloc(&sites).then_some(Provider {
            path: file.shown().to_path_buf(),
            file,
            sites,
            abi: Abi::C,
        }))
    }
}

/// The first of `files` (in symbol lookup order) that defines the custom malloc. Only its
/// custom functions are probed, not the family it may call underneath (a wrapper's libc
/// malloc): each call is counted once, under its custom name's function.
fn custom_in(files: &[Arc<TargetFile>], custom: &Custom, whose: &str) -> Result<Provider> {
    let names: Vec<(Func, String)> = custom
        .names
        .iter()
        .map(|(f, s, _)| (*f, s.clone()))
        .collect();
    let looked = || {
        files
            .iter()
            .map(|f| f.shown().display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    for file in files {
        let Ok(sites) = elf::named_sites(file, &names) else {
            continue; // not ELF: not the allocator
        };
        if !sites.iter().any(|s| s.func == Func::Malloc) {
            continue;
        }
        let has = |f: Func| sites.iter().any(|s| s.func == f || s.aliases.contains(&f));
        let missing: Vec<String> = custom
            .names
            .iter()
            .filter(|(f, _, required)| *required && !has(*f))
            .map(|(f, s, _)| format!("{s} ({})", f.name()))
            .collect();
        if !missing.is_empty() {
            return Err(Error::SymbolsNotFound {
                spec: custom.spec.clone(),
                missing: missing.join(", "),
                looked: file.shown().display().to_string(),
            });
        }
        return Ok(Provider {
            path: file.shown().to_path_buf(),
            file: file.clone(),
            sites,
            abi: custom.abi,
        });
    }
    let (f, s, _) = &custom.names[0];
    Err(Error::SymbolsNotFound {
        spec: custom.spec.clone(),
        missing: format!("{s} ({})", f.name()),
        looked: format!("{whose} (looked in: {})", looked()),
    })
}

/// The provider of custom allocator functions in a running process.
pub fn custom_for_pid(pid: u32, custom: &Custom) -> Result<Provider> {
    let c = candidates(pid)?;
    let files: Vec<Arc<TargetFile>> = c.files.iter().filter_map(|e| c.open(e)).collect();
    custom_in(&files, custom, &format!("process {pid}"))
}

/// The provider of custom allocator functions for a command about to be executed: its
/// executable, then its LD_PRELOAD libraries, then the host's libc (libraries it links are
/// only known once it runs: trace those with -p).
pub fn custom_for_command(
    exe: &Path,
    ld_preload: Option<&str>,
    custom: &Custom,
) -> Result<Provider> {
    let mut paths = vec![exe.to_path_buf()];
    paths.extend(preloaded(ld_preload));
    let libc = host_libc_path()?;
    if !paths.contains(&libc) {
        paths.push(libc);
    }
    let files: Vec<Arc<TargetFile>> = paths.iter().filter_map(|p| host_file(p)).collect();
    custom_in(&files, custom, &exe.display().to_string())
}

fn preloaded(ld_preload: Option<&str>) -> impl Iterator<Item = PathBuf> + '_ {
    ld_preload
        .unwrap_or("")
        .split([':', ' '])
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
}

/// A file of the host named by heaptrace's user, if it opens as a regular file.
fn host_file(path: &Path) -> Option<Arc<TargetFile>> {
    TargetFile::host(path)
        .inspect_err(|e| log::debug!("{} not opened: {e}", path.display()))
        .ok()
        .map(Arc::new)
}

pub(crate) fn is_libc(path: &Path) -> bool {
    path.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
        n.starts_with("libc.so") || n.starts_with("libc-") || n.starts_with("ld-musl")
    })
}

pub(crate) fn is_dynamic_loader(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("ld-linux"))
}

/// The host's libc: the one heaptrace itself runs on.
pub fn host_libc_path() -> Result<PathBuf> {
    let maps = fs::read_to_string("/proc/self/maps").map_err(|source| Error::Read {
        path: "/proc/self/maps".into(),
        source,
    })?;
    mapped_files(&maps)
        .into_iter()
        .map(|e| e.path)
        .find(|p| is_libc(p))
        .ok_or_else(|| Error::NoMallocFor("the host (no libc mapped in heaptrace itself)".into()))
}

pub fn host_libc() -> Result<Provider> {
    let path = host_libc_path()?;
    let file = TargetFile::host(&path)
        .map_err(|e| Error::NoMallocFor(format!("{} ({e})", path.display())))?;
    Provider::load(Arc::new(file))?.ok_or_else(|| Error::NoMallocFor(path.display().to_string()))
}

/// Executable file mappings of /proc/PID/maps, in order of first appearance, one per file.
fn mapped_files(maps: &str) -> Vec<MapsEntry> {
    let mut out: Vec<MapsEntry> = Vec::new();
    for e in crate::targets::maps::parse(maps) {
        if e.exec && !out.iter().any(|o| o.id == e.id && o.path == e.path) {
            out.push(e);
        }
    }
    out
}

/// The provider for a running process. Symbol lookup order is the executable first, then the
/// libraries in load order, so the first object that defines malloc and free wins; libc last.
pub fn for_pid(pid: u32) -> Result<Provider> {
    let provider = for_pid_known(pid, &mut Known::default())?;
    Ok(provider.expect("nothing is known attached"))
}

/// What is known of allocator files by identity, so each is parsed once.
#[derive(Default)]
pub struct Known {
    /// Files that define malloc and are probed already.
    pub attached: std::collections::HashSet<FileId>,
    /// Files that define no malloc.
    pub not_allocators: std::collections::HashSet<FileId>,
}

/// `for_pid`, skipping files already known: Ok(None) when the process's allocator is a file
/// probed already.
pub fn for_pid_known(pid: u32, known: &mut Known) -> Result<Option<Provider>> {
    let c = candidates(pid)?;
    for entry in &c.files {
        if known.attached.contains(&entry.id) {
            return Ok(None);
        }
        if known.not_allocators.contains(&entry.id) {
            continue;
        }
        // Unreadable, suspect (skipped, said) or non-ELF files are not allocators.
        let Some(file) = c.open(entry) else { continue };
        match Provider::load(file) {
            Ok(Some(p)) => return Ok(Some(p)),
            Ok(None) => {
                known.not_allocators.insert(entry.id);
            }
            Err(_) => {}
        }
    }
    Err(Error::NoMalloc {
        pid,
        looked: c
            .files
            .iter()
            .map(|e| e.path.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
    })
}

/// The libc a process maps, opened, if it maps one. A process whose allocator is another file
/// still makes its memory syscalls through libc's wrappers.
pub fn libc_of(pid: u32) -> Result<Option<Arc<TargetFile>>> {
    let c = candidates(pid)?;
    Ok(c.files
        .iter()
        .find(|e| is_libc(&e.path))
        .and_then(|e| c.open(e)))
}

/// A process's mapped files in symbol lookup order (the executable, then libraries in load
/// order, libc last; the dynamic loader left out), and where to open them from.
struct Candidates {
    pid: u32,
    /// Its /proc directory: a running thread's when the leader has exited.
    dir: String,
    files: Vec<MapsEntry>,
}

impl Candidates {
    /// The file of `entry`, opened safely; a suspect one is said and counted.
    fn open(&self, entry: &MapsEntry) -> Option<Arc<TargetFile>> {
        match TargetFile::mapped(&self.dir, entry) {
            Ok(f) => Some(Arc::new(f)),
            Err(e) => {
                target_file::skip(self.pid, &entry.path, Some(entry.id), &e);
                None
            }
        }
    }
}

fn candidates(pid: u32) -> Result<Candidates> {
    // A running thread's, when the leader has exited (its files are empty then).
    let dir = crate::targets::procfs::space_dir(pid);
    let maps_path = PathBuf::from(format!("{dir}/maps"));
    let maps = fs::read_to_string(&maps_path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            Error::NoSuchProcess(pid)
        } else {
            Error::Read {
                path: maps_path.clone(),
                source,
            }
        }
    })?;
    // Its path only orders the files; the file opened is the one mapped.
    let exe = fs::read_link(format!("{dir}/exe")).ok();
    let is_exe = |e: &MapsEntry| Some(&e.path) == exe.as_ref();
    let files = mapped_files(&maps);
    let mut ordered: Vec<MapsEntry> = Vec::new();
    ordered.extend(files.iter().filter(|e| is_exe(e)).cloned());
    ordered.extend(
        files
            .iter()
            .filter(|e| !is_exe(e) && !is_libc(&e.path) && !is_dynamic_loader(&e.path))
            .cloned(),
    );
    ordered.extend(files.iter().filter(|e| is_libc(&e.path)).cloned());
    Ok(Candidates {
        pid,
        dir,
        files: ordered,
    })
}

/// The provider for a command about to be executed: the executable if it defines malloc (a
/// static binary), else the first LD_PRELOAD library that does, else the host's libc.
pub fn for_command(exe: &Path, ld_preload: Option<&str>) -> Result<Provider> {
    let paths = std::iter::once(exe.to_path_buf()).chain(preloaded(ld_preload));
    for path in paths {
        if let Some(file) = host_file(&path)
            && let Ok(Some(p)) = Provider::load(file)
        {
            return Ok(p);
        }
    }
    host_libc()
}

/// Resolves a command name the way execvp does.
pub fn resolve_command(cmd: &std::ffi::OsStr) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt as _;
    if cmd.as_bytes().contains(&b'/') {
        return Some(PathBuf::from(cmd));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(cmd))
        .find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_maps_lines_keeping_executable_files_once() {
        let maps = "\
55d0c0000000-55d0c0001000 r--p 00000000 fe:01 123 /usr/bin/prog
55d0c0001000-55d0c0002000 r-xp 00001000 fe:01 123 /usr/bin/prog
7f0000000000-7f0000100000 r-xp 00000000 fe:01 456 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2
7f0000200000-7f0000300000 r-xp 00000000 fe:01 789 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000400000-7f0000500000 r-xp 00000000 fe:01 790 /tmp/my lib.so
7f0000600000-7f0000700000 r-xp 00000000 fe:01 791 /tmp/old.so (deleted)
7ffd00000000-7ffd00001000 r-xp 00000000 00:00 0 [vdso]
";
        let files: Vec<PathBuf> = mapped_files(maps).into_iter().map(|e| e.path).collect();
        assert_eq!(
            files,
            vec![
                PathBuf::from("/usr/bin/prog"),
                PathBuf::from("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"),
                PathBuf::from("/usr/lib/x86_64-linux-gnu/libc.so.6"),
                PathBuf::from("/tmp/my lib.so"),
                PathBuf::from("/tmp/old.so"),
            ]
        );
        assert!(is_libc(&files[2]));
        assert!(!is_libc(&files[1]));
    }

    #[test]
    fn own_process_uses_host_libc() {
        let p = for_pid(std::process::id()).unwrap();
        assert_eq!(p.path, host_libc_path().unwrap());
    }

    #[test]
    fn missing_process_is_reported_as_such() {
        let err = for_pid(u32::MAX - 1).unwrap_err();
        assert!(matches!(err, Error::NoSuchProcess(_)), "{err}");
    }
}
