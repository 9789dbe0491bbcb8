//! `-p PID --in-process`: heaptrace's library loaded into a running process with ptrace and
//! the malloc family redirected to it in every module's GOT. Exact over the counted phase as
//! the kernel path's `-p`, and harmless to the target: attached and detached again and again
//! while its threads allocate, or heaptrace killed in the middle of the attach, the target's
//! own checks of its blocks find nothing wrong and it exits as it would have. Needs root
//! (ptrace of a process that is not heaptrace's child), not BPF.
use std::{
    io::{BufRead as _, BufReader, Write as _},
    process::{Child, ChildStdout, Command, Stdio},
    time::Duration,
};

use crate::{
    counts::{allocs, args, check_leaks},
    expect::{Expected, Fixture},
    support::*,
};

const THREADS: &str = "8";

/// `attachloop 8`, running: its threads allocate, check and free until its stdin closes.
struct Loop {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl Loop {
    fn id(&self) -> u32 {
        self.child.id()
    }
}

fn attachloop() -> Loop {
    let (child, out, line) = piped(Command::new(fixture("attachloop", "", &[])).arg(THREADS));
    assert_eq!(line, "ready\n");
    Loop { child, out }
}

/// What thread `id` of attachloop sums over its first `rounds` blocks (see the fixture):
/// a block's terms repeat every 44,800 (the sizes' period, 700, and the bytes', 256).
fn loop_sum(id: u64, rounds: u64) -> u64 {
    const PERIOD: u64 = 44_800;
    let pattern = |seq: u64, i: u64| u64::from((id * 131 + seq * 7 + i) as u8);
    let sum = |n: u64| -> u64 {
        (0..n)
            .map(|seq| {
                let m = 16 + seq * 37 % 700;
                m + pattern(seq, 0) + pattern(seq, m - 1)
            })
            .sum()
    };
    rounds / PERIOD * sum(PERIOD) + sum(rounds % PERIOD)
}

/// The attach of the loops: a live table of 65,536 (the fixture holds 128 blocks), read
/// quickly at each end.
fn loop_attach_cmd(pid: u32, json: &std::path::Path) -> Command {
    let mut cmd = attach_cmd(pid, json);
    cmd.args(["--live-map-size", "65536"]);
    cmd
}

/// Closes the fixture's stdin and checks that its threads found every block intact (its
/// exit status says so) and that each one's sum of the work it did is the one its rounds
/// give.
fn finish_attachloop(mut target: Loop) {
    drop(target.child.stdin.take());
    let status = target.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    let mut threads = 0;
    for line in (&mut target.out).lines() {
        let line = line.unwrap();
        let w: Vec<&str> = line.split_whitespace().collect();
        assert_eq!((w[0], w[2], w[4]), ("thread", "rounds", "sum"), "{line}");
        let (id, rounds, sum): (u64, u64, u64) = (
            w[1].parse().unwrap(),
            w[3].parse().unwrap(),
            w[5].parse().unwrap(),
        );
        assert!(rounds > 0, "{line}");
        assert_eq!(sum, loop_sum(id, rounds), "{line}");
        threads += 1;
    }
    assert_eq!(threads.to_string(), THREADS);
}

/// The target's state is neither stopped nor a zombie.
fn running(pid: u32, when: &str) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let state = status.lines().find(|l| l.starts_with("State:")).unwrap();
    assert!(
        !state.contains('T') && !state.contains('Z'),
        "{when}: {state}"
    );
}

fn attach_cmd(pid: u32, json: &std::path::Path) -> Command {
    let mut cmd = heaptrace();
    cmd.args([
        "--no-tui",
        "-q",
        "--interval",
        "200ms",
        "--in-process",
        "--json",
    ])
    .arg(json)
    .args(["-p", &pid.to_string()]);
    cmd
}

/// The counted phase of `allocs`, attached to once its threads exist, is exact.
#[test]
fn pid_in_process_counts_exactly() {
    let _g = shared();
    let fx = Fixture {
        threads: 4,
        iterations: 2000,
        leaks: 4,
        memalign_apart: false,
        no_pvalloc: false,
    };
    let mut cmd = Command::new(allocs());
    cmd.args(args(&fx, &["wait"]));
    let mut target = ready(cmd);
    let json = json_path("pid-in-process");
    let tracer = start_attached(&mut attach_cmd(target.id(), &json));
    target.stdin.take().unwrap().write_all(b"g").unwrap();
    assert!(target.wait().unwrap().success());
    let (code, stderr) = tracer.wait();
    assert_eq!(code, 0, "{stderr}");
    assert!(stderr.contains("exited"), "{stderr}");
    let doc = read_json(&json);
    assert_eq!(doc["heaptrace"]["collector"], "in-process-attached");
    let want = Expected::of(&fx);
    let got = Expected::observed(&doc, &doc["sizes"], &want);
    assert_eq!(got, want);
    check_leaks(&doc, &want);
}

/// Fifty attaches and detaches in a row to eight threads in malloc, realloc, calloc and free:
/// each run counts, the target's checks never fail, its sums of the work done are those of
/// its rounds, it never crashes.
#[test]
fn pid_in_process_attaches_and_detaches_again_and_again() {
    let _g = shared();
    let target = attachloop();
    for run in 0..50 {
        let json = json_path("pid-in-process-again");
        let tracer = start_attached(&mut loop_attach_cmd(target.id(), &json));
        std::thread::sleep(Duration::from_millis(100));
        tracer.signal(libc::SIGINT);
        let (code, stderr) = tracer.wait();
        assert_eq!(code, 0, "run {run}: {stderr}");
        assert!(stderr.contains("written back"), "run {run}: {stderr}");
        let doc = read_json(&json);
        assert_eq!(doc["heaptrace"]["collector"], "in-process-attached");
        let calls = |f: &str| doc["functions"][f]["calls"].as_u64().unwrap();
        assert!(
            calls("malloc") > 0 && calls("calloc") > 0,
            "run {run}: {doc}"
        );
        // Every block freed is one of the ring's or calloc's, each allocated once.
        assert!(calls("free") <= calls("malloc") + calls("calloc") + 16 * 8);
        running(target.id(), &format!("run {run}"));
    }
    finish_attachloop(target);
}

/// heaptrace killed (SIGKILL) at moments spread over each phase: its attach, its counting,
/// and its detach (the GOT written back as it ends): the target runs on, intact, its sums
/// right, and can be attached to again and detached cleanly.
#[test]
fn pid_in_process_killed_in_any_phase_leaves_the_target_running() {
    let _g = shared();
    let target = attachloop();
    let json = json_path("pid-in-process-killed");
    for delay_ms in [0, 2, 5, 10, 20, 30, 50, 80, 120, 200] {
        let mut ht = loop_attach_cmd(target.id(), &json)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(delay_ms));
        ht.kill().unwrap();
        ht.wait().unwrap();
        std::thread::sleep(Duration::from_millis(50));
        running(target.id(), &format!("attach, {delay_ms} ms"));
    }
    // Counting: killed once attached.
    for delay_ms in [0, 20, 100] {
        let mut tracer = start_attached(&mut loop_attach_cmd(target.id(), &json));
        std::thread::sleep(Duration::from_millis(delay_ms));
        tracer.child.kill().unwrap();
        tracer.child.wait().unwrap();
        std::thread::sleep(Duration::from_millis(50));
        running(target.id(), &format!("counting, {delay_ms} ms"));
    }
    // The detach: killed at moments after SIGINT, while it writes the GOT back.
    for delay_us in [0, 500, 1000, 2000, 4000, 8000, 16000] {
        let mut tracer = start_attached(&mut loop_attach_cmd(target.id(), &json));
        std::thread::sleep(Duration::from_millis(50));
        tracer.signal(libc::SIGINT);
        std::thread::sleep(Duration::from_micros(delay_us));
        tracer.child.kill().unwrap();
        tracer.child.wait().unwrap();
        std::thread::sleep(Duration::from_millis(50));
        running(target.id(), &format!("detach, {delay_us} us"));
    }
    // Attached to once more, and detached cleanly.
    let json = json_path("pid-in-process-after-kills");
    let tracer = start_attached(&mut loop_attach_cmd(target.id(), &json));
    std::thread::sleep(Duration::from_millis(200));
    tracer.signal(libc::SIGINT);
    let (code, stderr) = tracer.wait();
    assert_eq!(code, 0, "{stderr}");
    assert!(stderr.contains("written back"), "{stderr}");
    finish_attachloop(target);
}

/// A stopped process is refused in one line before anything is loaded.
#[test]
fn pid_in_process_refuses_a_stopped_process() {
    let _g = shared();
    let mut target = attachloop().child;
    // SAFETY: signalling our own child.
    unsafe { libc::kill(target.id() as i32, libc::SIGSTOP) };
    std::thread::sleep(Duration::from_millis(100));
    let json = json_path("pid-in-process-stopped");
    let out = attach_cmd(target.id(), &json).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("is stopped"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    // SAFETY: as above.
    unsafe { libc::kill(target.id() as i32, libc::SIGCONT) };
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", target.id())).unwrap();
    assert!(!maps.contains("heaptrace"), "loaded into a stopped process");
    let _ = target.kill();
    let _ = target.wait();
}

/// Debian's python3 is not PIE: its malloc symbol is its own PLT entry (the canonical
/// address), which the library must not take for the real malloc. Attached while it holds a
/// dict of 1,000 strings, then replacing each 20 times: every new string is counted, the
/// frees of the strings from before the attach are untracked, and it exits as usual.
#[test]
fn pid_in_process_counts_a_non_pie_python() {
    let _g = shared();
    let script = "import sys\n\
        d = {i: str(i) * 3 for i in range(1000)}\n\
        print('ready', flush=True)\n\
        sys.stdin.readline()\n\
        for i in range(20000):\n    d[i % 1000] = str(i + 1000) * 3\n\
        print('done', flush=True)\n\
        sys.stdin.readline()\n";
    let mut py = Command::new("/usr/bin/python3")
        .args(["-c", script])
        .env("PYTHONMALLOC", "malloc")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("/usr/bin/python3");
    let mut out = BufReader::new(py.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "ready\n");
    let json = json_path("pid-in-process-python");
    let tracer = start_attached(&mut attach_cmd(py.id(), &json));
    let mut stdin = py.stdin.take().unwrap();
    stdin.write_all(b"g\n").unwrap();
    line.clear();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "done\n");
    tracer.signal(libc::SIGINT);
    let (code, stderr) = tracer.wait();
    assert_eq!(code, 0, "{stderr}");
    drop(stdin);
    assert!(py.wait().unwrap().success());
    let doc = read_json(&json);
    let free = &doc["functions"]["free"];
    let mallocs = doc["functions"]["malloc"]["calls"].as_u64().unwrap();
    assert!(mallocs >= 20000, "{mallocs} mallocs: {stderr}");
    assert!(free["untracked"].as_u64().unwrap() >= 1000, "{free}");
}

fn n(v: &serde_json::Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

/// "WORD A B" from a fixture's output.
fn pair(line: &str, word: &str) -> (u64, u64) {
    let w: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(w.first(), Some(&word), "{line}");
    (w[1].parse().unwrap(), w[2].parse().unwrap())
}

/// `--census`: tests/fixtures/beforeattach.c holds 64 blocks when attached to, then frees
/// half of them and keeps 10 new malloc(64). The blocks taken in are exactly those a census
/// of its heap finds while it waits attached (its 64 and the loader's for the library), each
/// free is of a known block with its usable size, none untracked, and the rest are leaks of
/// the "allocated before attach" site.
#[test]
fn pid_in_process_census_takes_in_the_blocks_live_before() {
    let _g = shared();
    let (mut target, mut out, mut line) =
        piped(&mut Command::new(fixture("beforeattach", "", &[])));
    let before = pair(&line, "before");
    assert_eq!(before.0, 64);
    line.clear();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "ready\n");
    let json = json_path("pid-in-process-census");
    let mut cmd = attach_cmd(target.id(), &json);
    cmd.args(["--census", "--mode", "stacks"]);
    let tracer = start_attached(&mut cmd);
    // What the process holds now, attached and waiting: the census's oracle.
    let heap = heaptrace()
        .args([
            "heap",
            "-p",
            &target.id().to_string(),
            "--stop",
            "--json",
            "-",
        ])
        .output()
        .unwrap();
    assert!(heap.status.success(), "{heap:?}");
    let heap: serde_json::Value = serde_json::from_slice(&heap.stdout).unwrap();
    let held = (n(&heap["in_use"]["blocks"]), n(&heap["in_use"]["bytes"]));
    assert!(held.0 >= before.0, "{}", heap["in_use"]);
    target.stdin.take().unwrap().write_all(b"x").unwrap();
    line.clear();
    out.read_line(&mut line).unwrap();
    let freed = pair(&line, "freed");
    assert!(target.wait().unwrap().success());
    let (code, stderr) = tracer.wait();
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stderr.contains("blocks live before now taken in"),
        "{stderr}"
    );
    let doc = read_json(&json);
    let live = &doc["live"];
    assert_eq!(n(&live["before_attach"]["blocks"]), held.0, "{live}");
    assert_eq!(n(&live["before_attach"]["bytes"]), held.1, "{live}");
    assert_eq!(n(&live["before_attach"]["lost_blocks"]), 0, "{live}");
    let free = &doc["functions"]["free"];
    assert_eq!(n(&free["untracked"]), 0, "{free}");
    assert_eq!(n(&free["calls"]), freed.0, "{free}");
    assert_eq!(n(&free["bytes"]), freed.1, "{free}");
    let left = (held.0 - freed.0, held.1 - freed.1);
    assert_eq!(n(&live["blocks"]), left.0 + 10, "{live}");
    assert_eq!(n(&live["bytes"]), left.1 + 640, "{live}");
    let old: Vec<&serde_json::Value> = doc["leaks"]["by_stack"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["stack_id"].as_i64() == Some(i32::MIN as i64 + 2))
        .collect();
    assert_eq!(old.len(), 1, "{}", doc["leaks"]);
    assert_eq!((n(&old[0]["blocks"]), n(&old[0]["bytes"])), left);
    assert_eq!(old[0]["frames"][0]["function"], "[allocated before attach]");
}

/// A library dlopened after the attach (tests/fixtures/dlopenwork.c): its GOT entries are
/// redirected at the program's `dlsym` of it, before its first call, so that each of its
/// 300 malloc(4321) and its calloc(3, 1111) is counted, and each free of them known.
#[test]
fn pid_in_process_counts_a_library_loaded_after_the_attach() {
    let _g = shared();
    let lib = fixture("dlopenwork", "", &["-shared", "-fPIC"]);
    let mut target = Command::new(fixture("dlopenlater", "", &[]));
    target.arg(&lib).arg("300");
    let (json, done) = attached_run(target, "pid-in-process-dlopen", "sizes");
    assert_eq!(done, "done\n");
    let doc = read_json(&json);
    let sizes = crate::expect::Expected::observed_sizes(&doc["sizes"]);
    assert_eq!(sizes.get(&("malloc".into(), 4321)), Some(&300), "{sizes:?}");
    assert_eq!(sizes.get(&("calloc".into(), 3333)), Some(&1), "{sizes:?}");
    let free = &doc["functions"]["free"];
    assert!(n(&free["calls"]) >= 301, "{free}");
    assert_eq!(n(&free["untracked"]), 0, "{free}");
}

/// Starts `target` (which says "ready", works on a byte on stdin, then says its last line),
/// attaches in `mode`, lets it work, detaches; returns the JSON's path and that last line.
fn attached_run(mut target: Command, tag: &str, mode: &str) -> (std::path::PathBuf, String) {
    let (mut target, mut out, mut line) = piped(&mut target);
    assert_eq!(line, "ready\n");
    let json = json_path(tag);
    let mut cmd = attach_cmd(target.id(), &json);
    cmd.args(["--mode", mode]);
    let tracer = start_attached(&mut cmd);
    let mut stdin = target.stdin.take().unwrap();
    stdin.write_all(b"g").unwrap();
    line.clear();
    out.read_line(&mut line).unwrap();
    tracer.signal(libc::SIGINT);
    let (code, stderr) = tracer.wait();
    assert_eq!(code, 0, "{stderr}");
    drop(stdin);
    assert!(target.wait().unwrap().success());
    (json, line)
}

/// A C++ program allocating through libstdc++'s operator new (its malloc and free entries
/// redirected as any module's): 500 new char[777] and 500 new std::vector<int>(250) counted
/// exactly, each as malloc of its size, every delete a free of a known block.
#[test]
fn pid_in_process_counts_operator_new_of_libstdcxx() {
    let _g = shared();
    let mut target = Command::new(cpp_fixture("cppnew"));
    target.arg("500");
    let (json, done) = attached_run(target, "pid-in-process-cpp", "stacks");
    assert!(done.starts_with("done"), "{done}");
    let doc = read_json(&json);
    assert_eq!(sized(&doc, "malloc", 777), 500);
    assert_eq!(sized(&doc, "malloc", 1000), 500);
    assert_eq!(sized(&doc, "malloc", 24), 500);
    let free = &doc["functions"]["free"];
    assert!(n(&free["calls"]) >= 1500, "{free}");
    assert_eq!(n(&free["untracked"]), 0, "{free}");
    // Their stacks go through operator new, in libstdc++.
    let stacks = doc["stacks"].as_array().unwrap();
    let through_new = stacks.iter().any(|s| {
        s["frames"].as_array().unwrap().iter().any(|f| {
            f["module"]
                .as_str()
                .is_some_and(|m| m.contains("libstdc++"))
                && f["function"]
                    .as_str()
                    .is_some_and(|n| n.contains("operator new"))
        })
    });
    assert!(through_new, "no stack through libstdc++'s operator new");
}
