//! A trace from start to end: pick the target, load and attach, start the daemon (`daemon`:
//! a round every interval until the target exits or we are told to stop), then detach, take
//! the last round and the leaks, and print, write and record what was seen.
use std::{
    collections::{BTreeMap, HashSet},
    time::{Duration, Instant},
};

use heaptrace_common::Func;

use crate::{
    bpf::prog_stats,
    cli::TraceArgs,
    daemon::exec_watch::ProcWatch,
    drain::KernelMaps,
    drain::round::Snapshot,
    error::{Error, Result},
    probe::{self, LoadOptions, Probes, Scope},
    profile::Profile,
    profile::temporary::Temporary,
    record::{Header, Recorder, format::EndRec},
    reserve::{Tracker, ring::MemRing},
    symbolize::Symbolizer,
    symbolize::modules::Modules,
    target::allocator::{self, Provider},
    target::launch,
    target::procfs,
    view::json,
    view::summary,
    view::tui,
};

use crate::daemon::{CpuMeter, Daemon, End, Filter};

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

/// Called once the probes are attached, the start-up work done: the binary's allocator keeps
/// freed memory from then on (see main.rs).
pub static STARTED: std::sync::OnceLock<fn()> = std::sync::OnceLock::new();

pub fn run(cli: &TraceArgs, record: Option<&std::path::Path>) -> Result<i32> {
    let target = Target::from_cli(cli)?;
    if cli.sample_bytes > 0 && cli.mode != crate::cli::Mode::Stacks {
        return Err(Error::Usage(
            "--sample-bytes samples stacks: it needs --mode stacks (counts and sizes are exact \
             and cheap already)"
                .into(),
        ));
    }
    if let Some(c) = &cli.comm
        && heaptrace_common::filter::pattern(c).is_none()
    {
        return Err(Error::Usage(format!(
            "--comm {c:?}: a command name has 1 to 15 bytes (the kernel's TASK_COMM_LEN), so \
             none can contain this"
        )));
    }
    probe::preflight()?;
    let live_view = !cli.no_tui && tui::wanted();
    let mut opts = LoadOptions {
        mode: cli.mode.kernel(),
        temporary_allocs: cli.temporary_allocs,
        live_map_size: cli.live_map_size,
        size_map_size: cli.size_map_size,
        inflight_map_size: cli.inflight_map_size,
        proc_slots: cli.proc_slots,
        stack_map_size: cli.stack_map_size,
        site_map_size: cli
            .site_map_size
            .unwrap_or_else(|| probe::default_site_map_size(cli.stack_map_size)),
        sample_bytes: cli.sample_bytes,
        latency_every: cli.latency_every,
        calls: cli.mode.at_entry(),
        bare_stack: cli.mode == crate::cli::Mode::Bare,
        pin: !cli.atomic_counters,
        ..LoadOptions::default()
    };

    // Find the target and its allocator; a launched command waits, stopped, until attached.
    let (provider, scope, stopped) = find_target(cli, &target, live_view)?;
    match scope {
        Scope::Process(pid) => opts.watch_tgid = pid,
        Scope::All => {
            opts.comm.clone_from(&cli.comm);
            opts.cgroup = cli
                .cgroup
                .clone()
                .filter(|_| crate::target::cgroups::CgroupNames::default().has_hierarchy());
        }
    }

    // Before any probe fires, so that every run is counted.
    let stats_fd = match cli.probe_stats.then(prog_stats::enable).transpose() {
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
    opts.reservations = reservations;
    let attached = probe::load(&opts).and_then(|loaded| {
        let mut probes = Probes::new(
            loaded,
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
    let maps = KernelMaps::take(&mut probes.ebpf)?;
    let what = match scope {
        Scope::All => summary::all_processes(cli.comm.as_deref(), cli.cgroup.as_deref()),
        Scope::Process(pid) => format!("pid {pid}"),
    };
    let first = probes.probe_count();

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // The process watch registers its ring buffer with this runtime's reactor.
    let _in_runtime = rt.enter();
    // Execs: system-wide, processes that start later (their allocator may be another file),
    // looked at as the ones already running are; one process traced starts over at its exec.
    let mut procwatch = match (
        ProcWatch::start(
            &mut probes,
            &provider,
            cli.probe_at_entry,
            scope,
            cli.comm.clone(),
            opts.cgroup.clone(),
        ),
        scope,
    ) {
        (Ok(mut w), Scope::All) => {
            w.scan(&mut probes);
            Some(w)
        }
        (Ok(w), Scope::Process(_)) => Some(w),
        (Err(e), Scope::All) => return Err(e),
        (Err(e), Scope::Process(pid)) => {
            eprintln!(
                "heaptrace: warning: execs not followed ({e}): if pid {pid} execs, its new \
                 command's counts add to the old one's"
            );
            None
        }
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
        print_probes(&probes);
    }
    if let Some(settled) = STARTED.get() {
        settled();
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
            let header = record_header(cli, &target, pid, &provider);
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
    let temporary = Temporary::Allocs(cli.temporary_allocs);
    let (view, link) = if live_view {
        let info = view_info(cli, &target, pid, &provider, &probes, &aliases, temporary);
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
        profile: Profile::of_mode(cli.mode.name(), cli.sample_bytes)
            .with_latency_every(cli.latency_every),
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
        execs: procwatch.as_mut().and_then(|w| w.events.take()),
        exec_first: None,
        procwatch,
        exited_leaks: BTreeMap::new(),
        same: Default::default(),
        freed: Default::default(),
        incarnations: Default::default(),
        keep_exited: cli.keep_exited,
        exited_order: Default::default(),
        folded_stacks: Vec::new(),
        restarted: Default::default(),
        notice: None,
        stale: HashSet::new(),
        filter: Filter::from_cli(cli),
        matched: std::collections::HashMap::new(),
        live: link,
        cpu: CpuMeter::default(),
        memring,
        reserves: Tracker::default(),
        reserves_lost: 0,
        unjudged_said: false,
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
    let syscall_probes = syscall_probes_json(&probes);
    // How the programs added to their CPU's counters (`pin`).
    let pinned = probes.pinned;
    let prog_stats = stats_fd.map(|fd| {
        let stats = probes.program_stats();
        drop(fd);
        stats
    });
    drop(probes);
    daemon.round()?;
    let pids: Option<HashSet<u32>> = pid.map(|p| HashSet::from([p]));
    // `-p` and a launched command too: its end is in `target`, and in its process's record.
    for (p, pp) in daemon.profile.procs.iter_mut() {
        if !procfs::alive(crate::profile::incarnation::Pid(*p).real()) {
            pp.exited = true;
        }
    }
    let live = daemon.maps.live_blocks(pids.as_ref())?;
    let live = daemon.matching(daemon.same.leaks(live));
    let mut leaks = daemon.incarnations.rekey_sites(live);
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
                summary::bytes(bytes as i64)
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
    eprint!("{}", summary::summary(profile, pid, &aliases));
    if pid.is_none() {
        eprint!("{}", summary::processes(profile, 20));
    }
    if cli.mode == crate::cli::Mode::Stacks {
        eprint!(
            "{}",
            crate::view::site_tables::sites(profile, cli.top, temporary)
        );
    }
    eprint!("{}", crate::view::site_tables::latency(profile));
    if let Some(stats) = &prog_stats {
        eprint!("{}", prog_stats::text(stats));
        eprintln!(
            "  counters: {}",
            match pinned {
                true => "plain adds with preemption off (bpf_preempt_disable), where they count",
                false => "atomic adds",
            }
        );
    }
    // What tracing cost in memory, read once everything is gathered: the kernel maps are
    // bounded by their sizes, this is the daemon's side (profile, stacks, symbols).
    let own = procfs::own_rss_kb();
    if let Some((rss, peak)) = own {
        eprintln!(
            "heaptrace itself: RSS {}, peak {}",
            summary::bytes(rss as i64 * 1024),
            summary::bytes(peak as i64 * 1024)
        );
    }
    eprint!("{}", summary::memory(profile, 10));
    if let Some(path) = &cli.json {
        let pids: Vec<u32> = pid.into_iter().collect();
        let info = json::RunInfo {
            mode: target.mode(),
            comm: cli.comm.as_deref(),
            cgroup: cli.cgroup.as_deref(),
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
            temporary,
        };
        let mut doc = json::document(profile, &info);
        if let Some(h) = doc.value_mut("heaptrace") {
            if let Some((rss, peak)) = own {
                h["rss_kb"] = rss.into();
                h["peak_rss_kb"] = peak.into();
            }
            if let Some(stats) = &prog_stats {
                h["programs"] =
                    serde_json::to_value(stats).map_err(|e| Error::Io(std::io::Error::other(e)))?;
            }
            h["counters"] = if pinned { "preemption_off" } else { "atomic" }.into();
        }
        if let Some(p) = doc.value_mut("provider") {
            p["syscall_probes"] = syscall_probes.into();
        }
        if path == "-" {
            doc.write_pretty(std::io::stdout().lock())?;
        } else {
            doc.write_pretty(std::fs::File::create(path)?)?;
        }
    }
    if let Some(e) = view_error {
        return Err(Error::Io(std::io::Error::other(e)));
    }
    Ok(exit_code.unwrap_or(0))
}

/// The target's allocator file and the probes' scope. A command is started here, stopped
/// before its first instruction until the probes are attached.
fn find_target(
    cli: &TraceArgs,
    target: &Target,
    live_view: bool,
) -> Result<(Provider, Scope, Option<launch::Stopped>)> {
    Ok(match target {
        Target::Pid(pid) => {
            if *pid == std::process::id() {
                return Err(Error::SelfTarget(*pid));
            }
            if !procfs::alive(*pid) {
                return Err(Error::NoSuchProcess(*pid));
            }
            if procfs::state(*pid) == Some('Z') {
                let comm = procfs::comm(*pid).unwrap_or_default();
                return Err(Error::LeaderExited(*pid, comm));
            }
            let provider = match &cli.allocator_symbols {
                Some(c) => allocator::custom_for_pid(*pid, c)?,
                None => allocator::for_pid(*pid)?,
            };
            (provider, Scope::Process(*pid), None)
        }
        Target::All => (allocator::host_libc()?, Scope::All, None),
        Target::Command(argv) => {
            let exe = allocator::resolve_command(&argv[0]).ok_or_else(|| Error::Exec {
                cmd: argv[0].clone(),
                reason: "command not found".into(),
            })?;
            // Said before anything is attached, as the shell would say it.
            launch::check_executable(&exe).map_err(|e| Error::Exec {
                cmd: argv[0].clone(),
                reason: e.to_string(),
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
            (provider, Scope::Process(child.pid), Some(child))
        }
    })
}

/// `--verbose`: every probe, where it went and why.
fn print_probes(probes: &Probes) {
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

/// What the live view's header and export say about the trace.
fn view_info(
    cli: &TraceArgs,
    target: &Target,
    pid: Option<u32>,
    provider: &Provider,
    probes: &Probes,
    aliases: &[(Func, Func)],
    temporary: Temporary,
) -> tui::Info {
    tui::Info {
        target: match target {
            Target::Pid(p) => format!(
                "pid {p} ({})",
                procfs::comm(*p).unwrap_or_else(|| "?".into())
            ),
            Target::All => summary::all_processes(cli.comm.as_deref(), cli.cgroup.as_deref()),
            Target::Command(argv) => format!("{} (pid {})", argv.join(" "), pid.unwrap_or(0)),
        },
        mode: target.mode(),
        comm: cli.comm.clone(),
        cgroup: cli.cgroup.clone(),
        collect: cli.mode.name(),
        interval_ms: cli.interval.as_millis() as u64,
        provider: provider.path.display().to_string(),
        pids: pid.into_iter().collect(),
        command: match target {
            Target::Command(argv) => argv.clone(),
            _ => Vec::new(),
        },
        attached: probes.attached.clone(),
        aliases: aliases.to_vec(),
        temporary,
        output: match (target, &cli.command_output) {
            (Target::Command(_), Some(p)) => Some(p.display().to_string()),
            (Target::Command(_), None) => Some("/dev/null".into()),
            _ => None,
        },
    }
}

/// The JSON document's `provider.syscall_probes`: each memory syscall wrapper probed.
fn syscall_probes_json(probes: &Probes) -> Vec<serde_json::Value> {
    probes
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
        .collect()
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
        temporary_ms: 0,
        cmdlines,
        aliases: aliases(provider)
            .iter()
            .map(|(a, of)| (a.name().to_string(), of.name().to_string()))
            .collect(),
        sample_bytes: cli.sample_bytes,
        latency_every: cli.latency_every,
        temporary_allocs: cli.temporary_allocs,
        comm: cli.comm.clone(),
        cgroup: cli.cgroup.clone(),
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
