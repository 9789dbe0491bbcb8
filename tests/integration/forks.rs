//! Following forks: a launched command's (by default; `--no-follow-forks` not), `-p PID`'s
//! existing and later ones (`--follow-forks`). Each process is counted exactly from its first
//! call, as its own entry. A fork not followed, and any process outside the tree, has no
//! breakpoint in its text (`forkcheck` reads its own malloc and free).
use std::{
    io::{BufRead as _, BufReader, Write as _},
    process::{Command, Stdio},
};

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
    /// Followed by default: each fork held at its fork until links bound to it are in place.
    fn a_launched_command_is_followed_into_its_forks() {
        let json = json_path("forks-launch");
        let out = run_ok(
            heaptrace()
                .args(["--no-tui", "--interval", "100ms", "--json"])
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
                .args(["--no-tui", "--no-follow-forks", "--json"])
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

/// The int3 count `forkcheck` printed for `who` ("parent", "child", "self").
fn int3s(stdout: &str, who: &str) -> u64 {
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{who} int3 ")))
        .unwrap_or_else(|| panic!("no {who} line in {stdout:?}"));
    line.trim().parse().unwrap()
}

/// `forkcheck 1000` waiting to be attached (with `env` set too), and `heaptrace -p` on it
/// with `flags`: the target, its stdout past "ready", the tracer and its JSON path.
fn forkcheck_attached(
    tag: &str,
    env: &[&str],
    flags: &[&str],
) -> (
    std::process::Child,
    BufReader<std::process::ChildStdout>,
    Running,
    std::path::PathBuf,
) {
    let mut cmd = Command::new(fixture("forkcheck", "", &[]));
    cmd.arg("1000")
        .env("FORKCHECK_BEFORE", "1")
        .env("FORKCHECK_WAIT", "1");
    for e in env {
        cmd.env(e, "1");
    }
    let (target, out, line) = piped(&mut cmd);
    assert_eq!(line, "ready\n");
    let json = json_path(&format!("forkcheck-{tag}"));
    let mut tracer = heaptrace();
    tracer
        .args(["--no-tui", "--interval", "100ms", "--json"])
        .arg(&json)
        .args(flags)
        .args(["-p", &target.id().to_string()]);
    (target, out, start_attached(&mut tracer), json)
}

/// What `forkcheck` printed up to its parent's line (its child has ended by then).
fn until_parent(out: impl std::io::BufRead) -> String {
    let mut seen = String::new();
    for l in out.lines() {
        seen.push_str(&(l.unwrap() + "\n"));
        if seen.contains("parent int3") {
            break;
        }
    }
    seen
}

/// `heaptrace [flags] -- forkcheck 1000`: its stdout and JSON document.
fn forkcheck(flags: &[&str]) -> (String, Value) {
    let json = json_path("forkcheck");
    let out = run_ok(
        heaptrace()
            .args(["--no-tui", "--quiet"])
            .args(flags)
            .arg("--json")
            .arg(&json)
            .arg("--")
            .arg(fixture("forkcheck", "", &[]))
            .arg("1000"),
    );
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        read_json(&json),
    )
}

bpf_test!(
    /// A fork not followed runs at its own speed: the breakpoints it inherited are taken out
    /// of its copy of the text at its fork (before: 2 of them, a trap at each of its calls).
    fn a_fork_not_followed_has_no_breakpoints_and_is_not_counted() {
        let (stdout, doc) = forkcheck(&["--no-follow-forks"]);
        assert!(int3s(&stdout, "parent") >= 1, "{stdout}");
        assert_eq!(int3s(&stdout, "child"), 0, "{stdout}");
        let procs = doc["processes"].as_array().unwrap();
        assert_eq!(procs.len(), 1, "{procs:#?}");
        assert_eq!(calls(&procs[0], "malloc"), (1, 100));
        assert_eq!(calls(&procs[0], "free"), (1, 100));
    }
);

bpf_test!(
    /// A fork followed keeps its breakpoints, and its own links count each of its calls.
    fn a_followed_fork_is_counted_exactly_from_its_first_call() {
        let (stdout, doc) = forkcheck(&[]);
        assert!(int3s(&stdout, "child") >= 1, "{stdout}");
        let procs = doc["processes"].as_array().unwrap();
        assert_eq!(procs.len(), 2, "{procs:#?}");
        let root = doc["target"]["pids"][0].as_u64().unwrap();
        let child = procs.iter().find(|p| p["pid"] != root).unwrap();
        assert_eq!(calls(child, "malloc"), (K, K * 64));
        assert_eq!(calls(child, "free"), (K, K * 64));
        assert_eq!(child["live"]["blocks"], 0);
    }
);

bpf_test!(
    /// While a launched command's forks are followed, a process outside its tree has no
    /// breakpoint in its libc (`--follow-forks` put them in every process that maps it).
    fn a_process_outside_a_followed_tree_is_not_trapped() {
        let mut tracer = heaptrace()
            .args(["--no-tui", "--quiet", "--"])
            .arg(fixture("forkcheck", "", &[]))
            .arg("10")
            .env("FORKCHECK_WAIT", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn heaptrace");
        let mut lines = BufReader::new(tracer.stdout.take().unwrap()).lines();
        let mut seen = String::new();
        while !seen.contains("parent int3") {
            match lines.next() {
                Some(Ok(l)) => seen.push_str(&(l + "\n")),
                _ => break,
            }
        }
        // The tree is traced and still running (its root waits on stdin).
        assert!(int3s(&seen, "parent") >= 1, "{seen}");
        assert!(int3s(&seen, "child") >= 1, "{seen}");
        let alone = Command::new(fixture("forkcheck", "", &[]))
            .arg("self")
            .output()
            .unwrap();
        tracer.stdin.take().unwrap().write_all(b"g").unwrap();
        let out = tracer.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(int3s(&String::from_utf8_lossy(&alone.stdout), "self"), 0);
    }
);

bpf_test!(
    shared,
    /// `-p PID` alone: a fork the process makes after the attach is not followed, and the
    /// breakpoints it inherited from its parent's text are taken out as it starts (before, a
    /// trap at each of its calls, counted by nothing); the parent keeps its own.
    fn an_attached_process_s_fork_loses_the_breakpoints_it_inherited() {
        let (mut target, out, tracer, json) = forkcheck_attached("pid", &["FORKCHECK_SETTLE"], &[]);
        let mut stdin = target.stdin.take().unwrap();
        stdin.write_all(b"g").unwrap();
        let seen = until_parent(out);
        stdin.write_all(b"g").unwrap();
        assert!(target.wait().unwrap().success());
        let (code, stderr) = tracer.wait();
        assert_eq!(code, 0, "{stderr}");
        assert!(int3s(&seen, "parent") >= 1, "{seen}");
        assert_eq!(int3s(&seen, "child"), 0, "{seen}");
        let doc = read_json(&json);
        let procs = doc["processes"].as_array().unwrap();
        assert_eq!(procs.len(), 1, "{procs:#?}");
        assert_eq!(calls(&procs[0], "malloc"), (1, 100));
    }
);

/// The thread that ptraces `pid` (its `TracerPid`), 0 for none.
fn tracer_of(pid: u32) -> u32 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with("TracerPid:"))
        .unwrap();
    line["TracerPid:".len()..].trim().parse().unwrap()
}

bpf_test!(
    shared,
    /// `-p PID --follow-forks`: the process is seized, its fork held until it has links of its
    /// own and counted exactly, and no process outside the tree traps (before: the probes
    /// went into every process that maps libc, 1.4 s for another's million pairs instead of
    /// 6 ms). At the end it runs on, traced by none.
    fn an_attached_tree_holds_its_forks_and_nothing_outside_traps() {
        let (mut target, out, tracer, json) = forkcheck_attached("tree", &[], &["--follow-forks"]);
        let mut stdin = target.stdin.take().unwrap();
        stdin.write_all(b"g").unwrap();
        let seen = until_parent(out);
        let alone = Command::new(fixture("forkcheck", "", &[]))
            .arg("self")
            .output()
            .unwrap();
        assert_eq!(int3s(&String::from_utf8_lossy(&alone.stdout), "self"), 0);
        assert!(int3s(&seen, "child") >= 1, "{seen}");
        let holder = tracer_of(target.id());
        let task = format!("/proc/{}/task/{holder}", tracer.child.id());
        assert!(std::path::Path::new(&task).exists(), "traced by {holder}");
        tracer.signal(libc::SIGINT);
        let (code, stderr) = tracer.wait();
        assert_eq!(code, 0, "{stderr}");
        assert!(!stderr.contains("not held"), "{stderr}");
        assert_eq!(tracer_of(target.id()), 0);
        stdin.write_all(b"g").unwrap();
        assert!(target.wait().unwrap().success());
        let doc = read_json(&json);
        let procs = doc["processes"].as_array().unwrap();
        assert_eq!(procs.len(), 2, "{procs:#?}");
        let child = procs.iter().find(|p| p["pid"] != target.id()).unwrap();
        assert_eq!(calls(child, "malloc"), (K, K * 64));
        assert_eq!(calls(child, "free"), (K, K * 64));
    }
);

bpf_test!(
    /// A fork made by a thread other than the main one is not held (only the main thread is
    /// traced): it is followed from the kernel's report, a millisecond or so late, and said
    /// so (before: never counted). The child sleeps 300 ms before its pairs.
    fn a_fork_by_another_thread_is_followed_from_its_report() {
        let json = json_path("forkcheck-thread");
        let out = run_ok(
            heaptrace()
                .args(["--no-tui", "--quiet", "--json"])
                .arg(&json)
                .arg("--")
                .arg(fixture("forkcheck", "", &[]))
                .arg("1000")
                .env("FORKCHECK_THREAD", "1"),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("1 forks were not held"), "{stderr}");
        let doc = read_json(&json);
        let procs = doc["processes"].as_array().unwrap();
        assert_eq!(procs.len(), 2, "{procs:#?}");
        let root = doc["target"]["pids"][0].as_u64().unwrap();
        let child = procs.iter().find(|p| p["pid"] != root).unwrap();
        assert_eq!(calls(child, "malloc"), (K, K * 64));
        assert_eq!(calls(child, "free"), (K, K * 64));
    }
);
