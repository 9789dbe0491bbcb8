//! Which object provides `malloc` to a process: the executable (static binaries, programs with
//! their own allocator), a preloaded or linked allocator (jemalloc, tcmalloc), or libc.
use std::{
    fs,
    path::{Path, PathBuf},
};

use heaptrace_common::Func;

use crate::{
    error::{Error, Result},
    targets::custom_symbols::{Abi, Custom},
    targets::elf::{self, FuncSite},
};

/// The object whose malloc family heaptrace probes.
#[derive(Clone, Debug)]
pub struct Provider {
    /// The path as the target process sees it (for display).
    pub path: PathBuf,
    /// The path heaptrace opens to attach (through /proc/PID/root for other mount namespaces).
    pub attach_path: PathBuf,
    pub sites: Vec<FuncSite>,
    /// How its functions take their arguments.
    pub abi: Abi,
}

impl Provider {
    fn load(path: PathBuf, attach_path: PathBuf) -> Result<Option<Provider>> {
        let sites = elf::alloc_sites(&attach_path)?;
        Ok(elf::defines_malloc(&sites).then_some(Provider {
            path,
            attach_path,
            sites,
            abi: Abi::C,
        }))
    }
}

/// The first of `files` (in symbol lookup order) that defines the custom malloc. Only its
/// custom functions are probed, not the family it may call underneath (a wrapper's libc
/// malloc): each call is counted once, under its custom name's function.
fn custom_in(files: &[(PathBuf, PathBuf)], custom: &Custom, whose: &str) -> Result<Provider> {
    let names: Vec<(Func, String)> = custom
        .names
        .iter()
        .map(|(f, s, _)| (*f, s.clone()))
        .collect();
    let looked = || {
        files
            .iter()
            .map(|(p, _)| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    for (path, attach) in files {
        let Ok(sites) = elf::named_sites(attach, &names) else {
            continue; // unreadable or not ELF: not the allocator
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
                looked: path.display().to_string(),
            });
        }
        return Ok(Provider {
            path: path.clone(),
            attach_path: attach.clone(),
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
    let (ordered, root) = candidates(pid)?;
    let files: Vec<(PathBuf, PathBuf)> = ordered
        .into_iter()
        .map(|p| {
            let attach = root.join(p.strip_prefix("/").unwrap_or(&p));
            (p, attach)
        })
        .collect();
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
    let mut files = vec![exe.to_path_buf()];
    files.extend(
        ld_preload
            .unwrap_or("")
            .split([':', ' '])
            .filter(|s| !s.is_empty())
            .map(PathBuf::from),
    );
    let libc = host_libc_path()?;
    if !files.contains(&libc) {
        files.push(libc);
    }
    let files: Vec<(PathBuf, PathBuf)> = files.into_iter().map(|p| (p.clone(), p)).collect();
    custom_in(&files, custom, &exe.display().to_string())
}

fn is_libc(path: &Path) -> bool {
    path.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
        n.starts_with("libc.so") || n.starts_with("libc-") || n.starts_with("ld-musl")
    })
}

fn is_dynamic_loader(path: &Path) -> bool {
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
        .find(|p| is_libc(p))
        .ok_or_else(|| Error::NoMallocFor("the host (no libc mapped in heaptrace itself)".into()))
}

pub fn host_libc() -> Result<Provider> {
    let path = host_libc_path()?;
    Provider::load(path.clone(), path.clone())?
        .ok_or_else(|| Error::NoMallocFor(path.display().to_string()))
}

/// Executable file mappings of /proc/PID/maps, in order of first appearance, without duplicates.
fn mapped_files(maps: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    for line in maps.lines() {
        let mut cols = line.split_whitespace();
        let perms = cols.nth(1).unwrap_or("");
        let path: Vec<&str> = cols.skip(3).collect();
        if !perms.contains('x') || path.is_empty() || !path[0].starts_with('/') {
            continue;
        }
        let path = path.join(" ");
        if path.ends_with(" (deleted)") {
            continue;
        }
        let path = PathBuf::from(path);
        if !out.contains(&path) {
            out.push(path);
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

/// What is known of allocator files by (device, inode), so each is parsed once.
#[derive(Default)]
pub struct Known {
    /// Files that define malloc and are probed already.
    pub attached: std::collections::HashSet<(u64, u64)>,
    /// Files that define no malloc.
    pub not_allocators: std::collections::HashSet<(u64, u64)>,
}

/// `for_pid`, skipping files already known: Ok(None) when the process's allocator is a file
/// probed already.
pub fn for_pid_known(pid: u32, known: &mut Known) -> Result<Option<Provider>> {
    let (ordered, root) = candidates(pid)?;
    let in_root = |p: &Path| root.join(p.strip_prefix("/").unwrap_or(p));
    for path in &ordered {
        let attach = in_root(path);
        let id = file_id(&attach);
        if let Some(id) = id {
            if known.attached.contains(&id) {
                return Ok(None);
            }
            if known.not_allocators.contains(&id) {
                continue;
            }
        }
        // Unreadable or non-ELF mappings (vdso-like files, deleted files) are not allocators.
        match Provider::load(path.clone(), attach) {
            Ok(Some(p)) => return Ok(Some(p)),
            Ok(None) => {
                if let Some(id) = id {
                    known.not_allocators.insert(id);
                }
            }
            Err(_) => {}
        }
    }
    Err(Error::NoMalloc {
        pid,
        looked: ordered
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
    })
}

/// The libc a process maps, as (its path, the path to attach to), if it maps one. A process
/// whose allocator is another file still makes its memory syscalls through libc's wrappers.
pub fn libc_of(pid: u32) -> Result<Option<(PathBuf, PathBuf)>> {
    let (ordered, root) = candidates(pid)?;
    Ok(ordered.into_iter().find(|p| is_libc(p)).map(|p| {
        let attach = root.join(p.strip_prefix("/").unwrap_or(&p));
        (p, attach)
    }))
}

/// A process's mapped files in symbol lookup order (the executable, then libraries in load
/// order, libc and the dynamic loader's neighbours last), and its root directory.
fn candidates(pid: u32) -> Result<(Vec<PathBuf>, PathBuf)> {
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
    let exe = fs::read_link(format!("{dir}/exe")).ok();
    let files = mapped_files(&maps);
    let mut ordered: Vec<PathBuf> = Vec::new();
    ordered.extend(files.iter().filter(|p| Some(*p) == exe.as_ref()).cloned());
    ordered.extend(
        files
            .iter()
            .filter(|p| Some(*p) != exe.as_ref() && !is_libc(p) && !is_dynamic_loader(p))
            .cloned(),
    );
    ordered.extend(files.iter().filter(|p| is_libc(p)).cloned());
    Ok((ordered, PathBuf::from(format!("{dir}/root"))))
}

/// The provider for a command about to be executed: the executable if it defines malloc (a
/// static binary), else the first LD_PRELOAD library that does, else the host's libc.
pub fn for_command(exe: &Path, ld_preload: Option<&str>) -> Result<Provider> {
    if let Ok(Some(p)) = Provider::load(exe.into(), exe.into()) {
        return Ok(p);
    }
    for lib in ld_preload
        .unwrap_or("")
        .split([':', ' '])
        .filter(|s| !s.is_empty())
    {
        if let Ok(Some(p)) = Provider::load(lib.into(), lib.into()) {
            return Ok(p);
        }
    }
    host_libc()
}

/// A file's identity: the same library seen through different paths (a container's root, a
/// bind mount) is attached once, and a different file at the same path is not mistaken for it.
pub fn file_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    let m = fs::metadata(path).ok()?;
    Some((m.dev(), m.ino()))
}

/// Resolves a command name the way execvp does.
pub fn resolve_command(cmd: &str) -> Option<PathBuf> {
    if cmd.contains('/') {
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
        let files = mapped_files(maps);
        assert_eq!(
            files,
            vec![
                PathBuf::from("/usr/bin/prog"),
                PathBuf::from("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"),
                PathBuf::from("/usr/lib/x86_64-linux-gnu/libc.so.6"),
                PathBuf::from("/tmp/my lib.so"),
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
