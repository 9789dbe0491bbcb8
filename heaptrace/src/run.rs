//! The daemon: pick the target, attach, drain a round every interval until the target exits or
//! we are told to stop, then detach and print what was seen.
use std::{
    collections::{BTreeMap, HashSet},
    io::Write as _,
    os::fd::OwnedFd,
    time::{Duration, Instant},
};

use heaptrace_common::Func;
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{SignalKind, signal},
};

use crate::{
    aggregate::{Leak, Profile},
    allocator::{self, Provider},
    cli::TraceArgs,
    drain::KernelMaps,
    error::{Error, Result},
    json, launch,
    model::{SiteId, Snapshot},
    modules::Modules,
    probe::{self, LoadOptions, Probes, Scope},
    procfs, progstats,
    record::{Header, Recorder, format::EndRec},
    report,
    reserve::{Tracker, ring::MemRing},
    symbolize::Symbolizer,
    tui,
    watch::ProcWatch,
};

enum Target {
    Pid(u32),
    All,
    Command(Vec<String>),
}

impl Target {
    fn from_cli(cli: &TraceArgs) -> Result<Target> {
        match (cli.pid, cli.all, cli.command.is_empty()) {
            (Some(pid), _, _) => Ok(Target::Pid(pid)),
            (None, true, _) => Ok(Target::All),
            (None, false, false) => Ok(Target::Command(cli.command.clone())),
            (None, false, true) => Err(Error::Exec {
                cmd: "nothing".into(),
                reason: "give a target: -p PID, --all or -- COMMAND [ARGS]".into(),
            }),
        }
    }

    fn mode(&self) -> &'static str {
        match self {
            Target::Pid(_) => "pid",
            Target::All => "all",
            Target::Command(_) => "command",
        }
    }
}

/// Why the main loop ended.
enum End {
    TargetExited,
    Interrupted,
    Terminated,
    /// The live view was quit.
    Quit,
}

pub fn run(cli: &TraceArgs, record: Option<&std::path::Path>) -> Result<i32> {
    let target = Target::from_cli(cli)?;
    if cli.sample_bytes > 0 && cli.mode != crate::cli::Mode::Stacks {
        return Err(Error::Usage(
            "--sample-bytes samples stacks: it needs --mode stacks (counts and sizes are exact \
             and cheap already)"
                .into(),
        ));
    }
    probe::preflight()?;
    let live_view = !cli.no_tui && tui::wanted();
    let opts = LoadOptions {
        mode: cli.mode.kernel(),
        temporary_ns: cli.temporary.unwrap_or(cli.interval).as_nanos() as u64,
        live_map_size: cli.live_map_size,
        size_map_size: cli.size_map_size,
        inflight_map_size: cli.inflight_map_size,
        stack_map_size: cli.stack_map_size,
        site_map_size: cli
            .site_map_size
            .unwrap_or_else(probe::default_site_map_size),
        sample_bytes: cli.sample_bytes,
        calls: cli.mode.at_entry(),
        bare_stack: cli.mode == crate::cli::Mode::Bare,
        ..LoadOptions::default()
    };

    // Find the target and its allocator; a launched command waits, stopped, until attached.
    let mut stopped = None;
    let (provider, scope) = match &target {
        Target::Pid(pid) => {
            if *pid == std::process::id() {
                return Err(Error::SelfTarget(*pid));
            }
            if !procfs::alive(*pid) {
                return Err(Error::NoSuchProcess(*pid));
            }
            let provider = match &cli.allocator_symbols {
                Some(c) => allocator::custom_for_pid(*pid, c)?,
                None => allocator::for_pid(*pid)?,
            };
            (provider, Scope::Process(*pid))
        }
        Target::All => (allocator::host_libc()?, Scope::All),
        Target::Command(argv) => {
            let exe = allocator::resolve_command(&argv[0]).ok_or_else(|| Error::Exec {
                cmd: argv[0].clone(),
                reason: "command not found".into(),
            })?;
            let preload = std::env::var("LD_PRELOAD").ok();
            let provider = match &cli.allocator_symbols {
                Some(c) => allocator::custom_for_command(&exe, preload.as_deref(), c)?,
                None => allocator::for_command(&exe, preload.as_deref())?,
            };
            // With the live view on the terminal, the command's output would scribble over it.
            let redirect = match (&cli.command_output, live_view) {
                (Some(path), _) => Some(launch::Redirect::to(path)?),
                (None, true) => Some(launch::Redirect::to(std::path::Path::new("/dev/null"))?),
                (None, false) => None,
            };
            let child = launch::spawn_stopped(&exe, argv, redirect.as_ref())?;
            let scope = Scope::Process(child.pid);
            stopped = Some(child);
            (provider, scope)
        }
    };

    // Before any probe fires, so that every run is counted.
    let stats_fd = match cli.probe_stats.then(progstats::enable).transpose() {
        Ok(fd) => fd,
        Err(e) => {
            if let Some(child) = stopped {
                child.abort();
            }
            return Err(Error::Load(format!("BPF run-time statistics: {e}")));
        }
    };
    // The memory behind malloc; not part of the bare benchmark floor. Calls mode does not see
    // malloc's calls end, so it could not tell which call made a mapping.
    let reservations = cli.mode.traces_reservations() && !cli.no_reservations;
    let attached = probe::load(&opts).and_then(|ebpf| {
        let mut probes = Probes::new(
            ebpf,
            !cli.perf_uprobes,
            opts.calls,
            reservations && !cli.syscall_tracepoints,
        )?;
        probes.attach(&provider, scope, cli.probe_at_entry)?;
        if let Scope::Process(pid) = scope
            && !probes.syscalls_probed()
        {
            // The allocator is another file; the memory syscalls still go through libc's
            // wrappers. A command not started yet maps heaptrace's own libc, the one it will
            // run on (as `allocator::for_command` assumes).
            if let Some((shown, path)) = allocator::libc_of(pid)? {
                probes.attach_syscalls_in(&shown, &path, scope);
            }
        }
        Ok(probes)
    });
    let mut probes = match attached {
        Ok(p) => p,
        Err(e) => {
            if let Some(child) = stopped {
                child.abort();
            }
            return Err(e);
        }
    };
    let maps = KernelMaps::take(&mut probes.ebpf, probe::stack_maps(&opts).1)?;
    let what = match scope {
        Scope::All => "all processes".to_string(),
        Scope::Process(pid) => format!("pid {pid}"),
    };
    let first = probes.probe_count();

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // The process watch registers its ring buffer with this runtime's reactor.
    let _in_runtime = rt.enter();
    // System-wide: follow processes that start later (their allocator may be another file) and
    // those that end; look at the ones already running the same way.
    let procwatch = match scope {
        Scope::All => {
            let mut w = ProcWatch::start(&mut probes, &provider, cli.probe_at_entry)?;
            w.scan(&mut probes);
            Some(w)
        }
        Scope::Process(_) => None,
    };
    let memring = if !reservations {
        None
    } else {
        match MemRing::start(&mut probes) {
            Ok(r) => Some(r),
            Err(e) => {
                eprintln!("heaptrace: warning: memory syscalls not traced: {e}");
                None
            }
        }
    };

    // Said once everything is in place (the scan of running processes included): tests and
    // scripts start their targets on this line.
    eprintln!(
        "heaptrace: attached {first} probes to {} ({what})",
        provider.path.display()
    );
    if cli.verbose {
        for a in &probes.attached {
            let p = &a.placement;
            eprintln!(
                "heaptrace:   {}{} at {:#x}+{} `{}`{}: {}",
                if a.symbol == a.func {
                    a.func.to_string()
                } else {
                    format!("{} ({})", a.symbol, a.func)
                },
                if a.aliases.is_empty() {
                    String::new()
                } else {
                    format!(" (= {})", a.aliases.join(", "))
                },
                a.offset,
                p.offset,
                p.instruction,
                if a.uretprobe { " + return" } else { "" },
                p.why
            );
        }
        for (path, sites) in &probes.syscall_sites {
            for s in sites {
                let p = &s.placement;
                eprintln!(
                    "heaptrace:   {} in {} at {:#x}+{} `{}`: {}",
                    s.name,
                    path.display(),
                    s.file_offset,
                    p.offset,
                    p.instruction,
                    p.why
                );
            }
        }
    }

    let (pid, child) = match (stopped, scope) {
        (Some(stopped), _) => {
            let child = stopped.resume()?;
            (Some(child.pid), Some(child))
        }
        (None, Scope::Process(pid)) => (Some(pid), None),
        (None, Scope::All) => (None, None),
    };

    let recorder = match record {
        Some(path) => {
            let header = record_header(cli, &target, pid, &provider, opts.temporary_ns);
            let r = Recorder::create(path, &header).map_err(|e| Error::Read {
                path: path.to_path_buf(),
                source: e,
            })?;
            eprintln!("heaptrace: recording to {}", path.display());
            Some(r)
        }
        None => None,
    };

    let mut modules = Modules::default();
    if let (Target::Command(_), Some(pid)) = (&target, pid) {
        modules.settle(pid, &provider.path, Duration::from_millis(200));
    }
    let aliases = aliases(&provider);
    let temporary_ms = opts.temporary_ns / 1_000_000;
    let (view, link) = if live_view {
        let info = tui::Info {
            target: match &target {
                Target::Pid(p) => format!(
                    "pid {p} ({})",
                    procfs::comm(*p).unwrap_or_else(|| "?".into())
                ),
                Target::All => "all processes".into(),
                Target::Command(argv) => format!("{} (pid {})", argv.join(" "), pid.unwrap_or(0)),
            },
            mode: target.mode(),
            collect: cli.mode.name(),
            interval_ms: cli.interval.as_millis() as u64,
            provider: provider.path.display().to_string(),
            pids: pid.into_iter().collect(),
            command: match &target {
                Target::Command(argv) => argv.clone(),
                _ => Vec::new(),
            },
            attached: probes.attached.clone(),
            aliases: aliases.clone(),
            temporary_ms,
            output: match (&target, &cli.command_output) {
                (Target::Command(_), Some(p)) => Some(p.display().to_string()),
                (Target::Command(_), None) => Some("/dev/null".into()),
                _ => None,
            },
        };
        match tui::Tui::start(info, tui::Published::default()) {
            Ok((view, link)) => (Some(view), Some(link)),
            Err(e) => {
                eprintln!("heaptrace: cannot open the live view ({e}); printing rounds instead");
                (None, None)
            }
        }
    } else {
        (None, None)
    };
    let mut daemon = Daemon {
        maps,
        prev: Snapshot::default(),
        profile: Profile::of_mode(cli.mode.name(), cli.sample_bytes),
        start: Instant::now(),
        pid,
        quiet: cli.quiet,
        modules,
        stack_depth: cli.stack_depth as usize,
        symbolizer: Symbolizer::default(),
        recorder,
        child,
        exit_code: None,
        probes: Some(probes),
        procwatch,
        exited_leaks: BTreeMap::new(),
        stale: HashSet::new(),
        filter: Filter::from_cli(cli),
        matched: std::collections::HashMap::new(),
        live: link,
        cpu: CpuMeter::default(),
        memring,
        reserves: Tracker::default(),
        reserves_lost: 0,
    };
    let end = rt.block_on(daemon.watch(cli.interval))?;

    // Exit status of a launched command: it may still be finishing after a signal.
    let exit_code = match &target {
        Target::Command(_) => Some(rt.block_on(daemon.child_exit(&end))?),
        _ => None,
    };

    // Detach first so the final read is of a state nothing changes any more.
    let probes = daemon.probes.take().expect("probes");
    let attached_list = probes.attached.clone();
    let syscall_probes: Vec<serde_json::Value> = probes
        .syscall_sites
        .iter()
        .flat_map(|(path, sites)| {
            sites.iter().map(move |s| {
                serde_json::json!({
                    "name": s.name,
                    "path": path,
                    "offset": s.file_offset,
                    "begin_probe": s.releases(),
                    "placement": s.placement,
                })
            })
        })
        .collect();
    let prog_stats = stats_fd.map(|fd| {
        let stats = probes.program_stats();
        drop(fd);
        stats
    });
    drop(probes);
    daemon.round()?;
    let pids: Option<HashSet<u32>> = pid.map(|p| HashSet::from([p]));
    if daemon.procwatch.is_some() {
        for (p, pp) in daemon.profile.procs.iter_mut() {
            if !procfs::alive(*p) {
                pp.exited = true;
            }
        }
    }
    let mut leaks = daemon.maps.live_blocks(pids.as_ref())?;
    leaks.append(&mut daemon.exited_leaks);
    daemon.profile.set_leaks(leaks);

    let reason = end_reason(&end, pid, exit_code);
    if let Some(r) = daemon.recorder.take() {
        let end = EndRec {
            elapsed_ms: daemon.start.elapsed().as_millis() as u64,
            exit_code,
            reason: reason.clone(),
        };
        match r.finish(daemon.profile.leaks.as_ref(), &end) {
            Ok(bytes) => eprintln!(
                "heaptrace: recorded {} rounds, {}",
                daemon.profile.round_count(),
                report::bytes(bytes as i64)
            ),
            Err(e) => eprintln!("heaptrace: warning: finishing the recording: {e}"),
        }
    }
    // The live view stays up on the final figures after the target exited, until quit.
    if daemon.live.is_some() && matches!(end, End::TargetExited) {
        daemon.publish(Some(reason.clone()), exit_code);
        rt.block_on(daemon.until_quit())?;
    }
    let view_error = view.map(|v| v.close()).and_then(|r| r.err());

    let profile = &daemon.profile;
    eprintln!("heaptrace: {reason}");
    eprint!("{}", report::summary(profile, pid, &aliases));
    if pid.is_none() {
        eprint!("{}", report::processes(profile, 20));
    }
    if cli.mode == crate::cli::Mode::Stacks {
        eprint!("{}", crate::views::sites(profile, cli.top, temporary_ms));
    }
    eprint!("{}", crate::views::latency(profile));
    if let Some(stats) = &prog_stats {
        eprint!("{}", progstats::text(stats));
    }
    // What tracing cost in memory, read once everything is gathered: the kernel maps are
    // bounded by their sizes, this is the daemon's side (profile, stacks, symbols).
    let own = procfs::own_rss_kb();
    if let Some((rss, peak)) = own {
        eprintln!(
            "heaptrace itself: RSS {}, peak {}",
            report::bytes(rss as i64 * 1024),
            report::bytes(peak as i64 * 1024)
        );
    }
    eprint!("{}", report::memory(profile, 10));
    if let Some(path) = &cli.json {
        let pids: Vec<u32> = pid.into_iter().collect();
        let info = json::RunInfo {
            mode: target.mode(),
            pids: &pids,
            command: match &target {
                Target::Command(argv) => argv,
                _ => &[],
            },
            exit_code,
            interval_ms: cli.interval.as_millis() as u64,
            provider: &provider.path.display().to_string(),
            probes: &attached_list,
            aliases: &aliases,
            collect: cli.mode.name(),
            temporary_ms,
        };
        let mut doc = json::document(profile, &info);
        if let Some((rss, peak)) = own {
            doc["heaptrace"]["rss_kb"] = rss.into();
            doc["heaptrace"]["peak_rss_kb"] = peak.into();
        }
        doc["provider"]["syscall_probes"] = syscall_probes.into();
        if let Some(stats) = &prog_stats {
            doc["heaptrace"]["programs"] =
                serde_json::to_value(stats).map_err(|e| Error::Io(std::io::Error::other(e)))?;
        }
        let doc =
            serde_json::to_string_pretty(&doc).map_err(|e| Error::Io(std::io::Error::other(e)))?;
        if path == "-" {
            let mut out = std::io::stdout().lock();
            writeln!(out, "{doc}")?;
        } else {
            std::fs::write(path, doc + "\n")?;
        }
    }
    if let Some(e) = view_error {
        return Err(Error::Io(std::io::Error::other(e)));
    }
    Ok(exit_code.unwrap_or(0))
}

fn first_line(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

fn record_header(
    cli: &TraceArgs,
    target: &Target,
    pid: Option<u32>,
    provider: &Provider,
    temporary_ns: u64,
) -> Header {
    let cmdlines = pid
        .into_iter()
        .map(|p| {
            let raw = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            let line = raw
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect::<Vec<_>>()
                .join(" ");
            (p, line)
        })
        .collect();
    Header {
        heaptrace_version: env!("CARGO_PKG_VERSION").into(),
        host: first_line("/proc/sys/kernel/hostname"),
        kernel: first_line("/proc/sys/kernel/osrelease"),
        start_unix_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0),
        interval_ms: cli.interval.as_millis() as u64,
        mode: cli.mode.name().into(),
        target_mode: target.mode().into(),
        pids: pid.into_iter().collect(),
        command: match target {
            Target::Command(argv) => argv.clone(),
            _ => Vec::new(),
        },
        provider: provider.path.display().to_string(),
        temporary_ms: temporary_ns / 1_000_000,
        cmdlines,
        aliases: aliases(provider)
            .iter()
            .map(|(a, of)| (a.name().to_string(), of.name().to_string()))
            .collect(),
        sample_bytes: cli.sample_bytes,
    }
}

/// (alias, probed as): family members defined at the address of another one.
fn aliases(provider: &Provider) -> Vec<(Func, Func)> {
    provider
        .sites
        .iter()
        .flat_map(|s| s.aliases.iter().map(move |a| (*a, s.func)))
        .collect()
}

fn end_reason(end: &End, pid: Option<u32>, exit_code: Option<i32>) -> String {
    match (end, pid, exit_code) {
        (End::TargetExited, Some(pid), Some(code)) => {
            format!("pid {pid} exited with status {code}")
        }
        (End::TargetExited, Some(pid), None) => format!("pid {pid} exited"),
        (End::Interrupted, _, _) => "interrupted; detached".into(),
        (End::Quit, Some(pid), Some(code)) => {
            format!("quit; detached; pid {pid} ended with status {code}")
        }
        (End::Quit, _, _) => "quit; detached".into(),
        (End::Terminated, _, _) => "terminated; detached".into(),
        (End::TargetExited, None, _) => "stopped".into(),
    }
}

struct Daemon {
    maps: KernelMaps,
    prev: Snapshot,
    profile: Profile,
    start: Instant,
    /// The one traced process, or None for all.
    pid: Option<u32>,
    quiet: bool,
    modules: Modules,
    stack_depth: usize,
    symbolizer: Symbolizer,
    recorder: Option<Recorder>,
    /// A launched command, held at its exit by its tracer thread.
    child: Option<launch::Child>,
    exit_code: Option<i32>,
    /// Detached (dropped) before the final round.
    probes: Option<Probes>,
    /// System-wide mode: process starts and exits.
    procwatch: Option<ProcWatch>,
    /// Blocks that processes ended without freeing, taken out of the live map when they ended.
    exited_leaks: BTreeMap<SiteId, Leak>,
    /// Processes that exec'ed since the last round: what their earlier images left in the
    /// kernel maps is dropped once a round (a walk of the live map each time would be too
    /// much for a host that runs many commands); until then their epoch keeps it out.
    stale: HashSet<u32>,
    /// --comm/--cgroup, and each process's verdict, taken while it lived.
    filter: Option<Filter>,
    matched: std::collections::HashMap<u32, bool>,
    /// The live view's channels, when it is up.
    live: Option<tui::Link>,
    cpu: CpuMeter,
    /// Memory syscalls of traced processes, and what they tell about reserved memory.
    memring: Option<MemRing>,
    reserves: Tracker,
    /// `reserves.lost` already reported in a round.
    reserves_lost: u64,
}

/// heaptrace's own CPU use between two reads, from /proc/self/stat.
#[derive(Default)]
struct CpuMeter {
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

/// `--comm` / `--cgroup`: which processes a system-wide trace reports. The probes see them all;
/// the rounds keep only the matching ones, so every view agrees.
struct Filter {
    comm: Option<String>,
    cgroup: Option<String>,
}

impl Filter {
    fn from_cli(cli: &TraceArgs) -> Option<Filter> {
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
        round: &mut crate::model::Round,
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
    async fn watch(&mut self, interval: Duration) -> Result<End> {
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
        let mut retry = tokio::time::interval(crate::watch::RETRY_EVERY);
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
                _ = logs_readable(self.procwatch.as_ref()) => {
                    if let Some(w) = self.procwatch.as_mut() {
                        w.flush_logs();
                    }
                }
                _ = mem_readable(self.memring.as_ref()) => self.drain_mem(),
                _ = ring_readable(self.procwatch.as_ref()) => self.process_events(),
                _ = view_quit(self.live.as_mut()) => return Ok(End::Quit),
                _ = sigint.recv() => return Ok(End::Interrupted),
                _ = sigterm.recv() => return Ok(End::Terminated),
            }
        }
    }

    /// Processes that ended before the round just applied, so their final counts are in it:
    /// keep their leaks and free their map space.
    fn forget_exited(&mut self, mut gone: HashSet<u32>) -> Result<()> {
        gone.retain(|p| self.profile.procs.get(p).is_none_or(|pp| !pp.exited));
        if gone.is_empty() {
            return Ok(());
        }
        let mut leaks = self.maps.forget(&gone)?;
        if let Some(w) = self.procwatch.as_mut() {
            w.seen.retain(|p, _| !gone.contains(p));
        }
        self.exited_leaks.append(&mut leaks);
        for p in &gone {
            self.reserves.forget(*p);
            if let Some(pp) = self.profile.procs.get_mut(p) {
                pp.exited = true;
                pp.leaks_at_exit = true;
            }
        }
        Ok(())
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
            Some(launch::Event::Exited(code)) => {
                self.exit_code = Some(code);
                Ok(true)
            }
            None => Ok(true),
        }
    }

    /// A launched command's exit status. After a signal it may still be finishing (a
    /// terminal's Ctrl-C reaches it too; SIGTERM is passed on): wait a short while at most.
    async fn child_exit(&mut self, end: &End) -> Result<i32> {
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
        if let Some(w) = self.procwatch.as_mut() {
            let execs = w.drain(self.probes.as_mut());
            self.restart(execs);
        }
    }

    /// Processes that exec'ed: the kernel reset their counters at the exec, so their figures
    /// are now those of the new command alone. What the image before the exec did (a shell's
    /// fork between fork and exec) is dropped from every figure: it belonged to neither the
    /// parent nor the new command.
    fn restart(&mut self, execs: Vec<u32>) {
        // The kernel moves a process's epoch on only when it had counters: only those have
        // anything to drop.
        let pids: HashSet<u32> = execs
            .into_iter()
            .filter(|p| {
                self.prev.procs.contains_key(p)
                    || self.profile.procs.get(p).is_some_and(|pp| !pp.exited)
                    || self.maps.has_restarted(*p)
            })
            .collect();
        if pids.is_empty() {
            return;
        }
        for p in &pids {
            self.prev.procs.remove(p);
            self.profile.restart(*p);
            // exec replaced its mappings: the new image's allocator starts from nothing.
            self.reserves.forget(*p);
            // Judged again under its new name.
            self.matched.remove(p);
        }
        self.prev.sizes.retain(|k, _| !pids.contains(&k.0));
        self.prev.sites.retain(|k, _| !pids.contains(&k.0));
        self.stale.extend(pids);
    }

    fn round(&mut self) -> Result<()> {
        // Execs reported so far are applied before the read, so that it starts their new
        // counts from zero.
        self.process_events();
        if !self.stale.is_empty() {
            let stale = std::mem::take(&mut self.stale);
            self.maps.restarted(&stale)?;
        }
        // Who is gone is decided before the snapshot, so that it holds their final counts (a
        // process found gone after it could still have counted something in between).
        let gone: HashSet<u32> = if self.procwatch.is_some() {
            self.prev
                .procs
                .keys()
                .copied()
                .filter(|p| !procfs::alive(*p))
                .collect()
        } else {
            HashSet::new()
        };
        self.drain_mem();
        let snap = self.maps.snapshot()?;
        let mut round = snap.since(&self.prev);
        round.reservations = self.reserves.take();
        round.index = self.profile.rounds.last().map_or(0, |r| r.index) + 1;
        round.elapsed_ms = self.start.elapsed().as_millis() as u64;
        let pids: Vec<u32> = match self.pid {
            Some(p) => vec![p],
            None => snap.procs.keys().copied().collect(),
        };
        // Processes gone already: named as they were seen starting.
        if let Some(w) = &self.procwatch {
            for (p, pr) in round.procs.iter_mut() {
                if let Some((comm, cgroup)) = w.seen.get(p) {
                    pr.comm.clone_from(comm);
                    pr.cgroup.clone_from(cgroup);
                }
            }
        }
        for p in pids {
            if procfs::alive(p)
                && let Some(m) = procfs::mem(p)
            {
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
                // The kernel names a process at its first allocation, which may be before
                // its exec (a shell's fork): the current name wins while it lives.
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
        let lost = self.reserves.lost - self.reserves_lost;
        round.losses[heaptrace_common::Loss::MemEvents as usize] += lost;
        self.reserves_lost = self.reserves.lost;
        if let Some(filter) = &self.filter {
            filter.apply(&mut round, &mut self.matched);
        }
        // After the filter: the stacks of processes left out are never symbolized (in --all,
        // those of every other program on the host, and their debug info would stay loaded).
        self.new_stacks(&mut round);
        self.profile.apply(&round);
        if !gone.is_empty() {
            self.forget_exited(gone)?;
        }
        if let Some(r) = &mut self.recorder
            && let Err(e) = r.round(&round)
        {
            // A full disk ends the recording, not the trace; what was written stays readable.
            eprintln!("heaptrace: warning: recording stopped: {e}");
            self.recorder = None;
        }
        if !self.quiet
            && self.live.is_none()
            && let Some(row) = self.profile.rounds.last()
        {
            eprintln!("heaptrace: {}", report::round_line(row, &self.profile));
        }
        self.prev = snap;
        self.publish(None, None);
        Ok(())
    }

    /// Hands the live view a copy of the Profile; it never waits for the view.
    fn publish(&mut self, ended: Option<String>, exit_code: Option<i32>) {
        if let Some(live) = &self.live {
            let cpu_percent = self.cpu.sample();
            live.publish(tui::Published {
                profile: self.profile.clone(),
                elapsed_ms: self.start.elapsed().as_millis() as u64,
                cpu_percent,
                ended,
                exit_code,
            });
        }
    }

    /// After the target exited: waits until the live view is quit, or a signal.
    async fn until_quit(&mut self) -> Result<()> {
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
        if let Some(r) = self.memring.as_mut() {
            for ev in r.drain() {
                self.reserves.event(&ev);
            }
        }
    }

    /// Symbolizes the stacks first seen this round, while their processes are (maybe) alive.
    fn new_stacks(&mut self, round: &mut crate::model::Round) {
        let new: Vec<(u32, i32)> = round
            .sites
            .keys()
            .map(|(pid, id, _)| (*pid, *id))
            .chain(round.reservations.keys().map(|(pid, _, id, _)| (*pid, *id)))
            .filter(|(_, id)| *id >= 0)
            .filter(|k| !self.profile.stacks.contains_key(k))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        let mut refreshed = HashSet::new();
        for (pid, id) in new {
            if refreshed.insert(pid) && procfs::alive(pid) {
                self.modules.refresh(pid);
            }
            let mut ips = self.maps.stack(id).unwrap_or_default();
            ips.truncate(self.stack_depth);
            let locations = Symbolizer::locations(&self.modules, pid, &ips);
            let frames = self.symbolizer.frames(&ips, &locations).into();
            round.stacks.insert(
                (pid, id),
                crate::model::NewStack {
                    ips,
                    locations,
                    frames,
                },
            );
        }
    }
}

async fn logs_readable(w: Option<&ProcWatch>) {
    match w.and_then(|w| w.logs.as_ref()) {
        Some(l) => {
            if let Ok(mut guard) = l.readable().await {
                guard.clear_ready();
            }
        }
        None => std::future::pending().await,
    }
}

async fn mem_readable(r: Option<&MemRing>) {
    match r {
        Some(r) => {
            if let Ok(mut guard) = r.ring.readable().await {
                guard.clear_ready();
            }
        }
        None => std::future::pending().await,
    }
}

async fn ring_readable(w: Option<&ProcWatch>) {
    match w {
        Some(w) => {
            if let Ok(mut guard) = w.ring.readable().await {
                guard.clear_ready();
            }
        }
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
