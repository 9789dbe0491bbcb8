//! The region read as a `Source`: the threads' counters, sizes and site entries summed into a
//! Snapshot, stacks and live blocks looked up.
use std::collections::{BTreeMap, BTreeSet, HashSet};

use heaptrace_common::{
    FUNC_COUNT, LOG2_BUCKETS, SiteCounters,
    inproc::{FIRST_KEY, Header, LOST_STACK, LiveEntry, SiteEntry, SizeEntry, StackHead},
    mode,
};

use super::{
    Region,
    check::{MAX_COUNT, MAX_SIZE, bad},
};
use crate::{
    drain::{
        Freed,
        round::{Buckets, KernelPeak, Leak, ProcSnapshot, SiteId, SiteTotals, Snapshot, Totals},
        source::Source,
    },
    error::Result,
    profile::complete::{Incomplete, RegionLost},
    targets::procfs,
};

/// Live-table entries read at a time.
const LIVE_CHUNK: usize = 1 << 15;

impl Region {
    /// Each thread's size table and the shared one, summed: a key may be in several (each
    /// thread's, and the shared table's where a thread's had no room).
    fn read_sizes(&self, h: &Header, snap: &mut Snapshot) -> Result<()> {
        let used = self.sites_used(h);
        let mut wrong = false;
        let mut tables: Vec<(usize, usize)> = (self.slots(h)?.into_iter())
            .map(|slot| (slot + self.layout.sizes_at, self.caps.sizes as usize))
            .collect();
        tables.push((self.layout.shared_sizes_at, self.layout.shared_sizes));
        // In chunks: the shared table may be large (`--size-map-size`, up to 2^24 entries).
        let chunks = tables.into_iter().flat_map(|(at, n)| {
            (0..n).step_by(LIVE_CHUNK).map(move |i| {
                let size = std::mem::size_of::<SizeEntry>();
                (at + i * size, LIVE_CHUNK.min(n - i))
            })
        });
        for (at, n) in chunks {
            for e in self.read::<SizeEntry>(at, n)? {
                if e.key < FIRST_KEY || e.count == 0 {
                    continue;
                }
                let (func, size, stack) = ((e.tag >> 32) as u32, e.key - FIRST_KEY, e.tag as i32);
                if !self.known_site(func, stack, used) || size > MAX_SIZE || e.count > MAX_COUNT {
                    wrong = true;
                    continue;
                }
                let key = (self.pid, func, size, stack);
                let n = snap.sizes.entry(key).or_default();
                *n = n.wrapping_add(e.count);
            }
        }
        self.found(bad::SIZES, wrong);
        Ok(())
    }

    /// Each site's entries summed over the threads: ids below the stacks stored, then the
    /// lost stack of each function.
    fn read_sites(&mut self, h: &Header, snap: &mut Snapshot) -> Result<()> {
        let used = self.sites_used(h);
        let sites = self.caps.sites as usize;
        self.learn_funcs(used)?;
        let mut sums = vec![SiteEntry::default(); used + FUNC_COUNT];
        // What each site's live figures add to be those at the peak (`SiteEntry::fold_peak`).
        let mut fixes = vec![(0u64, 0u64); used + FUNC_COUNT];
        let (seq, pending) = (h.peak_seq, h.peak_pending != 0);
        for slot in self.slots(h)? {
            let at = slot + self.layout.sites_at;
            let stored = self.read::<SiteEntry>(at, used)?;
            let lost_at = at + sites * std::mem::size_of::<SiteEntry>();
            let lost = self.read::<SiteEntry>(lost_at, FUNC_COUNT)?;
            let entries = stored.iter().chain(lost.iter());
            for ((sum, fix), e) in sums.iter_mut().zip(fixes.iter_mut()).zip(entries) {
                add_entry(sum, e);
                let f = e.at_peak_correction(seq, pending);
                fix.0 = fix.0.wrapping_add(f.0);
                fix.1 = fix.1.wrapping_add(f.1);
            }
        }
        let lifetimes =
            self.read::<u64>(self.layout.lifetimes, (sites + FUNC_COUNT) * LOG2_BUCKETS)?;
        for (i, sum) in sums.iter().enumerate() {
            if *sum == SiteEntry::default() {
                continue;
            }
            // Stored stacks' lifetimes first, the lost stacks' at the end, as the entries.
            let at = match i.checked_sub(used) {
                None => i,
                Some(f) => sites + f,
            } * LOG2_BUCKETS;
            let key = match i.checked_sub(used) {
                None => (self.pid, i as i32, self.funcs[i]),
                Some(f) => (self.pid, LOST_STACK, f as u32),
            };
            if key.2 as usize >= FUNC_COUNT {
                continue; // counted in `learn_funcs`
            }
            let c = SiteCounters {
                calls: sum.calls,
                bytes: sum.bytes,
                frees: sum.frees,
                freed_bytes: sum.freed_bytes,
                temp_blocks: sum.temp_blocks,
                temp_bytes: sum.temp_bytes,
                untracked: sum.untracked,
                untracked_bytes: sum.untracked_bytes,
                ..SiteCounters::ZERO
            };
            let mut t = SiteTotals::from_per_cpu([&c]);
            // The region's are 64-bit, counted for the whole run: not through the kernel's.
            t.lifetimes = Buckets::from_dense(&std::array::from_fn(|b| lifetimes[at + b]));
            snap.sites.insert(key, t);
            if fixes[i] != (0, 0) {
                snap.peak_fix.insert(key, fixes[i]);
            }
        }
        Ok(())
    }

    /// The threads' latency histograms, summed.
    fn read_latency(&self, h: &Header, snap: &mut Snapshot) -> Result<()> {
        for slot in self.slots(h)? {
            let at = slot + self.layout.latency_at;
            let counts = self.read::<u64>(at, FUNC_COUNT * LOG2_BUCKETS)?;
            for (f, hist) in snap.latency.iter_mut().enumerate() {
                for (b, n) in hist.iter_mut().enumerate() {
                    *n = n.wrapping_add(counts[f * LOG2_BUCKETS + b]);
                }
            }
        }
        Ok(())
    }

    /// Every block in the live table, by site. An entry no call can have written (a size or
    /// a site out of bounds) is left out and counted: its keys could otherwise make as many
    /// sites as the table has slots.
    fn live_by_site(&self) -> Result<BTreeMap<SiteId, Leak>> {
        let used = self.sites_used(&self.header());
        let mut out: BTreeMap<SiteId, Leak> = BTreeMap::new();
        let slots = self.caps.live as usize;
        let size = std::mem::size_of::<LiveEntry>();
        let mut wrong = false;
        // Live blocks share the address space: more bytes than it has cannot be.
        let mut total = 0u64;
        for start in (0..slots).step_by(LIVE_CHUNK) {
            let n = LIVE_CHUNK.min(slots - start);
            for e in self.read::<LiveEntry>(self.layout.live + start * size, n)? {
                if e.key < FIRST_KEY {
                    continue;
                }
                if e.size > MAX_SIZE - total || !self.known_site(e.func, e.stack_id, used) {
                    wrong = true;
                    continue;
                }
                total += e.size;
                let l = out.entry((self.pid, e.stack_id, e.func)).or_default();
                l.blocks = l.blocks.saturating_add(1);
                l.bytes = l.bytes.saturating_add(e.size);
            }
        }
        self.found(bad::LIVE, wrong);
        Ok(out)
    }
}

impl Region {
    fn read_snapshot(&mut self, h: &Header) -> Result<Snapshot> {
        let mut snap = Snapshot::default();
        if self.pid == 0 || self.slots(h)?.is_empty() {
            return Ok(snap);
        }
        let heads = self.thread_heads(h)?;
        let totals = Totals::from_per_cpu(heads.iter().map(|t| &t.counters));
        if let Some(comm) = procfs::comm(self.pid) {
            self.comm = comm;
        }
        let proc = ProcSnapshot {
            comm: self.comm.clone(),
            totals,
            epoch: h.epoch,
        };
        snap.procs.insert(self.pid, proc);
        if self.made.mode >= mode::SIZES {
            self.read_sizes(h, &mut snap)?;
            self.read_latency(h, &mut snap)?;
        }
        if self.made.mode >= mode::STACKS {
            self.read_sites(h, &mut snap)?;
        }
        snap.losses = h.losses;
        if h.peak_max as i64 > 0 {
            let peak = KernelPeak {
                bytes: h.peak_max,
                size: h.peak_size,
                stack_id: h.peak_stack as i32,
            };
            snap.peaks.insert(self.pid, peak);
            if self.made.mode >= mode::STACKS {
                // No count of blocks at the peak here: those of its sites.
                let states = crate::drain::FastMap::from_iter([(self.pid, (0, false, 0))]);
                snap.compose_peaks(&states);
                if let Some(held) = snap.peak_held.get_mut(&self.pid) {
                    // Saturating: a region the process scribbled on can hold any figures.
                    let blocks = held.sites.iter().map(|s| s.2.max(0) as u64);
                    held.blocks = blocks.fold(0, u64::saturating_add);
                }
            }
        }
        snap.peak_fix.clear();
        snap.fold_site_sizes();
        Ok(snap)
    }
}

fn add_entry(sum: &mut SiteEntry, e: &SiteEntry) {
    let add = |a: &mut u64, b: u64| *a = a.wrapping_add(b);
    add(&mut sum.calls, e.calls);
    add(&mut sum.bytes, e.bytes);
    add(&mut sum.frees, e.frees);
    add(&mut sum.freed_bytes, e.freed_bytes);
    add(&mut sum.temp_blocks, e.temp_blocks);
    add(&mut sum.temp_bytes, e.temp_bytes);
    add(&mut sum.untracked, e.untracked);
    add(&mut sum.untracked_bytes, e.untracked_bytes);
}

impl Source for Region {
    /// A read that a new image's start-over overlapped (its epoch 0 or changed) is not taken:
    /// the last one stands until the next round.
    fn snapshot(&mut self) -> Result<Snapshot> {
        let h = self.header();
        self.check_header(&h);
        if h.epoch == 0 {
            return Ok(self.last.clone());
        }
        let same_image = h.epoch == self.epoch;
        if !same_image {
            self.epoch = h.epoch;
            self.funcs.clear();
        }
        let mut snap = self.read_snapshot(&h)?;
        if self.header().epoch != h.epoch {
            return Ok(self.last.clone());
        }
        self.vet(&mut snap, &self.last, same_image, self.sites_used(&h));
        self.last = snap.clone();
        Ok(snap)
    }
    fn stack(&self, id: i32) -> Option<(Vec<u64>, bool)> {
        let used = self.sites_used(&self.header());
        let id = usize::try_from(id).ok().filter(|i| *i < used)?;
        let at = self.layout.stacks + id * self.layout.stack_stride;
        let head = self.read::<u8>(at, std::mem::size_of::<StackHead>()).ok()?;
        // SAFETY: plain #[repr(C)] integers.
        let head: StackHead = unsafe { std::ptr::read_unaligned(head.as_ptr() as *const _) };
        let len = (head.len as usize).min(self.caps.depth as usize);
        let ips = self
            .read::<u64>(at + std::mem::size_of::<StackHead>(), len)
            .ok()?;
        Some((ips, head.whole != 0))
    }

    fn live_blocks(&self, pids: Option<&HashSet<u32>>) -> Result<BTreeMap<SiteId, Leak>> {
        if pids.is_some_and(|p| !p.contains(&self.pid)) || self.pid == 0 {
            return Ok(BTreeMap::new());
        }
        self.live_by_site()
    }

    fn forget(&mut self, pids: &HashSet<u32>) -> Result<BTreeMap<SiteId, Leak>> {
        self.live_blocks(Some(pids))
    }

    fn restarted(&mut self, _pids: &HashSet<u32>) -> Result<BTreeSet<i32>> {
        Ok(BTreeSet::new())
    }

    fn free_stacks(&mut self, _ids: Vec<i32>) -> Freed {
        Freed::default()
    }

    fn epoch(&self, _tgid: u32) -> u32 {
        self.header().epoch
    }

    fn has_restarted(&self, _tgid: u32) -> bool {
        false
    }

    fn purge_inflight(&mut self, _thread_alive: &dyn Fn(u32, u32) -> bool) -> Result<usize> {
        Ok(0)
    }

    fn stop(&mut self) {
        self.stop_counting();
    }

    fn region_lost(&self) -> RegionLost {
        let h = self.header();
        RegionLost {
            region_overwritten: self.faults(),
            raw_thread_calls: h.raw_thread_calls.min(MAX_COUNT),
            nested_calls: h.nested_calls.min(MAX_COUNT),
        }
    }

    /// The library never took the region: which of the reasons it can tell (or the daemon
    /// knows: an exec it held).
    fn incomplete(&self) -> Vec<Incomplete> {
        if self.pid == 0 || self.owner() != 0 {
            return Vec::new();
        }
        let why = if self.header().failure == heaptrace_common::inproc::failure::MAP {
            Incomplete::RegionNotMapped
        } else if self.execs > 0 {
            Incomplete::LibraryNotAfterExec
        } else {
            Incomplete::LibraryNeverRan
        };
        vec![why]
    }

    fn exec_held(&mut self) -> Result<bool> {
        self.start_over()?;
        Ok(true)
    }
}
