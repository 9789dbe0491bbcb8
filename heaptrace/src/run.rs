//! The daemon: pick the target, attach, drain a round every interval until the target exits or
//! we are told to stop, then detach and print what was seen.
use std::{
    collections::HashSet,
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
    aggregate::Profile,
    allocator::{self, Provider},
    cli::Cli,
    drain::KernelMaps,
    error::{Error, Result},
    json, launch,
    model::Snapshot,
    modules::Modules,
    probe::{self, LoadOptions, Probes, Scope},
    procfs, report,
    symbolize::Symbolizer,
    tui,
};

enum Target {
    Pid(u32),
    All,
    Command(Vec<String>),
}

impl Target {
    fn from_cli(cli: &Cli) -> Result<Target> {
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

pub fn run(cli: Cli) -> Result<i32> {
    let target = Target::from_cli(&cli)?;
    probe::preflight()?;
    let live_view = !cli.no_tui && tui::wanted();
    let opts = LoadOptions {
        mode: cli.mode.kernel(),
        temporary_ns: cli.temporary.unwrap_or(cli.interval).as_nanos() as u64,
        live_map_size: cli.live_map_size,
        size_map_size: cli.size_map_size,
        stack_map_size: cli.stack_map_size,
        site_map_size: cli.site_map_size,
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
            (allocator::for_pid(*pid)?, Scope::Process(*pid))
        }
        Target::All => (allocator::host_libc()?, Scope::All),
        Target::Command(argv) => {
            let exe = allocator::resolve_command(&argv[0]).ok_or_else(|| Error::Exec {
                cmd: argv[0].clone(),
                reason: "command not found".into(),
            })?;
            let preload = std::env::var("LD_PRELOAD").ok();
            let provider = allocator::for_command(&exe, preload.as_deref())?;
            // With the live view on the terminal, the command's output would scribble over it.
            let redirect = match (&cli.output, live_view) {
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

    let attached = probe::load(&opts).and_then(|ebpf| Probes::attach(ebpf, &provider, scope));
    let mut probes = match attached {
        Ok(p) => p,
        Err(e) => {
            if let Some(child) = stopped {
                child.abort();
            }
            return Err(e);
        }
    };
    let maps = KernelMaps::take(&mut probes.ebpf)?;
    let what = match scope {
        Scope::All => "all processes".to_string(),
        Scope::Process(pid) => format!("pid {pid}"),
    };
    eprintln!(
        "heaptrace: attached {} probes to {} ({what})",
        probes.probe_count(),
        provider.path.display()
    );
    if cli.verbose {
        for a in &probes.attached {
            eprintln!(
                "heaptrace:   {}{} at {:#x}{}",
                a.func,
                if a.aliases.is_empty() {
                    String::new()
                } else {
                    format!(" (= {})", a.aliases.join(", "))
                },
                a.offset,
                if a.uretprobe { " + return" } else { "" }
            );
        }
    }

    let pid = match (stopped, scope) {
        (Some(child), _) => Some(child.resume()?),
        (None, Scope::Process(pid)) => Some(pid),
        (None, Scope::All) => None,
    };

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
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
            output: match (&target, &cli.output) {
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
        profile: Profile::default(),
        start: Instant::now(),
        pid,
        quiet: cli.quiet,
        modules,
        stack_depth: cli.stack_depth as usize,
        symbolizer: Symbolizer::default(),
        live: link,
        cpu: CpuMeter::default(),
    };
    let end = rt.block_on(daemon.watch(cli.interval))?;

    // Exit status of a launched command: it may still be finishing after a signal.
    let exit_code = match (&target, pid) {
        (Target::Command(_), Some(pid)) => Some(rt.block_on(child_exit(pid, &end))),
        _ => None,
    };

    // Detach first so the final read is of a state nothing changes any more.
    let attached_list = probes.attached.clone();
    drop(probes);
    daemon.round()?;
    let pids: Option<HashSet<u32>> = pid.map(|p| HashSet::from([p]));
    daemon.profile.leaks = Some(daemon.maps.live_blocks(pids.as_ref())?);

    // The live view stays up on the final figures after the target exited, until quit.
    let reason = end_reason(&end, pid, exit_code);
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
        let doc = serde_json::to_string_pretty(&json::document(profile, &info))
            .map_err(|e| Error::Io(std::io::Error::other(e)))?;
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

/// Waits for a launched command to end after a signal (a terminal's Ctrl-C reaches it too;
/// SIGTERM is passed on), a short while at most.
/// Quitting the live view interrupts the command as Ctrl-C would without it, and kills it if
/// it is still there after that while.
async fn child_exit(pid: u32, end: &End) -> i32 {
    let sig = match end {
        End::Terminated => Some(libc::SIGTERM),
        End::Quit => Some(libc::SIGINT),
        _ => None,
    };
    if let Some(sig) = sig {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(pid as i32, sig) };
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        if let Some(code) = launch::try_wait(pid) {
            return code;
        }
        if Instant::now() >= deadline {
            if let End::Quit = end {
                // SAFETY: killing and reaping our own child.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                let mut status = 0;
                unsafe { libc::waitpid(pid as i32, &mut status, 0) };
                return 128 + libc::SIGKILL;
            }
            return match end {
                End::Terminated => 128 + libc::SIGTERM,
                _ => 128 + libc::SIGINT,
            };
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
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
    /// The live view's channels, when it is up.
    live: Option<tui::Link>,
    cpu: CpuMeter,
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

/// How long after the start the target's mappings are read often: a short-lived command may
/// exit before the first round, and its stacks can only be resolved with mappings read while
/// it was alive.
const EARLY_MAPS: Duration = Duration::from_secs(2);
const EARLY_MAPS_EVERY: Duration = Duration::from_millis(20);

impl Daemon {
    async fn watch(&mut self, interval: Duration) -> Result<End> {
        let exited = match self.pid {
            Some(pid) => {
                let fd = procfs::pidfd_open(pid)?;
                // SAFETY: we own the pidfd and keep it open while it is registered.
                Some(unsafe { AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)?)
            }
            None => None,
        };
        let mut sigint = signal(SignalKind::interrupt())?;
        let mut sigterm = signal(SignalKind::terminate())?;
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await; // the first tick is immediate
        let mut early = tokio::time::interval(EARLY_MAPS_EVERY);
        loop {
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
                _ = view_quit(self.live.as_mut()) => return Ok(End::Quit),
                _ = sigint.recv() => return Ok(End::Interrupted),
                _ = sigterm.recv() => return Ok(End::Terminated),
            }
        }
    }

    fn round(&mut self) -> Result<()> {
        let snap = self.maps.snapshot()?;
        let mut round = snap.since(&self.prev);
        self.new_stacks(&mut round);
        round.index = self.profile.rounds.len() as u64 + 1;
        round.elapsed_ms = self.start.elapsed().as_millis() as u64;
        let pids: Vec<u32> = match self.pid {
            Some(p) => vec![p],
            None => snap.procs.keys().copied().collect(),
        };
        for p in pids {
            if procfs::alive(p)
                && let Some(m) = procfs::mem(p)
            {
                round.mem.insert(p, m);
            }
        }
        self.profile.apply(&round);
        if !self.quiet
            && self.live.is_none()
            && let Some(row) = self.profile.rounds.last()
        {
            eprintln!("heaptrace: {}", report::round_line(row));
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
    /// Symbolizes the stacks first seen this round, while their processes are (maybe) alive.
    fn new_stacks(&mut self, round: &mut crate::model::Round) {
        let new: Vec<(u32, i32)> = round
            .sites
            .keys()
            .filter(|(_, id, _)| *id >= 0)
            .map(|(pid, id, _)| (*pid, *id))
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
            let frames = self.symbolizer.stack(&self.modules, pid, &ips);
            round
                .stacks
                .insert((pid, id), crate::model::NewStack { ips, frames });
        }
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
