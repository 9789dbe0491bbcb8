//! Sites, sizes and stacks at the default map sizes: the kernel maps hold a round's keys, user
//! space the run's (docs/kernel.md, *Rounds*), so a program that makes more distinct stacks
//! over its run than the maps hold at once, but few a round, loses none.
use serde_json::Value;

use crate::support::*;

bpf_test!(
    shared,
    /// `rounds 14 3 2048 150`: 32,767 calls of `node`, each with a stack of its own, each
    /// allocating and freeing 16, 32 and 48 bytes at one call site in `alloc_sizes`, 2,048 nodes
    /// every 150 ms. Over the run: 32,767 sites (the site map holds 24,576) and 98,301
    /// (stack, size) keys (the size map holds 65,536); a 100 ms round sees at most about 4,096
    /// and 12,288 of them.
    fn more_stacks_over_a_run_than_the_maps_hold_lose_nothing() {
        let nodes = (1u64 << 15) - 1;
        let json = json_path("rounds");
        let mut cmd = heaptrace();
        cmd.args([
            "--no-tui",
            "-q",
            "--interval",
            "100ms",
            "--json-max-stacks",
            "100000",
        ])
        .arg("--json")
        .arg(&json)
        .arg("--")
        .arg(fixture("rounds", "", &[]))
        .args(["14", "3", "2048", "150"]);
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
);
