//! One site's counters (`SiteTotals`), cumulative in a snapshot and a difference in a round,
//! with their arithmetic, and the difference of two maps of them (`map_delta`).
use std::collections::BTreeMap;

use heaptrace_common::{LOG2_BUCKETS, SiteCounters};
use serde::{Deserialize, Serialize};

use crate::drain::buckets::Buckets;

/// Power-of-two histogram buckets (see `heaptrace_common::log2_bucket`).
pub type Log2 = [u64; LOG2_BUCKETS];

/// Counters of one allocation site; cumulative in a snapshot, a difference in a round.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SiteTotals {
    pub calls: u64,
    pub bytes: u64,
    pub frees: u64,
    pub freed_bytes: u64,
    pub live_blocks: i64,
    pub live_bytes: i64,
    pub temp_blocks: u64,
    pub temp_bytes: u64,
    pub sizes: Buckets,
    /// Lifetimes of released blocks, in units of 1024 ns.
    pub lifetimes: Buckets,
}

impl SiteTotals {
    /// Every counter put through `op`, field by field, wrapping on the bits as `Totals::zip`.
    fn zip(&self, other: &SiteTotals, op: impl Fn(u64, u64) -> u64 + Copy) -> SiteTotals {
        let signed = |a: i64, b: i64| op(a as u64, b as u64) as i64;
        SiteTotals {
            calls: op(self.calls, other.calls),
            bytes: op(self.bytes, other.bytes),
            frees: op(self.frees, other.frees),
            freed_bytes: op(self.freed_bytes, other.freed_bytes),
            live_blocks: signed(self.live_blocks, other.live_blocks),
            live_bytes: signed(self.live_bytes, other.live_bytes),
            temp_blocks: op(self.temp_blocks, other.temp_blocks),
            temp_bytes: op(self.temp_bytes, other.temp_bytes),
            sizes: self.sizes.zip(&other.sizes, op),
            lifetimes: self.lifetimes.zip(&other.lifetimes, op),
        }
    }

    pub fn from_per_cpu<'a>(cpus: impl IntoIterator<Item = &'a SiteCounters>) -> SiteTotals {
        let mut t = SiteTotals::default();
        let (mut untracked, mut untracked_bytes) = (0u64, 0u64);
        let mut lifetimes: Log2 = [0; LOG2_BUCKETS];
        let add = |a: &mut u64, b: u64| *a = a.wrapping_add(b);
        for c in cpus {
            for (a, b) in lifetimes.iter_mut().zip(c.lifetimes) {
                add(a, u64::from(b));
            }
            add(&mut untracked, c.untracked);
            add(&mut untracked_bytes, c.untracked_bytes);
            add(&mut t.calls, c.calls);
            add(&mut t.bytes, c.bytes);
            add(&mut t.frees, c.frees);
            add(&mut t.freed_bytes, c.freed_bytes);
            add(&mut t.temp_blocks, c.temp_blocks);
            add(&mut t.temp_bytes, c.temp_bytes);
        }
        t.lifetimes = Buckets::from_dense(&lifetimes);
        // The kernel keeps no live counters per site: what was allocated minus what was freed,
        // minus what the live map refused (its frees are not seen as this site's).
        t.live_blocks = t.calls.wrapping_sub(t.frees).wrapping_sub(untracked) as i64;
        t.live_bytes = t
            .bytes
            .wrapping_sub(t.freed_bytes)
            .wrapping_sub(untracked_bytes) as i64;
        t
    }

    pub fn minus(&self, prev: &SiteTotals) -> SiteTotals {
        self.zip(prev, u64::wrapping_sub)
    }

    /// `zip` with a wrapping add, in place: every round adds up hundreds of thousands.
    pub fn plus(&mut self, d: &SiteTotals) {
        // Every field named: one added to SiteTotals cannot be missed here.
        let SiteTotals {
            calls,
            bytes,
            frees,
            freed_bytes,
            live_blocks,
            live_bytes,
            temp_blocks,
            temp_bytes,
            sizes,
            lifetimes,
        } = d;
        let add = |a: &mut u64, b: u64| *a = a.wrapping_add(b);
        add(&mut self.calls, *calls);
        add(&mut self.bytes, *bytes);
        add(&mut self.frees, *frees);
        add(&mut self.freed_bytes, *freed_bytes);
        self.live_blocks = self.live_blocks.wrapping_add(*live_blocks);
        self.live_bytes = self.live_bytes.wrapping_add(*live_bytes);
        add(&mut self.temp_blocks, *temp_blocks);
        add(&mut self.temp_bytes, *temp_bytes);
        self.sizes.combine(sizes, u64::wrapping_add);
        self.lifetimes.combine(lifetimes, u64::wrapping_add);
    }
}

/// The entries of `cur` that differ from `base`'s (`minus`), those new in `cur` whole; an
/// entry that did not change is left out (`minus(v, v)` must be the default). Both maps are
/// walked once, side by side: each round compares every site of the host.
pub fn map_delta<K: Ord + Copy, V: Clone + PartialEq + Default>(
    cur: &BTreeMap<K, V>,
    base: &BTreeMap<K, V>,
    minus: impl Fn(&V, &V) -> V,
) -> BTreeMap<K, V> {
    let mut base = base.iter().peekable();
    let mut out = Vec::new();
    for (k, v) in cur {
        while base.next_if(|(b, _)| *b < k).is_some() {}
        let d = match base.peek() {
            Some((b, was)) if *b == k && v == *was => continue,
            Some((b, was)) if *b == k => minus(v, was),
            _ => v.clone(),
        };
        if d != V::default() {
            out.push((*k, d));
        }
    }
    // Sorted already: built whole.
    out.into_iter().collect()
}
