//! System-wide mode and processes that end: the oldest folded into one past `--keep-exited`,
//! short-lived ones (milliseconds, ten at a time, 200 in all) counted exactly and named, and
//! a pid given again kept apart from the process that had it.
use std::{
    io::{BufRead as _, Write as _},
    process::{Child, Command},
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
    /// Bounded memory on a host that starts processes all the time: past `--keep-exited`, ended
    /// processes fold into one, `[N exited processes]`, with their counts, sizes and leaks summed
    /// exactly, and their sites by frames (the same code in five runs is one site).
    fn all_folds_the_oldest_ended_processes_into_one() {
        let bin = fixture("allocs", "", &[]);
        let rec = json_path("sys-fold").with_extension("bin");
        let json = json_path("sys-fold");
        let tracer = start_attached(
            heaptrace()
                .args(["record", "-o"])
                .arg(&rec)
                .args(["--all", "--no-tui", "-q", "--interval", "200ms"])
                .args(["--comm", "allocs", "--keep-exited", "2", "--json"])
                .arg(&json),
        );
        let fx = Fixture::main_thread(100, 1);
        let mut pids = Vec::new();
        for _ in 0..5 {
            // Held alive for a round after its work: its stacks are named then. A process of a few
            // milliseconds may end before its libraries' mappings are read (best effort, see
            // `all_names_the_executable_frames_of_millisecond_processes`), and its sites would
            // then not be the others' to fold with; under load that happened in 2 runs of 8.
            // It waits before its work, too: a process that execs under `--all` is walked by
            // frame pointer until the daemon has read its mappings (`lost.unwind_late`), and
            // stacks cut by that timing in some runs and not others would not fold as one.
            pids.push(run_held(&bin));
            // Two rounds: one reads its last counts, the next sees it gone.
            std::thread::sleep(Duration::from_millis(500));
        }
        let (stderr, doc) = stop(tracer, &json);
        let want = Expected::of(&fx);
        let procs = doc["processes"].as_array().unwrap();
        assert_eq!(procs.len(), 3, "{}", doc["processes"]);
        // The last two as they were; the first three folded.
        for pid in &pids[3..] {
            let p = process(&doc, *pid);
            assert_eq!(Expected::observed(p, &p["sizes"], &want), want, "{p}");
        }
        let folded = procs.iter().find(|p| p["folded"] == true).unwrap();
        assert_eq!(folded["comm"], "[3 exited processes]");
        assert_eq!(
            folded["totals"]["allocations"].as_u64(),
            Some(3 * doc["totals"]["allocations"].as_u64().unwrap() / 5)
        );
        assert_eq!(
            folded["leaks"]["blocks"].as_u64(),
            Some(3 * want.live_blocks),
            "{}",
            folded["leaks"]
        );
        // The fixture's loop mallocs 1001 bytes from one line 100 times a run, and leaks a
        // 777-byte block: three runs, one site each.
        let folded_malloc = |bytes: u64| -> Vec<&Value> {
            doc["stacks"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|s| s["folded"] == true && s["function"] == "malloc")
                .filter(|s| s["bytes"].as_u64() == Some(bytes))
                .collect()
        };
        let loop_site = folded_malloc(3 * 100 * 1001);
        assert_eq!(loop_site.len(), 1, "{}", doc["stacks"]);
        assert_eq!(loop_site[0]["calls"], 300);
        assert_eq!(loop_site[0]["frames"][0]["module"], "allocs");
        let leak_site = folded_malloc(3 * 777);
        assert_eq!(leak_site.len(), 1, "{leak_site:?}");
        assert_eq!(leak_site[0]["live_blocks"], 3);
        assert!(stderr.contains("[3 exited processes]"), "{stderr}");

        report_folds_as_the_trace_did(&rec, &doc);
        let _ = std::fs::remove_file(&rec);
    }
);

/// Runs the fixture once, held at its start and after its work (see the folding test), and
/// returns its pid once it ended.
fn run_held(bin: &std::path::Path) -> u32 {
    let (mut c, mut out, mut line) =
        piped(Command::new(bin).args(["0", "100", "1", "wait", "hold"]));
    assert_eq!(line, "ready\n");
    std::thread::sleep(Duration::from_millis(500));
    c.stdin.as_mut().unwrap().write_all(b"g").unwrap();
    line.clear();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "done\n");
    std::thread::sleep(Duration::from_millis(300));
    drop(c.stdin.take());
    assert!(c.wait().unwrap().success());
    c.id()
}

/// The recording's report folds ended processes as the live trace did: the same processes,
/// figures and sites. Before, it listed all five, and the folded leaks under a process it
/// lacked.
fn report_folds_as_the_trace_did(rec: &std::path::Path, doc: &Value) {
    let off = crate::recording::report_json(&[rec.to_str().unwrap(), "overview"]);
    let procs = |d: &Value| -> Vec<Value> {
        d["processes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| serde_json::json!([p["pid"], p["comm"], p["totals"], p["leaks"], p["folded"]]))
            .collect()
    };
    assert_eq!(procs(&off), procs(doc));
    let sites = |d: &Value| -> Vec<Value> {
        let mut v: Vec<Value> = d["stacks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                let frames: Vec<&Value> = s["frames"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|f| &f["function"])
                    .collect();
                serde_json::json!([s["pid"], s["function"], s["calls"], s["bytes"], frames])
            })
            .collect();
        v.sort_by_key(|x| x.to_string());
        v
    };
    assert_eq!(sites(&off), sites(doc));
    assert_eq!(off["totals"], doc["totals"]);
    // Both say what the trace was narrowed to (a recording before format 8 could not: its
    // report called these figures "all processes").
    assert_eq!(doc["target"]["comm"], "allocs", "{}", doc["target"]);
    assert!(doc["target"]["cgroup"].is_null(), "{}", doc["target"]);
    assert_eq!(off["target"], doc["target"]);
    let out = heaptrace().arg("report").arg(rec).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("target: all processes whose name contains \"allocs\"\n"),
        "{text}"
    );
}

bpf_test!(
    /// 200 short-lived processes started during a system-wide trace (ten at a time) are all
    /// counted, each exactly, and each is marked ended.
    fn all_counts_every_one_of_200_short_lived_processes() {
        count_200_short_lived_processes("sys-churn", &[]);
    }
);

bpf_test!(
    /// One process slot per CPU (`--proc-slots 1`): of the ten processes running at once, one
    /// counts in the slot and the others in the process map, and a process that takes a slot freed
    /// by an ended one must start from zero.
    fn processes_sharing_one_slot_count_exactly() {
        count_200_short_lived_processes("sys-churn-slot", &["--proc-slots", "1"]);
    }
);

/// 200 `allocs 0 20 1`, ten at a time, under `--all`: each one's counts exact.
pub(crate) fn count_200_short_lived_processes(name: &str, extra: &[&str]) {
    let _g = exclusive();
    let bin = fixture("allocs", "", &[]);
    // Every process in the document (200 pass the default 100).
    let mut args = vec![
        "--mode",
        "counts",
        "--comm",
        "allocs",
        "--json-max-processes",
        "1000",
    ];
    args.extend_from_slice(extra);
    let (tracer, json) = start_all(name, &args);
    let fx = Fixture::main_thread(20, 1);
    let want = Expected::of(&fx);
    let mut pids = Vec::new();
    for _ in 0..20 {
        let batch: Vec<Child> = (0..10)
            .map(|_| Command::new(&bin).args(["0", "20", "1"]).spawn().unwrap())
            .collect();
        for mut c in batch {
            pids.push(c.id());
            assert!(c.wait().unwrap().success());
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    let (_, doc) = stop(tracer, &json);
    assert_eq!(doc["lost"]["process_map"], 0);
    assert_eq!(doc["lost"]["in_flight"], 0);
    for pid in &pids {
        let p = process(&doc, *pid);
        let got = Expected::observed(p, &serde_json::json!([]), &want);
        assert_eq!(got.funcs, want.funcs, "pid {pid}");
        assert_eq!(got.free_calls, want.free_calls, "pid {pid}");
        assert_eq!(p["exited"], true, "pid {pid}");
        assert_eq!(
            p["leaks"]["blocks"].as_u64(),
            Some(want.live_blocks),
            "pid {pid}"
        );
    }
    assert_eq!(doc["processes"].as_array().unwrap().len(), pids.len());
}

bpf_test!(
    exclusive,
    /// `recurse 7` lives about a millisecond past its first allocation, often too short for its
    /// mappings to be read at its first memory syscall: 10 of 20 runs had every stack named, 10
    /// none (release build; this test's debug build missed 3-4 of 8). A thread now reads them
    /// right at its exec (the executable is mapped then), so its own frames are named in every
    /// run, its libraries' where the later read came in time. The read races the process, so one
    /// run of eight may miss it.
    fn all_names_the_executable_frames_of_millisecond_processes() {
        let bin = fixture("recurse", "", &[]);
        let (tracer, json) = start_all("sys-named-exec", &["--comm", "recurse"]);
        let pids: Vec<u32> = (0..8)
            .map(|_| {
                let mut c = Command::new(&bin).arg("7").spawn().unwrap();
                assert!(c.wait().unwrap().success());
                std::thread::sleep(Duration::from_millis(100));
                c.id()
            })
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        let (_, doc) = stop(tracer, &json);
        let unnamed: Vec<u32> = pids
            .iter()
            .copied()
            .filter(|pid| {
                !doc["stacks"].as_array().unwrap().iter().any(|s| {
                    s["pid"].as_u64() == Some(u64::from(*pid))
                        && s["frames"][0]["function"] == "node"
                })
            })
            .collect();
        assert!(unnamed.len() <= 1, "unnamed: {unnamed:?} of {pids:?}");
    }
);

bpf_test!(
    exclusive,
    /// Processes that live a few milliseconds, each ended before a round could read its mappings:
    /// their stacks are named all the same (the mappings are read at a process's first memory
    /// syscall, in its first allocations). Before, every frame read `[unknown] 0x...`.
    fn all_names_the_stacks_of_short_lived_processes() {
        let bin = fixture("allocs", "", &[]);
        let (tracer, json) = start_all("sys-named", &["--comm", "allocs"]);
        let pids: Vec<u32> = (0..5)
            .map(|_| {
                let mut c = Command::new(&bin).args(["0", "20", "1"]).spawn().unwrap();
                assert!(c.wait().unwrap().success());
                c.id()
            })
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        let (_, doc) = stop(tracer, &json);
        for pid in pids {
            let sites: Vec<&Value> = doc["stacks"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|s| s["pid"].as_u64() == Some(u64::from(pid)))
                .collect();
            assert!(!sites.is_empty(), "pid {pid}");
            for s in sites {
                let f = &s["frames"][0];
                assert_eq!(f["module"], "allocs", "pid {pid}: {s}");
                assert!(
                    !f["function"].as_str().unwrap().starts_with("[unknown]"),
                    "pid {pid}: {s}"
                );
            }
        }
    }
);

/// Starts `cmd` as process `pid`: the kernel's last pid is set to the one before
/// (`ns_last_pid`, root in the host's pid namespace), tried again while others take it first.
pub(crate) fn spawn_as(cmd: &mut Command, pid: u32) -> Child {
    for _ in 0..200 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).unwrap();
        let mut child = cmd.spawn().unwrap();
        if child.id() == pid {
            return child;
        }
        child.wait().unwrap();
    }
    panic!("pid {pid} was always taken first");
}

bpf_test!(
    exclusive,
    fn all_keeps_apart_two_processes_with_one_pid() {
        let bin = fixture("allocs", "", &[]);
        let (tracer, json) = start_all("sys-pid-again", &["--comm", "allocs"]);
        let fx = Fixture::main_thread(100, 1);
        let mut first = Command::new(&bin).args(["0", "100", "1"]).spawn().unwrap();
        let pid = first.id();
        assert!(first.wait().unwrap().success());
        // Two rounds: one reads its last counts, the next sees it gone.
        std::thread::sleep(Duration::from_millis(600));
        let mut again = spawn_as(Command::new(&bin).args(["0", "100", "1"]), pid);
        assert!(again.wait().unwrap().success());
        std::thread::sleep(Duration::from_millis(600));
        let (stderr, doc) = stop(tracer, &json);
        let want = Expected::of(&fx);
        let procs: Vec<&Value> = doc["processes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| p["pid"].as_u64() == Some(u64::from(pid)))
            .collect();
        assert_eq!(procs.len(), 2, "{}", doc["processes"]);
        assert_eq!(
            procs
                .iter()
                .map(|p| p["instance"].as_u64())
                .collect::<Vec<_>>(),
            [None, Some(2)]
        );
        for p in procs {
            let got = Expected::observed(p, &p["sizes"], &want);
            assert_eq!(got, want, "{p}");
            assert_eq!(p["exited"], true);
            assert_eq!(p["leaks"]["blocks"].as_u64(), Some(want.live_blocks));
            assert_eq!(p["leaks"]["bytes"].as_u64(), Some(want.live_bytes));
            // Its sites hold exactly its successful allocations' bytes.
            let site_bytes: u64 = doc["stacks"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|s| s["pid"] == p["pid"] && s["instance"] == p["instance"])
                .map(|s| s["bytes"].as_u64().unwrap())
                .sum();
            assert_eq!(
                site_bytes,
                want.funcs.values().map(|f| f.bytes).sum::<u64>()
            );
        }
        assert!(stderr.contains(&format!("{pid}#2 allocs")), "{stderr}");
    }
);
