//! The true peak: taken by the kernel at the allocation that reached it, not at a round's end.
use crate::support::*;

const PEAK: u64 = (100 << 20) + 100 * 1000;

bpf_test!(
    fn a_burst_between_two_round_ends_is_the_peak() {
        for mode in ["stacks", "counts"] {
            let json = json_path(&format!("peak-burst-{mode}"));
            let out = run_ok(
                heaptrace()
                    .args(["--no-tui", "--interval", "1s", "--mode", mode, "--json"])
                    .arg(&json)
                    .arg("--")
                    .arg(fixture("burst", "", &[])),
            );
            let stderr = String::from_utf8_lossy(&out.stderr);
            let doc = read_json(&json);
            // Held 20 ms, freed long before the round's end: exactly its bytes.
            assert_eq!(doc["peak"]["live_bytes"].as_u64(), Some(PEAK), "{mode}");
            assert_eq!(doc["peak"]["exact"], true);
            let p = &doc["processes"][0]["peak"];
            assert_eq!(p["live_bytes"].as_u64(), Some(PEAK), "{mode}");
            assert_eq!(p["reached_by"]["size"].as_u64(), Some(100 << 20), "{mode}");
            assert!(stderr.contains("peak live heap: 100.1 MiB"), "{stderr}");
            if mode == "stacks" {
                let frames = &doc["peak"]["reached_by"]["frames"];
                assert_eq!(frames[0]["function"], "main", "{frames}");
                assert_eq!(frames[0]["file"], "burst.c", "{frames}");
            }
        }
    }
);

/// In process each thread adds its live-heap changes in 64 KiB batches: the peak is within
/// 64 KiB of the true one (one thread here), and says it is not exact.
#[test]
fn in_process_the_peak_is_within_a_batch_of_the_true_one() {
    let _g = shared();
    let json = json_path("peak-burst-inproc");
    run_ok(
        heaptrace()
            .args(["--no-tui", "-q", "--in-process", "--json"])
            .arg(&json)
            .arg("--")
            .arg(fixture("burst", "", &[])),
    );
    let doc = read_json(&json);
    let got = doc["peak"]["live_bytes"].as_u64().unwrap();
    assert!(got.abs_diff(PEAK) <= 64 << 10, "{got} against {PEAK}");
    assert_eq!(doc["peak"]["exact"], false);
}
