//! The daemon's loop: a round every interval (read the kernel's maps, subtract the previous
//! read, fold the difference into the Profile, record it, hand it to the live view), the
//! events in between (process starts, exits and execs, memory syscalls, the launched child),
//! until the target exits or heaptrace is told to stop.
pub mod exec_watch;
use std::{
    collections::{BTreeMap, HashSet},
    os::fd::OwnedFd,
    time::{Duration, Instant},
};

use tokio::{
    io::unix::AsyncFd,
    signal::unix::{SignalKind, signal},
};

use crate::{
    cli::TraceArgs,
    daemon::exec_watch::ProcWatch,
    drain::KernelMaps,
    drain::round::Leak,
    drain::round::{Round, SiteId, Snapshot},
    error::Result,
    probe::Probes,
    profile::Profile,
    record::Recorder,
    reserve::{Tracker, ring::MemRing},
    symbolize::modules::Modules,
    symbolize::{Frame, Symbolizer},
    targets::launch,
    targets::procfs,
    view::summary,
    view::tui,
};

/// Why the main loop ended.
pub enum End {
    TargetExited,
    Interrupted,
    Terminated,
    /// The live view was quit.
    Quit,
}

/// Everything a trace holds between rounds. `cmd::trace` builds it once the probes are attached, and
/// takes it apart at the end.
pub struct Daemon {
    pub maps: KernelMaps,
    pub prev: Snapshot,
    pub profile: Profile,
    pub start: Instant,
    /// The one traced process, or None for all.
    pub pid: Option<u32>,
    pub quiet: bool,
    pub modules: Modules,
    pub stack_depth: usize,
    pub symbolizer: Symbolizer,
    pub recorder: Option<Recorder>,
    /// A launched command, held at its exit by its tracer thread.
    pub child: Option<launch::Child>,
    pub exit_code: Option<i32>,
    /// Detached (dropped) before the final round.
    pub probes: Option<Probes>,
    /// System-wide mode: process starts and exits.
    pub procwatch: Option<ProcWatch>,
    /// Its execs, as its reader thread forwards them, and one received but not yet handled.
    pub execs: Option<tokio::sync::mpsc::Receiver<heaptrace_common::ProcEvent>>,
    pub exec_first: Option<heaptrace_common::ProcEvent>,
    /// Blocks that processes ended without freeing, taken out of the live map when they ended.
    pub exited_leaks: BTreeMap<SiteId, Leak>,
    /// Kernel stacks shown the same, counted as one site.
    pub same: crate::profile::same_stacks::SameStacks,
    /// Stacks of processes gone, freed after the last round's read (`KernelMaps::free_stacks`).
    pub freed: crate::drain::Freed,
    /// Processes that had the pid of one gone before: the figures' process keys.
    pub incarnations: crate::profile::incarnation::Incarnations,
    /// Ended processes kept one by one (`--keep-exited`), oldest first; older ones are folded.
    pub keep_exited: usize,
    pub exited_order: std::collections::VecDeque<u32>,
    /// Folded stacks made since the last round was recorded: the recording names them too.
    pub folded_stacks: Vec<(i32, std::sync::Arc<[Frame]>)>,
    /// Processes that exec'ed since the last round (`Round::restarted`).
    pub restarted: std::collections::BTreeSet<u32>,
    /// What the live view says beside the figures (`tui::Published::notice`).
    pub notice: Option<String>,
    /// Processes that exec'ed since the last round: what their earlier images left in the
    /// kernel maps is dropped once a round, after its read (a read of the whole live map for
    /// each exec would be too much for a host that runs many commands); until then their
    /// epoch keeps it out.
    pub stale: HashSet<u32>,
    /// --comm/--cgroup, and each process's verdict, taken while it lived.
    pub filter: Option<Filter>,
    pub matched: std::collections::HashMap<u32, bool>,
    /// The live view's channels, when it is up.
    pub live: Option<tui::Link>,
    pub cpu: CpuMeter,
    /// Memory syscalls of traced processes, and what they tell about reserved memory.
    pub memring: Option<MemRing>,
    pub reserves: Tracker,
    /// `reserves.lost` already reported in a round.
    pub reserves_lost: u64,
    /// The warning that the kernel's cgroup verdicts are full was given.
    pub unjudged_said: bool,
}

/// What a trace hands its daemon once the probes are attached; the rest starts empty.
pub struct Start {
    pub maps: KernelMaps,
    pub probes: Probes,
    pub profile: Profile,
    pub pid: Option<u32>,
    pub child: Option<launch::Child>,
    pub modules: Modules,
    pub recorder: Option<Recorder>,
    pub procwatch: Option<ProcWatch>,
    pub memring: Option<MemRing>,
    pub live: Option<tui::Link>,
    pub filter: Option<Filter>,
    pub quiet: bool,
    pub stack_depth: usize,
    pub keep_exited: usize,
}

impl Daemon {
    pub fn new(s: Start) -> Daemon {
        let mut procwatch = s.procwatch;
        Daemon {
            maps: s.maps,
            prev: Snapshot::default(),
            profile: s.profile,
            start: Instant::now(),
            pid: s.pid,
            quiet: s.quiet,
            modules: s.modules,
            stack_depth: s.stack_depth,
            symbolizer: Symbolizer::default(),
            recorder: s.recorder,
            child: s.child,
            exit_code: None,
            probes: Some(s.probes),
            execs: procwatch.as_mut().and_then(|w| w.events.take()),
            exec_first: None,
            procwatch,
            exited_leaks: BTreeMap::new(),
            same: Default::default(),
            freed: Default::default(),
            incarnations: Default::default(),
            keep_exited: s.keep_exited,
            exited_order: Default::default(),
            folded_stacks: Vec::new(),
            restarted: Default::default(),
            notice: None,
            stale: HashSet::new(),
            filter: s.filter,
            matched: std::collections::HashMap::new(),
            live: s.live,
            cpu: CpuMeter::default(),
            memring: s.memring,
            reserves: Tracker::default(),
            reserves_lost: 0,
            unjudged_said: false,
        }
    }
}

/// heaptrace's own CPU use between two reads, from /proc/self/stat.
#[derive(Default)]
pub struct CpuMeter {
    last: Option<(Instant, f64)>,
}

impl CpuMeter {
    /// Percent of one CPU since the previous call.
    fn sample(&mut self) -> Option<f64> {
        let now = (Instant::now(), procfs::self_cpu_seconds()?);
        let pct = self.last.map(|(t, cpu)| {
            let wall = now.0.duration_since(t).as_secs_f64().max(1e-6);
            100.0 * (now.1 - cpu) / wall
        });
        self.last = Some(now);
        pct
    }
}

/// Waits for the live view to quit (or to be gone); forever without one.
async fn view_quit(live: Option<&mut tui::Link>) {
    match live {
        Some(l) => {
            let _ = l.quit.recv().await;
        }
        None => std::future::pending().await,
    }
}

/// `--comm` / `--cgroup`: which processes a system-wide trace reports. The kernel leaves out
/// the processes that do not match (`heaptrace_common::filter`) but judges a thread at its
/// first call, and traces where it cannot judge: the rounds judge what it shows them again and
/// keep only the matching ones, so every view agrees.
pub struct Filter {
    comm: Option<String>,
    cgroup: Option<String>,
}

impl Filter {
    pub fn from_cli(cli: &TraceArgs) -> Option<Filter> {
        (cli.comm.is_some() || cli.cgroup.is_some()).then(|| Filter {
            comm: cli.comm.clone(),
            cgroup: cli.cgroup.clone(),
        })
    }

    fn matches(&self, comm: &str, cgroup: &str) -> bool {
        self.comm.as_ref().is_none_or(|c| comm.contains(c.as_str()))
            && self
                .cgroup
                .as_ref()
                .is_none_or(|c| cgroup.contains(c.as_str()))
    }

    /// Drops the processes that do not match. A process is judged once, when first seen: by
    /// its name and cgroup while it lives; once gone, by the name the kernel recorded (its
    /// cgroup can no longer be read, so a --cgroup filter leaves it out).
    fn apply(
        &self,
        round: &mut crate::drain::round::Round,
        matched: &mut std::collections::HashMap<u32, bool>,
    ) {
        for (pid, pr) in &round.procs {
            matched
                .entry(*pid)
                .or_insert_with(|| self.matches(&pr.comm, &pr.cgroup));
        }
        let keep = |pid: &u32| matched.get(pid).copied().unwrap_or(false);
        round.procs.retain(|p, _| keep(p));
        round.sizes.retain(|k, _| keep(&k.0));
        round.sites.retain(|k, _| keep(&k.0));
        round.mem.retain(|p, _| keep(p));
        round.stacks.retain(|k, _| keep(&k.0));
        round.reservations.retain(|k, _| keep(&k.0));
        round.reserved.retain(|p, _| keep(p));
    }
}

/// How long after the start the target's mappings are read often: a short-lived command may
/// exit before the first round, and its stacks can only be resolved with mappings read while
/// it was alive.
const EARLY_MAPS: Duration = Duration::from_secs(2);
const EARLY_MAPS_EVERY: Duration = Duration::from_millis(20);

impl Daemon {
    pub async fn watch(&mut self, interval: Duration) -> Result<End> {
        // A launched command reports its end through its tracer; any other process, through a
        // pidfd (readable once it exits).
        let exited = match self.pid {
            Some(pid) if self.child.is_none() => {
                let fd = match procfs::pidfd_open(pid) {
                    Ok(fd) => fd,
                    // Gone already (it can end right after the attach): its calls are in the
                    // maps, and the final round reads them.
                    Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                        return Ok(End::TargetExited);
                    }
                    Err(e) => return Err(e.into()),
                };
                // SAFETY: we own the pidfd and keep it open while it is registered.
                Some(unsafe { AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)?)
            }
            _ => None,
        };
        let mut sigint = signal(SignalKind::interrupt())?;
        let mut sigterm = signal(SignalKind::terminate())?;
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await; // the first tick is immediate
        let mut early = tokio::time::interval(EARLY_MAPS_EVERY);
        let mut retry = tokio::time::interval(crate::daemon::exec_watch::RETRY_EVERY);
        loop {
            let pending = self.procwatch.as_ref().is_some_and(ProcWatch::has_pending);
            let early_maps = self.pid.is_some() && self.start.elapsed() < EARLY_MAPS;
            tokio::select! {
                _ = early.tick(), if early_maps => {
                    if let Some(pid) = self.pid {
                        self.modules.refresh(pid);
                    }
                }
                _ = ticks.tick() => {
                    self.round()?;
                    self.maps.purge_inflight(procfs::thread_alive)?;
                }
                _ = target_exit(exited.as_ref()) => return Ok(End::TargetExited),
                ev = child_event(self.child.as_mut()) => {
                    if self.child_event(ev)? {
                        return Ok(End::TargetExited);
                    }
                }
                _ = retry.tick(), if pending => {
                    if let (Some(w), Some(p)) = (self.procwatch.as_mut(), self.probes.as_mut()) {
                        w.retry(p);
                    }
                }
                _ = readable(self.procwatch.as_ref().and_then(|w| w.logs.as_ref())) => {
                    if let Some(w) = self.procwatch.as_mut() {
                        w.flush_logs();
                    }
                }
                _ = readable(self.memring.as_ref().map(|r| &r.ring)) => self.drain_mem(),
                Some(first) = exec_event(self.execs.as_mut()) => {
                    self.exec_first = Some(first);
                    self.process_events();
                }
                _ = view_quit(self.live.as_mut()) => return Ok(End::Quit),
                _ = sigint.recv() => return Ok(End::Interrupted),
                _ = sigterm.recv() => return Ok(End::Terminated),
            }
        }
    }

    /// Processes that ended before the round just applied (and not before an earlier one),
    /// so their final counts are in it: keep their leaks and free their map space. Returns the
    /// processes marked ended, and those then folded, for the recording.
    fn forget_exited(&mut self, gone: HashSet<u32>) -> Result<(Vec<u32>, Vec<u32>)> {
        if gone.is_empty() {
            return Ok(Default::default());
        }
        let left = self.maps.forget(&gone)?;
        let leaks = self.matching(self.same.leaks(left));
        let mut leaks = self.incarnations.rekey_sites(leaks);
        self.exited_leaks.append(&mut leaks);
        let (mut ended, mut folded) = (Vec::new(), Vec::new());
        for p in &gone {
            self.reserves.forget(*p);
            self.same.forget(*p);
            // Its stacks were named in the round just applied; no more will come.
            self.modules.forget(*p);
            // A process that gets the pid next is judged anew.
            self.matched.remove(p);
            let key = self.incarnations.key(*p);
            if self.profile.end(key) {
                self.exited_order.push_back(key);
                ended.push(key);
            }
        }
        while self.exited_order.len() > self.keep_exited {
            let Some(key) = self.exited_order.pop_front() else {
                break;
            };
            let made = self.profile.fold(key, &mut self.exited_leaks);
            self.folded_stacks.extend(made);
            folded.push(key);
        }
        Ok((ended, folded))
    }

    /// Leaks (by pid) of the processes `--comm`/`--cgroup` keep: the kernel's live map holds
    /// every process's blocks.
    pub fn matching<V>(&self, leaks: BTreeMap<SiteId, V>) -> BTreeMap<SiteId, V> {
        if self.filter.is_none() {
            return leaks;
        }
        leaks
            .into_iter()
            .filter(|(k, _)| self.matched.get(&k.0).copied().unwrap_or(false))
            .collect()
    }

    /// Handles an event of a launched command; true once it is gone. At its exit, while it is
    /// held with its mappings intact, a round is drained so its new stacks get names.
    fn child_event(&mut self, ev: Option<launch::Event>) -> Result<bool> {
        match ev {
            Some(launch::Event::Exiting) => {
                if let Some(pid) = self.pid {
                    self.modules.refresh(pid);
                }
                self.round()?;
                if let Some(c) = &self.child {
                    let _ = c.ack.send(());
                }
                Ok(false)
            }
            Some(launch::Event::Exec) => {
                // Its executable may be its allocator: probed before it runs.
                if let (Some(w), Some(p), Some(pid)) =
                    (self.procwatch.as_mut(), self.probes.as_mut(), self.pid)
                {
                    w.look_at(p, pid);
                }
                if let Some(c) = &self.child {
                    let _ = c.ack.send(());
                }
                Ok(false)
            }
            Some(launch::Event::Exited(code)) => {
                self.exit_code = Some(code);
                Ok(true)
            }
            None => Ok(true),
        }
    }

    /// A launched command's exit status. After a signal it may still be finishing (a
    /// terminal's Ctrl-C reaches it too; SIGTERM is passed on): wait a short while at most.
    pub async fn child_exit(&mut self, end: &End) -> Result<i32> {
        if let Some(code) = self.exit_code {
            return Ok(code);
        }
        // Quitting the live view interrupts the command as Ctrl-C would without it, and kills
        // it if it is still there after that while.
        let sig = match end {
            End::Terminated => Some(libc::SIGTERM),
            End::Quit => Some(libc::SIGINT),
            _ => None,
        };
        if let (Some(sig), Some(pid)) = (sig, self.pid) {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(pid as i32, sig) };
        }
        let mut killed = false;
        loop {
            let deadline = tokio::time::sleep(Duration::from_secs(2));
            tokio::pin!(deadline);
            loop {
                tokio::select! {
                    ev = child_event(self.child.as_mut()) => {
                        if self.child_event(ev)? {
                            return Ok(self.exit_code.unwrap_or(1));
                        }
                    }
                    _ = &mut deadline => break,
                }
            }
            match (end, self.pid, killed) {
                (End::Quit, Some(pid), false) => {
                    // SAFETY: killing our own child; its tracer reaps it.
                    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                    killed = true;
                }
                (End::Terminated, _, _) => return Ok(128 + libc::SIGTERM),
                (End::Quit, _, _) => return Ok(128 + libc::SIGKILL),
                _ => return Ok(128 + libc::SIGINT),
            }
        }
    }

    /// Reads the process events: attaches the allocators of new processes, and starts the
    /// processes that exec'ed over as their new command.
    fn process_events(&mut self) {
        let Some(w) = self.procwatch.as_mut() else {
            return;
        };
        let mut got: Vec<_> = self.exec_first.take().into_iter().collect();
        if let Some(rx) = self.execs.as_mut() {
            while let Ok(e) = rx.try_recv() {
                got.push(e);
            }
        }
        let execs = w.drain(got, self.probes.as_mut());
        self.restart(execs);
    }

    /// The mappings the exec watch read right after new processes' execs: the stacks read
    /// next may be theirs (a process of a millisecond, gone by now).
    fn early_maps(&mut self) {
        let Some(w) = self.procwatch.as_ref() else {
            return;
        };
        let early = match w.early.lock() {
            Ok(mut m) => std::mem::take(&mut *m),
            Err(_) => return,
        };
        // The exec markers among the memory events first: they drop what was read of the
        // image before.
        self.drain_mem();
        for (pid, maps) in early {
            self.modules.keep_early(pid, &maps);
        }
    }

    /// Processes that exec'ed: the kernel reset their counters at the exec, so their figures
    /// are now those of the new command alone. What the image before the exec did (a shell's
    /// fork between fork and exec; with one process traced, the wrapper script that exec'ed
    /// the program) is dropped from every figure: it belonged to neither the parent nor the
    /// new command.
    fn restart(&mut self, execs: Vec<u32>) {
        // The kernel moves a process's epoch on only when it had counters: only those have
        // anything to drop. One read already may hold the new image's counters (this event
        // comes through the exec watch, later than the counters at times): then the epoch it
        // read is the current one, and nothing is dropped (that dropped a launched command's
        // reservations, and counted its work twice in the timeline).
        let pids: HashSet<u32> = execs
            .into_iter()
            .filter(|p| match self.prev.procs.get(p) {
                Some(read) => read.epoch != self.maps.epoch(*p),
                None => {
                    self.profile
                        .procs
                        .get(&self.incarnations.key(*p))
                        .is_some_and(|pp| !pp.exited)
                        || self.maps.has_restarted(*p)
                }
            })
            .collect();
        self.start_over(pids);
    }

    /// Drops what processes `pids` counted before their exec, everywhere: the previous read's
    /// entries now, the Profile's as the next round is applied, the kernel maps' after the next
    /// read.
    fn start_over(&mut self, pids: HashSet<u32>) {
        if pids.is_empty() {
            return;
        }
        if self.pid.is_some() {
            for p in &pids {
                let comm = procfs::comm(*p).unwrap_or_default();
                let says = format!("pid {p} exec'ed {comm}: its counts start over");
                if !self.quiet && self.live.is_none() {
                    eprintln!("heaptrace: {says}");
                }
                self.notice = Some(says);
            }
        }
        for p in &pids {
            self.prev.procs.remove(p);
            // Dropped from the profile as the next round is added, and so from a recording's.
            self.restarted.insert(*p);
            // Its new image's stacks are named by its new mappings, even at the same addresses.
            self.same.forget(*p);
            // Its memory tracker state is not dropped here: this event and the memory events
            // come on two rings, and the new image's may be read already. The kernel marks
            // the exec among the memory events (`mem::EXEC`).
            // Judged again under its new name.
            self.matched.remove(p);
        }
        for p in &pids {
            // By range: exec events come many a second on a busy host.
            crate::drain::round::take_range(
                &mut self.prev.sizes,
                crate::drain::round::size_keys(*p),
            );
            crate::drain::round::take_range(
                &mut self.prev.sites,
                crate::drain::round::site_ids(*p),
            );
        }
        self.stale.extend(pids);
    }

    pub fn round(&mut self) -> Result<()> {
        // Execs reported so far are applied before the read, so that it starts their new
        // counts from zero (the read counts only each process's current image).
        self.process_events();
        let gone = self.gone();
        self.drain_mem();
        let snap = self.maps.snapshot()?;
        // Started over at an exec whose event is not read yet: the read says so by its epoch.
        self.start_over(snap.restarted_since(&self.prev).into_iter().collect());
        // The earlier images of the processes that exec'ed go from the maps (the snapshot
        // counted their current images only), and their stacks are freed below unless others
        // hold them: a shell's forks that exec leave theirs (a pyenv shim's ~35 bash a run).
        let dropped = if self.stale.is_empty() {
            Default::default()
        } else {
            let stale = std::mem::take(&mut self.stale);
            self.maps.restarted(&stale)?
        };
        let mut round = snap.since(&self.prev);
        self.reincarnate(&snap);
        round.reservations = self.reserves.take();
        round.restarted = std::mem::take(&mut self.restarted).into_iter().collect();
        round.index = self.profile.rounds.last().map_or(0, |r| r.index) + 1;
        round.elapsed_ms = self.start.elapsed().as_millis() as u64;
        self.describe_processes(&mut round, &snap);
        let lost = self.reserves.lost - self.reserves_lost;
        round.losses[heaptrace_common::Loss::MemEvents as usize] += lost;
        self.reserves_lost = self.reserves.lost;
        if let Some(filter) = &self.filter {
            filter.apply(&mut round, &mut self.matched);
        }
        // After the filter: the stacks of processes left out are never symbolized (in --all,
        // those of every other program on the host, and their debug info would stay loaded).
        self.new_stacks(&mut round);
        self.same.round(&mut round);
        self.incarnations.rekey(&mut round);
        // Those not ended already; the Profile ends them as it applies the round, so that its
        // timeline row and peak leave their blocks out.
        let ending: HashSet<u32> = gone
            .iter()
            .copied()
            .filter(|p| {
                let key = self.incarnations.key(*p);
                self.profile.procs.get(&key).is_none_or(|pp| !pp.exited)
            })
            .collect();
        round.ended = ending.iter().map(|p| self.incarnations.key(*p)).collect();
        self.profile.apply(&round);
        // Sites first seen from now on were counted after this round's read: the stacks
        // freed before it are no one's now.
        self.freed.clear();
        let theirs = snap.stacks_only_of(&gone, dropped);
        (round.ended, round.folded) = self.forget_exited(ending)?;
        self.forget_gone(&gone);
        if !theirs.is_empty() {
            self.freed = self.maps.free_stacks(theirs);
        }
        for (id, frames) in std::mem::take(&mut self.folded_stacks) {
            let stack = crate::drain::round::NewStack {
                frames,
                ..Default::default()
            };
            round
                .stacks
                .insert((crate::profile::exited::FOLDED, id), stack);
        }
        self.emit(&round);
        self.prev = snap;
        self.publish(None, None);
        Ok(())
    }

    /// The processes found gone. Decided before the snapshot, so that it holds their final
    /// counts (a process found gone after it could still have counted something in between).
    /// Those seen starting since the last read count too: one that lived within a round ends
    /// in it, rather than a round later, its blocks live meanwhile.
    fn gone(&self) -> HashSet<u32> {
        if self.pid.is_some() {
            return HashSet::new();
        }
        // Each pid looked at once: a read of /proc, and most are in both.
        let mut known: HashSet<u32> = self.prev.procs.keys().copied().collect();
        known.extend(self.procwatch.iter().flat_map(|w| w.seen.keys()));
        known.retain(|p| !procfs::alive(*p));
        known
    }

    /// A pid whose process is gone, back in the kernel's maps: another process has it.
    fn reincarnate(&mut self, snap: &Snapshot) {
        let back: Vec<u32> = snap
            .procs
            .keys()
            .chain(self.restarted.iter())
            .copied()
            .filter(|p| {
                let key = self.incarnations.key(*p);
                self.profile.procs.get(&key).is_some_and(|pp| pp.exited)
            })
            .collect();
        for p in back {
            self.incarnations.next(p);
        }
    }

    /// Each process's name, cgroup, memory and what its allocator holds, as /proc shows them
    /// at the end of the round; processes gone already are named as they were seen starting.
    fn describe_processes(&mut self, round: &mut Round, snap: &Snapshot) {
        let pids: Vec<u32> = match self.pid {
            Some(p) => vec![p],
            None => snap.procs.keys().copied().collect(),
        };
        if let Some(w) = &self.procwatch {
            for (p, pr) in round.procs.iter_mut() {
                if let Some((comm, cgroup)) = w.seen.get(p) {
                    pr.comm.clone_from(comm);
                    pr.cgroup.clone_from(cgroup);
                }
            }
        }
        for p in pids {
            if !procfs::alive(p) {
                continue;
            }
            let Some(m) = procfs::mem(p) else { continue };
            round.mem.insert(p, m);
            if self.memring.is_some()
                && let Some((start, brk)) = procfs::heap(p)
            {
                if !self.reserves.knows(p) {
                    self.reserves.seed_brk(p, brk);
                }
                let mut r = self.reserves.reserved(p);
                r.heap = brk - start;
                round.reserved.insert(p, r);
            }
            // The kernel names a process at its first allocation, which may be before its
            // exec (a shell's fork): the current name wins while it lives.
            if let Some(pr) = round.procs.get_mut(&p) {
                if let Some(comm) = procfs::comm(p) {
                    pr.comm = comm;
                }
                // A process ending right now keeps the cgroup it was seen starting in.
                if let Some(cgroup) = procfs::cgroup(p) {
                    pr.cgroup = cgroup;
                }
            }
        }
    }

    /// Every one gone, also those that never allocated: no name of theirs is needed again.
    fn forget_gone(&mut self, gone: &HashSet<u32>) {
        let Some(w) = self.procwatch.as_mut() else {
            return;
        };
        w.seen.retain(|p, _| !gone.contains(p));
        let unjudged = w.judge_cgroups();
        if unjudged > 0 && !self.unjudged_said {
            self.unjudged_said = true;
            eprintln!(
                "heaptrace: warning: {unjudged} cgroups had no room in the kernel's \
                 verdicts: their processes are traced in full and left out in user space"
            );
        }
    }

    /// The round to the recording, and its line to stderr when no live view is up.
    fn emit(&mut self, round: &Round) {
        if let Some(r) = &mut self.recorder
            && let Err(e) = r.round(round)
        {
            // A full disk ends the recording, not the trace; what was written stays readable.
            eprintln!("heaptrace: warning: recording stopped: {e}");
            self.recorder = None;
        }
        if !self.quiet
            && self.live.is_none()
            && let Some(row) = self.profile.rounds.last()
        {
            eprintln!("heaptrace: {}", summary::round_line(row, &self.profile));
        }
    }

    /// Hands the live view a copy of the Profile; it never waits for the view.
    pub fn publish(&mut self, ended: Option<String>, exit_code: Option<i32>) {
        if let Some(live) = &self.live {
            let cpu_percent = self.cpu.sample();
            live.publish(tui::Published {
                profile: self.profile.clone(),
                elapsed_ms: self.start.elapsed().as_millis() as u64,
                cpu_percent,
                ended,
                exit_code,
                notice: self.notice.clone(),
            });
        }
    }

    /// After the target exited: waits until the live view is quit, or a signal.
    pub async fn until_quit(&mut self) -> Result<()> {
        let mut sigint = signal(SignalKind::interrupt())?;
        let mut sigterm = signal(SignalKind::terminate())?;
        tokio::select! {
            _ = view_quit(self.live.as_mut()) => {}
            _ = sigint.recv() => {}
            _ = sigterm.recv() => {}
        }
        Ok(())
    }
}

impl Daemon {
    /// Folds the memory syscalls reported so far into the reservation tracker.
    fn drain_mem(&mut self) {
        let Some(r) = self.memring.as_mut() else {
            return;
        };
        let mut first_seen = Vec::new();
        for ev in r.drain() {
            self.reserves.event(&ev);
            // A process's first memory syscall is in its first allocations, its libraries
            // mapped: read its mappings now, while it surely lives (a command of a few
            // milliseconds may be gone at the next round, its stacks then unnamed). An exec
            // makes them the new image's to read.
            if ev.kind == heaptrace_common::mem::EXEC {
                self.modules.forget(ev.tgid);
            } else if !self.modules.knows(ev.tgid) {
                first_seen.push(ev.tgid);
            }
        }
        first_seen.dedup();
        for pid in first_seen {
            if !self.modules.knows(pid) {
                self.modules.refresh(pid);
            }
        }
    }

    /// Symbolizes the stacks first seen this round, while their processes are (maybe) alive.
    fn new_stacks(&mut self, round: &mut crate::drain::round::Round) {
        self.early_maps();
        let new: Vec<(u32, i32)> = round
            .sites
            .keys()
            .map(|(pid, id, _)| (*pid, *id))
            .chain(round.reservations.keys().map(|(pid, _, id, _)| (*pid, *id)))
            .filter(|(pid, id)| *id >= 0 && !self.same.knows(*pid, *id))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        let mut refreshed = HashSet::new();
        for (pid, id) in new {
            if refreshed.insert(pid) && procfs::alive(pid) {
                self.modules.refresh(pid);
            }
            let stack = self.read_stack(pid, id);
            // Not when shown as a stack seen before: its counts go there.
            if self.same.add(pid, id, &stack.frames) == id {
                round.stacks.insert((pid, id), stack);
            }
        }
        // After the stacks are named: a process gone before this round's read may have
        // stacks in the next one.
        self.modules.prune_early(procfs::alive);
    }

    /// A stack as stored in the kernel, cut to what is shown, and named.
    fn read_stack(&mut self, pid: u32, id: i32) -> crate::drain::round::NewStack {
        // A stack that cannot be read has no frames, and says nothing of lost ones.
        let now = self.maps.stack(id);
        let read = match self.freed.get(&id) {
            None => Some(now.unwrap_or((Vec::new(), true))),
            Some(held) => {
                crate::drain::freed_stack(held.clone(), now, |ip| !self.modules.not_code(pid, ip))
            }
        };
        let Some((mut ips, whole)) = read else {
            return crate::drain::round::NewStack {
                frames: [Frame::taken()].into(),
                ..Default::default()
            };
        };
        ips.truncate(self.stack_depth);
        // The first frame is the return address the probe saw; past a function built
        // without frame pointers, the walk read on through data.
        if let Some(i) = ips
            .iter()
            .skip(1)
            .position(|ip| self.modules.not_code(pid, *ip))
        {
            ips.truncate(i + 1);
        }
        if !whole && ips.len() < self.stack_depth {
            ips.push(crate::symbolize::MORE_FRAMES_LOST);
        }
        let locations = Symbolizer::locations(&self.modules, pid, &ips);
        let frames = self.symbolizer.frames(&ips, &locations).into();
        crate::drain::round::NewStack {
            ips,
            locations,
            frames,
        }
    }
}

/// Waits until `fd` has something to read (a ring buffer, the programs' log), and clears that
/// readiness for the next wait; forever without one.
async fn readable<T: std::os::fd::AsRawFd>(fd: Option<&AsyncFd<T>>) {
    match fd {
        Some(fd) => {
            if let Ok(mut guard) = fd.readable().await {
                guard.clear_ready();
            }
        }
        None => std::future::pending().await,
    }
}

async fn exec_event(
    rx: Option<&mut tokio::sync::mpsc::Receiver<heaptrace_common::ProcEvent>>,
) -> Option<heaptrace_common::ProcEvent> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

async fn child_event(child: Option<&mut launch::Child>) -> Option<launch::Event> {
    match child {
        Some(c) => c.events.recv().await,
        None => std::future::pending().await,
    }
}

async fn target_exit(fd: Option<&AsyncFd<OwnedFd>>) {
    match fd {
        Some(fd) => {
            let _ = fd.readable().await;
        }
        None => std::future::pending().await,
    }
}
