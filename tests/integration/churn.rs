//! Processes that make many distinct stacks and sites over their lives: the kernel maps hold
//! a working set, not the run (stack ids of idle stacks freed, site and size keys of past
//! rounds read and retired between rounds as the maps fill), and nothing is lost.
use serde_json::Value;

use crate::support::*;

/// Sites whose innermost frame is `function`.
fn sites_at<'a>(doc: &'a Value, function: &str) -> Vec<&'a Value> {
    doc["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["frames"].get(0).and_then(|f| f["function"].as_str()) == Some(function))
        .collect()
}

bpf_test!(
    shared,
    /// A process that makes 3,200 distinct stacks over its life, 200 at a time, into a stack
    /// map of 1,024 ids: the ids of stacks idle for rounds (no live block) are freed and
    /// taken again, so no stack is lost, every stack's count is exact, a stack that comes
    /// back after its id was freed is the same site, and the one holding a block keeps it;
    /// in the live document and in the report of the recording alike.
    fn a_live_process_frees_the_ids_of_its_idle_stacks() {
        let (phases, per) = (16u64, 200u64);
        let rec = json_path("stackchurn").with_extension("bin");
        let live = json_path("stackchurn");
        run_ok(
            heaptrace()
                .args(["record", "-o"])
                .arg(&rec)
                .args(["-q", "--stack-map-size", "1024", "--interval", "100ms"])
                .args(["--json-max-stacks", "10000", "--json"])
                .arg(&live)
                .arg("--")
                .arg(fixture("stackchurn", "", &[]))
                .args([&phases.to_string(), &per.to_string(), "500"]),
        );
        let out = run_ok(
            heaptrace()
                .arg("report")
                .arg(&rec)
                .args(["--format", "json"]),
        );
        let offline: Value = serde_json::from_slice(&out.stdout).unwrap();
        for doc in [read_json(&live), offline] {
            each_stack_once_and_exact(&doc, phases * per);
        }
    }
);

bpf_test!(
    shared,
    /// Rounds far apart (a minute: only the last one at the exit) while a process makes 1,600
    /// site and size keys into maps of 256 each, and 1,600 new stacks into a FRAMES of 1,024:
    /// the maps are read (the keys' past ones retired, the frames archived) between rounds as
    /// they fill, so nothing is lost and every count is exact.
    fn site_size_and_frames_maps_are_relieved_between_long_rounds() {
        let (phases, per) = (16u64, 100u64);
        let json = json_path("stackchurn-relief");
        run_ok(
            heaptrace()
                .args(["-q", "--no-tui", "--interval", "60s"])
                .args(["--site-map-size", "256", "--size-map-size", "256"])
                .args(["--stack-map-size", "2048"])
                .args(["--json-max-stacks", "10000", "--json"])
                .arg(&json)
                .arg("--")
                .arg(fixture("stackchurn", "", &[]))
                .args([&phases.to_string(), &per.to_string(), "300"]),
        );
        let doc = read_json(&json);
        for loss in ["site_map", "size_histogram"] {
            assert_eq!(doc["lost"][loss].as_u64(), Some(0), "{}", doc["lost"]);
        }
        each_stack_once_and_exact(&doc, phases * per);
    }
);

/// `stackchurn`'s stacks in `doc`: none lost, one site each, each with its calls.
fn each_stack_once_and_exact(doc: &Value, stacks: u64) {
    assert_eq!(doc["lost"]["stack"].as_u64(), Some(0), "{}", doc["lost"]);
    let mut by_code = std::collections::BTreeMap::new();
    for s in sites_at(doc, "leaf") {
        let names = function_names(s);
        let digit = |i: usize| -> u64 {
            let n = names.get(i).and_then(|f| f.strip_prefix("step"));
            n.and_then(|d| d.parse().ok())
                .unwrap_or_else(|| panic!("{names:?}"))
        };
        assert_eq!(names.get(4..6), Some(&["walk", "main"][..]), "{names:?}");
        let code = digit(3) << 8 | digit(2) << 4 | digit(1);
        let calls = s["calls"].as_u64().unwrap();
        let live = s["live_blocks"].as_i64().unwrap();
        assert!(
            by_code.insert(code, (calls, live)).is_none(),
            "two sites of stack {code}: {names:?}"
        );
    }
    assert_eq!(by_code.len() as u64, stacks, "one site a stack");
    for (code, (calls, live)) in by_code {
        let want = match code {
            0 => (3, 1),
            1 => (4, 0),
            _ => (2, 0),
        };
        assert_eq!((calls, live), want, "stack {code}");
    }
}
