//! The exec watch's reader thread: the kernel's exec events as they come, and each new
//! process's mappings read at once and again as its loader maps its libraries.
use super::*;

/// Reads the kernel's exec events as they come, on a thread of its own, and each new process's
/// mappings at once. The daemon can be busy with a round for tens of milliseconds, and a
/// process that lives a millisecond is gone by then; its executable is mapped at the exec,
/// so read now its own frames can be named.
pub(super) struct Reader {
    pub(super) early_cgroups: Option<EarlyCgroups>,
    pub(super) ring: RingBuf<MapData>,
    pub(super) tx: mpsc::Sender<ProcEvent>,
    pub(super) stop: Arc<AtomicBool>,
    pub(super) wake: Arc<OwnedFd>,
    pub(super) comm: Option<String>,
    pub(super) early: EarlyMaps,
    pub(super) ready: Arc<OwnedFd>,
    pub(super) delay: Option<Duration>,
    /// The files of the mappings read, opened at once (a container's are reached through
    /// the process alone).
    pub(super) files: OpenFiles,
    /// What becomes of the forks reported: under `-p` alone, their inherited breakpoints
    /// taken out; in a followed tree, links for those no tracer holds.
    pub(super) forks: Arc<std::sync::OnceLock<ForkPolicy>>,
    /// The unwind tables, where a new process's entry is written at once if it needs no file
    /// read (`ProcWatch::share_tables`).
    pub(super) tables: Arc<std::sync::OnceLock<crate::unwind::loaded::Shared>>,
    /// New processes whose mappings hold files with no table yet, for the loader thread.
    pub(super) loads: Option<std::sync::mpsc::SyncSender<(u32, EarlyRead)>>,
}

/// Processes waiting for the loader thread; a host that starts more new programs at once has
/// the rest read by the daemon, at its next take of the early reads.
const LOADS_QUEUED: usize = 64;
/// The loader thread's nice value.
const LOADER_NICE: libc::c_int = -10;

/// The loader thread: the tables of the files a new process maps that no process mapped
/// before, read at once, away from the tables' lock, and the process's entry written. Left to
/// the daemon, they waited for its round (up to a second on a busy host), the process walked
/// late meanwhile; now, only while they are read.
/// Ends with the watch (`stop`), the reads still queued dropped: heaptrace exits at once.
fn load(rx: std::sync::mpsc::Receiver<(u32, EarlyRead)>, tables: &TablesCell, stop: &AtomicBool) {
    // Ahead of the daemon's round, whose CPU it would share on a busy host, not real-time:
    // a read takes tens of milliseconds. The nice value is this thread's alone (Linux).
    // SAFETY: no pointers; 0 is the calling thread.
    let _ = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, LOADER_NICE) };
    while let Ok((pid, read)) = rx.recv() {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let Some(t) = tables.get() else { continue };
        let opened = crate::symbolize::modules::table_files(read.files.iter());
        let todo = match t.lock() {
            Ok(t) => t.to_read(pid, &read.maps, &opened),
            Err(_) => continue,
        };
        let built: Vec<_> = todo.into_iter().map(|r| r.read()).collect();
        let Ok(mut t) = t.lock() else { continue };
        for b in built {
            t.admit(b);
        }
        t.sync_with(pid, &read.maps, &opened);
    }
}

type TablesCell = std::sync::OnceLock<crate::unwind::loaded::Shared>;

/// Tests only: `HEAPTRACE_DELAY_EXEC_EVENTS_MS` holds each exec event that long before the
/// daemon gets it, as a loaded host may (the reads of /proc before it, the scheduler), so that
/// a test can make the event come after the counters of the image it starts.
pub(super) fn delay_for_tests() -> Option<Duration> {
    let ms = std::env::var("HEAPTRACE_DELAY_EXEC_EVENTS_MS").ok()?;
    ms.parse().ok().map(Duration::from_millis)
}

impl Reader {
    /// Waits while the daemon's queue is full (the kernel's ring then fills, and counts what it
    /// cannot hold); false once the watch is stopped or gone.
    fn send(&self, mut exec: ProcEvent) -> bool {
        if let Some(d) = self.delay {
            std::thread::sleep(d);
        }
        loop {
            match self.tx.try_send(exec) {
                Ok(()) => return true,
                Err(mpsc::error::TrySendError::Closed(_)) => return false,
                Err(mpsc::error::TrySendError::Full(e)) => {
                    if self.stop.load(Ordering::Relaxed) {
                        return false;
                    }
                    exec = e;
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
        }
    }

    pub(super) fn run(mut self) {
        let (tx, rx) = std::sync::mpsc::sync_channel(LOADS_QUEUED);
        self.loads = Some(tx);
        let tables = self.tables.clone();
        let stop = self.stop.clone();
        std::thread::scope(|s| {
            let loader = std::thread::Builder::new()
                .name("heaptrace-tables".into())
                .spawn_scoped(s, || load(rx, &tables, &stop));
            if loader.is_err() {
                self.loads = None;
            }
            self.watch();
            // Ends the loader's wait; the scope joins it.
            self.loads = None;
        });
    }

    fn watch(&mut self) {
        // Run as soon as woken: a process of a millisecond is gone if the read waits for a
        // time slice behind the daemon's round and the traced programs (with this thread at
        // normal priority, 2 runs of 8 of `recurse 7` often went unread). Its work is bounded
        // (`READS_PER_SECOND`); where the priority cannot be had, it runs as any thread.
        let param = libc::sched_param { sched_priority: 1 };
        // SAFETY: a valid sched_param; 0 is the calling thread.
        let _ = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) };
        let mut budget = (Instant::now(), READS_PER_SECOND);
        // (when, pid, how many reads after the exec's): the reads to come.
        let mut again: Vec<(Instant, u32, usize)> = Vec::new();
        let mut fds = [self.ring.as_raw_fd(), self.wake.as_raw_fd()].map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        });
        while !self.stop.load(Ordering::Relaxed) {
            let now = Instant::now();
            let wait = again
                .iter()
                .map(|a| a.0.saturating_duration_since(now))
                .min()
                .unwrap_or(Duration::from_millis(100))
                .min(Duration::from_millis(100));
            // Rounded up: a timeout of 0 would spin (at real-time priority) until the next read.
            let ms = wait.as_micros().div_ceil(1000) as i32;
            // SAFETY: two valid pollfds.
            if unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) } < 0 {
                std::thread::sleep(Duration::from_millis(10));
            }
            let mut events = Vec::new();
            while let Some(item) = self.ring.next() {
                if item.len() >= std::mem::size_of::<ProcEvent>() {
                    // SAFETY: the kernel wrote a ProcEvent (repr(C), no padding); read unaligned.
                    events.push(unsafe {
                        std::ptr::read_unaligned(item.as_ptr().cast::<ProcEvent>())
                    });
                }
            }
            if budget.0.elapsed() >= Duration::from_secs(1) {
                budget = (Instant::now(), READS_PER_SECOND);
            }
            for event in events {
                if event.kind == PROC_LEFT {
                    self.left(event.tgid);
                    continue;
                }
                if event.kind == PROC_FORK {
                    self.unheld(event.tgid);
                }
                // A fork's mappings are its parent's, and it may be gone at the next round.
                let wanted = (event.kind == PROC_EXEC || event.kind == PROC_FORK)
                    && self.comm.as_ref().is_none_or(|c| {
                        comm_str(&event.comm).is_some_and(|n| n.contains(c.as_str()))
                    });
                if event.kind == PROC_EXEC {
                    self.read_cgroup(event.tgid);
                }
                if wanted && self.read(event.tgid, &mut budget.1) && again.len() < EARLY_MAPS {
                    again.push((Instant::now() + READ_AGAIN[0], event.tgid, 0));
                }
                if !self.send(event) {
                    return;
                }
            }
            let now = Instant::now();
            let due: Vec<(u32, usize)> = again
                .iter()
                .filter(|a| a.0 <= now)
                .map(|a| (a.1, a.2))
                .collect();
            again.retain(|a| a.0 > now);
            for (pid, n) in due {
                if self.read(pid, &mut budget.1) && n + 1 < READ_AGAIN.len() {
                    again.push((now + READ_AGAIN[n + 1] - READ_AGAIN[n], pid, n + 1));
                }
            }
        }
    }

    /// A fork of the `-p` process, not followed, already running: the file's bytes written
    /// back over the breakpoints it inherited, so that it runs at its own speed from here on.
    /// A vfork (or `posix_spawn`) runs in its parent's memory, whose breakpoints stay.
    fn left(&self, child: u32) {
        let Some(ForkPolicy::Leave(parent, forks)) = self.forks.get() else {
            return;
        };
        if crate::targets::procfs::same_memory(*parent, child) != Some(false) {
            return;
        }
        match forks.restore(child) {
            Ok(n) => log::debug!("pid {child}, forked by {parent}: {n} breakpoints taken out"),
            Err(e) => log::debug!("pid {child}, forked by {parent}: breakpoints left ({e})"),
        }
    }

    /// A fork in a followed tree: if no tracer of heaptrace's holds it (`TracerPid`, set at
    /// the fork itself, before the kernel's report), links of its own now.
    fn unheld(&self, child: u32) {
        let Some(ForkPolicy::FollowUnheld(forks)) = self.forks.get() else {
            return;
        };
        // TracerPid is the tracing thread's id: one of ours holds it.
        let ours = |t: u32| t != 0 && crate::targets::procfs::thread_alive(std::process::id(), t);
        if crate::targets::procfs::tracer(child).is_some_and(|t| !ours(t))
            && forks.follow_late(child)
        {
            log::debug!("pid {child}: not held at its fork, followed from its report");
        }
    }

    /// On a host with a v1 memory hierarchy, a new process's cgroup path for the daemon.
    fn read_cgroup(&self, pid: u32) {
        let Some(c) = &self.early_cgroups else {
            return;
        };
        if let Some(path) = crate::targets::procfs::cgroup(pid)
            && let Ok(mut c) = c.lock()
            && c.len() < EARLY_MAPS
        {
            c.insert(pid, path);
        }
    }

    /// Reads a process's mappings for the daemon, if the budget allows; false if it is gone
    /// (or nothing could be read).
    fn read(&mut self, pid: u32, budget: &mut u32) -> bool {
        if *budget == 0 {
            return false;
        }
        let Ok(maps) = fs::read_to_string(format!("/proc/{pid}/maps")) else {
            return false;
        };
        *budget -= 1;
        if maps.is_empty() {
            return false; // ended, not reaped yet
        }
        let read = self.files.read(pid, maps);
        // Not waiting for the daemon (a round holds it up to a tenth of a second or more),
        // nor for the tables (the daemon reading a file's rows): the daemon syncs it then.
        if let Some(t) = self.tables.get() {
            let known = t
                .try_lock()
                .is_ok_and(|mut t| t.sync_known(pid, &read.maps));
            if !known
                && crate::unwind::loaded::loader_done(&read.maps)
                && let Some(l) = &self.loads
            {
                let _ = l.try_send((pid, read.clone()));
            }
        }
        match self.early.lock() {
            Ok(mut early) if early.len() < EARLY_MAPS || early.contains_key(&pid) => {
                early.insert(pid, read);
                let one = 1u64.to_ne_bytes();
                // SAFETY: an 8-byte write to an eventfd we own; a full counter only fails.
                let _ = unsafe { libc::write(self.ready.as_raw_fd(), one.as_ptr().cast(), 8) };
                true
            }
            _ => false,
        }
    }
}
