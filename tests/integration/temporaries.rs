//! Temporaries by heaptrack's and memray's rule, exact against tests/fixtures/temporaries.c:
//! a block freed by the thread that allocated it with fewer than `--temporary-allocs` of that
//! thread's allocations in between.
use serde_json::Value;

use crate::support::*;

fn trace(tag: &str, opts: &[&str]) -> Value {
    trace_stacks(tag, "temporaries", opts)
}

/// The fixture's temporaries under both rules, exact; `flags` choose the collector.
pub fn check_temporaries(flags: &[&str]) {
    let doc = trace("temporaries", flags);
    assert_eq!(doc["temporary"]["allocations_between_below"], 1);
    assert_eq!(site(&doc, "once_x", 24), (100, 100, 100));
    assert_eq!(
        site(&doc, "pair_y", 40),
        (100, 100, 0),
        "q allocated in between"
    );
    assert_eq!(site(&doc, "pair_y", 8), (100, 100, 100));
    assert_eq!(
        site(&doc, "grow_z", 56),
        (100, 100, 100),
        "released by realloc"
    );
    assert_eq!(site(&doc, "grow_z", 200), (100, 100, 100));
    assert_eq!(
        site(&doc, "cross_w", 72),
        (10, 10, 0),
        "freed by another thread"
    );
    let total = doc["temporary"]["blocks"].as_u64().unwrap();
    assert_eq!(total, 400, "{}", doc["temporary"]);

    let mut two = flags.to_vec();
    two.extend(["--temporary-allocs", "2"]);
    let doc = trace("temporaries-2", &two);
    assert_eq!(doc["temporary"]["allocations_between_below"], 2);
    assert_eq!(site(&doc, "pair_y", 40), (100, 100, 100));
    assert_eq!(site(&doc, "cross_w", 72), (10, 10, 0));
}

/// (calls, frees, temporary blocks) of the site of `function`'s `size`-byte allocations.
fn site(doc: &Value, function: &str, size: u64) -> (u64, u64, u64) {
    let sites: Vec<&Value> = doc["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| {
            s["frames"][0]["function"] == function
                && s["bytes"] == s["calls"].as_u64().unwrap() * size
        })
        .collect();
    assert_eq!(sites.len(), 1, "{function} {size}: {sites:?}");
    let s = sites[0];
    let n = |v: &Value| v.as_u64().unwrap();
    (n(&s["calls"]), n(&s["frees"]), n(&s["temporary"]["blocks"]))
}

bpf_test!(
    shared,
    fn temporaries_count_the_freeing_threads_allocations_in_between() {
        check_temporaries(&[]);
    }
);

bpf_test!(
    shared,
    /// Lifetimes are measured for the calls timed for latency (one in 16 by default): the
    /// percentiles come from some of the blocks, every count and temporary stays exact.
    fn lifetimes_come_from_the_timed_calls() {
        let every = trace("lifetimes-every", &["--latency-every", "1"]);
        let sampled = trace("lifetimes-sampled", &[]);
        let lifetimes = |doc: &Value| -> u64 {
            doc["stacks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["lifetime"]["count"].as_u64().unwrap_or(0))
                .sum()
        };
        // 510 blocks freed at their sites: once_x 100, pair_y 200, grow_z 200 (malloc's and
        // realloc's), cross_w 10.
        assert_eq!(lifetimes(&every), 510);
        // Gaps uniform over 1..=31: ~32 of 510 timed (and the first call on each CPU), a standard
        // deviation of ~3.
        let n = lifetimes(&sampled);
        assert!((10..=70).contains(&n), "{n} lifetimes of 510 blocks");
        assert_eq!(every["temporary"]["blocks"], sampled["temporary"]["blocks"]);
        assert_eq!(site(&sampled, "once_x", 24), (100, 100, 100));
    }
);
