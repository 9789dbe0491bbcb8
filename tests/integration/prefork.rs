//! A pre-forked server without frame pointers (tests/fixtures/prefork.c, nginx's shape): every
//! process the trace takes in has its unwind tables before its first counted call, whether it
//! ran before the attach (`-p MASTER --follow-forks`, `--all --comm`) or was forked during the
//! trace (`-- CMD --follow-forks`). Each worker's stacks reach main, with its exact calls.
//! The `--all --comm prefork-nofp` tests run alone (`exclusive`): the other tests' masters and
//! workers bear the same name, and were counted in theirs.
use std::{io::Write as _, process::Command};

use serde_json::Value;

use crate::{
    support::*,
    unwinding::{names, upto_main},
};

const WORKERS: u64 = 3;
const UNWIND: [&str; 2] = ["--unwind-table-size", "1048576"];

/// `heaptrace --all --comm prefork-nofp` with `opts`, attached: its handle and JSON path.
fn trace_all(tag: &str, opts: &[&str]) -> (Running, std::path::PathBuf) {
    let json = json_path(tag);
    let mut cmd = heaptrace();
    cmd.args(["--no-tui", "--all", "--comm", "prefork-nofp"])
        .args(opts)
        .args(UNWIND)
        .arg("--json")
        .arg(&json);
    (start_attached(&mut cmd), json)
}

fn prefork() -> std::path::PathBuf {
    fixture("prefork", "-nofp", &["-O2", "-fomit-frame-pointer"])
}

/// Each worker's one site: malloc <- grow <- build <- handle <- serve <- main, worker i's
/// (i + 1) * 100 calls of 64 + 16 i bytes; no other site of the fixture's functions, no cut
/// stack, no loss, no warning of stacks cut short.
fn check(doc: &Value, summary: &str) {
    let mut got: Vec<(u64, u64, Vec<String>)> = doc["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["function"] == "malloc")
        .map(|s| {
            let upto = upto_main(&names(s));
            (
                s["calls"].as_u64().unwrap(),
                s["bytes"].as_u64().unwrap(),
                upto,
            )
        })
        .filter(|(_, _, f)| f.first().is_some_and(|f| f == "grow"))
        .collect();
    got.sort();
    let whole: Vec<String> = ["grow", "build", "handle", "serve", "main"]
        .map(String::from)
        .to_vec();
    let want: Vec<(u64, u64, Vec<String>)> = (0..WORKERS)
        .map(|i| ((i + 1) * 100, (i + 1) * 100 * (64 + 16 * i), whole.clone()))
        .collect();
    assert_eq!(got, want, "{summary}");
    for loss in ["unwind_late", "unwind_no_rule", "unwind_table", "stack"] {
        assert_eq!(doc["lost"][loss], 0, "{loss}: {}", doc["lost"]);
    }
    assert!(!summary.contains("stacks cut"), "{summary}");
    assert!(!summary.contains("end before main"), "{summary}");
}

/// Starts the master with its workers forked and waiting; traces it with `opts`; lets the
/// workers work; ends it. Returns the document and heaptrace's output.
fn attached(tag: &str, opts: &[&str], with_pid: bool) -> (Value, String) {
    let mut cmd = Command::new(prefork());
    cmd.args([&WORKERS.to_string(), "wait"]);
    let mut target = ready(cmd);
    let json = json_path(tag);
    let mut cmd = heaptrace();
    cmd.args(["--no-tui", "-q", "--interval", "100ms"])
        .args(UNWIND)
        .args(opts)
        .arg("--json")
        .arg(&json);
    if with_pid {
        cmd.args(["-p", &target.id().to_string()]);
    }
    let tracer = start_attached(&mut cmd);
    let mut stdin = target.stdin.take().unwrap();
    // At once: the first calls come right after the attach, before any round.
    stdin.write_all(b"g").unwrap();
    std::thread::sleep(std::time::Duration::from_millis(500));
    drop(stdin);
    assert!(target.wait().unwrap().success());
    if !with_pid {
        tracer.signal(libc::SIGINT);
    }
    let (code, out) = tracer.wait();
    assert_eq!(code, 0, "{out}");
    (read_json(&json), out)
}

bpf_test!(
    shared,
    /// `-p MASTER --follow-forks` after the workers exist: they are taken in with their
    /// tables (before: one frame each, `grow`, 100 % of calls, and no loss said).
    fn a_running_master_s_workers_get_whole_stacks() {
        let (doc, out) = attached("prefork-pid", &["--follow-forks"], true);
        check(&doc, &out);
    }
);

bpf_test!(
    shared,
    /// A launched master's workers, forked during the trace, walk with the tables the kernel
    /// gives them at the fork (their parent's) from their first call.
    fn forks_during_the_trace_get_whole_stacks_from_their_first_call() {
        let json = json_path("prefork-launch");
        let mut cmd = heaptrace();
        cmd.args(["--no-tui", "-q", "--interval", "100ms", "--follow-forks"])
            .args(UNWIND)
            .arg("--json")
            .arg(&json)
            .arg("--")
            .arg(prefork())
            .args([&WORKERS.to_string(), "go"]);
        let out = run_ok(&mut cmd);
        check(&read_json(&json), &String::from_utf8_lossy(&out.stderr));
    }
);

bpf_test!(
    exclusive,
    /// `--all --comm`: the master and workers running before heaptrace are taken in by the
    /// start-up scan, with their tables.
    fn running_processes_under_all_get_whole_stacks() {
        let (doc, out) = attached("prefork-all", &["--all", "--comm", "prefork-nofp"], false);
        check(&doc, &out);
    }
);

bpf_test!(
    exclusive,
    /// `--all --comm`, the master started during the trace: the workers it forks then get
    /// its tables in the kernel at the fork, and walk whole from their first call.
    fn forks_under_all_get_whole_stacks_from_their_first_call() {
        let (tracer, json) = trace_all("prefork-all-later", &["-q", "--interval", "100ms"]);
        let mut cmd = Command::new(prefork());
        cmd.args([&WORKERS.to_string(), "later"]);
        let mut target = ready(cmd);
        // The master's own entry in place (its exec's reads of its mappings, its libraries'
        // tables read) before it forks: generous, as a loaded machine reads them late.
        std::thread::sleep(std::time::Duration::from_millis(1500));
        let mut stdin = target.stdin.take().unwrap();
        stdin.write_all(b"g").unwrap();
        // Alive for a few rounds: no event reports a fork under --all, its mappings are read
        // with its first new stack.
        std::thread::sleep(std::time::Duration::from_millis(500));
        drop(stdin);
        assert!(target.wait().unwrap().success());
        tracer.signal(libc::SIGINT);
        let (code, out) = tracer.wait();
        assert_eq!(code, 0, "{out}");
        check(&read_json(&json), &out);
    }
);

bpf_test!(
    exclusive,
    /// `--all`, a master that forks right after its exec, before the daemon has read its
    /// mappings: its workers have no tables to inherit. Their counts stay exact, every call
    /// walked without tables is in `lost.unwind_late`, and the summary blames the late
    /// tables, not the program's frames.
    fn walks_before_the_tables_are_counted_and_named() {
        let (tracer, json) = trace_all("prefork-all-late", &["--interval", "1s"]);
        let mut cmd = Command::new(prefork());
        cmd.args([&WORKERS.to_string(), "later"]);
        let mut target = ready(cmd);
        let mut stdin = target.stdin.take().unwrap();
        stdin.write_all(b"g").unwrap();
        std::thread::sleep(std::time::Duration::from_millis(2500));
        drop(stdin);
        assert!(target.wait().unwrap().success());
        tracer.signal(libc::SIGINT);
        let (code, out) = tracer.wait();
        assert_eq!(code, 0, "{out}");
        let doc = read_json(&json);
        let (mut all, mut cut) = (0, 0);
        for s in doc["stacks"].as_array().unwrap() {
            let f = names(s);
            if s["function"] != "malloc" || f.first().is_none_or(|f| f != "grow") {
                continue;
            }
            let calls = s["calls"].as_u64().unwrap();
            all += calls;
            if !f.iter().any(|f| f == "main") {
                cut += calls;
            }
        }
        assert_eq!(all, 600, "{out}");
        let late = doc["lost"]["unwind_late"].as_u64().unwrap();
        assert!(cut <= late, "{cut} calls cut, {late} walks late: {out}");
        assert!(!out.contains("neither frame pointers"), "{out}");
        if cut * 2 > all {
            assert!(
                out.contains("walked before their process's unwind tables were loaded"),
                "{out}"
            );
        }
        eprintln!("{cut} of {all} calls cut, {late} walks late");
    }
);
