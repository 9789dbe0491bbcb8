//! A live map (or in-process live table) too small for the program: the blocks it could not
//! take are counted as lost and left out of the live figures, the process's and each site's,
//! which still equal its contents at the end, and the per-function counts stay exact.
use crate::{
    counts::{DTV, allocs, args},
    expect::{Expected, Fixture},
    support::*,
};

bpf_test!(
    shared,
    /// With byte sampling the live figures are the sites' estimates: they used to keep every
    /// refused block (2252 live blocks against 64 in the map here), since its free is never
    /// told to be the site's.
    fn a_full_live_map_leaves_the_live_figures_equal_to_its_contents() {
        full_live_map(&[]);
    }
);

/// In process: a live table of 64 slots.
#[test]
fn a_full_in_process_live_table_leaves_the_live_figures_equal_to_its_contents() {
    let _g = shared();
    full_live_map(&["--in-process"]);
}

/// The allocs fixture with `--live-map-size 64` in counts and stacks modes (and, on the
/// kernel path, sampled), with `collector` flags.
fn full_live_map(collector: &[&str]) {
    let fx = Fixture {
        threads: 2,
        iterations: 2000,
        leaks: 100,
        memalign_apart: false,
        no_pvalloc: false,
    };
    let want = Expected::of(&fx).with_glibc_threads(fx.threads, DTV);
    let mut runs = vec![&["--mode", "counts"][..], &["--mode", "stacks"]];
    if collector.is_empty() {
        runs.push(&["--mode", "stacks", "--sample-bytes", "1"]);
    }
    for flags in runs {
        let json = json_path(&format!("fullmap{}{}", collector.concat(), flags.concat()));
        let mut cmd = heaptrace();
        cmd.args(["--no-tui", "-q", "--live-map-size", "64", "--json"])
            .arg(&json)
            .args(flags)
            .args(collector)
            .arg("--")
            .arg(allocs())
            .args(args(&fx, &[]));
        run_ok(&mut cmd);
        let doc = read_json(&json);
        assert!(
            doc["lost"]["live_map"].as_u64().unwrap() > 0,
            "{flags:?}: {}",
            doc["lost"]
        );
        let (live, leaks) = (&doc["live"], &doc["leaks"]);
        // The map's 64 blocks and the slots before it (a sixteenth of the size, 4 here);
        // in process, a table of 64.
        let room = 64 + u64::from(heaptrace_common::live::slots(64));
        assert!(
            leaks["blocks"].as_u64().unwrap() <= room,
            "{flags:?}: {leaks}"
        );
        assert_eq!(live["blocks"], leaks["blocks"], "{flags:?}");
        assert_eq!(live["bytes"], leaks["bytes"], "{flags:?}");
        if flags.contains(&"stacks") {
            let sites = doc["stacks"].as_array().unwrap();
            let sum = |k: &str| sites.iter().map(|s| s[k].as_i64().unwrap()).sum::<i64>();
            assert_eq!(
                Some(sum("live_blocks")),
                live["blocks"].as_i64(),
                "{flags:?}"
            );
            assert_eq!(Some(sum("live_bytes")), live["bytes"].as_i64(), "{flags:?}");
        }
        let f = &doc["functions"];
        for (name, w) in &want.funcs {
            assert_eq!(
                f[*name]["calls"].as_u64(),
                Some(w.calls),
                "{flags:?} {name}"
            );
        }
        assert_eq!(
            f["free"]["calls"].as_u64(),
            Some(want.free_calls),
            "{flags:?}"
        );
    }
}

/// `manyblocks hold N` traced with `flags`: the JSON document and the summary (stderr).
fn hold(tag: &str, n: u64, flags: &[&str]) -> (serde_json::Value, String) {
    let json = json_path(tag);
    let out = run_ok(
        heaptrace()
            .args(["--no-tui", "--json"])
            .arg(&json)
            .args(flags)
            .arg("--")
            .arg(fixture("manyblocks", "", &[]))
            .args(["hold", &n.to_string()]),
    );
    (
        read_json(&json),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// More live blocks than a small live map holds: the live and peak figures leave the
/// blocks out, and say they are lower bounds, in JSON and on the summary's lines, with the
/// flag that would have avoided it.
fn more_blocks_than_the_map(collector: &[&str]) {
    const N: u64 = 20_000;
    let mut flags = vec!["--mode", "counts", "--live-map-size", "1024"];
    flags.extend(collector);
    let (doc, text) = hold(&format!("smallmap{}", collector.concat()), N, &flags);
    assert!(
        doc["lost"]["live_map"].as_u64().unwrap() > 0,
        "{}",
        doc["lost"]
    );
    for figure in [&doc["live"], &doc["peak"]] {
        assert_eq!(figure["lower_bound"], true, "{figure}");
        assert_eq!(figure["estimated"], true, "{figure}");
    }
    assert!(doc["live"]["blocks"].as_u64().unwrap() < N);
    let line = |start: &str| {
        text.lines()
            .find(|l| l.starts_with(start))
            .unwrap_or_else(|| panic!("no {start:?} line: {text}"))
            .to_string()
    };
    let (total, peak) = (line("total: "), line("peak live heap: "));
    assert!(total.contains("live at least "), "{total}");
    assert!(peak.starts_with("peak live heap: at least "), "{peak}");
    for l in [total, peak] {
        assert!(l.contains("raise --live-map-size"), "{l}");
    }
}

/// ~3 million small blocks held to the end at the default sizes: none lost, and the live
/// and peak figures exactly the fixture's, not marked lower bounds.
fn three_million_blocks(collector: &[&str]) {
    const N: u64 = 3_000_000;
    let mut flags = vec!["--mode", "counts"];
    flags.extend(collector);
    let (doc, text) = hold(&format!("threemillion{}", collector.concat()), N, &flags);
    assert_eq!(doc["lost"]["live_map"], 0, "{}", doc["lost"]);
    let live = &doc["live"];
    assert_eq!(live["blocks"].as_u64(), Some(N), "{live}");
    assert_eq!(live["bytes"].as_u64(), Some(24 * N), "{live}");
    assert_eq!(live["lower_bound"], false);
    assert_eq!(doc["peak"]["lower_bound"], false);
    assert!(doc["peak"]["live_blocks"].as_u64().unwrap() >= N);
    assert!(doc["peak"]["live_bytes"].as_u64().unwrap() >= 24 * N);
    assert!(!text.contains("at least"), "{text}");
}

bpf_test!(
    shared,
    fn more_live_blocks_than_the_map_make_lower_bounds_said_so() {
        more_blocks_than_the_map(&[]);
    }
);

bpf_test!(
    shared,
    fn three_million_live_blocks_fit_at_the_default_sizes() {
        three_million_blocks(&[]);
    }
);

#[test]
fn in_process_more_live_blocks_than_the_table_make_lower_bounds_said_so() {
    let _g = shared();
    more_blocks_than_the_map(&["--in-process"]);
}

#[test]
fn in_process_three_million_live_blocks_fit_at_the_default_sizes() {
    let _g = shared();
    three_million_blocks(&["--in-process"]);
}
