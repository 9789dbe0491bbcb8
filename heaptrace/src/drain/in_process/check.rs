//! What the traced program can write in its region, checked. It can write every byte of it:
//! the header's capacities and counts, its threads' counters, the tables. Every read is sized
//! from the daemon's own layout (what it made the region with), never from the header, and
//! what a read finds out of bounds or inconsistent is left out, the last good figures kept,
//! and counted as the region overwritten (`Region::faults`): the program's own counts are then
//! wrong, never heaptrace's memory, time or other processes' figures.
use std::sync::atomic::Ordering;

use heaptrace_common::{
    BEFORE_ATTACH, BEFORE_ATTACH_FUNC, FUNC_COUNT, NO_SITE, inproc::Header, inproc::LOST_STACK,
};

use super::Region;
use crate::drain::round::{Snapshot, Totals};

/// The most a counter can honestly reach in a trace (2^48 calls: a day at 3 G/s) and a byte
/// count (2^60). Below them, no sum or product the views make of the figures can wrap.
pub(super) const MAX_COUNT: u64 = 1 << 48;
pub(super) const MAX_BYTES: u64 = 1 << 60;
/// The largest block an allocation can return (the x86-64 user address space).
pub(super) const MAX_SIZE: u64 = 1 << 47;

/// What was found wrong, one flag each: a flag set counts one fault, and is cleared when a
/// read finds it right again.
pub(super) mod bad {
    pub const HEADER: u32 = 0;
    pub const THREADS_USED: u32 = 1;
    pub const SITES_USED: u32 = 2;
    pub const TOTALS: u32 = 3;
    pub const SIZES: u32 = 4;
    pub const SITES: u32 = 5;
    pub const LOSSES: u32 = 6;
    pub const LATENCY: u32 = 7;
    pub const PEAK: u32 = 8;
    pub const LIVE: u32 = 9;
    pub const STACK: u32 = 10;
}

impl Region {
    /// Records whether `what` (a `bad` flag) was found wrong in this read.
    pub(super) fn found(&self, what: u32, wrong: bool) {
        let bit = 1u64 << what;
        if wrong {
            if self.bad.fetch_or(bit, Ordering::Relaxed) & bit == 0 {
                self.faults.fetch_add(1, Ordering::Relaxed);
            }
        } else {
            self.bad.fetch_and(!bit, Ordering::Relaxed);
        }
    }

    /// Reads of the region that found it overwritten, one per thing found wrong.
    pub fn faults(&self) -> u64 {
        self.faults.load(Ordering::Relaxed)
    }

    /// The header's settings, which only the daemon writes, compared with what it wrote.
    pub(super) fn check_header(&self, h: &Header) {
        let m = &self.made;
        let same = h.magic == m.magic
            && h.version == m.version
            && h.mode == m.mode
            && h.token == m.token
            && h.temporary_allocs == m.temporary_allocs
            && h.threads == m.threads
            && h.sites == m.sites
            && h.site_index == m.site_index
            && h.live == m.live
            && h.sizes == m.sizes
            && h.shared_sizes == m.shared_sizes
            && h.depth == m.depth
            && h.count_as == m.count_as
            && h.latency_every == m.latency_every
            && h.bytes == m.bytes
            && h.unwind_rows == m.unwind_rows;
        self.found(bad::HEADER, !same);
        self.found(bad::THREADS_USED, h.threads_used > m.threads);
        self.found(bad::SITES_USED, h.sites_used > m.sites);
    }

    /// Whether a stack id can be one of this region's: none, the lost stack, or one stored.
    pub(super) fn known_stack(&self, id: i32, used: usize) -> bool {
        id == NO_SITE || id == LOST_STACK || usize::try_from(id).is_ok_and(|i| i < used)
    }

    /// Whether a function index and a stack id read from the region can be a site's.
    /// A block heaptrace put in from the heap's census (`before_attach`) is one.
    pub(super) fn known_site(&self, func: u32, id: i32, used: usize) -> bool {
        (id == BEFORE_ATTACH && func == BEFORE_ATTACH_FUNC)
            || ((func as usize) < FUNC_COUNT && self.known_stack(id, used))
    }

    /// Keeps of `snap` what is within bounds and, in the same image as `last`, never below it
    /// (counters only grow); each part that is not is `last`'s again, and counted.
    /// `used`: the stacks stored, as far as the read took them.
    pub(super) fn vet(&self, snap: &mut Snapshot, last: &Snapshot, same_image: bool, used: usize) {
        let same = |a: u64, b: u64| !same_image || a >= b;
        let mut totals_ok = true;
        for (pid, p) in snap.procs.iter_mut() {
            clamp_failures(&mut p.totals);
            let before = last.procs.get(pid).map(|q| q.totals).unwrap_or_default();
            if !totals_fit(&p.totals) || !grew(&p.totals, &before, same_image) {
                p.totals = before;
                totals_ok = false;
            }
        }
        self.found(bad::TOTALS, !totals_ok);
        // All the sizes' bytes are bytes allocated: their sum is bounded as a byte count.
        let sized: u128 = snap
            .sizes
            .iter()
            .map(|(k, n)| k.2 as u128 * *n as u128)
            .sum();
        let sizes_ok = snap.sizes.values().all(|n| *n <= MAX_COUNT)
            && sized <= MAX_BYTES as u128
            && last
                .sizes
                .iter()
                .all(|(k, n)| same(snap.sizes.get(k).copied().unwrap_or(0), *n));
        if !sizes_ok {
            snap.sizes = last.sizes.clone();
        }
        self.found(bad::SIZES, !sizes_ok);
        let site_fits = |s: &crate::drain::round::SiteTotals| {
            [s.calls, s.frees, s.temp_blocks]
                .iter()
                .all(|n| *n <= MAX_COUNT)
                && [s.bytes, s.freed_bytes, s.temp_bytes]
                    .iter()
                    .all(|n| *n <= MAX_BYTES)
                && s.lifetimes.iter().all(|(_, n)| n <= MAX_COUNT)
                && s.sizes.iter().all(|(_, n)| n <= MAX_COUNT)
        };
        let sum = |f: fn(&crate::drain::round::SiteTotals) -> u64| -> u128 {
            snap.sites.values().map(|s| f(s) as u128).sum()
        };
        let sites_ok = snap.sites.values().all(site_fits)
            && sum(|s| s.calls) <= MAX_COUNT as u128
            && sum(|s| s.bytes) <= MAX_BYTES as u128
            && last.sites.iter().all(|(k, s)| {
                snap.sites
                    .get(k)
                    .is_some_and(|t| same(t.calls, s.calls) && same(t.frees, s.frees))
                    || !same_image
            });
        if !sites_ok {
            snap.sites = last.sites.clone();
        }
        self.found(bad::SITES, !sites_ok);
        let losses_ok = snap
            .losses
            .iter()
            .zip(last.losses.iter())
            .all(|(a, b)| *a <= MAX_COUNT && same(*a, *b));
        if !losses_ok {
            snap.losses = last.losses;
        }
        self.found(bad::LOSSES, !losses_ok);
        let latency_ok = snap.latency.iter().zip(last.latency.iter()).all(|(a, b)| {
            a.iter()
                .zip(b.iter())
                .all(|(x, y)| *x <= MAX_COUNT && same(*x, *y))
        });
        if !latency_ok {
            snap.latency = last.latency;
        }
        self.found(bad::LATENCY, !latency_ok);
        let peaks_ok = snap.peaks.values().all(|p| {
            p.bytes <= MAX_BYTES && p.size <= MAX_SIZE && self.known_stack(p.stack_id, used)
        });
        if !peaks_ok {
            snap.peaks = last.peaks.clone();
        }
        self.found(bad::PEAK, !peaks_ok);
    }
}

/// A read may catch a thread between its call count and its failure count: failures are
/// never more than the calls, and realloc's frees never more than its calls that returned.
fn clamp_failures(t: &mut Totals) {
    for f in t.funcs.iter_mut() {
        f.failed = f.failed.min(f.calls);
    }
    let r = &t.funcs[heaptrace_common::Func::Realloc as usize];
    t.realloc_frees = t.realloc_frees.min(r.calls - r.failed);
}

fn totals_fit(t: &Totals) -> bool {
    t.funcs
        .iter()
        .all(|f| f.calls <= MAX_COUNT && f.bytes <= MAX_BYTES)
        && [
            t.untracked_frees,
            t.realloc_moves,
            t.realloc_in_place,
            t.realloc_frees,
        ]
        .iter()
        .all(|n| *n <= MAX_COUNT)
        && t.realloc_released_bytes <= MAX_BYTES
        && t.live_blocks.unsigned_abs() <= MAX_COUNT
        && t.live_bytes.unsigned_abs() <= MAX_BYTES
}

/// Whether no counter went down since `before` (of the same image).
fn grew(t: &Totals, before: &Totals, same_image: bool) -> bool {
    if !same_image {
        return true;
    }
    t.funcs
        .iter()
        .zip(before.funcs.iter())
        .all(|(a, b)| a.calls >= b.calls && a.bytes >= b.bytes && a.failed >= b.failed)
        && t.untracked_frees >= before.untracked_frees
        && t.realloc_moves >= before.realloc_moves
        && t.realloc_in_place >= before.realloc_in_place
        && t.realloc_frees >= before.realloc_frees
        && t.realloc_released_bytes >= before.realloc_released_bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_never_exceed_calls() {
        let mut t = Totals::default();
        t.funcs[0].calls = 3;
        t.funcs[0].failed = 9;
        let r = heaptrace_common::Func::Realloc as usize;
        t.funcs[r].calls = 5;
        t.funcs[r].failed = 1;
        t.realloc_frees = u64::MAX;
        clamp_failures(&mut t);
        assert_eq!(t.funcs[0].failed, 3);
        assert_eq!(t.realloc_frees, 4);
        assert!(totals_fit(&t));
        t.funcs[1].bytes = u64::MAX;
        assert!(!totals_fit(&t));
    }

    #[test]
    fn a_counter_that_went_down_is_not_taken_in_the_same_image() {
        let mut before = Totals::default();
        before.funcs[0].calls = 10;
        let t = Totals::default();
        assert!(!grew(&t, &before, true));
        assert!(grew(&t, &before, false));
    }
}
