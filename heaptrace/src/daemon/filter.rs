//! `--comm` and `--cgroup` in user space: the processes each round shows, judged again.
use crate::cli::TraceArgs;

/// `--comm` / `--cgroup`: which processes a system-wide trace reports. The kernel leaves out
/// the processes that do not match (`heaptrace_common::filter`) but judges a thread at its
/// first call, and traces where it cannot judge: the rounds judge what it shows them again and
/// keep only the matching ones, so every view agrees.
pub struct Filter {
    comm: Option<String>,
    cgroup: Option<String>,
}

impl Filter {
    pub fn from_cli(cli: &TraceArgs) -> Option<Filter> {
        (cli.comm.is_some() || cli.cgroup.is_some()).then(|| Filter {
            comm: cli.comm.clone(),
            cgroup: cli.cgroup.clone(),
        })
    }

    pub(super) fn matches(&self, comm: &str, cgroup: &str) -> bool {
        self.comm.as_ref().is_none_or(|c| comm.contains(c.as_str()))
            && self
                .cgroup
                .as_ref()
                .is_none_or(|c| cgroup.contains(c.as_str()))
    }

    /// Drops the processes that do not match. A process is judged once, when first seen: by
    /// its name and cgroup while it lives; once gone, by the name the kernel recorded (its
    /// cgroup can no longer be read, so a --cgroup filter leaves it out).
    pub(super) fn apply(
        &self,
        round: &mut crate::drain::round::Round,
        matched: &mut std::collections::HashMap<u32, bool>,
    ) {
        for (pid, pr) in &round.procs {
            matched
                .entry(*pid)
                .or_insert_with(|| self.matches(&pr.comm, &pr.cgroup));
        }
        let keep = |pid: &u32| matched.get(pid).copied().unwrap_or(false);
        round.procs.retain(|p, _| keep(p));
        round.sizes.retain(|k, _| keep(&k.0));
        round.sites.retain(|k, _| keep(&k.0));
        round.mem.retain(|p, _| keep(p));
        round.stacks.retain(|k, _| keep(&k.0));
        round.reservations.retain(|k, _| keep(&k.0));
        round.reserved.retain(|p, _| keep(p));
        round.peaks.retain(|p, _| keep(p));
    }
}
