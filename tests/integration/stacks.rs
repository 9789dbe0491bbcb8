//! Who allocates: stacks named exactly at known call sites, demangled C++ and Rust, leaks and
//! temporaries per site, bounded memory under exponentially many stacks, and the modes.
use serde_json::Value;

use crate::support::*;

/// Traces a launched fixture; returns the JSON document.
fn trace(tag: &str, bin: &std::path::Path, args: &[&str], opts: &[&str]) -> Value {
    launch(tag, bin, args, opts).0
}

fn fname(frame: &Value) -> &str {
    frame["function"].as_str().unwrap_or("")
}

/// Sites whose innermost frame is `function`.
fn sites_at<'a>(doc: &'a Value, key: &str, function: &str) -> Vec<&'a Value> {
    doc[key]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["frames"].get(0).is_some_and(|f| fname(f) == function))
        .collect()
}

fn sum(sites: &[&Value], field: &str) -> u64 {
    sites.iter().map(|s| s[field].as_u64().unwrap()).sum()
}

/// The line of the SITE_x marker in tests/fixtures/sites.c.
/// A site's requested sizes, power-of-two class (its lower bound) -> count, over `sites`.
fn size_classes(sites: &[&Value]) -> Vec<(u64, u64)> {
    let mut out = std::collections::BTreeMap::new();
    for s in sites {
        for c in s["sizes"].as_array().unwrap() {
            *out.entry(c["from"].as_u64().unwrap()).or_insert(0) += c["count"].as_u64().unwrap();
        }
    }
    out.into_iter().filter(|(_, n)| *n > 0).collect()
}

fn marker_line(marker: &str) -> u64 {
    let src = std::fs::read_to_string(workspace().join("tests/fixtures/sites.c")).unwrap();
    src.lines()
        .position(|l| l.contains(&format!("/* {marker} */")))
        .map(|i| i as u64 + 1)
        .unwrap()
}

const N: u64 = 2000;

fn sites_doc(tag: &str) -> Value {
    sites_doc_with(tag, &[])
}

fn sites_doc_with(tag: &str, opts: &[&str]) -> Value {
    let bin = fixture("sites", "", &[]);
    // Every call timed: every lifetime recorded.
    let mut all = vec!["--latency-every", "1"];
    all.extend_from_slice(opts);
    let doc = trace(tag, &bin, &[&N.to_string()], &all);
    assert_eq!(doc["mode"], "stacks");
    assert_eq!(doc["lost"]["stack"], 0);
    assert_eq!(doc["lost"]["site_map"], 0);
    doc
}

bpf_test!(
    shared,
    fn c_sites_are_named_with_exact_counts_and_lines() {
        check_sites(&sites_doc("sites"));
    }
);

bpf_test!(
    shared,
    /// One site slot and one size slot a CPU (maps of 16, `heaptrace_common::keyed`): one site
    /// counts in the slot, the others in the maps, and a block freed on another CPU than its
    /// allocation counts its free there. Every figure as exact as with room in the slots.
    fn sites_sharing_one_slot_count_exactly() {
        check_sites(&sites_doc_with(
            "sites-slot",
            &["--site-map-size", "16", "--size-map-size", "16"],
        ));
    }
);

fn check_sites(doc: &Value) {
    let a = sites_at(doc, "stacks", "alloc_a");
    assert_eq!(a.len(), 1, "{a:?}");
    assert_eq!(a[0]["function"], "malloc");
    assert_eq!((sum(&a, "calls"), sum(&a, "bytes")), (N, 111 * N));
    assert_eq!(
        a[0]["frames"][0]["line"].as_u64(),
        Some(marker_line("SITE_A"))
    );
    assert_eq!(fname(&a[0]["frames"][1]), "main");
    // Each site's size histogram, folded from the exact one: every call in its class.
    assert_eq!(size_classes(&a), [(64, N)]);
    assert_eq!(
        (sum(&a, "frees"), a[0]["live_blocks"].as_i64()),
        (N, Some(0))
    );
    // Freed at once (no allocation in between): all temporary, and every lifetime recorded.
    assert_eq!(a[0]["temporary"]["blocks"].as_u64(), Some(N));
    assert_eq!(a[0]["lifetime"]["count"].as_u64(), Some(N));

    let b = sites_at(doc, "stacks", "alloc_b");
    assert_eq!(b.len(), 1);
    assert_eq!(b[0]["function"], "calloc");
    assert_eq!((sum(&b, "calls"), sum(&b, "bytes")), (N, 100 * N));
    assert_eq!(size_classes(&b), [(64, N)]);
    assert_eq!(
        b[0]["frames"][0]["line"].as_u64(),
        Some(marker_line("SITE_B"))
    );
    assert_eq!(b[0]["live_blocks"].as_i64(), Some(N as i64));

    let c = sites_at(doc, "stacks", "helper_c");
    assert_eq!(c.len(), 1);
    let frames: Vec<&str> = c[0]["frames"]
        .as_array()
        .unwrap()
        .iter()
        .map(fname)
        .collect();
    assert_eq!(&frames[..3], ["helper_c", "alloc_c", "main"]);
    assert_eq!((sum(&c, "calls"), sum(&c, "bytes")), (N, 333 * N));
    assert_eq!(size_classes(&c), [(256, N)]);
    assert_eq!(
        c[0]["frames"][0]["line"].as_u64(),
        Some(marker_line("SITE_C"))
    );
    assert_eq!(
        c[0]["temporary"]["blocks"], 0,
        "freed after the thread's other allocations"
    );

    let d = sites_at(doc, "stacks", "leak_d");
    assert!(d.iter().all(|s| s["function"] == "realloc"), "{d:?}");
    assert_eq!((sum(&d, "calls"), sum(&d, "bytes")), (3, 3 * 444));
    assert_eq!(size_classes(&d), [(256, 3)]);
    assert_eq!(
        d[0]["frames"][0]["line"].as_u64(),
        Some(marker_line("SITE_D"))
    );
}

bpf_test!(
    shared,
    /// The kernel's frame-pointer walk from malloc's entry misses its caller (glibc's malloc does
    /// not start with push %rbp); heaptrace's stacks must start at the function that called malloc.
    fn immediate_caller_of_malloc_is_the_first_frame() {
        let doc = sites_doc("caller");
        for (caller, marker) in [
            ("alloc_a", "SITE_A"),
            ("alloc_b", "SITE_B"),
            ("helper_c", "SITE_C"),
        ] {
            let s = sites_at(&doc, "stacks", caller);
            assert_eq!(s.len(), 1, "{caller} is not the first frame of one site");
            assert_eq!(
                s[0]["frames"][0]["line"].as_u64(),
                Some(marker_line(marker))
            );
            assert!(
                s[0]["frames"][0]["module"]
                    .as_str()
                    .unwrap()
                    .starts_with("sites")
            );
        }
    }
);

bpf_test!(
    shared,
    fn leaks_are_reported_exactly_by_site() {
        let doc = sites_doc("leaks");
        let leaks = &doc["leaks"];
        assert_eq!(leaks["blocks"].as_u64(), Some(N + 3));
        assert_eq!(leaks["bytes"].as_u64(), Some(100 * N + 3 * 444));
        let b = sites_at(leaks, "by_stack", "alloc_b");
        assert_eq!(
            (b.len(), sum(&b, "blocks"), sum(&b, "bytes")),
            (1, N, 100 * N)
        );
        assert_eq!(b[0]["function"], "calloc");
        let d = sites_at(leaks, "by_stack", "leak_d");
        assert_eq!((sum(&d, "blocks"), sum(&d, "bytes")), (3, 3 * 444));
        assert!(d.iter().all(|s| s["function"] == "realloc"));
        assert_eq!(
            leaks["by_stack"].as_array().unwrap().len(),
            b.len() + d.len()
        );
        // The peak was held by the long-lived and the leaked blocks, never by alloc_a's.
        let peak = &doc["peak"];
        assert!(peak["live_bytes"].as_i64().unwrap() >= (100 * N + 3 * 444) as i64);
        assert!(sites_at(peak, "by_stack", "alloc_a").is_empty());
    }
);

bpf_test!(
    shared,
    fn stack_depth_limits_the_frames_kept() {
        let bin = fixture("sites", "", &[]);
        let doc = trace("depth", &bin, &["100"], &["--stack-depth", "2"]);
        let c = sites_at(&doc, "stacks", "helper_c");
        let frames: Vec<&str> = c[0]["frames"]
            .as_array()
            .unwrap()
            .iter()
            .map(fname)
            .collect();
        assert_eq!(frames, ["helper_c", "alloc_c"]);
    }
);

bpf_test!(
    shared,
    /// Stacks that differ only past the frames kept are one site: `recurse 6` allocates once in
    /// each of its 127 calls of `node`, each with a stack of its own; two frames keep three: the
    /// root's call from main, and the left and right calls' 63 each.
    fn stacks_the_same_within_the_depth_kept_are_one_site() {
        let doc = trace(
            "depth-merge",
            &fixture("recurse", "", &[]),
            &["6"],
            &["--stack-depth", "2"],
        );
        assert_eq!(doc["functions"]["malloc"]["calls"].as_u64(), Some(127));
        let sites = sites_at(&doc, "stacks", "node");
        let mut by_caller: Vec<(String, u64)> = sites
            .iter()
            .map(|s| {
                let f = &s["frames"][1];
                (
                    format!("{}:{}", fname(f), f["line"]),
                    s["calls"].as_u64().unwrap(),
                )
            })
            .collect();
        by_caller.sort();
        // The kernel may lose a stack in a hash collision (counted, and shown as a site of its
        // own).
        let lost = doc["lost"]["stack"].as_u64().unwrap();
        let calls: Vec<u64> = by_caller.iter().map(|c| c.1).collect();
        assert_eq!(calls.iter().sum::<u64>() + lost, 127, "{by_caller:?}");
        assert_eq!(by_caller.len(), 3, "one site per caller: {by_caller:?}");
        assert_eq!(
            by_caller[0].0.split(':').next(),
            Some("main"),
            "{by_caller:?}"
        );
        if lost == 0 {
            assert_eq!(calls, [1, 63, 63], "{by_caller:?}");
        }
    }
);

bpf_test!(
    shared,
    /// The programs' own walk (not the kernel's) goes as deep as a stack map keeps, 127 frames,
    /// and ends at the outermost frame: `deepstack 200 50` mallocs at the bottom of 201 calls of
    /// `down` (its innermost 127 kept) and of 51 (all of them, then main).
    fn the_walk_keeps_127_frames_and_ends_past_main() {
        let doc = trace("deep", &fixture("deepstack", "", &[]), &["200", "50"], &[]);
        let names = |bytes: u64| -> Vec<String> {
            let sites = sites_at(&doc, "stacks", "down");
            let site = sites
                .iter()
                .find(|s| s["bytes"] == bytes)
                .unwrap_or_else(|| panic!("no site of {bytes} bytes: {sites:?}"));
            assert_eq!(site["calls"], 1);
            site["frames"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| fname(f).to_string())
                .collect()
        };
        let deep = names(100);
        assert_eq!(deep.len(), 127, "{deep:?}");
        assert!(deep.iter().all(|f| f == "down"), "{deep:?}");
        let shallow = names(200);
        let downs = shallow.iter().take_while(|f| *f == "down").count();
        assert_eq!(downs, 51, "{shallow:?}");
        assert_eq!(shallow[51], "main", "{shallow:?}");
        assert_eq!(doc["lost"]["stack"], 0);
    }
);

bpf_test!(
    shared,
    /// A frame-pointer walk that went on through data (code without frame pointers) ends where it
    /// left the code: `strayframe`'s two mallocs come through the same two functions, then the
    /// walk reads a data address and a string as return addresses. One site, two frames.
    fn a_walk_that_leaves_the_code_is_cut_there() {
        let doc = trace("stray", &fixture("strayframe", "", &[]), &[], &[]);
        let sites = sites_at(&doc, "stacks", "alloc_fp");
        let shown: Vec<(Vec<&str>, u64)> = sites
            .iter()
            .map(|s| {
                let frames = s["frames"].as_array().unwrap().iter().map(fname).collect();
                (frames, s["calls"].as_u64().unwrap())
            })
            .collect();
        assert_eq!(shown, [(vec!["alloc_fp", "through_data"], 2)]);
        assert_eq!(doc["leaks"]["blocks"], 2);
    }
);

bpf_test!(
    shared,
    fn cpp_template_sites_are_demangled() {
        let doc = trace("cpp", &cpp_fixture("templates"), &[], &[]);
        let find = |needle: &str| -> Vec<&Value> {
            doc["stacks"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|s| fname(&s["frames"][0]).contains(needle))
                .collect()
        };
        let w = find("Pool<Widget>::make_raw");
        assert_eq!(
            (w.len(), sum(&w, "calls"), sum(&w, "bytes")),
            (1, 500, 500 * 96)
        );
        let d = find("Pool<double>::make_raw");
        assert_eq!(
            (d.len(), sum(&d, "calls"), sum(&d, "bytes")),
            (1, 300, 300 * 24)
        );
        assert!(
            !fname(&w[0]["frames"][0]).starts_with("_Z"),
            "not demangled"
        );
        assert_eq!(fname(&w[0]["frames"][1]), "main");
    }
);

fn rust_demangled(mangling: &str) {
    let _g = shared();
    let bin = rust_fixture("rustalloc", mangling);
    let doc = trace(&format!("rust-{mangling}"), &bin, &[], &[]);
    let site: Vec<&Value> = doc["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| {
            s["frames"]
                .as_array()
                .unwrap()
                .iter()
                .any(|f| fname(f) == "fixture::rust_alloc_site")
        })
        .collect();
    assert_eq!(site.len(), 1, "{}", doc["stacks"]);
    assert_eq!(
        (sum(&site, "calls"), sum(&site, "bytes")),
        (400, 400 * 1234)
    );
    assert_eq!(site[0]["live_blocks"].as_i64(), Some(400));
}

bpf_test!(
    fn rust_v0_symbols_are_demangled() {
        rust_demangled("v0");
    }
);

bpf_test!(
    fn rust_legacy_symbols_are_demangled() {
        rust_demangled("legacy");
    }
);

bpf_test!(
    shared,
    /// 2^15 - 1 allocations with as many distinct stacks, into a stack map of 1024: memory stays
    /// bounded by the maps, every call is still counted, and the lost stacks are reported. Each
    /// allocation whose whole stack was lost keeps its caller: `node`, then a frame saying more
    /// were lost.
    fn unique_stack_recursion_stays_bounded_and_reports_losses() {
        let depth = 14;
        let calls = (1u64 << (depth + 1)) - 1;
        let bin = fixture("recurse", "", &[]);
        let doc = trace(
            "recurse",
            &bin,
            &[&depth.to_string()],
            &["--stack-map-size", "1024"],
        );
        assert_eq!(doc["functions"]["malloc"]["calls"].as_u64(), Some(calls));
        let stacks = doc["stacks"].as_array().unwrap();
        let names = |s: &Value| -> Vec<String> {
            s["frames"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| fname(f).to_string())
                .collect()
        };
        let partial = |s: &&Value| {
            names(s)
                .last()
                .is_some_and(|f| f.starts_with("[more frames"))
        };
        let whole = stacks
            .iter()
            .filter(|s| s["stack_id"].as_i64() >= Some(0) && !partial(s))
            .count();
        assert!(whole <= 1024, "{whole} stacks from a map of 1024");
        let callers: Vec<&Value> = stacks.iter().filter(partial).collect();
        assert_eq!(callers.len(), 1, "one caller: {callers:?}");
        assert_eq!(
            names(callers[0]),
            [
                "node",
                "[more frames lost: no room in the stack maps; raise --stack-map-size]"
            ]
        );
        let lost: u64 = stacks
            .iter()
            .filter(|s| s["stack_id"].as_i64() < Some(0) || partial(s))
            .map(|s| s["calls"].as_u64().unwrap())
            .sum();
        assert!(lost > calls / 2, "{lost} of {calls} lost");
        assert_eq!(doc["lost"]["stack"].as_u64(), Some(lost));
        let all: u64 = stacks.iter().map(|s| s["calls"].as_u64().unwrap()).sum();
        assert_eq!(all, calls, "every call is in some site, stored or lost");
    }
);

bpf_test!(
    shared,
    /// With no room left even for a caller (stack maps of one stack each), an allocation is counted
    /// under its process's "stack lost" site, which says why.
    fn with_no_room_for_a_caller_the_stack_is_lost_whole() {
        // Four allocating lines: two whole stacks and one caller fit.
        let doc = trace(
            "sites-tiny",
            &fixture("sites", "", &[]),
            &["10"],
            &["--stack-map-size", "2"],
        );
        let stacks = doc["stacks"].as_array().unwrap();
        let lost: Vec<&Value> = stacks
            .iter()
            .filter(|s| s["stack_id"].as_i64() < Some(0))
            .collect();
        assert!(!lost.is_empty(), "{stacks:?}");
        let why = fname(&lost[0]["frames"][0]);
        assert!(why.starts_with("[stack lost: no room"), "{why}");
        assert!(why.contains("--stack-map-size"), "{why}");
        let all: u64 = stacks.iter().map(|s| s["calls"].as_u64().unwrap()).sum();
        assert_eq!(all, 33, "every call is in some site, stored or lost");
    }
);

bpf_test!(
    shared,
    fn counts_and_sizes_modes_collect_no_stacks() {
        let bin = fixture("sites", "", &[]);
        let counts = trace("mode-counts", &bin, &["500"], &["--mode", "counts"]);
        let sizes = trace(
            "mode-sizes",
            &bin,
            &["500"],
            &["--mode", "sizes", "--latency-every", "1"],
        );
        for doc in [&counts, &sizes] {
            assert_eq!(doc["stacks"], serde_json::json!([]));
            assert_eq!(doc["functions"]["malloc"]["calls"].as_u64(), Some(1000));
            assert_eq!(doc["functions"]["calloc"]["calls"].as_u64(), Some(500));
            assert_eq!(doc["functions"]["realloc"]["calls"].as_u64(), Some(3));
            assert_eq!(doc["leaks"]["blocks"].as_u64(), Some(503));
            assert_eq!(doc["leaks"]["by_stack"], serde_json::json!([]));
        }
        assert_eq!(counts["mode"], "counts");
        assert_eq!(counts["sizes"], serde_json::json!([]));
        assert_eq!(counts["latency"], serde_json::json!({}));
        assert_eq!(sizes["mode"], "sizes");
        assert_eq!(sizes["latency_every"], 1);
        assert_eq!(sizes["latency"]["malloc"]["count"].as_u64(), Some(1000));
        let s111 = sizes["sizes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["size"] == 111)
            .unwrap();
        assert_eq!(s111["count"], 500);
    }
);

bpf_test!(
    shared,
    /// By default one call in 16, at random, is timed: the latency percentiles come from about a
    /// sixteenth of the calls, and every count stays exact.
    fn latency_times_one_call_in_n() {
        let bin = fixture("sites", "", &[]);
        let doc = trace("latency-every", &bin, &["500"], &["--mode", "sizes"]);
        assert_eq!(doc["latency_every"], 16);
        assert_eq!(doc["functions"]["malloc"]["calls"].as_u64(), Some(1000));
        assert_eq!(doc["functions"]["calloc"]["calls"].as_u64(), Some(500));
        assert_eq!(doc["functions"]["realloc"]["calls"].as_u64(), Some(3));
        let timed: u64 = ["malloc", "calloc", "realloc"]
            .iter()
            .map(|f| doc["latency"][f]["count"].as_u64().unwrap_or(0))
            .sum();
        // 1,503 calls, gaps drawn uniform over 1..=31: ~94 timed (the first call on each CPU is
        // timed too), a standard deviation of ~5.
        assert!((50..=160).contains(&timed), "{timed} calls of 1503 timed");
        let malloc = doc["latency"]["malloc"]["count"].as_u64().unwrap_or(0);
        assert!(
            (25..=120).contains(&malloc),
            "{malloc} mallocs of 1000 timed"
        );
    }
);
