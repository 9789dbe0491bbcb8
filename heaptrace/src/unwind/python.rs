//! The kernel walk's Python part: for each traced process running CPython 3.11 to 3.13, where
//! its threads and frames are (`PY_PROCS`, `heaptrace_common::python::PyProc`), written at
//! the first read of its mappings that shows the interpreter; and the naming of the frames
//! the walk appends, from the code objects read back (cached, and checked against what the
//! walk saw, so a code object freed and its address reused never names the wrong function).
use std::{collections::HashMap, os::unix::fs::MetadataExt as _, sync::Arc};

use aya::maps::{Array as BpfArray, HashMap as BpfHashMap, MapData};
use heaptrace_common::{
    maps,
    python::{self as py, PyProc},
};

use crate::{
    error::{Error, Result},
    heap::memory::Live,
    symbolize::{
        Frame, FrameInfo,
        python::{
            objects::{Code, CodeLayout, StringLayout},
            offsets::{FramePath, Offsets},
            runtime::{self, NotRead, Runtime},
        },
    },
};

/// Code objects kept named, all processes together; past it the cache starts over.
const CODES_MAX: usize = 65_536;
/// Processes whose python files were looked through without an interpreter found, kept so.
const LOOKED_MAX: usize = 65_536;
/// The bytes of a frame its fields must lie in (the walk reads them from its windows of the
/// data stack), and of a code object the walk reads in one go (`heaptrace-ebpf/src/python.rs`,
/// `CODE_WORDS`).
const FRAME_BYTES: u64 = 128;
const CODE_BYTES: u64 = 256;

/// The initial pid namespace's inode number (`PROC_PID_INIT_INO`): a thread's id there is
/// the one the kernel's helpers give.
const INIT_PID_NS: u64 = 0xEFFF_FFFC;

/// A Python frame whose code object was freed, replaced, or its process ended, before it
/// was read.
pub const CODE_GONE: &str = "[python code gone before read]";

/// The module Python frames show: they are not in any file's code.
pub const PYTHON_MODULE: &str = "[python]";

struct Interp {
    runtime: Runtime,
    offsets: Offsets,
    /// The code type's own layout, read once it can be (after relocation); None until then.
    layout: Option<CodeLayout>,
    /// In the walk's map.
    walked: bool,
}

/// Where the walk finds each process's interpreter: the kernel's `PY_PROCS`, or an
/// in-process region's header (`drain::in_process::PyStore`).
pub trait Walks: Send {
    /// Tells the walk where `pid`'s interpreter is; false if it could not be told.
    fn insert(&mut self, pid: u32, p: PyProc) -> bool;
    fn remove(&mut self, pid: u32);
}

/// The kernel walk's map, and its switch: on at the first interpreter found.
struct KernelWalks {
    map: BpfHashMap<MapData, u32, PyProc>,
    on: BpfArray<MapData, u32>,
}

impl Walks for KernelWalks {
    fn insert(&mut self, pid: u32, p: PyProc) -> bool {
        let ok = self.map.insert(pid, p, 0).is_ok();
        if ok {
            let _ = self.on.set(0, 1, 0);
        }
        ok
    }

    fn remove(&mut self, pid: u32) {
        let _ = self.map.remove(&pid);
    }
}

pub struct Interpreters {
    walks: Box<dyn Walks>,
    procs: HashMap<u32, Interp>,
    /// The python files each process mapped when its interpreter was last looked for: looked
    /// for again only when they change.
    looked: HashMap<u32, Vec<String>>,
    codes: HashMap<(u32, u64, u64), Option<Arc<Code>>>,
}

/// The mappings of python files (`python*`, `libpython*`), whole lines, sorted.
fn python_files(maps: &str) -> Vec<String> {
    let mut v: Vec<String> = maps
        .lines()
        .filter(|l| {
            l.split_whitespace().nth(5).is_some_and(|p| {
                p.rsplit('/')
                    .next()
                    .is_some_and(|n| n.starts_with("python") || n.starts_with("libpython"))
            })
        })
        .map(str::to_string)
        .collect();
    v.sort();
    v.dedup();
    v
}

/// Their paths alone, sorted.
fn names(files: &[String]) -> Vec<String> {
    let mut v: Vec<String> = files
        .iter()
        .filter_map(|l| l.split_whitespace().nth(5).map(str::to_string))
        .collect();
    v.sort();
    v.dedup();
    v
}

impl Interpreters {
    pub fn take(ebpf: &mut aya::Ebpf) -> Result<Interpreters> {
        let err = |reason: String| Error::Map {
            map: maps::PY_PROCS,
            reason,
        };
        let map = ebpf
            .take_map(maps::PY_PROCS)
            .ok_or_else(|| err("missing from the object".into()))?;
        let on = ebpf
            .take_map(maps::PY_ON)
            .ok_or_else(|| err("PY_ON missing from the object".into()))?;
        Ok(Interpreters::with(Box::new(KernelWalks {
            map: BpfHashMap::try_from(map).map_err(|e| err(e.to_string()))?,
            on: BpfArray::try_from(on).map_err(|e| err(e.to_string()))?,
        })))
    }

    /// Interpreters told to another walk than the kernel's (the in-process library's).
    pub fn with(walks: Box<dyn Walks>) -> Interpreters {
        Interpreters {
            walks,
            procs: HashMap::new(),
            looked: HashMap::new(),
            codes: HashMap::new(),
        }
    }

    /// After a read of `pid`'s mappings: finds its interpreter where a python file is mapped
    /// that was not when it was last looked for, and tells the walk where it is. Only what
    /// needs no relocation is read here (`Py_Version` and the symbols' addresses), so that
    /// the walk has it before the program's first allocation.
    pub fn sync(&mut self, pid: u32, maps: &str) {
        // While glibc's loader maps libpython, its first mapping spans the whole file from
        // offset 0, and its symbols' addresses read from there are wrong (a run with no
        // Python frame at all, now and then): looked for once libc, mapped after it, is.
        if !crate::unwind::loaded::loader_done(maps) {
            return;
        }
        let files = python_files(maps);
        let paths = names(&files);
        if files.is_empty() {
            // An exec into a program that is not Python (a Python's subprocess): the walk must
            // not read the old image's interpreter in it (the kernel also drops it at exec).
            self.forget(pid);
            return;
        }
        if self
            .looked
            .get(&pid)
            .is_some_and(|l| *l == files || *l == paths)
        {
            return;
        }
        let mem = Live::new(pid);
        let (runtime, offsets) = match runtime::find(pid, &mem).and_then(|rt| {
            let off = Offsets::for_version(rt.version).ok_or(NotRead::Unsupported(rt.version))?;
            Ok((rt, off))
        }) {
            Ok(f) => f,
            Err(e) => {
                if matches!(e, NotRead::Unsupported(_)) {
                    // Once per file set: `looked` keeps it from being looked for again.
                    crate::say!("heaptrace: pid {pid}: {e}: its stacks show the interpreter only");
                }
                log::debug!("pid {pid}: no Python frames: {e}");
                if e != NotRead::Unreadable && self.looked.len() < LOOKED_MAX {
                    // Not looked for again until its python files change: where none is
                    // found, until their mappings do (the loader maps a library a segment at
                    // a time, and a look between two found no symbols where they were to be).
                    let key = if e == NotRead::NoInterpreter {
                        files
                    } else {
                        paths
                    };
                    self.looked.insert(pid, key);
                }
                return;
            }
        };
        let entry = to_kernel(pid, &runtime, &offsets);
        let walked = entry.is_some_and(|e| self.walks.insert(pid, e));
        log::debug!("pid {pid}: CPython {:?}, walked: {walked}", runtime.version);
        self.looked.insert(pid, paths);
        self.procs.insert(
            pid,
            Interp {
                runtime,
                offsets,
                layout: None,
                walked,
            },
        );
    }

    /// Whether `pid`'s walk appends Python frames.
    pub fn walks(&self, pid: u32) -> bool {
        self.procs.get(&pid).is_some_and(|p| p.walked)
    }

    pub fn forget(&mut self, pid: u32) {
        self.looked.remove(&pid);
        if self.procs.remove(&pid).is_some() {
            self.walks.remove(pid);
            self.codes.retain(|k, _| k.0 != pid);
        }
    }

    /// The frames of the Python words a walk appended (`heaptrace_common::python`), innermost
    /// first, each with whether it begins a C-level evaluation.
    pub fn frames(&mut self, pid: u32, words: &[u64]) -> Vec<(Frame, bool)> {
        let Some(interp) = self.procs.get_mut(&pid).filter(|p| p.walked) else {
            return Vec::new();
        };
        let mem = Live::new(pid);
        if interp.layout.is_none() {
            let rt = &interp.runtime;
            interp.layout = CodeLayout::read(&mem, rt.code_type, rt.version);
            if interp.layout.is_some_and(|l| !interp.offsets.agrees(&l)) {
                // This build's code objects are not the table's: its frames are not named.
                log::warn!(
                    "pid {pid}: CPython's code objects differ from {:?}'s",
                    rt.version
                );
                interp.walked = false;
                self.walks.remove(pid);
                return Vec::new();
            }
        }
        let Some(layout) = interp.layout else {
            return Vec::new();
        };
        let mem = Live::new(pid);
        let mut out = Vec::new();
        for pair in words.chunks_exact(2) {
            let Some((code, unit, entry, identity)) = py::read_frame(pair[0], pair[1]) else {
                break;
            };
            if self.codes.len() >= CODES_MAX {
                self.codes.clear();
            }
            let key = (pid, code, identity);
            let read = self.codes.entry(key).or_insert_with(|| {
                Code::read(&mem, &layout, code)
                    .filter(|c| {
                        let first = u32::try_from(c.first_line).unwrap_or(0);
                        py::identity_word(first, c.qualname_at, c.name_words) & !(1 << 63)
                            == identity
                    })
                    .map(Arc::new)
            });
            out.push((frame(read.as_deref(), unit), entry));
        }
        out
    }
}

fn frame(code: Option<&Code>, unit: u32) -> Frame {
    let info = match code {
        Some(c) => FrameInfo {
            function: c.qualname.as_str().into(),
            file: Some(c.filename.as_str().into()),
            line: c.line(unit).and_then(|l| u32::try_from(l).ok()),
            module: PYTHON_MODULE.into(),
            offset: u64::from(unit),
            inlined: false,
        },
        // Freed (or replaced, or its process ended) before it was read: no name rather than
        // another's.
        None => FrameInfo {
            function: CODE_GONE.into(),
            file: None,
            line: None,
            module: PYTHON_MODULE.into(),
            offset: 0,
            inlined: false,
        },
    };
    info.into()
}

/// The walk's entry for `pid`, if every offset it reads fits its reads.
fn to_kernel(pid: u32, rt: &Runtime, off: &Offsets) -> Option<PyProc> {
    let ns = std::fs::metadata(format!("/proc/{pid}/ns/pid")).ok()?;
    // In the initial namespace the walk asks no helper for the thread's id there (~0.1 us an
    // allocation): it is the global one.
    let (ns_dev, ns_ino) = match ns.ino() {
        INIT_PID_NS => (0, 0),
        ino => (ns.dev(), ino),
    };
    let (frame_path, cframe, current_frame) = match off.frame {
        FramePath::ThroughCFrame {
            cframe,
            current_frame,
        } => (py::PATH_CFRAME, cframe, current_frame),
        FramePath::Direct { current_frame } => (py::PATH_DIRECT, 0, current_frame),
    };
    let frame_fields = [off.code, off.previous, off.instruction, off.owner];
    let code_fields = [off.first_line, off.qualname];
    let fits = |f: &[u64], within: u64| f.iter().all(|o| o + 8 <= within);
    if !fits(&frame_fields, FRAME_BYTES)
        || !fits(&code_fields, CODE_BYTES)
        || off.is_entry.is_some_and(|e| e >= FRAME_BYTES)
    {
        return None;
    }
    let small = |v: u64| u32::try_from(v).ok();
    Some(PyProc {
        runtime: rt.runtime,
        ns_dev,
        ns_ino,
        interpreters_head: small(off.interpreters_head)?,
        threads_head: small(off.threads_head)?,
        interpreter_next: small(off.interpreter_next)?,
        thread_next: small(off.thread_next)?,
        native_thread_id: small(off.native_thread_id)?,
        frame_path,
        cframe: small(cframe)?,
        current_frame: small(current_frame)?,
        code: small(off.code)?,
        previous: small(off.previous)?,
        instruction: small(off.instruction)?,
        owner: small(off.owner)?,
        is_entry: off.is_entry.map_or(Some(u32::MAX), small)?,
        code_start: small(off.code_start)?,
        first_line: small(off.first_line)?,
        qualname: small(off.qualname)?,
        tss_key: small(off.tss_key)?,
        str_data: small(StringLayout::for_version(rt.version).ascii_data)?,
        _pad: 0,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// Records what the walk was told.
    struct Told(Arc<Mutex<Vec<u32>>>);

    impl Walks for Told {
        fn insert(&mut self, _pid: u32, _p: PyProc) -> bool {
            true
        }
        fn remove(&mut self, pid: u32) {
            self.0.lock().unwrap().push(pid);
        }
    }

    #[test]
    fn an_exec_into_a_program_without_python_files_leaves_the_walk() {
        let removed = Arc::new(Mutex::new(Vec::new()));
        let mut py = Interpreters::with(Box::new(Told(removed.clone())));
        let interp = |version| Interp {
            runtime: Runtime {
                version,
                code_type: 0x1000,
                runtime: 0x2000,
            },
            offsets: Offsets::for_version(version).unwrap(),
            layout: None,
            walked: true,
        };
        py.procs.insert(7, interp((3, 11)));
        py.procs.insert(8, interp((3, 11)));
        let python = "00400000-00500000 r-xp 00000000 08:01 42 /usr/bin/python3.11\n";
        py.looked.insert(7, names(&python_files(python)));
        // The same python files: nothing changes.
        py.sync(7, python);
        assert!(py.walks(7));
        // Its child exec'd a C program (a Python's subprocess.run).
        py.sync(7, "00400000-00401000 r-xp 00000000 08:01 43 /usr/bin/cc1\n");
        assert!(!py.walks(7));
        assert!(py.walks(8));
        assert_eq!(*removed.lock().unwrap(), vec![7]);
    }

    /// A read while glibc's loader is still mapping the libraries (libpython's first mapping
    /// spans its whole file from offset 0) is not looked at, nor remembered as looked at.
    #[test]
    fn no_interpreter_is_looked_for_before_the_loader_has_mapped_libc() {
        let mut py = Interpreters::with(Box::new(Told(Arc::new(Mutex::new(Vec::new())))));
        let maps = "7f0000000000-7f0000400000 r--p 00000000 08:01 42 /opt/lib/libpython3.13.so.1.0\n\
                    7f0000500000-7f0000501000 r-xp 00001000 08:01 12 /usr/lib/ld-linux-x86-64.so.2\n";
        py.sync(std::process::id(), maps);
        assert!(py.looked.is_empty() && py.procs.is_empty());
    }
}
