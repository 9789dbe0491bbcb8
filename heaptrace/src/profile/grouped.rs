//! Processes grouped by command (`--group-by command`): on a busy host 36 `cc1` are one
//! process of the Profile, with their counts summed and their sites merged by frames (the
//! same code at another address in each process is one site), as ended processes fold into
//! `[N exited processes]` (`exited.rs`). A command run once keeps its own process.
use std::collections::BTreeMap;

use super::*;

/// Group keys: `GROUPS + n` for the nth group; below [`exited::FOLDED`], above any process
/// key a trace gives (those of the 1,023rd process with a pid and less).
pub const GROUPS: u32 = 0xFFFF_0000;

/// Whether `key` is a group's.
pub fn is_group(key: u32) -> bool {
    (GROUPS..exited::FOLDED).contains(&key)
}

impl Profile {
    /// This Profile with the processes of each command run more than once as one. The peak
    /// keeps its figure; its sites are moved with their processes.
    pub fn by_command(&self) -> Profile {
        let mut out = self.clone();
        let mut by_comm: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
        for (key, p) in &self.procs {
            if *key != exited::FOLDED {
                by_comm.entry(p.comm.as_str()).or_default().push(*key);
            }
        }
        let mut leaks = out.leaks.take();
        let mut scratch = BTreeMap::new();
        let groups = by_comm.into_values().filter(|keys| keys.len() > 1);
        for (n, keys) in groups.take((exited::FOLDED - GROUPS) as usize).enumerate() {
            let into = GROUPS + n as u32;
            for key in &keys {
                let Some(p) = out.procs.remove(key) else {
                    continue;
                };
                let g = out.procs.entry(into).or_default();
                g.totals.plus(&p.totals);
                g.comm = format!("{} ({} processes)", p.comm, keys.len());
                g.exited = keys.iter().all(|k| self.procs[k].exited);
                g.leaks_at_exit = g.exited;
                g.oom_killed |= p.oom_killed;
                g.peak_rss_kb = g.peak_rss_kb.max(p.peak_rss_kb);
                g.cgroup.clone_from(&p.cgroup);
                out.move_sites(
                    *key,
                    into,
                    leaks.as_mut().unwrap_or(&mut scratch),
                    &mut || {},
                );
            }
        }
        out.leaks = leaks;
        out
    }

    /// How many processes a Profile process stands for: a group's count, else 1.
    pub fn processes_in(&self, key: u32) -> usize {
        if !is_group(key) {
            return 1;
        }
        let comm = self.procs.get(&key).map_or("", |p| p.comm.as_str());
        comm.rsplit_once(" (")
            .and_then(|(_, n)| n.strip_suffix(" processes)")?.parse().ok())
            .unwrap_or(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{drain::round::SiteTotals, symbolize::test_frames as frames};

    /// Three cc1 (the same stack at other ids in each) and one ld: the cc1 are one process
    /// with one site, ld is left as it was.
    #[test]
    fn processes_of_one_command_are_one_with_their_sites_by_frames() {
        let mut p = Profile::default();
        let mut leaks = BTreeMap::new();
        for (pid, comm, stack) in [
            (10, "cc1", 5),
            (11, "cc1", 6),
            (12, "cc1", 7),
            (13, "ld", 5),
        ] {
            let mut totals = crate::drain::round::Totals::default();
            totals.funcs[heaptrace_common::Func::Malloc as usize].calls = 100;
            p.procs.insert(
                pid,
                ProcProfile {
                    comm: comm.into(),
                    totals,
                    ..Default::default()
                },
            );
            p.sites.insert(
                (pid, stack, 0),
                SiteTotals {
                    calls: 100,
                    bytes: 1000,
                    ..Default::default()
                },
            );
            p.stacks.insert((pid, stack), frames(&["parse", "main"]));
            leaks.insert(
                (pid, stack, 0),
                crate::drain::round::Leak {
                    blocks: 1,
                    bytes: 10,
                },
            );
        }
        p.leaks = Some(leaks);
        let g = p.by_command();
        assert_eq!(g.procs.len(), 2);
        let cc1 = &g.procs[&GROUPS];
        assert_eq!(cc1.comm, "cc1 (3 processes)");
        assert_eq!(cc1.totals.allocations(), 300);
        assert_eq!(g.processes_in(GROUPS), 3);
        assert_eq!(g.processes_in(13), 1);
        let sites: Vec<_> = g.sites.iter().filter(|(k, _)| k.0 == GROUPS).collect();
        assert_eq!(sites.len(), 1, "{sites:?}");
        assert_eq!((sites[0].1.calls, sites[0].1.bytes), (300, 3000));
        assert_eq!(g.frames(sites[0].0).len(), 2);
        let leaked = g.leaks.as_ref().unwrap()[sites[0].0];
        assert_eq!((leaked.blocks, leaked.bytes), (3, 30));
        // ld, alone, keeps its pid and site.
        assert_eq!(g.sites[&(13, 5, 0)].calls, 100);
        assert_eq!(g.procs[&13].comm, "ld");
        // The whole is unchanged.
        assert_eq!(g.totals().allocations(), p.totals().allocations());
    }
}
