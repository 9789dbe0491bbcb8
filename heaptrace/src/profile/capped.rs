//! The JSON document's processes capped (`--json-max-processes`): a day of `--all` sees
//! tens of thousands of processes, and a document with each one's sites and frames runs to
//! hundreds of MB that nothing opens. Past the cap, the processes that allocated least are
//! folded into `[N ... processes]` as ended ones are (`exited.rs`): their counts add up there
//! and their sites merge by frames, so the totals stay exact and the document says how many.
use std::collections::BTreeMap;

use super::{Profile, exited::FOLDED};

impl Profile {
    /// Keeps the `max` processes that allocated the most bytes (OOM victims always, and the
    /// processes folded already as one); folds the others into [`FOLDED`]. Returns how many
    /// were folded here.
    pub fn keep_processes(&mut self, max: usize) -> u64 {
        let mut order: Vec<(u64, u32)> = self
            .procs
            .iter()
            .filter(|(key, p)| **key != FOLDED && !p.oom_killed)
            .map(|(key, p)| (p.totals.bytes_allocated(), *key))
            .collect();
        if order.len() <= max {
            return 0;
        }
        // Most bytes first; of equals, the lower key (the earlier pid) stays.
        order.sort_by_key(|(bytes, key)| (std::cmp::Reverse(*bytes), *key));
        let mut leaks = self.leaks.take();
        let mut scratch = BTreeMap::new();
        let mut running = false;
        for (_, key) in &order[max..] {
            running |= self.procs.get(key).is_some_and(|p| !p.exited);
            self.fold(*key, leaks.as_mut().unwrap_or(&mut scratch));
        }
        self.leaks = leaks;
        let folded = (order.len() - max) as u64;
        self.folded.document += folded;
        if let Some(f) = self.procs.get_mut(&FOLDED) {
            f.exited &= !running;
            f.leaks_at_exit = f.exited;
            if running {
                f.comm = format!("[{} processes]", self.folded.processes);
            }
        }
        folded
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        drain::round::{Leak, SiteTotals},
        profile::ProcProfile,
        symbolize::test_frames as frames,
    };

    /// Five processes allocating 100, 200, ... 500 bytes at the same code (stack 3), one
    /// running; the first leaked a block.
    fn five() -> Profile {
        let mut p = Profile::default();
        for pid in 1..=5u32 {
            let mut pp = ProcProfile {
                comm: format!("p{pid}"),
                exited: pid != 2,
                ..Default::default()
            };
            let f = &mut pp.totals.funcs[heaptrace_common::Func::Malloc as usize];
            f.calls = pid as u64;
            f.bytes = 100 * pid as u64;
            pp.totals.funcs[heaptrace_common::Func::Free as usize].calls = 1;
            p.procs.insert(pid, pp);
            p.stacks.insert((pid, 3), frames(&["work", "main"]));
            let t = SiteTotals {
                calls: pid as u64,
                bytes: 100 * pid as u64,
                ..Default::default()
            };
            p.sites.insert((pid, 3, 0), t);
        }
        let leak = Leak {
            blocks: 1,
            bytes: 100,
        };
        p.leaks = Some(BTreeMap::from([((1, 3, 0), leak)]));
        p
    }

    #[test]
    fn past_the_cap_the_least_allocating_fold_with_exact_totals() {
        let mut p = five();
        let before = p.totals();
        assert_eq!(p.keep_processes(2), 3);
        assert_eq!(p.totals(), before, "the sums are the same");
        let kept: Vec<u32> = p.procs.keys().copied().collect();
        assert_eq!(kept, [4, 5, FOLDED]);
        let f = &p.procs[&FOLDED];
        assert_eq!(f.comm, "[3 processes]", "one of them was running");
        assert!(!f.exited);
        assert_eq!(f.totals.allocations(), 1 + 2 + 3);
        assert_eq!(f.totals.bytes_allocated(), 600);
        assert_eq!(f.totals.frees(), 3);
        assert_eq!(p.folded.document, 3);
        // One site for the same code in the three.
        let folded: Vec<_> = p.sites.iter().filter(|(k, _)| k.0 == FOLDED).collect();
        assert_eq!(folded.len(), 1);
        assert_eq!(folded[0].1.bytes, 600);
        let leaks = p.leaks.as_ref().unwrap();
        assert_eq!(leaks.keys().map(|k| k.0).collect::<Vec<_>>(), [FOLDED]);
        assert!(p.stacks.keys().all(|k| k.0 != 1 && k.0 != 2 && k.0 != 3));
    }

    #[test]
    fn under_the_cap_nothing_moves_and_ended_ones_fold_as_exited() {
        let mut p = five();
        assert_eq!(p.keep_processes(5), 0);
        assert_eq!(p.procs.len(), 5);
        p.procs.get_mut(&2).unwrap().exited = true;
        assert_eq!(p.keep_processes(3), 2);
        assert_eq!(p.procs[&FOLDED].comm, "[2 exited processes]");
        assert!(p.procs[&FOLDED].exited);
    }
}
