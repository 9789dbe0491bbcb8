//! Sites, sizes and stacks at the default map sizes: the kernel maps hold a round's keys, user
//! space the run's (docs/kernel.md, *Rounds*), so a program that makes more distinct stacks
//! over its run than the maps hold at once, but few a round, loses none.
use serde_json::Value;

use crate::support::*;

/// Traces `rounds DEPTH 3 CHUNK 150` with a 100 ms round and `opts`; asserts that no stack,
/// site or size was lost and that each of its 2^(DEPTH+1) - 1 nodes has its own site with its
/// exact figures (3 calls, 96 bytes, all freed), and each size its count.
fn nothing_lost(tag: &str, depth: u32, chunk: u32, opts: &[&str]) {
    let nodes = (1u64 << (depth + 1)) - 1;
    let json = json_path(tag);
    let mut cmd = heaptrace();
    cmd.args([
        "--no-tui",
        "-q",
        "--interval",
        "100ms",
        "--json-max-stacks",
        "200000",
    ])
    .args(opts)
    .arg("--json")
    .arg(&json)
    .arg("--")
    .arg(fixture("rounds", "", &[]))
    .args([
        depth.to_string(),
        "3".into(),
        chunk.to_string(),
        "150".into(),
    ]);
    run_ok(&mut cmd);
    let doc = read_json(&json);
    for loss in ["stack", "site_map", "size_histogram"] {
        assert_eq!(
            doc["lost"][loss].as_u64(),
            Some(0),
            "{loss}: {}",
            doc["lost"]
        );
    }
    assert_eq!(
        doc["functions"]["malloc"]["calls"].as_u64(),
        Some(3 * nodes)
    );
    let sites: Vec<&Value> = doc["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["frames"][0]["function"] == "alloc_sizes")
        .collect();
    assert_eq!(sites.len() as u64, nodes, "one site a node");
    for s in &sites {
        let got = ["calls", "bytes", "frees", "freed_bytes"].map(|f| s[f].as_u64());
        assert_eq!(got, [Some(3), Some(96), Some(3), Some(96)], "{s}");
    }
    for size in [16, 32, 48] {
        let count: u64 = doc["sizes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["size"] == size && e["function"] == "malloc")
            .map(|e| e["count"].as_u64().unwrap())
            .sum();
        assert_eq!(count, nodes, "size {size}");
    }
}

bpf_test!(
    shared,
    /// At the default sizes but a site map of 20,000: 32,767 nodes, 1,024 every 150 ms. Over
    /// the run, 32,767 stacks (the default was 16,384), 32,767 sites and 98,301 (stack, size)
    /// keys (the size map holds 65,536); a second sees about 6,800 and 20,500 of them, so the
    /// maps hold them even where a loaded machine delays the rounds by a second or so.
    fn more_stacks_over_a_run_than_the_maps_hold_lose_nothing() {
        nothing_lost("rounds", 14, 1024, &["--site-map-size", "20000"]);
    }
);

bpf_test!(
    shared,
    /// FRAMES holds the frames of a round's new stacks only: with `--stack-map-size 12000` it
    /// holds 6,000, and the run's 8,191 stacks (512 every 150 ms) all come whole.
    fn the_frames_of_stacks_are_read_and_dropped_every_round() {
        nothing_lost("rounds-frames", 12, 512, &["--stack-map-size", "12000"]);
    }
);
