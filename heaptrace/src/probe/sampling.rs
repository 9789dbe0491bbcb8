//! Byte sampling (`--sample-bytes N`): what the loader gives the kernel. The kernel samples an
//! allocation of s bytes with probability 1 - exp(-s/N) (`heaptrace_common::sampling`);
//! `profile::sampling` turns the samples back into estimates.
use heaptrace_common::sampling::{FRAC_BITS, MAX_SAMPLE_BYTES, TABLE_BITS, TABLE_LEN};

/// Checks a `--sample-bytes` value (clap's parser): 0 (every allocation) up to 2^40.
pub fn parse_sample_bytes(s: &str) -> Result<u64, String> {
    let n: u64 = s
        .trim()
        .parse()
        .map_err(|_| format!("not a number of bytes: {s:?}"))?;
    if n > MAX_SAMPLE_BYTES {
        return Err(format!(
            "{n} is above the largest sampling rate, {MAX_SAMPLE_BYTES}"
        ));
    }
    Ok(n)
}

/// The kernel's log2 table: log2(1 + j / 1024) in Q32, j in 0..=1024.
pub fn log2_table() -> Vec<u64> {
    (0..TABLE_LEN)
        .map(|j| {
            let m = 1.0 + j as f64 / f64::from(1u32 << TABLE_BITS);
            (m.log2() * (1u64 << FRAC_BITS) as f64).round() as u64
        })
        .collect()
}

/// N * ln 2 in Q16: the kernel's scale from -log2(u) to bytes.
pub fn gap_scale(sample_bytes: u64) -> u64 {
    (sample_bytes as f64 * std::f64::consts::LN_2 * 65536.0).round() as u64
}

#[cfg(test)]
mod tests {
    use heaptrace_common::sampling::{gap, neg_log2_q32};

    use super::*;

    fn table_fn(t: &[u64]) -> impl Fn(u32) -> Option<u64> + '_ {
        move |j| t.get(j as usize).copied()
    }

    #[test]
    fn the_log2_table_and_its_interpolation_match_the_logarithm() {
        let t = log2_table();
        assert_eq!(t.len(), TABLE_LEN);
        assert_eq!((t[0], t[TABLE_LEN - 1]), (0, 1 << FRAC_BITS));
        // Every random number's -log2(u), against f64, over a spread of values.
        let mut worst = 0.0f64;
        for i in 0..200_000u64 {
            let r = (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as u32;
            let want = -((u64::from(r) + 1) as f64 / 4294967296.0).log2();
            let got = neg_log2_q32(r, table_fn(&t)) as f64 / 4294967296.0;
            worst = worst.max((got - want).abs());
        }
        assert!(worst < 1e-6, "worst error {worst}");
        assert_eq!(neg_log2_q32(u32::MAX, table_fn(&t)), 0);
        assert_eq!(neg_log2_q32(0, table_fn(&t)), 32 << FRAC_BITS);
    }

    #[test]
    fn gaps_are_exponential_with_mean_n() {
        // Every 2^-20 quantile of the random number: the gaps' distribution, deterministically.
        let t = log2_table();
        let n = 65536u64;
        let scale = gap_scale(n);
        let steps = 1u64 << 20;
        let gaps: Vec<u64> = (0..steps)
            .map(|i| gap(((i << 12) | 0x800) as u32, scale, table_fn(&t)))
            .collect();
        let mean = gaps.iter().sum::<u64>() as f64 / steps as f64;
        assert!((mean / n as f64 - 1.0).abs() < 1e-3, "mean {mean}");
        // P(gap <= s) = 1 - exp(-s/N): what makes 1 / (1 - exp(-s/N)) the right weight.
        for s in [64u64, 1024, 16384, 65536, 262144] {
            let p = gaps.iter().filter(|g| **g <= s).count() as f64 / steps as f64;
            let want = -(-(s as f64) / n as f64).exp_m1();
            assert!((p / want - 1.0).abs() < 2e-3, "s {s}: {p} vs {want}");
        }
    }

    #[test]
    fn parses_and_bounds_the_rate() {
        assert_eq!(parse_sample_bytes("0"), Ok(0));
        assert_eq!(parse_sample_bytes("65536"), Ok(65536));
        assert!(parse_sample_bytes("-1").is_err());
        assert!(parse_sample_bytes("1k").is_err());
        assert!(parse_sample_bytes(&(MAX_SAMPLE_BYTES + 1).to_string()).is_err());
    }
}
