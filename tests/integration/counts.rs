//! Exact counts per function and per size for every way of choosing a target.
use std::{io::Write as _, process::Command};

use serde_json::Value;

use crate::{
    expect::{Expected, Fixture},
    support::*,
};

pub const DTV: u64 = 272;

pub fn allocs() -> std::path::PathBuf {
    fixture("allocs", "", &[])
}

/// Run both ways: probes where placement puts them (the default), and all at the entry.
const AT_ENTRY: &[&str] = &["--probe-at-entry"];

/// Traces `BIN ARGS` launched by heaptrace with extra heaptrace `flags`; returns the JSON
/// document.
pub fn launch(
    tag: &str,
    flags: &[&str],
    bin: &std::path::Path,
    args: &[String],
    env: &[(&str, &str)],
) -> Value {
    let json = json_path(tag);
    let mut cmd = heaptrace();
    cmd.args(["--no-tui", "-q", "--json"])
        .arg(&json)
        .args(flags)
        .arg("--")
        .arg(bin)
        .args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = run_ok(&mut cmd);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("function"), "no summary table: {stderr}");
    let doc = read_json(&json);
    assert_eq!(doc["target"]["exit_code"], 0);
    assert_eq!(doc["lost"]["live_map"], 0);
    assert_eq!(doc["lost"]["in_flight"], 0);
    if flags.contains(&"--in-process") {
        assert_eq!(doc["heaptrace"]["collector"], "in-process");
        assert_eq!(doc["provider"]["probes"], serde_json::json!([]));
        return doc;
    }
    assert_eq!(doc["heaptrace"]["collector"], "kernel");
    check_placement(&doc, flags);
    check_counters(&doc, flags);
    doc
}

/// How the programs added to their counters: with preemption off where the kernel lets them
/// (6.10+: CI's does), atomically where `--atomic-counters` asks.
fn check_counters(doc: &Value, flags: &[&str]) {
    let counters = &doc["heaptrace"]["counters"];
    if flags.contains(&"--atomic-counters") {
        assert_eq!(counters, "atomic");
    } else if std::env::var_os("CI").is_some() {
        assert_eq!(
            counters, "preemption_off",
            "CI's kernel has bpf_preempt_disable"
        );
    } else {
        assert!(
            counters == "preemption_off" || counters == "atomic",
            "{counters}"
        );
    }
}

/// Functions with a uretprobe keep their entry probe where no push has run (the return address
/// at [rsp]); with --probe-at-entry, every probe is at the entry.
fn check_placement(doc: &Value, flags: &[&str]) {
    for p in doc["provider"]["probes"].as_array().unwrap() {
        let at = p["placement"]["offset"].as_u64().unwrap();
        if flags.contains(&"--probe-at-entry") {
            assert_eq!(at, 0, "{p}");
        }
        if p["uretprobe"] == true || flags.contains(&"--probe-at-entry") {
            assert_eq!(p["placement"]["pushes"], 0, "{p}");
        }
    }
}

pub fn args(fx: &Fixture, extra: &[&str]) -> Vec<String> {
    let mut a = vec![
        fx.threads.to_string(),
        fx.iterations.to_string(),
        fx.leaks.to_string(),
    ];
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

pub fn check_leaks(doc: &Value, want: &Expected) {
    // The live map scanned at exit agrees with the running live counters, block for block.
    assert_eq!(
        doc["leaks"]["blocks"].as_u64(),
        Some(want.live_blocks),
        "{}",
        doc["leaks"]
    );
    assert_eq!(
        doc["leaks"]["bytes"].as_u64(),
        Some(want.live_bytes),
        "{}",
        doc["leaks"]
    );
}

pub fn launch_exact(threads: u64, iterations: u64, leaks: u64, flags: &[&str]) {
    let _g = shared();
    let fx = Fixture {
        threads,
        iterations,
        leaks,
        memalign_apart: false,
        no_pvalloc: false,
    };
    let tag = format!("launch{threads}{}", flags.concat());
    let doc = launch(&tag, flags, &allocs(), &args(&fx, &[]), &[]);
    let want = Expected::of(&fx).with_glibc_threads(threads, DTV);
    let got = Expected::observed(&doc, &doc["sizes"], &want);
    assert_eq!(got, want);
    check_leaks(&doc, &want);
    assert_eq!(doc["aliases"]["memalign"], "aligned_alloc");
    assert!(doc["functions"].get("memalign").is_none());
    assert_eq!(doc["processes"].as_array().unwrap().len(), 1);
}

bpf_test!(
    fn launch_one_thread_counts_exactly() {
        launch_exact(0, 3000, 5, &[]);
    }
);

bpf_test!(
    fn launch_four_threads_counts_exactly() {
        launch_exact(4, 3000, 3, &[]);
    }
);

bpf_test!(
    /// The counting the kernel falls back to where the programs cannot turn preemption off, on
    /// both kinds of link (uprobe_multi, and aya's perf-event uprobes).
    fn launch_four_threads_with_atomic_counters_counts_exactly() {
        launch_exact(4, 3000, 3, &["--atomic-counters"]);
        launch_exact(4, 3000, 3, &["--atomic-counters", "--perf-uprobes"]);
    }
);

bpf_test!(
    /// Preemption off in the programs aya loads too (perf-event uprobes, where uprobe_multi
    /// links fail).
    fn launch_four_threads_on_perf_uprobes_counts_exactly() {
        launch_exact(4, 3000, 3, &["--perf-uprobes"]);
    }
);

bpf_test!(
    fn launch_four_threads_at_entry_counts_exactly() {
        launch_exact(4, 3000, 3, AT_ENTRY);
    }
);

/// Calls mode: malloc counted at its entry, with no return probe. Everything the fixture knows
/// that needs no live map stays exact: calls, bytes and failures per function (malloc's
/// failures here are requests above PTRDIFF_MAX, which calls mode counts at the entry), the
/// size histogram, frees and realloc's outcomes, nested calls (realloc(NULL, n) and
/// posix_memalign(16) run malloc's code) counted once and free(NULL) not at all. What needs
/// the live map is null, not zero.
fn calls_exact(threads: u64, flags: &[&str]) {
    let _g = shared();
    let fx = Fixture {
        threads,
        iterations: 3000,
        leaks: 3,
        memalign_apart: false,
        no_pvalloc: false,
    };
    let mut all = vec!["--mode", "calls"];
    all.extend_from_slice(flags);
    let tag = format!("calls{threads}{}", flags.concat());
    let doc = launch(&tag, &all, &allocs(), &args(&fx, &[]), &[]);
    let want = Expected::of(&fx).with_glibc_threads(threads, DTV);
    check_calls(&doc, &doc["sizes"], &want);
    check_calls_plan(&doc);
}

/// What calls mode shows of the fixture's work in `obj` (the document, or one of its
/// processes) with `sizes` its size histogram: exact where it needs no live map, null where
/// it would.
fn check_calls(obj: &Value, sizes: &Value, want: &Expected) {
    let want = want.calls_only();
    assert_eq!(Expected::observed_calls(obj, sizes, &want), want);
    let f = &obj["functions"];
    for v in [
        &obj["live"],
        &obj["leaks"],
        &f["free"]["bytes"],
        &f["realloc"]["released_bytes"],
    ] {
        assert!(v.is_null(), "not null in calls mode: {v}");
    }
}

/// Calls mode's plan: malloc without a return probe.
fn check_calls_plan(doc: &Value) {
    let probes = doc["provider"]["probes"].as_array().unwrap();
    let malloc = probes.iter().find(|p| p["func"] == "malloc").unwrap();
    assert_eq!(malloc["uretprobe"], false, "{malloc}");
}

bpf_test!(
    fn launch_calls_mode_counts_exactly() {
        calls_exact(4, &[]);
    }
);

bpf_test!(
    fn launch_calls_mode_at_entry_counts_exactly() {
        calls_exact(0, AT_ENTRY);
    }
);

bpf_test!(
    /// 4 threads x 12,000 iterations x 21 counted calls = 1,008,000 calls.
    fn launch_a_million_calls_counts_exactly() {
        launch_exact(4, 12_000, 2, &[]);
    }
);

/// Attaches to a running fixture whose threads already exist (so libc's thread set-up is not
/// seen), then lets it work.
fn pid_exact(threads: u64, flags: &[&str]) {
    let _g = shared();
    let fx = Fixture {
        threads,
        iterations: 2000,
        leaks: 4,
        memalign_apart: false,
        no_pvalloc: false,
    };
    let mut cmd = Command::new(allocs());
    cmd.args(args(&fx, &["wait"]));
    let mut target = ready(cmd);
    let json = json_path(&format!("pid{threads}{}", flags.concat()));
    let mut cmd = heaptrace();
    cmd.args(["--no-tui", "-q", "--interval", "200ms", "--json"])
        .arg(&json)
        .args(flags)
        .args(["-p", &target.id().to_string()]);
    let tracer = start_attached(&mut cmd);
    target.stdin.take().unwrap().write_all(b"g").unwrap();
    assert!(target.wait().unwrap().success());
    let (code, stderr) = tracer.wait();
    assert_eq!(code, 0, "{stderr}");
    assert!(stderr.contains("exited"), "{stderr}");
    let doc = read_json(&json);
    check_placement(&doc, flags);
    let mut want = Expected::of(&fx);
    // The blocks it held at attach (its stdout's buffer) are live too (a census of the heap).
    let before = &doc["live"]["before_attach"];
    want.live_blocks += before["blocks"].as_u64().unwrap_or(0);
    want.live_bytes += before["bytes"].as_u64().unwrap_or(0);
    let got = Expected::observed(&doc, &doc["sizes"], &want);
    assert_eq!(got, want);
    check_leaks(&doc, &want);
    assert_eq!(doc["functions"]["free"]["untracked"], 0);
}

bpf_test!(
    fn pid_one_thread_counts_exactly() {
        pid_exact(1, &[]);
    }
);

bpf_test!(
    fn pid_four_threads_counts_exactly() {
        pid_exact(4, &[]);
    }
);

bpf_test!(
    fn pid_four_threads_at_entry_counts_exactly() {
        pid_exact(4, AT_ENTRY);
    }
);

/// `--all` sees a fixture started after it, exactly, under the fixture's own pid.
/// Traces every process while `allocs` runs `fx`'s work; returns the JSON document and the
/// fixture's pid.
fn trace_all(tag: &str, fx: &Fixture, flags: &[&str]) -> (Value, u64) {
    let json = json_path(tag);
    let mut cmd = heaptrace();
    cmd.args(["--all", "--no-tui", "-q", "--interval", "200ms", "--json"])
        .arg(&json)
        .args(flags);
    let tracer = start_attached(&mut cmd);
    let tracer_pid = tracer.child.id() as u64;
    let status = Command::new(allocs()).args(args(fx, &[])).spawn().unwrap();
    let pid = status.id() as u64;
    let out = status.wait_with_output().unwrap();
    assert!(out.status.success());
    tracer.signal(libc::SIGINT);
    let (code, stderr) = tracer.wait();
    assert_eq!(code, 0, "{stderr}");
    let doc = read_json(&json);
    assert_eq!(doc["target"]["mode"], "all");
    let procs = doc["processes"].as_array().unwrap();
    assert!(
        procs.iter().all(|p| p["pid"].as_u64() != Some(0)),
        "pid 0 must not appear"
    );
    // heaptrace never traces itself, though it allocates through the same libc.
    assert!(
        procs.iter().all(|p| p["pid"].as_u64() != Some(tracer_pid)),
        "heaptrace traced itself"
    );
    (doc, pid)
}

/// The fixture's process in a system-wide document.
fn process(doc: &Value, pid: u64) -> &Value {
    let procs = doc["processes"].as_array().unwrap();
    let p = procs
        .iter()
        .find(|p| p["pid"].as_u64() == Some(pid))
        .unwrap_or_else(|| panic!("pid {pid} missing from {procs:?}"));
    assert_eq!(p["comm"], "allocs");
    p
}

fn all_exact(threads: u64) {
    let _g = exclusive();
    let fx = Fixture {
        threads,
        iterations: 1500,
        leaks: 2,
        memalign_apart: false,
        no_pvalloc: false,
    };
    let (doc, pid) = trace_all(&format!("all{threads}"), &fx, &[]);
    let p = process(&doc, pid);
    let want = Expected::of(&fx).with_glibc_threads(threads, DTV);
    let got = Expected::observed(p, &per_process_sizes(&doc, pid), &want);
    assert_eq!(got, want);
    assert_eq!(p["leaks"]["blocks"].as_u64(), Some(want.live_blocks));
    assert_eq!(p["leaks"]["bytes"].as_u64(), Some(want.live_bytes));
}

bpf_test!(
    exclusive,
    /// Calls mode system-wide: malloc's entry-only probe goes on the host's libc for every process,
    /// and the fixture's process is still counted exactly.
    fn all_calls_mode_counts_exactly() {
        let fx = Fixture {
            threads: 2,
            iterations: 1500,
            leaks: 2,
            memalign_apart: false,
            no_pvalloc: false,
        };
        let (doc, pid) = trace_all("all-calls", &fx, &["--mode", "calls"]);
        let want = Expected::of(&fx).with_glibc_threads(2, DTV);
        check_calls(process(&doc, pid), &per_process_sizes(&doc, pid), &want);
        check_calls_plan(&doc);
    }
);

fn per_process_sizes(doc: &Value, pid: u64) -> Value {
    doc["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"].as_u64() == Some(pid))
        .map(|p| p["sizes"].clone())
        .unwrap()
}

bpf_test!(
    fn all_one_thread_counts_exactly() {
        all_exact(0);
    }
);

bpf_test!(
    fn all_four_threads_counts_exactly() {
        all_exact(4);
    }
);

/// Runs a fixture twice (no work, then work) under the same runtime; the difference is exactly
/// the fixture's calls, whatever the runtime allocates for itself at start-up.
/// `flags` are heaptrace's (`--mode calls`: what calls mode shows, see [`check_calls`]).
fn exact_over_baseline(
    tag: &str,
    bin: &std::path::Path,
    fx: Fixture,
    extra: &[&str],
    env: &[(&str, &str)],
    flags: &[&str],
) -> Value {
    let base_fx = Fixture {
        iterations: 0,
        leaks: 0,
        ..fx
    };
    let calls = flags.contains(&"calls");
    let mut want = Expected::of(&fx).minus(&Expected::of(&base_fx));
    if calls {
        want = want.calls_only();
    }
    let observe = |doc: &Value| {
        if calls {
            Expected::observed_calls(doc, &doc["sizes"], &want)
        } else {
            Expected::observed(doc, &doc["sizes"], &want)
        }
    };
    let base = launch(
        &format!("{tag}-base"),
        flags,
        bin,
        &args(&base_fx, extra),
        env,
    );
    let full = launch(tag, flags, bin, &args(&fx, extra), env);
    let (b, f) = (observe(&base), observe(&full));
    assert_eq!(f.minus(&b), want);
    // And the fixture's own sizes, absolutely.
    for ((func, size), n) in &want.sizes {
        assert_eq!(
            f.sizes.get(&(func.clone(), *size)),
            Some(n),
            "{func} {size}"
        );
    }
    full
}

bpf_test!(
    shared,
    fn static_binary_counts_exactly() {
        let bin = fixture("allocs", "-static", &["-static"]);
        let fx = Fixture {
            threads: 4,
            iterations: 2000,
            leaks: 3,
            memalign_apart: false,
            no_pvalloc: false,
        };
        let doc = exact_over_baseline("static", &bin, fx, &[], &[], &[]);
        // The malloc family was found in the executable itself.
        assert_eq!(doc["provider"]["path"], bin.display().to_string());
    }
);

bpf_test!(
    fn jemalloc_preload_counts_exactly() {
        jemalloc_exact("jemalloc", &[]);
    }
);

bpf_test!(
    /// jemalloc's malloc runs no other family member inside it either: calls mode drops its return
    /// probe too, and still counts exactly.
    fn jemalloc_preload_calls_mode_counts_exactly() {
        let doc = jemalloc_exact("jemalloc-calls", &["--mode", "calls"]);
        check_calls_plan(&doc);
    }
);

fn jemalloc_exact(tag: &str, flags: &[&str]) -> Value {
    let _g = shared();
    let lib = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2";
    assert!(
        std::path::Path::new(lib).exists(),
        "libjemalloc2 missing (cargo xtask setup installs it)"
    );
    let fx = Fixture {
        threads: 4,
        iterations: 2000,
        leaks: 3,
        // jemalloc defines memalign apart from aligned_alloc, and no pvalloc.
        memalign_apart: true,
        no_pvalloc: true,
    };
    let doc = exact_over_baseline(
        tag,
        &allocs(),
        fx,
        &["nopvalloc"],
        &[("LD_PRELOAD", lib)],
        flags,
    );
    assert_eq!(doc["provider"]["path"], lib);
    assert!(doc["functions"].get("memalign").is_some());
    doc
}

bpf_test!(
    shared,
    /// `--probe-stats`: the kernel's own run counts of heaptrace's programs agree with the counts
    /// heaptrace shows. `pairs` makes no nested allocator call and frees no NULL, so each malloc
    /// runs the malloc entry and the return program once and each free the free program once.
    /// The command alone (a followed tree would be probed in every process).
    fn probe_stats_runs_agree_with_the_counts() {
        const N: u64 = 20_000;
        let bin = fixture("pairs", "", &[]);
        let doc = launch(
            "probestats",
            &["--mode", "counts", "--probe-stats"],
            &bin,
            &[N.to_string()],
            &[],
        );
        let progs = doc["heaptrace"]["programs"].as_array().expect("programs");
        let prog = |name: &str| program(&doc, name);
        let runs = |name: &str| prog(name)["runs"].as_u64().unwrap();
        let f = &doc["functions"];
        let calls = |func: &str| f[func]["calls"].as_u64().unwrap();
        assert!(calls("malloc") >= N, "{f}");
        assert_eq!(runs("malloc_entry"), calls("malloc"), "{progs:?}");
        assert_eq!(runs("free_entry"), calls("free"), "{progs:?}");
        let allocating: u64 = f
            .as_object()
            .unwrap()
            .iter()
            .filter(|(name, _)| name.as_str() != "free")
            .map(|(_, v)| v["calls"].as_u64().unwrap())
            .sum();
        assert_eq!(runs("alloc_return"), allocating, "{progs:?}");
        for name in ["malloc_entry", "free_entry", "alloc_return"] {
            assert!(prog(name)["run_ns"].as_u64().unwrap() > 0, "{progs:?}");
            assert_eq!(prog(name)["recursion_misses"], 0, "{progs:?}");
        }
    }
);
