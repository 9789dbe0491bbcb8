//! The power-of-two histograms' buckets (request sizes, lifetimes, latencies), computed the
//! same way by the probes and by user space.

/// Buckets of the power-of-two histograms: bucket `b` holds values in `[2^(b-1), 2^b)`,
/// bucket 0 holds 0, the last bucket everything from `2^(LOG2_BUCKETS-2)` up.
pub const LOG2_BUCKETS: usize = 32;

/// The number of significant bits of `v` (0 for 0). BPF has no count-leading-zeros
/// instruction, and a binary search made the verifier follow each result on its own path
/// through the rest of a program (a result is an index, so its value is kept): the top bit is
/// smeared down and the ones counted instead, with no branch.
#[inline(always)]
pub fn bit_length(v: u64) -> u32 {
    let mut x = v;
    x |= x >> 1;
    x |= x >> 2;
    x |= x >> 4;
    x |= x >> 8;
    x |= x >> 16;
    x |= x >> 32;
    x -= (x >> 1) & 0x5555_5555_5555_5555;
    x = (x & 0x3333_3333_3333_3333) + ((x >> 2) & 0x3333_3333_3333_3333);
    x = (x + (x >> 4)) & 0x0f0f_0f0f_0f0f_0f0f;
    (x.wrapping_mul(0x0101_0101_0101_0101) >> 56) as u32
}

/// The bucket of `v`: the number of significant bits, capped at the last bucket.
#[inline(always)]
pub fn log2_bucket(v: u64) -> usize {
    let r = bit_length(v) as usize;
    if r >= LOG2_BUCKETS {
        LOG2_BUCKETS - 1
    } else {
        r
    }
}

/// The smallest value that lands in bucket `b`.
pub const fn log2_bucket_floor(b: usize) -> u64 {
    if b == 0 { 0 } else { 1u64 << (b - 1) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bit_length_counts_significant_bits() {
        for v in [0u64, 1, 2, 3, 255, 256, 1 << 40, u64::MAX]
            .into_iter()
            .chain((0..64).flat_map(|b| [1u64 << b, (1u64 << b) - 1, (1u64 << b) | 1]))
        {
            assert_eq!(bit_length(v), 64 - v.leading_zeros(), "{v:#x}");
        }
    }

    #[test]
    fn log2_buckets_hold_their_floors() {
        assert_eq!(log2_bucket(0), 0);
        assert_eq!(log2_bucket(1), 1);
        assert_eq!(log2_bucket(2), 2);
        assert_eq!(log2_bucket(3), 2);
        assert_eq!(log2_bucket(1000), 10);
        assert_eq!(log2_bucket(1024), 11);
        assert_eq!(log2_bucket(u64::MAX), LOG2_BUCKETS - 1);
        for b in 0..LOG2_BUCKETS {
            assert_eq!(log2_bucket(log2_bucket_floor(b)), b);
        }
    }
}
