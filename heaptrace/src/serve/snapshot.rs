//! What a round publishes for the server: the part of the Profile it serves (the running
//! processes, their sites and stacks), and heaptrace's own figures. Ended processes are left
//! out: under `--all` they are most of the Profile, and the server shows none of them, so a
//! copy of them each round would only double what the daemon holds.
use std::collections::BTreeMap;

use crate::{
    drain::round::site_ids,
    profile::{Profile, exited::FOLDED, grouped::is_group},
};

#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// The running processes' figures, sites and stacks; the trace's losses and rules.
    pub profile: Profile,
    /// Rounds taken since the start.
    pub rounds: u64,
    /// When the trace started (Unix milliseconds), and how long it has run.
    pub start_unix_ms: u64,
    pub elapsed_ms: u64,
    /// How long the last round took, in seconds.
    pub round_seconds: f64,
    /// Rounds that started more than half an interval late, and the longest time between two
    /// rounds' starts (seconds).
    pub rounds_late: u64,
    pub round_gap_max_seconds: f64,
    /// The trace has ended: the figures are final.
    pub ended: bool,
}

/// The running processes' part of `p`: their figures, their sites (taken by range, so the
/// cost follows the running processes, not all the trace has seen) and their stacks, shared.
pub fn running(p: &Profile) -> Profile {
    let procs: BTreeMap<_, _> = p
        .procs
        .iter()
        .filter(|(k, pp)| **k != FOLDED && !is_group(**k) && !pp.exited)
        .map(|(k, pp)| (*k, pp.clone()))
        .collect();
    let mut sites = BTreeMap::new();
    let mut stacks = BTreeMap::new();
    for pid in procs.keys() {
        sites.extend(p.sites.range(site_ids(*pid)).map(|(k, v)| (*k, v.clone())));
        let ids = (*pid, i32::MIN)..=(*pid, i32::MAX);
        stacks.extend(p.stacks.range(ids).map(|(k, v)| (*k, v.clone())));
    }
    Profile {
        procs,
        sites,
        stacks,
        losses: p.losses,
        sample_bytes: p.sample_bytes,
        calls: p.calls,
        latency_every: p.latency_every,
        wrapper_rule: p.wrapper_rule.clone(),
        ..Profile::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::tests_support::add_process;

    #[test]
    fn only_running_processes_are_kept() {
        let mut s = Snapshot::default();
        add_process(&mut s, 1, "alive", "", 10, 8, 0);
        add_process(&mut s, 2, "gone", "", 10, 8, 0);
        s.profile.procs.get_mut(&2).unwrap().exited = true;
        let r = running(&s.profile);
        assert_eq!(r.procs.keys().copied().collect::<Vec<_>>(), [1]);
        assert_eq!(r.sites.len(), 1);
        assert_eq!(r.stacks.len(), 1);
        assert_eq!(r.frames(r.sites.keys().next().unwrap()).len(), 2);
    }
}
