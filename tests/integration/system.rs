//! System-wide mode beyond the host's libc: allocators that appear after heaptrace started (a
//! static executable, a private copy of libc in its own mount namespace), and the clean-up of
//! processes that end.
use std::{
    io::{BufRead as _, BufReader, Write as _},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::Value;

use crate::{
    expect::{Expected, Fixture},
    support::*,
};

pub fn start_all(tag: &str, extra: &[&str]) -> (Running, std::path::PathBuf) {
    let json = json_path(tag);
    let mut cmd = heaptrace();
    cmd.args(["--all", "--no-tui", "-q", "--interval", "200ms"])
        .args(extra)
        .arg("--json")
        .arg(&json);
    (start_attached(&mut cmd), json)
}

/// Interrupts heaptrace as Ctrl-C would; it must exit cleanly. Returns its stderr and JSON.
pub fn stop(tracer: Running, json: &std::path::Path) -> (String, Value) {
    tracer.signal(libc::SIGINT);
    let (code, stderr) = tracer.wait();
    assert_eq!(code, 0, "{stderr}");
    (stderr, read_json(json))
}

/// Waits until heaptrace's stderr has `needle`.
pub(crate) fn wait_for(tracer: &Running, needle: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !tracer.stderr.lock().unwrap().contains(needle) {
        assert!(
            Instant::now() < deadline,
            "no {needle:?} in {}",
            tracer.stderr.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub(crate) fn go(mut child: Child) {
    child.stdin.take().unwrap().write_all(b"g").unwrap();
    assert!(child.wait().unwrap().success());
}

/// Allocations of process `pid` (of `function` only, if given) counted at a whole stack: one
/// of more than a frame with nothing lost. Not always named: a process gone within
/// milliseconds may be gone before its mappings are read.
pub(crate) fn whole_stack_calls(doc: &Value, pid: u32, function: Option<&str>) -> u64 {
    doc["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["pid"].as_u64() == Some(u64::from(pid)))
        .filter(|s| function.is_none_or(|f| s["function"] == f))
        .filter(|s| {
            let frames = s["frames"].as_array().unwrap();
            frames.len() > 1
                && frames
                    .iter()
                    .all(|f| !f["function"].as_str().unwrap().contains("lost"))
        })
        .map(|s| s["calls"].as_u64().unwrap())
        .sum()
}

pub fn process(doc: &Value, pid: u32) -> &Value {
    doc["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"].as_u64() == Some(u64::from(pid)))
        .unwrap_or_else(|| panic!("pid {pid} not in {}", doc["processes"]))
}

pub(crate) fn sizes_of(p: &Value) -> std::collections::BTreeMap<(String, u64), u64> {
    p["sizes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                (
                    s["function"].as_str().unwrap().to_string(),
                    s["size"].as_u64().unwrap(),
                ),
                s["count"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// The fixture's own sizes, exactly: its work runs only after heaptrace said it attached.
pub(crate) fn check_fixture_sizes(p: &Value, fx: &Fixture) {
    let got = sizes_of(p);
    for ((func, size), n) in &Expected::of(fx).sizes {
        assert_eq!(got.get(&(func.clone(), *size)), Some(n), "{func} {size}");
    }
}

bpf_test!(
    exclusive,
    fn all_attaches_a_static_binary_started_later() {
        let bin = fixture("allocs", "-static", &["-static"]);
        let (tracer, json) = start_all("sys-static", &["--mode", "sizes"]);
        let fx = Fixture::main_thread(300, 3);
        let mut cmd = Command::new(&bin);
        cmd.args(["0", "300", "3", "wait"]);
        let child = ready(cmd);
        let pid = child.id();
        wait_for(&tracer, &format!("also tracing {}", bin.display()));
        go(child);
        std::thread::sleep(Duration::from_millis(500));
        let (_, doc) = stop(tracer, &json);
        let p = process(&doc, pid);
        check_fixture_sizes(p, &fx);
        assert_eq!(p["comm"], "allocs-static");
        assert_eq!(p["exited"], true);
        assert_eq!(p["leaks"]["blocks"].as_u64(), Some(4), "{}", p["leaks"]);
    }
);

bpf_test!(
    exclusive,
    /// A process in its own mount namespace, where libc.so.6 is another file (a bind-mounted copy):
    /// heaptrace finds it through /proc/PID/root and attaches that file too, once.
    fn all_attaches_a_private_libc_in_another_mount_namespace() {
        let host_libc = heaptrace::targets::allocator::host_libc_path().unwrap();
        let copy = workspace().join("target/fixtures/libc-copy.so.6");
        std::fs::copy(&host_libc, &copy).unwrap();
        let bin = fixture("allocs", "", &[]);
        let (tracer, json) = start_all("sys-mntns", &["--mode", "sizes"]);
        let fx = Fixture::main_thread(300, 3);
        let script = format!(
            "mount --bind {} {} && exec {} 0 300 3 wait",
            copy.display(),
            host_libc.display(),
            bin.display()
        );
        let mut cmd = Command::new("unshare");
        cmd.args(["-m", "--propagation", "private", "sh", "-c", &script]);
        let child = ready(cmd);
        let pid = child.id(); // unshare execs sh, which execs the fixture: the same pid
        wait_for(
            &tracer,
            &format!("also tracing {} (first seen in pid", host_libc.display()),
        );
        go(child);
        std::thread::sleep(Duration::from_millis(500));
        tracer.signal(libc::SIGINT);
        let (code, stderr) = tracer.wait();
        assert_eq!(code, 0, "{stderr}");
        // Once: other programs started meanwhile (a compiler with its own allocator) may be
        // traced too, and say so on lines of their own.
        let private = format!("also tracing {} (", host_libc.display());
        assert_eq!(stderr.matches(&private).count(), 1, "{stderr}");
        let doc = read_json(&json);
        check_fixture_sizes(process(&doc, pid), &fx);
    }
);

bpf_test!(
    exclusive,
    /// Processes that end give their live-map space back: the blocks of two processes that each
    /// leave 1500 behind are taken out of the live map when each ends (not found there at the
    /// end), with their leaks exact.
    fn exited_processes_free_their_map_space() {
        let bin = fixture("allocs", "", &[]);
        let (tracer, json) = start_all("sys-exit", &["--mode", "counts"]);
        let mut pids = Vec::new();
        for _ in 0..2 {
            let mut child = Command::new(&bin).args(["0", "0", "1500"]).spawn().unwrap();
            pids.push(child.id());
            assert!(child.wait().unwrap().success());
            // Two rounds: one sees it gone and forgets it.
            std::thread::sleep(Duration::from_millis(600));
        }
        let (stderr, doc) = stop(tracer, &json);
        assert_eq!(doc["lost"]["live_map"], 0, "{}", doc["lost"]);
        for pid in &pids {
            let p = process(&doc, *pid);
            assert_eq!(p["exited"], true);
            assert_eq!(
                p["leaks_at_exit"], true,
                "its live-map entries stayed until the end"
            );
            assert_eq!(p["leaks"]["blocks"].as_u64(), Some(1501), "{}", p["leaks"]);
            assert_eq!(p["leaks"]["bytes"].as_u64(), Some(1500 * 777 + 555));
        }
        // Their blocks went with them: the summary's live figure tells them apart.
        let ended = |k: &str| -> i64 {
            doc["processes"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|p| p["exited"] == true && p["leaks_at_exit"] == true)
                .map(|p| p["live"][k].as_i64().unwrap())
                .sum()
        };
        let of_ended = &doc["live"]["of_ended_processes"];
        assert_eq!(
            of_ended["blocks"].as_i64(),
            Some(ended("blocks")),
            "{of_ended}"
        );
        assert_eq!(
            of_ended["bytes"].as_i64(),
            Some(ended("bytes")),
            "{of_ended}"
        );
        assert!(ended("blocks") >= 2 * 1501, "{of_ended}");
        let running = doc["live"]["blocks"].as_i64().unwrap() - ended("blocks");
        let line = format!("live {running} blocks / ");
        let total = stderr
            .lines()
            .find(|l| l.starts_with("total: "))
            .unwrap_or_else(|| panic!("no total line: {stderr}"));
        assert!(total.contains(&line), "{total}");
        let left = format!(
            "in running processes (ended ones left {} blocks / ",
            ended("blocks")
        );
        assert!(total.contains(&left), "{total}");
    }
);

bpf_test!(
    exclusive,
    /// A process that starts and ends between two reads is ended by the round that first sees it
    /// (it was seen starting): the blocks it left (15 MB) are never live in the timeline, where
    /// they used to be for a round. Rounds of 2 s; the fixture runs for milliseconds right after
    /// one.
    fn a_process_gone_within_a_round_is_never_live() {
        let bin = fixture("allocs", "", &[]);
        let json = json_path("sys-within-round");
        let tracer = start_attached(
            heaptrace()
                .args(["--all", "--no-tui", "--mode", "counts", "--interval", "2s"])
                .arg("--json")
                .arg(&json),
        );
        wait_for(&tracer, "round 1:");
        let mut child = Command::new(&bin)
            .args(["0", "0", "20000"])
            .spawn()
            .unwrap();
        let pid = child.id();
        assert!(child.wait().unwrap().success());
        wait_for(&tracer, "round 3:");
        let (_, doc) = stop(tracer, &json);
        let p = process(&doc, pid);
        assert_eq!(
            (&p["exited"], &p["leaks_at_exit"]),
            (&true.into(), &true.into())
        );
        let left = 20000 * 777 + 555;
        assert_eq!(p["leaks"]["bytes"].as_i64(), Some(left), "{}", p["leaks"]);
        let rows = doc["timeline"].as_array().unwrap();
        let live = |i: usize| rows[i]["live_bytes"].as_i64().unwrap();
        assert!(
            rows[1]["allocations"].as_u64().unwrap() > 20000,
            "{}",
            rows[1]
        );
        assert!(live(1) - live(0) < left / 2, "{} then {}", rows[0], rows[1]);
    }
);

bpf_test!(
    exclusive,
    /// A process whose main thread ended first (pthread_exit) lives on in its other threads, its
    /// leader a zombie with empty maps. It used to be taken for gone at every round: forgotten,
    /// then seen again as another process, its counts read against nothing (2^64 - 1 allocations
    /// in a round). Now it is one process, counted exactly, its memory and frames read through a
    /// running thread.
    fn a_process_whose_main_thread_ended_lives_on_in_its_threads() {
        let bin = fixture("mainexit", "", &[]);
        let (tracer, json) = start_all("sys-mainexit", &["--comm", "mainexit"]);
        let n = 300u64;
        let mut child = Command::new(&bin).arg(n.to_string()).spawn().unwrap();
        let pid = child.id();
        assert!(child.wait().unwrap().success());
        std::thread::sleep(Duration::from_millis(600));
        let (_, doc) = stop(tracer, &json);
        let records: Vec<&Value> = doc["processes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| p["pid"].as_u64() == Some(u64::from(pid)))
            .collect();
        assert_eq!(records.len(), 1, "{records:?}");
        let p = records[0];
        let sizes = sizes_of(p);
        assert_eq!(sizes.get(&("malloc".into(), 4242)), Some(&n), "{sizes:?}");
        assert_eq!(sizes.get(&("malloc".into(), 4343)), Some(&3), "{sizes:?}");
        let mallocs = p["functions"]["malloc"]["calls"].as_u64().unwrap();
        assert!(mallocs < n + 100, "{}", p["functions"]);
        assert!(
            p["memory"]["rss_bytes"].as_u64().unwrap_or(0) > 0,
            "{}",
            p["memory"]
        );
        assert!(whole_stack_calls(&doc, pid, Some("malloc")) >= n);
        let named = doc["stacks"].as_array().unwrap().iter().any(|s| {
            s["pid"].as_u64() == Some(u64::from(pid))
                && s["frames"][0]["function"] == "work"
                && s["calls"].as_u64() >= Some(n)
        });
        assert!(named, "{}", doc["stacks"]);
    }
);

bpf_test!(
    shared,
    /// `-p` on a process whose main thread ended cannot see it (the kernel's per-process probe
    /// filter compares the main thread's address space, which is gone): one clear error, where it
    /// used to attach and count nothing.
    fn pid_of_a_process_whose_main_thread_ended_is_a_clear_error() {
        let mut child = Command::new(fixture("mainexit", "", &[]))
            .arg("300")
            .spawn()
            .unwrap();
        // Its main thread ends at once; its worker waits 400 ms before its work.
        std::thread::sleep(Duration::from_millis(100));
        let out = heaptrace()
            .args(["-p", &child.id().to_string(), "--no-tui"])
            .output()
            .unwrap();
        assert!(child.wait().unwrap().success());
        assert!(!out.status.success());
        let error = error_line(&out);
        assert!(error.contains("main thread has ended"), "{error}");
        assert!(error.contains("--all --comm mainexit"), "{error}");
    }
);

bpf_test!(
    exclusive,
    /// The kernel keeps a stack until it is deleted. Processes that ended used to keep theirs, so
    /// on a host that starts programs all the time the stack maps filled with the stacks of
    /// processes gone, and every later one lost its stacks. `recurse 7` allocates from 255
    /// stacks; eight runs one after the other take 2,040 (ASLR: each its own addresses). In maps
    /// of 514, they kept 250, 204, 51, then 0 whole stacks; then each a few less than 255 (two
    /// kernel stack maps, where a stack whose bucket was taken in both lost all but its caller);
    /// now each all 255 (ids from the stack's hash, two choices in 2^30). The map holds 1,024
    /// (`--stack-map-size 1024`): a run's stacks are freed a round or two after it ended, and in
    /// 512 a slow round left a run without room (CI).
    fn exited_processes_free_their_stacks() {
        let bin = fixture("recurse", "", &[]);
        let kept = recurse_one_after_another(&["--stack-map-size", "1024"], 8, || {
            let mut c = Command::new(&bin);
            c.arg("7");
            c
        });
        assert_eq!(kept, [255; 8]);
    }
);

/// Runs `cmd()` (a `recurse` fixture) `n` times one after the other under `--all --comm
/// recurse` with `extra`; the malloc calls with whole stacks of each run.
pub(crate) fn recurse_one_after_another(
    extra: &[&str],
    n: usize,
    cmd: impl Fn() -> Command,
) -> Vec<u64> {
    // Every run's stacks in the document (8 runs of 255 pass the default 2,000).
    let mut args = vec!["--comm", "recurse", "--json-max-stacks", "100000"];
    args.extend_from_slice(extra);
    let (tracer, json) = start_all("sys-stacks", &args);
    let mut pids = Vec::new();
    for _ in 0..n {
        let mut child = cmd().spawn().unwrap();
        pids.push(child.id());
        assert!(child.wait().unwrap().success());
        // Two rounds: one reads its last counts, the next sees it gone and frees its stacks.
        std::thread::sleep(Duration::from_millis(600));
    }
    let (stderr, doc) = stop(tracer, &json);
    let kept: Vec<u64> = pids
        .iter()
        .map(|p| whole_stack_calls(&doc, *p, Some("malloc")))
        .collect();
    // What a run short of its stacks had instead (once in CI, the last of four runs: 0).
    for (pid, n) in pids.iter().zip(&kept) {
        if *n != 255 {
            let sites: Vec<String> = doc["stacks"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|s| s["pid"].as_u64() == Some(u64::from(*pid)))
                .map(|s| format!("{} {} {}", s["function"], s["calls"], s["frames"]))
                .take(5)
                .collect();
            eprintln!(
                "pid {pid}: {n} whole; lost {}; process {}; sites {sites:?}; stderr {stderr}",
                doc["lost"],
                doc["processes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|p| p["pid"].as_u64() == Some(u64::from(*pid)))
                    .map_or("none".to_string(), |p| p
                        .to_string()
                        .chars()
                        .take(600)
                        .collect())
            );
        }
    }
    kept
}

bpf_test!(
    exclusive,
    /// The stack cache (`heaptrace_common::stack::cache_word`) names the ids of stacks seen
    /// before, and the stacks of a process gone are freed. Runs without address randomization
    /// (`setarch -R`) have the same stacks, so the same hashes: a run must not take the ids of
    /// the run before's from the cache once those were freed, or its sites name stacks no longer
    /// stored, or stored since by others. A build that kept the cache across frees (before the
    /// generation also moved on every round) lost the frames of the second and fourth runs' sites:
    /// [255, 13, 255, 12].
    fn a_stack_freed_is_not_taken_from_the_cache_again() {
        let bin = fixture("recurse", "", &[]);
        let kept = recurse_one_after_another(&[], 4, || {
            let mut c = Command::new("setarch");
            c.args(["x86_64", "-R"]).arg(&bin).arg("7");
            c
        });
        assert_eq!(kept, [255; 4]);
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
    /// A long trace of a busy host meets pids given again (after 32,768 processes here). The
    /// second process with a pid is its own: its counts, sizes and leaks exactly the fixture's,
    /// beside the first one's, and shown as `PID#2`. Before, its counts were added to the first's,
    /// under one process that had exited.
    /// A process that execs drops its earlier image's sites, and the stacks only they held are
    /// freed, as an ended process's are. Before, they stayed: a shell's forks that exec (a pyenv
    /// shim is some 35 bash processes a run) filled the stack maps, and under `--all` 54 % of
    /// 1.9 M allocations lost their stacks in 20 s. Ten `execfork -n 100 sites 10` one after
    /// the other, each leaving some 100 stacks behind at its exec, in a stack map of 512 (1,050 in
    /// all; in 256, two runs' stacks not yet freed at a slow round left the next without room).
    fn exec_frees_the_stacks_of_the_image_it_drops() {
        let launcher = fixture("execfork", "", &[]);
        let sites = fixture("sites", "", &[]);
        let (tracer, json) = start_all(
            "sys-exec-stacks",
            &["--comm", "sites", "--stack-map-size", "512"],
        );
        let mut pids = Vec::new();
        for _ in 0..10 {
            let mut cmd = Command::new(&launcher);
            cmd.env("EXECFORK_WAIT", "1")
                .args(["-n", "100"])
                .arg(&sites)
                .arg("10");
            let child = ready(cmd);
            pids.push(child.id());
            go(child);
            // Two rounds: one reads its last counts, the next sees it gone and frees its stacks.
            std::thread::sleep(Duration::from_millis(600));
        }
        let (_, doc) = stop(tracer, &json);
        let kept: Vec<u64> = pids
            .iter()
            .map(|p| whole_stack_calls(&doc, *p, None))
            .collect();
        // `sites 10` makes 33 allocations from five stacks, all whole. Before, from the third
        // run on none kept a whole stack: [33, 23, 0, 0, 0, 0, 0, 0, 0, 0]; then one of them
        // at times kept its caller only (its buckets taken in both kernel stack maps).
        assert_eq!(kept, [33; 10]);
    }
);

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
            let mut c = Command::new(&bin)
                .args(["0", "100", "1", "hold"])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
            pids.push(c.id());
            let mut line = String::new();
            BufReader::new(c.stdout.take().unwrap())
                .read_line(&mut line)
                .unwrap();
            assert_eq!(line, "done\n");
            std::thread::sleep(Duration::from_millis(300));
            drop(c.stdin.take());
            assert!(c.wait().unwrap().success());
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

        // The recording's report folds them as the live trace did: the same processes, figures
        // and sites. Before, it listed all five, and the folded leaks under a process it lacked.
        let out = heaptrace()
            .arg("report")
            .arg(&rec)
            .args(["overview", "--format", "json"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let off: Value = serde_json::from_slice(&out.stdout).unwrap();
        let procs = |d: &Value| -> Vec<Value> {
            d["processes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| {
                    serde_json::json!([p["pid"], p["comm"], p["totals"], p["leaks"], p["folded"]])
                })
                .collect()
        };
        assert_eq!(procs(&off), procs(&doc));
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
        assert_eq!(sites(&off), sites(&doc));
        assert_eq!(off["totals"], doc["totals"]);
        // Both say what the trace was narrowed to (a recording before format 8 could not: its
        // report called these figures "all processes").
        assert_eq!(doc["target"]["comm"], "allocs", "{}", doc["target"]);
        assert!(doc["target"]["cgroup"].is_null(), "{}", doc["target"]);
        assert_eq!(off["target"], doc["target"]);
        let out = heaptrace().arg("report").arg(&rec).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("target: all processes whose name contains \"allocs\"\n"),
            "{text}"
        );
        let _ = std::fs::remove_file(&rec);
    }
);

/// `recurse 6` (127 stacks; `filter` leaves it out), then `sites 10` (4 stacks, 33
/// allocations; kept), in a stack map of 16: sites' every allocation at a whole stack, and no
/// process the kernel traces lost one. `sites` makes the kept command from the fixture.
pub(crate) fn others_take_no_stack_room(
    tag: &str,
    filter: &[&str],
    sites: impl FnOnce(&std::path::Path) -> Command,
) {
    let recurse = fixture("recurse", "", &[]);
    let bin = fixture("sites", "", &[]);
    let mut args = filter.to_vec();
    args.extend(["--stack-map-size", "16"]);
    let (tracer, json) = start_all(tag, &args);
    run_ok(Command::new(&recurse).arg("6"));
    let mut child = sites(&bin).spawn().unwrap();
    assert!(child.wait().unwrap().success());
    std::thread::sleep(Duration::from_millis(500));
    let (_, doc) = stop(tracer, &json);
    assert_eq!(doc["lost"]["stack_all_processes"], 0, "{}", doc["lost"]);
    assert_eq!(doc["totals"]["allocations"], 33, "{}", doc["functions"]);
    let whole = whole_stack_calls(&doc, child.id(), None);
    assert_eq!(whole, 33, "{}", doc["stacks"]);
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

bpf_test!(
    exclusive,
    /// A process whose fork allocated between fork and exec (as a shell's does) is counted, once it
    /// exec'ed, as the new command alone: functions, sizes, sites and leaks exactly the fixture's.
    /// The launcher's child allocates 2 x 40 blocks of 4242 bytes, a round or more before the exec
    /// and right before it; none of them shows. `--comm allocs` judges it under its new name.
    fn all_restarts_a_process_at_exec() {
        let bin = fixture("allocs", "", &[]);
        let launcher = fixture("execfork", "", &[]);
        let (tracer, json) = start_all("sys-exec", &["--comm", "allocs"]);
        let fx = Fixture::main_thread(300, 3);
        let out = Command::new(&launcher)
            .arg("40")
            .arg(&bin)
            .args(["0", "300", "3"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let pid: u32 = String::from_utf8(out.stdout)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        std::thread::sleep(Duration::from_millis(500));
        let (_, doc) = stop(tracer, &json);
        let want = Expected::of(&fx);
        let p = process(&doc, pid);
        assert_eq!(p["comm"], "allocs");
        let got = Expected::observed(p, &p["sizes"], &want);
        assert_eq!(got, want, "pid {pid}");
        assert_eq!(p["exited"], true);
        assert_eq!(
            p["leaks"]["blocks"].as_u64(),
            Some(want.live_blocks),
            "{}",
            p["leaks"]
        );
        assert_eq!(
            p["leaks"]["bytes"].as_u64(),
            Some(want.live_bytes),
            "{}",
            p["leaks"]
        );
        // Its sites hold exactly its successful allocations' bytes.
        let site_bytes: u64 = doc["stacks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["pid"].as_u64() == Some(u64::from(pid)))
            .map(|s| s["bytes"].as_u64().unwrap())
            .sum();
        let alloc_bytes: u64 = want.funcs.values().map(|f| f.bytes).sum();
        assert_eq!(site_bytes, alloc_bytes);
        crate::exec::check_brk(&doc, p);
        assert_eq!(
            doc["processes"].as_array().unwrap().len(),
            1,
            "{}",
            doc["processes"]
        );
    }
);

/// The cgroup v2 mount point (a hybrid host mounts it at /sys/fs/cgroup/unified).
pub(crate) fn cgroup2_root() -> Option<std::path::PathBuf> {
    let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
    mounts.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.get(2) == Some(&"cgroup2")).then(|| std::path::PathBuf::from(f[1]))
    })
}

bpf_test!(
    exclusive,
    /// A process that lives for milliseconds in a cgroup of its own is named and placed from its
    /// exec event (taken in the kernel), not from /proc, which it may have left by the time
    /// heaptrace looks: `--cgroup` keeps it, with its exact counts.
    fn all_places_a_short_lived_process_in_its_cgroup() {
        let root = cgroup2_root().expect("a cgroup2 mount");
        let name = format!("heaptrace-test-{}", std::process::id());
        let dir = root.join(&name);
        std::fs::create_dir(&dir).expect("mkdir in the cgroup2 hierarchy");
        let bin = fixture("allocs", "", &[]);
        let (tracer, json) = start_all("sys-cgroup", &["--mode", "sizes", "--cgroup", &name]);
        // The shell moves itself into the cgroup, then becomes the fixture.
        let script = format!(
            "echo $$ > {}/cgroup.procs && exec {} 0 50 2",
            dir.display(),
            bin.display()
        );
        let status = Command::new("sh").args(["-c", &script]).status().unwrap();
        std::thread::sleep(Duration::from_millis(600));
        let (stderr, doc) = stop(tracer, &json);
        let _ = std::fs::remove_dir(&dir);
        assert!(status.success());
        let procs = doc["processes"].as_array().unwrap();
        assert_eq!(procs.len(), 1, "{procs:?} {stderr}");
        let p = &procs[0];
        assert_eq!(p["comm"], "allocs");
        assert_eq!(p["cgroup"], format!("/{name}"));
        let fx = Fixture::main_thread(50, 2);
        check_fixture_sizes(p, &fx);
    }
);

/// A cgroup of its own, made for one test (removed when dropped).
pub(crate) struct TestCgroup {
    pub(crate) name: String,
    pub(crate) dir: std::path::PathBuf,
}

impl TestCgroup {
    pub(crate) fn new(tag: &str) -> TestCgroup {
        let root = cgroup2_root().expect("a cgroup2 mount");
        let name = format!("heaptrace-test-{tag}-{}", std::process::id());
        let dir = root.join(&name);
        std::fs::create_dir(&dir).expect("mkdir in the cgroup2 hierarchy");
        TestCgroup { name, dir }
    }

    /// `sh -c` that moves itself into the cgroup, then becomes `bin args`.
    pub(crate) fn exec_in(&self, bin: &std::path::Path, args: &str) -> Command {
        let mut cmd = Command::new("sh");
        cmd.args([
            "-c",
            &format!(
                "echo $$ > {}/cgroup.procs && exec {} {args}",
                self.dir.display(),
                bin.display()
            ),
        ]);
        cmd
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

bpf_test!(
    shared,
    /// heaptrace's own allocations never reach the malloc family it probes. Under `--all` each of
    /// them would trap into its own probes (the programs return at once, the trap remains): with
    /// 10,000 live stacks that was some 23,000 calls a second, a third of the daemon's CPU time.
    /// Here one heaptrace traces another's `probes` command on this (large) test binary: with the
    /// system allocator the inner one made 46,772 allocation calls, now only what libc makes for
    /// itself (7).
    fn heaptraces_own_allocations_never_reach_the_probed_malloc() {
        let json = json_path("self-allocs");
        let me = std::process::id().to_string();
        let out = run_ok(
            heaptrace()
                .args(["--no-tui", "-q", "--mode", "calls", "--json"])
                .arg(&json)
                .arg("--")
                .arg(env!("CARGO_BIN_EXE_heaptrace"))
                .args(["probes", "-p", &me]),
        );
        let inner = String::from_utf8_lossy(&out.stdout);
        assert!(
            inner.contains("malloc"),
            "the inner heaptrace printed no plan: {inner}"
        );
        let doc = read_json(&json);
        assert_eq!(doc["target"]["exit_code"], 0);
        let f = &doc["functions"];
        let calls: u64 = [
            "malloc",
            "calloc",
            "realloc",
            "posix_memalign",
            "aligned_alloc",
        ]
        .iter()
        .map(|name| f[name]["calls"].as_u64().unwrap_or(0))
        .sum();
        assert!(calls > 0, "libc's own calls not seen: {f}");
        assert!(
            calls < 50,
            "heaptrace's allocations reach libc's malloc: {f}"
        );
    }
);
