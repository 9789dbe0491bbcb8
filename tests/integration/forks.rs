//! Following forks (`--follow-forks`): a launched command's forks, `-p PID`'s existing and
//! later ones. Each process is counted exactly from its first call, as its own entry.
use std::{io::Write as _, process::Command};

use serde_json::Value;

use crate::{
    expect::{Expected, Fixture},
    support::*,
};

const K: u64 = 1000;

/// `forkers 1000 allocs 0 300 3`: worker 2 execs `allocs`.
fn args() -> Vec<String> {
    let allocs = fixture("allocs", "", &[]);
    ["1000", allocs.to_str().unwrap(), "0", "300", "3"]
        .map(String::from)
        .to_vec()
}

fn calls(p: &Value, func: &str) -> (u64, u64) {
    let f = &p["functions"][func];
    (f["calls"].as_u64().unwrap(), f["bytes"].as_u64().unwrap())
}

/// The parent, its two workers that exit and the one that execs `allocs`, each exact. An
/// attached parent's 100 blocks were allocated before the attach: only their frees show.
fn check(doc: &Value, root: u64, attached: bool) {
    let procs = doc["processes"].as_array().unwrap();
    assert_eq!(procs.len(), 4, "{procs:#?}");
    let parent = procs.iter().find(|p| p["pid"] == root).unwrap();
    let (mallocs, untracked) = if attached { (0, 100) } else { (100, 0) };
    assert_eq!(calls(parent, "malloc"), (mallocs, mallocs * 3000));
    assert_eq!(calls(parent, "free"), (100, mallocs * 3000));
    assert_eq!(parent["functions"]["free"]["untracked"], untracked);
    assert_eq!(parent["live"]["blocks"], 0);
    let mut workers: Vec<&Value> = procs
        .iter()
        .filter(|p| p["pid"] != root && p["comm"] == "forkers")
        .collect();
    workers.sort_by_key(|p| calls(p, "malloc").1);
    assert_eq!(workers.len(), 2, "{procs:#?}");
    for (w, p) in workers.iter().enumerate() {
        let size = 1000 + 100 * w as u64;
        assert_eq!(calls(p, "malloc"), (K, K * size), "worker {w}");
        // Half its own blocks, and one it inherited from the parent: its own copy, unseen
        // allocated in it (the parent's figures stay whole).
        assert_eq!(calls(p, "free"), (K / 2 + 1, K / 2 * size), "worker {w}");
        assert_eq!(p["functions"]["free"]["untracked"], 1, "worker {w}");
        assert_eq!(p["live"]["blocks"].as_u64(), Some(K / 2), "worker {w}");
        assert_eq!(
            p["live"]["bytes"].as_u64(),
            Some(K / 2 * size),
            "worker {w}"
        );
        assert_eq!(p["exited"], true);
    }
    // Worker 2 exec'ed: counted as its new command alone.
    let execd = procs.iter().find(|p| p["comm"] == "allocs").unwrap();
    let want = Expected::of(&Fixture::main_thread(300, 3));
    assert_eq!(Expected::observed(execd, &execd["sizes"], &want), want);
    // The document's totals are the four processes'.
    let all = mallocs + 2 * K + want.funcs["malloc"].calls;
    assert_eq!(doc["functions"]["malloc"]["calls"].as_u64(), Some(all));
}

bpf_test!(
    fn a_launched_command_is_followed_into_its_forks() {
        let json = json_path("forks-launch");
        let out = run_ok(
            heaptrace()
                .args([
                    "--no-tui",
                    "--follow-forks",
                    "--interval",
                    "100ms",
                    "--json",
                ])
                .arg(&json)
                .arg("--")
                .arg(fixture("forkers", "", &[]))
                .args(args()),
        );
        let doc = read_json(&json);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(doc["target"]["exit_code"], 0, "{stderr}");
        let root = doc["target"]["pids"][0].as_u64().unwrap();
        // The parent exits first: the run ends with its last worker.
        check(&doc, root, false);
    }
);

bpf_test!(
    fn without_follow_forks_the_command_is_traced_alone() {
        let json = json_path("forks-none");
        run_ok(
            heaptrace()
                .args(["--no-tui", "--json"])
                .arg(&json)
                .arg("--")
                .arg(fixture("forkers", "", &[]))
                .args(args()),
        );
        let doc = read_json(&json);
        let procs = doc["processes"].as_array().unwrap();
        assert_eq!(procs.len(), 1, "{procs:#?}");
        assert_eq!(calls(&procs[0], "malloc"), (100, 300_000));
    }
);

bpf_test!(
    shared,
    /// The root ends at once after the attach (the test releases it on the "attached" line):
    /// when it was gone before the daemon watched it, the trace ended with the root alone, its
    /// workers never counted (1 run in 3 under load).
    fn follow_forks_takes_a_process_s_forks_present_and_future() {
        let mut cmd = Command::new(fixture("forkers", "", &[]));
        cmd.args(args()).env("FORKERS_WAIT", "1");
        // Two workers forked already, waiting; the third is forked after the attach.
        let mut target = ready(cmd);
        let root = target.id();
        let json = json_path("forks-pid");
        let mut cmd = heaptrace();
        cmd.args([
            "--no-tui",
            "--interval",
            "100ms",
            "--follow-forks",
            "--json",
        ])
        .arg(&json)
        .args(["-p", &root.to_string()]);
        let tracer = start_attached(&mut cmd);
        target.stdin.take().unwrap().write_all(b"g").unwrap();
        assert!(target.wait().unwrap().success());
        let (code, stderr) = tracer.wait();
        assert_eq!(code, 0, "{stderr}");
        check(&read_json(&json), root.into(), true);
    }
);
