//! The files heaptrace writes (`-o`, `--json`, `--command-output`), made safe for a tracer
//! that runs as root: a path in a directory others can write to must not make it write
//! somewhere else, nor show what it wrote (command lines, arguments) to others.
//!
//! - Nothing is written through a symbolic link: a file is created under a temporary name
//!   beside the final one, `O_EXCL|O_NOFOLLOW`, mode 0600, and renamed over the final name
//!   when complete (a link there is replaced, never followed). A stream (`--command-output`)
//!   is opened `O_NOFOLLOW` at its final name, mode 0600.
//! - An existing file (or link) at the path is replaced only with `--force`.
//! - A character device (`/dev/null`, a terminal) is written to as it is, never replaced.
//! - Every path is checked before anything is launched or attached (`check`).
use std::{
    ffi::OsString,
    fs::{File, OpenOptions},
    io,
    os::unix::{
        ffi::OsStrExt as _,
        fs::{FileTypeExt as _, OpenOptionsExt as _},
    },
    path::{Path, PathBuf},
};

use crate::error::{Error, Result};

/// Said when a file is in the way and `--force` was not given.
const EXISTS: &str = "exists; --force replaces it";

/// What is at an output path now.
enum Existing {
    Nothing,
    /// Written to in place: nothing is overwritten, and only root makes device nodes.
    CharDevice,
    /// A regular file or a symbolic link: replaced with `--force`.
    Replaceable {
        link: bool,
    },
}

/// The directory a file at `path` goes in.
fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Looks at `path` without following a link; the reason it cannot be written otherwise.
fn existing(path: &Path) -> std::result::Result<Existing, String> {
    if path.as_os_str().as_bytes().ends_with(b"/") {
        return Err("is a directory".into());
    }
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Existing::Nothing),
        Err(e) => return Err(e.to_string()),
    };
    let t = meta.file_type();
    if t.is_dir() {
        Err("is a directory".into())
    } else if t.is_char_device() {
        Ok(Existing::CharDevice)
    } else if t.is_file() || t.is_symlink() {
        Ok(Existing::Replaceable {
            link: t.is_symlink(),
        })
    } else {
        Err("is not a regular file".into())
    }
}

/// Checks, before anything is launched or attached, that `path` (given with `flag`) can be
/// written: its directory exists and is writable, and nothing is in the way but what
/// `--force` may replace.
pub fn check(flag: &'static str, path: &Path, force: bool) -> Result<()> {
    let fail = |reason: String| Error::Output {
        flag,
        path: path.to_path_buf(),
        reason,
    };
    let dir = parent(path);
    is_dir(dir).map_err(fail)?;
    let there = existing(path).map_err(fail)?;
    // Files there are the system's (/dev/stdout is a link): root must never replace one.
    let system = is_system(dir);
    if system && !matches!(there, Existing::CharDevice) {
        return Err(fail(
            "is in /dev, /proc or /sys, where only a character device is written to (- for \
             stdout)"
                .into(),
        ));
    }
    match there {
        Existing::Nothing => {}
        Existing::CharDevice => return Ok(()),
        Existing::Replaceable { .. } if force => {}
        Existing::Replaceable { link: false } => return Err(fail(EXISTS.into())),
        Existing::Replaceable { link: true } => {
            return Err(fail(
                "exists, a symbolic link (never written through); --force replaces the link".into(),
            ));
        }
    }
    writable(dir).map_err(fail)
}

/// Checks, before anything is launched or attached, that files can be made in directory
/// `dir` (given with `flag`, e.g. `--oom-dir`), each with [`NewFile`] as it is written.
pub fn check_dir(flag: &'static str, dir: &Path) -> Result<()> {
    let fail = |reason: String| Error::Output {
        flag,
        path: dir.to_path_buf(),
        reason,
    };
    is_dir(dir).map_err(fail)?;
    if is_system(dir) {
        return Err(fail("is in /dev, /proc or /sys".into()));
    }
    writable(dir).map_err(fail)
}

fn is_system(dir: &Path) -> bool {
    ["/dev", "/proc", "/sys"].iter().any(|d| dir.starts_with(d))
}

fn is_dir(dir: &Path) -> std::result::Result<(), String> {
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(format!("{} is not a directory", dir.display())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            Err(format!("no such directory {}", dir.display()))
        }
        Err(e) => Err(format!("{}: {e}", dir.display())),
    }
}

fn writable(dir: &Path) -> std::result::Result<(), String> {
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| "contains a NUL byte".to_string())?;
    // SAFETY: access(2) reads a NUL-terminated path we own.
    if unsafe { libc::access(c.as_ptr(), libc::W_OK) } != 0 {
        let e = io::Error::last_os_error();
        return Err(format!("cannot write in {}: {e}", dir.display()));
    }
    Ok(())
}

fn exists_error() -> io::Error {
    io::Error::new(io::ErrorKind::AlreadyExists, EXISTS)
}

/// Creating, writing: never through a link, never readable by others.
fn options() -> OpenOptions {
    let mut o = OpenOptions::new();
    // std adds O_CLOEXEC: a launched command inherits none of these.
    o.write(true).mode(0o600).custom_flags(libc::O_NOFOLLOW);
    o
}

/// Opens the character device at `path` for writing, making sure it still is one.
fn open_device(path: &Path) -> io::Result<File> {
    let f = options().open(path)?;
    if !f.metadata()?.file_type().is_char_device() {
        return Err(io::Error::other("changed while being opened"));
    }
    Ok(f)
}

/// A temporary name, removed when dropped unless taken.
struct TempName(Option<PathBuf>);

impl Drop for TempName {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A file written under a temporary name in its final directory, which `persist` moves to
/// the final name: the final name never shows a half-written file, and a link there is
/// replaced, not followed. Dropped without `persist`, the temporary file is removed.
pub struct NewFile {
    file: File,
    tmp: TempName,
    path: PathBuf,
    force: bool,
}

impl NewFile {
    pub fn create(path: &Path, force: bool) -> io::Result<NewFile> {
        let new = |file, tmp| NewFile {
            file,
            tmp: TempName(tmp),
            path: path.to_path_buf(),
            force,
        };
        match existing(path).map_err(io::Error::other)? {
            Existing::CharDevice => return Ok(new(open_device(path)?, None)),
            Existing::Replaceable { .. } if !force => return Err(exists_error()),
            _ => {}
        }
        let name = path
            .file_name()
            .ok_or_else(|| io::Error::other("names no file"))?;
        let dir = parent(path);
        let mut n = 0;
        loop {
            let mut tmp = OsString::from(".");
            tmp.push(name);
            tmp.push(format!(".{}-{n}.tmp", std::process::id()));
            let tmp = dir.join(tmp);
            match options().create_new(true).open(&tmp) {
                Ok(file) => return Ok(new(file, Some(tmp))),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && n < 100 => n += 1,
                Err(e) => return Err(e),
            }
        }
    }

    /// The final name.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file to write to.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Moves the file to its final name (without `--force`, only if nothing has appeared
    /// there meanwhile); the file stays open for more writes.
    pub fn persist(self) -> io::Result<File> {
        let NewFile {
            file,
            mut tmp,
            path,
            force,
        } = self;
        if let Some(t) = &tmp.0 {
            if force {
                std::fs::rename(t, &path)?;
            } else {
                rename_noreplace(t, &path)?;
            }
            tmp.0 = None;
        }
        Ok(file)
    }
}

/// rename(2) that fails if `to` exists; a link and an unlink where the filesystem lacks
/// RENAME_NOREPLACE.
fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|_| io::Error::other("path contains a NUL byte"))
    };
    let (f, t) = (c(from)?, c(to)?);
    // SAFETY: renameat2 reads two NUL-terminated paths we own.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            f.as_ptr(),
            libc::AT_FDCWD,
            t.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if r == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EEXIST) => Err(exists_error()),
        Some(libc::EINVAL | libc::ENOSYS) => match std::fs::hard_link(from, to) {
            Ok(()) => std::fs::remove_file(from),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Err(exists_error()),
            Err(e) => Err(e),
        },
        _ => Err(e),
    }
}

/// A file written as it goes (`--command-output`), opened at its final name: created mode
/// 0600, or with `--force` a file or link there replaced by a new one; never through a link.
pub fn stream(path: &Path, force: bool) -> io::Result<File> {
    let create = || options().create_new(true).open(path);
    match create() {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            match existing(path).map_err(io::Error::other)? {
                Existing::CharDevice => open_device(path),
                Existing::Replaceable { .. } if force => {
                    std::fs::remove_file(path)?;
                    create()
                }
                Existing::Replaceable { .. } => Err(exists_error()),
                // Gone meanwhile: made again, still never through a link.
                Existing::Nothing => create(),
            }
        }
        r => r,
    }
}

#[cfg(test)]
mod tests {
    use std::{io::Write as _, os::unix::fs::PermissionsExt as _};

    use super::*;

    /// A fresh directory under the temporary one, removed at the end.
    struct Dir(PathBuf);

    impl Dir {
        fn new(tag: &str) -> Dir {
            let d =
                std::env::temp_dir().join(format!("heaptrace-output-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).unwrap();
            Dir(d)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777
    }

    fn entries(d: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    fn write_new(path: &Path, force: bool, text: &str) -> io::Result<()> {
        let f = NewFile::create(path, force)?;
        f.file().write_all(text.as_bytes())?;
        f.persist().map(drop)
    }

    /// A victim file at a link's end: untouched whatever is written at the link.
    fn victim(d: &Dir) -> PathBuf {
        let v = d.0.join("victim");
        std::fs::write(&v, "secret").unwrap();
        std::fs::set_permissions(&v, std::fs::Permissions::from_mode(0o600)).unwrap();
        v
    }

    #[test]
    fn a_new_file_is_0600_and_appears_only_when_persisted() {
        let d = Dir::new("new");
        let out = d.0.join("out.json");
        check("--json", &out, false).unwrap();
        let f = NewFile::create(&out, false).unwrap();
        f.file().write_all(b"{}").unwrap();
        assert!(!out.exists());
        f.persist().unwrap();
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "{}");
        assert_eq!(mode(&out), 0o600);
        assert_eq!(entries(&d.0), ["out.json"]);
    }

    #[test]
    fn an_unpersisted_file_leaves_nothing() {
        let d = Dir::new("dropped");
        let f = NewFile::create(&d.0.join("out.bin"), false).unwrap();
        f.file().write_all(b"half").unwrap();
        drop(f);
        assert!(entries(&d.0).is_empty());
    }

    #[test]
    fn an_existing_file_is_replaced_only_with_force() {
        let d = Dir::new("exists");
        let out = d.0.join("out.json");
        std::fs::write(&out, "old").unwrap();
        let e = check("--json", &out, false).unwrap_err().to_string();
        assert!(e.contains("exists") && e.contains("--force"), "{e}");
        assert_eq!(
            write_new(&out, false, "new").unwrap_err().kind(),
            io::ErrorKind::AlreadyExists
        );
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "old");
        check("--json", &out, true).unwrap();
        write_new(&out, true, "new").unwrap();
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "new");
        assert_eq!(mode(&out), 0o600);
        assert_eq!(entries(&d.0), ["out.json"]);
    }

    #[test]
    fn a_file_appearing_meanwhile_is_not_replaced_without_force() {
        let d = Dir::new("race");
        let out = d.0.join("out.json");
        let f = NewFile::create(&out, false).unwrap();
        std::fs::write(&out, "theirs").unwrap();
        assert_eq!(
            f.persist().unwrap_err().kind(),
            io::ErrorKind::AlreadyExists
        );
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "theirs");
        assert_eq!(entries(&d.0), ["out.json"]);
    }

    #[test]
    fn a_link_is_replaced_never_followed() {
        let d = Dir::new("link");
        let v = victim(&d);
        let out = d.0.join("out.json");
        std::os::unix::fs::symlink(&v, &out).unwrap();
        let e = check("--json", &out, false).unwrap_err().to_string();
        assert!(e.contains("symbolic link") && e.contains("--force"), "{e}");
        assert!(write_new(&out, false, "new").is_err());
        write_new(&out, true, "new").unwrap();
        assert_eq!(std::fs::read_to_string(&v).unwrap(), "secret");
        assert!(std::fs::symlink_metadata(&out).unwrap().is_file());
        assert_eq!(mode(&out), 0o600);
    }

    #[test]
    fn a_stream_is_0600_and_never_follows_a_link() {
        let d = Dir::new("stream");
        let v = victim(&d);
        let out = d.0.join("cmd.out");
        std::os::unix::fs::symlink(&v, &out).unwrap();
        assert!(stream(&out, false).is_err());
        let mut f = stream(&out, true).unwrap();
        f.write_all(b"hello").unwrap();
        assert_eq!(std::fs::read_to_string(&v).unwrap(), "secret");
        assert!(std::fs::symlink_metadata(&out).unwrap().is_file());
        assert_eq!(mode(&out), 0o600);
        // An existing file: only with --force, and then a new one (0600 too).
        std::fs::write(&out, "old").unwrap();
        std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(
            stream(&out, false).unwrap_err().kind(),
            io::ErrorKind::AlreadyExists
        );
        stream(&out, true).unwrap().write_all(b"new").unwrap();
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "new");
        assert_eq!(mode(&out), 0o600);
    }

    #[test]
    fn devices_are_written_in_place() {
        let null = Path::new("/dev/null");
        check("--json", null, false).unwrap();
        write_new(null, false, "x").unwrap();
        stream(null, false).unwrap().write_all(b"x").unwrap();
        assert!(
            std::fs::symlink_metadata(null)
                .unwrap()
                .file_type()
                .is_char_device()
        );
    }

    #[test]
    fn bad_paths_are_named_in_one_line() {
        let d = Dir::new("bad");
        let e = check("--json", Path::new("/nonexistent/x.json"), false).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--json /nonexistent/x.json: no such directory /nonexistent"
        );
        assert_eq!(e.exit_code(), 2);
        let e = check("-o", &d.0, true).unwrap_err().to_string();
        assert!(e.ends_with(": is a directory"), "{e}");
        let file = d.0.join("f");
        std::fs::write(&file, "").unwrap();
        let e = check("-o", &file.join("x"), true).unwrap_err().to_string();
        assert!(e.ends_with("is not a directory"), "{e}");
        // A bare name is in the current directory.
        check(
            "-o",
            Path::new("heaptrace-output-test-does-not-exist.bin"),
            false,
        )
        .unwrap();
    }

    /// /dev/stdout is a link: even with --force it is never replaced, nor anything in /dev.
    #[test]
    fn nothing_in_dev_is_replaced() {
        for force in [false, true] {
            let e = check("--json", Path::new("/dev/stdout"), force).unwrap_err();
            assert!(e.to_string().contains("only a character device"), "{e}");
            assert!(check("--json", Path::new("/dev/heaptrace-new"), force).is_err());
        }
        assert!(check("--json", Path::new("/dev/null"), false).is_ok());
    }
}
