//! `--in-process`: the launched command counted by a preloaded library. Exact against the
//! same fixtures and oracles as the kernel path, and harmless to the command: its output, exit
//! status, forks, threads, signal handlers, dlopen'ed code and calls to malloc_usable_size and
//! mallopt are what they are without heaptrace. No BPF is needed: plain tests.
use std::{path::PathBuf, process::Command};

use serde_json::Value;

use crate::{counts::launch_exact, support::*};

const IN_PROCESS: &str = "--in-process";

fn inproc() -> PathBuf {
    fixture("inproc", "", &[])
}

/// `inproc ARGS` under `heaptrace --in-process` with `flags`: its stdout, its exit code and
/// the JSON document.
fn traced(tag: &str, flags: &[&str], args: &[&str]) -> (String, i32, Value) {
    let json = json_path(tag);
    let out = heaptrace()
        .args(["--no-tui", "-q", IN_PROCESS, "--json"])
        .arg(&json)
        .args(flags)
        .arg("--")
        .arg(inproc())
        .args(args)
        .output()
        .expect("heaptrace");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("function"), "no summary: {stderr}");
    let doc = read_json(&json);
    assert_eq!(doc["heaptrace"]["collector"], "in-process");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    (stdout, out.status.code().unwrap_or(-1), doc)
}

fn native(args: &[&str]) -> (String, i32) {
    let out = Command::new(inproc()).args(args).output().expect("inproc");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    (stdout, out.status.code().unwrap_or(-1))
}

fn func(doc: &Value, name: &str) -> (u64, u64) {
    let f = &doc["functions"][name];
    (f["calls"].as_u64().unwrap(), f["bytes"].as_u64().unwrap())
}

/// Allocations of `size` bytes by `function` in the exact size histogram.
#[test]
fn in_process_one_thread_counts_exactly() {
    launch_exact(0, 1000, 3, &[IN_PROCESS]);
}

#[test]
fn in_process_four_threads_counts_exactly() {
    launch_exact(4, 3000, 3, &[IN_PROCESS]);
}

#[test]
fn in_process_sizes_mode_counts_exactly() {
    launch_exact(4, 1000, 5, &[IN_PROCESS, "--mode", "sizes"]);
}

#[test]
fn in_process_temporaries_are_counted_as_by_the_probes() {
    let _g = shared();
    crate::temporaries::check_temporaries(&[IN_PROCESS]);
}

#[test]
fn in_process_leaves_malloc_usable_size_and_mallopt_alone() {
    let _g = shared();
    let (out, code, doc) = traced("inproc-usable", &[], &["usable"]);
    assert_eq!((out.clone(), code), native(&["usable"]));
    assert!(out.contains("usable_null 0"), "{out}");
    for size in [1, 24, 100, 1000, 5000, 200000] {
        assert_eq!(sized(&doc, "malloc", size), 1, "{size}");
    }
    assert_eq!(doc["leaks"]["blocks"], 0);
    assert_eq!(doc["functions"]["free"]["untracked"], 0);
}

#[test]
fn in_process_keeps_the_commands_output_and_status() {
    let _g = shared();
    let json = json_path("inproc-exit");
    let out = heaptrace()
        .args(["--no-tui", "-q", IN_PROCESS, "--json"])
        .arg(&json)
        .arg("--")
        .arg(inproc())
        .args(["exit", "3"])
        .output()
        .expect("heaptrace");
    let native = Command::new(inproc()).args(["exit", "3"]).output().unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(out.stdout, native.stdout);
    assert!(String::from_utf8_lossy(&out.stderr).contains("err\n"));
    assert_eq!(read_json(&json)["target"]["exit_code"], 3);
}

#[test]
fn in_process_a_fork_counts_nothing_and_the_parent_stays_exact() {
    let _g = shared();
    let (out, code, doc) = traced("inproc-fork", &[], &["fork"]);
    assert_eq!((out.as_str(), code), ("child_status 7\n", 0));
    // The parent's 100 blocks and their frees; the child's 50 blocks and 26 frees are its own.
    assert_eq!(sized(&doc, "malloc", 3000), 100);
    assert_eq!(sized(&doc, "malloc", 2000), 0);
    assert_eq!(func(&doc, "free").0, 100);
    assert_eq!(doc["leaks"]["blocks"], 0);
    assert_eq!(doc["functions"]["free"]["untracked"], 0);
}

#[test]
fn in_process_signal_handlers_allocations_never_deadlock_or_unbalance() {
    let _g = shared();
    let n = 300_000;
    let (out, code, doc) = traced("inproc-signals", &[], &["signals", &n.to_string()]);
    assert_eq!(code, 0);
    let handled: u64 = out
        .trim()
        .strip_prefix("handled ")
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{out}"));
    assert!(handled > 0, "the timer never fired: {out}");
    assert_eq!(sized(&doc, "malloc", 16), n);
    // A handler's pair that interrupted a call being counted goes through uncounted, both its
    // halves: nothing is left unbalanced, and both are said (`lost.nested_calls`).
    let in_handler = sized(&doc, "malloc", 200) - 7;
    assert!(in_handler <= handled, "{in_handler} > {handled}");
    assert_eq!(doc["lost"]["nested_calls"], 2 * (handled - in_handler));
    assert_eq!(doc["complete"], (handled == in_handler));
    assert_eq!(doc["leaks"]["blocks"], 0);
    assert_eq!(doc["functions"]["free"]["untracked"], 0);
    assert_eq!(func(&doc, "free").0, n + 7 + in_handler);
}

#[test]
fn in_process_counts_dlopened_code() {
    let _g = shared();
    let lib = fixture("inproclib", "", &["-shared", "-fPIC"]);
    let lib = lib.display().to_string();
    let (out, code, doc) = traced("inproc-dlopen", &[], &["dlopen", &lib]);
    assert_eq!((out.as_str(), code), ("dlopen done\n", 0));
    assert_eq!(sized(&doc, "malloc", 300), 20);
    let leaked: u64 = doc["leaks"]["by_stack"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["frames"][0]["function"] == "lib_alloc")
        .map(|s| s["blocks"].as_u64().unwrap())
        .sum();
    assert_eq!(leaked, 10, "{}", doc["leaks"]);
}

#[test]
fn in_process_threads_that_exit_give_their_slots_to_the_next() {
    let _g = shared();
    // Two slots for 20 threads one after another: each exits before the next starts.
    let flags = ["--in-process-threads", "2"];
    let (_, code, doc) = traced("inproc-threads", &flags, &["threads", "20"]);
    assert_eq!(code, 0);
    assert_eq!(sized(&doc, "malloc", 48), 20_000);
    assert_eq!(sized(&doc, "malloc", 64), 20);
    assert_eq!(doc["lost"]["in_flight"], 0, "{}", doc["lost"]);
    let leaked_64: u64 = doc["leaks"]["by_stack"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["bytes"] == s["blocks"].as_u64().unwrap() * 64)
        .map(|s| s["blocks"].as_u64().unwrap())
        .sum();
    assert_eq!(leaked_64, 20, "{}", doc["leaks"]);
}

/// Blocks freed by another thread than their own, by threads racing on the live table:
/// every one found, none twice.
#[test]
fn in_process_blocks_freed_by_other_threads_are_all_found() {
    let _g = shared();
    let (t, n) = (4u64, 50_000u64);
    let (_, code, doc) = traced(
        "inproc-xfree",
        &["--mode", "sizes"],
        &["xfree", &t.to_string(), &n.to_string()],
    );
    assert_eq!(code, 0);
    for i in 0..t {
        assert_eq!(sized(&doc, "malloc", 40 + i), n, "{i}");
    }
    // Besides: the threads' own dynamic thread vectors (272 bytes), which glibc frees as
    // joined threads are reaped.
    let want_bytes: u64 = (0..t).map(|i| n * (40 + i)).sum();
    let (frees, bytes) = func(&doc, "free");
    let dtvs = frees - t * n;
    assert!(dtvs <= sized(&doc, "calloc", 272), "{frees}");
    assert_eq!(bytes, want_bytes + 272 * dtvs);
    assert_eq!(doc["functions"]["free"]["untracked"], 0);
    let ours =
        |s: &&Value| (40..40 + t).any(|size| s["bytes"] == s["blocks"].as_u64().unwrap() * size);
    let left: Vec<&Value> = doc["leaks"]["by_stack"]
        .as_array()
        .unwrap()
        .iter()
        .filter(ours)
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// A frame on a stack that is not its thread's (a coroutine's, here a static buffer) is not
/// walked past: the allocation's caller, and nothing read beyond.
#[test]
fn in_process_walks_no_further_than_the_first_frame_on_a_stack_of_its_own() {
    let _g = shared();
    let (out, code, doc) = traced("inproc-context", &[], &["context"]);
    assert_eq!((out.as_str(), code), ("context done\n", 0));
    assert_eq!(sized(&doc, "malloc", 72), 1000);
    let site = doc["leaks"]["by_stack"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["bytes"] == 88)
        .unwrap_or_else(|| panic!("{}", doc["leaks"]));
    let frames = site["frames"].as_array().unwrap();
    assert_eq!(frames[0]["function"], "co_work", "{frames:?}");
    assert_eq!(frames.len(), 1, "{frames:?}");
}

#[test]
fn in_process_refuses_a_static_program_before_it_runs() {
    let bin = fixture("allocs", "static", &["-static"]);
    let out = heaptrace()
        .args(["--no-tui", "-q", IN_PROCESS, "--"])
        .arg(&bin)
        .args(["0", "10", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("statically linked"), "{stderr}");
}

/// Each in one line naming the option, before anything runs: clap's conflicts (exit 2), and
/// the options only the kernel's probes have (exit 1).
#[test]
fn in_process_refuses_what_only_probes_do() {
    // `-p PID --in-process` loads the library into the process (in_process_attach.rs).
    for (flags, code) in [
        (&["--all"][..], 2),
        (&["--mode", "calls"], 1),
        (&["--follow-forks"], 1),
        (&["--probe-stats"], 1),
    ] {
        let out = heaptrace()
            .args(["--no-tui", IN_PROCESS])
            .args(flags)
            .args(["--", "true"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(code), "{flags:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let first = stderr.lines().next().unwrap_or_default();
        assert!(first.contains(flags[0]), "{flags:?}: {stderr}");
        assert!(first.contains(IN_PROCESS), "{flags:?}: {stderr}");
    }
}

/// `--latency-every 1` times every allocating call in process too: each function's latency
/// count is its calls, and each site's lifetimes count its released blocks.
#[test]
fn in_process_times_every_call_when_asked() {
    let _g = shared();
    let json = json_path("inproc-latency");
    run_ok(
        heaptrace()
            .args([
                "--no-tui",
                "-q",
                IN_PROCESS,
                "--latency-every",
                "1",
                "--json",
            ])
            .arg(&json)
            .arg("--")
            .arg(fixture("allocs", "", &[]))
            .args(["0", "200", "3"]),
    );
    let doc = read_json(&json);
    for f in ["malloc", "calloc", "realloc", "posix_memalign", "valloc"] {
        assert_eq!(
            doc["latency"][f]["count"], doc["functions"][f]["calls"],
            "{f}: {}",
            doc["latency"]
        );
    }
    for s in doc["stacks"].as_array().unwrap() {
        assert_eq!(
            s["lifetime"]["count"].as_u64().unwrap_or(0),
            s["frees"].as_u64().unwrap(),
            "{s}"
        );
    }
}

/// The library takes its region as it is loaded: a command that makes no allocation was
/// counted whole (nothing), with no warning.
#[test]
fn in_process_a_command_that_makes_no_call_is_counted_whole() {
    let _g = shared();
    // An unknown mode: inproc exits 2 before any allocation.
    let json = json_path("inproc-nocall");
    let out = heaptrace()
        .args(["--no-tui", "-q", IN_PROCESS, "--json"])
        .arg(&json)
        .arg("--")
        .arg(inproc())
        .arg("bogus")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("warning"), "{stderr}");
    let doc = read_json(&json);
    assert_eq!(doc["complete"], true, "{}", doc["incomplete"]);
}

/// A script is run by its interpreter, which takes the library.
#[test]
fn in_process_traces_a_script_through_its_interpreter() {
    let _g = shared();
    let dir = json_path("inproc-script").with_extension("d");
    std::fs::create_dir_all(&dir).unwrap();
    let script = dir.join("run.sh");
    let body = format!("#!/bin/sh\nexec {} usable\n", inproc().display());
    std::fs::write(&script, body).unwrap();
    let mut perms = std::fs::metadata(&script).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&script, perms).unwrap();
    let json = json_path("inproc-script");
    let out = run_ok(
        heaptrace()
            .args(["--no-tui", "-q", IN_PROCESS, "--json"])
            .arg(&json)
            .arg("--")
            .arg(&script),
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("usable_null 0"));
    let doc = read_json(&json);
    // The exec'ed program alone: the shell's own calls were started over.
    assert_eq!(sized(&doc, "malloc", 200000), 1, "{}", doc["sizes"]);
    assert_eq!(doc["processes"][0]["comm"], "inproc");
}

/// More distinct (size, stack) pairs on one thread than its own size table holds (a
/// sixteenth of --size-map-size, 4,096 by default, all that was kept before the shared
/// table behind it): the shared table takes the rest, and each size is counted once.
#[test]
fn more_sizes_than_a_threads_table_are_all_counted() {
    let _g = shared();
    const M: u64 = 10_000;
    let json = json_path("inproc-sizes");
    run_ok(
        heaptrace()
            .args(["--no-tui", "-q", IN_PROCESS, "--mode", "stacks", "--json"])
            .arg(&json)
            .arg("--")
            .arg(fixture("manyblocks", "", &[]))
            .args(["sizes", &M.to_string()]),
    );
    let doc = read_json(&json);
    assert_eq!(doc["lost"]["size_histogram"], 0, "{}", doc["lost"]);
    let missing: Vec<u64> = (1..=M).filter(|s| sized(&doc, "malloc", *s) == 0).collect();
    assert!(
        missing.is_empty(),
        "{} sizes not counted: {:?}",
        missing.len(),
        &missing[..missing.len().min(10)]
    );
}
