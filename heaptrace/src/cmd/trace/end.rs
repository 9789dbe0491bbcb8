//! The end of a trace: detach, the last round and the leaks, the summary and the JSON document.
use super::*;

/// What the end of a trace knows that the Profile does not.
pub(super) struct Done {
    pub(super) reason: String,
    pub(super) attached: Vec<probe::Attached>,
    pub(super) syscall_probes: Vec<serde_json::Value>,
    /// How the kernel's programs added to their counters (None in process).
    pub(super) counting: Option<probe::Counting>,
    pub(super) prog_stats: Option<Vec<prog_stats::ProgStats>>,
    /// The launched command was let go of by its tracer (signals too fast to stop for).
    pub(super) released: Option<crate::daemon::Released>,
}

/// Detaches, takes the last round and the leaks, and finishes the recording.
pub(super) fn finish(
    daemon: &mut Daemon,
    stats_fd: Option<OwnedFd>,
    pid: Option<u32>,
    end: &End,
    exit: Option<ExitStatus>,
) -> Result<Done> {
    // Detach first so the final read is of a state nothing changes any more.
    let (attached, syscall_probes, counting, prog_stats) = match daemon.probes.take() {
        Some(mut probes) => {
            let attached = probes.attached.clone();
            let syscall_probes = syscall_probes_json(&probes);
            let counting = probes.counting();
            let prog_stats = stats_fd.map(|fd| {
                let stats = probes.program_stats();
                drop(fd);
                stats
            });
            probes.detach();
            (attached, syscall_probes, Some(counting), prog_stats)
        }
        // In process: the library passes calls through from now on.
        None => (Vec::new(), Vec::new(), None, None),
    };
    daemon.maps.stop();
    daemon.round()?;
    daemon.profile.incomplete = daemon.maps.incomplete();
    let raw = daemon.profile.region_lost.raw_thread_calls;
    if raw > 0 {
        crate::say!(
            "heaptrace: {raw} calls of threads made by a raw clone (not pthread_create) were \
             counted together: their stacks are of one frame, their temporaries and call \
             times not taken"
        );
    }
    for why in &daemon.profile.incomplete {
        crate::say!("heaptrace: warning: {}", why.says());
    }
    // Every followed process's blocks, not the root's alone.
    let pids: Option<HashSet<u32>> = pid
        .filter(|_| daemon.followed.is_none())
        .map(|p| HashSet::from([p]));
    // `-p` and a launched command too: its end is in `target`, and in its process's record.
    for (p, pp) in daemon.profile.procs.iter_mut() {
        if !procfs::alive(crate::profile::incarnation::Pid(*p).real()) {
            pp.exited = true;
        }
    }
    read_resident(&mut daemon.profile);
    let live = daemon.maps.live_blocks(pids.as_ref())?;
    let live = daemon.matching(daemon.same.leaks(live));
    let mut leaks = daemon.incarnations.rekey_sites(live);
    leaks.append(&mut daemon.exited_leaks);
    daemon.profile.set_leaks(leaks);
    let oom = pid.is_some_and(|p| daemon.oom_victims.contains(&p));
    let after = daemon.relay.as_ref().map(|r| (r.got.sig, r.after()));
    let reason = end_reason(end, pid, exit.map(|e| (e, oom)), after);
    if let Some(r) = daemon.recorder.take() {
        let end = EndRec {
            elapsed_ms: daemon.start.elapsed().as_millis() as u64,
            exit_code: exit.map(|e| e.shell_code()),
            reason: reason.clone(),
        };
        match r.finish(daemon.profile.leaks.as_ref(), &end) {
            Ok(bytes) => crate::say!(
                "heaptrace: recorded {} rounds, {}",
                daemon.profile.round_count(),
                crate::view::units::bytes(bytes as i64)
            ),
            Err(e) => crate::say!("heaptrace: warning: finishing the recording: {e}"),
        }
    }
    Ok(Done {
        reason,
        attached,
        syscall_probes,
        counting,
        prog_stats,
        released: daemon.released,
    })
}

/// Processes whose resident memory behind malloc is read at the end, the most reserved
/// first: each read walks the process's page tables.
const RESIDENT_READS: usize = 64;

/// The resident memory behind malloc of the processes still running, from their smaps.
fn read_resident(profile: &mut Profile) {
    let mut alive: Vec<(u64, u64, u32)> = profile
        .procs
        .iter()
        .filter(|(_, p)| !p.exited)
        .map(|(pid, p)| {
            let reserved = p.reserved.map_or(0, |r| r.total());
            (reserved, p.mem.map_or(0, |m| m.rss_kb), *pid)
        })
        .collect();
    alive.sort_by_key(|&(r, rss, pid)| (std::cmp::Reverse((r, rss)), pid));
    for (_, _, pid) in alive.into_iter().take(RESIDENT_READS) {
        let real = crate::profile::incarnation::Pid(pid).real();
        let resident = crate::reserve::resident::read(real);
        if let Some(p) = profile.procs.get_mut(&pid) {
            p.resident = resident;
        }
    }
}

/// The `--json` document, whole, to its path ("-": stdout).
pub(super) fn write_json(
    cli: &TraceArgs,
    profile: &Profile,
    info: &RunInfo,
    exit: Option<ExitStatus>,
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
        exit_code: exit.map(|e| e.shell_code()),
        signal: match exit {
            Some(ExitStatus::Signal { signal, .. }) => Some(signal),
            _ => None,
        },
        probes: &done.attached,
        syscall_probes: Some(done.syscall_probes.clone()),
        own_rss_kb: own,
        programs,
        counting: done.counting,
        released: done.released.map(|r| (r.after_ms, r.per_second)),
        max_processes: Some(cli.json_max_processes as usize),
    };
    let doc = json::document(profile, &run);
    let (path, force) = (cli.json.as_deref().unwrap_or("-"), cli.force);
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
pub(super) fn print_summary(
    cli: &TraceArgs,
    profile: &Profile,
    info: &RunInfo,
    done: &Done,
    own: Option<(u64, u64)>,
) {
    // A followed tree of more than one process is summed, as `--all` is (and grouped, it
    // may be one process of the Profile standing for several).
    let pid = info
        .pids
        .first()
        .copied()
        .filter(|_| profile.procs.len() <= 1);
    let grouped;
    let profile = match cli.group_by {
        crate::cli::GroupBy::Command => {
            grouped = profile.by_command();
            &grouped
        }
        crate::cli::GroupBy::Process => profile,
    };
    crate::say!("heaptrace: {}", done.reason);
    if let (Some(r), Some(pid)) = (done.released, info.pids.first()) {
        crate::say!(
            "heaptrace: pid {pid} was let go of {} ms in (it took {} signals a second): its \
             exit and later execs were not held",
            r.after_ms,
            r.per_second
        );
    }
    crate::say_part!("{}", summary::summary(profile, pid, &info.aliases));
    if pid.is_none() {
        crate::say_part!("{}", summary::processes(profile, 20));
    }
    if info.mode.has_stacks() && cli.floor.is_none() {
        crate::say_part!(
            "{}",
            site_tables::sites(
                profile,
                cli.top,
                info.temporary,
                if cli.full_names {
                    crate::view::names::Names::FULL
                } else {
                    crate::view::names::Names::SHORT
                }
            )
        );
    }
    crate::say_part!("{}", site_tables::latency(profile));
    if let Some(stats) = &done.prog_stats {
        crate::say_part!("{}", prog_stats::text(stats));
        crate::say!(
            "  counters: {}",
            match done.counting.unwrap_or(probe::Counting::Atomic) {
                probe::Counting::PreemptionOff =>
                    "plain adds with preemption off (bpf_preempt_disable), where they count",
                probe::Counting::Atomic => "atomic adds",
            }
        );
    }
    // What tracing cost in memory, read once everything is gathered: the kernel maps are
    // bounded by their sizes, this is the daemon's side (profile, stacks, symbols).
    if let Some((rss, peak)) = own {
        crate::say!(
            "heaptrace itself: RSS {}, peak {}",
            crate::view::units::bytes(rss as i64 * 1024),
            crate::view::units::bytes(peak as i64 * 1024)
        );
    }
    let attached = info.target != crate::run_info::TargetKind::Command;
    crate::say_part!("{}", summary::memory(profile, 10, attached));
}

/// The JSON document's `provider.syscall_probes`: each memory syscall wrapper probed.
pub(super) fn syscall_probes_json(probes: &Probes) -> Vec<serde_json::Value> {
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

/// `exit`: how the target ended, and whether the OOM killer killed it.
pub(super) fn end_reason(
    end: &End,
    pid: Option<u32>,
    exit: Option<(ExitStatus, bool)>,
    relayed: Option<(Sig, String)>,
) -> String {
    let exit = exit.map(|(status, oom)| Ended(status, oom));
    let passed_on = relayed.as_ref().map(|(s, _)| *s);
    let after = relayed.map(|(_, after)| after).unwrap_or_default();
    match (end, pid, exit) {
        (End::TargetExited, Some(pid), Some(status)) => format!("pid {pid} {status}{after}"),
        (End::TargetExited, Some(pid), None) => format!("pid {pid} exited"),
        (End::TargetExited, None, _) => "stopped".into(),
        (End::Signal(sig), Some(pid), Some(status)) if passed_on.is_some() => {
            format!("{sig} again: detached; pid {pid} {status}")
        }
        (End::Signal(Sig::Int), _, _) => "interrupted; detached".into(),
        (End::Signal(Sig::Term), _, _) => "terminated; detached".into(),
        (End::Signal(Sig::Hup), _, _) => "hung up; detached".into(),
        (End::Quit, Some(pid), Some(status)) => format!("quit; detached; pid {pid} {status}"),
        (End::Quit, _, _) => "quit; detached".into(),
    }
}

/// How the target ended, and whether the OOM killer killed it: "was killed by the OOM killer
/// (SIGKILL)".
struct Ended(ExitStatus, bool);

impl std::fmt::Display for Ended {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.0, self.1) {
            (ExitStatus::Signal { signal, .. }, true) => write!(
                f,
                "was killed by the OOM killer ({})",
                crate::exit_status::signal_name(signal)
            ),
            (status, true) => write!(f, "{status}, after the OOM killer chose it"),
            (status, false) => write!(f, "{status}"),
        }
    }
}
