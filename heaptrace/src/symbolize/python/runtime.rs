//! Finding CPython in a process: the file (the `python3.X` binary or `libpython3.X.so`) that
//! exports `Py_Version`, `PyCode_Type` and `_PyRuntime`, where they are mapped, and which
//! version it is.
use std::fmt;

use crate::{
    heap::memory::Memory,
    targets::{
        elf,
        maps::{self, MapsEntry},
        target_file::TargetFile,
    },
};

/// The CPython versions whose frames are read (3.11 to 3.13); any other is named, not read.
pub const SUPPORTED: std::ops::RangeInclusive<(u8, u8)> = (3, 11)..=(3, 13);

/// A CPython interpreter found in a process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Runtime {
    /// (major, minor) from `Py_Version`.
    pub version: (u8, u8),
    /// Where `PyCode_Type` and `_PyRuntime` are, in the process.
    pub code_type: u64,
    pub runtime: u64,
}

/// Why a process's Python is not read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotRead {
    /// No file exports `Py_Version` and `PyCode_Type` (not CPython, or before 3.11).
    NoInterpreter,
    /// A CPython outside [`SUPPORTED`].
    Unsupported((u8, u8)),
    /// Its memory could not be read where its symbols say.
    Unreadable,
}

impl fmt::Display for NotRead {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotRead::NoInterpreter => write!(f, "no CPython 3.11+ found"),
            NotRead::Unsupported((a, b)) => {
                write!(f, "CPython {a}.{b} is not supported (3.11 to 3.13 are)")
            }
            NotRead::Unreadable => write!(f, "CPython's memory could not be read"),
        }
    }
}

/// The interpreter of process `pid`, read through `mem`.
pub fn find(pid: u32, mem: &dyn Memory) -> Result<Runtime, NotRead> {
    let text = crate::targets::procfs::maps(pid).map_err(|_| NotRead::Unreadable)?;
    let entries = maps::parse(&text);
    for (e, file) in python_files(pid, &entries) {
        let Ok(syms) = elf::data_symbols(&file, &["Py_Version", "PyCode_Type", "_PyRuntime"])
        else {
            continue;
        };
        let at = |name: &str| {
            let (_, off) = syms.iter().find(|(n, _)| n == name)?;
            address(&entries, e, *off)
        };
        let (Some(version), Some(code_type), Some(runtime)) =
            (at("Py_Version"), at("PyCode_Type"), at("_PyRuntime"))
        else {
            continue;
        };
        let hex = mem.u64_at(version).ok_or(NotRead::Unreadable)? as u32;
        let version = ((hex >> 24) as u8, (hex >> 16) as u8);
        if !SUPPORTED.contains(&version) {
            return Err(NotRead::Unsupported(version));
        }
        return Ok(Runtime {
            version,
            code_type,
            runtime,
        });
    }
    Err(NotRead::NoInterpreter)
}

/// Where process `pid`'s `Py_FinalizeEx` is: the python file that exports it (opened as
/// mapped), the function's file offset there, and its address in the process.
pub fn finalize_site(pid: u32) -> Option<(TargetFile, u64, u64)> {
    let text = crate::targets::procfs::maps(pid).ok()?;
    let entries = maps::parse(&text);
    python_files(pid, &entries).find_map(|(e, file)| {
        let off = elf::function_symbol(&file, "Py_FinalizeEx").ok()??;
        let at = address(&entries, e, off)?;
        Some((file, off, at))
    })
}

/// Each python file `pid` maps (`entries`), once, opened as mapped, as it is asked for.
fn python_files<'a>(
    pid: u32,
    entries: &'a [MapsEntry],
) -> impl Iterator<Item = (&'a MapsEntry, TargetFile)> + 'a {
    let dir = format!("/proc/{pid}");
    let mut tried = Vec::new();
    entries
        .iter()
        .filter(|e| is_python_file(e))
        .filter(move |e| {
            let new = !tried.contains(&e.id);
            tried.push(e.id);
            new
        })
        .filter_map(move |e| Some((e, TargetFile::mapped(&dir, e).ok()?)))
}

/// `python3.X`, `python3`, `libpython3.X.so...`: the files worth reading symbols of.
fn is_python_file(e: &MapsEntry) -> bool {
    e.path
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("python") || n.starts_with("libpython"))
}

/// Where file offset `off` of the file mapped at `e` is in the process: in whichever of that
/// file's mappings holds it.
fn address(entries: &[MapsEntry], e: &MapsEntry, off: u64) -> Option<u64> {
    entries
        .iter()
        .filter(|m| m.id == e.id)
        .find(|m| off >= m.offset && off - m.offset < m.end - m.start)
        .map(|m| m.start + (off - m.offset))
}
