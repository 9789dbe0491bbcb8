//! One read of every counter map into a Snapshot, in the order the rounds need.
use std::collections::btree_map::Entry;

use super::*;

pub(super) fn comm_str(comm: &[u8; 16]) -> String {
    let end = comm.iter().position(|b| *b == 0).unwrap_or(comm.len());
    String::from_utf8_lossy(&comm[..end]).into_owned()
}

/// Each process's peak number, whether its peak is pending, and its blocks at the peak
/// (`heaptrace_common::ProcPeak`), by tgid.
pub(super) type PeakStates = FastMap<u32, (u32, bool, u64)>;

/// What the entries of one key add to its live figures to give them at the peak `seq`.
pub(super) fn peak_fix<'a>(
    entries: impl Iterator<Item = &'a SiteCounters>,
    seq: u32,
    pending: bool,
) -> (u64, u64) {
    let mut fix = (0, 0);
    for c in entries {
        add_fix(&mut fix, c.at_peak_correction(seq, pending));
    }
    fix
}

/// Each process's peak state (`PeakStates`) and highest live bytes, read again.
type PeaksNow = FastMap<u32, ((u32, bool, u64), u64)>;

/// The processes whose peak moved between two reads: a new number, a new high, or other
/// blocks at it.
fn moved(
    before: &PeakStates,
    bytes: &BTreeMap<u32, crate::drain::round::KernelPeak>,
    after: &PeaksNow,
) -> Vec<u32> {
    before
        .iter()
        .filter(|(pid, s)| {
            let was = (**s, bytes.get(pid).map_or(0, |k| k.bytes));
            after.get(pid) != Some(&was)
        })
        .map(|(pid, _)| *pid)
        .collect()
}

pub(super) fn add_fix(to: &mut (u64, u64), f: (u64, u64)) {
    to.0 = to.0.wrapping_add(f.0);
    to.1 = to.1.wrapping_add(f.1);
}

impl KernelMaps {
    /// Every counter the kernel keeps, read once: processes, sizes, losses, sites, latency.
    pub fn snapshot(&mut self) -> Result<Snapshot> {
        let mut snap = Snapshot::default();
        // Read before the maps: keys of any other generation are final (`retire`).
        let round = self.round_now();
        let epochs = self.read_procs(&mut snap)?;
        // Before the sites: the peak number their figures at the peak are kept for.
        let peaks = self.read_peaks(&mut snap);
        self.retired.add_to(&mut snap, &epochs, &peaks);
        self.read_sizes(&mut snap, &epochs, round)?;
        self.read_losses(&mut snap)?;
        self.read_sites(&mut snap, &epochs, round, &peaks)?;
        snap.compose_peaks(&peaks);
        // A new high or its first release during the sites' read leaves sites read on
        // either side of it: that process's composition waits for a round read whole.
        let now = self.peak_states(peaks.keys());
        for pid in moved(&peaks, &snap.peaks, &now) {
            snap.peak_held.remove(&pid);
        }
        self.read_frames()?;
        snap.fold_site_sizes();
        // Every round too, not only after frees: a word written for a copy that its program
        // then removed as torn (full preemption, `stacks::intact`) names an id with no stack,
        // and is taken until the generation moves on. It lives a round at most.
        next_stack_generation(&self.stack_cache, &self.stack_gen);
        self.fills.moved()?;
        self.read_latency(&mut snap)?;
        Ok(snap)
    }

    /// The highest live heap of each process with counters (one lookup each); returns each
    /// one's peak state (`PeakStates`).
    pub(super) fn read_peaks(&self, snap: &mut Snapshot) -> PeakStates {
        let mut states = PeakStates::new();
        for pid in snap.procs.keys() {
            if let Some(p) = self.peak_of(*pid)
                && p.max as i64 > 0
            {
                let k = crate::drain::round::KernelPeak {
                    bytes: p.max,
                    size: p.max_size,
                    stack_id: p.max_stack,
                };
                snap.peaks.insert(*pid, k);
                states.insert(*pid, (p.seq, p.pending != 0, p.max_blocks));
            }
        }
        states
    }

    /// `pid`'s peak: in its slot where it has one, else in the map (never both).
    fn peak_of(&self, pid: u32) -> Option<heaptrace_common::ProcPeak> {
        self.proc_states
            .peak(pid)
            .or_else(|| self.peaks.get(&pid, 0).ok())
    }

    /// The peak state and highest bytes of each of `pids` now, as `read_peaks` reads them.
    fn peak_states<'a>(&self, pids: impl Iterator<Item = &'a u32>) -> PeaksNow {
        pids.filter_map(|pid| {
            let p = self.peak_of(*pid)?;
            Some((*pid, ((p.seq, p.pending != 0, p.max_blocks), p.max)))
        })
        .collect()
    }

    /// The processes' counters; returns each one's current image: only its entries count (an
    /// earlier image's wait to be dropped, see `restarted`). A process without counters has
    /// no current entries yet.
    pub(super) fn read_procs(&self, snap: &mut Snapshot) -> Result<FastMap<u32, u32>> {
        let mut epochs: FastMap<u32, u32> = FastMap::new();
        // A process counts in its slots and, on CPUs where another owns its slot, in the map:
        // its figures are the sum of both.
        let mut in_slots: FastMap<u32, Vec<ProcCounters>> = FastMap::new();
        for (tgid, counters) in self.proc_slots.owned() {
            in_slots.entry(tgid).or_default().push(counters);
        }
        let mut add_proc = |tgid: u32, per_cpu: &[ProcCounters], slots: &[ProcCounters]| {
            let all = || per_cpu.iter().chain(slots);
            let epoch = all().map(|c| c.epoch).max().unwrap_or(0);
            epochs.insert(tgid, epoch as u32);
            let comm = all()
                .map(|c| comm_str(&c.comm))
                .find(|c| !c.is_empty())
                .unwrap_or_default();
            snap.procs.insert(
                tgid,
                ProcSnapshot {
                    comm,
                    totals: Totals::from_per_cpu(all()),
                    epoch: epoch as u32,
                },
            );
        };
        batch::per_cpu_hash::<u32, ProcCounters>(
            self.procs_fd.as_fd(),
            self.cpus,
            |&tgid, per_cpu| {
                let slots = in_slots.remove(&tgid).unwrap_or_default();
                add_proc(tgid, per_cpu, &slots);
            },
        )
        .map_err(read_err(maps::PROCS))?;
        for (tgid, slots) in in_slots {
            add_proc(tgid, &[], &slots);
        }
        Ok(epochs)
    }

    /// The size counters of the current images (`epochs`), and every image's keys for
    /// `size_keys`; those of past rounds (not `round`) retired.
    pub(super) fn read_sizes(
        &mut self,
        snap: &mut Snapshot,
        epochs: &FastMap<u32, u32>,
        round: u16,
    ) -> Result<()> {
        let mut size_keys = std::mem::take(&mut self.size_keys);
        size_keys.clear();
        let mut past: retire::Past<SizeKey, u64> = Default::default();
        // A size counts in its slots and, on CPUs where another holds its slot, in the map:
        // its figures are the sum of both. Only the current images' count.
        let mut count_size = |key: &SizeKey, n: u64| {
            if key.round != round {
                let p = past.totals.entry(*key).or_default();
                *p = p.wrapping_add(n);
            }
            if epochs.get(&key.tgid) == Some(&key.epoch) {
                let c = snap
                    .sizes
                    .entry((key.tgid, u32::from(key.func), key.size, key.stack_id))
                    .or_default();
                *c = c.wrapping_add(n);
            }
        };
        for (key, n) in self.size_slots.held() {
            count_size(&key, n);
        }
        let mut in_map = Vec::new();
        batch::per_cpu_hash::<SizeKey, u64>(self.sizes_fd.as_fd(), self.cpus, |key, per_cpu| {
            if key.round == round {
                size_keys.push(*key);
            } else {
                in_map.push(*key);
            }
            count_size(key, per_cpu.iter().fold(0u64, |a, b| a.wrapping_add(*b)));
        })
        .map_err(read_err(maps::SIZES))?;
        past.in_map = in_map;
        self.size_keys = size_keys;
        self.retire_sizes(past)
    }

    pub(super) fn read_losses(&self, snap: &mut Snapshot) -> Result<()> {
        for kind in Loss::ALL {
            let per_cpu = self
                .losses
                .get(&(kind as u32), 0)
                .map_err(map_err(maps::LOSSES))?;
            snap.losses[kind as usize] = per_cpu.iter().fold(0u64, |a, b| a.wrapping_add(*b));
        }
        Ok(())
    }

    /// The site counters of the current images (`epochs`), and every image's keys for
    /// `site_keys`; those of past rounds (not `round`) retired.
    pub(super) fn read_sites(
        &mut self,
        snap: &mut Snapshot,
        epochs: &FastMap<u32, u32>,
        round: u16,
        peaks: &PeakStates,
    ) -> Result<()> {
        let mut site_keys = std::mem::take(&mut self.site_keys);
        site_keys.clear();
        let mut past: retire::Past<SiteKey, SiteTotals> = Default::default();
        // As sizes: the slots' figures and the map's, summed; and a site's keys of every
        // round too.
        let mut site_slots: FastMap<SiteKey, Vec<SiteCounters>> = FastMap::new();
        for (key, counters) in self.site_slots.held() {
            site_slots.entry(key).or_default().push(counters);
        }
        let mut past_fix = Vec::new();
        let mut add_site = |key: &SiteKey, per_cpu: &[SiteCounters], slots: &[SiteCounters]| {
            let mut t = SiteTotals::from_per_cpu(per_cpu.iter().chain(slots));
            let past_round = key.round != round;
            let fix = peaks.get(&key.tgid).map(|&(seq, pending, _)| {
                let fix = peak_fix(per_cpu.iter().chain(slots), seq, pending);
                (seq, fix)
            });
            if epochs.get(&key.tgid) == Some(&key.epoch) {
                let id = (key.tgid, key.stack_id, u32::from(key.func));
                match snap.sites.entry(id) {
                    Entry::Occupied(mut o) => o.get_mut().plus(&t),
                    // Moved where the archive does not take it too.
                    Entry::Vacant(v) if past_round => _ = v.insert(t.clone()),
                    Entry::Vacant(v) => _ = v.insert(std::mem::take(&mut t)),
                }
                if let Some((_, f)) = fix {
                    add_fix(snap.peak_fix.entry(id).or_default(), f);
                }
            }
            if past_round {
                past.totals.insert(*key, t);
                if let Some(f) = fix.filter(|f| f.1 != (0, 0)) {
                    past_fix.push((*key, f));
                }
            }
        };
        let mut in_map = Vec::new();
        batch::per_cpu_hash::<SiteKey, SiteCounters>(
            self.sites_fd.as_fd(),
            self.cpus,
            |key, per_cpu| {
                if key.round == round {
                    site_keys.push(*key);
                } else {
                    in_map.push(*key);
                }
                let slots = site_slots.remove(key).unwrap_or_default();
                add_site(key, per_cpu, &slots);
            },
        )
        .map_err(read_err(maps::SITES))?;
        for (key, slots) in site_slots {
            add_site(&key, &[], &slots);
        }
        past.in_map = in_map;
        self.site_keys = site_keys;
        for (key, (seq, fix)) in past_fix {
            self.retired.keep_peak_fix(key, seq, fix);
        }
        self.retire_sites(past)
    }

    /// The call-time histograms, each function's summed over the CPUs.
    pub(super) fn read_latency(&self, snap: &mut Snapshot) -> Result<()> {
        for f in 0..FUNC_COUNT {
            let per_cpu = self
                .latency
                .get(&(f as u32), 0)
                .map_err(map_err(maps::LATENCY))?;
            for h in per_cpu.iter() {
                for (acc, b) in snap.latency[f].iter_mut().zip(h.buckets.iter()) {
                    *acc = acc.wrapping_add(*b);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peak_that_moved_during_the_read_is_named() {
        use crate::drain::round::KernelPeak;
        let before: PeakStates = [(1, (3, false, 10)), (2, (5, false, 7)), (3, (1, true, 2))]
            .into_iter()
            .collect();
        let bytes: BTreeMap<u32, KernelPeak> = [1, 2, 3]
            .into_iter()
            .map(|pid| {
                (
                    pid,
                    KernelPeak {
                        bytes: 100,
                        size: 8,
                        stack_id: 0,
                    },
                )
            })
            .collect();
        let mut after: PeaksNow = before.iter().map(|(p, s)| (*p, (*s, 100))).collect();
        assert!(moved(&before, &bytes, &after).is_empty());
        after.insert(1, ((3, true, 10), 100)); // a new high, not yet released
        after.insert(3, ((2, false, 2), 100)); // its release moved the number
        let mut m = moved(&before, &bytes, &after);
        m.sort();
        assert_eq!(m, [1, 3]);
        after.insert(1, ((3, false, 10), 120)); // higher, the same blocks (a realloc)
        assert_eq!(moved(&before, &bytes, &after).len(), 2);
        after.remove(&2); // gone from the map: no composition to trust
        assert_eq!(moved(&before, &bytes, &after).len(), 3);
    }
}
