//! Execs. System-wide: processes that start after heaptrace, whose allocator may be a file not
//! probed yet (a container's libc, a static executable, jemalloc). One process traced: its
//! execs (a wrapper script's `exec`, pyenv's shims), after which it is its new command, maybe
//! on another allocator.
use std::fs;

use std::{
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use aya::{
    maps::{MapData, RingBuf},
    programs::RawTracePoint,
};
use heaptrace_common::{PROC_EXEC, PROC_FORK, PROC_LEFT, PROC_OOM, ProcEvent, maps};
use tokio::{io::unix::AsyncFd, sync::mpsc};

use crate::{
    error::{Error, Result},
    probe::{Probes, Scope, held::HeldForks},
    symbolize::modules::{EarlyRead, OpenFiles},
    targets::allocator::{self, Provider},
};

mod reader;
use reader::{Reader, delay_for_tests};

/// Mappings of new processes as the reader read them right after their exec, by pid, until
/// the daemon takes them (`Modules::keep_early`); at most `EARLY_MAPS` of them.
pub type EarlyMaps = Arc<std::sync::Mutex<std::collections::HashMap<u32, EarlyRead>>>;
/// On a host with a v1 memory hierarchy, the cgroup paths of new processes as the reader read
/// them right after their exec (the kernel's event has the unified cgroup's id only), until
/// the daemon takes them; at most `EARLY_MAPS` of them.
type EarlyCgroups = Arc<std::sync::Mutex<std::collections::HashMap<u32, String>>>;
const EARLY_MAPS: usize = 4096;
/// Mappings read a second at most (about 0.1 ms each): a host that execs faster gets the rest
/// of its processes named by the daemon's reads only.
const READS_PER_SECOND: u32 = 400;
/// When a new process's mappings are read again after its exec: the dynamic loader maps its
/// libraries within a few milliseconds, and a program of 5 ms (`as`) allocates from them.
const READ_AGAIN: [Duration; 3] = [
    Duration::from_millis(2),
    Duration::from_millis(6),
    Duration::from_millis(20),
];

/// Events waiting in the channel from the reader: as many as the kernel's ring holds. When it
/// is full the reader waits, the ring fills, and the kernel counts the loss.
const QUEUED: usize = 1024;

pub struct ProcWatch {
    /// Execs as the reader thread forwards them, until the daemon takes the receiver.
    pub events: Option<mpsc::Receiver<ProcEvent>>,
    pub early: EarlyMaps,
    /// Readable once the reader has put mappings in `early`: the daemon takes them at once,
    /// so that a new process's unwind tables are in the kernel within milliseconds of its
    /// exec rather than at the next round (`lost.unwind_late` meanwhile).
    pub early_ready: Option<AsyncFd<Arc<OwnedFd>>>,
    early_cgroups: Option<EarlyCgroups>,
    stop: Arc<AtomicBool>,
    /// Written to end the reader's wait at once.
    wake: Arc<OwnedFd>,
    reader: Option<std::thread::JoinHandle<()>>,
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
    cgroups: crate::targets::cgroups::CgroupNames,
    /// The kernel's cgroup verdicts, under `--all --cgroup`.
    verdicts: Option<crate::probe::cgroup_filter::CgroupVerdicts>,
    /// `--all --comm` and `--all --cgroup`: the processes whose allocator files are looked at.
    wanted: Wanted,
    /// Processes just started whose allocator is not mapped yet (the exec tracepoint fires
    /// before the dynamic loader maps libc): looked at again shortly, a while at most.
    pending: Vec<(u32, std::time::Instant)>,
    /// Processes the followed ones forked, reported since the daemon last took them.
    pub forked: Vec<u32>,
    /// Victims of the OOM killer, reported since the daemon last took them.
    pub oom_killed: Vec<u32>,
    /// The running processes the start-up scan of `--all` took in (those the filters want):
    /// their unwind tables go in before counting starts.
    pub scanned: Vec<u32>,
    /// What the reader does with the forks reported (`leave_forks`, `follow_unheld`).
    forks: Arc<std::sync::OnceLock<ForkPolicy>>,
    /// The unwind tables, once shared with the reader (`share_tables`).
    tables: Arc<std::sync::OnceLock<crate::unwind::loaded::Shared>>,
}

/// What the reader thread does with a fork the kernel reports, beside reading its mappings.
pub(super) enum ForkPolicy {
    /// `-p PID` alone (PID, what restores): the breakpoints the fork inherited taken out.
    Leave(u32, Arc<HeldForks>),
    /// A followed tree: a fork no tracer of heaptrace's holds gets links of its own.
    FollowUnheld(Arc<HeldForks>),
}

/// How long a new process may take to map its allocator.
const PENDING_FOR: std::time::Duration = std::time::Duration::from_millis(500);
/// How often pending processes are looked at again.
pub const RETRY_EVERY: std::time::Duration = std::time::Duration::from_millis(10);

impl ProcWatch {
    /// Attaches the exec tracepoint; `first` is the file already probed. With one process in
    /// `scope`, the kernel reports that process's execs only (`LoadOptions::watch_tgid`).
    /// `comm`: the `--comm` filter; the reader reads only the matching processes' mappings.
    /// `cgroup`: the `--cgroup` filter, when the kernel judges by cgroup (`probe::cgroup_filter`).
    pub fn start(
        probes: &mut Probes,
        first: &Provider,
        at_entry: bool,
        scope: Scope,
        comm: Option<String>,
        cgroup: Option<String>,
    ) -> Result<ProcWatch> {
        let (prog, tp) = ("on_exec", "sched_process_exec");
        {
            let p: &mut RawTracePoint = crate::probe::program(&mut probes.ebpf, prog)?;
            p.load().map_err(|e| Error::Load(format!("{prog}: {e}")))?;
            p.attach(tp)
                .map_err(|e| Error::Load(format!("{prog} on {tp}: {e}")))?;
        }
        if let Err(e) = watch_oom(probes) {
            crate::say!("heaptrace: warning: OOM kills not reported: {e}");
        }
        let ring = probes.take_ring(maps::EVENTS)?;
        let mut known = allocator::Known::default();
        known.attached.insert(first.file.id());
        let (tx, events) = mpsc::channel(QUEUED);
        let stop = Arc::new(AtomicBool::new(false));
        // SAFETY: no pointers; the new fd is owned at once.
        let wake = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if wake < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        // SAFETY: a valid fd that nothing else owns.
        let wake = Arc::new(unsafe { OwnedFd::from_raw_fd(wake) });
        let early = EarlyMaps::default();
        // SAFETY: no pointers; the new fd is owned at once.
        let ready = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if ready < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        // SAFETY: a valid fd that nothing else owns.
        let ready = Arc::new(unsafe { OwnedFd::from_raw_fd(ready) });
        let early_cgroups =
            crate::targets::cgroups::v1_memory_mount().map(|_| EarlyCgroups::default());
        let forks = Arc::new(std::sync::OnceLock::new());
        let tables = Arc::new(std::sync::OnceLock::new());
        let reader = Reader {
            early_cgroups: early_cgroups.clone(),
            ring,
            tx,
            stop: stop.clone(),
            wake: wake.clone(),
            comm: comm.clone(),
            early: early.clone(),
            ready: ready.clone(),
            delay: delay_for_tests(),
            files: OpenFiles::default(),
            forks: forks.clone(),
            tables: tables.clone(),
            loads: None,
        };
        let reader = std::thread::Builder::new()
            .name("heaptrace-execs".into())
            .spawn(move || reader.run())?;
        // Without the log map (an object built without any log call) there is nothing to read.
        let logs = match aya_log::EbpfLogger::init(&mut probes.ebpf) {
            // SAFETY: the logger owns its ring buffer's fd while it is registered.
            Ok(l) => unsafe { AsyncFd::register(l) }.ok(),
            Err(e) => {
                log::debug!("no kernel-side log: {e}");
                None
            }
        };
        let wanted = match scope {
            Scope::All => Wanted {
                comm,
                cgroup: cgroup.clone(),
            },
            Scope::Process(_) | Scope::Tree(_) | Scope::Held(_) => Wanted::default(),
        };
        let mut cgroups = crate::targets::cgroups::CgroupNames::default();
        let verdicts = match cgroup {
            Some(pattern) if scope == Scope::All => {
                let mut v =
                    crate::probe::cgroup_filter::CgroupVerdicts::take(&mut probes.ebpf, pattern)?;
                v.judge_all(&mut cgroups);
                Some(v)
            }
            _ => None,
        };
        Ok(ProcWatch {
            events: Some(events),
            early,
            // SAFETY: the fd stays open while registered (the Arc holds it).
            early_ready: unsafe { AsyncFd::register(ready) }.ok(),
            early_cgroups,
            stop,
            wake,
            reader: Some(reader),
            logs,
            known,
            at_entry,
            scope,
            seen: std::collections::HashMap::new(),
            cgroups,
            verdicts,
            wanted,
            pending: Vec::new(),
            forked: Vec::new(),
            oom_killed: Vec::new(),
            scanned: Vec::new(),
            forks,
            tables,
        })
    }

    /// The unwind tables: the reader writes a new process's entry itself where every file it
    /// maps has its table already (`Tables::sync_known`), not waiting for the daemon.
    /// Those it read before (started while the trace was starting) have theirs written here.
    pub fn share_tables(&self, tables: crate::unwind::loaded::Shared) {
        if let Ok(early) = self.early.lock()
            && let Ok(mut t) = tables.lock()
        {
            for (pid, read) in early.iter() {
                let files = crate::symbolize::modules::table_files(read.files.iter());
                t.sync_with(*pid, &read.maps, &files);
            }
        }
        let _ = self.tables.set(tables);
    }

    /// `-p PID` alone, on uprobe_multi links (bound to the process, they neither count nor
    /// remove the breakpoints its forks inherit): each fork it makes from now on has them
    /// taken out as it starts, by the reader thread at the kernel's report (`PROC_LEFT`).
    /// Perf-event links remove them at a fork's first trap themselves.
    pub fn leave_forks(&self, probes: &mut Probes, pid: u32) -> Result<()> {
        crate::bpf::btf::id_offsets().map_err(|e| Error::Load(e.to_string()))?;
        let _ = self.forks.set(ForkPolicy::Leave(pid, probes.forks.clone()));
        crate::probe::follow::report_forks(probes)
    }

    /// A followed tree whose forks are held by a tracer of heaptrace's: each fork the kernel
    /// reports that none holds gets links of its own from the reader thread at once
    /// (`HeldForks::follow_late`), not none at all.
    pub fn follow_unheld(&self, probes: &Probes) {
        let _ = self
            .forks
            .set(ForkPolicy::FollowUnheld(probes.forks.clone()));
    }

    /// Once a round under `--all --cgroup`: the kernel's verdicts on the cgroups made or removed
    /// since the last walk (a process moved into a new cgroup without an exec reports none;
    /// `CgroupVerdicts::judge_new`).
    /// Returns how many cgroups the kernel's map has had no room for.
    pub fn judge_cgroups(&mut self) -> u64 {
        let Some(v) = self.verdicts.as_mut() else {
            return 0;
        };
        v.judge_new(&mut self.cgroups);
        v.unjudged
    }

    /// Looks at every process already running, as if each had just started.
    pub fn scan(&mut self, probes: &mut Probes) {
        let me = std::process::id();
        let Ok(dir) = fs::read_dir("/proc") else {
            return;
        };
        let pids: Vec<u32> = dir
            .flatten()
            .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
            .filter(|&pid| pid != me)
            .collect();
        // A host of thousands of processes, each file read once: can take seconds.
        let mut progress = crate::progress::Progress::new(
            pids.len() as u64,
            "looking at running processes",
            false,
        );
        for pid in pids {
            if self.wanted.judge_pid(pid) {
                let _ = self.started(probes, pid);
                self.scanned.push(pid);
            }
            progress.inc(1);
        }
    }

    /// Looks at each process that started among `events` (attaching its allocator when
    /// `probes` is given). Returns the processes that exec'ed.
    pub fn drain(&mut self, events: Vec<ProcEvent>, mut probes: Option<&mut Probes>) -> Vec<u32> {
        let (oom, events): (Vec<ProcEvent>, Vec<ProcEvent>) =
            events.into_iter().partition(|e| e.kind == PROC_OOM);
        self.oom_killed.extend(oom.iter().map(|e| e.tgid));
        let execs: Vec<u32> = events
            .iter()
            .filter(|e| e.kind == PROC_EXEC)
            .map(|e| e.tgid)
            .collect();
        // Names first, for every process of the batch, from the event itself (taken in the
        // kernel at the exec or fork): looking for a process's allocator can take long (a big
        // new file to read and attach), and a short-lived process may be gone before /proc is
        // read.
        for e in &events {
            let comm = comm_str(&e.comm)
                .or_else(|| crate::targets::procfs::comm(e.tgid))
                .unwrap_or_default();
            let known = self.cgroups.path(e.cgroup_id);
            // Before its first allocations, at best: until then the kernel traces it.
            if let (Some(v), Some(path)) = (self.verdicts.as_mut(), known.as_deref()) {
                v.judge(e.cgroup_id, path);
            }
            // The unified root: on a hybrid host its v1 memory cgroup may say more, as read
            // at its exec.
            let early = self
                .early_cgroups
                .as_ref()
                .and_then(|c| c.lock().ok()?.remove(&e.tgid));
            let cgroup = match known {
                Some(p) if p != "/" => Some(p),
                root => early
                    .or_else(|| crate::targets::procfs::cgroup(e.tgid))
                    .or(root),
            }
            .unwrap_or_default();
            self.seen.insert(e.tgid, (comm, cgroup));
            if e.kind == PROC_FORK {
                self.forked.push(e.tgid);
            }
        }
        for e in events.iter().filter(|e| e.kind == PROC_EXEC) {
            let wanted = self
                .seen
                .get(&e.tgid)
                .is_none_or(|(comm, cgroup)| self.wanted.judge(known(comm), known(cgroup)));
            if let Some(p) = probes.as_deref_mut()
                && wanted
            {
                self.look_at(p, e.tgid);
            }
        }
        execs
    }

    /// Prints what the kernel side logged.
    /// Resets `early_ready` (its counter read), before the mappings are taken.
    pub fn early_taken(&self) {
        if let Some(fd) = &self.early_ready {
            let mut n = [0u8; 8];
            // SAFETY: an 8-byte read from a nonblocking eventfd we own.
            let _ = unsafe { libc::read(fd.get_ref().as_raw_fd(), n.as_mut_ptr().cast(), 8) };
        }
    }

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
        if !self.known.attached.insert(provider.file.id()) {
            return true;
        }
        match probes.attach(&provider, self.scope, self.at_entry) {
            Ok(()) => crate::say!(
                "heaptrace: also tracing {} (first seen in pid {pid})",
                provider.path.display()
            ),
            Err(e) => crate::say!("heaptrace: warning: cannot trace pid {pid}'s allocator: {e}"),
        }
        true
    }
}

/// The OOM killer's victims, reported on the process-event ring (heaptrace-ebpf's oom.rs).
fn watch_oom(probes: &mut Probes) -> Result<()> {
    probes.oom_victim.clone().map_err(Error::Load)?;
    let (prog, tp) = ("on_oom", "mark_victim");
    let p: &mut RawTracePoint = crate::probe::program(&mut probes.ebpf, prog)?;
    p.load().map_err(|e| Error::Load(format!("{prog}: {e}")))?;
    p.attach(tp)
        .map_err(|e| Error::Load(format!("{prog} on {tp}: {e}")))?;
    Ok(())
}

/// Which processes' allocator files a system-wide trace probes: under `--comm`/`--cgroup`, only
/// those of the processes that match, judged at their exec (or at the start), as the kernel
/// judges them. Probes on a file only the others map would trap in their every call and count
/// nothing (a compiler's own jemalloc under `--comm myapp`). A process whose name or cgroup
/// cannot be read is looked at.
#[derive(Default)]
struct Wanted {
    comm: Option<String>,
    cgroup: Option<String>,
}

/// A name or path read ("" where none could be).
fn known(s: &str) -> Option<&str> {
    (!s.is_empty()).then_some(s)
}

impl Wanted {
    fn judge(&self, comm: Option<&str>, cgroup: Option<&str>) -> bool {
        let fits = |pattern: &Option<String>, value: Option<&str>| match (pattern, value) {
            (Some(p), Some(v)) => v.contains(p.as_str()),
            _ => true,
        };
        fits(&self.comm, comm) && fits(&self.cgroup, cgroup)
    }

    /// A running process, by what /proc says; only what a filter needs is read (the start-up
    /// scan of `--all` looks at every process on the host).
    fn judge_pid(&self, pid: u32) -> bool {
        let comm = self
            .comm
            .as_ref()
            .and_then(|_| crate::targets::procfs::comm(pid));
        let cgroup = self
            .cgroup
            .as_ref()
            .and_then(|_| crate::targets::procfs::cgroup(pid));
        self.judge(comm.as_deref(), cgroup.as_deref())
    }
}

impl Drop for ProcWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let one = 1u64.to_ne_bytes();
        // SAFETY: 8 bytes from a live buffer to an eventfd.
        let _ = unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), one.len()) };
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

fn comm_str(comm: &[u8; 16]) -> Option<String> {
    let end = comm.iter().position(|b| *b == 0).unwrap_or(comm.len());
    (end > 0).then(|| String::from_utf8_lossy(&comm[..end]).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filter_wants_the_processes_it_would_keep_and_the_unknown_ones() {
        let all = Wanted::default();
        assert!(all.judge(Some("anything"), Some("/x")));
        let by_name = Wanted {
            comm: Some("alloc".into()),
            cgroup: None,
        };
        assert!(by_name.judge(Some("allocs-static"), Some("/")));
        assert!(!by_name.judge(Some("rustc"), Some("/")));
        assert!(by_name.judge(None, None));
        let both = Wanted {
            comm: Some("alloc".into()),
            cgroup: Some("box".into()),
        };
        assert!(both.judge(Some("allocs"), Some("/box.scope")));
        assert!(!both.judge(Some("allocs"), Some("/")));
        assert!(!both.judge(Some("sh"), Some("/box.scope")));
        assert!(both.judge(Some("allocs"), None));
    }
}
