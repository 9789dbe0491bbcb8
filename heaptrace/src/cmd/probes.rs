//! `heaptrace probes [-p PID]`: where each probe would go and why, attaching nothing.
use std::fmt::Write as _;

use crate::{
    cli::ProbesArgs,
    error::Result,
    probe::{self, Planned},
    targets::allocator::{self, Provider},
};

pub fn run(args: &ProbesArgs) -> Result<i32> {
    let (provider, whose) = match (args.pid, &args.allocator_symbols) {
        (Some(pid), None) => (allocator::for_pid(pid)?, format!("pid {pid}")),
        (Some(pid), Some(c)) => (allocator::custom_for_pid(pid, c)?, format!("pid {pid}")),
        (None, None) => (allocator::host_libc()?, "the host's libc".to_string()),
        (None, Some(c)) => {
            let libc = allocator::host_libc_path()?;
            let provider = allocator::custom_for_command(&libc, None, c)?;
            (provider, "the host's libc".to_string())
        }
    };
    let plan = probe::plan(&provider, false, args.mode.at_entry())?;
    super::out(&table(&provider, &whose, &plan))?;
    if !args.mode.at_entry() {
        super::out(&syscalls(wrappers(&provider, args.pid)?))?;
    }
    Ok(0)
}

/// The memory syscalls' wrappers that would be probed, and their file: the allocator's file's,
/// else the libc of the process (heaptrace's own for a command, as `cmd::trace` does).
fn wrappers(
    provider: &Provider,
    pid: Option<u32>,
) -> Result<
    Option<(
        std::path::PathBuf,
        Vec<crate::probe::syscall_sites::SyscallSite>,
    )>,
> {
    if let Some(sites) = crate::probe::syscall_sites::find(&provider.file)? {
        return Ok(Some((provider.path.clone(), sites)));
    }
    let libc = allocator::libc_of(pid.unwrap_or_else(std::process::id))?;
    let Some(libc) = libc else {
        return Ok(None);
    };
    let sites = crate::probe::syscall_sites::find(&libc)?;
    Ok(sites.map(|sites| (libc.shown().to_path_buf(), sites)))
}

/// Where the memory syscalls are seen (the memory behind malloc; not in calls mode).
fn syscalls(
    wrappers: Option<(
        std::path::PathBuf,
        Vec<crate::probe::syscall_sites::SyscallSite>,
    )>,
) -> String {
    let Some((path, sites)) = wrappers else {
        return "memory syscalls: no libc wrappers to probe; the syscall tracepoints trace \
                them (they run on every syscall of the host)\n"
            .into();
    };
    let mut out = format!(
        "memory syscalls (the memory behind malloc), in {}:\n",
        path.display()
    );
    for s in &sites {
        let p = &s.placement;
        let _ = writeln!(
            out,
            "{:<24} {:>11} {:>11} {:<9} {:<26} {}",
            s.name,
            format!("{:#x}", s.file_offset),
            format!("+{}", p.offset),
            "no",
            p.instruction,
            if s.releases() {
                format!("{}; and at +0, before the range it releases is free", p.why)
            } else {
                p.why.clone()
            }
        );
    }
    out
}

/// One line per function; the first four columns have no spaces, for scripts.
fn table(provider: &Provider, whose: &str, plan: &[Planned]) -> String {
    let mut out = format!("{} ({whose})\n", provider.path.display());
    let _ = writeln!(
        out,
        "{:<24} {:>11} {:>11} {:<9} {:<26} why",
        "function", "file offset", "entry probe", "uretprobe", "instruction"
    );
    for p in plan {
        // A custom function shows what it is counted as: `malloc:xx_malloc`.
        let mut name = if p.site.symbol == p.site.func.name() {
            p.site.func.name().to_string()
        } else {
            format!("{}:{}", p.site.func.name(), p.site.symbol)
        };
        for a in &p.site.aliases {
            name.push('=');
            name.push_str(a.name());
        }
        let _ = writeln!(
            out,
            "{name:<24} {:>11} {:>11} {:<9} {:<26} {}",
            format!("{:#x}", p.site.file_offset),
            format!("+{}", p.placement.offset),
            if p.uretprobe { "yes" } else { "no" },
            p.placement.instruction,
            p.placement.why
        );
    }
    out
}
