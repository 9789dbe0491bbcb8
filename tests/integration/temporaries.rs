//! Temporaries by heaptrack's rule, exact against tests/fixtures/temporaries.c: a block freed
//! by the thread that allocated it with fewer than `--temporary-allocs` of that thread's
//! allocations and frees in between.
use serde_json::Value;

use crate::support::*;

fn trace(tag: &str, opts: &[&str]) -> Value {
    trace_stacks(tag, "temporaries", opts)
}

/// The fixture's temporaries under both rules, exact; `flags` choose the collector.
pub fn check_temporaries(flags: &[&str]) {
    let doc = trace("temporaries", flags);
    assert_eq!(doc["temporary"]["allocations_and_frees_between_below"], 1);
    assert_eq!(site(&doc, "once_x", 24), (100, 100, 100));
    assert_eq!(
        site(&doc, "pair_y", 40),
        (100, 100, 0),
        "q allocated in between"
    );
    assert_eq!(site(&doc, "pair_y", 8), (100, 100, 0), "p freed in between");
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
    // Two sites: the first block's malloc and the loop's.
    let recycled = doc["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["frames"][0]["function"] == "recycle_v")
        .fold((0, 0, 0), |(c, f, t), s| {
            let n = |v: &Value| v.as_u64().unwrap();
            (
                c + n(&s["calls"]),
                f + n(&s["frees"]),
                t + n(&s["temporary"]["blocks"]),
            )
        });
    assert_eq!(recycled, (101, 101, 0), "a newer block in between");
    let total = doc["temporary"]["blocks"].as_u64().unwrap();
    assert_eq!(total, 300, "{}", doc["temporary"]);

    let mut two = flags.to_vec();
    two.extend(["--temporary-allocs", "2"]);
    let doc = trace("temporaries-2", &two);
    assert_eq!(doc["temporary"]["allocations_and_frees_between_below"], 2);
    assert_eq!(site(&doc, "pair_y", 40), (100, 100, 100));
    assert_eq!(site(&doc, "pair_y", 8), (100, 100, 100));
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
        // 611 blocks freed at their sites: once_x 100, pair_y 200, grow_z 200 (malloc's and
        // realloc's), cross_w 10, recycle_v 101.
        assert_eq!(lifetimes(&every), 611);
        // Gaps uniform over 1..=31: ~32 of 510 timed (and the first call on each CPU), a standard
        // deviation of ~3.
        let n = lifetimes(&sampled);
        assert!((12..=85).contains(&n), "{n} lifetimes of 611 blocks");
        assert_eq!(every["temporary"]["blocks"], sampled["temporary"]["blocks"]);
        assert_eq!(site(&sampled, "once_x", 24), (100, 100, 100));
    }
);

bpf_test!(
    shared,
    /// Debian's heaptrack on the same fixture: its temporaries are ours plus exactly the ones
    /// its rule adds (docs/accuracy.md): a free right after an allocation of the same size and
    /// stack (recycle_v: 99), and a block another thread frees right after its allocation, all
    /// threads being one stream to it (cross_w: 10).
    fn temporaries_differ_from_heaptracks_by_its_documented_rule() {
        if !tool_present("heaptrack") {
            assert!(std::env::var_os("CI").is_none(), "heaptrack is missing");
            eprintln!("SKIPPED: no heaptrack (cargo xtask setup installs it)");
            return;
        }
        let ours = trace("temporaries-vs-heaptrack", &[]);
        let ours = ours["temporary"]["blocks"].as_u64().unwrap();
        let bin = fixture("temporaries", "", &[]);
        let out = json_path("temporaries-heaptrack").with_extension("ht");
        let run = std::process::Command::new("heaptrack")
            .arg("-o")
            .arg(&out)
            .arg(&bin)
            .output()
            .unwrap();
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
        // heaptrack adds its compression's extension to the name it is given.
        let data = ["ht.zst", "ht.gz"]
            .map(|ext| out.with_extension(ext))
            .into_iter()
            .find(|p| p.exists())
            .expect("heaptrack's data file");
        let print = std::process::Command::new("heaptrack_print")
            .arg(&data)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&print.stdout);
        let theirs: u64 = text
            .lines()
            .find_map(|l| l.strip_prefix("temporary memory allocations: "))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no temporaries in heaptrack_print's output: {text}"));
        assert_eq!(ours, 300);
        assert_eq!(theirs, ours + 99 + 10, "heaptrack counted {theirs}");
    }
);

/// Whether `cmd` is on the PATH.
fn tool_present(cmd: &str) -> bool {
    std::process::Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .output()
        .is_ok_and(|o| o.status.success())
}
