//! A launched Python script that ends at once after its allocations: `Py_FinalizeEx` frees
//! the code objects its stacks name before it exits, so its exit is too late to read them.
//! The command is held as its finalization begins (docs/python.md): the 300 blocks of
//! tests/fixtures/python/quick.py are named by their line, under Debian's 3.11 and pyenv's
//! 3.13, and run by a shell as its child (a followed fork); a script that handles SIGURG
//! (the signal the hold uses) never sees one.
use std::process::Stdio;

use serde_json::Value;

use crate::support::*;

fn script() -> String {
    format!(
        "{}/../tests/fixtures/python/quick.py",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// Calls of 4 KiB or more whose innermost Python frame is quick.py's marked line, and the
/// script's standard output, in a launched run of `command`.
fn quick(command: &[&str], tag: &str) -> (u64, String) {
    let line = crate::python_code::marked(&script(), "quick") as u64;
    let json = json_path(tag);
    let out = heaptrace()
        .args(["-q", "--no-tui", "--json"])
        .arg(&json)
        .arg("--")
        .args(command)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{command:?}: {stderr}");
    let doc = read_json(&json);
    let mut calls = 0;
    for s in doc["stacks"].as_array().unwrap() {
        let frames = s["frames"].as_array().unwrap();
        let py = frames.iter().find(|f| f["module"] == "[python]");
        let here = |f: &Value| f["file"].as_str().is_some_and(|p| p.ends_with("/quick.py"));
        if py.is_some_and(|f| here(f) && f["line"] == line) {
            calls += sized(s, 4096);
        }
    }
    (calls, String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Calls in a stack's size buckets from `from` bytes up.
fn sized(stack: &Value, from: u64) -> u64 {
    stack["sizes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["from"].as_u64().is_some_and(|f| f >= from))
        .map(|e| e["count"].as_u64().unwrap_or(0))
        .sum()
}

bpf_test!(
    shared,
    fn a_script_that_ends_at_once_names_its_lines() {
        let pyenv = crate::python_code::pythons();
        let script = script();
        for python in ["/usr/bin/python3.11", pyenv[3].0.as_str()] {
            let (calls, _) = quick(&[python, &script], "pyquick");
            eprintln!("{python}: {calls} of 300 blocks at their line");
            assert!(calls >= 285, "{python}: {calls} of 300 at their line");
        }
        // A shell's child (`;`: no exec in its place), a followed fork.
        let run = format!("/usr/bin/python3.11 {script}; true");
        let (calls, _) = quick(&["/bin/sh", "-c", &run], "pyquick-fork");
        eprintln!("as a shell's child: {calls} of 300 blocks at their line");
        assert!(calls >= 285, "as a shell's child: {calls} of 300");
        // Catching SIGURG, it is held by SIGWINCH instead, and runs no handler of its own.
        let catching = ["/usr/bin/python3.11", &script, "catch"];
        let (calls, stdout) = quick(&catching, "pyquick-catch");
        assert!(calls >= 285, "catching SIGURG: {calls} of 300");
        assert!(!stdout.contains("SIGURG"), "its handler ran: {stdout}");
    }
);
