//! The daemon's loop: a round every interval (read the kernel's maps, subtract the previous
//! read, fold the difference into the Profile, record it, hand it to the live view), the
//! events in between (process starts, exits and execs, memory syscalls, the launched child),
//! until the target exits or heaptrace is told to stop.
pub mod exec_watch;
mod filter;
mod finalize;
mod oom;
mod processes;
mod relay;
mod round;
pub mod signals;

pub use filter::Filter;
pub use finalize::hold_python_finalize;
pub use oom::OomReports;
pub use relay::{Relay, Route};
pub use signals::Sig;
use std::{
    collections::{BTreeMap, HashSet},
    os::fd::OwnedFd,
    time::{Duration, Instant},
};

use tokio::io::unix::AsyncFd;

use crate::{
    daemon::exec_watch::ProcWatch,
    drain::round::Leak,
    drain::round::{Round, SiteId, Snapshot},
    drain::source::Source,
    error::Result,
    exit_status::ExitStatus,
    probe::Probes,
    profile::Profile,
    record::Recorder,
    reserve::{Tracker, ring::MemRing},
    symbolize::modules::Modules,
    symbolize::{Frame, Symbolizer},
    targets::{exit_watch::ExitWatch, launch, procfs},
    view::summary,
    view::tui,
};

/// Why the main loop ended.
pub enum End {
    TargetExited,
    /// A signal ended the trace: the first for `-p` and `--all`, a second one for a launched
    /// command (the first is passed on to it).
    Signal(Sig),
    /// The live view was quit.
    Quit,
}

/// Everything a trace holds between rounds. `cmd::trace` builds it once the probes are attached, and
/// takes it apart at the end.
pub struct Daemon {
    pub maps: Box<dyn Source>,
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
    /// A seized `-p` tree's holds: its new images, held at their start.
    tree: Option<crate::targets::seized::Holds>,
    /// How the target ended, when known (always for a launched command).
    pub exit: Option<ExitStatus>,
    /// The first signal heaptrace got while its launched command runs, which it then waits
    /// for.
    pub relay: Option<Relay>,
    /// The launched command was let go of: it took signals faster than its tracer could
    /// stop it for each.
    pub released: Option<Released>,
    /// A process tree traced (`probe::Scope::Tree`): its processes, `pid` its root.
    pub followed: Option<crate::probe::follow::Followed>,
    /// The root of a tree ended and others of it run on: the trace ends with the last.
    pub root_ended: bool,
    /// How a `-p` target ends, from the kernel's process events.
    pub exit_watch: Option<ExitWatch>,
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
    /// When each stored stack was last counted: those idle are freed (`drain::idle`).
    pub idle: crate::drain::idle::IdleStacks,
    /// Processes that had the pid of one gone before: the figures' process keys.
    pub incarnations: crate::profile::incarnation::Incarnations,
    /// Ended processes kept one by one (`--keep-exited`); older ones are folded.
    pub keep_exited: usize,
    pub exited_kept: crate::profile::exited::Kept,
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
    /// OOM killer victims reported and not yet handled (`oom::killed`), and every one seen.
    pub oom_pending: Vec<u32>,
    pub oom_victims: HashSet<u32>,
    /// `--oom-dir`: where each victim's report goes.
    pub oom_reports: Option<OomReports>,
    /// `--serve`: where each round's snapshot goes, and what it says of the trace.
    pub serve: Option<crate::serve::Publisher>,
    pub start_unix_ms: u64,
    /// How long the last round took, and when rounds started.
    pub round_seconds: f64,
    pub gaps: round::RoundGaps,
}

/// A launched command let go of (`launch::Event::Released`): no longer held at its exit or
/// later execs, nor seen taking its signals.
#[derive(Clone, Copy, Debug)]
pub struct Released {
    /// Since the trace started.
    pub after_ms: u64,
    /// The signals it took a second, then.
    pub per_second: u32,
}

/// What a trace hands its daemon once the probes are attached; the rest starts empty.
pub struct Start {
    pub maps: Box<dyn Source>,
    /// None for `--in-process`.
    pub probes: Option<Probes>,
    pub profile: Profile,
    pub pid: Option<u32>,
    pub child: Option<launch::Child>,
    /// A seized `-p` tree's holds (`targets::seized`).
    pub tree: Option<crate::targets::seized::Holds>,
    /// How a `-p` target ends: opened before the attach, so an end right after it is heard.
    pub exit_watch: Option<ExitWatch>,
    pub followed: Option<crate::probe::follow::Followed>,
    pub modules: Modules,
    pub recorder: Option<Recorder>,
    pub procwatch: Option<ProcWatch>,
    pub memring: Option<MemRing>,
    pub live: Option<tui::Link>,
    pub filter: Option<Filter>,
    pub quiet: bool,
    pub stack_depth: usize,
    pub keep_exited: usize,
    pub oom_reports: Option<OomReports>,
    pub serve: Option<crate::serve::Publisher>,
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
            exit_watch: s.exit_watch,
            child: s.child,
            tree: s.tree,
            followed: s.followed,
            root_ended: false,
            exit: None,
            relay: None,
            released: None,
            probes: s.probes,
            execs: procwatch.as_mut().and_then(|w| w.events.take()),
            exec_first: None,
            procwatch,
            exited_leaks: BTreeMap::new(),
            same: Default::default(),
            freed: Default::default(),
            idle: Default::default(),
            incarnations: Default::default(),
            keep_exited: s.keep_exited,
            exited_kept: Default::default(),
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
            oom_pending: Vec::new(),
            oom_victims: HashSet::new(),
            oom_reports: s.oom_reports,
            serve: s.serve,
            start_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            round_seconds: 0.0,
            gaps: Default::default(),
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

/// How long after the start the target's mappings are read often: a short-lived command may
/// exit before the first round, and its stacks can only be resolved with mappings read while
/// it was alive.
const EARLY_MAPS: Duration = Duration::from_secs(2);
const EARLY_MAPS_EVERY: Duration = Duration::from_millis(20);
/// How often, once a tree's root ended, the trace looks whether the rest of it has.
const LAST_CHECK_EVERY: Duration = Duration::from_millis(20);
/// How often the site and size maps are looked at between rounds (`drain::relief`): two small
/// reads, and a retire when they are filling.
const RELIEF_EVERY: Duration = Duration::from_millis(100);

impl Daemon {
    pub async fn watch(&mut self, interval: Duration) -> Result<End> {
        // A launched command reports its end through its tracer; any other process, through a
        // pidfd (readable once it exits).
        let exited = match self.pid {
            Some(pid) if self.child.is_none() => {
                match procfs::pidfd_open(pid) {
                    // SAFETY: we own the pidfd and keep it open while it is registered.
                    Ok(fd) => Some(unsafe { AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)?),
                    // Gone already (it can end right after the attach): its calls are in the
                    // maps, and the final round reads them. A followed tree goes on with the
                    // processes it forked, if any still run.
                    Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                        self.exit = self.exit_watch.as_mut().and_then(ExitWatch::status);
                        if !self.root_ends_trace() {
                            return Ok(End::TargetExited);
                        }
                        None
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            _ => None,
        };
        let signals = signals::Signals::new()?;
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await; // the first tick is immediate
        let mut early = tokio::time::interval(EARLY_MAPS_EVERY);
        let mut retry = tokio::time::interval(crate::daemon::exec_watch::RETRY_EVERY);
        let mut last_check = tokio::time::interval(LAST_CHECK_EVERY);
        let mut relief = tokio::time::interval(RELIEF_EVERY);
        relief.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
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
                    if self.root_ended && !self.others_alive() {
                        return Ok(End::TargetExited);
                    }
                    self.gaps.tick(interval);
                    self.round()?;
                    self.maps.purge_inflight(&procfs::thread_alive)?;
                    if let Some(w) = self.exit_watch.as_mut() {
                        w.drain();
                    }
                }
                _ = target_exit(exited.as_ref()), if !self.root_ended => {
                    self.exit = self.exit_watch.as_mut().and_then(ExitWatch::status);
                    if !self.root_ends_trace() {
                        return Ok(End::TargetExited);
                    }
                }
                ev = child_event(self.child.as_mut()), if !self.root_ended => {
                    if self.child_event(ev)? && !self.root_ends_trace() {
                        return Ok(End::TargetExited);
                    }
                }
                ev = tree_event(self.tree.as_mut()) => self.tree_event(ev)?,
                _ = relief.tick() => {
                    self.maps.relieve()?;
                }
                _ = readable(self.procwatch.as_ref().and_then(|w| w.early_ready.as_ref())) => {
                    if let Some(w) = self.procwatch.as_ref() {
                        w.early_taken();
                    }
                    self.early_maps_if_any();
                }
                _ = last_check.tick(), if self.root_ended => {
                    if !self.others_alive() {
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
                got = signals.recv() => {
                    if let Some(end) = self.on_signal(got) {
                        return Ok(end);
                    }
                }
                _ = relay::due(self.relay.as_ref()) => self.relay_due(),
            }
        }
    }

    /// The root of a followed tree ended: true if the trace goes on (others of the tree run),
    /// false if it ends now.
    fn root_ends_trace(&mut self) -> bool {
        self.root_ended = self.others_alive();
        self.root_ended
    }

    /// Whether a followed process other than the root still runs (after their forks the
    /// kernel reported, which come through the process events).
    fn others_alive(&mut self) -> bool {
        self.process_events();
        match (&mut self.followed, self.pid) {
            (Some(f), Some(root)) => f.others_alive(root),
            _ => false,
        }
    }

    /// Hands the live view and the server a copy of the Profile; it never waits for either.
    pub fn publish(&mut self, ended: Option<String>, exit_code: Option<i32>) {
        if let Some(serve) = self
            .serve
            .as_ref()
            .filter(|s| ended.is_some() || s.wanted())
        {
            serve.publish(crate::serve::Snapshot {
                profile: crate::serve::snapshot::running(&self.profile),
                rounds: self.profile.round_count(),
                start_unix_ms: self.start_unix_ms,
                elapsed_ms: self.start.elapsed().as_millis() as u64,
                round_seconds: self.round_seconds,
                rounds_late: self.gaps.late,
                round_gap_max_seconds: self.gaps.max_gap,
                ended: ended.is_some(),
            });
        }
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
        let signals = signals::Signals::new()?;
        tokio::select! {
            _ = view_quit(self.live.as_mut()) => {}
            got = signals.recv() => {
                if got.sig == Sig::Hup {
                    signals::leave_hung_up_terminal();
                }
            }
        }
        Ok(())
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

async fn tree_event(tree: Option<&mut crate::targets::seized::Holds>) -> Option<launch::Event> {
    match tree {
        Some(t) => t.events.recv().await,
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
