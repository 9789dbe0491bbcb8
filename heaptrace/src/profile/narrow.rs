//! Profiles narrowed from a whole one: what happened after a baseline (the live view's reset),
//! and the part about one process (`--pid`, the live view's focus).
use super::*;

impl Profile {
    /// What happened after `base`, an earlier state of this same Profile: counters are the
    /// differences (live figures too, so they can be negative), the timeline keeps the rows
    /// that end after `base`'s last round (a row of a coarsened timeline that began before it
    /// is kept whole). Memory figures, leaks and stacks are the current ones.
    pub fn since(&self, base: &Profile) -> Profile {
        let last = base.rounds.last().map_or(0, |r| r.index);
        let mut out = Profile {
            rounds: self
                .rounds
                .iter()
                .filter(|r| r.index > last)
                .cloned()
                .collect(),
            timeline_step: self.timeline_step,
            stacks: self.stacks.clone(),
            leaks: self.leaks.clone(),
            peak: self.peak.clone().filter(|p| p.round > last),
            sample_bytes: self.sample_bytes,
            weights: self.weights.clone(),
            calls: self.calls,
            latency_every: self.latency_every,
            wrapper_rule: self.wrapper_rule.clone(),
            ..Profile::default()
        };
        out.samples = map_delta(&self.samples, &base.samples, SiteTotals::minus);
        for (pid, p) in &self.procs {
            let mut p = p.clone();
            if let Some(b) = base.procs.get(pid) {
                p.totals = p.totals.minus(&b.totals);
            }
            out.procs.insert(*pid, p);
        }
        out.sizes = map_delta(&self.sizes, &base.sizes, |a, b| a.saturating_sub(*b));
        for (i, l) in self.losses.iter().enumerate() {
            out.losses[i] = l.saturating_sub(base.losses[i]);
        }
        out.sites = map_delta(&self.sites, &base.sites, SiteTotals::minus);
        for (f, h) in self.latency.iter().enumerate() {
            for (b, n) in h.iter().enumerate() {
                out.latency[f][b] = n.saturating_sub(base.latency[f][b]);
            }
        }
        out.reservations = map_delta(&self.reservations, &base.reservations, |t, b| ResTotals {
            calls: t.calls - b.calls,
            bytes: t.bytes - b.bytes,
        });
        out
    }

    /// The part of this Profile about one process. The timeline, losses and latencies stay
    /// those of all processes (the kernel keeps them per function, not per process; but see
    /// [`Profile::losses_of`] for stacks); the peak is dropped, since it was measured over all
    /// of them.
    pub fn only(&self, pid: u32) -> Profile {
        Profile {
            rounds: self.rounds.clone(),
            timeline_step: self.timeline_step,
            max_round_gap_ms: self.max_round_gap_ms,
            procs: of_pid(&self.procs, pid),
            sizes: of_pid(&self.sizes, pid),
            losses: self.losses,
            sites: of_pid(&self.sites, pid),
            stacks: of_pid(&self.stacks, pid),
            latency: self.latency,
            peak: None,
            sample_bytes: self.sample_bytes,
            calls: self.calls,
            latency_every: self.latency_every,
            folded: Default::default(),
            samples: of_pid(&self.samples, pid),
            weights: of_pid(&self.weights, pid),
            leaks: self.leaks.as_ref().map(|l| of_pid(l, pid)),
            before_attach: self.before_attach.filter(|b| b.pid == pid),
            reservations: of_pid(&self.reservations, pid),
            unsafe_files: self.unsafe_files,
            collector: self.collector,
            region_lost: self.region_lost,
            incomplete: self.incomplete.clone(),
            wrapper_rule: self.wrapper_rule.clone(),
            wrappers_cache: Default::default(),
        }
    }
}

/// A key whose first field is the process (key) it belongs to.
trait OfPid {
    fn pid(&self) -> u32;
}

impl OfPid for u32 {
    fn pid(&self) -> u32 {
        *self
    }
}

impl<A> OfPid for (u32, A) {
    fn pid(&self) -> u32 {
        self.0
    }
}

impl<A, B> OfPid for (u32, A, B) {
    fn pid(&self) -> u32 {
        self.0
    }
}

impl<A, B, C> OfPid for (u32, A, B, C) {
    fn pid(&self) -> u32 {
        self.0
    }
}

/// The entries of `m` that belong to process `pid`.
fn of_pid<K: OfPid + Ord + Clone, V: Clone>(m: &BTreeMap<K, V>, pid: u32) -> BTreeMap<K, V> {
    m.iter()
        .filter(|(k, _)| k.pid() == pid)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}
