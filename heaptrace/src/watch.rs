//! Execs. System-wide: processes that start after heaptrace, whose allocator may be a file not
//! probed yet (a container's libc, a static executable, jemalloc). One process traced: its
//! execs (a wrapper script's `exec`, pyenv's shims), after which it is its new command, maybe
//! on another allocator.
use std::fs;

use aya::{
    maps::{MapData, RingBuf},
    programs::RawTracePoint,
};
use heaptrace_common::{PROC_EXEC, ProcEvent, maps};
use tokio::io::unix::AsyncFd;

use crate::{
    allocator::{self, Provider},
    error::{Error, Result},
    probe::{Probes, Scope},
};

pub struct ProcWatch {
    pub ring: AsyncFd<RingBuf<MapData>>,
    /// The kernel side's rare diagnostics (aya-log), printed through `log`.
    pub logs: Option<AsyncFd<aya_log::EbpfLogger<&'static dyn log::Log>>>,
    /// Allocator files attached, and files that are no allocators, by (device, inode).
    known: allocator::Known,
    at_entry: bool,
    /// Where a new allocator file's probes fire: every process, or the one traced.
    scope: Scope,
    /// Name and cgroup of processes seen starting, read while they surely lived: a process
    /// that ends within a round is still named and placed. Entries go when the process is
    /// forgotten.
    pub seen: std::collections::HashMap<u32, (String, String)>,
    cgroups: crate::cgroups::CgroupNames,
    /// Processes just started whose allocator is not mapped yet (the exec tracepoint fires
    /// before the dynamic loader maps libc): looked at again shortly, a while at most.
    pending: Vec<(u32, std::time::Instant)>,
}

/// How long a new process may take to map its allocator.
const PENDING_FOR: std::time::Duration = std::time::Duration::from_millis(500);
/// How often pending processes are looked at again.
pub const RETRY_EVERY: std::time::Duration = std::time::Duration::from_millis(10);

impl ProcWatch {
    /// Attaches the exec tracepoint; `first` is the file already probed. With one process in
    /// `scope`, the kernel reports that process's execs only (`LoadOptions::watch_tgid`).
    pub fn start(
        probes: &mut Probes,
        first: &Provider,
        at_entry: bool,
        scope: Scope,
    ) -> Result<ProcWatch> {
        let (prog, tp) = ("on_exec", "sched_process_exec");
        {
            let p: &mut RawTracePoint = crate::probe::program(&mut probes.ebpf, prog)?;
            p.load().map_err(|e| Error::Load(format!("{prog}: {e}")))?;
            p.attach(tp)
                .map_err(|e| Error::Load(format!("{prog} on {tp}: {e}")))?;
        }
        let map = probes
            .ebpf
            .take_map(maps::EVENTS)
            .ok_or_else(|| Error::Load("map EVENTS missing".into()))?;
        let ring = RingBuf::try_from(map).map_err(|e| Error::Map {
            map: maps::EVENTS,
            reason: e.to_string(),
        })?;
        let mut known = allocator::Known::default();
        if let Some(id) = allocator::file_id(&first.attach_path) {
            known.attached.insert(id);
        }
        // SAFETY: the ring buffer owns its map fd and keeps it open while it is registered.
        let ring = unsafe { AsyncFd::register(ring) }.map_err(|e| e.into_parts().1)?;
        // Without the log map (an object built without any log call) there is nothing to read.
        let logs = match aya_log::EbpfLogger::init(&mut probes.ebpf) {
            // SAFETY: the logger owns its ring buffer's fd while it is registered.
            Ok(l) => unsafe { AsyncFd::register(l) }.ok(),
            Err(e) => {
                log::debug!("no kernel-side log: {e}");
                None
            }
        };
        Ok(ProcWatch {
            ring,
            logs,
            known,
            at_entry,
            scope,
            seen: std::collections::HashMap::new(),
            cgroups: crate::cgroups::CgroupNames::default(),
            pending: Vec::new(),
        })
    }

    /// Looks at every process already running, as if each had just started.
    pub fn scan(&mut self, probes: &mut Probes) {
        let me = std::process::id();
        let Ok(dir) = fs::read_dir("/proc") else {
            return;
        };
        for entry in dir.flatten() {
            if let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
                && pid != me
            {
                let _ = self.started(probes, pid);
            }
        }
    }

    /// Reads the events waiting in the ring and looks at each process that started (attaching
    /// its allocator when `probes` is given). Returns the processes that exec'ed.
    pub fn drain(&mut self, mut probes: Option<&mut Probes>) -> Vec<u32> {
        let mut events = Vec::new();
        {
            let ring = self.ring.get_mut();
            while let Some(item) = ring.next() {
                if item.len() >= std::mem::size_of::<ProcEvent>() {
                    // SAFETY: the kernel wrote a ProcEvent (repr(C), no padding); read unaligned.
                    events.push(unsafe {
                        std::ptr::read_unaligned(item.as_ptr().cast::<ProcEvent>())
                    });
                }
            }
        }
        let execs: Vec<u32> = events
            .iter()
            .filter(|e| e.kind == PROC_EXEC)
            .map(|e| e.tgid)
            .collect();
        // Names first, for every process of the batch, from the event itself (taken in the
        // kernel at the exec): looking for a process's allocator can take long (a big new file
        // to read and attach), and a short-lived process may be gone before /proc is read.
        for e in events.iter().filter(|e| e.kind == PROC_EXEC) {
            let comm = comm_str(&e.comm)
                .or_else(|| crate::procfs::comm(e.tgid))
                .unwrap_or_default();
            let cgroup = self
                .cgroups
                .path(e.cgroup_id)
                .or_else(|| crate::procfs::cgroup(e.tgid))
                .unwrap_or_default();
            self.seen.insert(e.tgid, (comm, cgroup));
        }
        for e in events.iter().filter(|e| e.kind == PROC_EXEC) {
            if let Some(p) = probes.as_deref_mut() {
                self.look_at(p, e.tgid);
            }
        }
        execs
    }

    /// Prints what the kernel side logged.
    pub fn flush_logs(&mut self) {
        if let Some(l) = self.logs.as_mut() {
            l.get_mut().flush();
        }
    }

    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Looks at a process that just exec'ed (its allocator attached if not yet), or again
    /// shortly if no allocator is mapped in it yet.
    pub fn look_at(&mut self, probes: &mut Probes, pid: u32) {
        if !self.started(probes, pid) {
            self.pending.push((pid, std::time::Instant::now()));
        }
    }

    /// Looks again at the processes whose allocator was not mapped yet.
    pub fn retry(&mut self, probes: &mut Probes) {
        let pending = std::mem::take(&mut self.pending);
        for (pid, since) in pending {
            if !self.started(probes, pid) && since.elapsed() < PENDING_FOR {
                self.pending.push((pid, since));
            }
        }
    }

    /// A process started: attach its allocator file if no probe is on it yet. False when no
    /// allocator is mapped in it (yet).
    fn started(&mut self, probes: &mut Probes, pid: u32) -> bool {
        let provider = match allocator::for_pid_known(pid, &mut self.known) {
            Ok(Some(p)) => p,
            Ok(None) => return true, // an allocator file probed already
            Err(crate::error::Error::NoSuchProcess(_)) => return true, // gone already
            Err(_) => return false,  // nothing with malloc mapped, maybe not yet
        };
        let Some(id) = allocator::file_id(&provider.attach_path) else {
            return true;
        };
        if !self.known.attached.insert(id) {
            return true;
        }
        match probes.attach(&provider, self.scope, self.at_entry) {
            Ok(()) => eprintln!(
                "heaptrace: also tracing {} (first seen in pid {pid})",
                provider.path.display()
            ),
            Err(e) => eprintln!("heaptrace: warning: cannot trace pid {pid}'s allocator: {e}"),
        }
        true
    }
}

fn comm_str(comm: &[u8; 16]) -> Option<String> {
    let end = comm.iter().position(|b| *b == 0).unwrap_or(comm.len());
    (end > 0).then(|| String::from_utf8_lossy(&comm[..end]).into_owned())
}
