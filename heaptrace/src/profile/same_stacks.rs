//! Sites are told apart by the stacks shown, not by the kernel's stack ids. The kernel hashes
//! the whole walk; heaptrace keeps fewer frames (`--stack-depth`, and none past the point where
//! a frame-pointer walk left the code). Kernel stacks that differ only past the frames kept are
//! one stack as shown, so their counts go under one site: the first such stack's id. Without
//! this, `--stack-depth 1` listed one caller as many sites with the same text.
//!
//! The kernel's counters stay per kernel id (rounds are differences of them); each round, and
//! the leaks, are then put under the ids kept, summed.
//!
//! A kernel id freed while its process lives (an idle stack, `drain::idle`) and then taken by
//! another stack is told apart here too: the process's old translation of it is forgotten
//! (`forget_id`), its next site with that id is named anew and merged by its frames, and
//! where its frames are new while the id is shown already for the old ones, the site gets
//! an id of user space's own (`FIRST_OWN_ID` on), never two stacks under one.
use std::{collections::BTreeMap, hash::BuildHasher, sync::Arc};

// Frames hashed every new stack: foldhash, seeded per run, is several times faster than SipHash.
use foldhash::{HashMap, HashSet, fast::RandomState};

use crate::{
    drain::round::Leak,
    drain::round::{Round, SiteId},
    symbolize::Frame,
};

/// Stacks kept, each with its frames.
type Kept = Vec<(i32, Arc<[Frame]>)>;

/// The first id user space gives a stack whose kernel id shows another stack already: above
/// the kernel's ids and its callers' (`heaptrace_common::CALLER_ID_BASE` on, fewer than 2^17).
pub const FIRST_OWN_ID: i32 = (1 << 30) + (1 << 29);

#[derive(Default)]
pub struct SameStacks {
    /// (process, kernel stack id) -> the id its site goes under; every stack seen is here.
    to: HashMap<(u32, i32), i32>,
    /// (process, hash of the frames) -> the stacks kept with that hash, and their frames.
    kept: HashMap<(u32, u64), Kept>,
    /// Each process's entries in `to` and `kept` (kernel id, hash of the frames): forgetting
    /// a process takes its own, not a scan of every process's (thousands end a minute).
    of: HashMap<u32, Vec<(i32, u64)>>,
    /// Stacks put under another's id so far: none, and rounds are left as they are.
    merged: usize,
    /// Per process, the ids shown for a stack whose kernel id was forgotten since
    /// (`forget_id`): a new stack with that kernel id must be shown under another.
    shown: HashMap<u32, HashSet<i32>>,
    /// The next id of user space's own (`FIRST_OWN_ID`).
    next_own: i32,
    hasher: RandomState,
}

impl SameStacks {
    pub fn knows(&self, pid: u32, id: i32) -> bool {
        self.to.contains_key(&(pid, id))
    }

    /// A stack of `pid` seen for the first time, with its frames as kept. Returns the id its
    /// site goes under: that of an earlier stack of the process with the same frames, or its
    /// own (or, where its own shows another stack already, a new one); and whether that id is
    /// new, its frames to be given with the round.
    pub fn add(&mut self, pid: u32, id: i32, frames: &Arc<[Frame]>) -> (i32, bool) {
        let hash = self.hasher.hash_one(&**frames);
        let same = self.kept.entry((pid, hash)).or_default();
        let (to, new) = match same.iter().find(|(_, f)| **f == **frames) {
            Some((earlier, _)) => {
                self.merged += 1;
                (*earlier, false)
            }
            None => {
                let taken = self.shown.get(&pid).is_some_and(|s| s.contains(&id));
                let to = match self.next_own.max(FIRST_OWN_ID).checked_add(1) {
                    Some(next) if taken => {
                        self.merged += 1;
                        std::mem::replace(&mut self.next_own, next).max(FIRST_OWN_ID)
                    }
                    _ => id,
                };
                same.push((to, frames.clone()));
                (to, true)
            }
        };
        if self.to.insert((pid, id), to).is_none() {
            self.of.entry(pid).or_default().push((id, hash));
        }
        (to, new)
    }

    /// The kernel id `id` of `pid` holds another stack from now on (it was freed while the
    /// process lived, and taken): its next site is named anew. The id it was shown under
    /// stays that of the stack it held.
    pub fn forget_id(&mut self, pid: u32, id: i32) {
        if let Some(to) = self.to.remove(&(pid, id)) {
            self.shown.entry(pid).or_default().insert(to);
        }
    }

    /// The site a kernel site's counts go under. Lost stacks (negative ids) and blocks without
    /// a stack are sites of their own.
    pub fn site(&self, (pid, id, func): SiteId) -> SiteId {
        (pid, self.to.get(&(pid, id)).copied().unwrap_or(id), func)
    }

    /// Puts a round's sites, sizes and reservations under the ids kept.
    pub fn round(&self, round: &mut Round) {
        if self.merged == 0 {
            return;
        }
        round.sites = merge(
            std::mem::take(&mut round.sites),
            |k| self.site(k),
            |a, b| a.plus(b),
        );
        round.sizes = merge(
            std::mem::take(&mut round.sizes),
            |(pid, func, size, id)| (pid, func, size, self.site((pid, id, func)).1),
            |a, b| *a = a.wrapping_add(*b),
        );
        round.reservations = merge(
            std::mem::take(&mut round.reservations),
            |(pid, kind, id, func)| (pid, kind, self.site((pid, id, func)).1, func),
            |a, b| a.plus(b),
        );
    }

    /// Leaks by the sites kept.
    pub fn leaks(&self, leaks: BTreeMap<SiteId, Leak>) -> BTreeMap<SiteId, Leak> {
        merge(
            leaks,
            |k| self.site(k),
            |a, b| {
                a.blocks += b.blocks;
                a.bytes += b.bytes;
            },
        )
    }

    /// A process is gone: a new one with its pid has stacks of its own.
    pub fn forget(&mut self, pid: u32) {
        self.shown.remove(&pid);
        for (id, hash) in self.of.remove(&pid).unwrap_or_default() {
            self.to.remove(&(pid, id));
            self.kept.remove(&(pid, hash));
        }
    }
}

fn merge<K: Ord + Copy, V>(
    map: BTreeMap<K, V>,
    key: impl Fn(K) -> K,
    add: impl Fn(&mut V, &V),
) -> BTreeMap<K, V> {
    let mut out: BTreeMap<K, V> = BTreeMap::new();
    for (k, v) in map {
        match out.entry(key(k)) {
            std::collections::btree_map::Entry::Occupied(mut e) => add(e.get_mut(), &v),
            std::collections::btree_map::Entry::Vacant(e) => {
                e.insert(v);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{drain::round::SiteTotals, symbolize::test_frames as frames};

    #[test]
    fn stacks_shown_the_same_are_one_site_per_process() {
        let mut s = SameStacks::default();
        assert_eq!(s.add(1, 10, &frames(&["a", "b"])), (10, true));
        assert_eq!(s.add(1, 11, &frames(&["a", "b"])), (10, false));
        assert_eq!(s.add(1, 12, &frames(&["a", "c"])), (12, true));
        assert_eq!(
            s.add(2, 11, &frames(&["a", "b"])),
            (11, true),
            "another process"
        );
        assert!(s.knows(1, 11) && !s.knows(1, 13));

        let mut round = Round::default();
        let t = |calls| SiteTotals {
            calls,
            ..SiteTotals::default()
        };
        round.sites.insert((1, 10, 0), t(1));
        round.sites.insert((1, 11, 0), t(2));
        round.sites.insert((1, 11, 2), t(4));
        round.sites.insert((1, 12, 0), t(8));
        round.sites.insert((1, -17, 0), t(16));
        round.sizes.insert((1, 0, 24, 10), 1);
        round.sizes.insert((1, 0, 24, 11), 2);
        s.round(&mut round);
        let calls: Vec<(SiteId, u64)> = round.sites.iter().map(|(k, v)| (*k, v.calls)).collect();
        assert_eq!(
            calls,
            [
                ((1, -17, 0), 16),
                ((1, 10, 0), 3),
                ((1, 10, 2), 4),
                ((1, 12, 0), 8)
            ]
        );
        assert_eq!(round.sizes, BTreeMap::from([((1, 0, 24, 10), 3)]));

        let leaks = BTreeMap::from([
            (
                (1, 10, 0),
                Leak {
                    blocks: 1,
                    bytes: 5,
                },
            ),
            (
                (1, 11, 0),
                Leak {
                    blocks: 2,
                    bytes: 7,
                },
            ),
        ]);
        assert_eq!(
            s.leaks(leaks),
            BTreeMap::from([(
                (1, 10, 0),
                Leak {
                    blocks: 3,
                    bytes: 12
                }
            )])
        );

        s.forget(1);
        assert!(!s.knows(1, 10) && !s.knows(1, 11) && !s.knows(1, 12) && s.knows(2, 11));
        assert!(s.kept.keys().all(|k| k.0 == 2) && !s.of.contains_key(&1));
        // Its pid given again: stacks of its own, the old ones' ids as any other.
        assert_eq!(s.add(1, 11, &frames(&["a", "b"])), (11, true));
    }

    #[test]
    fn a_kernel_id_taken_by_another_stack_of_the_process_is_never_two_sites() {
        let mut s = SameStacks::default();
        assert_eq!(s.add(1, 10, &frames(&["a", "b"])), (10, true));
        assert_eq!(s.add(1, 20, &frames(&["c"])), (20, true));
        // Id 10 freed while idle, then taken by another stack of the same process.
        s.forget_id(1, 10);
        assert!(!s.knows(1, 10));
        let (own, new) = s.add(1, 10, &frames(&["x", "y"]));
        assert!(new && own >= FIRST_OWN_ID, "{own}");
        assert_eq!(s.site((1, 10, 0)), (1, own, 0));
        // The old stack back under another kernel id: its first site, by its frames.
        assert_eq!(s.add(1, 30, &frames(&["a", "b"])), (10, false));
        // Taken again by a third stack: yet another id of user space's own.
        s.forget_id(1, 10);
        let (third, _) = s.add(1, 10, &frames(&["z"]));
        assert!(third > own);
        // Id 20 freed and taken back by its own stack: its site again.
        s.forget_id(1, 20);
        assert_eq!(s.add(1, 20, &frames(&["c"])), (20, false));
        // Another process's id 10 is its own.
        assert_eq!(s.add(2, 10, &frames(&["x", "y"])), (10, true));
        let mut round = Round::default();
        let t = |calls| SiteTotals {
            calls,
            ..SiteTotals::default()
        };
        round.sites.insert((1, 10, 0), t(1));
        round.sites.insert((1, 30, 0), t(2));
        s.round(&mut round);
        let calls: Vec<(SiteId, u64)> = round.sites.iter().map(|(k, v)| (*k, v.calls)).collect();
        assert_eq!(calls, [((1, 10, 0), 2), ((1, third, 0), 1)]);
        s.forget(1);
        assert_eq!(s.add(1, 10, &frames(&["x", "y"])), (10, true));
    }
}
