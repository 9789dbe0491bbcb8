//! A trace from start to end, in phases: check the arguments, find the target, load and
//! attach, start the watchers and the daemon (a round every interval until the target exits
//! or heaptrace is told to stop), then detach, take the last round and the leaks, and print,
//! write and record what was seen.
use std::{collections::HashSet, os::fd::OwnedFd, path::Path, time::Duration};

use heaptrace_common::Func;

use crate::{
    bpf::prog_stats,
    cli::TraceArgs,
    daemon::{Daemon, End, Filter, Start, exec_watch::ProcWatch},
    drain::KernelMaps,
    error::{Error, Result},
    output::{self, NewFile},
    probe::{self, LoadOptions, Probes, Scope},
    profile::Profile,
    record::{Header, Recorder, format::EndRec},
    reserve::ring::MemRing,
    run_info::{RunInfo, TargetKind, Temporary},
    symbolize::modules::Modules,
    targets::{
        allocator::{self, Provider},
        launch, procfs,
    },
    view::{json, site_tables, summary, tui},
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

    fn kind(&self) -> TargetKind {
        match self {
            Target::Pid(_) => TargetKind::Pid,
            Target::All => TargetKind::All,
            Target::Command(_) => TargetKind::Command,
        }
    }
}

/// Called once the probes are attached, the start-up work done: the binary's allocator keeps
/// freed memory from then on (see main.rs).
pub static STARTED: std::sync::OnceLock<fn()> = std::sync::OnceLock::new();

pub fn run(cli: &TraceArgs, record: Option<&Path>) -> Result<i32> {
    let target = Target::from_cli(cli)?;
    check(cli)?;
    check_outputs(cli, &target, record)?;
    probe::preflight()?;
    // Created now, not once the command runs: a recording that cannot be written leaves no
    // command running untraced. Removed again if tracing never starts.
    let recording = record
        .map(|path| NewFile::create(path, cli.force).map_err(write_error(path)))
        .transpose()?;
    let live_view = !cli.no_tui && tui::wanted();
    // Find the target and its allocator; a launched command waits, stopped, until attached.
    let (provider, scope, stopped) = find_target(cli, &target, live_view)?;
    let attached = match attach(cli, &provider, scope) {
        Ok(a) => a,
        Err(e) => {
            if let Some(child) = stopped {
                child.abort();
            }
            return Err(e);
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // The process watch registers its ring buffer with this runtime's reactor.
    let _in_runtime = rt.enter();
    let Attached {
        mut probes,
        maps,
        opts,
        stats_fd,
        first,
    } = attached;
    let (procwatch, memring) = watchers(cli, &mut probes, &provider, scope, &opts)?;
    announce(cli, &probes, first, &provider, scope);
    let (pid, child) = match (stopped, scope) {
        (Some(stopped), _) => {
            let child = stopped.resume()?;
            (Some(child.pid), Some(child))
        }
        (None, Scope::Process(pid)) => (Some(pid), None),
        (None, Scope::All) => (None, None),
    };
    let info = run_info(cli, &target, pid, &provider, &opts);
    let recorder = recording
        .map(|out| start_recording(out, &info))
        .transpose()?;
    let mut modules = Modules::default();
    if let (Target::Command(_), Some(pid)) = (&target, pid) {
        modules.settle(pid, &provider.path, Duration::from_millis(200));
    }
    let (view, live) = open_view(live_view, cli, &target, &info, &probes);
    let mut daemon = Daemon::new(Start {
        maps,
        probes,
        profile: Profile::of_mode(info.mode, cli.sample_bytes)
            .with_latency_every(cli.latency_every),
        pid,
        child,
        modules,
        recorder,
        procwatch,
        memring,
        live,
        filter: Filter::from_cli(cli),
        quiet: cli.quiet,
        stack_depth: cli.stack_depth as usize,
        keep_exited: cli.keep_exited,
    });
    let end = rt.block_on(daemon.watch(cli.interval))?;
    // Exit status of a launched command: it may still be finishing after a signal.
    let exit_code = match &target {
        Target::Command(_) => Some(rt.block_on(daemon.child_exit(&end))?),
        _ => None,
    };
    let done = finish(&mut daemon, stats_fd, pid, &end, exit_code)?;
    // The live view stays up on the final figures after the target exited, until quit.
    if daemon.live.is_some() && matches!(end, End::TargetExited) {
        daemon.publish(Some(done.reason.clone()), exit_code);
        rt.block_on(daemon.until_quit())?;
    }
    let view_error = view.map(|v| v.close()).and_then(|r| r.err());
    let own = procfs::own_rss_kb();
    print_summary(cli, &daemon.profile, &info, &done, own);
    if let Some(path) = &cli.json {
        write_json(
            path,
            cli.force,
            &daemon.profile,
            &info,
            exit_code,
            &done,
            own,
        )?;
    }
    if let Some(e) = view_error {
        return Err(Error::Io(std::io::Error::other(e)));
    }
    Ok(exit_code.unwrap_or(0))
}

/// Arguments that cannot work together, said before anything is started or attached.
fn check(cli: &TraceArgs) -> Result<()> {
    if cli.sample_bytes > 0 && !cli.mode.has_stacks() {
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
    Ok(())
}

/// Every output path, checked before anything is started or attached: a bad one is said in
/// one line naming it, with exit code 2.
fn check_outputs(cli: &TraceArgs, target: &Target, record: Option<&Path>) -> Result<()> {
    if let Some(path) = record {
        output::check("-o", path, cli.force)?;
    }
    if let Some(path) = cli.json.as_deref().filter(|p| *p != "-") {
        output::check("--json", Path::new(path), cli.force)?;
    }
    if let (Target::Command(_), Some(path)) = (target, &cli.command_output) {
        output::check("--command-output", path, cli.force)?;
    }
    Ok(())
}

fn write_error(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |source| Error::Write {
        path: path.to_path_buf(),
        source,
    }
}

/// The programs loaded, their probes attached, and the kernel maps taken.
struct Attached {
    probes: Probes,
    maps: KernelMaps,
    opts: LoadOptions,
    /// Holds the kernel's BPF run-time statistics on (`--probe-stats`).
    stats_fd: Option<OwnedFd>,
    /// The probes on the target's allocator, before any other file is probed.
    first: usize,
}

fn load_options(cli: &TraceArgs, scope: Scope) -> LoadOptions {
    let mut opts = LoadOptions {
        mode: cli.mode,
        floor: cli.floor,
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
        preempt_off: !cli.atomic_counters,
        ..LoadOptions::default()
    };
    match scope {
        Scope::Process(pid) => opts.watch_tgid = pid,
        Scope::All => {
            opts.comm.clone_from(&cli.comm);
            opts.cgroup = cli
                .cgroup
                .clone()
                .filter(|_| crate::targets::cgroups::CgroupNames::default().has_hierarchy());
        }
    }
    // The memory behind malloc; not part of the benchmark floors. Calls mode does not see
    // malloc's calls end, so it could not tell which call made a mapping.
    opts.reservations = opts.floor.is_none() && !opts.at_entry() && !cli.no_reservations;
    opts
}

fn attach(cli: &TraceArgs, provider: &Provider, scope: Scope) -> Result<Attached> {
    let opts = load_options(cli, scope);
    // Before any probe fires, so that every run is counted.
    let stats_fd = cli
        .probe_stats
        .then(prog_stats::enable)
        .transpose()
        .map_err(|e| Error::Load(format!("BPF run-time statistics: {e}")))?;
    let loaded = probe::load(&opts)?;
    let mut probes = Probes::new(
        loaded,
        !cli.perf_uprobes,
        opts.at_entry(),
        opts.reservations && !cli.syscall_tracepoints,
    )?;
    probes.attach(provider, scope, cli.probe_at_entry)?;
    if let Scope::Process(pid) = scope
        && !probes.syscalls_probed()
    {
        // The allocator is another file; the memory syscalls still go through libc's
        // wrappers. A command not started yet maps heaptrace's own libc, the one it will run
        // on (as `allocator::for_command` assumes).
        if let Some((shown, path)) = allocator::libc_of(pid)? {
            probes.attach_syscalls_in(&shown, &path, scope);
        }
    }
    let maps = KernelMaps::take(&mut probes.ebpf)?;
    Ok(Attached {
        first: probes.probe_count(),
        probes,
        maps,
        opts,
        stats_fd,
    })
}

/// Execs (system-wide: processes that start later, whose allocator may be another file,
/// looked at as the ones already running are; one process traced starts over at its exec),
/// and the memory syscalls.
fn watchers(
    cli: &TraceArgs,
    probes: &mut Probes,
    provider: &Provider,
    scope: Scope,
    opts: &LoadOptions,
) -> Result<(Option<ProcWatch>, Option<MemRing>)> {
    let started = ProcWatch::start(
        probes,
        provider,
        cli.probe_at_entry,
        scope,
        cli.comm.clone(),
        opts.cgroup.clone(),
    );
    let procwatch = match (started, scope) {
        (Ok(mut w), Scope::All) => {
            w.scan(probes);
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
    let memring = match opts.reservations.then(|| MemRing::start(probes)) {
        Some(Ok(r)) => Some(r),
        Some(Err(e)) => {
            eprintln!("heaptrace: warning: memory syscalls not traced: {e}");
            None
        }
        None => None,
    };
    Ok((procwatch, memring))
}

/// Said once everything is in place (the scan of running processes included): tests and
/// scripts start their targets on this line.
fn announce(cli: &TraceArgs, probes: &Probes, first: usize, provider: &Provider, scope: Scope) {
    let what = match scope {
        Scope::All => summary::all_processes(cli.comm.as_deref(), cli.cgroup.as_deref()),
        Scope::Process(pid) => format!("pid {pid}"),
    };
    eprintln!(
        "heaptrace: attached {first} probes to {} ({what})",
        provider.path.display()
    );
    if cli.verbose {
        print_probes(probes);
    }
    if let Some(settled) = STARTED.get() {
        settled();
    }
}

fn run_info(
    cli: &TraceArgs,
    target: &Target,
    pid: Option<u32>,
    provider: &Provider,
    opts: &LoadOptions,
) -> RunInfo {
    RunInfo {
        mode: opts.probes(),
        target: target.kind(),
        pids: pid.into_iter().collect(),
        command: match target {
            Target::Command(argv) => argv.clone(),
            _ => Vec::new(),
        },
        comm: cli.comm.clone(),
        cgroup: cli.cgroup.clone(),
        interval_ms: cli.interval.as_millis() as u64,
        provider: provider.path.display().to_string(),
        aliases: aliases(provider),
        temporary: Temporary::Allocs(cli.temporary_allocs),
        sample_bytes: cli.sample_bytes,
        latency_every: cli.latency_every,
    }
}

fn start_recording(out: NewFile, info: &RunInfo) -> Result<Recorder> {
    let header = Header::new(info, cmdlines(&info.pids));
    let path = out.path().to_path_buf();
    let r = Recorder::create(out, &header).map_err(write_error(&path))?;
    eprintln!("heaptrace: recording to {}", path.display());
    Ok(r)
}

/// The command lines of `pids`, as /proc shows them now.
fn cmdlines(pids: &[u32]) -> Vec<(u32, String)> {
    pids.iter()
        .map(|&p| {
            let raw = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            let line = raw
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect::<Vec<_>>()
                .join(" ");
            (p, line)
        })
        .collect()
}

/// The live view, when wanted and the terminal allows it.
fn open_view(
    wanted: bool,
    cli: &TraceArgs,
    target: &Target,
    info: &RunInfo,
    probes: &Probes,
) -> (Option<tui::Tui>, Option<tui::Link>) {
    if !wanted {
        return (None, None);
    }
    let pid = info.pids.first().copied();
    let info = tui::Info {
        target: match target {
            Target::Pid(p) => format!(
                "pid {p} ({})",
                procfs::comm(*p).unwrap_or_else(|| "?".into())
            ),
            Target::All => summary::all_processes(cli.comm.as_deref(), cli.cgroup.as_deref()),
            Target::Command(argv) => format!("{} (pid {})", argv.join(" "), pid.unwrap_or(0)),
        },
        run: info.clone(),
        attached: probes.attached.clone(),
        output: match (target, &cli.command_output) {
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
}

/// What the end of a trace knows that the Profile does not.
struct Done {
    reason: String,
    attached: Vec<probe::Attached>,
    syscall_probes: Vec<serde_json::Value>,
    counting: probe::Counting,
    prog_stats: Option<Vec<prog_stats::ProgStats>>,
}

/// Detaches, takes the last round and the leaks, and finishes the recording.
fn finish(
    daemon: &mut Daemon,
    stats_fd: Option<OwnedFd>,
    pid: Option<u32>,
    end: &End,
    exit_code: Option<i32>,
) -> Result<Done> {
    // Detach first so the final read is of a state nothing changes any more.
    let probes = daemon.probes.take().expect("probes");
    let attached = probes.attached.clone();
    let syscall_probes = syscall_probes_json(&probes);
    let counting = probes.counting();
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
    let reason = end_reason(end, pid, exit_code);
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
                crate::view::units::bytes(bytes as i64)
            ),
            Err(e) => eprintln!("heaptrace: warning: finishing the recording: {e}"),
        }
    }
    Ok(Done {
        reason,
        attached,
        syscall_probes,
        counting,
        prog_stats,
    })
}

/// The `--json` document, whole, to `path` ("-": stdout).
fn write_json(
    path: &str,
    force: bool,
    profile: &Profile,
    info: &RunInfo,
    exit_code: Option<i32>,
    done: &Done,
    own: Option<(u64, u64)>,
) -> Result<()> {
    let programs = done
        .prog_stats
        .as_ref()
        .map(serde_json::to_value)
        .transpose()
        .map_err(|e| Error::Io(std::io::Error::other(e)))?;
    let run = json::Run {
        info,
        exit_code,
        probes: &done.attached,
        syscall_probes: Some(done.syscall_probes.clone()),
        own_rss_kb: own,
        programs,
        counting: Some(done.counting),
    };
    let doc = json::document(profile, &run);
    if path == "-" {
        doc.write_pretty(std::io::stdout().lock())?;
        return Ok(());
    }
    let path = Path::new(path);
    let out = NewFile::create(path, force).map_err(write_error(path))?;
    doc.write_pretty(out.file()).map_err(write_error(path))?;
    out.persist().map_err(write_error(path))?;
    Ok(())
}

/// The summary on stderr: the end, the functions, the sites (stacks mode), the programs' cost
/// (`--probe-stats`), heaptrace's own memory and the memory behind malloc.
fn print_summary(
    cli: &TraceArgs,
    profile: &Profile,
    info: &RunInfo,
    done: &Done,
    own: Option<(u64, u64)>,
) {
    let pid = info.pids.first().copied();
    eprintln!("heaptrace: {}", done.reason);
    eprint!("{}", summary::summary(profile, pid, &info.aliases));
    if pid.is_none() {
        eprint!("{}", summary::processes(profile, 20));
    }
    if info.mode.has_stacks() && cli.floor.is_none() {
        eprint!("{}", site_tables::sites(profile, cli.top, info.temporary));
    }
    eprint!("{}", site_tables::latency(profile));
    if let Some(stats) = &done.prog_stats {
        eprint!("{}", prog_stats::text(stats));
        eprintln!(
            "  counters: {}",
            match done.counting {
                probe::Counting::PreemptionOff =>
                    "plain adds with preemption off (bpf_preempt_disable), where they count",
                probe::Counting::Atomic => "atomic adds",
            }
        );
    }
    // What tracing cost in memory, read once everything is gathered: the kernel maps are
    // bounded by their sizes, this is the daemon's side (profile, stacks, symbols).
    if let Some((rss, peak)) = own {
        eprintln!(
            "heaptrace itself: RSS {}, peak {}",
            crate::view::units::bytes(rss as i64 * 1024),
            crate::view::units::bytes(peak as i64 * 1024)
        );
    }
    eprint!("{}", summary::memory(profile, 10));
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
                (Some(path), _) => Some(launch::Redirect::to(path, cli.force)?),
                (None, true) => Some(launch::Redirect::to(Path::new("/dev/null"), false)?),
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
