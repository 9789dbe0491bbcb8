//! The library of `--in-process` (`heaptrace-preload`, embedded at build time), put where a
//! launched command's dynamic loader can open it, and the checks that the command can take it
//! at all: a static program has no dynamic loader to preload it, and a set-user-ID one run by
//! another user has it ignored.
use std::{
    io::Read as _,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    os::unix::{
        ffi::OsStrExt as _,
        fs::{DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _, PermissionsExt as _},
    },
    path::{Path, PathBuf},
};

use crate::error::{Error, Result};

static LIBRARY: &[u8] = include_bytes!(env!("HEAPTRACE_PRELOAD_SO"));

/// The library's bytes, as loaded into a running process (`targets::inject`).
pub fn library() -> &'static [u8] {
    LIBRARY
}

/// Why a command cannot be traced in process, in one line; None if it can.
pub fn refusal(exe: &Path) -> Option<String> {
    let meta = std::fs::metadata(exe).ok()?;
    // SAFETY: no preconditions.
    let euid = unsafe { libc::geteuid() };
    if meta.mode() & (libc::S_ISUID | libc::S_ISGID) != 0 && meta.uid() != euid {
        return Some(format!(
            "{} is set-user-ID or set-group-ID: its dynamic loader ignores LD_PRELOAD, so \
             --in-process cannot trace it; leave --in-process out to trace it with probes",
            exe.display()
        ));
    }
    // A script runs its interpreter (once: an interpreter that is itself a script is left to
    // the kernel, which refuses it too).
    let exe = &shebang(exe).unwrap_or_else(|| exe.to_path_buf());
    match interpreter(exe) {
        Ok(true) => None,
        Ok(false) => Some(format!(
            "{} is statically linked: no dynamic loader preloads a library into it, so \
             --in-process cannot trace it; leave --in-process out to trace it with probes",
            exe.display()
        )),
        Err(e) => Some(format!("--in-process: cannot read {}: {e}", exe.display())),
    }
}

/// The interpreter a script names on its `#!` line, if it is one.
fn shebang(path: &Path) -> Option<PathBuf> {
    let mut head = [0u8; 256];
    let n = std::fs::File::open(path).ok()?.read(&mut head).ok()?;
    let line = head[..n].strip_prefix(b"#!")?;
    let line = &line[..line.iter().position(|b| *b == b'\n')?];
    let word = line
        .split(|b| *b == b' ' || *b == b'\t')
        .find(|w| !w.is_empty())?;
    Some(PathBuf::from(std::ffi::OsStr::from_bytes(word)))
}

/// Whether an ELF file asks for a dynamic loader (has a PT_INTERP segment). Reads the file
/// header and the program headers only, bounded.
fn interpreter(exe: &Path) -> std::io::Result<bool> {
    let mut f = std::fs::File::open(exe)?;
    let mut head = [0u8; 64];
    f.read_exact(&mut head)?;
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "not a 64-bit ELF file");
    if head[..4] != *b"\x7fELF" || head[4] != 2 || head[5] != 1 {
        return Err(bad());
    }
    let u16_at = |o: usize| u16::from_le_bytes([head[o], head[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(head[32..40].try_into().map_err(|_| bad())?);
    let (entsize, count) = (u16_at(54), u16_at(56));
    if entsize < 56 || count > 512 {
        return Err(bad());
    }
    let mut table = vec![0u8; entsize * count];
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut table, phoff)?;
    const PT_INTERP: u32 = 3;
    Ok(table
        .chunks_exact(entsize)
        .any(|ph| u32::from_le_bytes([ph[0], ph[1], ph[2], ph[3]]) == PT_INTERP))
}

/// The directory the library goes in: /run/heaptrace for root, else the user's runtime
/// directory (or /tmp/heaptrace-UID), made if missing; it must be ours and writable by no
/// one else, so that nobody can swap the library a traced command loads. Err: why not.
fn directory() -> std::result::Result<PathBuf, String> {
    // SAFETY: no preconditions.
    let euid = unsafe { libc::geteuid() };
    let dir = if euid == 0 {
        PathBuf::from("/run/heaptrace")
    } else {
        match std::env::var_os("XDG_RUNTIME_DIR") {
            Some(d) if !d.is_empty() => Path::new(&d).join("heaptrace"),
            _ => PathBuf::from(format!("/tmp/heaptrace-{euid}")),
        }
    };
    let mode = if euid == 0 { 0o755 } else { 0o700 };
    match std::fs::DirBuilder::new().mode(mode).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("cannot make {}: {e}", dir.display())),
    }
    let meta = std::fs::symlink_metadata(&dir)
        .map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
    if !meta.is_dir() {
        return Err(format!("{} is not a directory", dir.display()));
    }
    if meta.uid() != euid {
        return Err(format!(
            "{} is owned by uid {}, not by you",
            dir.display(),
            meta.uid()
        ));
    }
    if meta.permissions().mode() & 0o022 != 0 {
        return Err(format!("others can write to {}", dir.display()));
    }
    Ok(dir)
}

/// Where the command's dynamic loader finds the library.
pub enum Library {
    /// A file of heaptrace's directory.
    File(PathBuf),
    /// A sealed memfd the command inherits, named by /proc/self/fd: heaptrace's directory
    /// could not be used.
    Memfd(OwnedFd),
}

impl Library {
    /// The library's path in the command's LD_PRELOAD.
    pub fn preload_path(&self) -> String {
        match self {
            Library::File(p) => p.display().to_string(),
            Library::Memfd(fd) => format!("/proc/self/fd/{}", fd.as_raw_fd()),
        }
    }

    /// The descriptor the command must inherit, if any.
    pub fn fd(&self) -> Option<i32> {
        match self {
            Library::File(_) => None,
            Library::Memfd(fd) => Some(fd.as_raw_fd()),
        }
    }
}

/// The library, written once per build to heaptrace's directory (named by its checksum); or,
/// when that directory cannot be used (another user made it first, others can write to it),
/// handed to the command as a sealed memfd, and the reason said.
pub fn install() -> Result<Library> {
    let why = match directory() {
        Ok(dir) => return Ok(Library::File(install_in(&dir)?)),
        Err(why) => why,
    };
    let fd = sealed_memfd()?;
    crate::say!(
        "heaptrace: not using heaptrace's library directory: {why}; the command gets the \
         library as a sealed memfd"
    );
    Ok(Library::Memfd(fd))
}

/// The library in a memfd no one can change any more (sealed against writes and resizing).
fn sealed_memfd() -> Result<OwnedFd> {
    let err = |what: &str| {
        let e = std::io::Error::last_os_error();
        Error::Io(std::io::Error::new(e.kind(), format!("{what}: {e}")))
    };
    let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    // SAFETY: a NUL-terminated name.
    let fd = unsafe { libc::memfd_create(c"heaptrace-preload".as_ptr(), flags) };
    if fd < 0 {
        return Err(err("memfd_create for the library"));
    }
    // SAFETY: a new descriptor, ours alone.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut file = std::fs::File::from(fd.try_clone()?);
    std::io::Write::write_all(&mut file, LIBRARY)?;
    let seals = libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
    // SAFETY: adds seals to our own memfd.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(err("sealing the library's memfd"));
    }
    Ok(fd)
}

/// The library's path in `dir`, written there once per build (named by its checksum).
fn install_in(dir: &Path) -> Result<PathBuf> {
    let name = format!("libheaptrace-preload-{:08x}.so", crc32fast::hash(LIBRARY));
    let path = dir.join(&name);
    if let Ok(meta) = std::fs::symlink_metadata(&path)
        && meta.is_file()
        && std::fs::read(&path).is_ok_and(|b| b == LIBRARY)
    {
        return Ok(path);
    }
    let tmp = dir.join(format!(".{name}.{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        std::io::Write::write_all(&mut f, LIBRARY)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)
    };
    write().map_err(|source| {
        let _ = std::fs::remove_file(&tmp);
        Error::Write {
            path: path.clone(),
            source,
        }
    })?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_and_dynamic_programs_are_told_apart() {
        assert_eq!(interpreter(Path::new("/bin/sh")).ok(), Some(true));
        assert!(interpreter(Path::new("/etc/passwd")).is_err());
        assert!(refusal(Path::new("/bin/sh")).is_none());
    }

    #[test]
    fn a_script_is_judged_by_its_interpreter() {
        let dir = std::env::temp_dir().join(format!("ht-shebang-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = dir.join("s.sh");
        std::fs::write(&script, "#!/bin/sh -e\necho hi\n").unwrap();
        assert_eq!(shebang(&script), Some(PathBuf::from("/bin/sh")));
        assert!(refusal(&script).is_none());
        std::fs::write(&script, "echo no interpreter\n").unwrap();
        assert_eq!(shebang(&script), None);
        assert!(refusal(&script).is_some());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_library_is_embedded() {
        assert!(LIBRARY.starts_with(b"\x7fELF"));
    }
}
