//! Thread churn: every thread that calls the allocator gets an in-flight record in a bounded
//! kernel map, and the kernel gives it back when the thread exits.
use crate::{counts::launch, support::*};

#[test]
fn exited_threads_give_back_their_in_flight_records() {
    if !bpf_or_skip("exited_threads_give_back_their_in_flight_records") {
        return;
    }
    let _g = shared();
    let bin = fixture("threadchurn", "", &[]);
    let (threads, calls, size) = (5000u64, 3u64, 4321u64);
    // 8 threads alive at a time through a 64-entry map: it would be full after 64 threads
    // (the daemon's purge runs once a round), and every later call lost.
    let args: Vec<String> = [threads, 8, calls, size]
        .iter()
        .map(u64::to_string)
        .collect();
    // `launch` checks that no in-flight record was lost.
    let doc = launch(
        "threadchurn",
        &["--inflight-map-size", "64"],
        &bin,
        &args,
        &[],
    );
    let counted: Vec<u64> = doc["sizes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["function"] == "malloc" && s["size"] == size)
        .map(|s| s["count"].as_u64().unwrap())
        .collect();
    assert_eq!(counted, vec![threads * calls], "{}", doc["sizes"]);
}
