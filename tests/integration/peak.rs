//! The true peak: taken by the kernel at the allocation that reached it, not at a round's end.
use serde_json::Value;

use crate::support::*;

const PEAK: u64 = (100 << 20) + 100 * 1000;
/// The big block and the 100 small ones.
const BLOCKS: u64 = 101;

/// `by_stack` of a peak: what held it at that moment, the burst's two sites in main: the big
/// block (burst.c:22) and the 100 small ones (burst.c:21), summing to the peak.
fn assert_held_by_the_burst(peak: &Value, what: &str) {
    let by = peak["by_stack"].as_array().expect("by_stack");
    let rows: Vec<(u64, u64, String, String)> = by
        .iter()
        .map(|s| {
            let f = &s["frames"][0];
            (
                s["live_blocks"].as_u64().unwrap(),
                s["live_bytes"].as_u64().unwrap(),
                f["function"].as_str().unwrap_or("").to_string(),
                f["file"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    let main = |b: u64, n: u64| (b, n, "main".to_string(), "burst.c".to_string());
    assert_eq!(
        rows,
        [main(1, 100 << 20), main(100, 100_000)],
        "{what}: {peak}"
    );
    assert_eq!(rows.iter().map(|r| r.1).sum::<u64>(), PEAK, "{what}");
    assert_eq!(peak["live_blocks"].as_u64(), Some(BLOCKS), "{what}: {peak}");
    assert_eq!(peak["by_stack_left_out"]["stacks"], 0, "{what}: {peak}");
}

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
            // Its blocks too, at that moment (not the round end's 0).
            assert_eq!(p["live_blocks"].as_u64(), Some(BLOCKS), "{mode}: {p}");
            assert!(
                stderr.contains("peak live heap: 100.1 MiB in 101 blocks"),
                "{stderr}"
            );
            if mode == "stacks" {
                let frames = &doc["peak"]["reached_by"]["frames"];
                assert_eq!(frames[0]["function"], "main", "{frames}");
                assert_eq!(frames[0]["file"], "burst.c", "{frames}");
                assert_eq!(doc["peak"]["by_stack_at"], "peak");
                assert_held_by_the_burst(&doc["peak"], "peak");
                assert_held_by_the_burst(p, "processes[0].peak");
                assert!(
                    stderr.contains("peak: 100.1 MiB live in 101 blocks, reached in round"),
                    "{stderr}"
                );
            } else {
                // No sites in counts mode: the peak's bytes and blocks, held by no list.
                assert_eq!(doc["peak"]["by_stack"], serde_json::json!([]), "{mode}");
            }
        }
    }
);

bpf_test!(
    fn a_recording_of_the_burst_keeps_what_held_its_peak() {
        let rec = json_path("peak-burst-rec").with_extension("bin");
        run_ok(
            heaptrace()
                .args(["record", "-q", "--interval", "1s", "-o"])
                .arg(&rec)
                .arg("--")
                .arg(fixture("burst", "", &[])),
        );
        let report = |args: &[&str]| {
            let o = heaptrace()
                .arg("report")
                .arg(&rec)
                .args(args)
                .output()
                .unwrap();
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            String::from_utf8_lossy(&o.stdout).into_owned()
        };
        let text = report(&["peak"]);
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[0].starts_with("peak: 100.1 MiB live in 101 blocks, reached in round"),
            "{text}"
        );
        assert!(
            lines[1].contains("100.0 MiB in       1 blocks  malloc <- main (burst.c:22)"),
            "{text}"
        );
        assert!(
            lines[2].contains("97.7 KiB in     100 blocks  malloc <- main (burst.c:21)"),
            "{text}"
        );
        let doc: Value = serde_json::from_str(&report(&["peak", "--format", "json"])).unwrap();
        assert_held_by_the_burst(&doc, "report peak --format json");
        // massif's peak snapshot: the two sites under the allocation functions, as ms_print
        // reads them.
        let massif = json_path("peak-burst-massif").with_extension("massif");
        report(&["--export", "massif", "-o", massif.to_str().unwrap()]);
        let text = std::fs::read_to_string(&massif).unwrap();
        let tree = text
            .split("heap_tree=peak\n")
            .nth(1)
            .expect("a peak snapshot");
        let tree: Vec<&str> = tree.lines().take(10).collect();
        assert_eq!(
            tree[0],
            format!("n2: {PEAK} (heap allocation functions) malloc/new/new[], --alloc-fns, etc."),
            "{text}"
        );
        assert!(
            tree[1].starts_with(" n1: 104857600 ") && tree[1].ends_with(": main (burst.c:22)"),
            "{text}"
        );
        assert!(
            tree.iter()
                .any(|l| l.starts_with(" n1: 100000 ") && l.ends_with(": main (burst.c:21)")),
            "{text}"
        );
    }
);

/// In process each thread adds its live-heap changes in 64 KiB batches: the peak is within
/// 64 KiB of the true one (one thread here), and says it is not exact; so are its sites.
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
    // Held by the burst's sites, as they were when the first release after the high (its
    // batch added) moved the peak's number on: within a batch too.
    let peak = &doc["peak"];
    assert_eq!(peak["by_stack_at"], "peak");
    let by = peak["by_stack"].as_array().unwrap();
    let big = &by[0];
    assert_eq!(big["live_bytes"].as_u64(), Some(100 << 20), "{peak}");
    assert_eq!(big["live_blocks"].as_u64(), Some(1), "{peak}");
    for s in by {
        assert_eq!(s["frames"][0]["function"], "main", "{s}");
        assert_eq!(s["frames"][0]["file"], "burst.c", "{s}");
    }
    let held: u64 = by.iter().map(|s| s["live_bytes"].as_u64().unwrap()).sum();
    assert!(held.abs_diff(got) <= 64 << 10, "{held} against {got}");
}

bpf_test!(
    /// The peak's sites keep their figures of that moment while their counters move on in
    /// later rounds (the 16 KiB site's frees), and after the round of the peak is retired.
    fn the_peak_is_held_by_its_sites_as_they_were_then() {
        let json = json_path("peak-held");
        run_ok(
            heaptrace()
                .args(["--no-tui", "-q", "--interval", "100ms", "--json"])
                .arg(&json)
                .arg("--")
                .arg(fixture("peakheld", "", &[])),
        );
        let doc = read_json(&json);
        const HELD: u64 = 6400 * 16384 + (1 << 20);
        for (what, peak) in [
            ("peak", &doc["peak"]),
            ("process", &doc["processes"][0]["peak"]),
        ] {
            assert_eq!(peak["live_bytes"].as_u64(), Some(HELD), "{what}: {peak}");
            assert_eq!(peak["live_blocks"].as_u64(), Some(6401), "{what}: {peak}");
            let rows: Vec<(u64, u64, u64)> = peak["by_stack"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| {
                    assert_eq!(s["frames"][0]["function"], "main", "{s}");
                    assert_eq!(s["frames"][0]["file"], "peakheld.c", "{s}");
                    let line = s["frames"][0]["line"].as_u64().unwrap();
                    (
                        s["live_blocks"].as_u64().unwrap(),
                        s["live_bytes"].as_u64().unwrap(),
                        line,
                    )
                })
                .collect();
            assert_eq!(rows, [(6400, 6400 * 16384, 20), (1, 1 << 20, 21)], "{what}");
        }
    }
);
