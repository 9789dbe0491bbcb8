//! Processes that had the same pid. The kernel gives a pid again once its process is gone (on
//! this machine after 32,768 processes: minutes on a busy host), so a long system-wide trace
//! meets several processes with one pid. Every figure is keyed by a *process key*: the pid,
//! and in the bits above the largest pid Linux gives (2^22), how many processes of the trace
//! had that pid before. The first process with a pid keys as the pid itself, so a trace
//! without reuse (and every recording made before this) reads as it did. Before, the second
//! process's counts were added to the first's, under its name and exit.
use std::collections::{BTreeMap, HashMap};

use crate::drain::round::{Round, SiteId};

/// Linux's PID_MAX_LIMIT on 64-bit hosts is 2^22.
const PID_BITS: u32 = 22;

/// A process key, shown as its pid, then `#N` for the Nth process with that pid in the trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pid(pub u32);

impl Pid {
    pub fn real(self) -> u32 {
        self.0 & ((1 << PID_BITS) - 1)
    }

    /// How many processes of the trace had this pid before this one.
    pub fn earlier(self) -> u32 {
        self.0 >> PID_BITS
    }
}

impl std::fmt::Display for Pid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Padded as a number would be, for the tables.
        if self.0 == crate::profile::exited::FOLDED {
            return f.pad("exited");
        }
        match self.earlier() {
            0 => f.pad(&self.real().to_string()),
            n => f.pad(&format!("{}#{}", self.real(), n + 1)),
        }
    }
}

/// The daemon's count of processes seen with each pid.
#[derive(Default)]
pub struct Incarnations {
    earlier: HashMap<u32, u32>,
}

impl Incarnations {
    /// The key of the process that has `pid` now.
    pub fn key(&self, pid: u32) -> u32 {
        let n = self.earlier.get(&pid).copied().unwrap_or(0);
        (n.min((1 << (32 - PID_BITS)) - 1) << PID_BITS) | pid
    }

    /// `pid` belongs to a new process: the one known by it is gone.
    pub fn next(&mut self, pid: u32) {
        *self.earlier.entry(pid).or_default() += 1;
    }

    /// Puts a round's figures (read by pid) under the process keys.
    pub fn rekey(&self, round: &mut Round) {
        if self.earlier.is_empty() {
            return;
        }
        let key = |pid: u32| self.key(pid);
        remap(&mut round.procs, key);
        remap(&mut round.mem, key);
        remap(&mut round.reserved, key);
        remap(&mut round.sizes, |(p, f, s, id)| (key(p), f, s, id));
        remap(&mut round.sites, |(p, id, f)| (key(p), id, f));
        remap(&mut round.reservations, |(p, kind, id, f)| {
            (key(p), kind, id, f)
        });
        remap(&mut round.stacks, |(p, id)| (key(p), id));
        remap(&mut round.peaks, key);
        for p in &mut round.restarted {
            *p = key(*p);
        }
    }

    /// Leaks (or any map keyed by site) read by pid, under the process keys.
    pub fn rekey_sites<V>(&self, mut m: BTreeMap<SiteId, V>) -> BTreeMap<SiteId, V> {
        remap(&mut m, |(p, id, f)| (self.key(p), id, f));
        m
    }
}

/// A map's keys changed by `key`, one to one (a process key is one pid's).
fn remap<K: Ord, V>(map: &mut BTreeMap<K, V>, key: impl Fn(K) -> K) {
    *map = std::mem::take(map)
        .into_iter()
        .map(|(k, v)| (key(k), v))
        .collect();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drain::round::{ProcRound, SiteTotals};

    #[test]
    fn the_second_process_with_a_pid_is_kept_apart() {
        let mut inc = Incarnations::default();
        assert_eq!(inc.key(31395), 31395);
        assert_eq!(Pid(31395).to_string(), "31395");
        inc.next(31395);
        let second = inc.key(31395);
        assert_ne!(second, 31395);
        assert_eq!(Pid(second).real(), 31395);
        assert_eq!(Pid(second).to_string(), "31395#2");
        assert_eq!(format!("{:>8}|", Pid(second)), " 31395#2|");
        assert_eq!(inc.key(7), 7, "other pids");

        let mut round = Round::default();
        round.procs.insert(31395, ProcRound::default());
        round.procs.insert(7, ProcRound::default());
        round.sites.insert((31395, 4, 0), SiteTotals::default());
        round.sizes.insert((31395, 0, 24, 4), 1);
        round.restarted.push(31395);
        inc.rekey(&mut round);
        assert_eq!(round.procs.keys().copied().collect::<Vec<_>>(), [7, second]);
        assert_eq!(round.sites.keys().next(), Some(&(second, 4, 0)));
        assert_eq!(round.sizes.keys().next(), Some(&(second, 0, 24, 4)));
        assert_eq!(round.restarted, [second]);
    }
}
