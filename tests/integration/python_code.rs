//! CPython's code objects read from outside a running python (no probes needed): each
//! supported version's names, file and the line of every instruction match what the
//! interpreter itself says of them (tests/fixtures/python/codes.py), and an object that is no
//! code is refused.
use std::{
    io::{BufRead as _, BufReader},
    process::{Command, Stdio},
};

use heaptrace::{
    heap::memory::Live,
    symbolize::python::{
        objects::{Code, CodeLayout},
        runtime,
    },
};
use serde_json::Value;

/// Debian's stripped, non-PIE 3.11 and pyenv's builds (3.12 with a shared libpython).
fn pythons() -> Vec<(String, (u8, u8))> {
    let pyenv = std::env::var("PYENV_ROOT")
        .unwrap_or_else(|_| format!("{}/.pyenv", std::env::var("HOME").unwrap_or_default()));
    vec![
        ("/usr/bin/python3.11".into(), (3, 11)),
        (format!("{pyenv}/versions/3.11.7/bin/python3.11"), (3, 11)),
        (format!("{pyenv}/versions/3.12.1/bin/python3.12"), (3, 12)),
        (format!("{pyenv}/versions/3.13.0/bin/python3.13"), (3, 13)),
    ]
}

fn check(python: &str, version: (u8, u8)) {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/python/codes.py"
    );
    let mut child = Command::new(python)
        .arg(script)
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
