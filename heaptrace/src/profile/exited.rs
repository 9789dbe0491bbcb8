//! Processes that ended long ago, folded into one. A system-wide trace of a busy host meets
//! thousands of processes a minute; were each one's sites, sizes and stacks kept, the daemon
//! would grow without bound. Past `--keep-exited` ended processes, the oldest one's
//! figures move to one pseudo-process, `[N exited processes]` (key [`FOLDED`]): its counts,
//! sizes, reservations and leaks add up there, and its sites go under the folded stack with
//! the same frames, so the same code in many short processes is one site. Totals stay exact.
use std::{
    collections::{BTreeMap, VecDeque},
    sync::Arc,
};

use foldhash::{HashMap, HashMapExt as _};

use crate::{
    drain::round::{Leak, SiteId, reservation_keys, site_ids, size_keys, take_range},
    profile::Profile,
    symbolize::Frame,
};

/// The sites the ended processes kept one by one may hold, all together: a site is ~1.1 KB
/// with its histograms, and a compiler's process has thousands (cc1 ~2,500), so a thousand
/// of them alone would be gigabytes on a host that builds software. Past it the oldest
/// fold, however few they are.
pub const KEEP_EXITED_SITES: usize = 50_000;

/// Ended processes kept one by one, oldest first, with the sites each held: which to fold.
#[derive(Debug, Default)]
pub struct Kept {
    order: VecDeque<(u32, usize)>,
    sites: usize,
}

impl Kept {
    pub fn push(&mut self, key: u32, sites: usize) {
        self.order.push_back((key, sites));
        self.sites += sites;
    }

    /// The oldest, to fold now: past `max` processes or past [`KEEP_EXITED_SITES`] sites.
    pub fn next_to_fold(&mut self, max: usize) -> Option<u32> {
        if self.order.len() <= max && self.sites <= KEEP_EXITED_SITES {
            return None;
        }
        let (key, sites) = self.order.pop_front()?;
        self.sites -= sites;
        Some(key)
    }
}

/// Entries `Profile::fold_pacing` moves between two calls of its tick.
pub const TICK_EVERY: usize = 4096;

/// The key of the folded processes. Never a process's: it is above every pid Linux gives.
pub const FOLDED: u32 = u32::MAX;

/// Distinct stacks the folded processes keep; the rest go under [`OTHER`]. Above the sites the
/// ended processes keep one by one ([`KEEP_EXITED_SITES`]), so that one large process folded
/// alone (a compiler's cc1plus has tens of thousands of stacks) keeps every stack.
pub const FOLDED_STACKS: usize = 65_536;
/// The folded stack of the stacks past [`FOLDED_STACKS`], and of those never named.
const OTHER: i32 = 0;
/// The same for the stacks past the bound that were cut for want of room (their caller then
/// `[more frames lost ...]`): still counted in `lost.stack` once folded.
const OTHER_LOST: i32 = FOLDED_STACKS as i32 + 1;

impl Profile {
    /// Marks process `key` ended: its figures are final, and its blocks still live were taken
    /// as its leaks at its end. False if it has no figures here.
    pub fn end(&mut self, key: u32) -> bool {
        let Some(p) = self.procs.get_mut(&key) else {
            return false;
        };
        p.exited = true;
        p.leaks_at_exit = true;
        true
    }

    /// How many sites process `key` has.
    pub fn sites_of(&self, key: u32) -> usize {
        self.sites.range(site_ids(key)).count()
    }

    /// Folds process `key` (ended) into [`FOLDED`]; `leaks` (its blocks left at its end) are
    /// put under the folded sites too. Returns the folded stacks made for it, for a recording
    /// to hold their frames.
    pub fn fold(
        &mut self,
        key: u32,
        leaks: &mut BTreeMap<SiteId, Leak>,
    ) -> Vec<(i32, Arc<[Frame]>)> {
        self.fold_pacing(key, leaks, &mut || {})
    }

    /// `fold`, calling `tick` every [`TICK_EVERY`] entries moved: a compiler's process
    /// has hundreds of thousands of sites, whose fold took over a second of a round on a
    /// busy host, and the daemon's kernel maps must be read meanwhile.
    pub fn fold_pacing(
        &mut self,
        key: u32,
        leaks: &mut BTreeMap<SiteId, Leak>,
        tick: &mut dyn FnMut(),
    ) -> Vec<(i32, Arc<[Frame]>)> {
        let Some(p) = self.procs.remove(&key) else {
            return Vec::new();
        };
        self.folded.processes += 1;
        let n = self.folded.processes;
        let f = self.procs.entry(FOLDED).or_default();
        f.totals.plus(&p.totals);
        f.comm = format!("[{n} exited processes]");
        f.exited = true;
        f.leaks_at_exit = true;
        f.peak_rss_kb = f.peak_rss_kb.max(p.peak_rss_kb);
        self.move_sites(key, FOLDED, leaks, tick)
    }

    /// Moves the figures of process `key` by site to process `into`, each site's stack by its
    /// frames (stacks of one frames are one site there); `leaks` too. Returns the stacks made
    /// under `into`. Its process entry is the caller's. `tick`: as `fold_pacing`.
    pub(super) fn move_sites(
        &mut self,
        key: u32,
        into: u32,
        leaks: &mut BTreeMap<SiteId, Leak>,
        tick: &mut dyn FnMut(),
    ) -> Vec<(i32, Arc<[Frame]>)> {
        let mut moved = 0usize;
        let mut pace = || {
            moved += 1;
            if moved.is_multiple_of(TICK_EVERY) {
                tick();
            }
        };
        let mut made = Vec::new();
        let mut to: HashMap<i32, i32> = HashMap::new();
        let mut id = |profile: &mut Profile, id: i32| -> i32 {
            if id < 0 {
                return id; // lost, or no stack: the same meaning in any process
            }
            *to.entry(id).or_insert_with(|| {
                let frames = profile.stacks.remove(&(key, id));
                let (fid, new) = profile.folded_id(into, frames);
                if let Some(frames) = new {
                    made.push((fid, frames));
                }
                fid
            })
        };
        let range = site_ids(key);
        for (k, v) in take_range(&mut self.sites, range.clone()) {
            pace();
            let k = (into, id(self, k.1), k.2);
            self.sites.entry(k).or_default().plus(&v);
        }
        for (k, v) in take_range(&mut self.samples, range.clone()) {
            pace();
            let k = (into, id(self, k.1), k.2);
            self.samples.entry(k).or_default().plus(&v);
        }
        for (k, w) in take_range(&mut self.weights, range.clone()) {
            pace();
            let k = (into, id(self, k.1), k.2);
            self.weights.entry(k).or_default().plus(&w);
        }
        for ((_, func, size, st), n) in take_range(&mut self.sizes, size_keys(key)) {
            pace();
            let k = (into, func, size, id(self, st));
            *self.sizes.entry(k).or_default() += n;
        }
        for (k, t) in take_range(&mut self.reservations, reservation_keys(key)) {
            let k = (into, k.1, id(self, k.2), k.3);
            self.reservations.entry(k).or_default().plus(&t);
        }
        for (k, l) in take_range(leaks, range.clone()) {
            let e = leaks.entry((into, id(self, k.1), k.2)).or_default();
            e.blocks += l.blocks;
            e.bytes += l.bytes;
        }
        let at_peak: Vec<(usize, SiteId)> = self
            .peak
            .iter()
            .flat_map(|p| p.sites.iter().enumerate())
            .filter(|(_, s)| s.0.0 == key)
            .map(|(i, s)| (i, s.0))
            .collect();
        let moved = !at_peak.is_empty();
        for (i, (_, st, func)) in at_peak {
            let fid = id(self, st);
            if let Some(p) = self.peak.as_mut() {
                p.sites[i].0 = (into, fid, func);
            }
        }
        if moved && let Some(p) = self.peak.as_mut() {
            // Sites now one: one row, largest first as before.
            let mut sum: BTreeMap<SiteId, (i64, i64)> = BTreeMap::new();
            for (site, blocks, bytes) in &p.sites {
                let e = sum.entry(*site).or_default();
                e.0 += blocks;
                e.1 += bytes;
            }
            p.sites = sum.into_iter().map(|(s, (b, y))| (s, b, y)).collect();
            p.sites
                .sort_by_key(|(s, _, bytes)| (std::cmp::Reverse(*bytes), *s));
        }
        // Stacks of the process that no figure held.
        take_range(&mut self.stacks, (key, i32::MIN)..=(key, i32::MAX));
        made
    }

    /// The folded stack with these frames (None: never named) under process `into`, and its
    /// frames if it is new there. Ids are by frames, the same under every `into`.
    fn folded_id(
        &mut self,
        into: u32,
        frames: Option<Arc<[Frame]>>,
    ) -> (i32, Option<Arc<[Frame]>>) {
        let known = frames
            .as_ref()
            .and_then(|f| self.folded.ids.get(f).copied());
        let (fid, f) = match (known, frames) {
            (Some(fid), Some(f)) => (fid, f),
            (None, Some(f)) if self.folded.ids.len() < FOLDED_STACKS => {
                let fid = self.folded.ids.len() as i32 + 1;
                self.folded.ids.insert(f.clone(), fid);
                (fid, f)
            }
            (_, f)
                if f.as_ref()
                    .and_then(|f| f.last())
                    .is_some_and(Frame::is_more_lost) =>
            {
                (
                    OTHER_LOST,
                    [Frame::folded_other(), Frame::more_lost()].into(),
                )
            }
            _ => (OTHER, [Frame::folded_other()].into()),
        };
        if self.stacks.contains_key(&(into, fid)) {
            return (fid, None);
        }
        self.stacks.insert((into, fid), f.clone());
        (fid, Some(f))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{drain::round::SiteTotals, profile::ProcProfile, symbolize::test_frames as frames};

    /// Two ended processes whose stack 7 and 9 are the same code, and a third kernel stack
    /// that is another.
    fn two_processes() -> (Profile, BTreeMap<SiteId, Leak>) {
        let mut p = Profile::default();
        let mut leaks = BTreeMap::new();
        for (pid, st) in [(10, 7), (11, 9)] {
            let mut pp = ProcProfile {
                comm: "prog".into(),
                exited: true,
                ..Default::default()
            };
            pp.totals.funcs[0].calls = 5;
            p.procs.insert(pid, pp);
            p.stacks.insert((pid, st), frames(&["work", "main"]));
            let t = SiteTotals {
                calls: 5,
                bytes: 50,
                ..Default::default()
            };
            p.sites.insert((pid, st, 0), t.clone());
            p.sizes.insert((pid, 0, 10, st), 5);
            // As sampling keeps them: the sampled counters and their weights, per site.
            p.samples.insert((pid, st, 0), t);
            let w = crate::profile::sampling::Weighted {
                calls: 5,
                est_calls: 7.5,
                ..Default::default()
            };
            p.weights.insert((pid, st, 0), w);
            leaks.insert(
                (pid, st, 0),
                Leak {
                    blocks: 1,
                    bytes: 10,
                },
            );
        }
        p.stacks.insert((11, 4), frames(&["other", "main"]));
        p.sites.insert((11, 4, 0), SiteTotals::default());
        p.sites.insert((11, -12, 0), SiteTotals::default()); // a lost stack
        (p, leaks)
    }

    /// A process of 10,000 sites folds as `fold` does, its tick called every 4,096.
    #[test]
    fn a_paced_fold_ticks_every_4096_sites_and_moves_the_same() {
        let build = || {
            let mut p = Profile::default();
            let pp = ProcProfile {
                comm: "cc1plus".into(),
                exited: true,
                ..Default::default()
            };
            p.procs.insert(10, pp);
            for st in 0..10_000 {
                p.stacks
                    .insert((10, st), frames(&[&st.to_string(), "main"]));
                let t = SiteTotals {
                    calls: 1,
                    bytes: 8,
                    ..Default::default()
                };
                p.sites.insert((10, st, 0), t);
            }
            p
        };
        let (mut paced, mut whole) = (build(), build());
        let mut ticks = 0;
        paced.fold_pacing(10, &mut BTreeMap::new(), &mut || ticks += 1);
        whole.fold(10, &mut BTreeMap::new());
        assert_eq!(ticks, 10_000 / TICK_EVERY);
        assert_eq!(paced.sites, whole.sites);
        assert_eq!(paced.sites.len(), 10_000);
    }

    #[test]
    fn ended_processes_fold_into_one_with_their_sites_by_frames() {
        let (mut p, mut leaks) = two_processes();
        let before = p.totals();
        let made = p.fold(10, &mut leaks);
        assert_eq!(made.len(), 1);
        assert!(p.fold(11, &mut leaks).len() == 1, "only `other` is new");
        assert_eq!(p.totals(), before, "totals stay exact");
        assert_eq!(p.procs.keys().collect::<Vec<_>>(), [&FOLDED]);
        assert_eq!(p.procs[&FOLDED].comm, "[2 exited processes]");
        assert_eq!(p.procs[&FOLDED].totals.funcs[0].calls, 10);
        let work = p.folded.ids[&frames(&["work", "main"])];
        assert_eq!(
            p.sites[&(FOLDED, work, 0)].calls,
            10,
            "one site for the same code"
        );
        assert!(p.sites.contains_key(&(FOLDED, -12, 0)));
        assert_eq!(p.samples[&(FOLDED, work, 0)].calls, 10);
        assert_eq!(p.weights[&(FOLDED, work, 0)].calls, 10);
        assert_eq!(p.weights[&(FOLDED, work, 0)].est_calls, 15.0);
        assert_eq!(p.weights.len(), 1);
        assert_eq!(p.sites.len(), 3);
        assert_eq!(p.sizes, BTreeMap::from([((FOLDED, 0, 10, work), 10)]));
        assert_eq!(
            leaks,
            BTreeMap::from([(
                (FOLDED, work, 0),
                Leak {
                    blocks: 2,
                    bytes: 20
                }
            )])
        );
        assert_eq!(*p.frames(&(FOLDED, work, 0))[0].function, *"work");
        assert!(
            p.stacks.keys().all(|k| k.0 == FOLDED),
            "{:?}",
            p.stacks.keys()
        );
    }

    #[test]
    fn the_peak_holds_one_row_per_folded_site() {
        let (mut p, mut leaks) = two_processes();
        p.peak = Some(crate::profile::Peak {
            sites: vec![
                ((10, 7, 0), 1, 100),
                ((11, 4, 0), 1, 60),
                ((11, 9, 0), 2, 50),
            ],
            ..Default::default()
        });
        p.fold(10, &mut leaks);
        p.fold(11, &mut leaks);
        let work = p.folded.ids[&frames(&["work", "main"])];
        let other = p.folded.ids[&frames(&["other", "main"])];
        assert_eq!(
            p.peak.unwrap().sites,
            [((FOLDED, work, 0), 3, 150), ((FOLDED, other, 0), 1, 60)]
        );
    }

    #[test]
    fn the_oldest_fold_past_the_count_or_past_the_sites() {
        let mut k = Kept::default();
        for key in 1..=3 {
            k.push(key, 10);
        }
        assert_eq!(k.next_to_fold(2), Some(1), "three past two");
        assert_eq!(k.next_to_fold(2), None);
        // Two compilers' worth of sites: under the count, past the sites.
        k.push(4, KEEP_EXITED_SITES / 2);
        k.push(5, KEEP_EXITED_SITES / 2);
        let folded: Vec<u32> = std::iter::from_fn(|| k.next_to_fold(1000)).collect();
        assert_eq!(folded, [2, 3], "until the sites are within the bound");
        k.push(6, 1);
        assert_eq!(k.next_to_fold(1000), Some(4), "one site past it");
        assert_eq!(k.next_to_fold(0), Some(5));
        assert_eq!(k.next_to_fold(0), Some(6));
        assert_eq!(k.next_to_fold(0), None);
    }

    #[test]
    fn stacks_past_the_bound_fold_under_one() {
        let (mut p, mut leaks) = two_processes();
        // As if the folded stacks were full already.
        for i in 0..FOLDED_STACKS {
            p.folded.ids.insert(frames(&[&i.to_string()]), i as i32 + 1);
        }
        // Process 10's stack 8 was cut for want of room: its caller alone.
        let cut: Arc<[Frame]> = [frames(&["caller"])[0].clone(), Frame::more_lost()].into();
        p.stacks.insert((10, 8), cut);
        let t = SiteTotals {
            calls: 3,
            ..Default::default()
        };
        p.sites.insert((10, 8, 0), t);
        assert_eq!(p.losses_of(None)[heaptrace_common::Loss::Stack as usize], 3);
        p.fold(10, &mut leaks);
        assert_eq!(p.sites[&(FOLDED, OTHER, 0)].calls, 5);
        assert_eq!(
            *p.frames(&(FOLDED, OTHER, 0))[0].function,
            *"[other stacks of exited processes]"
        );
        assert_eq!(p.sites[&(FOLDED, OTHER_LOST, 0)].calls, 3);
        assert_eq!(
            p.losses_of(None)[heaptrace_common::Loss::Stack as usize],
            3,
            "still lost once folded"
        );
    }
}
