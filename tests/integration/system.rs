//! System-wide mode beyond the host's libc: allocators that appear after heaptrace started (a
//! static executable, a private copy of libc in its own mount namespace), and the clean-up of
//! processes that end.
use std::{
    io::Write as _,
    process::{Child, Command},
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
