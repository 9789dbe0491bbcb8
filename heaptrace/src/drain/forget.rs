//! What processes that ended or exec'ed leave in the kernel maps, dropped.
use super::*;

/// Frees the in-flight slots whose owners are gone; returns how many. Each is freed only if
/// its owner is still the one read: no program of a dead thread runs, and a thread that took
/// the slot meanwhile keeps it.
pub(super) fn free_slots_of_dead_threads(
    slots: &MappedArray<InFlightSlot>,
    thread_alive: impl Fn(u32, u32) -> bool,
) -> usize {
    let mut freed = 0;
    for i in 0..slots.len() {
        let owner = slots.first_word(i).load(Ordering::Acquire);
        if owner != 0
            && !thread_alive((owner >> 32) as u32, owner as u32)
            && slots
                .first_word(i)
                .compare_exchange(owner, 0, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            freed += 1;
        }
    }
    freed
}

/// Rounds between two looks at the state slots of processes gone unseen.
const UNUSED_SLOTS_EVERY: u32 = 16;

impl KernelMaps {
    /// Deletes `keys` from a map in batches; a failure is the map's error.
    pub(super) fn delete<K: aya::Pod>(fd: &OwnedFd, map: &'static str, keys: &[K]) -> Result<()> {
        batch::delete(fd.as_fd(), keys).map_err(|e| Error::Map {
            map,
            reason: e.to_string(),
        })
    }

    /// Forgets processes that are gone: returns the blocks they never freed (their leaks), and
    /// removes their entries from every map keyed by process, so map space does not leak
    /// with process churn. Call after a snapshot that holds their final counts.
    pub fn forget(&mut self, pids: &HashSet<u32>) -> Result<BTreeMap<SiteId, Leak>> {
        let blocks = self.live_where(|k| pids.contains(&k.tgid))?;
        // Blocks of an image before an exec not cleared yet go too, but are not its leaks.
        let epochs: FastMap<u32, u32> = pids.iter().map(|p| (*p, self.epoch(*p))).collect();
        let mut leaks: BTreeMap<SiteId, Leak> = BTreeMap::new();
        for (key, block) in blocks.iter() {
            if epochs.get(&key.tgid) == Some(&key.epoch) {
                let l = leaks
                    .entry((key.tgid, block.stack_id, block.func))
                    .or_default();
                l.blocks += 1;
                l.bytes += block.size;
            }
        }
        self.drop_live(blocks)?;
        let procs: Vec<u32> = pids.iter().copied().collect();
        Self::delete(&self.procs_fd, maps::PROCS, &procs)?;
        self.proc_slots.free_where(|tgid| pids.contains(&tgid));
        for pid in pids {
            let _ = self.execs.remove(pid);
            let _ = self.peaks.remove(pid);
        }
        self.proc_states.free_where(|tgid| pids.contains(&tgid));
        // Gone before the last snapshot, so its keys there are all it has.
        let sizes: Vec<SizeKey> = self
            .size_keys
            .extract_if(.., |k| pids.contains(&k.tgid))
            .collect();
        let sites: Vec<SiteKey> = self
            .site_keys
            .extract_if(.., |k| pids.contains(&k.tgid))
            .collect();
        Self::delete(&self.sizes_fd, maps::SIZES, &sizes)?;
        Self::delete(&self.sites_fd, maps::SITES, &sites)?;
        self.size_slots.free_where(|k| pids.contains(&k.tgid));
        self.site_slots.free_where(|k| pids.contains(&k.tgid));
        self.retired.drop_sizes(|k| pids.contains(&k.tgid));
        self.retired.drop_sites(|k| pids.contains(&k.tgid));
        Ok(leaks)
    }

    /// Processes exec'ed (the kernel has reset its counters and moved its epoch on): drops
    /// what their earlier images left in the maps keyed by process. The blocks they never freed
    /// went with their address space. The current image's entries carry another epoch, so
    /// nothing it counts meanwhile is touched.
    /// Call after a snapshot: the earlier images' entries it read are all they have (they
    /// ended at the exec, before it). Returns the stored stacks the dropped sites held (ids as
    /// in the site map): once no other site holds them, they are for others to take, as an
    /// ended process's are.
    pub fn restarted(&mut self, pids: &HashSet<u32>) -> Result<BTreeSet<i32>> {
        let epochs: FastMap<u32, u32> = pids.iter().map(|p| (*p, self.epoch(*p))).collect();
        let old = |tgid: u32, epoch: u32| epochs.get(&tgid).is_some_and(|e| *e != epoch);
        self.drop_live(self.live_where(|k| old(k.tgid, k.epoch))?)?;
        let sizes: Vec<SizeKey> = self
            .size_keys
            .extract_if(.., |k| old(k.tgid, k.epoch))
            .collect();
        let sites: Vec<SiteKey> = self
            .site_keys
            .extract_if(.., |k| old(k.tgid, k.epoch))
            .collect();
        Self::delete(&self.sizes_fd, maps::SIZES, &sizes)?;
        Self::delete(&self.sites_fd, maps::SITES, &sites)?;
        self.size_slots.free_where(|k| old(k.tgid, k.epoch));
        let in_slots = self.site_slots.free_where(|k| old(k.tgid, k.epoch));
        self.retired.drop_sizes(|k| old(k.tgid, k.epoch));
        let retired = self.retired.drop_sites(|k| old(k.tgid, k.epoch));
        Ok(sites
            .iter()
            .chain(&in_slots)
            .chain(&retired)
            .map(|k| k.stack_id)
            .filter(|id| *id >= 0)
            .collect())
    }

    /// Drops in-flight records of threads that are gone; the map is bounded, and a reused
    /// thread id must not inherit one. The kernel deletes a thread's record when it exits
    /// (sched_process_exit), so this is a backstop for the records that tracepoint misses: a
    /// non-leader thread that calls execve takes over its process's pid without exiting, and
    /// leaves its record under the old thread id; and the tracepoint may fail to attach.
    pub fn purge_inflight(&mut self, thread_alive: impl Fn(u32, u32) -> bool) -> Result<usize> {
        let dead: Vec<u64> = self
            .inflight
            .keys()
            .filter_map(|k| k.ok())
            .filter(|k| !thread_alive((k >> 32) as u32, *k as u32))
            .collect();
        for k in &dead {
            let _ = self.inflight.remove(k);
        }
        // Here too, now and then: the state slots of processes gone without a block counted.
        // Not every round: each slot held by a process that never counted costs a /proc
        // read (hundreds under `--all`, whose scan takes slots for idle processes too).
        self.purges = self.purges.wrapping_add(1);
        if self.purges.is_multiple_of(UNUSED_SLOTS_EVERY) {
            self.proc_states.free_unused(crate::targets::procfs::alive);
        }
        Ok(dead.len() + free_slots_of_dead_threads(&self.inflight_slots, thread_alive))
    }
}
