//! A launched Python script that ends at once after its allocations: `Py_FinalizeEx` frees
//! the code objects its stacks name before it exits, so its exit is too late to read them.
//! The command is held as its finalization begins (docs/python.md): the 300 blocks of
//! tests/fixtures/python/quick.py are named by their line, under Debian's 3.11 and pyenv's
//! 3.13, and run by a shell as its child (a followed fork); a script that handles SIGURG
//! (the signal the hold uses) never sees one. A seized tree's (`-p SHELL --follow-forks`)
//! Python child is held the same way.
use std::{
    io::Write as _,
    process::{Command, Stdio},
};

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
    let calls = at_line(&json);
    (calls, String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Calls of 4 KiB or more whose innermost Python frame is quick.py's marked line, in a JSON.
fn at_line(json: &std::path::Path) -> u64 {
    let line = crate::python_code::marked(&script(), "quick") as u64;
    let doc = read_json(json);
    let mut calls = 0;
    for s in doc["stacks"].as_array().unwrap() {
        let frames = s["frames"].as_array().unwrap();
        let py = frames.iter().find(|f| f["module"] == "[python]");
        let here = |f: &Value| f["file"].as_str().is_some_and(|p| p.ends_with("/quick.py"));
        if py.is_some_and(|f| here(f) && f["line"] == line) {
            calls += sized(s, 4096);
        }
    }
    calls
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

bpf_test!(
    shared,
    /// Traced with its forks (`-p --follow-forks`, seized), a running Python (waiting for a
    /// line), and a running shell that runs the script as its child once the trace is on:
    /// each finalization is held as a launched one's. Without the hold: 0 of 300 named.
    fn an_attached_tree_s_script_that_ends_at_once_names_its_lines() {
        let script = script();
        let run = format!("echo ready; read x; /usr/bin/python3.11 {script}; true");
        let shell = ["/bin/sh", "-c", &run];
        let python = ["/usr/bin/python3.11", &script, "wait"];
        for (what, argv) in [("a Python", &python), ("a shell's child", &shell)] {
            let (mut root, _out, line) = piped(Command::new(argv[0]).args(&argv[1..]));
            assert_eq!(line, "ready\n");
            let json = json_path("pyquick-tree");
            let mut tracer = heaptrace();
            tracer
                .args(["--no-tui", "--follow-forks", "--json"])
                .arg(&json)
                .args(["-p", &root.id().to_string()]);
            let tracer = start_attached(&mut tracer);
            root.stdin.take().unwrap().write_all(b"go\n").unwrap();
            let _ = root.wait();
            let (code, stderr) = tracer.wait();
            assert_eq!(code, 0, "{what}: {stderr}");
            let calls = at_line(&json);
            eprintln!("{what}, seized: {calls} of 300 blocks at their line");
            assert!(
                calls >= 285,
                "{what}: {calls} of 300 at their line: {stderr}"
            );
        }
    }
);
