//! Stack ids freed while their processes live: the kernel's stack map holds a working set, not
//! every stack a process makes over its life.
//!
//! A stack keeps its id in `STACK_OWNERS` while it is used. One that holds no live block, is
//! no part of a process's peak nor of a reserved region, and was not counted in the last
//! `IDLE_ROUNDS` rounds has its id freed (its site and size keys are all retired by then, in
//! user space's archive); its figures stay where they are, under its id. When it comes back it
//! is stored anew: under the same id (both come from its hash) unless another stack took that
//! one meanwhile, and then under its second, which `SameStacks` merges with the first by its
//! frames. An id freed this way and then taken by another stack (`read_frames` compares the
//! hashes) is named anew for the processes that used it (`SameStacks::forget_id`).
use super::*;
use crate::drain::round::Round;

/// Rounds a stack goes uncounted before its id is freed, at first: its keys of the round it
/// was last counted in are retired at the next read (`retire`), so after two no kernel key
/// names it.
pub const IDLE_ROUNDS: u64 = 2;
/// The most rounds a stack waits. A stack freed that comes back within the rounds it waited
/// waits twice as long the next time: one in use whose counts the site map had no room for
/// (`lost.site_map`) looks idle, and would otherwise be freed and stored again every round.
pub const MAX_IDLE_ROUNDS: u64 = 64;

/// A stored stack: its last round counted or stored, and the rounds it must go uncounted.
#[derive(Clone, Copy, Debug)]
struct Held {
    seen: u64,
    wait: u64,
}

/// A stack freed while idle: the processes that counted under it (told when another stack
/// takes its id), and when it was freed, after how long a wait.
#[derive(Debug)]
struct Gone {
    users: Vec<u32>,
    at: u64,
    wait: u64,
}

/// Which stored stacks were counted when, and which processes used those freed while idle.
#[derive(Default)]
pub struct IdleStacks {
    /// Each stored stack (kernel ids).
    last: FastMap<i32, Held>,
    /// The stacks freed while idle and not stored again.
    gone: FastMap<i32, Gone>,
}

impl IdleStacks {
    /// Notes the stacks stored (`stored`) and those counted in `round` (kernel ids, before the
    /// filter and `SameStacks`). Call `taken` for the ids another stack took first.
    pub fn note(&mut self, stored: &[i32], round: &Round) {
        let now = round.index;
        for id in stored {
            // Back soon after it was freed: it waits longer the next time.
            let wait = match self.gone.remove(id) {
                Some(g) if now.saturating_sub(g.at) <= g.wait => (g.wait * 2).min(MAX_IDLE_ROUNDS),
                _ => IDLE_ROUNDS,
            };
            self.last.insert(*id, Held { seen: now, wait });
        }
        for (_, id, _) in round.sites.keys() {
            if stored_id(*id) {
                let h = self.last.entry(*id).or_insert(Held {
                    seen: now,
                    wait: IDLE_ROUNDS,
                });
                h.seen = now;
            }
        }
    }

    /// The stacks to free now: uncounted for as long as each waits and held by nothing of
    /// `snap` (a live block, a peak) nor by `held` (reserved regions), with the processes
    /// that counted under each.
    pub fn pick(
        &self,
        snap: &Snapshot,
        now: u64,
        held: impl Fn(i32) -> bool,
    ) -> FastMap<i32, Vec<u32>> {
        let mut idle: FastMap<i32, Vec<u32>> = self
            .last
            .iter()
            .filter(|(id, h)| now.saturating_sub(h.seen) >= h.wait && !held(**id))
            .map(|(id, _)| (*id, Vec::new()))
            .collect();
        if idle.is_empty() {
            return idle;
        }
        for (k, p) in &snap.peaks {
            idle.remove(&p.stack_id);
            for s in snap.peak_held.get(k).iter().flat_map(|h| &h.sites) {
                idle.remove(&s.0);
            }
        }
        for ((pid, id, _), t) in &snap.sites {
            if t.live_blocks != 0 || t.live_bytes != 0 {
                idle.remove(id);
            } else if let Some(users) = idle.get_mut(id)
                && users.last() != Some(pid)
            {
                users.push(*pid);
            }
        }
        idle
    }

    /// Stacks freed with the processes that held them: nothing to remember of them.
    pub fn dropped(&mut self, ids: impl IntoIterator<Item = i32>) {
        for id in ids {
            self.last.remove(&id);
            self.gone.remove(&id);
        }
    }

    /// The stacks `pick`ed in round `now`, freed (`freed`) or not: each freed one is
    /// remembered until it is stored again.
    pub fn freed_idle(&mut self, picked: FastMap<i32, Vec<u32>>, freed: &Freed, now: u64) {
        for (id, users) in picked {
            let held = self.last.remove(&id);
            if freed.contains_key(&id) {
                let wait = held.map_or(IDLE_ROUNDS, |h| h.wait);
                self.gone.insert(
                    id,
                    Gone {
                        users,
                        at: now,
                        wait,
                    },
                );
            }
        }
    }

    /// The processes that used an id freed while idle, which another stack took now.
    pub fn taken(&mut self, id: i32) -> Vec<u32> {
        self.gone.remove(&id).map(|g| g.users).unwrap_or_default()
    }

    /// How many stored stacks are known.
    pub fn held(&self) -> usize {
        self.last.len()
    }
}

/// An id of `STACK_OWNERS` (not a lost stack, nor a caller's).
fn stored_id(id: i32) -> bool {
    u32::try_from(id).is_ok_and(|u| u < CALLER_ID_BASE)
}

impl KernelMaps {
    /// Frees the ids of idle stacks of live processes (`IdleStacks::pick`), remembering each
    /// one's hash: the same stack stored again under it is the same site, another is not.
    /// Returns what each held, as `free_stacks`. None is in FRAMES: read at the last drain,
    /// and held since, so no stack could store its frames under it.
    pub fn free_idle_stacks(&mut self, ids: Vec<i32>) -> Freed {
        let mut freed = Freed::new();
        // The hash from the archive, the deletes in batches (as `free_stacks`): an id held
        // since the last read has its stack there.
        let mut picked: Vec<(u32, u64, HeldStack)> = Vec::new();
        for id in ids {
            let Some(u) = u32::try_from(id).ok().filter(|u| *u < CALLER_ID_BASE) else {
                continue;
            };
            let Some(hash) = self.archive.get(&u).map(|(hash, _)| *hash) else {
                continue;
            };
            picked.push((u, hash, self.stack(id)));
        }
        let gone = self.delete_owners(picked.iter().map(|(u, ..)| *u).collect());
        for ((u, hash, held), gone) in picked.into_iter().zip(gone) {
            if gone {
                self.archive.remove(&u);
                self.idle.insert(u, hash);
                freed.insert(u as i32, held);
            }
        }
        if !freed.is_empty() {
            next_stack_generation(&self.stack_cache, &self.stack_gen);
        }
        freed
    }

    /// The ids stored since the last read (`read_frames`), and those of them that were freed
    /// while idle and are now another stack's.
    pub fn take_stored(&mut self) -> (Vec<i32>, Vec<i32>) {
        (
            std::mem::take(&mut self.stored),
            std::mem::take(&mut self.rebound),
        )
    }

    /// A stack read from FRAMES: whether its id was freed while idle and now holds another.
    pub(super) fn stored_anew(&mut self, id: u32, hash: u64) {
        self.stored.push(id as i32);
        if self.idle.remove(&id).is_some_and(|h| h != hash) {
            self.rebound.push(id as i32);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drain::round::{KernelPeak, PeakHeld, SiteTotals};

    fn t(live: i64) -> SiteTotals {
        SiteTotals {
            calls: 1,
            live_blocks: live,
            live_bytes: live * 8,
            ..SiteTotals::default()
        }
    }

    #[test]
    fn only_stacks_uncounted_for_rounds_and_holding_nothing_are_freed() {
        let mut idle = IdleStacks::default();
        let mut r = Round {
            index: 1,
            ..Round::default()
        };
        for id in [1, 2, 3, 4, 5, 6] {
            r.sites.insert((7, id, 0), t(0));
        }
        r.sites.insert((8, 1, 0), t(0));
        r.sites.insert((7, -12, 0), t(0));
        r.sites.insert((7, CALLER_ID_BASE as i32 + 3, 0), t(0));
        idle.note(&[9], &r);
        // Counted again in round 2: not idle until round 4.
        let r2 = Round {
            index: 2,
            sites: BTreeMap::from([((7, 6, 0), t(0))]),
            ..Round::default()
        };
        idle.note(&[], &r2);
        let mut snap = Snapshot::default();
        for id in [1, 3, 4, 5, 6] {
            snap.sites.insert((7, id, 0), t(0));
        }
        snap.sites.insert((8, 1, 0), t(0));
        // A live block, on one of its sites only.
        snap.sites.insert((7, 2, 1), t(1));
        snap.sites.insert((7, 2, 0), t(0));
        // At a peak, and the peak's stack.
        snap.peaks.insert(
            7,
            KernelPeak {
                bytes: 1,
                size: 1,
                stack_id: 3,
            },
        );
        snap.peak_held.insert(
            7,
            PeakHeld {
                bytes: 1,
                blocks: 1,
                sites: vec![(4, 0, 1, 8)],
            },
        );
        assert!(idle.pick(&snap, 2, |_| false).is_empty(), "too soon");
        let mut picked: Vec<(i32, Vec<u32>)> =
            idle.pick(&snap, 3, |id| id == 5).into_iter().collect();
        picked.sort();
        // 9: stored, never counted (its count lost): idle all the same.
        assert_eq!(picked, [(1, vec![7, 8]), (9, vec![])]);
        let at4: FastMap<i32, Vec<u32>> = idle.pick(&snap, 4, |_| false);
        assert!(at4.contains_key(&6) && at4.contains_key(&5));

        let freed = Freed::from_iter([(1, None), (9, None)]);
        idle.freed_idle(idle.pick(&snap, 3, |id| id == 5), &freed, 3);
        assert_eq!(idle.held(), 5);
        assert_eq!(idle.taken(1), [7, 8]);
        assert!(idle.taken(1).is_empty());
        assert!(idle.taken(9).is_empty(), "no process counted under it");
        idle.dropped([6]);
        assert_eq!(idle.held(), 4);
    }

    #[test]
    fn a_stack_back_soon_after_its_id_was_freed_waits_longer_the_next_time() {
        let mut idle = IdleStacks::default();
        let round = |index| Round {
            index,
            ..Round::default()
        };
        let snap = Snapshot::default();
        idle.note(&[1, 2], &round(1));
        let mut at = 3;
        for wait in [2, 4, 8, 16, 32, 64, 64] {
            assert!(idle.pick(&snap, at - 1, |_| false).is_empty(), "{wait}");
            let picked = idle.pick(&snap, at, |_| false);
            assert!(picked.contains_key(&1), "waited {wait}");
            let freed: Freed = picked.keys().map(|id| (*id, None)).collect();
            idle.freed_idle(picked, &freed, at);
            // Stored again the round after: it was in use.
            idle.note(&[1], &round(at + 1));
            at += 1 + (wait * 2).min(MAX_IDLE_ROUNDS);
        }
        // Stack 2 never came back; once back long after, it waits as a new one.
        idle.note(&[2], &round(at + 100));
        assert!(idle.pick(&snap, at + 102, |_| false).contains_key(&2));
    }
}
