//! Byte sampling (`--sample-bytes`): exact per-function counts and sizes, site estimates
//! within what the Poisson sampling's variance allows, and far fewer stacks and live entries.
use serde_json::Value;

use crate::support::*;

const N_A: u64 = 200_000;
const N_B: u64 = 20_000;
const N_C: u64 = 100;
const KIB: u64 = 1024;
const MIB: u64 = 1 << 20;
const RATE: u64 = 65_536;

fn trace(tag: &str, opts: &[&str]) -> Value {
    trace_stacks(tag, "sampled", opts)
}

/// The sites whose innermost frame is `function`, summed: (estimated calls, bytes, samples).
fn site(doc: &Value, function: &str) -> (f64, f64, u64) {
    let sites: Vec<&Value> = doc["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["frames"][0]["function"] == function)
        .collect();
    assert!(!sites.is_empty(), "no site at {function}");
    let sum = |k: &str| sites.iter().map(|s| s[k].as_u64().unwrap()).sum::<u64>();
    (sum("calls") as f64, sum("bytes") as f64, sum("samples"))
}

/// P(an allocation of `size` bytes is sampled) at RATE.
fn p(size: u64) -> f64 {
    -(-(size as f64) / RATE as f64).exp_m1()
}

/// Five standard deviations of the estimate of `n` allocations of `size` bytes: each one's
/// estimator is w * Bernoulli(p) with w = 1/p, whose variance is (1 - p) / p.
fn tolerance(n: u64, size: u64) -> f64 {
    5.0 * (n as f64 * (1.0 - p(size)) / p(size)).sqrt()
}

bpf_test!(
    shared,
    fn sampled_stacks_estimate_sites_and_keep_counts_exact() {
        let doc = trace("sampled", &["--sample-bytes", &RATE.to_string()]);
        assert_eq!(doc["sample_bytes"], RATE);
        assert_eq!(doc["lost"]["stack"], 0);
        assert_eq!(doc["lost"]["size_histogram"], 0);
        assert_eq!(doc["lost"]["live_map"], 0);

        // Exact, sampled or not: per-function calls and bytes, and the size histogram.
        let f = &doc["functions"];
        assert_eq!(f["malloc"]["calls"].as_u64(), Some(N_A + N_B + N_C));
        assert_eq!(
            f["malloc"]["bytes"].as_u64(),
            Some((N_A + N_B) * KIB + N_C * MIB)
        );
        assert_eq!(f["free"]["calls"].as_u64(), Some(N_A + N_C));
        assert_eq!(sized(&doc, "malloc", KIB), N_A + N_B);
        assert_eq!(sized(&doc, "malloc", MIB), N_C);
        // Frees of unsampled blocks miss the live map: not reported as untracked.
        assert!(f["free"]["untracked"].is_null(), "{}", f["free"]);
        assert!(f["free"]["not_in_live_map"].as_u64().unwrap() > N_A / 2);

        // Estimates within five standard deviations of the known numbers.
        for (func, n, size) in [
            ("alloc_a", N_A, KIB),
            ("alloc_b", N_B, KIB),
            ("alloc_c", N_C, MIB),
        ] {
            let (calls, bytes, _) = site(&doc, func);
            let tol = tolerance(n, size);
            assert!(
                (calls - n as f64).abs() <= tol.max(0.5),
                "{func}: estimated {calls} calls of {n} (tolerance {tol:.0})"
            );
            assert!(
                (bytes - (n * size) as f64).abs() <= (tol * size as f64).max(size as f64 / 2.0),
                "{func}: estimated {bytes} bytes of {}",
                n * size
            );
        }
        // The 20,000 blocks of alloc_b were never freed: the leak estimate says so.
        let leaked = doc["leaks"]["bytes"].as_u64().unwrap() as f64;
        assert_eq!(doc["leaks"]["estimated"], true);
        let tol = tolerance(N_B, KIB) * KIB as f64;
        assert!(
            (leaked - (N_B * KIB) as f64).abs() <= tol,
            "leaked {leaked} of {} (tolerance {tol:.0})",
            N_B * KIB
        );
        assert_eq!(doc["live"]["estimated"], true);

        // The samples themselves: a Poisson-binomial count with known mean and variance.
        let samples: u64 = ["alloc_a", "alloc_b", "alloc_c"]
            .iter()
            .map(|f| site(&doc, f).2)
            .sum();
        let mean = (N_A + N_B) as f64 * p(KIB) + N_C as f64 * p(MIB);
        let sd = ((N_A + N_B) as f64 * p(KIB) * (1.0 - p(KIB))).sqrt();
        assert!(
            (samples as f64 - mean).abs() <= 5.0 * sd,
            "{samples} samples, expected {mean:.0} +- {:.0}",
            5.0 * sd
        );

        // Unsampled: every allocation takes a stack walk and a live-map entry.
        let full = trace("unsampled", &[]);
        assert_eq!(full["sample_bytes"], 0);
        let all: u64 = ["alloc_a", "alloc_b", "alloc_c"]
            .iter()
            .map(|f| site(&full, f).2)
            .sum();
        assert_eq!(all, N_A + N_B + N_C);
        assert!(
            samples * 20 < all,
            "{samples} sampled allocations against {all} unsampled"
        );
        assert_eq!(full["functions"]["free"]["untracked"], 0);
    }
);

bpf_test!(
    shared,
    fn a_sampled_recording_says_so_in_every_view() {
        let bin = fixture("sampled", "", &[]);
        let file = json_path("sampled-rec").with_extension("bin");
        let mut cmd = heaptrace();
        cmd.args(["record", "-o"])
            .arg(&file)
            .args(["--no-tui", "-q", "--sample-bytes", &RATE.to_string(), "--"])
            .arg(&bin);
        let out = run_ok(&mut cmd);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("sampling: 1 per 65536 bytes"), "{stderr}");

        let report = |args: &[&str]| {
            let mut c = heaptrace();
            c.arg("report").arg(&file).args(args);
            String::from_utf8(run_ok(&mut c).stdout).unwrap()
        };
        for view in [
            "overview",
            "timeline",
            "hotspots",
            "leaks",
            "peak",
            "histogram",
        ] {
            let text = report(&[view]);
            assert!(
                text.contains("sampling: 1 per 65536 bytes"),
                "{view}: {text}"
            );
        }
        let doc: Value = serde_json::from_str(&report(&["--format", "json"])).unwrap();
        assert_eq!(doc["sample_bytes"], RATE);
        assert_eq!(
            doc["functions"]["malloc"]["calls"].as_u64(),
            Some(N_A + N_B + N_C)
        );
        let (calls, _, _) = site(&doc, "alloc_a");
        assert!((calls - N_A as f64).abs() <= tolerance(N_A, KIB));
        assert_eq!(doc["stacks"][0]["estimated"], true);
    }
);

#[test]
fn sampling_is_refused_where_it_would_mean_nothing() {
    let out = heaptrace()
        .args([
            "--no-tui",
            "--mode",
            "counts",
            "--sample-bytes",
            "4096",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("needs --mode stacks"), "{err}");
    let out = heaptrace()
        .args(["--no-tui", "--sample-bytes", "2000000000000", "--", "true"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("largest sampling rate"), "{err}");
}
