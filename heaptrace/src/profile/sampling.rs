//! Byte sampling (`--sample-bytes N`): how user space turns the sampled allocations of a site
//! into unbiased estimates (`probe::sampling` has what the loader gives the kernel).
//!
//! The kernel samples an allocation of s bytes with probability 1 - exp(-s/N) (see
//! `heaptrace_common::sampling`). Per-function counters and the size histogram stay exact;
//! only sampled allocations get a stack, a site and a live-map entry. The size histogram keeps
//! each sampled allocation's site, so every sampled allocation is weighted by its own size
//! (pprof's scaling of Go heap samples uses a site's average size instead, which is the same
//! for a site of one size and biased for a site of many).
use std::collections::BTreeMap;

use heaptrace_common::{LOG2_BUCKETS, NO_SITE, NOT_SAMPLED, log2_bucket};
use serde::Serialize;

use crate::{
    drain::round::Leak,
    drain::round::{SiteId, SiteTotals, SizeKey},
};

/// The unbiased weight of a sampled allocation of `size` bytes: 1 / P(sampled) =
/// 1 / (1 - exp(-size/N)), as pprof scales tcmalloc's and Go's heap samples. 1 without
/// sampling.
pub fn weight(size: u64, sample_bytes: u64) -> f64 {
    if sample_bytes == 0 {
        return 1.0;
    }
    let p = -(-(size as f64) / sample_bytes as f64).exp_m1();
    if p > 0.0 { 1.0 / p } else { 1.0 }
}

/// What the sampled allocations of one site stand for: their weighted count, bytes and
/// sizes, summed allocation by allocation from the size histogram.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Weighted {
    /// Sampled allocations found in the size histogram, and their bytes.
    pub calls: u64,
    pub bytes: u64,
    /// Their weighted sums.
    pub est_calls: f64,
    pub est_bytes: f64,
    #[serde(skip)]
    pub est_sizes: [f64; LOG2_BUCKETS],
}

impl Weighted {
    /// Another site's, added: the weights of sites folded into one (`profile::exited`).
    pub fn plus(&mut self, o: &Weighted) {
        self.calls += o.calls;
        self.bytes += o.bytes;
        self.est_calls += o.est_calls;
        self.est_bytes += o.est_bytes;
        for (a, b) in self.est_sizes.iter_mut().zip(o.est_sizes) {
            *a += b;
        }
    }
}

impl Default for Weighted {
    fn default() -> Self {
        Weighted {
            calls: 0,
            bytes: 0,
            est_calls: 0.0,
            est_bytes: 0.0,
            est_sizes: [0.0; LOG2_BUCKETS],
        }
    }
}

impl Weighted {
    fn add(&mut self, size: u64, n: u64, sample_bytes: u64) {
        let w = weight(size, sample_bytes) * n as f64;
        self.calls += n;
        self.bytes += size * n;
        self.est_calls += w;
        self.est_bytes += w * size as f64;
        self.est_sizes[log2_bucket(size)] += w;
    }
}

/// Adds a round's size-histogram increments of sampled sites to their weighted sums.
pub fn weigh(
    weights: &mut BTreeMap<SiteId, Weighted>,
    sizes: &BTreeMap<SizeKey, u64>,
    sample_bytes: u64,
) {
    for ((pid, func, size, stack), n) in sizes {
        if *stack != NOT_SAMPLED && *stack != NO_SITE {
            weights
                .entry((*pid, *stack, *func))
                .or_default()
                .add(*size, *n, sample_bytes);
        }
    }
}

/// Per-site multipliers from sampled to estimated: for blocks and for bytes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scale {
    pub blocks: f64,
    pub bytes: f64,
}

/// The estimate of a site's counters from its sampled ones. Allocations come from the
/// weighted size histogram; sampled allocations it does not hold yet (the two maps are read
/// one after the other, or the histogram was full) are weighted by their average size.
/// Releases, temporaries and lifetimes are of sampled blocks whose sizes are not kept apart:
/// they are scaled by the site's ratio of estimated to sampled blocks and bytes (exact for a
/// site of one size).
pub fn estimate(raw: &SiteTotals, w: &Weighted, sample_bytes: u64) -> (SiteTotals, Scale) {
    let mut est_calls = w.est_calls;
    let mut est_bytes = w.est_bytes;
    let mut sizes = w.est_sizes;
    let rest_calls = raw.calls.saturating_sub(w.calls);
    let rest_bytes = raw.bytes.saturating_sub(w.bytes);
    if let Some(avg) = rest_bytes.checked_div(rest_calls) {
        let wt = weight(avg, sample_bytes) * rest_calls as f64;
        est_calls += wt;
        est_bytes += weight(avg, sample_bytes) * rest_bytes as f64;
        sizes[log2_bucket(avg)] += wt;
    }
    let ratio = |est: f64, raw: u64| if raw == 0 { 1.0 } else { est / raw as f64 };
    let scale = Scale {
        blocks: ratio(est_calls, raw.calls),
        bytes: ratio(est_bytes, raw.bytes),
    };
    let by = |v: u64, f: f64| (v as f64 * f).round() as u64;
    let mut t = SiteTotals {
        calls: est_calls.round() as u64,
        bytes: est_bytes.round() as u64,
        frees: by(raw.frees, scale.blocks),
        freed_bytes: by(raw.freed_bytes, scale.bytes),
        temp_blocks: by(raw.temp_blocks, scale.blocks),
        temp_bytes: by(raw.temp_bytes, scale.bytes),
        ..SiteTotals::default()
    };
    for (b, s) in sizes.iter().enumerate() {
        t.sizes.set(b, s.round() as u64);
    }
    for (b, l) in raw.lifetimes.iter() {
        t.lifetimes.set(b, by(l, scale.blocks));
    }
    // Blocks the live map refused left the raw live figures at once (see SiteTotals); scaled
    // like the frees, they leave the estimates too.
    let refused = raw.calls as i64 - raw.frees as i64 - raw.live_blocks;
    let refused_bytes = raw.bytes as i64 - raw.freed_bytes as i64 - raw.live_bytes;
    t.live_blocks =
        t.calls as i64 - t.frees as i64 - (refused as f64 * scale.blocks).round() as i64;
    t.live_bytes =
        t.bytes as i64 - t.freed_bytes as i64 - (refused_bytes as f64 * scale.bytes).round() as i64;
    (t, scale)
}

/// A site's sampled blocks not freed at the end, scaled to an estimate.
pub fn scale_leak(l: &Leak, s: Scale) -> Leak {
    Leak {
        blocks: (l.blocks as f64 * s.blocks).round() as u64,
        bytes: (l.bytes as f64 * s.bytes).round() as u64,
    }
}

/// "1 in N bytes" in the words every output uses.
pub fn describe(sample_bytes: u64) -> String {
    if sample_bytes == 0 {
        "every allocation".into()
    } else {
        format!("1 per {sample_bytes} bytes allocated (Poisson)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_are_the_inverse_sampling_probability() {
        let n = 65536;
        assert_eq!(weight(100, 0), 1.0);
        // A block of N bytes is sampled with probability 1 - 1/e.
        let w = weight(n, n);
        assert!((w - 1.0 / (1.0 - (-1.0f64).exp())).abs() < 1e-12, "{w}");
        // Small blocks: about N / s; huge blocks: about 1.
        assert!((weight(1024, n) - 64.5).abs() < 0.01, "{}", weight(1024, n));
        assert!((weight(64 * n, n) - 1.0).abs() < 1e-12);
        assert_eq!(weight(0, n), 1.0);
    }

    #[test]
    fn sites_are_weighted_allocation_by_allocation() {
        let n = 65536;
        let mut weights = BTreeMap::new();
        let mut sizes = BTreeMap::new();
        // Site 5: 10 sampled blocks of 1 KiB and 2 of 1 MiB; unsampled calls are not weighed.
        sizes.insert((1, 0, 1024, 5), 10);
        sizes.insert((1, 0, 1 << 20, 5), 2);
        sizes.insert((1, 0, 1024, NOT_SAMPLED), 1000);
        weigh(&mut weights, &sizes, n);
        assert_eq!(weights.len(), 1);
        let raw = SiteTotals {
            calls: 12,
            bytes: 10 * 1024 + (2 << 20),
            frees: 10,
            freed_bytes: 10 * 1024,
            live_blocks: 2,
            live_bytes: 2 << 20,
            ..Default::default()
        };
        let (est, scale) = estimate(&raw, &weights[&(1, 5, 0)], n);
        let w_small = weight(1024, n);
        let w_big = weight(1 << 20, n);
        assert_eq!(est.calls, (10.0 * w_small + 2.0 * w_big).round() as u64);
        assert_eq!(
            est.bytes,
            (10.0 * 1024.0 * w_small + 2.0 * (1 << 20) as f64 * w_big).round() as u64
        );
        assert_eq!(
            est.sizes[log2_bucket(1024)],
            (10.0 * w_small).round() as u64
        );
        assert_eq!(est.sizes[log2_bucket(1 << 20)], 2);
        assert_eq!(est.live_blocks, est.calls as i64 - est.frees as i64);
        // A sampled allocation the histogram does not hold yet: weighted by its size.
        let mut more = raw.clone();
        more.calls += 1;
        more.bytes += 2048;
        more.live_blocks += 1;
        more.live_bytes += 2048;
        let (est2, _) = estimate(&more, &weights[&(1, 5, 0)], n);
        assert_eq!(
            est2.calls,
            (10.0 * w_small + 2.0 * w_big + weight(2048, n)).round() as u64
        );
        let leak = scale_leak(
            &Leak {
                blocks: 2,
                bytes: 2 << 20,
            },
            scale,
        );
        assert!(leak.blocks > 2 && leak.bytes > 2 << 20, "{leak:?}");
        // One of the 1 KiB blocks was refused by a full live map: it leaves the live
        // estimates scaled like a free.
        let refused = SiteTotals {
            live_blocks: 1,
            live_bytes: (2 << 20) - 1024,
            ..raw
        };
        let (est3, s3) = estimate(&refused, &weights[&(1, 5, 0)], n);
        assert_eq!(est3.live_blocks, est.live_blocks - s3.blocks.round() as i64);
        assert_eq!(
            est3.live_bytes,
            est.live_bytes - (1024.0 * s3.bytes).round() as i64
        );
    }
}
