//! Before anything is attached: the arguments checked, the outputs checked, the target found
//! (a command is started here, stopped before its first instruction).
use super::*;

/// Arguments that cannot work together, said before anything is started or attached.
pub(super) fn check(cli: &TraceArgs) -> Result<()> {
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
pub(super) fn check_outputs(cli: &TraceArgs, target: &Target, record: Option<&Path>) -> Result<()> {
    if let Some(path) = record {
        output::check("-o", path, cli.force)?;
    }
    if let Some(path) = cli.json.as_deref().filter(|p| *p != "-") {
        output::check("--json", Path::new(path), cli.force)?;
    }
    if let (Target::Command(_), Some(path)) = (target, &cli.command_output) {
        output::check("--command-output", path, cli.force)?;
    }
    if let Some(dir) = &cli.oom_dir {
        output::check_dir("--oom-dir", dir)?;
    }
    Ok(())
}

/// The target's allocator file and the probes' scope. A command is started here, stopped
/// before its first instruction until the probes are attached.
pub(super) fn find_target(
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
            access::Privileges::own().check_pid(*pid)?;
            if procfs::state(*pid) == Some('Z') {
                let comm = procfs::comm(*pid).unwrap_or_default();
                return Err(Error::LeaderExited(*pid, comm));
            }
            let provider = match &cli.allocator_symbols {
                Some(c) => allocator::custom_for_pid(*pid, c)?,
                None => allocator::for_pid(*pid)?,
            };
            // A tree's forks are held as a launched command's (`tree.rs`); with perf-event
            // links, `attach` makes it a `Tree`.
            let scope = match cli.follow_forks {
                true => Scope::Held(*pid),
                false => Scope::Process(*pid),
            };
            (provider, scope, None)
        }
        Target::All => {
            if let Some(w) = access::Privileges::own().all_warning() {
                crate::say!("heaptrace: warning: {w}");
            }
            (allocator::host_libc()?, Scope::All, None)
        }
        Target::Command(argv) => {
            let exe = executable(argv)?;
            let preload = std::env::var("LD_PRELOAD").ok();
            let provider = match &cli.allocator_symbols {
                Some(c) => allocator::custom_for_command(&exe, preload.as_deref(), c)?,
                None => allocator::for_command(&exe, preload.as_deref())?,
            };
            let redirect = redirect(cli, live_view)?;
            let inherit = super::in_process::python_malloc(cli).map(|e| launch::Inherit {
                env: vec![e],
                fds: Vec::new(),
            });
            let child =
                launch::spawn_stopped_with(&exe, argv, redirect.as_ref(), inherit.as_ref())?;
            // Its forks held at each fork (`probe::held`): followed unless told not to.
            let scope = match cli.no_follow_forks {
                false => Scope::Held(child.pid),
                true => Scope::Process(child.pid),
            };
            (provider, scope, Some(child))
        }
    })
}

/// A command's executable, found as the shell would find it and checked to be one: said
/// before anything is launched or attached, as the shell would say it.
pub(super) fn executable(argv: &[std::ffi::OsString]) -> Result<std::path::PathBuf> {
    let cmd = argv[0].to_string_lossy().into_owned();
    let exe = allocator::resolve_command(&argv[0]).ok_or_else(|| Error::Exec {
        cmd: cmd.clone(),
        reason: "command not found".into(),
        found: false,
    })?;
    launch::check_executable(&exe).map_err(|e| Error::Exec {
        cmd,
        reason: e.to_string(),
        found: e.kind() != std::io::ErrorKind::NotFound,
    })?;
    Ok(exe)
}

/// Where a launched command's output goes: `--command-output`, or /dev/null under the live
/// view (its output would scribble over it), else heaptrace's own.
pub(super) fn redirect(cli: &TraceArgs, live_view: bool) -> Result<Option<launch::Redirect>> {
    Ok(match (&cli.command_output, live_view) {
        (Some(path), _) => Some(launch::Redirect::to(path, cli.force)?),
        (None, true) => Some(launch::Redirect::to(Path::new("/dev/null"), false)?),
        (None, false) => None,
    })
}
