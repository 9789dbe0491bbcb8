//! Site and size keys of past rounds, retired: their last figures kept here, their entries
//! deleted from the kernel's maps and slots.
//!
//! Programs key sites and sizes by the round generation too (`heaptrace_common::round_gen`),
//! which each read moves on. A key of another generation than the one programs write at a
//! read was last written before the previous read's move, a round ago: its figures are final.
//! They are added here (keyed with generation 0) and the key is deleted, so the kernel holds
//! the keys of about two rounds, and the archive, here, the run's. Every snapshot starts from
//! the archive: its figures stay cumulative, and the rounds' differences are as before.
use std::collections::btree_map::Entry;

use super::*;

/// The retired figures, by key with `round` 0, every image's (an earlier image's go when it
/// is dropped, `KernelMaps::restarted`).
#[derive(Default)]
pub struct Retired {
    sites: FastMap<SiteKey, RetiredSite>,
    sizes: FastMap<SizeKey, u64>,
    /// What the retired keys add to their live figures to give them at their process's peak
    /// (`SiteCounters::at_peak_correction`), with the peak number that holds for: a retired
    /// key is final, so once its process's number moves on, its figures are the peak's too.
    peak_fix: FastMap<SiteKey, (u32, (u64, u64))>,
}

/// A key's figures read this round, where its generation is a past one: to retire.
pub(super) struct Past<K, V> {
    /// Summed over the map's CPUs and the slots.
    pub totals: FastMap<K, V>,
    /// Those found in the hash map (the others are in slots only).
    pub in_map: Vec<K>,
}

impl<K, V> Default for Past<K, V> {
    fn default() -> Self {
        Past {
            totals: FastMap::new(),
            in_map: Vec::new(),
        }
    }
}

/// A retired site's figures: a `SiteTotals` without its size histogram (the kernel's site
/// counters have none: it is folded from the sizes at each snapshot). Under `--all` the
/// archive holds every live process's sites of past rounds (its table of dense `SiteTotals`
/// reached 74 MiB beside a compile loop and Rust builds).
#[derive(Default)]
pub(super) struct RetiredSite {
    calls: u64,
    bytes: u64,
    frees: u64,
    freed_bytes: u64,
    live_blocks: i64,
    live_bytes: i64,
    temp_blocks: u64,
    temp_bytes: u64,
    lifetimes: crate::drain::round::Buckets,
}

impl RetiredSite {
    fn plus(&mut self, t: &SiteTotals) {
        let signed = |a: i64, b: i64| a.wrapping_add(b);
        self.calls = self.calls.wrapping_add(t.calls);
        self.bytes = self.bytes.wrapping_add(t.bytes);
        self.frees = self.frees.wrapping_add(t.frees);
        self.freed_bytes = self.freed_bytes.wrapping_add(t.freed_bytes);
        self.live_blocks = signed(self.live_blocks, t.live_blocks);
        self.live_bytes = signed(self.live_bytes, t.live_bytes);
        self.temp_blocks = self.temp_blocks.wrapping_add(t.temp_blocks);
        self.temp_bytes = self.temp_bytes.wrapping_add(t.temp_bytes);
        debug_assert!(t.sizes.is_empty(), "a kernel site has no sizes");
        if !t.lifetimes.is_empty() {
            self.lifetimes = self.lifetimes.zip(&t.lifetimes, u64::wrapping_add);
        }
    }

    fn totals(&self) -> SiteTotals {
        SiteTotals {
            calls: self.calls,
            bytes: self.bytes,
            frees: self.frees,
            freed_bytes: self.freed_bytes,
            live_blocks: self.live_blocks,
            live_bytes: self.live_bytes,
            temp_blocks: self.temp_blocks,
            temp_bytes: self.temp_bytes,
            lifetimes: self.lifetimes.clone(),
            ..SiteTotals::default()
        }
    }
}

/// Adds `entries` (keys unique) to `map`, moved in where new; built whole from them, sorted,
/// where `map` is empty.
fn merge_into<K: Ord, V>(
    map: &mut BTreeMap<K, V>,
    entries: impl Iterator<Item = (K, V)>,
    add: impl Fn(&mut V, V),
) {
    if map.is_empty() {
        *map = entries.collect();
        return;
    }
    for (k, v) in entries {
        match map.entry(k) {
            Entry::Occupied(mut o) => add(o.get_mut(), v),
            Entry::Vacant(e) => _ = e.insert(v),
        }
    }
}

fn site_base(k: &SiteKey) -> SiteKey {
    SiteKey { round: 0, ..*k }
}

fn size_base(k: &SizeKey) -> SizeKey {
    SizeKey { round: 0, ..*k }
}

impl Retired {
    /// Adds the current images' (`epochs`) retired figures to a snapshot being read, and
    /// their corrections at the peak of the processes' `peaks`.
    pub(super) fn add_to(
        &self,
        snap: &mut Snapshot,
        epochs: &FastMap<u32, u32>,
        peaks: &snapshot::PeakStates,
    ) {
        let current = |tgid: u32, epoch: u32| epochs.get(&tgid) == Some(&epoch);
        // The archive is most of a busy host's sites and sizes, added every round: in the
        // maps' order, each insertion's path is in the cache (in the archive's, nearly every
        // node is a miss). One key per id: only the current image's count. Sites are sorted
        // by reference, a copy of their totals would be one more of them.
        let mut sites: Vec<(SiteId, &RetiredSite)> = self
            .sites
            .iter()
            .filter(|(k, _)| current(k.tgid, k.epoch))
            .map(|(k, t)| ((k.tgid, k.stack_id, u32::from(k.func)), t))
            .collect();
        sites.sort_unstable_by_key(|e| e.0);
        for (id, t) in sites {
            match snap.sites.entry(id) {
                Entry::Occupied(mut o) => o.get_mut().plus(&t.totals()),
                Entry::Vacant(e) => _ = e.insert(t.totals()),
            }
        }
        let fixes = self
            .peak_fix
            .iter()
            .filter(|(k, (seq, _))| {
                current(k.tgid, k.epoch) && peaks.get(&k.tgid).is_some_and(|s| s.0 == *seq && !s.1)
            })
            .map(|(k, (_, fix))| ((k.tgid, k.stack_id, u32::from(k.func)), *fix));
        merge_into(&mut snap.peak_fix, fixes, snapshot::add_fix);
        let sizes = self
            .sizes
            .iter()
            .filter(|(k, _)| current(k.tgid, k.epoch))
            .map(|(k, n)| ((k.tgid, u32::from(k.func), k.size, k.stack_id), *n));
        merge_into(&mut snap.sizes, sizes, |a, b| *a = a.wrapping_add(b));
    }

    /// Keeps a retiring key's correction at its process's peak `seq` (`peak_fix`); one of an
    /// earlier number is of no use any more.
    pub(super) fn keep_peak_fix(&mut self, key: SiteKey, seq: u32, fix: (u64, u64)) {
        let e = self
            .peak_fix
            .entry(site_base(&key))
            .or_insert((seq, (0, 0)));
        if e.0 != seq {
            *e = (seq, (0, 0));
        }
        snapshot::add_fix(&mut e.1, fix);
    }

    /// Forgets the figures of the keys `gone` accepts; returns those keys.
    pub(super) fn drop_sites(&mut self, gone: impl Fn(&SiteKey) -> bool) -> Vec<SiteKey> {
        self.peak_fix.retain(|k, _| !gone(k));
        let keys: Vec<SiteKey> = self.sites.keys().filter(|k| gone(k)).copied().collect();
        for k in &keys {
            self.sites.remove(k);
        }
        keys
    }

    pub(super) fn drop_sizes(&mut self, gone: impl Fn(&SizeKey) -> bool) {
        self.sizes.retain(|k, _| !gone(k));
    }
}

impl KernelMaps {
    /// Retires the sizes of past rounds read this round: their figures kept, their entries
    /// deleted from the map and their slots freed.
    pub(super) fn retire_sizes(&mut self, past: Past<SizeKey, u64>) -> Result<()> {
        for (k, n) in &past.totals {
            let c = self.retired.sizes.entry(size_base(k)).or_default();
            *c = c.wrapping_add(*n);
        }
        Self::delete(&self.sizes_fd, maps::SIZES, &past.in_map)?;
        // Only the slots whose figures were read (a slot read torn is left for next round).
        self.size_slots.free_where(|k| past.totals.contains_key(k));
        Ok(())
    }

    /// Retires the sites of past rounds read this round, as `retire_sizes`.
    pub(super) fn retire_sites(&mut self, past: Past<SiteKey, SiteTotals>) -> Result<()> {
        for (k, t) in &past.totals {
            self.retired.sites.entry(site_base(k)).or_default().plus(t);
        }
        Self::delete(&self.sites_fd, maps::SITES, &past.in_map)?;
        self.site_slots.free_where(|k| past.totals.contains_key(k));
        Ok(())
    }

    /// The round generation programs write now (`heaptrace_common::round_gen`).
    pub(super) fn round_now(&self) -> u16 {
        heaptrace_common::round_gen(self.stack_gen.first_word(0).load(Ordering::Acquire))
    }
}

#[cfg(test)]
mod tests {
    use heaptrace_common::SiteCounters;

    use super::*;
    use crate::drain::round::KernelPeak;

    /// One process's kernel side as `peak.rs` and `sites.rs` keep it: its peak number and
    /// whether a new high waits for a release, and the site entries (one CPU).
    #[derive(Default)]
    struct Kernel {
        seq: u32,
        pending: bool,
        live: u64,
        max: u64,
        entries: FastMap<SiteKey, SiteCounters>,
    }

    const PID: u32 = 7;

    fn key(stack_id: i32, round: u16) -> SiteKey {
        SiteKey {
            tgid: PID,
            stack_id,
            func: 0,
            round,
            epoch: 1,
        }
    }

    impl Kernel {
        fn entry(&mut self, k: SiteKey) -> &mut SiteCounters {
            self.entries.entry(k).or_insert(SiteCounters::ZERO)
        }

        fn alloc(&mut self, k: SiteKey, size: u64) {
            let seq = self.seq;
            let e = self.entry(k);
            e.fold_peak(seq);
            e.calls += 1;
            e.bytes += size;
            self.live += size;
            if self.live > self.max {
                (self.max, self.pending) = (self.live, true);
            }
        }

        fn free(&mut self, k: SiteKey, size: u64) {
            if self.pending {
                (self.pending, self.seq) = (false, self.seq + 1);
            }
            self.live -= size;
            let seq = self.seq;
            let e = self.entry(k);
            e.fold_peak(seq);
            e.frees += 1;
            e.freed_bytes += size;
        }

        /// What `snapshot` makes of it: the entries of `round` are current, the others
        /// retired into `retired` (and gone from here).
        fn read(&mut self, retired: &mut Retired, round: u16) -> PeakHeld {
            let states = PeakStates::from_iter([(PID, (self.seq, self.pending, 0))]);
            let mut snap = Snapshot::default();
            let epochs = FastMap::from_iter([(PID, 1)]);
            retired.add_to(&mut snap, &epochs, &states);
            for (k, c) in &self.entries {
                let id = (k.tgid, k.stack_id, 0);
                snap.sites
                    .entry(id)
                    .or_default()
                    .plus(&SiteTotals::from_per_cpu([c]));
                let fix = snapshot::peak_fix([c].into_iter(), self.seq, self.pending);
                snapshot::add_fix(snap.peak_fix.entry(id).or_default(), fix);
            }
            for (k, c) in self.entries.iter().filter(|(k, _)| k.round != round) {
                let fix = snapshot::peak_fix([c].into_iter(), self.seq, self.pending);
                retired.keep_peak_fix(*k, self.seq, fix);
                let t = SiteTotals::from_per_cpu([c]);
                retired.sites.entry(site_base(k)).or_default().plus(&t);
            }
            self.entries.retain(|k, _| k.round == round);
            let k = KernelPeak {
                bytes: self.max,
                ..KernelPeak::default()
            };
            snap.peaks.insert(PID, k);
            snap.compose_peaks(&states);
            snap.peak_held.remove(&PID).unwrap()
        }
    }

    use super::snapshot::PeakStates;
    use crate::drain::round::PeakHeld;

    #[test]
    fn a_retired_site_keeps_its_figures_in_less_room() {
        let mut a = SiteTotals {
            calls: 3,
            bytes: 300,
            frees: 1,
            freed_bytes: 100,
            live_blocks: 2,
            live_bytes: 200,
            temp_blocks: 1,
            temp_bytes: 100,
            ..SiteTotals::default()
        };
        let mut r = RetiredSite::default();
        r.plus(&a);
        assert!(r.lifetimes.is_empty(), "no lifetimes timed, none kept");
        assert_eq!(r.totals(), a);
        a.lifetimes.set(4, 2);
        r.plus(&a);
        let mut twice = a.clone();
        twice.plus(&a);
        twice.lifetimes = a.lifetimes.clone();
        assert_eq!(r.totals(), twice);
    }

    #[test]
    fn the_peak_keeps_each_sites_figures_of_its_moment() {
        let (a, b, c) = (1, 2, 3);
        let mut k = Kernel::default();
        let mut retired = Retired::default();
        for _ in 0..3 {
            k.alloc(key(a, 1), 100);
        }
        k.alloc(key(b, 1), 1000);
        // A new high with no release since: the figures now are the peak's.
        let held = k.read(&mut retired, 1);
        assert_eq!(held.sites, [(a, 0, 3, 300), (b, 0, 1, 1000)]);
        // Site a touched after the peak, in the round of the peak and after it (that round's
        // key retired in between); b untouched; c new since.
        k.free(key(a, 1), 100);
        k.read(&mut retired, 2);
        k.free(key(a, 2), 100);
        k.alloc(key(c, 2), 50);
        let held = k.read(&mut retired, 3);
        assert_eq!(held.bytes, 1300);
        assert_eq!(held.sites, [(a, 0, 3, 300), (b, 0, 1, 1000)]);
        // A higher peak later: the retired key's figures at the old one no longer count.
        k.alloc(key(c, 3), 2000);
        k.free(key(b, 3), 1000);
        let held = k.read(&mut retired, 3);
        assert_eq!(held.bytes, 3150);
        assert_eq!(
            held.sites,
            [(a, 0, 1, 100), (b, 0, 1, 1000), (c, 0, 2, 2050)]
        );
    }
}
