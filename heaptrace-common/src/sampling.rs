//! Poisson sampling per allocated byte (`--sample-bytes N`), the integer arithmetic both sides
//! share: the kernel draws the bytes until the next sample with it, user space tests it.
//!
//! As in tcmalloc and jemalloc, the allocated bytes are a stream in which samples fall as a
//! Poisson process of rate 1/N: the gap until the next sample is exponential with mean N, and
//! an allocation of s bytes that crosses it is sampled. The exponential is memoryless, so an
//! allocation of s bytes is sampled with probability 1 - exp(-s/N) whatever came before it;
//! its unbiased weight is the inverse of that (see [`weight`]).
//!
//! BPF has no floating point. The gap is -ln(u) * N for a uniform u in (0, 1]:
//! -ln(u) = ln 2 * -log2(u), and -log2(u) of a 32-bit random number is its leading-one position
//! plus log2 of its mantissa, read from a table of log2(1 + j/1024) and interpolated linearly
//! on the mantissa's remaining bits (the error of the interpolation is below 2e-7).

/// Mantissa bits resolved by the table; the rest are interpolated.
pub const TABLE_BITS: u32 = 10;
/// Entries of the log2 table: log2(1 + j / 2^TABLE_BITS) for j in 0..=2^TABLE_BITS.
pub const TABLE_LEN: usize = (1 << TABLE_BITS) + 1;
/// Fixed point of the table's entries and of the draw's logarithm.
pub const FRAC_BITS: u32 = 32;
/// The largest `--sample-bytes`: keeps `log2 (Q16, at most 2^21) * N * ln 2` within 64 bits.
pub const MAX_SAMPLE_BYTES: u64 = 1 << 40;

/// floor(log2 v) for v > 0.
#[inline(always)]
fn floor_log2(v: u64) -> u32 {
    crate::bit_length(v) - 1
}

/// -log2(u) in Q32 for u = (random + 1) / 2^32, so u is in (0, 1]. `table(j)` returns
/// log2(1 + j / 1024) in Q32 for j in 0..=1024 (None where a lookup fails: then 0, which only
/// shortens that one gap).
#[inline(always)]
pub fn neg_log2_q32(random: u32, table: impl Fn(u32) -> Option<u64>) -> u64 {
    let r = u64::from(random) + 1; // 1 ..= 2^32
    let k = floor_log2(r); // 0 ..= 32
    let frac = r - (1u64 << k); // the bits below the leading one
    // The first TABLE_BITS mantissa bits index the table; the rest interpolate.
    let (j, rem, rem_bits) = if k >= TABLE_BITS {
        let rem_bits = k - TABLE_BITS;
        (
            (frac >> rem_bits) as u32,
            frac & ((1u64 << rem_bits) - 1),
            rem_bits,
        )
    } else {
        ((frac << (TABLE_BITS - k)) as u32, 0, 0)
    };
    let lo = table(j).unwrap_or(0);
    let hi = table(j + 1).unwrap_or(lo);
    let log2_mantissa = lo + ((hi.saturating_sub(lo) * rem) >> rem_bits);
    // log2(u) = k - 32 + log2(mantissa): at most 0.
    (u64::from(32 - k) << FRAC_BITS).saturating_sub(log2_mantissa)
}

/// Bytes until the next sample: -ln(u) * N rounded up, at least 1. `scale` is N * ln 2 in
/// Q16 (computed once by the loader). Rounded up because an allocation of s bytes is sampled
/// when the gap is at most s: a gap x is sampled by s >= ceil(x), exactly when x <= s (rounding
/// down would sample with the probability of s + 1 bytes).
#[inline(always)]
pub fn gap(random: u32, scale: u64, table: impl Fn(u32) -> Option<u64>) -> u64 {
    // To the nearest Q16 step (up to N * ln 2 / 2^17 bytes off, either way: no bias).
    let l_q16 = (neg_log2_q32(random, table) + (1 << (FRAC_BITS - 17))) >> (FRAC_BITS - 16);
    // l_q16 <= (32 << 16) + 1 and scale <= 2^40 * 0.7 * 2^16: the product needs a split to fit.
    let g = ((l_q16 * (scale >> 16)) + ((l_q16 * (scale & 0xffff)) >> 16) + 0xffff) >> 16;
    if g == 0 { 1 } else { g }
}
