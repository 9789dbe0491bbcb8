//! Site and size keys of past rounds, retired: their last figures kept here, their entries
//! deleted from the kernel's maps and slots.
//!
//! Programs key sites and sizes by the round generation too (`heaptrace_common::round_gen`),
//! which each read moves on. A key of another generation than the one programs write at a
//! read was last written before the previous read's move, a round ago: its figures are final.
//! They are added here (keyed with generation 0) and the key is deleted, so the kernel holds
//! the keys of about two rounds, and the archive, here, the run's. Every snapshot starts from
//! the archive: its figures stay cumulative, and the rounds' differences are as before.
use super::*;

/// The retired figures, by key with `round` 0, every image's (an earlier image's go when it
/// is dropped, `KernelMaps::restarted`).
#[derive(Default)]
pub struct Retired {
    sites: StdHashMap<SiteKey, SiteTotals>,
    sizes: StdHashMap<SizeKey, u64>,
}

/// A key's figures read this round, where its generation is a past one: to retire.
pub(super) struct Past<K, V> {
    /// Summed over the map's CPUs and the slots.
    pub totals: StdHashMap<K, V>,
    /// Those found in the hash map (the others are in slots only).
    pub in_map: Vec<K>,
}

impl<K, V> Default for Past<K, V> {
    fn default() -> Self {
        Past {
            totals: StdHashMap::new(),
            in_map: Vec::new(),
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
    /// Adds the current images' (`epochs`) retired figures to a snapshot being read.
    pub(super) fn add_to(&self, snap: &mut Snapshot, epochs: &StdHashMap<u32, u32>) {
        let current = |tgid: u32, epoch: u32| epochs.get(&tgid) == Some(&epoch);
        for (k, t) in self.sites.iter().filter(|(k, _)| current(k.tgid, k.epoch)) {
            let id = (k.tgid, k.stack_id, u32::from(k.func));
            snap.sites.entry(id).or_default().plus(t);
        }
        for (k, n) in self.sizes.iter().filter(|(k, _)| current(k.tgid, k.epoch)) {
            let id = (k.tgid, u32::from(k.func), k.size, k.stack_id);
            let c = snap.sizes.entry(id).or_default();
            *c = c.wrapping_add(*n);
        }
    }

    /// Forgets the figures of the keys `gone` accepts; returns those keys.
    pub(super) fn drop_sites(&mut self, gone: impl Fn(&SiteKey) -> bool) -> Vec<SiteKey> {
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
