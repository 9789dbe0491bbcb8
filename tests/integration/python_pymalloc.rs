//! Python's own allocator from outside it: `--python-malloc` counts the objects of 512 bytes
//! or less pymalloc would serve unseen (tests/fixtures/python/small.py), and pymalloc's arenas
//! are named by the Python line whose objects needed them (tests/fixtures/python/arenas.py).
use serde_json::Value;

use crate::{
    python_lines::{innermost_python, launched_with},
    support::*,
};

/// (calls of 128-255 bytes, bytes) of the stacks whose innermost Python frame is `small.py`'s
/// marked line, in `options`' run of the fixture under Debian's 3.11.
fn small_objects(options: &[&str], tag: &str) -> (u64, u64) {
    let script = format!(
        "{}/../tests/fixtures/python/small.py",
        env!("CARGO_MANIFEST_DIR")
    );
    let line = crate::python_code::marked(&script, "small") as u64;
    let doc = launched_with(options, &["/usr/bin/python3.11", &script], tag);
    // bytearray(200)'s buffer: 201 bytes (the object itself is 56).
    let (mut calls, mut bytes) = (0, 0);
    for s in doc["stacks"].as_array().unwrap() {
        let py = innermost_python(s);
        if py.is_some_and(|f| f["function"] == "small" && f["line"] == line) {
            calls += sized_from(s, 128);
            bytes += s["bytes"].as_u64().unwrap();
        }
    }
    (calls, bytes)
}

/// Calls in one stack's size bucket that starts at `from` bytes.
fn sized_from(stack: &Value, from: u64) -> u64 {
    stack["sizes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["from"].as_u64() == Some(from))
        .map(|e| e["count"].as_u64().unwrap_or(0))
        .sum()
}

/// `--python-malloc` counts the objects of 512 bytes or less pymalloc would serve unseen: the
/// 1,000 bytearray buffers of 201 bytes at their line, none without it.
#[test]
fn in_process_python_malloc_counts_small_objects() {
    let _lock = shared();
    let with = small_objects(&["--in-process", "--python-malloc"], "pysmall-inproc");
    let without = small_objects(&["--in-process"], "pysmall-inproc-pymalloc");
    eprintln!("201-byte buffers at the line: with {with:?}, without {without:?}");
    assert!(with.0 >= 950, "with --python-malloc: {with:?}");
    assert_eq!(without.0, 0, "without: {without:?}");
}

bpf_test!(
    shared,
    /// The same under the probes.
    fn python_malloc_counts_small_objects() {
        let with = small_objects(&["--python-malloc"], "pysmall");
        let without = small_objects(&[], "pysmall-pymalloc");
        eprintln!("201-byte buffers at the line: with {with:?}, without {without:?}");
        assert!(with.0 >= 950, "with --python-malloc: {with:?}");
        assert_eq!(without.0, 0, "without: {without:?}");
    }
);

/// (bytes of pymalloc arenas whose innermost Python frame is arenas.py's marked line, bytes
/// of all pymalloc arenas) of a launched run of the fixture under `python`, and the process's
/// `memory.reserved.pymalloc` at its end.
fn arenas(python: &str, tag: &str) -> (u64, u64, u64) {
    let script = format!(
        "{}/../tests/fixtures/python/arenas.py",
        env!("CARGO_MANIFEST_DIR")
    );
    let line = crate::python_code::marked(&script, "arenas") as u64;
    let doc = launched_with(&[], &[python, &script], tag);
    let (mut at_line, mut all) = (0, 0);
    for r in doc["reservations"].as_array().unwrap() {
        if r["kind"] != "pymalloc" {
            continue;
        }
        let bytes = r["bytes"].as_u64().unwrap();
        all += bytes;
        let here = |f: &Value| {
            f["file"]
                .as_str()
                .is_some_and(|p| p.ends_with("/arenas.py"))
        };
        let py = innermost_python(r);
        if py.is_some_and(|f| here(f) && f["function"] == "fill" && f["line"] == line) {
            at_line += bytes;
        }
    }
    let held = doc["processes"][0]["memory"]["reserved"]["pymalloc"].as_u64();
    (at_line, all, held.unwrap())
}

bpf_test!(
    shared,
    /// pymalloc's arenas, which malloc never sees, are reserved at the Python line whose
    /// objects needed them: 150,000 objects of 56 and 201 bytes kept by one line fill some
    /// 39 MiB of 1 MiB arenas, and that line names them (Debian's stripped 3.11, pyenv's 3.13).
    fn pymalloc_arenas_are_named_by_their_python_line() {
        let pyenv = crate::python_code::pythons();
        for python in ["/usr/bin/python3.11", pyenv[3].0.as_str()] {
            let (at_line, all, held) = arenas(python, "pyarenas");
            eprintln!(
                "{python}: {at_line} of {all} arena bytes at the line, {held} held at the end"
            );
            // 150,000 x (64 + 208) bytes in blocks: 38.9 MiB, less what earlier arenas had free.
            assert!(at_line >= 36 << 20, "{python}: {at_line} of {all}");
            assert!(at_line * 10 >= all * 9, "{python}: {at_line} of {all}");
            assert!(
                held >= 1 << 20,
                "{python}: the arenas held at the end: {held}"
            );
        }
    }
);
