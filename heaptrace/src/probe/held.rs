//! A launched command's forks, each held by its tracer at its fork (`targets::launch::Forks`);
//! and the forks of a `-p` process, restored as they run (`daemon::exec_watch`).
//!
//! The links are bound to a process (uprobe_multi's pid): a fork inherits its parent's
//! breakpoints (fork copies the int3s in the parent's private copies of the text pages), but
//! no link counts them for it. So a fork followed gets links of its own, the same probes bound
//! to its pid, before its first instruction; a fork not followed gets the file's original bytes
//! back over each probe in its copy of the text (through /proc/PID/mem, which writes a private
//! copy of read-only text), and runs at its own speed. The kernel's later unregister checks
//! the opcode before it restores one (`verify_opcode`), so restoring first is safe. A vfork
//! runs in its parent's memory: its bytes are left as they are (it execs or exits soon).
//!
//! Every link made here is recorded (`Spec`), so that a fork gets the files attached before
//! it, and the forks followed get each file attached after.
use std::{
    collections::HashMap,
    io,
    os::unix::fs::FileExt as _,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

use crate::{
    bpf::{
        links::{self, Link},
        uprobe_multi::{MultiError, MultiPrograms},
    },
    targets::{launch::Forks, maps, target_file::TargetFile},
};

/// The breakpoint instruction a uprobe writes (x86's int3).
const INT3: u8 = 0xcc;

/// One link, as made for the command: remade for each fork followed.
pub struct Spec {
    pub prog: &'static str,
    pub file: Arc<TargetFile>,
    pub offsets: Vec<u64>,
    pub cookies: Vec<u64>,
    pub ret: bool,
}

/// A probed file's probe addresses: each one's file offset and the byte the file has there.
type FileBytes = (Arc<TargetFile>, Vec<(u64, u8)>);

#[derive(Default)]
struct Inner {
    specs: Vec<Spec>,
    bytes: Vec<FileBytes>,
    /// The links of each fork followed and not yet gone.
    links: HashMap<u32, Vec<Link>>,
}

/// What the forks of a launched command get: their own links (followed), or their text
/// restored (not followed).
pub struct HeldForks {
    multi: Option<Arc<MultiPrograms>>,
    follow: AtomicBool,
    inner: Mutex<Inner>,
    /// Forks followed from the kernel's report rather than held (`follow_late`).
    late: AtomicU64,
}

impl HeldForks {
    pub fn new(multi: Option<Arc<MultiPrograms>>) -> HeldForks {
        HeldForks {
            multi,
            follow: AtomicBool::new(false),
            inner: Mutex::default(),
            late: AtomicU64::new(0),
        }
    }

    /// Forks followed from now on (each with links of its own), or let go of, restored.
    pub fn set_follow(&self, follow: bool) {
        self.follow.store(follow, Ordering::Relaxed);
    }

    /// A link made for the command (or its original bytes, for a probe that is no link of
    /// uprobe_multi's): remade for every fork followed and running now, and those to come.
    pub fn record(&self, spec: Spec) {
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        let bytes: Vec<(u64, u8)> = spec
            .offsets
            .iter()
            .filter_map(|o| Some((*o, *spec.file.read_at(*o, 1).ok()?.first()?)))
            .collect();
        match inner
            .bytes
            .iter_mut()
            .find(|(f, _)| f.id() == spec.file.id())
        {
            Some((_, b)) => b.extend(bytes),
            None => inner.bytes.push((spec.file.clone(), bytes)),
        }
        if let Some(multi) = &self.multi {
            let pids: Vec<u32> = inner.links.keys().copied().collect();
            for pid in pids {
                match attach(multi, &spec, pid) {
                    Ok(l) => inner.links.entry(pid).or_default().push(l),
                    Err(e) => log::debug!("pid {pid}'s link on {}: {e}", spec.prog),
                }
            }
        }
        inner.specs.push(spec);
    }

    /// Every fork's links, to be closed with the command's.
    pub fn take_links(&self) -> Vec<Link> {
        match self.inner.lock() {
            Ok(mut inner) => inner.links.drain().flat_map(|(_, l)| l).collect(),
            Err(_) => Vec::new(),
        }
    }

    /// A process of the tree running already (`-p PID --follow-forks`): links of its own.
    /// Call before counting is on, and it is counted from its first call.
    pub fn follow_running(&self, pid: u32) -> Result<(), MultiError> {
        self.follow_pid(pid).map(|_| ())
    }

    /// A followed process's fork that no tracer held (its parent could not be seized or was
    /// let go of, or a thread other than the main one forked): links of its own now, its
    /// calls until then not counted. False if it had them already (held after all).
    pub fn follow_late(&self, pid: u32) -> bool {
        if !self.follow.load(Ordering::Relaxed) {
            return false;
        }
        match self.follow_pid(pid) {
            Ok(made) => {
                if made {
                    self.late.fetch_add(1, Ordering::Relaxed);
                }
                made
            }
            Err(e) => {
                log::debug!("fork {pid} not followed: {e}");
                false
            }
        }
    }

    /// Counting is on: the forks followed late before it missed nothing.
    pub fn counting_on(&self) {
        self.late.store(0, Ordering::Relaxed);
    }

    /// How many forks `follow_late` followed.
    pub fn late(&self) -> u64 {
        self.late.load(Ordering::Relaxed)
    }

    /// Links bound to `pid` for every spec; all or none. False: it had them already.
    fn follow_pid(&self, pid: u32) -> Result<bool, MultiError> {
        let multi = self.multi.as_ref().ok_or(MultiError::Link(io::Error::from(
            io::ErrorKind::Unsupported,
        )))?;
        let Ok(mut inner) = self.inner.lock() else {
            return Err(MultiError::Link(io::Error::other("poisoned")));
        };
        if inner.links.contains_key(&pid) {
            return Ok(false);
        }
        let mut made = Vec::with_capacity(inner.specs.len());
        for spec in &inner.specs {
            made.push(attach(multi, spec, pid)?);
        }
        inner.links.insert(pid, made);
        Ok(true)
    }

    /// Writes the file's bytes back over every probe in `pid`'s text where a breakpoint is;
    /// how many were.
    pub fn restore(&self, pid: u32) -> io::Result<usize> {
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
        let maps = maps::parse(&maps);
        let mem = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/{pid}/mem"))?;
        let Ok(inner) = self.inner.lock() else {
            return Ok(0);
        };
        let mut restored = 0;
        for (file, bytes) in &inner.bytes {
            for m in maps.iter().filter(|m| m.id == file.id()) {
                for (offset, byte) in bytes {
                    let Some(addr) = address(m, *offset) else {
                        continue;
                    };
                    let mut now = [0u8];
                    if mem.read_at(&mut now, addr).is_ok() && now[0] == INT3 && *byte != INT3 {
                        mem.write_at(&[*byte], addr)?;
                        restored += 1;
                    }
                }
            }
        }
        Ok(restored)
    }
}

/// Where file offset `offset` is in mapping `m`, if it maps it.
fn address(m: &maps::MapsEntry, offset: u64) -> Option<u64> {
    let len = m.end.checked_sub(m.start)?;
    (offset >= m.offset && offset - m.offset < len).then(|| m.start + (offset - m.offset))
}

fn attach(multi: &MultiPrograms, spec: &Spec, pid: u32) -> Result<Link, MultiError> {
    let path = spec.file.attach_path();
    multi
        .attach(
            spec.prog,
            &path,
            &spec.offsets,
            &spec.cookies,
            spec.ret,
            pid,
        )
        .map(Link::Multi)
}

impl Forks for HeldForks {
    fn forked(&self, pid: u32, vfork: bool) -> bool {
        if self.follow.load(Ordering::Relaxed) {
            match self.follow_pid(pid) {
                Ok(_) => return true,
                Err(e) => crate::say!("heaptrace: warning: fork {pid} not followed: {e}"),
            }
        }
        if !vfork {
            match self.restore(pid) {
                Ok(n) => log::debug!("fork {pid} let go of, {n} breakpoints taken out"),
                Err(e) => log::debug!("fork {pid}: its breakpoints stay: {e}"),
            }
        }
        false
    }

    fn gone(&self, pid: u32) {
        let links = match self.inner.lock() {
            Ok(mut inner) => inner.links.remove(&pid).unwrap_or_default(),
            Err(_) => return,
        };
        // Closing waits for grace periods: not on the tracer thread.
        if !links.is_empty() {
            let closed = std::thread::Builder::new()
                .name("heaptrace-detach".into())
                .spawn(move || links::detach_all(links));
            drop(closed); // a failed spawn dropped (closed) them here
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_offset_is_found_in_the_mapping_that_maps_it() {
        let m = maps::MapsEntry {
            start: 0x7000_0000,
            end: 0x7000_2000,
            offset: 0x1000,
            exec: true,
            id: crate::targets::target_file::FileId {
                major: 0,
                minor: 0,
                ino: 1,
            },
            path: "/lib/libc.so.6".into(),
            deleted: false,
        };
        assert_eq!(address(&m, 0x1000), Some(0x7000_0000));
        assert_eq!(address(&m, 0x2fff), Some(0x7000_1fff));
        assert_eq!(address(&m, 0x3000), None);
        assert_eq!(address(&m, 0xfff), None);
    }
}
