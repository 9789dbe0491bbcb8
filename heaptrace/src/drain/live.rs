//! The live map: blocks still live, read by site, and taken out where processes ended.
use super::*;

/// Live blocks as `live_where` read them: a block is in a slot or in the map, never both.
pub(super) struct Live {
    in_map: FastMap<LiveKey, LiveBlock>,
    in_slots: Vec<Held>,
}

pub(super) fn group_by_site(blocks: &FastMap<LiveKey, LiveBlock>) -> BTreeMap<SiteId, Leak> {
    let mut out: BTreeMap<SiteId, Leak> = BTreeMap::new();
    for (key, block) in blocks {
        let l = out
            .entry((key.tgid, block.stack_id, block.func))
            .or_default();
        l.blocks += 1;
        l.bytes += block.size;
    }
    out
}

impl Live {
    pub(super) fn iter(&self) -> impl Iterator<Item = (&LiveKey, &LiveBlock)> {
        let slots = self.in_slots.iter().map(|h| (&h.key, &h.block));
        self.in_map.iter().chain(slots)
    }
}

impl KernelMaps {
    /// Blocks still live, grouped by site. Reads the whole live map: for the end of a trace,
    /// not for every round.
    pub fn live_blocks(&self, pids: Option<&HashSet<u32>>) -> Result<BTreeMap<SiteId, Leak>> {
        let blocks = self.live_entries(|tgid| pids.is_none_or(|p| p.contains(&tgid)))?;
        Ok(group_by_site(&blocks))
    }

    /// The live blocks of the current images of the processes `want` accepts.
    pub(super) fn live_entries(
        &self,
        want: impl Fn(u32) -> bool,
    ) -> Result<FastMap<LiveKey, LiveBlock>> {
        let mut epochs: FastMap<u32, u32> = FastMap::new();
        let live = self.live_where(|key| {
            want(key.tgid)
                && key.epoch
                    == *epochs
                        .entry(key.tgid)
                        .or_insert_with(|| self.epoch(key.tgid))
        })?;
        Ok(live.iter().map(|(k, b)| (*k, *b)).collect())
    }

    /// The live blocks `want` accepts: the slots' and the live map's, the map read in
    /// batches. The kernel copies a bucket at a time, so an entry is seen once while the probes
    /// add and delete others (a walk key by key started over when its current key was deleted,
    /// and met keys twice).
    pub(super) fn live_where(&self, mut want: impl FnMut(&LiveKey) -> bool) -> Result<Live> {
        let mut out = Live {
            in_map: FastMap::new(),
            in_slots: self.live_slots.held_where(&mut want),
        };
        batch::per_cpu_hash::<LiveKey, LiveBlock>(self.live_fd.as_fd(), 1, |key, block| {
            if want(key) {
                out.in_map.insert(*key, block[0]);
            }
        })
        .map_err(|e| Error::Map {
            map: maps::LIVE,
            reason: e.to_string(),
        })?;
        Ok(out)
    }

    /// Forgets blocks read by `live_where`: no program frees them any more.
    pub(super) fn drop_live(&self, live: Live) -> Result<()> {
        self.live_slots.empty(&live.in_slots);
        let keys: Vec<LiveKey> = live.in_map.into_keys().collect();
        Self::delete(&self.live_fd, maps::LIVE, &keys)
    }
}
