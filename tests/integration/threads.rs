//! Thread churn: every thread that calls the allocator gets an in-flight record in a bounded
//! kernel map, and the kernel gives it back when the thread exits.
use serde_json::Value;

use crate::{counts::launch, support::*};

/// `threadchurn THREADS BATCH CALLS SIZE` launched under heaptrace with `flags`; the JSON
/// document, after checking that every one of its THREADS x CALLS malloc(SIZE) was counted.
/// (`launch` checks that no in-flight record was lost.)
fn churn(tag: &str, flags: &[&str], threads: u64, batch: u64, calls: u64, size: u64) -> Value {
    let bin = fixture("threadchurn", "", &[]);
    let args: Vec<String> = [threads, batch, calls, size]
        .iter()
        .map(u64::to_string)
        .collect();
    let doc = launch(tag, flags, &bin, &args, &[]);
    let counted: Vec<u64> = doc["sizes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["function"] == "malloc" && s["size"] == size)
        .map(|s| s["count"].as_u64().unwrap())
        .collect();
    assert_eq!(counted, vec![threads * calls], "{}", doc["sizes"]);
    doc
}

bpf_test!(
    shared,
    fn exited_threads_give_back_their_in_flight_records() {
        // 8 threads alive at a time through a 64-entry map: it would be full after 64 threads
        // (the daemon's purge runs once a round), and every later call lost.
        churn(
            "threadchurn",
            &["--inflight-map-size", "64"],
            5000,
            8,
            3,
            4321,
        );
    }
);

bpf_test!(
    shared,
    /// One in-flight slot (`--inflight-map-size 1`: one slot, one map entry): whichever thread owns
    /// it, every other thread's record goes to the map, and each thread in turn must find its own.
    /// One worker alive at a time, so the map's one entry is enough when the threads give it back.
    fn threads_whose_slot_is_taken_keep_their_records_in_the_map() {
        let (threads, calls, size) = (300u64, 3u64, 4321u64);
        let doc = churn(
            "threadslot",
            &["--inflight-map-size", "1"],
            threads,
            1,
            calls,
            size,
        );
        // Each block found at its free: its malloc's return found the thread's record.
        let f = &doc["functions"];
        let bytes = threads * calls * size;
        assert_eq!(f["malloc"]["bytes"].as_u64(), Some(bytes), "{f}");
        assert_eq!(f["free"]["bytes"].as_u64(), Some(bytes), "{f}");
    }
);
