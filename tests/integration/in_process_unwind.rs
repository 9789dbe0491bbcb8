//! Stacks counted in process (`--in-process`) through code without frame pointers: the
//! preloaded library's walker unwinds from the same tables the kernel path's does, kept in the
//! region (docs/unwinding.md), and its stacks are the kernel path's, frame for frame.
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::{
    support::*,
    unwinding::{expected, names, sites, unwinddeep},
};

fn trace(tag: &str, bin: &Path, in_process: bool, opts: &[&str]) -> Value {
    let json = json_path(tag);
    let mut cmd = heaptrace();
    if in_process {
        cmd.arg("--in-process");
    }
    cmd.args(["--no-tui", "-q"])
        .args(opts)
        .arg("--json")
        .arg(&json)
        .arg("--")
        .arg(bin);
    run_ok(&mut cmd);
    read_json(&json)
}

/// tests/fixtures/unwindqsort.c, -O2 without frame pointers: a comparator that allocates,
/// called back from libc's qsort.
fn unwindqsort() -> PathBuf {
    fixture("unwindqsort", "-O2-nofp", &["-O2", "-fomit-frame-pointer"])
}

/// Each malloc site: (bytes, calls, function names, modules).
fn frames(doc: &Value) -> Vec<(u64, u64, Vec<String>, Vec<String>)> {
    let mut out: Vec<_> = doc["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["function"] == "malloc")
        .map(|s| {
            let modules = s["frames"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| f["module"].as_str().unwrap_or("").to_string())
                .collect();
            (
                s["bytes"].as_u64().unwrap(),
                s["calls"].as_u64().unwrap(),
                names(s),
                modules,
            )
        })
        .collect();
    out.sort();
    out
}

fn no_cuts(doc: &Value) {
    for loss in ["unwind_no_rule", "unwind_table", "stack_depth", "stack"] {
        assert_eq!(doc["lost"][loss], 0, "{loss}: {}", doc["lost"]);
    }
}

/// Program and library -O2 -fomit-frame-pointer: each site's stack is whole to main, as the
/// kernel path's (`unwinding::stacks_without_frame_pointers_reach_main_with_exact_counts`),
/// and ends at `_start`.
#[test]
fn in_process_stacks_without_frame_pointers_reach_main() {
    let doc = trace("ipunwind-deep", &unwinddeep(false, false), true, &[]);
    let got = sites(&doc);
    let shown: Vec<_> = got.iter().map(|(b, c, f, _)| (*b, *c, f.clone())).collect();
    assert_eq!(
        shown,
        vec![
            (1600, 100, expected(0)),
            (6400, 200, expected(2)),
            (14400, 300, expected(4)),
        ],
        "{got:?}"
    );
    for (_, _, _, rest) in &got {
        assert_eq!(rest.last().map(String::as_str), Some("_start"), "{rest:?}");
    }
    no_cuts(&doc);
}

/// Through libc's own frames (qsort calling back the comparator): malloc <- compare <- libc
/// <- sort_pair <- main <- libc <- _start. With `--unwind-table-size 0` the same stack stops
/// at the comparator, its counts still exact.
#[test]
fn in_process_stacks_go_through_the_c_library() {
    let bin = unwindqsort();
    let doc = trace("ipunwind-qsort", &bin, true, &[]);
    let got = frames(&doc);
    assert_eq!(got.len(), 1, "{got:?}");
    let (bytes, calls, f, m) = &got[0];
    assert_eq!((*bytes, *calls), (2400, 100));
    assert_eq!(f[0], "compare", "{f:?}");
    let sort = f.iter().position(|n| n == "sort_pair").expect("sort_pair");
    assert!(
        sort > 1 && m[1..sort].iter().all(|m| m == "libc.so.6"),
        "{f:?} {m:?}"
    );
    assert_eq!(f[sort + 1], "main", "{f:?}");
    assert_eq!(f.last().map(String::as_str), Some("_start"), "{f:?}");
    no_cuts(&doc);

    let doc = trace(
        "ipunwind-qsort-off",
        &bin,
        true,
        &["--unwind-table-size", "0"],
    );
    let got = frames(&doc);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!((got[0].0, got[0].1), (2400, 100));
    assert!(!got[0].2.contains(&"main".to_string()), "{got:?}");
}

bpf_test!(
    shared,
    /// The same fixtures traced by the kernel's probes and in process: the same sites, each
    /// with the same frames.
    fn in_process_and_kernel_stacks_agree() {
        for (tag, bin) in [("deep", unwinddeep(false, false)), ("qsort", unwindqsort())] {
            let kernel = trace(&format!("ipunwind-k-{tag}"), &bin, false, &[]);
            let inproc = trace(&format!("ipunwind-i-{tag}"), &bin, true, &[]);
            assert_eq!(frames(&inproc), frames(&kernel), "{tag}");
        }
    }
);
