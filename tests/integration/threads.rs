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

/// One in-flight slot (`--inflight-map-size 1`: one slot, one map entry): whichever thread owns
/// it, every other thread's record goes to the map, and each thread in turn must find its own.
/// One worker alive at a time, so the map's one entry is enough when the threads give it back.
#[test]
fn threads_whose_slot_is_taken_keep_their_records_in_the_map() {
    if !bpf_or_skip("threads_whose_slot_is_taken_keep_their_records_in_the_map") {
        return;
    }
    let _g = shared();
    let bin = fixture("threadchurn", "", &[]);
    let (threads, calls, size) = (300u64, 3u64, 4321u64);
    let args: Vec<String> = [threads, 1, calls, size]
        .iter()
        .map(u64::to_string)
        .collect();
    let doc = launch(
        "threadslot",
        &["--inflight-map-size", "1"],
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
    // Each block found at its free: its malloc's return found the thread's record.
    let f = &doc["functions"];
    let bytes = threads * calls * size;
    assert_eq!(f["malloc"]["bytes"].as_u64(), Some(bytes), "{f}");
    assert_eq!(f["free"]["bytes"].as_u64(), Some(bytes), "{f}");
}
