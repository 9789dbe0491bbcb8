//! Reading the kernel maps: the one place user space touches them.
//!
//! Counters in the kernel are cumulative and never reset; each round reads them all and
//! subtracts the previous read (`Snapshot::since`). We chose this over Heapprof's double-buffer
//! swap because a read-and-subtract needs no coordination with the probes (no map swap, no
//! flag the hot path must check) and cannot lose or double-count a call: an increment that lands
//! after the read is simply in the next round's difference.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap as StdHashMap, HashSet},
    os::fd::{AsFd as _, OwnedFd},
};

use aya::{
    Ebpf,
    maps::{HashMap, MapData, PerCpuArray, PerCpuHashMap, StackTraceMap},
};
use heaptrace_common::{
    FUNC_COUNT, InFlight, LatencyHist, LiveBlock, LiveKey, Loss, ProcCounters, SiteCounters,
    SiteKey, SizeKey, maps,
};

use crate::{
    aggregate::Leak,
    batch,
    error::{Error, Result},
    model::{ProcSnapshot, SiteId, SiteTotals, Snapshot, Totals},
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
    procs: PerCpuHashMap<MapData, u32, ProcCounters>,
    sizes: PerCpuHashMap<MapData, SizeKey, u64>,
    losses: PerCpuArray<MapData, u64>,
    live: HashMap<MapData, LiveKey, LiveBlock>,
    inflight: HashMap<MapData, u64, InFlight>,
    sites: PerCpuHashMap<MapData, SiteKey, SiteCounters>,
    stacks: StackTraceMap<MapData>,
    stacks2: StackTraceMap<MapData>,
    /// One-frame stacks: the callers of allocations whose whole stack neither map took.
    callers: StackTraceMap<MapData>,
    /// Ids at or above this are in `stacks2`, at or above twice this in `callers`.
    stack_id_offset: u32,
    latency: PerCpuArray<MapData, LatencyHist>,
    execs: HashMap<MapData, u32, u32>,
    /// The per-CPU hash maps read every round, for batched reads (`batch`).
    procs_fd: OwnedFd,
    sizes_fd: OwnedFd,
    sites_fd: OwnedFd,
    cpus: usize,
}

fn map_err(map: &'static str) -> impl Fn(aya::maps::MapError) -> Error {
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

/// A second descriptor of a per-CPU hash map, for batched reads next to aya's handle.
fn per_cpu_hash_fd(ebpf: &Ebpf, name: &'static str) -> Result<OwnedFd> {
    match ebpf.map(name) {
        Some(aya::maps::Map::PerCpuHashMap(data)) => data
            .fd()
            .as_fd()
            .try_clone_to_owned()
            .map_err(|e| Error::Map {
                map: name,
                reason: e.to_string(),
            }),
        _ => Err(Error::Map {
            map: name,
            reason: "not a per-CPU hash map in the object".into(),
        }),
    }
}

impl KernelMaps {
    pub fn take(ebpf: &mut Ebpf, stack_id_offset: u32) -> Result<KernelMaps> {
        let procs_fd = per_cpu_hash_fd(ebpf, maps::PROCS)?;
        let sizes_fd = per_cpu_hash_fd(ebpf, maps::SIZES)?;
        let sites_fd = per_cpu_hash_fd(ebpf, maps::SITES)?;
        let cpus = aya::util::nr_cpus().map_err(|(path, e)| Error::Read {
            path: path.into(),
            source: e,
        })?;
        Ok(KernelMaps {
            procs_fd,
            sizes_fd,
            sites_fd,
            cpus,
            procs: take(ebpf, maps::PROCS)?,
            sizes: take(ebpf, maps::SIZES)?,
            losses: take(ebpf, maps::LOSSES)?,
            live: take(ebpf, maps::LIVE)?,
            inflight: take(ebpf, maps::INFLIGHT)?,
            sites: take(ebpf, maps::SITES)?,
            stacks: take(ebpf, maps::STACKS)?,
            stacks2: take(ebpf, maps::STACKS2)?,
            callers: take(ebpf, maps::CALLERS)?,
            stack_id_offset,
            latency: take(ebpf, maps::LATENCY)?,
            execs: take(ebpf, maps::EXECS)?,
        })
    }

    /// The return addresses of a stored stack, innermost first, and whether it is whole
    /// (false: its caller alone, the rest lost).
    pub fn stack(&self, id: i32) -> Option<(Vec<u64>, bool)> {
        let id = u32::try_from(id).ok()?;
        let offset = self.stack_id_offset;
        let (trace, whole) = if id >= 2 * offset {
            (self.callers.get(&(id - 2 * offset), 0).ok()?, false)
        } else if id >= offset {
            (self.stacks2.get(&(id - offset), 0).ok()?, true)
        } else {
            (self.stacks.get(&id, 0).ok()?, true)
        };
        Some((trace.frames().iter().map(|f| f.ip).collect(), whole))
    }

    /// Frees stored stacks for others to take (ids as in the site map; lost ones, negative,
    /// are skipped). The kernel keeps a stack until it is deleted, so in a system-wide trace
    /// the maps filled with the stacks of processes long gone, and every later one lost its
    /// stacks. Returns what each held, read just before: a site first seen after this may
    /// have been counted under the stack freed, or under one that took its place since.
    pub fn free_stacks(&mut self, ids: impl IntoIterator<Item = i32>) -> Freed {
        let offset = self.stack_id_offset;
        let mut freed = Freed::new();
        for id in ids {
            let Ok(u) = u32::try_from(id) else { continue };
            let held = self.stack(id);
            let removed = if u >= 2 * offset {
                self.callers.remove(&(u - 2 * offset))
            } else if u >= offset {
                self.stacks2.remove(&(u - offset))
            } else {
                self.stacks.remove(&u)
            };
            if removed.is_ok() {
                freed.insert(id, held);
            }
        }
        freed
    }

    pub fn snapshot(&self) -> Result<Snapshot> {
        let mut snap = Snapshot::default();
        let read_err = |map: &'static str| {
            move |e: std::io::Error| Error::Map {
                map,
                reason: e.to_string(),
            }
        };
        // Each process's current image: only its entries count (an earlier image's wait to be
        // dropped, see `restarted`). A process without counters has no current entries yet.
        let mut epochs: StdHashMap<u32, u32> = StdHashMap::new();
        batch::per_cpu_hash::<u32, ProcCounters>(
            self.procs_fd.as_fd(),
            self.cpus,
            |&tgid, per_cpu| {
                let epoch = per_cpu.iter().map(|c| c.epoch).max().unwrap_or(0);
                epochs.insert(tgid, epoch as u32);
                let comm = per_cpu
                    .iter()
                    .map(|c| comm_str(&c.comm))
                    .find(|c| !c.is_empty())
                    .unwrap_or_default();
                snap.procs.insert(
                    tgid,
                    ProcSnapshot {
                        comm,
                        totals: Totals::from_per_cpu(per_cpu.iter()),
                    },
                );
            },
        )
        .map_err(read_err(maps::PROCS))?;
        batch::per_cpu_hash::<SizeKey, u64>(self.sizes_fd.as_fd(), self.cpus, |key, per_cpu| {
            if epochs.get(&key.tgid) != Some(&key.epoch) {
                return;
            }
            let n = per_cpu.iter().fold(0u64, |a, b| a.wrapping_add(*b));
            snap.sizes
                .insert((key.tgid, key.func, key.size, key.stack_id), n);
        })
        .map_err(read_err(maps::SIZES))?;
        for kind in Loss::ALL {
            let per_cpu = self
                .losses
                .get(&(kind as u32), 0)
                .map_err(map_err(maps::LOSSES))?;
            snap.losses[kind as usize] = per_cpu.iter().fold(0u64, |a, b| a.wrapping_add(*b));
        }
        batch::per_cpu_hash::<SiteKey, SiteCounters>(
            self.sites_fd.as_fd(),
            self.cpus,
            |key, per_cpu| {
                if epochs.get(&key.tgid) != Some(&key.epoch) {
                    return;
                }
                snap.sites.insert(
                    (key.tgid, key.stack_id, key.func),
                    SiteTotals::from_per_cpu(per_cpu.iter()),
                );
            },
        )
        .map_err(read_err(maps::SITES))?;
        snap.fold_site_sizes();
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
        Ok(snap)
    }

    /// Blocks still live, grouped by site. Reads the whole live map: for the end of a trace,
    /// not for every round.
    pub fn live_blocks(&self, pids: Option<&HashSet<u32>>) -> Result<BTreeMap<SiteId, Leak>> {
        let blocks = self.live_entries(|tgid| pids.is_none_or(|p| p.contains(&tgid)))?;
        Ok(group_by_site(&blocks))
    }

    /// The live map's entries for the processes `want` accepts, each once. The kernel deletes
    /// entries while we walk the map (every free of every traced process), and a walk whose
    /// current key was deleted starts over: keys can come back, so they are deduplicated.
    fn live_entries(&self, want: impl Fn(u32) -> bool) -> Result<StdHashMap<LiveKey, LiveBlock>> {
        let mut out = StdHashMap::new();
        let mut epochs: StdHashMap<u32, u32> = StdHashMap::new();
        for item in self.live.iter() {
            let (key, block) = item.map_err(map_err(maps::LIVE))?;
            if !want(key.tgid) {
                continue;
            }
            let epoch = *epochs
                .entry(key.tgid)
                .or_insert_with(|| self.epoch(key.tgid));
            if key.epoch == epoch {
                out.insert(key, block);
            }
        }
        Ok(out)
    }

    /// Forgets processes that are gone: returns the blocks they never freed (their leaks), and
    /// removes their entries from every map keyed by process, so map space does not leak
    /// with process churn. Call after a snapshot that holds their final counts.
    pub fn forget(&mut self, pids: &HashSet<u32>) -> Result<BTreeMap<SiteId, Leak>> {
        // Deduplicated: a walk of the live map can meet a key twice (see `live_entries`).
        let blocks = self.live_entries(|tgid| pids.contains(&tgid))?;
        // Blocks of an image before an exec not cleared yet go too, but are not its leaks.
        let epochs: StdHashMap<u32, u32> = pids.iter().map(|p| (*p, self.epoch(*p))).collect();
        let mut leaks: BTreeMap<SiteId, Leak> = BTreeMap::new();
        for (key, block) in &blocks {
            if epochs.get(&key.tgid) == Some(&key.epoch) {
                let l = leaks
                    .entry((key.tgid, block.stack_id, block.func))
                    .or_default();
                l.blocks += 1;
                l.bytes += block.size;
            }
        }
        for k in blocks.keys() {
            let _ = self.live.remove(k);
        }
        for pid in pids {
            let _ = self.procs.remove(pid);
            let _ = self.execs.remove(pid);
        }
        remove_where(&mut self.sizes, |k: &SizeKey| pids.contains(&k.tgid));
        remove_where(&mut self.sites, |k: &SiteKey| pids.contains(&k.tgid));
        Ok(leaks)
    }

    /// The epoch of a process's current image (see `ProcCounters::epoch`).
    fn epoch(&self, tgid: u32) -> u32 {
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
    /// Returns the stored stacks the dropped sites held (ids as in the site map): once no
    /// other site holds them, they are for others to take, as an ended process's are.
    pub fn restarted(&mut self, pids: &HashSet<u32>) -> Result<BTreeSet<i32>> {
        let epochs: StdHashMap<u32, u32> = pids.iter().map(|p| (*p, self.epoch(*p))).collect();
        let old = |tgid: u32, epoch: u32| epochs.get(&tgid).is_some_and(|e| *e != epoch);
        remove_where(&mut self.live, |k: &LiveKey| old(k.tgid, k.epoch));
        remove_where(&mut self.sizes, |k: &SizeKey| old(k.tgid, k.epoch));
        let mut held = BTreeSet::new();
        remove_where(&mut self.sites, |k: &SiteKey| {
            let drop = old(k.tgid, k.epoch);
            if drop && k.stack_id >= 0 {
                held.insert(k.stack_id);
            }
            drop
        });
        Ok(held)
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
        Ok(dead.len())
    }
}

/// A kernel map whose keys can be listed and removed: what dropping a process's entries needs.
trait Keyed<K> {
    fn key_list(&self) -> Vec<K>;
    fn drop_key(&mut self, key: &K);
}

impl<K: aya::Pod, V: aya::Pod> Keyed<K> for HashMap<MapData, K, V> {
    fn key_list(&self) -> Vec<K> {
        self.keys().filter_map(|k| k.ok()).collect()
    }
    fn drop_key(&mut self, key: &K) {
        let _ = self.remove(key);
    }
}

impl<K: aya::Pod, V: aya::Pod> Keyed<K> for PerCpuHashMap<MapData, K, V> {
    fn key_list(&self) -> Vec<K> {
        self.keys().filter_map(|k| k.ok()).collect()
    }
    fn drop_key(&mut self, key: &K) {
        let _ = self.remove(key);
    }
}

/// Removes the entries whose key `drop` selects. The keys are listed first: removing while
/// walking would restart the walk.
fn remove_where<K>(map: &mut impl Keyed<K>, mut drop: impl FnMut(&K) -> bool) {
    for k in map.key_list().iter().filter(|k| drop(k)) {
        map.drop_key(k);
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
