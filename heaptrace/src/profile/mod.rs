//! Folds rounds into one Profile that every view reads, so the round lines, the summary and the
//! JSON document can never disagree.
pub mod capped;
pub mod complete;
pub mod exited;
pub mod grouped;
pub mod histogram;
pub mod incarnation;
mod narrow;
mod peak;
pub use peak::Peak;
pub mod same_stacks;
pub mod sampling;
pub mod wrappers;
use std::{collections::BTreeMap, sync::Arc};

use heaptrace_common::{FUNC_COUNT, LOSS_COUNT, Loss};
use serde::Serialize;

use crate::{
    drain::round::{
        KernelPeak, Leak, Log2, PeakHeld, Round, SiteId, SiteTotals, Totals, map_delta,
        reservation_keys, site_ids, size_keys, take_range,
    },
    reserve::{ResKey, ResTotals, Reserved},
    run_info::Mode,
    symbolize::Frame,
    targets::procfs::Mem,
};

/// Symbolized stacks by (process, stack id), each shared.
pub type Stacks = BTreeMap<(u32, i32), Arc<[Frame]>>;

/// The most rows the timeline keeps. Past it, neighbouring rows merge two by two and each row
/// covers twice as many rounds: a trace of days keeps its whole span, at a coarser step, in
/// bounded memory (and the live view's copy of the Profile stays small).
pub const TIMELINE_ROWS: usize = 4096;

#[derive(Clone, Debug, Default, Serialize)]
pub struct Profile {
    /// The timeline, oldest first: a row per round, or per `timeline_step` rounds once more
    /// than [`TIMELINE_ROWS`] rounds were seen.
    pub rounds: Vec<TimelineRow>,
    /// Rounds per row of the timeline (0 or 1: every round has its row).
    pub timeline_step: u64,
    /// The longest time from one round's read to the next's, in ms: the kernel maps that
    /// hold what is new since a read fill in between (a loss of room says so).
    pub max_round_gap_ms: u64,
    pub procs: BTreeMap<u32, ProcProfile>,
    /// (process, function index, size, stack id) -> count.
    pub sizes: BTreeMap<crate::drain::round::SizeKey, u64>,
    pub losses: [u64; LOSS_COUNT],
    pub sites: BTreeMap<SiteId, SiteTotals>,
    /// Symbolized stacks by (process, stack id). Shared, so that a copy of the Profile (the
    /// live view's snapshot) does not copy every frame.
    #[serde(skip)]
    pub stacks: Stacks,
    pub latency: [Log2; FUNC_COUNT],
    pub peak: Option<Peak>,
    /// Blocks still in the live map when tracing ended, by site (estimates with sampling:
    /// set them with [`Profile::set_leaks`]).
    pub leaks: Option<BTreeMap<SiteId, Leak>>,
    /// `--sample-bytes`: 0 when every allocation was sampled. Otherwise `sites`, the live
    /// figures of `procs`, the peak and the leaks are estimates (see `sampling`), and the
    /// sampled counters are in `samples`.
    pub sample_bytes: u64,
    pub samples: BTreeMap<SiteId, SiteTotals>,
    #[serde(skip)]
    pub weights: BTreeMap<SiteId, crate::profile::sampling::Weighted>,
    /// The allocators' reservations and releases of memory, by site.
    pub reservations: BTreeMap<ResKey, ResTotals>,
    /// Calls mode: malloc was counted at its entry and nothing was kept in the live map, so
    /// live figures, leaks, free's bytes and untracked count, and realloc's released bytes are
    /// not known. The views say so rather than show zeros.
    pub calls: bool,
    /// `--latency-every`: one call in this many was timed for `latency`; 0 or 1 when every
    /// call was (recordings before format 6 say 0).
    pub latency_every: u32,
    /// Processes folded into one (`profile::exited`).
    #[serde(skip)]
    pub folded: Folded,
    /// Files of traced processes skipped as suspect (`targets::target_file`): calls into them
    /// were not counted, frames in them not named. A fact of the live trace: recordings do not
    /// keep it.
    #[serde(skip)]
    pub unsafe_files: u64,
    /// `-p`: the blocks live at attach, taken into the live figures from a census of the
    /// heap (`drain::before_attach`). A fact of the live trace: recordings do not keep it.
    #[serde(skip)]
    pub before_attach: Option<crate::drain::before_attach::BeforeAttach>,
    /// What collected the figures: a loss names the flag of its collector.
    #[serde(skip)]
    pub collector: crate::run_info::Collector,
    /// What the in-process region lost beyond the loss counters. A fact of the live trace.
    #[serde(skip)]
    pub region_lost: complete::RegionLost,
    /// Why the counts are known incomplete, besides losses (set at the end of a live trace).
    #[serde(skip)]
    pub incomplete: Vec<complete::Incomplete>,
    /// Which frames are allocator wrappers, passed over in naming a site (`wrappers`).
    #[serde(skip)]
    pub wrapper_rule: Arc<wrappers::WrapperRule>,
    #[serde(skip)]
    pub wrappers_cache: wrappers::Cache,
}

/// What folding ended processes keeps (`exited`): how many processes, and each folded stack's
/// id by its frames.
#[derive(Clone, Debug, Default)]
pub struct Folded {
    pub processes: u64,
    /// Of `processes`, those folded for the JSON document alone (`capped`).
    pub document: u64,
    /// `--json-max-stacks`: the JSON document's lists by stack list this many at most, the
    /// largest (None: all).
    pub document_stacks: Option<usize>,
    ids: foldhash::HashMap<Arc<[Frame]>, i32>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct ProcProfile {
    pub comm: String,
    pub totals: Totals,
    pub mem: Option<Mem>,
    /// What its allocator holds from the kernel (last read while it lived).
    pub reserved: Option<Reserved>,
    /// What of it is resident, estimated from its mappings at the end of the trace (None:
    /// ended before, or not read).
    pub resident: Option<crate::reserve::resident::Resident>,
    pub peak_rss_kb: u64,
    /// Ended while traced (system-wide mode): its figures are final.
    pub exited: bool,
    /// Its cgroup (the unified hierarchy's path): tells containers apart.
    pub cgroup: String,
    /// Its blocks were taken out of the kernel's live map when it ended (system-wide mode),
    /// rather than found there at the end.
    pub leaks_at_exit: bool,
    /// Its highest live heap, taken by the kernel at the allocation that reached it (None
    /// in calls mode and under `--sample-bytes`, and in recordings before format 9).
    pub peak: Option<KernelPeak>,
    /// What `peak` was made of (recordings before format 13: None).
    pub peak_held: Option<PeakHeld>,
    /// The kernel's OOM killer killed it (`oom/mark_victim`): its leaks are its heap then.
    pub oom_killed: bool,
}

/// One line of the timeline: the activity of its rounds and the state at the end of the last.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TimelineRow {
    /// The index of its last round.
    pub index: u64,
    /// How many rounds it covers: 1, until the timeline is coarsened.
    pub rounds: u64,
    pub elapsed_ms: u64,
    pub allocations: u64,
    pub frees: u64,
    pub bytes_allocated: u64,
    pub live_blocks: i64,
    pub live_bytes: i64,
    /// Summed over the processes read (`rss_processes`): pages they share count once each.
    pub rss_kb: u64,
    pub virt_kb: u64,
    /// How many processes' memory `rss_kb` and `virt_kb` sum.
    pub rss_processes: u64,
    /// Bytes the allocators hold from the kernel (heap, arenas, mmapped blocks).
    pub reserved_bytes: u64,
}

impl TimelineRow {
    /// Folds the next row in: activity adds up, the state is the later one's.
    fn absorb(&mut self, later: &TimelineRow) {
        *self = TimelineRow {
            rounds: self.rounds + later.rounds,
            allocations: self.allocations + later.allocations,
            frees: self.frees + later.frees,
            bytes_allocated: self.bytes_allocated + later.bytes_allocated,
            ..later.clone()
        };
    }

    /// Whether round `index` is one of this row's.
    pub fn covers(&self, index: u64) -> bool {
        index <= self.index && index + self.rounds.max(1) > self.index
    }
}

impl Profile {
    /// A process starts over (it exec'ed): its figures so far go; its name and cgroup stay
    /// until the next round names it again.
    pub fn restart(&mut self, pid: u32) {
        if let Some(p) = self.procs.get_mut(&pid) {
            *p = ProcProfile {
                comm: std::mem::take(&mut p.comm),
                cgroup: std::mem::take(&mut p.cgroup),
                ..Default::default()
            };
        }
        // By range: a host's execs are thousands a minute, each a scan of every map else.
        take_range(&mut self.sizes, size_keys(pid));
        take_range(&mut self.sites, site_ids(pid));
        take_range(&mut self.samples, site_ids(pid));
        take_range(&mut self.weights, site_ids(pid));
        take_range(&mut self.reservations, reservation_keys(pid));
    }

    /// An empty Profile of a trace sampled at `sample_bytes` (0: not sampled).
    pub fn sampled(sample_bytes: u64) -> Profile {
        Profile {
            sample_bytes,
            ..Profile::default()
        }
    }

    /// This Profile, its latencies from one call in `n` timed.
    pub fn with_latency_every(self, n: u32) -> Profile {
        Profile {
            latency_every: n,
            ..self
        }
    }

    /// This Profile, its sites named past the wrappers of `rule`.
    pub fn with_wrapper_rule(self, rule: wrappers::WrapperRule) -> Profile {
        Profile {
            wrapper_rule: Arc::new(rule),
            ..self
        }
    }

    /// One call in this many was timed for the latency histograms; None when every call was.
    pub fn latency_sampled(&self) -> Option<u32> {
        (self.latency_every > 1).then_some(self.latency_every)
    }

    /// An empty Profile of a trace in `mode`, sampled at `sample_bytes`.
    pub fn of_mode(mode: Mode, sample_bytes: u64) -> Profile {
        Profile {
            calls: mode.at_entry(),
            ..Profile::sampled(sample_bytes)
        }
    }

    pub fn apply(&mut self, round: &Round) {
        for pid in &round.restarted {
            self.restart(*pid);
        }
        let mut delta = Totals::default();
        for (pid, pr) in &round.procs {
            let p = self.procs.entry(*pid).or_default();
            if !pr.comm.is_empty() {
                p.comm.clone_from(&pr.comm);
            }
            if !pr.cgroup.is_empty() {
                p.cgroup.clone_from(&pr.cgroup);
            }
            p.totals.plus(&pr.delta);
            delta.plus(&pr.delta);
        }
        for (pid, mem) in &round.mem {
            let p = self.procs.entry(*pid).or_default();
            p.mem = Some(*mem);
            p.peak_rss_kb = p.peak_rss_kb.max(mem.rss_kb);
        }
        for (pid, r) in &round.reserved {
            self.procs.entry(*pid).or_default().reserved = Some(*r);
        }
        for (key, t) in &round.reservations {
            self.reservations.entry(*key).or_default().plus(t);
        }
        for (key, n) in &round.sizes {
            let c = self.sizes.entry(*key).or_default();
            *c = c.wrapping_add(*n);
        }
        for (acc, l) in self.losses.iter_mut().zip(round.losses.iter()) {
            *acc += l;
        }
        if self.sample_bytes == 0 {
            for (id, d) in &round.sites {
                self.sites.entry(*id).or_default().plus(d);
            }
        } else {
            self.apply_samples(round);
        }
        for (key, s) in &round.stacks {
            self.stacks.insert(*key, s.frames.clone());
        }
        for (acc, d) in self.latency.iter_mut().zip(round.latency.iter()) {
            for (a, b) in acc.iter_mut().zip(d) {
                *a += b;
            }
        }
        // Ended before the read: their blocks went with them, at this row already.
        for key in &round.ended {
            self.end(*key);
        }
        let total = self.live_now();
        self.apply_peaks(round, &total);
        if let Some(last) = self.rounds.last() {
            let gap = round.elapsed_ms.saturating_sub(last.elapsed_ms);
            self.max_round_gap_ms = self.max_round_gap_ms.max(gap);
        }
        self.push_row(TimelineRow {
            index: round.index,
            rounds: 1,
            elapsed_ms: round.elapsed_ms,
            allocations: delta.allocations(),
            frees: delta.frees(),
            bytes_allocated: delta.bytes_allocated(),
            live_blocks: total.live_blocks,
            live_bytes: total.live_bytes,
            rss_kb: round.mem.values().map(|m| m.rss_kb).sum(),
            virt_kb: round.mem.values().map(|m| m.virt_kb).sum(),
            rss_processes: round.mem.len() as u64,
            reserved_bytes: round.reserved.values().map(|r| r.total()).sum(),
        });
        if self
            .peak
            .as_ref()
            .is_none_or(|p| total.live_bytes > p.live_bytes)
        {
            self.peak = Some(self.peak_now(round, &total));
        }
    }

    /// Adds a round's row to the timeline, into the last row while it covers fewer rounds
    /// than the step; halves the rows when they are too many.
    fn push_row(&mut self, row: TimelineRow) {
        let step = self.timeline_step.max(1);
        match self.rounds.last_mut() {
            Some(last) if last.rounds < step => last.absorb(&row),
            _ => self.rounds.push(row),
        }
        if self.rounds.len() > TIMELINE_ROWS {
            self.rounds = self
                .rounds
                .chunks(2)
                .map(|pair| {
                    let mut merged = pair[0].clone();
                    pair[1..].iter().for_each(|r| merged.absorb(r));
                    merged
                })
                .collect();
            self.timeline_step = step * 2;
        }
    }

    /// How many rounds the timeline covers.
    pub fn round_count(&self) -> u64 {
        self.rounds.iter().map(|r| r.rounds.max(1)).sum()
    }

    /// Sampled sites: their sampled counters add up, their estimates are derived again, and
    /// so are the live figures of the processes they belong to (the kernel's live counters
    /// count sampled blocks only).
    fn apply_samples(&mut self, round: &Round) {
        crate::profile::sampling::weigh(&mut self.weights, &round.sizes, self.sample_bytes);
        for (id, d) in &round.sites {
            self.samples.entry(*id).or_default().plus(d);
        }
        let touched: std::collections::BTreeSet<SiteId> = round
            .sites
            .keys()
            .copied()
            .chain(round.sizes.keys().map(|(p, f, _, st)| (*p, *st, *f)))
            .filter(|id| self.samples.contains_key(id))
            .collect();
        for id in touched {
            let w = self.weights.get(&id).copied().unwrap_or_default();
            let (est, _) =
                crate::profile::sampling::estimate(&self.samples[&id], &w, self.sample_bytes);
            self.sites.insert(id, est);
        }
        for pid in round.procs.keys() {
            let (blocks, bytes) = self
                .sites
                .range((*pid, i32::MIN, 0)..=(*pid, i32::MAX, u32::MAX))
                .fold((0, 0), |(b, y), (_, s)| {
                    (b + s.live_blocks, y + s.live_bytes)
                });
            if let Some(p) = self.procs.get_mut(pid) {
                p.totals.live_blocks = blocks;
                p.totals.live_bytes = bytes;
            }
        }
    }

    /// Sets the blocks found not freed at the end, by site. With sampling these are sampled
    /// blocks: each site's are scaled as its other releases are.
    pub fn set_leaks(&mut self, raw: BTreeMap<SiteId, Leak>) {
        if self.sample_bytes == 0 {
            self.leaks = Some(raw);
            return;
        }
        let scaled = raw
            .into_iter()
            .map(|(id, l)| {
                let w = self.weights.get(&id).copied().unwrap_or_default();
                let raw_site = self.samples.get(&id).cloned().unwrap_or_default();
                let (_, scale) =
                    crate::profile::sampling::estimate(&raw_site, &w, self.sample_bytes);
                (id, crate::profile::sampling::scale_leak(&l, scale))
            })
            .collect();
        self.leaks = Some(scaled);
    }

    /// The processes that have not ended, summed: the live memory of the timeline and the
    /// peak. An ended process's blocks went with it; its own figures keep them, as not freed
    /// at its end; counted as live, a host's ended processes would pile up under `--all`.
    fn live_now(&self) -> Totals {
        let mut t = Totals::default();
        for p in self.procs.values().filter(|p| !p.exited) {
            t.plus(&p.totals);
        }
        t
    }

    /// The live blocks and bytes of the processes that ended while traced (system-wide mode,
    /// seen ended at a round): what they had not freed at their end, gone with them. (0, 0)
    /// when none did. Not those found ended only once tracing stopped (a `-p` or launched
    /// target): a recording does not say which those are, and their figure is the trace's.
    pub fn ended_live(&self) -> (i64, i64) {
        self.procs
            .values()
            .filter(|p| p.exited && p.leaks_at_exit)
            .fold((0, 0), |(b, y), p| {
                (b + p.totals.live_blocks, y + p.totals.live_bytes)
            })
    }

    /// All processes summed.
    pub fn totals(&self) -> Totals {
        let mut t = Totals::default();
        for p in self.procs.values() {
            t.plus(&p.totals);
        }
        t
    }

    /// (function index, size) -> count over all processes (or one).
    pub fn sizes_by_func(&self, pid: Option<u32>) -> BTreeMap<(u32, u64), u64> {
        let mut out = BTreeMap::new();
        for ((p, f, s, _), n) in &self.sizes {
            if pid.is_none_or(|want| want == *p) {
                *out.entry((*f, *s)).or_default() += n;
            }
        }
        out
    }

    /// The losses to show for process `pid`, or for every process here. The kernel counts
    /// them for all the processes it traces together. A lost stack is also a site of its
    /// process (under an errno, or its caller alone), so the stack loss is counted from the
    /// sites of the processes shown: a filter (`--comm`, one process picked) leaves the
    /// others' out, as an exec leaves out the dropped image's. With byte sampling, sampled
    /// allocations, as the kernel counts them.
    pub fn losses_of(&self, pid: Option<u32>) -> [u64; LOSS_COUNT] {
        let sites = if self.sample_bytes > 0 {
            &self.samples
        } else {
            &self.sites
        };
        let lost = |(p, id, _): &SiteId| match *id {
            heaptrace_common::NO_SITE
            | heaptrace_common::NOT_SAMPLED
            | heaptrace_common::BEFORE_ATTACH => false,
            id if id < 0 => true,
            id => self
                .stacks
                .get(&(*p, id))
                .and_then(|f| f.last())
                .is_some_and(Frame::is_more_lost),
        };
        let mut out = self.losses;
        out[Loss::Stack as usize] = sites
            .iter()
            .filter(|(k, _)| pid.is_none_or(|want| want == k.0) && lost(k))
            .map(|(_, s)| s.calls)
            .sum();
        out
    }

    pub fn leak_totals(&self, pid: Option<u32>) -> Option<Leak> {
        let leaks = self.leaks.as_ref()?;
        let mut t = Leak::default();
        for ((p, _, _), l) in leaks {
            if pid.is_none_or(|want| want == *p) {
                t.blocks += l.blocks;
                t.bytes += l.bytes;
            }
        }
        Some(t)
    }

    pub fn leaks_by_func(&self, pid: Option<u32>) -> [Leak; FUNC_COUNT] {
        let mut out = [Leak::default(); FUNC_COUNT];
        for ((p, _, f), l) in self.leaks.iter().flatten() {
            if pid.is_none_or(|want| want == *p) && (*f as usize) < FUNC_COUNT {
                out[*f as usize].blocks += l.blocks;
                out[*f as usize].bytes += l.bytes;
            }
        }
        out
    }

    /// The frames of a site, innermost first (a lost stack gets one frame saying so).
    pub fn frames(&self, site: &SiteId) -> Vec<Frame> {
        let (pid, stack_id, _) = *site;
        if stack_id == heaptrace_common::NO_SITE {
            return vec![Frame::not_collected()];
        }
        if stack_id == heaptrace_common::NOT_SAMPLED {
            return vec![Frame::not_sampled()];
        }
        if stack_id == heaptrace_common::BEFORE_ATTACH {
            return vec![Frame::before_attach()];
        }
        if stack_id < 0 {
            return vec![Frame::lost(stack_id)];
        }
        self.stacks
            .get(&(pid, stack_id))
            .map(|f| f.to_vec())
            .unwrap_or_else(|| vec![Frame::lost(0)])
    }

    /// Sites ordered by `key`, largest first, at most `top`.
    pub fn top_sites(
        &self,
        top: usize,
        key: impl Fn(&SiteTotals) -> i64,
    ) -> Vec<(SiteId, SiteTotals)> {
        let mut v: Vec<(SiteId, SiteTotals)> = self
            .sites
            .iter()
            .filter(|(_, s)| key(s) > 0)
            .map(|(id, s)| (*id, s.clone()))
            .collect();
        v.sort_by_key(|(id, s)| (std::cmp::Reverse(key(s)), *id));
        v.truncate(top);
        v
    }

    /// The exact sizes one site requested, (size, count) by size; empty where the mode keeps
    /// no exact histogram. Under byte sampling the counts are of sampled calls.
    pub fn sizes_of_site(&self, site: &SiteId) -> Vec<(u64, u64)> {
        let &(pid, stack, func) = site;
        self.sizes
            .range((pid, func, 0, i32::MIN)..=(pid, func, u64::MAX, i32::MAX))
            .filter(|((_, _, _, st), _)| *st == stack)
            .map(|((_, _, size, _), n)| (*size, *n))
            .collect()
    }

    /// Sites that allocated exactly `size` bytes, and how often.
    pub fn sites_with_size(&self, size: u64) -> Vec<(SiteId, u64)> {
        let mut v: Vec<(SiteId, u64)> = self
            .sizes
            .iter()
            .filter(|((_, _, s, _), _)| *s == size)
            .map(|((p, f, _, stack), n)| ((*p, *stack, *f), *n))
            .collect();
        v.sort_by_key(|(id, n)| (std::cmp::Reverse(*n), *id));
        v
    }

    /// Leaked blocks by site, largest first.
    pub fn top_leaks(&self, top: usize) -> Vec<(SiteId, Leak)> {
        let mut v: Vec<(SiteId, Leak)> = self
            .leaks
            .iter()
            .flatten()
            .map(|(id, l)| (*id, *l))
            .collect();
        v.sort_by_key(|(id, l)| (std::cmp::Reverse(l.bytes), *id));
        v.truncate(top);
        v
    }
}

#[cfg(test)]
mod tests;
