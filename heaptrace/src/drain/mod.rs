//! Reading the kernel maps: the one place user space touches them.
//!
//! Counters in the kernel are cumulative and never reset; each round reads them all and
//! subtracts the previous read (`Snapshot::since`). We chose this over Heapprof's double-buffer
//! swap because a read-and-subtract needs no coordination with the probes (no map swap, no
//! flag the hot path must check) and cannot lose or double-count a call: an increment that lands
//! after the read is simply in the next round's difference.
pub mod before_attach;
pub mod buckets;
mod forget;
pub mod idle;
pub mod in_process;
pub mod keyed_slots;
mod live;
pub mod live_slots;
pub mod proc_slots;
mod relief;
mod retire;
pub mod round;
pub mod site_totals;
mod snapshot;
pub mod source;

use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    os::fd::{AsFd as _, OwnedFd},
    sync::atomic::Ordering,
};

// Keyed by what traced processes give (pids, stack ids, sizes), read every round: foldhash,
// seeded per run, is several times faster than SipHash here.
use aya::{
    Ebpf,
    maps::{HashMap, MapData, PerCpuArray, StackTraceMap},
};
pub(crate) use foldhash::{HashMap as FastMap, HashMapExt as _};
use heaptrace_common::{
    CALLER_ID_BASE, FUNC_COUNT, InFlight, InFlightSlot, LatencyHist, LiveBlock, LiveKey, Loss,
    ProcCounters, SiteCounters, SiteKey, SizeKey, StoredStack, maps,
    stack::{CACHE_GEN_MASK, cache_generation},
};

use crate::{
    bpf::batch,
    bpf::mmap_array::MappedArray,
    bpf::proc_states::ProcStates,
    drain::keyed_slots::KeyedSlots,
    drain::live_slots::{Held, LiveSlots},
    drain::proc_slots::ProcSlots,
    drain::round::Leak,
    drain::round::{ProcSnapshot, SiteId, SiteTotals, Snapshot, Totals},
    error::{Error, Result},
};

/// Stacks freed (`KernelMaps::free_stacks`): id -> its return addresses and whether they were
/// whole, if it could be read.
pub type Freed = FastMap<i32, HeldStack>;

/// A stored stack's return addresses and whether it is whole (`KernelMaps::stack`).
pub type HeldStack = Option<(Vec<u64>, bool)>;

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
    /// The frames of whole stacks stored since the last read, by id (ids below
    /// `CALLER_ID_BASE`): read and deleted every round (`read_frames`).
    frames: HashMap<MapData, u32, StoredStack>,
    frames_fd: OwnedFd,
    /// STACK_OWNERS: which stack holds each id (its hash), every stack's not freed.
    owners_fd: OwnedFd,
    /// The hash and frames of each stack read from FRAMES, by id, until the id is freed.
    archive: FastMap<u32, (u64, Vec<u64>)>,
    /// Ids freed while their processes lived (`idle`), with the hash of the stack they held.
    idle: FastMap<u32, u64>,
    /// Ids read from FRAMES since `take_stored`, and those of them that were freed while idle
    /// and hold another stack now.
    stored: Vec<i32>,
    rebound: Vec<i32>,
    /// One-frame stacks: the callers of allocations whose whole stack FRAMES did not take.
    callers: StackTraceMap<MapData>,
    /// Which id recent stacks have, and its generation (`heaptrace_common::stack::cache_word`).
    stack_cache: MappedArray<u64>,
    stack_gen: MappedArray<u64>,
    latency: PerCpuArray<MapData, LatencyHist>,
    execs: HashMap<MapData, u32, u32>,
    /// Each process's live heap and its highest (`heaptrace_common::ProcPeak`).
    peaks: HashMap<MapData, u32, heaptrace_common::ProcPeak>,
    /// The peaks of the processes with a slot, in place of the map (`proc_states`).
    proc_states: ProcStates,
    /// Calls of `purge_inflight`: the slots of processes gone unseen are looked at every
    /// `UNUSED_SLOTS_EVERY`th.
    purges: u32,
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
    /// The figures of the keys of past rounds, deleted from the kernel (`retire`).
    retired: retire::Retired,
    /// How full the site and size maps are getting between reads (`relief`).
    fills: relief::Fills,
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
    /// Slots (`heaptrace_common::proc_state`) for processes taken in before counting starts
    /// (`-p` and what it forked already, `--all`'s scan), as the kernel gives them at an exec
    /// or a fork: their peak and unwind entry then take no hash lookup.
    pub fn claim_slots(&self, pids: &[u32]) {
        let n = pids.iter().filter(|p| self.proc_states.claim(**p)).count();
        log::debug!("{n} of {} processes taken in have a slot", pids.len());
    }

    pub fn take(ebpf: &mut Ebpf) -> Result<KernelMaps> {
        let procs_fd = hash_fd(ebpf, maps::PROCS)?;
        let sizes_fd = hash_fd(ebpf, maps::SIZES)?;
        let sites_fd = hash_fd(ebpf, maps::SITES)?;
        let live_fd = hash_fd(ebpf, maps::LIVE)?;
        let frames_fd = hash_fd(ebpf, maps::FRAMES)?;
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
            retired: Default::default(),
            fills: relief::Fills::take(ebpf)?,
            losses: take(ebpf, maps::LOSSES)?,
            inflight: take(ebpf, maps::INFLIGHT)?,
            inflight_slots: MappedArray::map(ebpf, maps::INFLIGHT_SLOTS)?,
            frames: take(ebpf, maps::FRAMES)?,
            frames_fd,
            owners_fd: hash_fd(ebpf, maps::STACK_OWNERS)?,
            archive: FastMap::new(),
            idle: FastMap::new(),
            stored: Vec::new(),
            rebound: Vec::new(),
            callers: take(ebpf, maps::CALLERS)?,
            stack_cache: MappedArray::map(ebpf, maps::STACK_CACHE)?,
            stack_gen: MappedArray::map(ebpf, maps::STACK_GEN)?,
            latency: take(ebpf, maps::LATENCY)?,
            execs: take(ebpf, maps::EXECS)?,
            peaks: take(ebpf, maps::PEAKS)?,
            proc_states: ProcStates::map(ebpf)?,
            purges: 0,
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
        if let Some((_, frames)) = self.archive.get(&id) {
            return Some((frames.clone(), true));
        }
        // Stored since the last read.
        Some((self.frames.get(&id, 0).ok()?.frames().to_vec(), true))
    }

    /// Moves the frames stored since the last read into the archive, and deletes them from
    /// FRAMES: it holds a round's new stacks, not the run's. Read after the sites and sizes:
    /// the stacks of the keys read are stored by then (a program stores its stack before it
    /// counts).
    pub(super) fn read_frames(&mut self) -> Result<()> {
        let at = self.fills.frames_now()?;
        let mut read = Vec::new();
        let archive = &mut self.archive;
        batch::per_cpu_hash::<u32, StoredStack>(self.frames_fd.as_fd(), 1, |id, stack| {
            if let Some(s) = stack.first() {
                archive.insert(*id, (s.hash, s.frames().to_vec()));
                read.push((*id, s.hash));
            }
        })
        .map_err(read_err(maps::FRAMES))?;
        for (id, hash) in &read {
            self.stored_anew(*id, *hash);
        }
        let ids: Vec<u32> = read.into_iter().map(|(id, _)| id).collect();
        Self::delete(&self.frames_fd, maps::FRAMES, &ids)?;
        self.fills.frames_read(at);
        Ok(())
    }

    /// Frees stored stacks for others to take (ids as in the site map; lost ones, negative,
    /// are skipped). The kernel keeps a stack until it is deleted, so in a system-wide trace
    /// the maps filled with the stacks of processes long gone, and every later one lost its
    /// stacks. Returns what each held, read just before: a site first seen after this may
    /// have been counted under the stack freed, or under one that took its place since.
    pub fn free_stacks(&mut self, ids: impl IntoIterator<Item = i32>) -> Freed {
        let mut freed = Freed::new();
        // Whole stacks' ids, deleted in batches: a compiler that ends frees tens of
        // thousands at once, and a system call each took seconds of a round on a busy host.
        let mut owned: Vec<(u32, HeldStack)> = Vec::new();
        let mut unread = Vec::new();
        for id in ids {
            let Ok(u) = u32::try_from(id) else { continue };
            // Freed while idle and not stored again since: nothing to delete. Most ids of a
            // long process's sites are, and each absent key costs the batch a system call.
            if self.idle.remove(&u).is_some() {
                continue;
            }
            let held = self.stack(id);
            if u >= CALLER_ID_BASE {
                if self.callers.remove(&(u - CALLER_ID_BASE)).is_ok() {
                    freed.insert(id, held);
                }
                continue;
            }
            // Frames are in FRAMES only until read into the archive, and an id is taken
            // anew only once deleted from STACK_OWNERS, which takes it out of the archive.
            if self.archive.remove(&u).is_none() {
                unread.push(u);
            }
            owned.push((u, held));
        }
        let _ = batch::delete(self.frames_fd.as_fd(), &unread);
        let gone = self.delete_owners(owned.iter().map(|(u, _)| *u).collect());
        for ((u, held), gone) in owned.into_iter().zip(gone) {
            if gone {
                freed.insert(u as i32, held);
            }
        }
        if !freed.is_empty() {
            next_stack_generation(&self.stack_cache, &self.stack_gen);
        }
        freed
    }

    /// Deletes ids from STACK_OWNERS in batches; whether each was there and went (none did
    /// if the delete failed).
    fn delete_owners(&self, ids: Vec<u32>) -> Vec<bool> {
        let mut gone = vec![true; ids.len()];
        if batch::delete_each(self.owners_fd.as_fd(), &ids, |i| gone[i] = false).is_err() {
            gone.fill(false);
        }
        gone
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
}

/// Moves the stack cache on to its next generation, after stacks were freed (STACK_OWNERS): no
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

#[cfg(test)]
mod tests {
    use super::{forget::free_slots_of_dead_threads, *};

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
