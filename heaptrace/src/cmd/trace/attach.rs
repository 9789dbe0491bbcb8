//! The programs loaded, the probes attached, the watchers of execs and memory syscalls started.
use super::*;

/// The programs loaded, their probes attached, and the kernel maps taken.
pub(super) struct Attached {
    pub(super) probes: Probes,
    pub(super) maps: KernelMaps,
    /// The kernel's unwind tables, where the walk uses them (`LoadOptions::unwinds`).
    pub(super) unwind: Option<crate::unwind::loaded::Tables>,
    pub(super) opts: LoadOptions,
    /// Holds the kernel's BPF run-time statistics on (`--probe-stats`).
    pub(super) stats_fd: Option<OwnedFd>,
    /// The probes on the target's allocator, before any other file is probed.
    pub(super) first: usize,
    /// The scope the probes have: a launched tree's forks get links bound to them only where
    /// the probes are uprobe_multi links; with perf-event uprobes, the tree is `Tree`.
    pub(super) scope: Scope,
}

pub(super) fn load_options(cli: &TraceArgs, scope: Scope) -> LoadOptions {
    let mut opts = LoadOptions {
        mode: cli.mode,
        floor: cli.floor,
        temporary_allocs: cli.temporary_allocs,
        live_map_size: cli.live_map_size,
        size_map_size: cli.size_map_size,
        inflight_map_size: cli.inflight_map_size,
        proc_slots: cli.proc_slots,
        stack_map_size: cli.kernel_stack_map_size(),
        unwind_rows: cli.kernel_unwind_rows(),
        site_map_size: cli
            .site_map_size
            .unwrap_or_else(probe::default_site_map_size),
        sample_bytes: cli.sample_bytes,
        latency_every: cli.latency_every,
        preempt_off: !cli.atomic_counters,
        ..LoadOptions::default()
    };
    match scope {
        Scope::Process(pid) => opts.watch_tgid = pid,
        Scope::Tree(_) | Scope::Held(_) => opts.follow_forks = true,
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

pub(super) fn attach(cli: &TraceArgs, provider: &Provider, scope: Scope) -> Result<Attached> {
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
    let scope = match scope {
        Scope::Held(root) if !probes.multi_links() => Scope::Tree(root),
        s => s,
    };
    probes.attach(provider, scope, cli.probe_at_entry)?;
    if let Some(pid) = scope.root()
        && !probes.syscalls_probed()
    {
        // The allocator is another file; the memory syscalls still go through libc's
        // wrappers. A command not started yet maps heaptrace's own libc, the one it will run
        // on (as `allocator::for_command` assumes).
        if let Some(libc) = allocator::libc_of(pid)? {
            probes.attach_syscalls_in(&libc, scope);
        }
    }
    let maps = KernelMaps::take(&mut probes.ebpf)?;
    // A process's tables go in at the daemon's first read of its mappings.
    let unwind = opts
        .unwinds()
        .then(|| crate::unwind::loaded::Tables::take(&mut probes.ebpf, opts.unwind_rows))
        .transpose()?;
    Ok(Attached {
        scope,
        first: probes.probe_count(),
        unwind,
        probes,
        maps,
        opts,
        stats_fd,
    })
}

/// Execs (system-wide: processes that start later, whose allocator may be another file,
/// looked at as the ones already running are; one process traced starts over at its exec),
/// and the memory syscalls.
pub(super) fn watchers(
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
        (Ok(w), Scope::Process(pid)) => {
            // A launched command's forks are held by its tracer instead.
            if cli.pid.is_some()
                && probes.multi_links()
                && let Err(e) = w.leave_forks(probes, pid)
            {
                crate::say!(
                    "heaptrace: warning: pid {pid}'s forks keep its breakpoints, a trap at each \
                     call for nothing ({e}); --follow-forks counts them"
                );
            }
            Some(w)
        }
        (Ok(w), Scope::Held(_)) => {
            // Forks no tracer of heaptrace's holds get links at the kernel's report.
            w.follow_unheld(probes);
            Some(w)
        }
        (Ok(w), Scope::Tree(_)) => Some(w),
        (Err(e), Scope::All | Scope::Tree(_) | Scope::Held(_)) => return Err(e),
        (Err(e), Scope::Process(pid)) => {
            crate::say!(
                "heaptrace: warning: execs not followed ({e}): if pid {pid} execs, its new \
                 command's counts add to the old one's"
            );
            None
        }
    };
    let memring = match opts.reservations.then(|| MemRing::start(probes)) {
        Some(Ok(r)) => Some(r),
        Some(Err(e)) => {
            crate::say!("heaptrace: warning: memory syscalls not traced: {e}");
            None
        }
        None => None,
    };
    Ok((procwatch, memring))
}

/// Said once everything is in place (the scan of running processes included): tests and
/// scripts start their targets on this line.
pub(super) fn announce(
    cli: &TraceArgs,
    probes: &Probes,
    first: usize,
    provider: &Provider,
    scope: Scope,
) {
    let what = match scope {
        Scope::All => summary::all_processes(cli.comm.as_deref(), cli.cgroup.as_deref()),
        Scope::Process(pid) => format!("pid {pid}"),
        Scope::Tree(pid) | Scope::Held(pid) => format!("pid {pid} and its forks"),
    };
    crate::say!(
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

/// `--verbose`: every probe, where it went and why.
pub(super) fn print_probes(probes: &Probes) {
    for a in &probes.attached {
        let p = &a.placement;
        crate::say!(
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
            crate::say!(
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

/// `-p`: the blocks the process holds now, put in the live map before counting starts
/// (`drain::before_attach`). Returns what was taken in, and the process, held still until the
/// caller has turned counting on: nothing it allocates or frees in between is missed. None,
/// with a line saying why, where the heap cannot be read (another allocator, an unknown glibc).
pub(super) fn before_attach(
    cli: &TraceArgs,
    opts: &LoadOptions,
    maps: &mut KernelMaps,
    pid: u32,
) -> Result<Option<(BeforeAttach, crate::heap::stop::Frozen)>> {
    // Calls mode and the floors keep no live map; sampled live figures are estimates of
    // sampled blocks, which a census's blocks are not.
    if !cli.census || opts.floor.is_some() || opts.at_entry() {
        return Ok(None);
    }
    if cli.sample_bytes > 0 {
        crate::say!("heaptrace: blocks live before attach not counted (--sample-bytes)");
        return Ok(None);
    }
    let started = std::time::Instant::now();
    let held = match crate::heap::blocks_of_process(pid, true) {
        Ok(h) => h,
        Err(e) => {
            crate::say!("heaptrace: blocks live before attach not counted: {e}");
            return Ok(None);
        }
    };
    for w in &held.warnings {
        crate::say!("heaptrace: warning: heap of pid {pid} before attach: {w}");
    }
    let taken = maps.take_in_before_attach(pid, &held.blocks)?;
    if taken.lost_blocks > 0 {
        crate::say!(
            "heaptrace: warning: {} blocks live before attach did not fit in the live map \
             (--live-map-size {}): counted lost",
            taken.lost_blocks,
            cli.live_map_size
        );
    }
    log::debug!(
        "{} blocks live before attach taken in, {:?} after the census began",
        taken.blocks,
        started.elapsed()
    );
    Ok(Some((taken, held.frozen)))
}
