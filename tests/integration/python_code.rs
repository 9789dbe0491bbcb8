//! CPython's code objects read from outside a running python (no probes needed): each
//! supported version's names, file and the line of every instruction match what the
//! interpreter itself says of them (tests/fixtures/python/codes.py), and an object that is no
//! code is refused; two blocked threads' Python frames, walked from `_PyRuntime`, name the
//! functions and lines they are blocked at.
use std::{
    io::{BufRead as _, BufReader},
    process::{Command, Stdio},
};

use heaptrace::{
    heap::memory::Live,
    symbolize::python::{
        objects::{Code, CodeLayout},
        offsets::Offsets,
        runtime, threads,
    },
};
use serde_json::Value;

use crate::support::piped;

/// Debian's stripped, non-PIE 3.11 and pyenv's builds (3.12 with a shared libpython).
pub fn pythons() -> Vec<(String, (u8, u8))> {
    let pyenv = std::env::var("PYENV_ROOT")
        .unwrap_or_else(|_| format!("{}/.pyenv", std::env::var("HOME").unwrap_or_default()));
    vec![
        ("/usr/bin/python3.11".into(), (3, 11)),
        (format!("{pyenv}/versions/3.11.7/bin/python3.11"), (3, 11)),
        (format!("{pyenv}/versions/3.12.1/bin/python3.12"), (3, 12)),
        (format!("{pyenv}/versions/3.13.0/bin/python3.13"), (3, 13)),
    ]
}

fn fixture(name: &str) -> String {
    format!(
        "{}/../tests/fixtures/python/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

fn check(python: &str, version: (u8, u8)) {
    let script = fixture("codes.py");
    let mut child = Command::new(python)
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{python}: {e}"));
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut docs = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        if line == "ready" {
            break;
        }
        docs.push(serde_json::from_str::<Value>(&line).unwrap());
    }
    let pid = child.id();
    let mem = Live::new(pid);
    let rt = runtime::find(pid, &mem).unwrap_or_else(|e| panic!("{python}: {e}"));
    assert_eq!(rt.version, version, "{python}");
    let layout = CodeLayout::read(&mem, rt.code_type, rt.version).expect("the code type");
    // What the kernel walk reads before the code type can be: the same fields.
    assert!(
        Offsets::for_version(version).unwrap().agrees(&layout),
        "{python}: {layout:?}"
    );
    let (mut functions, mut units) = (0, 0);
    for d in &docs {
        if let Some(id) = d["not_code"].as_u64() {
            assert_eq!(Code::read(&mem, &layout, id), None, "a list read as code");
            continue;
        }
        let code = Code::read(&mem, &layout, d["id"].as_u64().unwrap())
            .unwrap_or_else(|| panic!("{python}: {d}"));
        assert_eq!(code.qualname, d["qualname"].as_str().unwrap(), "{python}");
        assert_eq!(code.filename, d["file"].as_str().unwrap(), "{python}");
        assert_eq!(i64::from(code.first_line), d["first"].as_i64().unwrap());
        for u in d["units"].as_array().unwrap() {
            let line = u[2].as_i64().map(|l| l as i32);
            for unit in u[0].as_u64().unwrap()..u[1].as_u64().unwrap() {
                assert_eq!(
                    code.line(unit as u32),
                    line,
                    "{python} {} unit {unit}",
                    code.qualname
                );
                units += 1;
            }
        }
        functions += 1;
    }
    assert_eq!(functions, 5, "{python}");
    eprintln!("{python}: {functions} code objects, {units} instructions' lines read");
    drop(child.stdin.take());
    child.wait().unwrap();
}

#[test]
fn code_objects_read_from_outside_match_the_interpreter() {
    for (python, version) in pythons() {
        if !std::path::Path::new(&python).exists() && std::env::var_os("CI").is_none() {
            eprintln!("skipped: {python} missing");
            continue;
        }
        check(&python, version);
    }
}

/// The line of `# at: MARK` in `script`.
pub fn marked(script: &str, mark: &str) -> i32 {
    let text = std::fs::read_to_string(script).unwrap();
    let n = text
        .lines()
        .position(|l| l.ends_with(&format!("# at: {mark}")));
    n.expect(mark) as i32 + 1
}

/// `function (file:line)` of each of thread `tid`'s Python frames, innermost first, and how
/// many were entry frames.
fn walk(pid: u32, tid: u32) -> (Vec<String>, usize) {
    let mem = Live::new(pid);
    let rt = runtime::find(pid, &mem).unwrap();
    let off = Offsets::for_version(rt.version).unwrap();
    let layout = CodeLayout::read(&mem, rt.code_type, rt.version).unwrap();
    let tstate = threads::thread_state(&mem, &rt, &off, tid).expect("the thread's state");
    let frames = threads::frames(&mem, &off, &layout, tstate);
    let names = frames
        .iter()
        .map(|f| {
            let code = Code::read(&mem, &layout, f.code).expect("a code object");
            let file = code.filename.rsplit('/').next().unwrap().to_string();
            let line = code.line(f.unit).unwrap_or(-1);
            format!("{} ({file}:{line})", code.qualname)
        })
        .collect();
    (names, frames.iter().filter(|f| f.entry).count())
}

fn check_threads(python: &str) {
    let script = fixture("threads.py");
    let (mut child, _out, line) = piped(Command::new(python).arg(&script));
    let ids: Vec<u32> = line
        .split_whitespace()
        .skip(1)
        .map(|w| w.parse().unwrap())
        .collect();
    let at = |f: &str, mark: &str| format!("{f} (threads.py:{})", marked(&script, mark));
    // "ready" is printed just before the read it blocks in: walk until it is there.
    let want_inner = at("inner", "inner-read");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let (main, entries) = loop {
        let (main, entries) = walk(child.id(), ids[0]);
        if main[0] == want_inner || std::time::Instant::now() > deadline {
            break (main, entries);
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(
        main,
        [
            at("inner", "inner-read"),
            at("outer", "outer-call"),
            at("<module>", "module-call")
        ],
        "{python}"
    );
    assert!(entries >= 1, "{python}: no entry frame");
    let (worker, _) = walk(child.id(), ids[1]);
    assert_eq!(worker[0], at("worker", "worker-sleep"), "{python}");
    assert!(
        worker[1..]
            .iter()
            .any(|f| f.starts_with("Thread.run (threading.py:")),
        "{python}: {worker:?}"
    );
    eprintln!("{python}: {main:?} {worker:?}");
    drop(child.stdin.take());
    let _ = child.kill();
    child.wait().unwrap();
}

#[test]
fn threads_python_frames_are_walked_from_outside() {
    for (python, _) in pythons() {
        if !std::path::Path::new(&python).exists() && std::env::var_os("CI").is_none() {
            eprintln!("skipped: {python} missing");
            continue;
        }
        check_threads(&python);
    }
}
