//! `--all --comm` and `--all --cgroup`: the processes left out are judged in the kernel, their
//! allocators unprobed where nothing matches, their figures kept out of every view.
use std::{
    io::{BufRead as _, BufReader, Write as _},
    process::{Command, Stdio},
    time::Duration,
};

use serde_json::Value;

use crate::{
    expect::{Expected, Fixture},
    support::*,
    system::*,
};

bpf_test!(
    exclusive,
    /// Under `--comm`, a static executable the filter leaves out gets no probes: they would trap in
    /// its every call and count nothing.
    fn all_with_a_comm_filter_leaves_the_allocators_of_the_others_unprobed() {
        let bin = fixture("allocs", "-static", &["-static"]);
        let (tracer, json) =
            start_all("sys-static-out", &["--mode", "counts", "--comm", "recurse"]);
        let mut cmd = Command::new(&bin);
        cmd.args(["0", "20", "1", "wait"]);
        let child = ready(cmd);
        let pid = u64::from(child.id());
        // Alive meanwhile: long enough to be looked at
        // (`all_attaches_a_static_binary_started_later` waits for its probes).
        std::thread::sleep(Duration::from_millis(500));
        go(child);
        std::thread::sleep(Duration::from_millis(300));
        let (stderr, doc) = stop(tracer, &json);
        assert!(!stderr.contains("also tracing"), "{stderr}");
        let procs = doc["processes"].as_array().unwrap();
        assert!(
            procs.iter().all(|p| p["pid"].as_u64() != Some(pid)),
            "{procs:?}"
        );
    }
);

bpf_test!(
    exclusive,
    /// `--comm` keeps only the matching processes, in every figure; each carries its cgroup.
    fn all_with_a_comm_filter_reports_only_matching_processes() {
        let bin = fixture("allocs", "", &[]);
        let (tracer, json) = start_all("sys-comm", &["--mode", "sizes", "--comm", "allocs"]);
        let fx = Fixture::main_thread(200, 2);
        let mut cmd = Command::new(&bin);
        cmd.args(["0", "200", "2", "wait"]);
        let child = ready(cmd);
        let pid = child.id();
        go(child);
        // Something else that allocates, and must not show.
        assert!(
            Command::new("sh")
                .args(["-c", "ls / > /dev/null"])
                .status()
                .unwrap()
                .success()
        );
        std::thread::sleep(Duration::from_millis(500));
        let (_, doc) = stop(tracer, &json);
        let procs = doc["processes"].as_array().unwrap();
        assert!(procs.iter().all(|p| p["comm"] == "allocs"), "{procs:?}");
        let p = process(&doc, pid);
        assert!(
            p["cgroup"].as_str().is_some_and(|c| c.starts_with('/')),
            "{}",
            p["cgroup"]
        );
        check_fixture_sizes(p, &fx);
        // The top-level figures are those of the matching processes only, leaks too (those of
        // `sh` and `ls` were in them, taken at their ends).
        assert_eq!(doc["functions"], p["functions"]);
        assert_eq!(
            doc["leaks"]["blocks"], p["leaks"]["blocks"],
            "{}",
            doc["leaks"]
        );
        assert_eq!(
            doc["leaks"]["bytes"], p["leaks"]["bytes"],
            "{}",
            doc["leaks"]
        );
    }
);

bpf_test!(
    exclusive,
    /// With `--comm`, the stacks said lost are the matching processes' own. The kernel counts
    /// lost stacks for every process it traces, and the others' take the stack maps' room too:
    /// `recurse 6` (127 mallocs, each its own stack) beside `sites 10` (33), in maps of two
    /// stacks. Before, `lost.stack` was the kernel's count: more than `sites` allocated.
    fn all_with_a_comm_filter_reports_only_matching_stack_losses() {
        let (tracer, json) = start_all(
            "sys-comm-lost",
            &["--comm", "sites", "--stack-map-size", "2"],
        );
        run_ok(Command::new(fixture("recurse", "", &[])).arg("6"));
        run_ok(Command::new(fixture("sites", "", &[])).arg("10"));
        std::thread::sleep(Duration::from_millis(500));
        let (_, doc) = stop(tracer, &json);
        assert_eq!(doc["totals"]["allocations"], 33, "{}", doc["functions"]);
        let stacks = doc["stacks"].as_array().unwrap();
        let partial = |s: &Value| {
            s["frames"]
                .as_array()
                .and_then(|f| f.last())
                .and_then(|f| f["function"].as_str())
                .is_some_and(|f| f.starts_with("[more frames lost"))
        };
        let lost: u64 = stacks
            .iter()
            .filter(|s| s["stack_id"].as_i64() < Some(0) || partial(s))
            .map(|s| s["calls"].as_u64().unwrap())
            .sum();
        assert!(lost > 0 && lost <= 33, "{lost}: {stacks:?}");
        assert_eq!(doc["lost"]["stack"].as_u64(), Some(lost), "{}", doc["lost"]);
        // The kernel judges the processes too: recurse, left out there, took no stack and lost
        // none (before, the kernel's count was over 100 more: recurse's).
        let all = doc["lost"]["stack_all_processes"].as_u64().unwrap();
        assert_eq!(all, lost, "{}", doc["lost"]);
    }
);

bpf_test!(
    exclusive,
    /// The kernel leaves out the processes `--comm` does not match: `recurse 6`'s 127 stacks,
    /// traced first, take no room in a stack map of 16, and the `sites 10` after it keeps its 4
    /// whole (filtered in user space alone, recurse filled the map and sites lost every one).
    fn all_with_a_comm_filter_keeps_the_others_out_of_the_kernel_maps() {
        others_take_no_stack_room("sys-comm-kernel", &["--comm", "sites"], |bin| {
            let mut cmd = Command::new(bin);
            cmd.arg("10");
            cmd
        });
    }
);

bpf_test!(
    exclusive,
    /// The judging programs stay cheap to verify (start-up time): with `--comm`, malloc's entry
    /// program goes through ~3,200 instructions here and free's ~4,800 (230 and 1,900 without); a
    /// byte-by-byte matcher was ~5,500 and ~7,100, one whose compares LLVM turned into branches
    /// ~6,400 and ~8,000. Not a timing: the count is the kernel's, the same every load.
    fn all_with_a_comm_filter_verifies_the_judging_programs_within_bounds() {
        let bin = fixture("pairs", "", &[]);
        let (tracer, json) = start_all("sys-comm-verified", &["--comm", "pairs", "--probe-stats"]);
        run_ok(Command::new(&bin).arg("100"));
        std::thread::sleep(Duration::from_millis(300));
        let (_, doc) = stop(tracer, &json);
        let verified = |name: &str| program(&doc, name)["verified_insns"].as_u64().unwrap();
        let (entry, free) = (verified("malloc_entry"), verified("free_entry"));
        assert!((1_000..=5_000).contains(&entry), "malloc_entry: {entry}");
        assert!((2_000..=6_000).contains(&free), "free_entry: {free}");
    }
);

bpf_test!(
    exclusive,
    /// A process is judged by its main thread's name, in the kernel as in user space: threads
    /// that named themselves otherwise (`pthread_setname_np`) are counted, every call exact.
    fn all_with_a_comm_filter_counts_threads_named_otherwise() {
        let bin = fixture("allocs", "", &[]);
        let (tracer, json) = start_all("sys-comm-named", &["--comm", "allocs"]);
        let fx = Fixture {
            threads: 2,
            ..Fixture::main_thread(100, 2)
        };
        let want = Expected::of(&fx).with_glibc_threads(2, 272);
        let mut child = Command::new(&bin)
            .args(["2", "100", "2", "named"])
            .spawn()
            .unwrap();
        assert!(child.wait().unwrap().success());
        std::thread::sleep(Duration::from_millis(500));
        let (_, doc) = stop(tracer, &json);
        let p = process(&doc, child.id());
        let got = Expected::observed(p, &serde_json::json!([]), &want);
        assert_eq!(got.funcs, want.funcs);
        assert_eq!(got.free_calls, want.free_calls);
        assert_eq!(p["leaks"]["blocks"].as_u64(), Some(want.live_blocks));
    }
);

/// A name no process can have is refused: the kernel keeps at most 15 bytes of one.
#[test]
fn all_with_a_comm_longer_than_any_name_is_refused() {
    let out = heaptrace()
        .args(["--all", "--no-tui", "--comm", "sixteen-bytes-xx"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("15 bytes"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}

bpf_test!(
    exclusive,
    /// The kernel leaves out the threads of the cgroups `--cgroup` does not match: `recurse 6`'s
    /// 127 stacks in the test's cgroup take no room in a stack map of 16, and a `sites 10` in a
    /// cgroup of its own keeps its 4 whole (as `--comm` does, by name).
    fn all_with_a_cgroup_filter_keeps_the_others_out_of_the_kernel_maps() {
        let cg = TestCgroup::new("kernel");
        others_take_no_stack_room("sys-cgroup-kernel", &["--cgroup", &cg.name], |bin| {
            cg.exec_in(bin, "10")
        });
    }
);

bpf_test!(
    exclusive,
    /// A process left out by its cgroup, then moved into the one traced (no exec), is counted from
    /// its move: its threads are judged again in their new cgroup, made after heaptrace started
    /// (judged by user space once a round; traced meanwhile). The one malloc(1) before the move is
    /// not seen, the work after it exactly.
    fn all_with_a_cgroup_filter_counts_a_process_moved_into_it() {
        let bin = fixture("allocs", "", &[]);
        let name = format!("heaptrace-test-moved-{}", std::process::id());
        let (tracer, json) = start_all("sys-cgroup-moved", &["--mode", "sizes", "--cgroup", &name]);
        let mut child = Command::new(&bin)
            .args(["0", "100", "2", "wait", "early", "hold"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut stdin = child.stdin.take().unwrap();
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line, "ready\n");
        let cg = TestCgroup::new("moved");
        assert_eq!(cg.name, name);
        std::fs::write(cg.dir.join("cgroup.procs"), pid.to_string()).unwrap();
        // It lives on past a round: user space judges a process gone by the cgroup of its exec.
        stdin.write_all(b"g").unwrap();
        line.clear();
        out.read_line(&mut line).unwrap();
        assert_eq!(line, "done\n");
        std::thread::sleep(Duration::from_millis(500));
        drop(stdin);
        assert!(child.wait().unwrap().success());
        let (stderr, doc) = stop(tracer, &json);
        let procs = doc["processes"].as_array().unwrap();
        assert_eq!(procs.len(), 1, "{procs:?} {stderr}");
        let p = process(&doc, pid);
        assert_eq!(p["cgroup"], format!("/{name}"));
        check_fixture_sizes(p, &Fixture::main_thread(100, 2));
    }
);
