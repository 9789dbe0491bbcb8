//! Percentiles of the kernel's power-of-two histograms, through an hdrhistogram.
//!
//! The kernel only knows which power of two a value fell in, so each bucket is recorded at its
//! geometric middle (1.5 x its floor): percentiles are good to within a factor of 1.5.
use hdrhistogram::Histogram;
use heaptrace_common::log2_bucket_floor;
use serde::Serialize;

use crate::drain::round::Log2;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Percentiles {
    pub count: u64,
    pub p50: u64,
    pub p99: u64,
    /// The upper bound of the highest non-empty bucket.
    pub max: u64,
}

/// Percentiles of a histogram whose values are in units of `unit` (1 for ns, 1024 for the
/// ~us lifetimes), reported in the base unit. None when it is empty.
pub fn percentiles(h: &Log2, unit: u64) -> Option<Percentiles> {
    let count: u64 = h.iter().sum();
    if count == 0 {
        return None;
    }
    let mut hist = Histogram::<u64>::new(2).ok()?;
    let mut top = 0;
    for (b, n) in h.iter().enumerate() {
        if *n == 0 {
            continue;
        }
        let floor = log2_bucket_floor(b).saturating_mul(unit);
        let mid = if b == 0 { 0 } else { floor + floor / 2 };
        hist.record_n(mid, *n).ok()?;
        top = b;
    }
    Some(Percentiles {
        count,
        p50: hist.value_at_quantile(0.50),
        p99: hist.value_at_quantile(0.99),
        max: log2_bucket_floor(top + 1).saturating_mul(unit),
    })
}

#[cfg(test)]
mod tests {
    use heaptrace_common::{LOG2_BUCKETS, log2_bucket};

    use super::*;

    #[test]
    fn percentiles_land_in_the_right_bucket() {
        let mut h = [0u64; LOG2_BUCKETS];
        h[log2_bucket(100)] += 98; // [64, 128)
        h[log2_bucket(5000)] += 2; // [4096, 8192)
        let p = percentiles(&h, 1).unwrap();
        assert_eq!(p.count, 100);
        assert!((64..128).contains(&p.p50), "{p:?}");
        assert!((4096..8192 + 100).contains(&p.p99), "{p:?}");
        assert_eq!(p.max, 8192);
        assert_eq!(percentiles(&[0; LOG2_BUCKETS], 1), None);
    }

    #[test]
    fn units_scale_the_result() {
        let mut h = [0u64; LOG2_BUCKETS];
        h[1] = 1; // 1 unit
        let p = percentiles(&h, 1024).unwrap();
        assert_eq!(p.max, 2048);
        assert!((1024..2048).contains(&p.p50), "{p:?}");
    }
}
