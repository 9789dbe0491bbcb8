//! A file of a traced process, opened safely.
//!
//! Everything a traced process shows is hostile input, its paths above all: inside a container
//! an absolute symlink resolves on the host when followed from outside, a path can be swapped
//! for a FIFO (an `open` that never returns) or a device, and a file can change between being
//! parsed and being probed. So a mapped file is opened through `/proc/PID/map_files/`, which
//! leads to the very file mapped whatever its path has become; anything else through
//! `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)` under `/proc/PID/root`. Every open is
//! non-blocking, only a regular file is kept, and a mapped one must be the (device, inode)
//! /proc/PID/maps shows. The one descriptor is then read (never mapped: a file the process
//! can truncate would fault heaptrace) and probed through `/proc/self/fd/N`, which resolves to
//! exactly its inode: what was decoded is what gets probed.
//!
//! A file that fails a check is skipped, said once and counted ([`skipped`]); the daemon adds
//! the count to the run's losses.
use std::{
    collections::HashSet,
    fs, io,
    os::{
        fd::{AsRawFd as _, FromRawFd as _},
        unix::{ffi::OsStrExt as _, fs::FileExt as _},
    },
    path::{Path, PathBuf},
    sync::{
        Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use thiserror::Error;

use crate::targets::maps::MapsEntry;

/// A file's identity as /proc/PID/maps shows it: its device (major, minor) and inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FileId {
    pub major: u32,
    pub minor: u32,
    pub ino: u64,
}

impl FileId {
    fn of(meta: &libc::stat) -> FileId {
        FileId {
            major: libc::major(meta.st_dev),
            minor: libc::minor(meta.st_dev),
            ino: meta.st_ino,
        }
    }
}

impl std::fmt::Display for FileId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:02x}:{:02x} {}", self.major, self.minor, self.ino)
    }
}

/// The kind of a file that is not a regular one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Fifo,
    CharDevice,
    BlockDevice,
    Directory,
    Socket,
    Symlink,
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Kind::Fifo => "a FIFO",
            Kind::CharDevice => "a character device",
            Kind::BlockDevice => "a block device",
            Kind::Directory => "a directory",
            Kind::Socket => "a socket",
            Kind::Symlink => "a symbolic link",
        })
    }
}

/// Why a file of a traced process was not opened, or not kept.
#[derive(Debug, Error)]
pub enum FileError {
    /// It could not be opened (the process or its mapping is gone, a symlink leading out of
    /// its root, no permission).
    #[error("cannot open it: {0}")]
    Open(#[source] io::Error),
    #[error("it is {0}, not a regular file")]
    NotRegular(Kind),
    #[error("it is not the file mapped (device and inode {found}, mapped {mapped})")]
    Changed { mapped: FileId, found: FileId },
    #[error("it has {size} bytes, more than the {max} heaptrace reads")]
    TooLarge { size: u64, max: u64 },
}

impl FileError {
    /// Whether the file itself is suspect (not regular, swapped, oversized, a path leading
    /// out of the process's root): skipped and counted. The others (a process gone, a file
    /// not readable) are what a process that ends or changes its mappings leaves behind.
    pub fn suspect(&self) -> bool {
        match self {
            FileError::Open(e) => matches!(e.raw_os_error(), Some(libc::ELOOP | libc::EXDEV)),
            _ => true,
        }
    }
}

/// The most bytes heaptrace reads of one file, in all (`read_at`'s callers bound their own
/// reads below it): a file larger than this is skipped.
pub const MAX_SIZE: u64 = 4 << 30;

/// A regular file of a traced process, opened once and held: every read and every probe goes
/// through this one descriptor. Two are equal when they are the same file.
#[derive(Debug)]
pub struct TargetFile {
    file: fs::File,
    id: FileId,
    size: u64,
    /// The path as the process sees it (for display).
    shown: PathBuf,
    /// Whether someone other than root on this host may change it: a file not owned by root,
    /// or writable by others, or one of a process in another mount namespace (a container's
    /// root may own its files). Mapping it could fault (see `private_copy`).
    may_change: bool,
}

impl PartialEq for TargetFile {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}

impl Eq for TargetFile {}

impl std::hash::Hash for TargetFile {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.id.hash(state);
    }
}

impl PartialOrd for TargetFile {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for TargetFile {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.id.cmp(&other.id)
    }
}

impl TargetFile {
    /// The file mapped at `entry` of the process whose /proc directory is `dir` (/proc/PID,
    /// or a running thread's): through map_files, else (map_files refused, or a thread's
    /// directory) the mapped path under the process's root; either way it must be the
    /// (device, inode) mapped.
    pub fn mapped(dir: &str, entry: &MapsEntry) -> Result<TargetFile, FileError> {
        let link = format!("{dir}/map_files/{:x}-{:x}", entry.start, entry.end);
        let opened = match map_files_refused() {
            true => Err(io::Error::from_raw_os_error(libc::EPERM)),
            false => open_nonblocking(Path::new(&link)),
        };
        // A thread's directory (the leader has exited) has no map_files.
        let no_map_files = dir.contains("/task/");
        let file = match opened {
            Ok(f) => f,
            Err(e)
                if e.raw_os_error() == Some(libc::EPERM)
                    || no_map_files && e.raw_os_error() == Some(libc::ENOENT) =>
            {
                in_root(dir, &entry.path).map_err(FileError::Open)?
            }
            Err(e) => return Err(FileError::Open(e)),
        };
        let mut opened = TargetFile::check(file, entry.path.clone())?;
        opened.may_change |= !same_mount_namespace(dir);
        if opened.id != entry.id {
            return Err(FileError::Changed {
                mapped: entry.id,
                found: opened.id,
            });
        }
        Ok(opened)
    }

    /// The file at `path` as the process whose /proc directory is `dir` sees it: resolved
    /// inside its root, no magic link followed.
    pub fn in_root(dir: &str, path: &Path) -> Result<TargetFile, FileError> {
        let file = in_root(dir, path).map_err(FileError::Open)?;
        let mut opened = TargetFile::check(file, path.to_path_buf())?;
        opened.may_change |= !same_mount_namespace(dir);
        Ok(opened)
    }

    /// The file mapped at `entry` by a process that is gone, through its path on this host:
    /// kept only if it is the file that was mapped (a process of this host's mount
    /// namespace; a container's path leads elsewhere). A mismatch here is no sign of
    /// hostility: the caller does not count it.
    pub fn host_as(entry: &MapsEntry) -> Result<TargetFile, FileError> {
        let opened = TargetFile::host(&entry.path)?;
        if opened.id != entry.id {
            return Err(FileError::Changed {
                mapped: entry.id,
                found: opened.id,
            });
        }
        Ok(opened)
    }

    /// A file of heaptrace's own host, named by its user (the command to start, its
    /// LD_PRELOAD, the host's libc): opened without blocking, and regular.
    pub fn host(path: &Path) -> Result<TargetFile, FileError> {
        let file = open_nonblocking(path).map_err(FileError::Open)?;
        TargetFile::check(file, path.to_path_buf())
    }

    fn check(file: fs::File, shown: PathBuf) -> Result<TargetFile, FileError> {
        // SAFETY: stat is plain data, filled by fstat on a descriptor we own.
        let mut meta: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(file.as_raw_fd(), &mut meta) } != 0 {
            return Err(FileError::Open(io::Error::last_os_error()));
        }
        if let Some(kind) = not_regular(meta.st_mode) {
            return Err(FileError::NotRegular(kind));
        }
        let size = meta.st_size as u64;
        if size > MAX_SIZE {
            return Err(FileError::TooLarge {
                size,
                max: MAX_SIZE,
            });
        }
        Ok(TargetFile {
            file,
            id: FileId::of(&meta),
            size,
            shown,
            may_change: meta.st_uid != 0 || meta.st_mode & 0o022 != 0,
        })
    }

    pub fn id(&self) -> FileId {
        self.id
    }

    /// The size it had when opened.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The path as the process sees it.
    pub fn shown(&self) -> &Path {
        &self.shown
    }

    /// The path that leads to this very file, from heaptrace: the kernel resolves it to the
    /// descriptor's inode, which is what a uprobe attaches to.
    pub fn attach_path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}", self.file.as_raw_fd()))
    }

    /// Up to `len` bytes at `offset` (fewer at the end of the file, or if it has shrunk).
    pub fn read_at(&self, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        let mut buf = vec![0; len];
        let mut got = 0;
        while got < len {
            match self.file.read_at(&mut buf[got..], offset + got as u64) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        buf.truncate(got);
        Ok(buf)
    }

    /// A path to the file's bytes that is safe to map: the file itself (`attach_path`) when
    /// only root here can change it, else a sealed in-memory copy (returned with it, to hold
    /// while the path is in use), which nothing can truncate under the map.
    pub fn mappable(&self) -> io::Result<(PathBuf, Option<fs::File>)> {
        if !self.may_change {
            return Ok((self.attach_path(), None));
        }
        let copy = self.private_copy()?;
        let path = PathBuf::from(format!("/proc/self/fd/{}", copy.as_raw_fd()));
        Ok((path, Some(copy)))
    }

    /// The file's bytes (as many as it had when opened, at most) in a sealed memfd.
    fn private_copy(&self) -> io::Result<fs::File> {
        // SAFETY: a NUL-terminated name; the new fd is owned at once.
        let fd = unsafe {
            libc::memfd_create(
                c"heaptrace-module".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor that nothing else owns.
        let copy = unsafe { fs::File::from_raw_fd(fd) };
        let mut offset: libc::off_t = 0;
        while (offset as u64) < self.size {
            let left = (self.size - offset as u64).min(1 << 30) as usize;
            // SAFETY: two descriptors we own and an offset that lives across the call.
            let n = unsafe { libc::sendfile(fd, self.file.as_raw_fd(), &mut offset, left) };
            match n {
                0 => break, // shrunk meanwhile: a short copy parses as a broken ELF file
                n if n < 0 => {
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
                _ => {}
            }
        }
        let seals =
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on a descriptor we own.
        if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(copy)
    }
}

/// Whether the process whose /proc directory is `dir` sees the files heaptrace sees.
fn same_mount_namespace(dir: &str) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    let ino = |p: &str| fs::metadata(p).map(|m| m.ino()).ok();
    matches!((ino(&format!("{dir}/ns/mnt")), ino("/proc/self/ns/mnt")), (Some(a), Some(b)) if a == b)
}

/// Every file of the traced processes whose frames may be named is held open (`symbolize::modules`):
/// the soft limit on descriptors goes up to the hard one, once.
fn raise_fd_limit() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: rlimit is plain data, read and written by the kernel.
        unsafe {
            let mut lim: libc::rlimit = std::mem::zeroed();
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
                lim.rlim_cur = lim.rlim_max;
                libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
            }
        }
    });
}

/// Tests only: `HEAPTRACE_NO_MAP_FILES` has mapped files opened by path under the process's
/// root, as when map_files is refused, so that the checks on that way can be seen at work.
fn map_files_refused() -> bool {
    std::env::var_os("HEAPTRACE_NO_MAP_FILES").is_some()
}

/// open(O_NONBLOCK): a FIFO without a writer, a tty, a device, return at once instead of
/// waiting; `check` then refuses them.
fn open_nonblocking(path: &Path) -> io::Result<fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    raise_fd_limit();
    fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
}

/// `path` resolved inside the root of the process whose /proc directory is `dir`: `..` and
/// absolute symlinks stay in it, and no magic link (/proc/self/...) is followed.
fn in_root(dir: &str, path: &Path) -> io::Result<fs::File> {
    let root = fs::File::open(format!("{dir}/root"))?;
    let rel = path.strip_prefix("/").unwrap_or(path);
    let cpath = std::ffi::CString::new(rel.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: open_how is plain data; zero is "unset" for every field.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC) as u64;
    how.resolve = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;
    // SAFETY: a NUL-terminated path and an open_how that live across the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            root.as_raw_fd(),
            cpath.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    Ok(unsafe { fs::File::from_raw_fd(fd as i32) })
}

fn not_regular(mode: libc::mode_t) -> Option<Kind> {
    match mode & libc::S_IFMT {
        libc::S_IFREG => None,
        libc::S_IFIFO => Some(Kind::Fifo),
        libc::S_IFCHR => Some(Kind::CharDevice),
        libc::S_IFBLK => Some(Kind::BlockDevice),
        libc::S_IFDIR => Some(Kind::Directory),
        libc::S_IFSOCK => Some(Kind::Socket),
        _ => Some(Kind::Symlink),
    }
}

/// Suspect files skipped so far, each counted once.
static SKIPPED: AtomicU64 = AtomicU64::new(0);
/// The ones said and counted already, by path and the identity they were expected to have:
/// a process looked at again (each retry of a new one, each round) does not add to them.
static SAID: Mutex<Option<HashSet<Said>>> = Mutex::new(None);
type Said = (PathBuf, Option<FileId>);

/// How many suspect files of traced processes were skipped so far.
pub fn skipped() -> u64 {
    SKIPPED.load(Ordering::Relaxed)
}

/// A file of process `pid` not opened: a suspect one (see [`FileError::suspect`]) is said in
/// one line and counted, once; the others only in the debug log.
pub fn skip(pid: u32, path: &Path, expected: Option<FileId>, e: &FileError) {
    if !e.suspect() {
        log::debug!("pid {pid}: {} not opened: {e}", path.display());
        return;
    }
    let mut said = SAID.lock().unwrap_or_else(|p| p.into_inner());
    if !said
        .get_or_insert_with(HashSet::new)
        .insert((path.to_path_buf(), expected))
    {
        return;
    }
    SKIPPED.fetch_add(1, Ordering::Relaxed);
    crate::say!(
        "heaptrace: warning: skipped {} of pid {pid}: {e}",
        path.display()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("heaptrace-tf-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn mkfifo(path: &Path) {
        let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    }

    #[test]
    fn a_fifo_a_device_and_a_directory_are_refused_without_blocking() {
        let dir = temp("kinds");
        let fifo = dir.join("fifo");
        mkfifo(&fifo);
        let kind = |r: Result<TargetFile, FileError>| match r {
            Err(FileError::NotRegular(k)) => Some(k),
            _ => None,
        };
        assert_eq!(kind(TargetFile::host(&fifo)), Some(Kind::Fifo));
        assert_eq!(
            kind(TargetFile::host(Path::new("/dev/null"))),
            Some(Kind::CharDevice)
        );
        assert_eq!(kind(TargetFile::host(&dir)), Some(Kind::Directory));
        let me = format!("/proc/{}", std::process::id());
        assert_eq!(kind(TargetFile::in_root(&me, &fifo)), Some(Kind::Fifo));
        assert!(TargetFile::host(&fifo).unwrap_err().suspect());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn paths_resolve_inside_the_process_root_and_follow_no_magic_link() {
        let dir = temp("root");
        let me = format!("/proc/{}", std::process::id());
        // A magic link: refused, where a plain open would follow it.
        let magic = dir.join("magic");
        std::os::unix::fs::symlink("/proc/self/exe", &magic).unwrap();
        let err = TargetFile::in_root(&me, &magic).unwrap_err();
        assert!(err.suspect(), "{err}");
        // An absolute symlink resolves in the process's root (ours is /): the file it names.
        let libc = crate::targets::allocator::host_libc_path().unwrap();
        let link = dir.join("libc");
        std::os::unix::fs::symlink(&libc, &link).unwrap();
        let f = TargetFile::in_root(&me, &link).unwrap();
        assert_eq!(f.id(), TargetFile::host(&libc).unwrap().id());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_mapped_file_is_the_one_mapped_and_reads_through_its_descriptor() {
        let me = format!("/proc/{}", std::process::id());
        let maps = fs::read_to_string(format!("{me}/maps")).unwrap();
        let entries = crate::targets::maps::parse(&maps);
        let libc = crate::targets::allocator::host_libc_path().unwrap();
        let entry = entries.iter().find(|e| e.path == libc).unwrap();
        let f = TargetFile::mapped(&me, entry).unwrap();
        assert_eq!(f.id(), entry.id);
        let bytes = fs::read(&libc).unwrap();
        assert_eq!(f.read_at(0, 64).unwrap(), bytes[..64]);
        let end = f.read_at(f.size() - 10, 64).unwrap();
        assert_eq!(end, bytes[bytes.len() - 10..], "short at the end");
        // The attach path is the same inode.
        let via = TargetFile::host(&f.attach_path()).unwrap();
        assert_eq!(via.id(), f.id());
        // Another identity than the one mapped: refused.
        let mut other = entry.clone();
        other.id.ino += 1;
        assert!(matches!(
            TargetFile::mapped(&me, &other),
            Err(FileError::Changed { .. })
        ));
    }

    #[test]
    fn a_threads_directory_opens_by_path_in_the_root() {
        let me = std::process::id();
        let dir = format!("/proc/{me}/task/{me}");
        let maps = fs::read_to_string(format!("/proc/{me}/maps")).unwrap();
        let libc = crate::targets::allocator::host_libc_path().unwrap();
        let entries = crate::targets::maps::parse(&maps);
        let entry = entries.iter().find(|e| e.path == libc).unwrap();
        assert_eq!(TargetFile::mapped(&dir, entry).unwrap().id(), entry.id);
    }

    #[test]
    fn a_skip_is_said_and_counted_once() {
        let before = skipped();
        let e = FileError::NotRegular(Kind::Fifo);
        let path = Path::new("/nonexistent/heaptrace-skip-test");
        skip(1, path, None, &e);
        skip(1, path, None, &e);
        let gone = FileError::Open(io::Error::from_raw_os_error(libc::ENOENT));
        skip(1, Path::new("/nonexistent/gone"), None, &gone);
        assert_eq!(skipped() - before, 1);
    }
}
