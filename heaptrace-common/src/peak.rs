//! The true peak and what held it: each process's live heap and its highest ([`ProcPeak`]),
//! and the site counters' figures at that moment (memray's high-water mark, folded lazily).
use crate::{NO_SITE, SiteCounters};

/// A process's live heap as the kernel keeps it at each tracked allocation and release, and
/// the highest it reached, with the allocation that reached it (`maps::PEAKS`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcPeak {
    /// Live bytes now (wrapping adds: a release is an add of the negated size).
    pub live: u64,
    /// The highest `live` reached.
    pub max: u64,
    /// The size and stack id ([`NO_SITE`] outside stacks mode) of the allocation that
    /// reached `max`.
    pub max_size: u64,
    pub max_stack: i32,
    pub epoch: u32,
    /// The peak's number (memray's high-water mark): moves on at the first release after a
    /// new high, before that release is counted anywhere, so that the site entries a change
    /// touches next keep their figures as they were at the high ([`SiteCounters::peak_seq`]).
    /// 0 before the first.
    pub seq: u32,
    /// 1 from a new high to the release that moves `seq` on: the live figures now are the
    /// peak's.
    pub pending: u32,
    /// Live blocks now (wrapping, as `live`), and those live at `max`.
    pub blocks: u64,
    pub max_blocks: u64,
}

const _: () = assert!(core::mem::size_of::<ProcPeak>() == 56);

impl ProcPeak {
    pub const ZERO: ProcPeak = ProcPeak {
        live: 0,
        max: 0,
        max_size: 0,
        max_stack: NO_SITE,
        epoch: 0,
        seq: 0,
        pending: 0,
        blocks: 0,
        max_blocks: 0,
    };
}

impl SiteCounters {
    /// Live blocks and bytes now, wrapping (user space reads them signed).
    #[inline(always)]
    pub fn live(&self) -> (u64, u64) {
        live(
            (self.calls, self.frees, self.untracked),
            (self.bytes, self.freed_bytes, self.untracked_bytes),
        )
    }

    /// Keeps the live figures as they were at the peak before the entry's first change since
    /// its process's peak number moved on to `seq` (`ProcPeak::seq`): what it held at the
    /// peak. Called before each change (the kernel's site counters).
    #[inline(always)]
    pub fn fold_peak(&mut self, seq: u32) {
        // SAFETY: an aligned read of a value the caller holds.
        if unsafe { core::ptr::read_volatile(&self.peak_seq) } != u64::from(seq) {
            let (blocks, bytes) = self.live();
            self.peak_blocks = blocks;
            self.peak_bytes = bytes;
            self.peak_seq = u64::from(seq);
        }
    }

    /// What this entry adds to its site's live figures to give them at the peak `seq` of its
    /// process (`pending`: a new high with no release since, the figures now are the peak's).
    pub fn at_peak_correction(&self, seq: u32, pending: bool) -> (u64, u64) {
        correction(
            self.live(),
            (self.peak_seq, self.peak_blocks, self.peak_bytes),
            u64::from(seq),
            pending,
        )
    }
}

/// Live figures from counts: what was allocated, less what was freed and what was freed
/// untracked (blocks, then bytes), wrapping.
#[inline(always)]
pub fn live(blocks: (u64, u64, u64), bytes: (u64, u64, u64)) -> (u64, u64) {
    (
        blocks.0.wrapping_sub(blocks.1).wrapping_sub(blocks.2),
        bytes.0.wrapping_sub(bytes.1).wrapping_sub(bytes.2),
    )
}

/// What an entry with live figures `live` and kept figures `kept` (the peak number it last
/// saw, its blocks and bytes then) adds to give them at the peak `seq`: nothing when the
/// figures now are the peak's (`pending`), before the first peak, or when the entry has not
/// changed since the number moved on to `seq`. Shared by the kernel's site counters and the
/// in-process site entries, which keep the same figures.
#[inline(always)]
pub fn correction(live: (u64, u64), kept: (u64, u64, u64), seq: u64, pending: bool) -> (u64, u64) {
    let (peak_seq, peak_blocks, peak_bytes) = kept;
    if pending || seq == 0 || peak_seq != seq {
        return (0, 0);
    }
    (
        peak_blocks.wrapping_sub(live.0),
        peak_bytes.wrapping_sub(live.1),
    )
}
