//! Reading the kernel maps: the one place user space touches them.
//!
//! Counters in the kernel are cumulative and never reset; each round reads them all and
//! subtracts the previous read (`Snapshot::since`). We chose this over Heapprof's double-buffer
//! swap because a read-and-subtract needs no coordination with the probes (no map swap, no
//! flag the hot path must check) and cannot lose or double-count a call: an increment that lands
//! after the read is simply in the next round's difference.
pub mod keyed_slots;
pub mod live_slots;
pub mod proc_slots;
pub mod round;
use std::{
    collections::{BTreeMap, BTreeSet, HashMap as StdHashMap, HashSet},
    os::fd::{AsFd as _, OwnedFd},
    sync::atomic::Ordering,
};

use aya::{
    Ebpf,
    maps::{HashMap, MapData, PerCpuArray, StackTraceMap},
};
use heaptrace_common::{
    CALLER_ID_BASE, FUNC_COUNT, InFlight, InFlightSlot, LatencyHist, LiveBlock, LiveKey, Loss,
    ProcCounters, SiteCounters, SiteKey, SizeKey, StoredStack, maps,
    stack::{CACHE_GEN_MASK, cache_generation},
};

use crate::{
    bpf::batch,
    bpf::mmap_array::MappedArray,
    drain::keyed_slots::KeyedSlots,
    drain::live_slots::{Held, LiveSlots},
    drain::proc_slots::ProcSlots,
    drain::round::Leak,
    drain::round::{ProcSnapshot, SiteId, SiteTotals, Snapshot, Totals},
    error::{Error, Result},
};

/// Stacks freed (`KernelMaps::free_stacks`): id -> its return addresses and whether they were
/// whole, if it could be read.
pub type Freed = StdHashMap<i32, Option<(Vec<u64>, bool)>>;

/// The stack a site first seen right after its stack id was freed was counted under, from
/// what the id held then (`held`) and holds `now`: the stack freed, unless another has taken
/// the id since (None: it could be either). `code(ip)`: whether `ip` is code of the site's
/// process. The freed stack's first return address is code of the process that made it; a
/// process for which it is not (another address space, as with every process but a fork
/// that has not exec'ed) cannot have counted under it, and has the stack the id holds now.
pub fn freed_stack(
    held: Option<(Vec<u64>, bool)>,
    now: Option<(Vec<u64>, bool)>,
    code: impl Fn(u64) -> bool,
) -> Option<(Vec<u64>, bool)> {
    match (held, now) {
        (Some(held), now) if held.0.first().is_some_and(|ip| !code(*ip)) => {
            Some(now.unwrap_or((Vec::new(), true)))
        }
        (Some(held), Some(now)) if held != now => None,
        (Some(held), _) => Some(held),
        (None, now) => Some(now.unwrap_or((Vec::new(), true))),
    }
}

pub struct KernelMaps {
    losses: PerCpuArray<MapData, u64>,
    inflight: HashMap<MapData, u64, InFlight>,
    /// In-flight records of the threads that own a slot (`heaptrace_common::InFlightSlot`).
    inflight_slots: MappedArray<InFlightSlot>,
    /// Whole stacks, by id (ids below `CALLER_ID_BASE`).
    frames: HashMap<MapData, u32, StoredStack>,
    /// One-frame stacks: the callers of allocations whose whole stack FRAMES did not take.
    callers: StackTraceMap<MapData>,
    /// Which id recent stacks have, and its generation (`heaptrace_common::stack::cache_word`).
    stack_cache: MappedArray<u64>,
    stack_gen: MappedArray<u64>,
    latency: PerCpuArray<MapData, LatencyHist>,
    execs: HashMap<MapData, u32, u32>,
    /// The hash maps read every round or walked for a process's entries, for batched reads
    /// and deletes (`batch`).
    procs_fd: OwnedFd,
    sizes_fd: OwnedFd,
    sites_fd: OwnedFd,
    live_fd: OwnedFd,
    /// The live blocks held in slots before the live map (`heaptrace_common::live`).
    live_slots: LiveSlots,
    /// Process counters in slots before the process map (`heaptrace_common::procs`).
    proc_slots: ProcSlots,
    /// Site and size counters in slots before their maps (`heaptrace_common::keyed`).
    site_slots: KeyedSlots<SiteKey, SiteCounters>,
    size_slots: KeyedSlots<SizeKey, u64>,
    cpus: usize,
    /// The keys of the size and site maps, every image's, as the last snapshot read them:
    /// what forgetting a process or an image deletes, without a walk of the maps. Kept flat
    /// (no grouping by process on every round's read); searched only when one is forgotten.
    size_keys: Vec<SizeKey>,
    site_keys: Vec<SiteKey>,
}

fn map_err(map: &'static str) -> impl Fn(aya::maps::MapError) -> Error {
    move |e| Error::Map {
        map,
        reason: e.to_string(),
    }
}

/// The error of a batched read of `map`.
fn read_err(map: &'static str) -> impl Fn(std::io::Error) -> Error {
    move |e| Error::Map {
        map,
        reason: e.to_string(),
    }
}

fn take<T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>>(
    ebpf: &mut Ebpf,
    name: &'static str,
) -> Result<T> {
    let map = ebpf.take_map(name).ok_or_else(|| Error::Map {
        map: name,
        reason: "missing from the object".into(),
    })?;
    T::try_from(map).map_err(map_err(name))
}

/// A second descriptor of a hash map (per-CPU or not), for batched reads and deletes next to
/// aya's handle.
fn hash_fd(ebpf: &Ebpf, name: &'static str) -> Result<OwnedFd> {
    match ebpf.map(name) {
        Some(aya::maps::Map::PerCpuHashMap(data) | aya::maps::Map::HashMap(data)) => data
            .fd()
            .as_fd()
            .try_clone_to_owned()
            .map_err(|e| Error::Map {
                map: name,
                reason: e.to_string(),
            }),
        _ => Err(Error::Map {
            map: name,
            reason: "not a hash map in the object".into(),
        }),
    }
}

impl KernelMaps {
    pub fn take(ebpf: &mut Ebpf) -> Result<KernelMaps> {
        let procs_fd = hash_fd(ebpf, maps::PROCS)?;
        let sizes_fd = hash_fd(ebpf, maps::SIZES)?;
        let sites_fd = hash_fd(ebpf, maps::SITES)?;
        let live_fd = hash_fd(ebpf, maps::LIVE)?;
        let cpus = aya::util::nr_cpus().map_err(|(path, e)| Error::Read {
            path: path.into(),
            source: e,
        })?;
        Ok(KernelMaps {
            procs_fd,
            sizes_fd,
            sites_fd,
            live_fd,
            live_slots: LiveSlots::map(ebpf)?,
            proc_slots: ProcSlots::map(ebpf)?,
            site_slots: KeyedSlots::map(ebpf, maps::SITE_SLOTS)?,
            size_slots: KeyedSlots::map(ebpf, maps::SIZE_SLOTS)?,
            cpus,
            size_keys: Vec::new(),
            site_keys: Vec::new(),
            losses: take(ebpf, maps::LOSSES)?,
            inflight: take(ebpf, maps::INFLIGHT)?,
            inflight_slots: MappedArray::map(ebpf, maps::INFLIGHT_SLOTS)?,
            frames: take(ebpf, maps::FRAMES)?,
            callers: take(ebpf, maps::CALLERS)?,
            stack_cache: MappedArray::map(ebpf, maps::STACK_CACHE)?,
            stack_gen: MappedArray::map(ebpf, maps::STACK_GEN)?,
            latency: take(ebpf, maps::LATENCY)?,
            execs: take(ebpf, maps::EXECS)?,
        })
    }

    /// The return addresses of a stored stack, innermost first, and whether it is whole
    /// (false: its caller alone, the rest lost).
    pub fn stack(&self, id: i32) -> Option<(Vec<u64>, bool)> {
        let id = u32::try_from(id).ok()?;
        if id >= CALLER_ID_BASE {
            let trace = self.callers.get(&(id - CALLER_ID_BASE), 0).ok()?;
            return Some((trace.frames().iter().map(|f| f.ip).collect(), false));
        }
        Some((self.frames.get(&id, 0).ok()?.frames().to_vec(), true))
    }

    /// Frees stored stacks for others to take (ids as in the site map; lost ones, negative,
    /// are skipped). The kernel keeps a stack until it is deleted, so in a system-wide trace
    /// the maps filled with the stacks of processes long gone, and every later one lost its
    /// stacks. Returns what each held, read just before: a site first seen after this may
    /// have been counted under the stack freed, or under one that took its place since.
    pub fn free_stacks(&mut self, ids: impl IntoIterator<Item = i32>) -> Freed {
        let mut freed = Freed::new();
        for id in ids {
            let Ok(u) = u32::try_from(id) else { continue };
            let held = self.stack(id);
            let removed = if u >= CALLER_ID_BASE {
                self.callers.remove(&(u - CALLER_ID_BASE))
            } else {
                self.frames.remove(&u)
            };
            if removed.is_ok() {
                freed.insert(id, held);
            }
        }
        if !freed.is_empty() {
            next_stack_generation(&self.stack_cache, &self.stack_gen);
        }
        freed
    }

    /// Every counter the kernel keeps, read once: processes, sizes, losses, sites, latency.
    pub fn snapshot(&mut self) -> Result<Snapshot> {
        let mut snap = Snapshot::default();
        let epochs = self.read_procs(&mut snap)?;
        self.read_sizes(&mut snap, &epochs)?;
        self.read_losses(&mut snap)?;
        self.read_sites(&mut snap, &epochs)?;
        snap.fold_site_sizes();
        // Every round too, not only after frees: a word written for a copy that its program
        // then removed as torn (full preemption, `stacks::intact`) names an id with no stack,
        // and is taken until the generation moves on. It lives a round at most.
        next_stack_generation(&self.stack_cache, &self.stack_gen);
        self.read_latency(&mut snap)?;
        Ok(snap)
    }

    /// The processes' counters; returns each one's current image: only its entries count (an
    /// earlier image's wait to be dropped, see `restarted`). A process without counters has
    /// no current entries yet.
    fn read_procs(&self, snap: &mut Snapshot) -> Result<StdHashMap<u32, u32>> {
        let mut epochs: StdHashMap<u32, u32> = StdHashMap::new();
        // A process counts in its slots and, on CPUs where another owns its slot, in the map:
        // its figures are the sum of both.
        let mut in_slots: StdHashMap<u32, Vec<ProcCounters>> = StdHashMap::new();
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
    /// `size_keys`.
    fn read_sizes(&mut self, snap: &mut Snapshot, epochs: &StdHashMap<u32, u32>) -> Result<()> {
        let mut size_keys = std::mem::take(&mut self.size_keys);
        size_keys.clear();
        // A size counts in its slots and, on CPUs where another holds its slot, in the map:
        // its figures are the sum of both. Only the current images' count.
        let mut count_size = |key: &SizeKey, n: u64| {
            if epochs.get(&key.tgid) == Some(&key.epoch) {
                let c = snap
                    .sizes
                    .entry((key.tgid, key.func, key.size, key.stack_id))
                    .or_default();
                *c = c.wrapping_add(n);
            }
        };
        for (key, n) in self.size_slots.held() {
            count_size(&key, n);
        }
        batch::per_cpu_hash::<SizeKey, u64>(self.sizes_fd.as_fd(), self.cpus, |key, per_cpu| {
            size_keys.push(*key);
            count_size(key, per_cpu.iter().fold(0u64, |a, b| a.wrapping_add(*b)));
        })
        .map_err(read_err(maps::SIZES))?;
        self.size_keys = size_keys;
        Ok(())
    }

    fn read_losses(&self, snap: &mut Snapshot) -> Result<()> {
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
    /// `site_keys`.
    fn read_sites(&mut self, snap: &mut Snapshot, epochs: &StdHashMap<u32, u32>) -> Result<()> {
        let mut site_keys = std::mem::take(&mut self.site_keys);
        site_keys.clear();
        // As sizes: the slots' figures and the map's, summed.
        let mut site_slots: StdHashMap<SiteKey, Vec<SiteCounters>> = StdHashMap::new();
        for (key, counters) in self.site_slots.held() {
            site_slots.entry(key).or_default().push(counters);
        }
        let mut add_site = |key: &SiteKey, per_cpu: &[SiteCounters], slots: &[SiteCounters]| {
            if epochs.get(&key.tgid) == Some(&key.epoch) {
                snap.sites.insert(
                    (key.tgid, key.stack_id, key.func),
                    SiteTotals::from_per_cpu(per_cpu.iter().chain(slots)),
                );
            }
        };
        batch::per_cpu_hash::<SiteKey, SiteCounters>(
            self.sites_fd.as_fd(),
            self.cpus,
            |key, per_cpu| {
                site_keys.push(*key);
                let slots = site_slots.remove(key).unwrap_or_default();
                add_site(key, per_cpu, &slots);
            },
        )
        .map_err(read_err(maps::SITES))?;
        for (key, slots) in site_slots {
            add_site(&key, &[], &slots);
        }
        self.site_keys = site_keys;
        Ok(())
    }

    /// The call-time histograms, each function's summed over the CPUs.
    fn read_latency(&self, snap: &mut Snapshot) -> Result<()> {
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

    /// Blocks still live, grouped by site. Reads the whole live map: for the end of a trace,
    /// not for every round.
    pub fn live_blocks(&self, pids: Option<&HashSet<u32>>) -> Result<BTreeMap<SiteId, Leak>> {
        let blocks = self.live_entries(|tgid| pids.is_none_or(|p| p.contains(&tgid)))?;
        Ok(group_by_site(&blocks))
    }

    /// The live blocks of the current images of the processes `want` accepts.
    fn live_entries(&self, want: impl Fn(u32) -> bool) -> Result<StdHashMap<LiveKey, LiveBlock>> {
        let mut epochs: StdHashMap<u32, u32> = StdHashMap::new();
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
    fn live_where(&self, mut want: impl FnMut(&LiveKey) -> bool) -> Result<Live> {
        let mut out = Live {
            in_map: StdHashMap::new(),
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
    fn drop_live(&self, live: Live) -> Result<()> {
        self.live_slots.empty(&live.in_slots);
        let keys: Vec<LiveKey> = live.in_map.into_keys().collect();
        Self::delete(&self.live_fd, maps::LIVE, &keys)
    }

    /// Deletes `keys` from a map in batches; a failure is the map's error.
    fn delete<K: aya::Pod>(fd: &OwnedFd, map: &'static str, keys: &[K]) -> Result<()> {
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
        let epochs: StdHashMap<u32, u32> = pids.iter().map(|p| (*p, self.epoch(*p))).collect();
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
        }
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
        Ok(leaks)
    }

    /// The epoch of a process's current image (see `ProcCounters::epoch`).
    /// The process's current image (as `ProcCounters::epoch`).
    pub fn epoch(&self, tgid: u32) -> u32 {
        self.execs.get(&tgid, 0).unwrap_or(0).wrapping_add(1)
    }

    /// Whether the kernel started this process over at an exec while it was traced.
    pub fn has_restarted(&self, tgid: u32) -> bool {
        self.execs.get(&tgid, 0).is_ok()
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
        let epochs: StdHashMap<u32, u32> = pids.iter().map(|p| (*p, self.epoch(*p))).collect();
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
        Ok(sites
            .iter()
            .chain(&in_slots)
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
        Ok(dead.len() + free_slots_of_dead_threads(&self.inflight_slots, thread_alive))
    }
}

/// Moves the stack cache on to its next generation, after stacks were deleted from FRAMES: no
/// word written before counts any more (`heaptrace_common::stack::cache_word`). The words of
/// the next generation, written a wrap of the counter ago, are cleared first.
fn next_stack_generation(cache: &MappedArray<u64>, generation: &MappedArray<u64>) {
    let next = (generation.first_word(0).load(Ordering::Acquire) + 1) & CACHE_GEN_MASK;
    for i in 0..cache.len() {
        let word = cache.first_word(i);
        let w = word.load(Ordering::Acquire);
        if w != 0 && cache_generation(w) == next {
            // A program writing meanwhile writes the current generation: left.
            let _ = word.compare_exchange(w, 0, Ordering::AcqRel, Ordering::Relaxed);
        }
    }
    generation.first_word(0).store(next, Ordering::Release);
}

/// Frees the in-flight slots whose owners are gone; returns how many. Each is freed only if
/// its owner is still the one read: no program of a dead thread runs, and a thread that took
/// the slot meanwhile keeps it.
fn free_slots_of_dead_threads(
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

/// Live blocks as `live_where` read them: a block is in a slot or in the map, never both.
struct Live {
    in_map: StdHashMap<LiveKey, LiveBlock>,
    in_slots: Vec<Held>,
}

impl Live {
    fn iter(&self) -> impl Iterator<Item = (&LiveKey, &LiveBlock)> {
        let slots = self.in_slots.iter().map(|h| (&h.key, &h.block));
        self.in_map.iter().chain(slots)
    }
}

fn group_by_site(blocks: &StdHashMap<LiveKey, LiveBlock>) -> BTreeMap<SiteId, Leak> {
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

fn comm_str(comm: &[u8; 16]) -> String {
    let end = comm.iter().position(|b| *b == 0).unwrap_or(comm.len());
    String::from_utf8_lossy(&comm[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_slots_of_threads_gone_are_freed() {
        let owned = |tgid: u64, tid: u64| InFlightSlot {
            owner: (tgid << 32) | tid,
            rec: InFlight {
                sp: 0x7ff0,
                ..InFlight::NONE
            },
        };
        let free = InFlightSlot {
            owner: 0,
            ..owned(0, 0)
        };
        let mut slots = [owned(10, 11), free, owned(10, 12), owned(20, 21)];
        let t = MappedArray::over(&mut slots);
        let alive = |tgid: u32, tid: u32| (tgid, tid) != (10, 12) && tgid != 20;
        assert_eq!(free_slots_of_dead_threads(&t, alive), 2);
        let owners: Vec<u64> = (0..t.len()).map(|i| t.read(i).owner).collect();
        assert_eq!(owners, [(10 << 32) | 11, 0, 0, 0]);
        assert_eq!(free_slots_of_dead_threads(&t, alive), 0);
    }

    #[test]
    fn a_new_stack_generation_drops_every_word_written_before() {
        use heaptrace_common::stack::{cache_choice, cache_word};
        let h = 0xfeed_beef_0000_0000;
        let mut words = [
            cache_word(h, 5, 1),
            0,
            cache_word(h, 6, 0),
            cache_word(h, 4, 0),
        ];
        let mut generation = [5u64];
        let (c, g) = (
            MappedArray::over(&mut words),
            MappedArray::over(&mut generation),
        );
        next_stack_generation(&c, &g);
        assert_eq!(g.read(0), 6);
        // Only the next generation's words are cleared: a wrap of the counter ago.
        assert_eq!(c.read(2), 0);
        assert_eq!(
            cache_choice(c.read(0), h, 6),
            None,
            "the words before are stale"
        );
        assert_eq!(c.read(3), cache_word(h, 4, 0));
        generation[0] = CACHE_GEN_MASK;
        let g = MappedArray::over(&mut generation);
        next_stack_generation(&c, &g);
        assert_eq!(g.read(0), 0, "the counter wraps");
    }

    #[test]
    fn a_site_first_seen_after_its_stack_was_freed_keeps_that_stack_unless_another_took_it() {
        let a = Some((vec![1, 2], true));
        let b = Some((vec![3], true));
        let all = |_| true;
        // Nothing took the id: the stack freed.
        assert_eq!(freed_stack(a.clone(), None, all), a);
        // The same stack stored again.
        assert_eq!(freed_stack(a.clone(), a.clone(), all), a);
        // Another stack took it: counted under either, not known which.
        assert_eq!(freed_stack(a.clone(), b.clone(), all), None);
        // What the id held could not be read: what it holds now.
        assert_eq!(freed_stack(None, b.clone(), all), b);
        assert_eq!(freed_stack(None, None, all), Some((Vec::new(), true)));
        // The stack freed began outside this process's code: not its stack, the one now is.
        let not_1 = |ip| ip != 1;
        assert_eq!(freed_stack(a.clone(), b.clone(), not_1), b);
        assert_eq!(freed_stack(a, None, not_1), Some((Vec::new(), true)));
        // Frames past the first may be noise (no frame pointers) even for its own process.
        let only_1 = |ip| ip == 1;
        assert_eq!(freed_stack(Some((vec![1, 2], true)), b, only_1), None);
    }
}
