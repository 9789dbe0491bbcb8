//! A trace from start to end, in phases: check the arguments, find the target, load and
//! attach, start the watchers and the daemon (a round every interval until the target exits
//! or heaptrace is told to stop), then detach, take the last round and the leaks, and print,
//! write and record what was seen.
use std::{collections::HashSet, os::fd::OwnedFd, path::Path, time::Duration};

use heaptrace_common::Func;

use crate::{
    bpf::prog_stats,
    cli::TraceArgs,
    daemon::{Daemon, End, Filter, OomReports, Sig, Start, exec_watch::ProcWatch, signals},
    drain::{KernelMaps, before_attach::BeforeAttach},
    error::{Error, Result},
    exit_status::ExitStatus,
    output::{self, NewFile},
    probe::{self, LoadOptions, Probes, Scope},
    profile::Profile,
    record::{Header, Recorder, format::EndRec},
    reserve::ring::MemRing,
    run_info::{RunInfo, TargetKind, Temporary},
    symbolize::modules::Modules,
    targets::{
        access,
        allocator::{self, Provider},
        exit_watch::ExitWatch,
        launch, procfs,
    },
    view::{json, site_tables, summary, tui},
};

enum Target {
    Pid(u32),
    All,
    Command(Vec<std::ffi::OsString>),
}

impl Target {
    fn from_cli(cli: &TraceArgs) -> Result<Target> {
        match (cli.pid, cli.all, cli.command.is_empty()) {
            (Some(pid), _, _) => Ok(Target::Pid(pid)),
            (None, true, _) => Ok(Target::All),
            (None, false, false) => Ok(Target::Command(cli.command.clone())),
            (None, false, true) => Err(Error::Usage(
                "give a target: -p PID, --all or -- COMMAND [ARGS] (heaptrace --help)".into(),
            )),
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
mod attach;
mod end;
mod in_process;
mod inject;
mod target;
mod tree;

use self::{attach::*, end::*, target::*};

pub fn run(cli: &TraceArgs, record: Option<&Path>) -> Result<i32> {
    let target = Target::from_cli(cli)?;
    if cli.in_process {
        return in_process::run(cli, &target, record);
    }
    check(cli)?;
    check_outputs(cli, &target, record)?;
    let serve = crate::serve::Options::from_cli(&cli.serve, cli.interval)?;
    probe::preflight()?;
    // Listening before anything is launched or attached: a port in use stops nothing started.
    let serve = serve.map(crate::serve::start).transpose()?;
    // From here on SIGINT, SIGTERM and SIGHUP are only recorded: one during the attach ends
    // the trace once the attach is complete, and never leaves a probe behind.
    signals::install()?;
    // Created now, not once the command runs: a recording that cannot be written leaves no
    // command running untraced. Removed again if tracing never starts.
    let recording = record
        .map(|path| NewFile::create(path, cli.force).map_err(write_error(path)))
        .transpose()?;
    let live_view = !cli.no_tui && tui::wanted();
    // Listening for a `-p` target's end before anything else: it may end at any moment.
    let exit_watch = exit_watch(&target);
    // Find the target and its allocator; a launched command waits, stopped, until attached.
    let (provider, scope, mut stopped) = find_target(cli, &target, live_view)?;
    let attached = attach_or_abort(cli, &provider, scope, &mut stopped)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // The process watch registers its ring buffer with this runtime's reactor.
    let _in_runtime = rt.enter();
    let Attached {
        mut probes,
        mut maps,
        opts,
        stats_fd,
        first,
        unwind,
        scope,
    } = attached;
    let (mut procwatch, memring) = watchers(cli, &mut probes, &provider, scope, &opts)?;
    let (followed, tree) = tree::follow(&mut probes, scope, &target)?;
    if let Some(got) = signals::take_pending() {
        if let Some(child) = stopped {
            child.abort();
        }
        return Err(Error::Signalled(got.sig.to_string(), got.sig.number()));
    }
    // The blocks the process holds now, taken in with the process stopped until counting is
    // on: each of its frees is of a block known, each of its allocations counted.
    let taken = taken_in(&target, followed.as_ref(), procwatch.as_mut());
    maps.claim_slots(&taken);
    let (before, held) = match target {
        Target::Pid(pid) => before_attach(cli, &opts, &mut maps, pid)?.unzip(),
        _ => (None, None),
    };
    let python = (opts.unwinds() && !cli.no_python_frames)
        .then(|| crate::unwind::python::Interpreters::take(&mut probes.ebpf))
        .transpose()?;
    let mut modules = tables_before_counting(&mut probes, (unwind, python), scope, taken);
    // Before counting: processes started since the watch did have their entries in place.
    share_tables(&modules, &target, &provider, procwatch.as_ref());
    let seized = tree::count_from_here(&mut probes, held, followed.as_ref().filter(|_| tree))?;
    let forks = probes.forks.clone();
    let (seized, tree_holds) = seized.unzip();
    hold_tree_finalize(
        &mut probes,
        &modules,
        tree_holds.as_ref(),
        followed.as_ref(),
    );
    announce(cli, &probes, first, &provider, scope);
    if let Some(s) = &stopped {
        // Its forks: followed (links of their own) or let go of with their text restored.
        probes.forks.set_follow(matches!(scope, Scope::Held(_)));
        s.on_forks(probes.forks.clone());
    }
    let (pid, child) = start(stopped, scope)?;
    let info = run_info(cli, &target, pid, &provider, &opts);
    let recorder = recording
        .map(|out| start_recording(out, &info))
        .transpose()?;
    if let (Target::Command(_), Some(pid)) = (&target, pid) {
        modules.settle(pid, &provider.path, Duration::from_millis(200));
    }
    let (view, live) = open_view(
        live_view,
        cli,
        &target,
        &info,
        &probes.attached,
        probes.probe_count(),
    );
    let daemon = Daemon::new(Start {
        maps: Box::new(maps),
        probes: Some(probes),
        profile: new_profile(cli, &info, before),
        pid,
        child,
        tree: tree_holds,
        exit_watch,
        followed,
        modules,
        recorder,
        procwatch,
        memring,
        live,
        filter: Filter::from_cli(cli),
        quiet: cli.quiet,
        stack_depth: cli.stack_depth as usize,
        keep_exited: cli.keep_exited,
        oom_reports: cli.oom_dir.clone().map(|dir| OomReports {
            dir,
            info: info.clone(),
        }),
        serve,
    });
    let code = conclude(cli, &target, &rt, daemon, pid, view, stats_fd, &info);
    tree::said_late(forks.late(), seized.as_ref());
    code
}

/// The probes attached, or the launched command (held before exec) ended if they could not be.
fn attach_or_abort(
    cli: &TraceArgs,
    provider: &Provider,
    scope: Scope,
    stopped: &mut Option<crate::targets::launch::Stopped>,
) -> Result<Attached> {
    attach(cli, provider, scope).inspect_err(|_| {
        if let Some(child) = stopped.take() {
            child.abort();
        }
    })
}

/// The Profile the daemon folds the rounds into, with the run's rules.
pub(super) fn new_profile(
    cli: &TraceArgs,
    info: &RunInfo,
    before: Option<crate::drain::before_attach::BeforeAttach>,
) -> Profile {
    let mut profile = Profile::of_mode(info.mode, cli.sample_bytes)
        .with_latency_every(cli.latency_every)
        .with_wrapper_rule(cli.site_naming.rule(&info.provider));
    profile.before_attach = before;
    profile
}

/// A `-p` target's end, listened for (None for the other targets, or when it cannot be).
fn exit_watch(target: &Target) -> Option<ExitWatch> {
    match target {
        Target::Pid(pid) => ExitWatch::open(*pid)
            .inspect_err(|e| log::debug!("no exit status for pid {pid}: {e}"))
            .ok(),
        _ => None,
    }
}

/// The processes taken in at the start with their unwind tables in place, before counting is
/// on: their first counted calls walk whole.
fn tables_before_counting(
    probes: &mut Probes,
    (unwind, python): (
        Option<crate::unwind::loaded::Tables>,
        Option<crate::unwind::python::Interpreters>,
    ),
    scope: Scope,
    taken: Vec<u32>,
) -> Modules {
    if scope == Scope::All && unwind.is_some() {
        inherit_tables(probes);
    }
    let mut modules = Modules::default();
    modules.unwind = unwind.map(|t| std::sync::Arc::new(std::sync::Mutex::new(t)));
    modules.python = python;
    modules.take_in(taken);
    modules
}

/// Under `--all`, each fork gets its parent's unwind entry in the kernel (with `--follow-forks`
/// the fork program does it already).
fn inherit_tables(probes: &mut Probes) {
    let done = crate::bpf::btf::id_offsets()
        .map_err(|e| e.to_string())
        .and_then(|_| probe::follow::inherit_tables(probes).map_err(|e| e.to_string()));
    if let Err(e) = done {
        crate::say!(
            "heaptrace: warning: forks walk by frame pointer until their mappings are read ({e})"
        );
    }
}

/// The running processes a trace takes in as it starts: the `-p` process, with
/// `--follow-forks` its descendants (seeded in `FOLLOWED`), under `--all` those the scan found.
/// A launched command is not running yet (its tables go in at its start hold).
fn taken_in(
    target: &Target,
    followed: Option<&probe::follow::Followed>,
    procwatch: Option<&mut ProcWatch>,
) -> Vec<u32> {
    match (target, followed) {
        (Target::Pid(_), Some(f)) => f.pids.iter().copied().collect(),
        (Target::Pid(pid), None) => vec![*pid],
        (Target::All, _) => procwatch
            .map(|w| std::mem::take(&mut w.scanned))
            .unwrap_or_default(),
        _ => Vec::new(),
    }
}

/// A seized tree's Pythons held as they finalize (`daemon::hold_python_finalize`), in place
/// before the trace says it is attached: one told to end then is named.
fn hold_tree_finalize(
    probes: &mut Probes,
    modules: &Modules,
    holds: Option<&crate::targets::seized::Holds>,
    followed: Option<&probe::follow::Followed>,
) {
    let (Some(h), Some(f)) = (holds, followed) else {
        return;
    };
    for &pid in &f.pids {
        crate::daemon::hold_python_finalize(probes, modules.python.as_ref(), &h.finalize, pid);
    }
}

/// The unwind tables, a launched command's files' rows read before it runs, shared with the
/// exec watch's reader (new processes' entries written at once).
fn share_tables(
    modules: &Modules,
    target: &Target,
    provider: &Provider,
    procwatch: Option<&ProcWatch>,
) {
    let Some(t) = &modules.unwind else { return };
    if let (Target::Command(argv), Ok(mut t)) = (target, t.lock()) {
        preload_tables(&mut t, argv, provider);
    }
    if let Some(w) = procwatch {
        w.share_tables(t.clone());
    }
}

/// A launched command's executable's and allocator's unwind rows, read before it runs, so that
/// its entry takes no reading as it starts.
fn preload_tables(
    t: &mut crate::unwind::loaded::Tables,
    argv: &[std::ffi::OsString],
    provider: &Provider,
) {
    if let Some(exe) = crate::targets::allocator::resolve_command(&argv[0]) {
        t.preload(&exe);
    }
    t.preload(&provider.path);
}

/// Lets a launched command run; the pid traced and the launched child, if any.
fn start(
    stopped: Option<crate::targets::launch::Stopped>,
    scope: Scope,
) -> Result<(Option<u32>, Option<crate::targets::launch::Child>)> {
    Ok(match (stopped, scope) {
        (Some(stopped), _) => {
            let child = stopped.resume()?;
            (Some(child.pid), Some(child))
        }
        (None, Scope::Process(pid) | Scope::Tree(pid) | Scope::Held(pid)) => (Some(pid), None),
        (None, Scope::All) => (None, None),
    })
}

/// The trace's loop until the target ends or heaptrace is told to stop, then the last round,
/// the summary and the JSON document; returns heaptrace's exit code.
#[allow(clippy::too_many_arguments)]
fn conclude(
    cli: &TraceArgs,
    target: &Target,
    rt: &tokio::runtime::Runtime,
    mut daemon: Daemon,
    pid: Option<u32>,
    view: Option<tui::Tui>,
    stats_fd: Option<OwnedFd>,
    info: &RunInfo,
) -> Result<i32> {
    let end = match rt.block_on(daemon.watch(cli.interval)) {
        Ok(end) => end,
        Err(e) => {
            // Never left to run on untraced: the tracer thread's end kills it
            // (PTRACE_O_EXITKILL), but the summary should say so first.
            if let (Target::Command(_), Some(pid)) = (target, pid) {
                crate::say!("heaptrace: stopping pid {pid}, which would run on untraced");
            }
            return Err(e);
        }
    };
    // How a launched command ended: it may still be finishing after a signal.
    let exit = match target {
        Target::Command(_) => Some(rt.block_on(daemon.child_exit(&end))?),
        _ => daemon.exit,
    };
    let exit_code = exit.map(|e| e.shell_code());
    let done = finish(&mut daemon, stats_fd, pid, &end, exit)?;
    // The live view stays up on the final figures after the target exited, until quit; not
    // when a signal asked heaptrace to end.
    if daemon.live.is_some() && matches!(end, End::TargetExited) && daemon.relay.is_none() {
        daemon.publish(Some(done.reason.clone()), exit_code);
        rt.block_on(daemon.until_quit())?;
    }
    let view_error = view.map(|v| v.close()).and_then(|r| r.err());
    // A view that failed because its terminal hung up is no error of the trace.
    let view_error = view_error.filter(|_| !matches!(end, End::Signal(Sig::Hup)));
    let own = procfs::own_rss_kb();
    print_summary(cli, &daemon.profile, info, &done, own);
    if cli.json.is_some() {
        // The summary is out: the Profile is the document's alone now.
        let max = cli.json_max_processes as usize;
        let folded = daemon.profile.keep_processes(max);
        daemon.profile.folded.document_stacks = Some(cli.json_max_stacks as usize);
        if folded > 0 {
            crate::say!(
                "heaptrace: the JSON document folds {folded} processes into one \
                 (--json-max-processes {max})"
            );
        }
        match write_json(cli, &daemon.profile, info, exit, &done, own) {
            // `--json - | head`: its reader chose to stop; the command's status still counts.
            Err(e) if e.is_broken_pipe() => {
                crate::say!("heaptrace: the JSON document's reader closed the pipe")
            }
            r => r?,
        }
    }
    if let Some(e) = view_error {
        return Err(Error::Io(std::io::Error::other(e)));
    }
    Ok(match target {
        // The command's own status, whatever made it end.
        Target::Command(_) => exit_code.unwrap_or(1),
        // Ending a trace of -p or --all with Ctrl-C is no failure.
        _ => 0,
    })
}

fn write_error(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |source| Error::Write {
        path: path.to_path_buf(),
        source,
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
            Target::Command(argv) => argv
                .iter()
                .map(|a| a.to_string_lossy().into_owned())
                .collect(),
            _ => Vec::new(),
        },
        comm: cli.comm.clone(),
        cgroup: cli.cgroup.clone(),
        interval_ms: cli.interval.as_millis() as u64,
        provider: provider.path.display().to_string(),
        aliases: aliases(provider),
        temporary: Temporary::Events(cli.temporary_allocs),
        sample_bytes: cli.sample_bytes,
        latency_every: cli.latency_every,
        collector: crate::run_info::Collector::Kernel,
    }
}

fn start_recording(out: NewFile, info: &RunInfo) -> Result<Recorder> {
    let header = Header::new(info, cmdlines(&info.pids));
    let path = out.path().to_path_buf();
    let r = Recorder::create(out, &header).map_err(write_error(&path))?;
    crate::say!("heaptrace: recording to {}", path.display());
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
    attached: &[probe::Attached],
    probe_count: usize,
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
            Target::Command(argv) => format!(
                "{} (pid {})",
                argv.join(std::ffi::OsStr::new(" ")).to_string_lossy(),
                pid.unwrap_or(0)
            ),
        },
        run: info.clone(),
        attached: attached.to_vec(),
        probe_count,
        output: match (target, &cli.command_output) {
            (Target::Command(_), Some(p)) => Some(p.display().to_string()),
            (Target::Command(_), None) => Some("/dev/null".into()),
            _ => None,
        },
    };
    match tui::Tui::start(info, tui::Published::default()) {
        Ok((view, link)) => (Some(view), Some(link)),
        Err(e) => {
            crate::say!("heaptrace: cannot open the live view ({e}); printing rounds instead");
            (None, None)
        }
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
