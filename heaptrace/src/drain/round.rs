//! Plain data that flows from the kernel maps to every view: cumulative snapshots and the
//! per-round deltas between them. No kernel handles here; everything is serializable.
use std::collections::BTreeMap;

use heaptrace_common::{FUNC_COUNT, Func, LOSS_COUNT, ProcCounters};
use serde::{Deserialize, Serialize};

pub use crate::drain::buckets::Buckets;
pub use crate::drain::site_totals::{Log2, SiteTotals, map_delta};
use crate::targets::procfs::Mem;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FnTotals {
    pub calls: u64,
    pub bytes: u64,
    pub failed: u64,
}

/// Counters of one process (or of several, summed). Cumulative in a snapshot, a difference in a
/// round; the arithmetic is the same.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Totals {
    pub funcs: [FnTotals; FUNC_COUNT],
    pub live_blocks: i64,
    pub live_bytes: i64,
    pub untracked_frees: u64,
    pub realloc_moves: u64,
    pub realloc_in_place: u64,
    pub realloc_frees: u64,
    pub realloc_released_bytes: u64,
}

impl Totals {
    /// Every counter of `self` and `other` put through `op`, field by field. The arithmetic
    /// wraps on the bits: the kernel's live counters are wrapping sums per CPU, signed here.
    fn zip(&self, other: &Totals, op: impl Fn(u64, u64) -> u64 + Copy) -> Totals {
        let signed = |a: i64, b: i64| op(a as u64, b as u64) as i64;
        let mut t = *self;
        for (a, b) in t.funcs.iter_mut().zip(other.funcs.iter()) {
            a.calls = op(a.calls, b.calls);
            a.bytes = op(a.bytes, b.bytes);
            a.failed = op(a.failed, b.failed);
        }
        t.live_blocks = signed(t.live_blocks, other.live_blocks);
        t.live_bytes = signed(t.live_bytes, other.live_bytes);
        t.untracked_frees = op(t.untracked_frees, other.untracked_frees);
        t.realloc_moves = op(t.realloc_moves, other.realloc_moves);
        t.realloc_in_place = op(t.realloc_in_place, other.realloc_in_place);
        t.realloc_frees = op(t.realloc_frees, other.realloc_frees);
        t.realloc_released_bytes = op(t.realloc_released_bytes, other.realloc_released_bytes);
        t
    }

    /// One CPU's kernel values.
    fn of_cpu(c: &ProcCounters) -> Totals {
        let mut t = Totals {
            live_blocks: c.live_blocks as i64,
            live_bytes: c.live_bytes as i64,
            untracked_frees: c.untracked_frees,
            realloc_moves: c.realloc_moves,
            realloc_in_place: c.realloc_in_place,
            realloc_frees: c.realloc_frees,
            realloc_released_bytes: c.realloc_released_bytes,
            ..Totals::default()
        };
        for (acc, f) in t.funcs.iter_mut().zip(c.funcs.iter()) {
            *acc = FnTotals {
                calls: f.calls,
                bytes: f.bytes,
                failed: f.failed,
            };
        }
        t
    }

    /// Sums one process's per-CPU kernel values.
    pub fn from_per_cpu<'a>(cpus: impl IntoIterator<Item = &'a ProcCounters>) -> Totals {
        cpus.into_iter().fold(Totals::default(), |t, c| {
            t.zip(&Totals::of_cpu(c), u64::wrapping_add)
        })
    }

    /// `self - prev`, field by field (counters only grow, so a delta is never negative except
    /// for the live figures).
    pub fn minus(&self, prev: &Totals) -> Totals {
        self.zip(prev, u64::wrapping_sub)
    }

    /// Adds a delta. Wrapping, like the deltas: a round read while a process exec'ed can see
    /// its counters lower than the round before (the kernel reset them), and the restart that
    /// follows puts its figures right.
    pub fn plus(&mut self, d: &Totals) {
        *self = self.zip(d, u64::wrapping_add);
    }

    pub fn func(&self, f: Func) -> &FnTotals {
        &self.funcs[f as usize]
    }

    /// Blocks handed out: successful calls of the allocating functions. A realloc counts when it
    /// returned a block (not for realloc(p, 0), which is a free).
    pub fn allocations(&self) -> u64 {
        Func::ALL
            .iter()
            .filter(|f| **f != Func::Free)
            .map(|f| {
                let t = self.func(*f);
                let frees = if *f == Func::Realloc {
                    self.realloc_frees
                } else {
                    0
                };
                t.calls.wrapping_sub(t.failed).wrapping_sub(frees)
            })
            // Wrapping, as the deltas are (`minus`): a round's delta can be below zero for a
            // round, and the next puts it right.
            .fold(0, u64::wrapping_add)
    }

    /// Blocks given back: free() of a non-NULL pointer and realloc(p, 0).
    pub fn frees(&self) -> u64 {
        self.func(Func::Free).calls.wrapping_add(self.realloc_frees)
    }

    /// Bytes requested by successful allocating calls.
    pub fn bytes_allocated(&self) -> u64 {
        Func::ALL
            .iter()
            .filter(|f| **f != Func::Free)
            .map(|f| self.func(*f).bytes)
            .fold(0, u64::wrapping_add)
    }
}

/// (process, function index, requested size, stack id of the allocating site: `NO_SITE`
/// outside stacks mode).
pub type SizeKey = (u32, u32, u64, i32);

/// An allocation site: (process, stack id, function index). A negative stack id is a lost
/// stack (its errno), `heaptrace_common::NO_SITE` a block allocated outside stacks mode.
pub type SiteId = (u32, i32, u32);

/// The keys of process `pid`'s sites (and samples, weights, leaks).
pub fn site_ids(pid: u32) -> std::ops::RangeInclusive<SiteId> {
    (pid, i32::MIN, 0)..=(pid, i32::MAX, u32::MAX)
}

/// The keys of process `pid`'s sizes.
pub fn size_keys(pid: u32) -> std::ops::RangeInclusive<SizeKey> {
    (pid, 0, 0, i32::MIN)..=(pid, u32::MAX, u64::MAX, i32::MAX)
}

/// The keys of process `pid`'s reservations.
pub fn reservation_keys(pid: u32) -> std::ops::RangeInclusive<crate::reserve::ResKey> {
    use crate::reserve::Kind;
    let last = Kind::Pymalloc;
    (pid, Kind::Arena, i32::MIN, 0)..=(pid, last, i32::MAX, u32::MAX)
}

/// Removes and returns the entries of `map` in `range`.
pub fn take_range<K: Ord + Copy, V>(
    map: &mut BTreeMap<K, V>,
    range: std::ops::RangeInclusive<K>,
) -> Vec<(K, V)> {
    let keys: Vec<K> = map.range(range).map(|(k, _)| *k).collect();
    keys.into_iter()
        .filter_map(|k| map.remove(&k).map(|v| (k, v)))
        .collect()
}

/// What the kernel maps held at one instant, summed over CPUs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    pub procs: BTreeMap<u32, ProcSnapshot>,
    pub sizes: BTreeMap<SizeKey, u64>,
    pub losses: [u64; LOSS_COUNT],
    pub sites: BTreeMap<SiteId, SiteTotals>,
    /// Per function: time from entry to return, power-of-two buckets of nanoseconds.
    pub latency: [Log2; FUNC_COUNT],
    /// Each process's highest live heap, from the kernel (`heaptrace_common::ProcPeak`).
    pub peaks: BTreeMap<u32, KernelPeak>,
    /// What each of those was made of.
    #[serde(default)]
    pub peak_held: BTreeMap<u32, PeakHeld>,
    /// While read: what each site's live figures add to be those at its process's peak
    /// (blocks, bytes, wrapping; `SiteCounters::at_peak_correction`).
    #[serde(skip)]
    pub peak_fix: BTreeMap<SiteId, (u64, u64)>,
}

/// What a process's peak (`KernelPeak`) was made of, at the moment it was reached.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeakHeld {
    /// The peak this is of (`KernelPeak::bytes`).
    pub bytes: u64,
    /// The blocks live then (every tracked block, with a site or not).
    pub blocks: u64,
    /// Stacks mode: the sites live then, (stack id, function index, live blocks, live
    /// bytes), those with live bytes only.
    pub sites: Vec<(i32, u32, i64, i64)>,
}

/// A process's highest live heap as the kernel took it, at the allocation that reached it:
/// that allocation's size and stack id.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelPeak {
    pub bytes: u64,
    pub size: u64,
    pub stack_id: i32,
}

/// A stack seen for the first time: raw return addresses (innermost first), where each one is
/// (module, file offset; what a recording keeps to symbolize again), and their frames.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NewStack {
    pub ips: Vec<u64>,
    pub locations: Vec<Option<crate::symbolize::modules::Location>>,
    pub frames: std::sync::Arc<[crate::symbolize::Frame]>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcSnapshot {
    pub comm: String,
    pub totals: Totals,
    /// The image the counters are of: 1 + the execs at which the kernel started it over.
    #[serde(default)]
    pub epoch: u32,
}

/// Blocks still live: how many and their bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Leak {
    pub blocks: u64,
    pub bytes: u64,
}

/// Everything new since the previous round.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "RoundWire", into = "RoundWire")]
pub struct Round {
    pub index: u64,
    pub elapsed_ms: u64,
    /// Processes whose counters moved this round.
    pub procs: BTreeMap<u32, ProcRound>,
    pub sizes: BTreeMap<SizeKey, u64>,
    pub losses: [u64; LOSS_COUNT],
    /// Memory of the traced processes that are still alive, read at the end of the round.
    pub mem: BTreeMap<u32, Mem>,
    pub sites: BTreeMap<SiteId, SiteTotals>,
    pub latency: [Log2; FUNC_COUNT],
    /// The allocators' reservations and releases of memory this round, by site.
    pub reservations: BTreeMap<crate::reserve::ResKey, crate::reserve::ResTotals>,
    /// What each live traced process's allocator holds at the end of the round.
    pub reserved: BTreeMap<u32, crate::reserve::Reserved>,
    /// Processes that exec'ed since the previous round: what their earlier images did is
    /// dropped before this round is added (recording format 4; a version 3 round reads with
    /// an empty list appended, see `record::format::decode_round`).
    pub restarted: Vec<u32>,
    /// Processes seen ended this round (process keys), and then those folded into
    /// `[N exited processes]`, oldest first (see `profile::exited`): a report replays both as the live
    /// trace did them. Recording format 5; earlier rounds read with none.
    pub ended: Vec<u32>,
    pub folded: Vec<u32>,
    /// Processes whose highest live heap rose since the previous round (recording format 9;
    /// earlier rounds read with none).
    pub peaks: BTreeMap<u32, KernelPeak>,
    /// What those peaks were made of, where it changed since the previous round (recording
    /// format 13; earlier rounds read with none).
    pub peak_held: BTreeMap<u32, PeakHeld>,
    /// Stacks first seen this round, by (process, stack id).
    #[serde(skip)]
    pub stacks: BTreeMap<(u32, i32), NewStack>,
}

/// The losses a round of recording format 9 and earlier holds, in its place among the fields;
/// the later ones (`Loss::UnwindNoRule` on) go at the end, where an older round reads as zeros.
const WIRE_LOSSES: usize = 8;
/// The losses recorded at a round's end (format 10 on).
pub const LATER_LOSSES: usize = 3;
/// Those added since (format 12 on: `Loss::UnwindLate` on), a list: a loss added later needs
/// no new format, an older round's list is shorter and reads its missing ones as zeros.
const NEWER_LOSSES: usize = WIRE_LOSSES + LATER_LOSSES;

/// A round as recordings hold it (postcard writes no field names: fields are only added at
/// the end, `record::format::decode_round` pads older rounds).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RoundWire {
    index: u64,
    elapsed_ms: u64,
    procs: BTreeMap<u32, ProcRound>,
    sizes: BTreeMap<SizeKey, u64>,
    losses: [u64; WIRE_LOSSES],
    mem: BTreeMap<u32, Mem>,
    sites: BTreeMap<SiteId, SiteTotals>,
    latency: [Log2; FUNC_COUNT],
    reservations: BTreeMap<crate::reserve::ResKey, crate::reserve::ResTotals>,
    reserved: BTreeMap<u32, crate::reserve::Reserved>,
    restarted: Vec<u32>,
    ended: Vec<u32>,
    folded: Vec<u32>,
    peaks: BTreeMap<u32, KernelPeak>,
    /// Recording format 10.
    later_losses: [u64; LATER_LOSSES],
    /// Recording format 12: the losses from `NEWER_LOSSES` on.
    newer_losses: Vec<u64>,
    /// Recording format 13.
    peak_held: BTreeMap<u32, PeakHeld>,
    /// Recording format 14: `Reserved::pymalloc` of each process in `reserved`.
    pymalloc: BTreeMap<u32, u64>,
}

impl From<RoundWire> for Round {
    fn from(w: RoundWire) -> Round {
        let mut losses = [0; LOSS_COUNT];
        losses[..WIRE_LOSSES].copy_from_slice(&w.losses);
        losses[WIRE_LOSSES..NEWER_LOSSES].copy_from_slice(&w.later_losses);
        for (to, from) in losses[NEWER_LOSSES..].iter_mut().zip(&w.newer_losses) {
            *to = *from;
        }
        let mut reserved = w.reserved;
        let pymalloc = |pid| w.pymalloc.get(pid).copied().unwrap_or(0);
        reserved
            .iter_mut()
            .for_each(|(pid, r)| r.pymalloc = pymalloc(pid));
        Round {
            index: w.index,
            elapsed_ms: w.elapsed_ms,
            procs: w.procs,
            sizes: w.sizes,
            losses,
            mem: w.mem,
            sites: w.sites,
            latency: w.latency,
            reservations: w.reservations,
            reserved,
            restarted: w.restarted,
            ended: w.ended,
            folded: w.folded,
            peaks: w.peaks,
            peak_held: w.peak_held,
            stacks: BTreeMap::new(),
        }
    }
}

impl From<Round> for RoundWire {
    fn from(r: Round) -> RoundWire {
        let mut losses = [0; WIRE_LOSSES];
        losses.copy_from_slice(&r.losses[..WIRE_LOSSES]);
        let mut later_losses = [0; LATER_LOSSES];
        later_losses.copy_from_slice(&r.losses[WIRE_LOSSES..NEWER_LOSSES]);
        let pymalloc = r.reserved.iter().map(|(p, m)| (*p, m.pymalloc));
        let pymalloc = pymalloc.filter(|(_, b)| *b > 0).collect();
        RoundWire {
            index: r.index,
            elapsed_ms: r.elapsed_ms,
            procs: r.procs,
            sizes: r.sizes,
            losses,
            mem: r.mem,
            sites: r.sites,
            latency: r.latency,
            reservations: r.reservations,
            reserved: r.reserved,
            restarted: r.restarted,
            ended: r.ended,
            folded: r.folded,
            peaks: r.peaks,
            later_losses,
            newer_losses: r.losses[NEWER_LOSSES..].to_vec(),
            peak_held: r.peak_held,
            pymalloc,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcRound {
    pub comm: String,
    pub delta: Totals,
    /// Its cgroup (the unified hierarchy's path), read while it lives; empty if unknown.
    pub cgroup: String,
}

impl Snapshot {
    /// The stored stacks (kernel ids) that sites of `pids` hold, or that are in `dropped`
    /// (held by sites dropped already), and no other process's site holds.
    pub fn stacks_only_of(
        &self,
        pids: &std::collections::HashSet<u32>,
        dropped: std::collections::BTreeSet<i32>,
    ) -> Vec<i32> {
        let mut theirs = dropped;
        let mut others = std::collections::HashSet::new();
        for (pid, id, _) in self.sites.keys().filter(|k| k.1 >= 0) {
            if pids.contains(pid) {
                theirs.insert(*id);
            } else {
                others.insert(*id);
            }
        }
        theirs
            .into_iter()
            .filter(|id| !others.contains(id))
            .collect()
    }

    /// Gives each site its size histogram, folded from the exact one, which is keyed by stack
    /// too: the kernel keeps no second histogram per site. Both are cumulative, as the rounds
    /// need. Sizes the exact histogram could not hold (`lost.size_histogram`) are missing from
    /// the sites' too; allocations left out by sampling belong to no site. The kernel counts a
    /// call's size after its site, and the size map is read first: a site's classes never hold
    /// more than its calls, and a call counted between the two reads gets its class next round.
    pub fn fold_site_sizes(&mut self) {
        // A process's sizes gathered by site first: one lookup and one histogram made per
        // site, not per size.
        let mut of_proc: Vec<(SiteId, usize, u64)> = Vec::new();
        let mut sizes = self.sizes.iter().peekable();
        while let Some((&(tgid, func, size, stack_id), &n)) = sizes.next() {
            of_proc.push((
                (tgid, stack_id, func),
                heaptrace_common::log2_bucket(size),
                n,
            ));
            if sizes.peek().is_some_and(|(k, _)| k.0 == tgid) {
                continue;
            }
            of_proc.sort_unstable_by_key(|e| e.0);
            for one in of_proc.chunk_by(|a, b| a.0 == b.0) {
                if let Some(site) = self.sites.get_mut(&one[0].0) {
                    let mut dense = site.sizes.dense();
                    for &(_, b, n) in one {
                        if let Some(d) = dense.get_mut(b) {
                            *d = d.wrapping_add(n);
                        }
                    }
                    site.sizes = Buckets::from_dense(&dense);
                }
            }
            of_proc.clear();
        }
    }

    /// What each process's peak was made of (`peak_held`): its sites' live figures now with
    /// the corrections read (`peak_fix`) that give them as they were at the peak. `states`:
    /// each process's peak number, whether its peak is pending, and its blocks at the peak.
    pub fn compose_peaks(&mut self, states: &crate::drain::FastMap<u32, (u32, bool, u64)>) {
        let fix = std::mem::take(&mut self.peak_fix);
        for (pid, k) in &self.peaks {
            let blocks = states.get(pid).map_or(0, |s| s.2);
            let sites = self
                .sites
                .range(site_ids(*pid))
                .map(|(id, t)| {
                    let (b, n) = fix.get(id).copied().unwrap_or_default();
                    let blocks = (t.live_blocks as u64).wrapping_add(b) as i64;
                    (
                        id.1,
                        id.2,
                        blocks,
                        (t.live_bytes as u64).wrapping_add(n) as i64,
                    )
                })
                // Blocks of 0 bytes held at the peak count too (`malloc(0)`).
                .filter(|s| s.3 > 0 || s.2 > 0)
                .collect();
            let held = PeakHeld {
                bytes: k.bytes,
                blocks,
                sites,
            };
            self.peak_held.insert(*pid, held);
        }
    }

    /// Processes whose counters here are of another image than in `prev`: the kernel started
    /// them over at an exec in between. What `prev` holds of them is of the image before.
    pub fn restarted_since(&self, prev: &Snapshot) -> Vec<u32> {
        self.procs
            .iter()
            .filter(|(pid, p)| prev.procs.get(pid).is_some_and(|q| q.epoch != p.epoch))
            .map(|(pid, _)| *pid)
            .collect()
    }

    /// The differences from `prev` to `self`. Cumulative kernel counters read twice give exact
    /// deltas whatever the kernel did in between: a call counted after this read shows up in the
    /// next round, never in two and never in none.
    pub fn since(&self, prev: &Snapshot) -> Round {
        let mut round = Round::default();
        for (pid, snap) in &self.procs {
            let delta = match prev.procs.get(pid) {
                Some(p) => snap.totals.minus(&p.totals),
                None => snap.totals,
            };
            if delta != Totals::default() {
                round.procs.insert(
                    *pid,
                    ProcRound {
                        comm: snap.comm.clone(),
                        delta,
                        cgroup: String::new(),
                    },
                );
            }
        }
        round.sizes = map_delta(&self.sizes, &prev.sizes, |a, b| a.wrapping_sub(*b));
        for (i, l) in self.losses.iter().enumerate() {
            round.losses[i] = l.wrapping_sub(prev.losses[i]);
        }
        round.sites = map_delta(&self.sites, &prev.sites, SiteTotals::minus);
        round.peaks = self
            .peaks
            .iter()
            .filter(|(p, k)| prev.peaks.get(p).is_none_or(|was| k.bytes > was.bytes))
            .map(|(p, k)| (*p, *k))
            .collect();
        round.peak_held = self
            .peak_held
            .iter()
            .filter(|(p, h)| prev.peak_held.get(p) != Some(*h))
            .map(|(p, h)| (*p, h.clone()))
            .collect();
        for (f, hist) in self.latency.iter().enumerate() {
            round.latency[f] = std::array::from_fn(|i| hist[i].wrapping_sub(prev.latency[f][i]));
        }
        round
    }
}

#[cfg(test)]
mod tests;
