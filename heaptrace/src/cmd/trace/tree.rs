//! `-p PID --follow-forks` on uprobe_multi links (`Scope::Held` without a launched command):
//! the tree's running processes get links of their own before counting is on, and are seized
//! so that each process they fork is held until it has its own (`targets::seized`). Nothing
//! outside the tree traps.
use super::*;

/// The root (and, for -p, what it forked already) in the kernel's set before it counts; true
/// for a `-p` tree held by seizing (its running processes get links of their own here).
pub(super) fn follow(
    probes: &mut Probes,
    scope: Scope,
    target: &Target,
) -> Result<(Option<probe::follow::Followed>, bool)> {
    let running = matches!(target, Target::Pid(_));
    let followed = match scope {
        Scope::Tree(root) | Scope::Held(root) => {
            Some(probe::follow::Followed::start(probes, root, running)?)
        }
        _ => None,
    };
    let seized = running && matches!(scope, Scope::Held(_));
    if let (true, Some(f), Some(root)) = (seized, &followed, scope.root()) {
        follow_running(probes, f, root);
    }
    Ok((followed, seized))
}

/// Counting on: every probe of the start in place (the scan of `--all` included). A `-p`
/// tree (`followed`) is seized before, unless a census holds its root (`held`: ptrace has
/// one tracer), then after.
pub(super) fn count_from_here(
    probes: &mut Probes,
    held: Option<crate::heap::stop::Frozen>,
    followed: Option<&probe::follow::Followed>,
) -> Result<Option<(Seized, Holds)>> {
    let first = held.is_none();
    let mut seized = followed.filter(|_| first).and_then(|f| seize(probes, f));
    probes.enable()?;
    probes.forks.counting_on();
    drop(held);
    if let (false, Some(f)) = (first, followed) {
        seized = seize(probes, f);
    }
    Ok(seized)
}

/// Links of their own for the tree's processes other than its root (whose links the attach
/// made), and forks followed from here on. Before counting is on: counted from their first call.
fn follow_running(probes: &Probes, followed: &probe::follow::Followed, root: u32) {
    probes.forks.set_follow(true);
    for &pid in followed.pids.iter().filter(|p| **p != root) {
        if let Err(e) = probes.forks.follow_running(pid) {
            crate::say!("heaptrace: warning: pid {pid} not counted: {e}");
        }
    }
}

/// Seizes the tree's processes: their forks held from here on. Says which cannot be (their
/// forks are followed from the kernel's report, their first calls uncounted).
fn seize(probes: &Probes, followed: &probe::follow::Followed) -> Option<(Seized, Holds)> {
    let pids: Vec<u32> = followed.pids.iter().copied().collect();
    let forks: std::sync::Arc<dyn launch::Forks> = probes.forks.clone();
    match crate::targets::seized::seize(&pids, forks) {
        Ok((s, holds)) => {
            let refused: Vec<String> = s
                .refused
                .iter()
                .filter(|(pid, _)| procfs::alive(*pid))
                .map(|(pid, e)| format!("{pid} ({e})"))
                .collect();
            if !refused.is_empty() {
                crate::say!(
                    "heaptrace: warning: the forks of pid {} are followed from the kernel's report, \
                     not held: their first calls are not counted (another tracer holds it?)",
                    refused.join(", ")
                );
            }
            Some((s, holds))
        }
        Err(e) => {
            crate::say!(
                "heaptrace: warning: forks followed from the kernel's report, not held (their \
                 first calls are not counted): {e}"
            );
            None
        }
    }
}

/// At the end: the forks that were not held, said.
pub(super) fn said_late(late: u64, seized: Option<&Seized>) {
    let released = seized.map_or(0, |s| s.released.load(std::sync::atomic::Ordering::Relaxed));
    if late > 0 {
        crate::say!(
            "heaptrace: {late} forks were not held at their fork (forked by a thread other than \
             the main one, or by a process let go of{}): each counted from the kernel's report of \
             it, a millisecond or so late",
            match released {
                0 => String::new(),
                n => format!(": {n} for the signals it was sent"),
            }
        );
    }
}

pub(super) use crate::targets::seized::{Holds, Seized};
