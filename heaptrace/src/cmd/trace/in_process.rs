//! `--in-process`: the command launched with heaptrace's library preloaded and a region to
//! count into; no probes. From the daemon on, the trace is the kernel path's: the same
//! rounds, Profile, views and recording.
use super::*;
use crate::{
    drain::in_process::{Capacities, Region},
    run_info::Collector,
    targets::{launch::Inherit, preload},
    unwind::python::Interpreters,
};

/// Options that only the kernel's probes have, refused by name before anything starts.
fn check_in_process(cli: &TraceArgs, target: &Target) -> Result<()> {
    if matches!(target, Target::All) {
        return Err(Error::Usage(
            "--in-process traces one process: heaptrace --in-process -- CMD, or -p PID \
             --in-process; leave out --in-process for --all"
                .into(),
        ));
    }
    let refused = [
        (cli.mode == crate::run_info::Mode::Calls, "--mode calls"),
        (cli.floor.is_some(), "--floor"),
        (cli.sample_bytes > 0, "--sample-bytes"),
        (cli.follow_forks, "--follow-forks"),
        (cli.allocator_symbols.is_some(), "--allocator-symbols"),
        (cli.probe_at_entry, "--probe-at-entry"),
        (cli.perf_uprobes, "--perf-uprobes"),
        (cli.atomic_counters, "--atomic-counters"),
        (cli.probe_stats, "--probe-stats"),
        (cli.oom_dir.is_some(), "--oom-dir"),
        (cli.comm.is_some(), "--comm"),
        (cli.cgroup.is_some(), "--cgroup"),
    ];
    if let Some((_, flag)) = refused.iter().find(|(set, _)| *set) {
        return Err(Error::Usage(format!(
            "{flag} works with the kernel's probes only: leave out --in-process or {flag}"
        )));
    }
    check_sizes(cli)
}

/// The region's tables, each within what its layout takes (`inproc::Layout::of`): the live
/// table is a power of two of at most 2^28 slots, the stack table at most 2^22 stacks.
fn check_sizes(cli: &TraceArgs) -> Result<()> {
    let bounds = [
        ("--live-map-size", cli.live_map_size, 1 << 28),
        ("--stack-map-size", cli.in_process_stack_map_size(), 1 << 22),
    ];
    for (flag, value, most) in bounds {
        if value == 0 || value > most {
            return Err(Error::Usage(format!(
                "{flag} {value} is out of range with --in-process: 1 to {most}"
            )));
        }
    }
    Ok(())
}

/// Each function's counted name in the region: aliases count as the function they are
/// (glibc's memalign is aligned_alloc), as the probes count them.
pub(super) fn count_as(provider: &Provider) -> [u32; heaptrace_common::FUNC_COUNT] {
    let mut out = std::array::from_fn(|i| i as u32);
    for (alias, as_) in aliases(provider) {
        out[alias as usize] = as_ as u32;
    }
    out
}

pub(super) fn mode_word(mode: crate::run_info::Mode) -> u32 {
    match mode {
        crate::run_info::Mode::Stacks => heaptrace_common::mode::STACKS,
        crate::run_info::Mode::Sizes => heaptrace_common::mode::SIZES,
        _ => heaptrace_common::mode::COUNTS,
    }
}

/// The command, resolved, checked and started stopped with the library and region handed
/// over; the region and the provider of its malloc.
fn launch_with_library(
    cli: &TraceArgs,
    argv: &[std::ffi::OsString],
    live_view: bool,
) -> Result<(Region, Provider, launch::Stopped)> {
    let exe = executable(argv)?;
    if let Some(why) = preload::refusal(&exe) {
        return Err(Error::Usage(why));
    }
    let preloaded = std::env::var("LD_PRELOAD").ok();
    let provider = allocator::for_command(&exe, preloaded.as_deref())?;
    let region = Region::create(
        capacities(cli),
        mode_word(cli.mode),
        count_as(&provider),
        cli.temporary_allocs,
    )?;
    // After the region: a size it refuses is said first, alone.
    let library = preload::install()?;
    let (fd, env) = region.handoff();
    let (name, value) = env.split_once('=').unwrap_or_default();
    let mut env = vec![
        ("LD_PRELOAD".into(), library.preload_path()),
        (name.into(), value.into()),
    ];
    env.extend(python_malloc(cli));
    let inherit = Inherit {
        env,
        fds: std::iter::once(fd).chain(library.fd()).collect(),
    };
    let redirect = redirect(cli, live_view)?;
    let stopped = launch::spawn_stopped_with(&exe, argv, redirect.as_ref(), Some(&inherit))?;
    Ok((region, provider, stopped))
}

/// `--python-malloc`: CPython's object allocator routed to malloc, so that its objects of 512
/// bytes or less are malloc calls, counted (docs/python.md, *pymalloc*).
pub(super) fn python_malloc(cli: &TraceArgs) -> Option<(String, String)> {
    cli.python_malloc
        .then(|| ("PYTHONMALLOC".into(), "malloc".into()))
}

/// The region's capacities, from the command line.
pub(super) fn capacities(cli: &TraceArgs) -> Capacities {
    Capacities {
        threads: cli.in_process_threads,
        sites: cli.in_process_stack_map_size(),
        live: cli.live_map_size.next_power_of_two(),
        // The kernel's map is shared by every process; here each thread has a table of a
        // sixteenth, and what does not fit in it goes to a shared one of the map's size.
        sizes: (cli.size_map_size / 16)
            .clamp(256, 1 << 20)
            .next_power_of_two(),
        shared_sizes: cli.size_map_size.next_power_of_two(),
        depth: cli.stack_depth,
        latency_every: if cli.mode >= crate::run_info::Mode::Sizes {
            cli.latency_every
        } else {
            0
        },
        unwind_rows: if cli.mode == crate::run_info::Mode::Stacks {
            cli.in_process_unwind_rows()
        } else {
            0
        },
    }
}

/// The unwind tables the library's walker reads, in the region: the executable's and its
/// allocator's read now, before it runs, as the kernel path does; its entry is written at the
/// first read of its mappings (its start is held there). None without an unwind area.
pub(super) fn unwind_tables(
    region: &Region,
    pid: u32,
    cmd: &std::ffi::OsStr,
    provider: &Provider,
) -> Result<Option<crate::unwind::loaded::Tables>> {
    let Some(store) = region.unwind_store(pid)? else {
        return Ok(None);
    };
    let mut t = crate::unwind::loaded::Tables::new(Box::new(store));
    if let Some(exe) = allocator::resolve_command(cmd) {
        t.preload(&exe);
    }
    t.preload(&provider.path);
    Ok(Some(t))
}

/// The library's walk appends the Python frames as the kernel's does (docs/python.md): where
/// it finds process `pid`'s interpreter, written into the region's header as it is found at
/// each read of the mappings. None outside stacks mode or with `--no-python-frames`.
pub(super) fn python_walk(
    cli: &TraceArgs,
    region: &Region,
    pid: u32,
) -> Result<Option<Interpreters>> {
    if cli.mode != crate::run_info::Mode::Stacks || cli.no_python_frames {
        return Ok(None);
    }
    let store = Box::new(region.python_store(pid)?);
    Ok(Some(Interpreters::with(store)))
}

pub(super) fn run(cli: &TraceArgs, target: &Target, record: Option<&Path>) -> Result<i32> {
    check_in_process(cli, target)?;
    check(cli)?;
    check_outputs(cli, target, record)?;
    if let Target::Pid(pid) = target
        && let Some(why) = crate::targets::inject::refusal(*pid)
    {
        return Err(Error::Usage(why));
    }
    let serve = crate::serve::Options::from_cli(&cli.serve, cli.interval)?
        .map(crate::serve::start)
        .transpose()?;
    signals::install()?;
    let recording = record
        .map(|path| NewFile::create(path, cli.force).map_err(write_error(path)))
        .transpose()?;
    let live_view = !cli.no_tui && tui::wanted();
    let started = match target {
        Target::Command(argv) => launch(cli, argv, live_view)?,
        Target::Pid(pid) => super::inject::attach(cli, *pid)?,
        Target::All => unreachable!("checked: one process"),
    };
    let Started {
        region,
        provider,
        pid,
        child,
        unwind,
        python,
        collector,
        before,
        rt,
    } = started;
    let _in_runtime = rt.enter();
    let mut info = run_info(cli, target, Some(pid), &provider, &LoadOptions::default());
    info.mode = cli.mode;
    info.collector = collector;
    let recorder = recording
        .map(|out| start_recording(out, &info))
        .transpose()?;
    let mut modules = Modules::default();
    modules.unwind = unwind.map(|t| std::sync::Arc::new(std::sync::Mutex::new(t)));
    modules.python = python;
    modules.settle(pid, &provider.path, Duration::from_millis(200));
    let (view, live) = open_view(live_view, cli, target, &info, &[], 0);
    let mut profile = super::new_profile(cli, &info, before);
    profile.collector = collector;
    let exit_watch = match target {
        Target::Pid(_) => exit_watch(target),
        _ => None,
    };
    let daemon = Daemon::new(Start {
        maps: Box::new(region),
        probes: None,
        profile,
        pid: Some(pid),
        child,
        tree: None,
        exit_watch,
        followed: None,
        modules,
        recorder,
        procwatch: None,
        memring: None,
        live,
        filter: None,
        quiet: cli.quiet,
        stack_depth: cli.stack_depth as usize,
        keep_exited: cli.keep_exited,
        oom_reports: None,
        serve,
    });
    conclude(cli, target, &rt, daemon, Some(pid), view, None, &info)
}

/// A process counting into its region: launched, or attached to.
pub(super) struct Started {
    pub region: Region,
    pub provider: Provider,
    pub pid: u32,
    pub child: Option<launch::Child>,
    pub unwind: Option<crate::unwind::loaded::Tables>,
    /// Where the library's walk finds the Python interpreter (`python_walk`).
    pub python: Option<Interpreters>,
    pub collector: Collector,
    /// `-p --census`: the blocks live before the attach, taken in.
    pub before: Option<crate::drain::before_attach::BeforeAttach>,
    pub rt: tokio::runtime::Runtime,
}

/// The command launched with the library, counting.
fn launch(cli: &TraceArgs, argv: &[std::ffi::OsString], live_view: bool) -> Result<Started> {
    let (mut region, provider, stopped) = launch_with_library(cli, argv, live_view)?;
    if let Some(got) = signals::take_pending() {
        stopped.abort();
        return Err(Error::Signalled(got.sig.to_string(), got.sig.number()));
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let in_runtime = rt.enter();
    region.set_pid(stopped.pid);
    let unwind = unwind_tables(&region, stopped.pid, &argv[0], &provider)?;
    // Its interpreter is found once its libraries are mapped (held there, `Event::Started`).
    let python = python_walk(cli, &region, stopped.pid)?;
    region.set_counting(true);
    let child = stopped.resume()?;
    let pid = child.pid;
    crate::say!(
        "heaptrace: counting in process (a preloaded library) in pid {pid}, {}",
        provider.path.display()
    );
    drop(in_runtime);
    Ok(Started {
        region,
        provider,
        pid,
        child: Some(child),
        unwind,
        python,
        collector: Collector::InProcess,
        before: None,
        rt,
    })
}
