//! The highest live heap: the kernel's (or the in-process library's) at the allocation that
//! reached it, else the highest total at a round's end, and the sites holding the most then.
use serde::Serialize;

use super::Profile;
use crate::drain::round::{PeakHeld, Round, SiteId, Totals};

/// How many sites the peak remembers.
const PEAK_SITES: usize = 20;

/// The highest live heap: at the allocation that reached it where the kernel took it (the
/// highest of one process's, `exact`), else the highest total seen at the end of a round; and
/// the sites holding it: at that moment where the kernel kept them (`PeakHeld`), else at the
/// end of the round that saw it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Peak {
    pub live_bytes: i64,
    /// At the peak where the kernel kept them, else at the end of the round that saw it.
    pub live_blocks: i64,
    pub round: u64,
    pub elapsed_ms: u64,
    /// (site, live blocks, live bytes), largest first: at the peak where the kernel kept
    /// them (every site live then), else the largest at the end of that round.
    pub sites: Vec<(SiteId, i64, i64)>,
    /// `sites` and `live_blocks` are the peak's own (not a round end's).
    pub held: bool,
    /// Taken by the kernel at an allocation rather than at a round's end.
    pub exact: bool,
    /// The allocation that reached an exact peak: (process, stack id, its size).
    pub reached_by: Option<(u32, i32, u64)>,
}

impl Profile {
    /// The kernel's peaks of the round: each process's highest, and the trace's where one is
    /// higher than any seen. Under byte sampling the live map holds the sampled blocks only:
    /// the estimate at the round ends stands.
    pub(super) fn apply_peaks(&mut self, round: &Round, total: &Totals) {
        if self.sample_bytes > 0 {
            return;
        }
        for (pid, k) in &round.peaks {
            let p = self.procs.entry(*pid).or_default();
            if p.peak.is_none_or(|was| k.bytes > was.bytes) {
                p.peak = Some(*k);
            }
            if self
                .peak
                .as_ref()
                .is_none_or(|p| k.bytes as i64 > p.live_bytes)
            {
                let mut peak = self.peak_now(round, total);
                peak.live_bytes = k.bytes as i64;
                // In process each thread adds its changes in batches: within
                // `inproc::PEAK_BATCH` a thread (docs/in-process.md).
                peak.exact = self.collector == crate::run_info::Collector::Kernel;
                peak.reached_by = Some((*pid, k.stack_id, k.size));
                self.peak = Some(peak);
            }
        }
        // After the peaks: a composition can come a round after its peak (a new high read
        // before the release that fixes its sites' figures).
        for (pid, held) in &round.peak_held {
            let Some(p) = self.procs.get_mut(pid) else {
                continue;
            };
            if p.peak.is_none_or(|k| k.bytes != held.bytes) {
                continue;
            }
            p.peak_held = Some(held.clone());
            if let Some(peak) = self.peak.as_mut()
                && peak.reached_by.is_some_and(|r| r.0 == *pid)
                && peak.live_bytes == held.bytes as i64
            {
                peak.set_held(*pid, held);
            }
        }
    }

    pub(super) fn peak_now(&self, round: &Round, total: &Totals) -> Peak {
        let mut sites: Vec<(SiteId, i64, i64)> = self
            .sites
            .iter()
            .filter(|(id, s)| s.live_bytes > 0 && self.procs.get(&id.0).is_none_or(|p| !p.exited))
            .map(|(id, s)| (*id, s.live_blocks, s.live_bytes))
            .collect();
        sites.sort_by_key(|(_, _, bytes)| std::cmp::Reverse(*bytes));
        sites.truncate(PEAK_SITES);
        Peak {
            live_bytes: total.live_bytes,
            live_blocks: total.live_blocks,
            round: round.index,
            elapsed_ms: round.elapsed_ms,
            sites,
            held: false,
            exact: false,
            reached_by: None,
        }
    }
}

impl Peak {
    /// Takes the sites and blocks of process `pid`'s peak, `held`.
    pub fn set_held(&mut self, pid: u32, held: &PeakHeld) {
        self.live_blocks = held.blocks as i64;
        self.sites = held
            .sites
            .iter()
            .map(|&(stack, func, blocks, bytes)| ((pid, stack, func), blocks, bytes))
            .collect();
        self.sites
            .sort_by_key(|(id, _, bytes)| (std::cmp::Reverse(*bytes), *id));
        self.held = true;
    }
}
