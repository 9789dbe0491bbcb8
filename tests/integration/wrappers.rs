//! Sites named past the program's own allocator wrappers (tests/fixtures/wrappers.c): found
//! by detection, named by --hide, and neither with --no-wrapper-detection. Only the naming
//! moves: every stack keeps the wrapper's frame.
use serde_json::Value;

use crate::support::*;

const N: u64 = 1000;

/// Traces the fixture with `opts`: the JSON document and the summary (stderr).
fn trace(tag: &str, opts: &[&str]) -> (Value, String) {
    let bin = fixture("wrappers", "", &[]);
    let (doc, out) = launch(tag, &bin, &[&N.to_string()], opts);
    assert_eq!(doc["lost"]["stack"], 0);
    (doc, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The JSON document's stacks named `site`: (calls, the functions of their first frames).
fn named<'a>(doc: &'a Value, site: &str) -> Vec<&'a Value> {
    doc["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["site"] == site)
        .collect()
}

fn frame_names(stack: &Value) -> Vec<&str> {
    stack["frames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["function"].as_str().unwrap_or(""))
        .collect()
}

/// Each caller `site` of `wrapper` has one stack, of `calls` calls, whose frames are the
/// wrapper's then the caller's, and one summary line naming it past the wrapper.
fn check_named_past(doc: &Value, summary: &str, wrapper: &str, site: &str, calls: u64) {
    let s = named(doc, site);
    assert_eq!(s.len(), 1, "{site}: {s:?}");
    assert_eq!(s[0]["calls"].as_u64(), Some(calls), "{site}");
    assert_eq!(s[0]["function"], "malloc");
    assert_eq!(s[0]["site_frame"].as_u64(), Some(1), "{site}");
    assert_eq!(&frame_names(s[0])[..3], [wrapper, site, "main"], "{site}");
    let line = format!("{calls} calls");
    let label = format!("malloc via {wrapper} <- {site} (wrappers.c:");
    assert!(
        summary
            .lines()
            .any(|l| l.contains(&line) && l.contains(&label)),
        "no line with {line:?} and {label:?}:\n{summary}"
    );
}

bpf_test!(
    shared,
    /// xmalloc, called from six functions and only ever right above malloc, is detected: the
    /// sites are use_1 .. use_6 with their exact counts; my_alloc, with two callers, is not.
    fn sites_are_named_past_a_detected_wrapper() {
        let (doc, summary) = trace("wrappers-detected", &[]);
        for k in 1..=6u64 {
            check_named_past(&doc, &summary, "xmalloc", &format!("use_{k}"), k * N);
        }
        assert!(
            summary.contains("sites named past allocator wrappers: xmalloc (detected)"),
            "{summary}"
        );
        assert_eq!(doc["wrappers"]["detected"], serde_json::json!(["xmalloc"]));
        let mine = named(&doc, "my_alloc");
        let mut calls: Vec<u64> = mine.iter().map(|s| s["calls"].as_u64().unwrap()).collect();
        calls.sort();
        assert_eq!(calls, [N, 2 * N]);
        assert!(mine.iter().all(|s| s["site_frame"] == 0));
        assert!(named(&doc, "xmalloc").is_empty());
    }
);

bpf_test!(
    shared,
    /// --hide names the wrapper detection leaves (two callers); the stacks keep its frame.
    fn hide_names_sites_past_a_wrapper_detection_leaves() {
        let (doc, summary) = trace("wrappers-hide", &["--hide", "^my_alloc$"]);
        check_named_past(&doc, &summary, "my_alloc", "two_a", N);
        check_named_past(&doc, &summary, "my_alloc", "two_b", 2 * N);
        check_named_past(&doc, &summary, "xmalloc", "use_6", 6 * N);
        assert!(summary.contains("my_alloc (--hide)"), "{summary}");
        assert_eq!(doc["wrappers"]["hide"], serde_json::json!(["^my_alloc$"]));
    }
);

bpf_test!(
    shared,
    /// Detection off: the sites are the wrappers again, their counts summed over callers.
    fn no_wrapper_detection_names_sites_by_the_wrapper() {
        let (doc, summary) = trace("wrappers-off", &["--no-wrapper-detection"]);
        let x = named(&doc, "xmalloc");
        assert_eq!(x.len(), 6);
        let calls: u64 = x.iter().map(|s| s["calls"].as_u64().unwrap()).sum();
        assert_eq!(calls, 21 * N);
        assert!(!summary.contains("sites named past"), "{summary}");
        assert!(
            summary.contains("malloc <- xmalloc (wrappers.c:"),
            "{summary}"
        );
    }
);

/// A bad --hide is one line and a usage exit, before anything is attached.
#[test]
fn a_bad_hide_pattern_is_refused() {
    let out = heaptrace()
        .args(["--no-tui", "--hide", "(", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--hide"), "{err}");
    assert!(err.contains("not a regular expression"), "{err}");
}
