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
