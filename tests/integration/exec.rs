//! One process traced (`-p`, a launched command) that execs, as a wrapper script's `exec` or
//! pyenv's shims do: from the exec on it is its new command, counted as that alone, and the
//! memory behind malloc is measured from the new image's break, not the old one's.
use std::{io::Write as _, process::Command};

use serde_json::Value;

use crate::{
    expect::{Expected, Fixture},
    support::*,
};

/// `execfork -n 40 allocs 0 300 3`: 40 + 40 blocks of 4242 bytes and a 100000-byte one (the
/// brk heap grows) before the exec, none of which may show.
fn command() -> Vec<String> {
    let allocs = fixture("allocs", "", &[]);
    ["-n", "40", allocs.to_str().unwrap(), "0", "300", "3"]
        .map(String::from)
        .to_vec()
}

fn fx() -> Fixture {
    Fixture::main_thread(300, 3)
}

/// The document is `allocs`'s alone: functions, sizes, leaks, and brk growth within its heap.
fn check(doc: &Value, stderr: &str) {
    check_counts(doc, stderr);
    let procs = doc["processes"].as_array().unwrap();
    assert_eq!(procs[0]["exited"], true);
    check_brk(doc, &procs[0]);
}

/// `allocs`'s functions, sizes and leaks alone, one process, said to have started over.
fn check_counts(doc: &Value, stderr: &str) {
    let want = Expected::of(&fx());
    let got = Expected::observed(doc, &doc["sizes"], &want);
    assert_eq!(got, want);
    assert_eq!(doc["leaks"]["blocks"].as_u64(), Some(want.live_blocks));
    assert_eq!(doc["leaks"]["bytes"].as_u64(), Some(want.live_bytes));
    assert_eq!(doc["functions"]["free"]["untracked"], 0);
    let procs = doc["processes"].as_array().unwrap();
    assert_eq!(procs.len(), 1, "{procs:?}");
    assert_eq!(procs[0]["comm"], "allocs");
    assert!(
        stderr.contains("exec'ed allocs: its counts start over"),
        "{stderr}"
    );
}

/// The brk heap of process `p` (a record of `doc["processes"]`), which exec'ed, is measured
/// from its new image's break.
pub fn check_brk(doc: &Value, p: &Value) {
    // Before the exec was marked among the memory events, the new image's first brk call
    // was measured from the old image's break: hundreds of GiB grown or given back (each
    // image's heap is placed at random). The heap moves by at most what the program allocated
    // (glibc grows it 132 KiB at a time), and grows to at most its size when that was read at
    // the end (a launched command is held at exit; an attached one is gone by then).
    let heap = p["memory"]["reserved"]["heap"].as_u64();
    let allocated = p["totals"]["bytes_allocated"].as_u64().unwrap();
    let brk = |kind: &str, of: &str| -> u64 {
        doc["reservations"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["pid"] == p["pid"])
            .filter(|r| r["kind"] == kind && r["of"].as_str().unwrap_or("") == of)
            .map(|r| r["bytes"].as_u64().unwrap())
            .sum()
    };
    let (grown, given_back) = (brk("brk", ""), brk("munmap", "brk"));
    assert!(grown > 0, "{:#}", doc["reservations"]);
    assert!(
        grown + given_back <= allocated,
        "brk heap grew {grown} and gave back {given_back}; {allocated} bytes allocated"
    );
    if let Some(heap) = heap {
        assert!(grown <= heap, "brk heap grew {grown}, holds {heap}");
    }
}

/// Launches `execfork` with the exec events held `delay_ms` (`HEAPTRACE_DELAY_EXEC_EVENTS_MS`)
/// and checks it is counted as its new command.
fn launch_execfork(tag: &str, delay_ms: u64) {
    let _g = shared();
    let json = json_path(tag);
    let out = run_ok(
        heaptrace()
            .env("HEAPTRACE_DELAY_EXEC_EVENTS_MS", delay_ms.to_string())
            .args(["--no-tui", "--interval", "200ms", "--json"])
            .arg(&json)
            .arg("--")
            .arg(fixture("execfork", "", &[]))
            .args(command()),
    );
    let doc = read_json(&json);
    assert_eq!(doc["target"]["exit_code"], 0);
    check(&doc, &String::from_utf8_lossy(&out.stderr));
}

bpf_test!(
    fn a_launched_command_that_execs_is_counted_as_its_new_command() {
        launch_execfork("exec-launch", 0);
    }
);

bpf_test!(
    /// The same with the exec's event read after the new image's counters: the read's epoch says
    /// the process started over (the event alone came too late: a round took the new image's
    /// counters less the old one's).
    fn an_exec_seen_first_in_the_counters_starts_the_process_over() {
        launch_execfork("exec-launch-late", 800);
    }
);

bpf_test!(
    shared,
    fn an_attached_process_that_execs_is_counted_as_its_new_command() {
        let mut cmd = Command::new(fixture("execfork", "", &[]));
        cmd.args(command()).env("EXECFORK_WAIT", "1");
        let mut target = ready(cmd);
        let json = json_path("exec-pid");
        let mut cmd = heaptrace();
        cmd.args(["--no-tui", "--interval", "200ms", "--json"])
            .arg(&json)
            .args(["-p", &target.id().to_string()]);
        let tracer = start_attached(&mut cmd);
        // A round passes with the 40 blocks before the exec counted, then the exec.
        std::thread::sleep(std::time::Duration::from_millis(300));
        target.stdin.take().unwrap().write_all(b"g").unwrap();
        assert!(target.wait().unwrap().success());
        let (code, stderr) = tracer.wait();
        assert_eq!(code, 0, "{stderr}");
        check(&read_json(&json), &stderr);
    }
);

bpf_test!(
    shared,
    /// A launched command that execs a static binary (its own allocator, not probed yet): the
    /// launcher holds it at the exec until the executable is probed, so it counts exactly as the
    /// binary launched directly.
    fn a_launched_command_that_execs_a_static_binary_is_counted_whole() {
        let bin = fixture("allocs", "-static", &["-static"]);
        let args = ["0", "300", "3"].map(String::from);
        let direct = crate::counts::launch("exec-static-direct", &[], &bin, &args, &[]);
        let mut wrapped_args = vec![
            "-n".to_string(),
            "40".to_string(),
            bin.display().to_string(),
        ];
        wrapped_args.extend(args.iter().cloned());
        let wrapped = crate::counts::launch(
            "exec-static",
            &[],
            &fixture("execfork", "", &[]),
            &wrapped_args,
            &[],
        );
        assert_eq!(wrapped["functions"], direct["functions"]);
        assert_eq!(wrapped["sizes"], direct["sizes"]);
        for key in ["blocks", "bytes", "by_function"] {
            assert_eq!(wrapped["leaks"][key], direct["leaks"][key], "leaks {key}");
        }
        assert_eq!(
            wrapped["processes"][0]["comm"].as_str(),
            Some("allocs-static")
        );
    }
);

bpf_test!(
    shared,
    /// A recording keeps the restart: its report counts the exec'ed command alone, as the live
    /// trace did.
    fn a_recording_of_a_command_that_execs_reports_its_new_command() {
        let live = json_path("exec-record");
        let rec = live.with_extension("bin");
        run_ok(
            heaptrace()
                .args(["record", "-o"])
                .arg(&rec)
                .args(["-q", "--interval", "200ms", "--json"])
                .arg(&live)
                .arg("--")
                .arg(fixture("execfork", "", &[]))
                .args(command()),
        );
        let out = heaptrace()
            .arg("report")
            .arg(&rec)
            .args(["--format", "json"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let offline: Value = serde_json::from_slice(&out.stdout).unwrap();
        let live = read_json(&live);
        let want = Expected::of(&fx());
        assert_eq!(Expected::observed(&offline, &offline["sizes"], &want), want);
        for key in ["functions", "sizes", "totals"] {
            assert_eq!(offline[key], live[key], "{key}");
        }
        for key in ["blocks", "bytes", "by_function"] {
            assert_eq!(offline["leaks"][key], live["leaks"][key], "leaks {key}");
        }
    }
);

bpf_test!(
    shared,
    /// An exec event that reaches the daemon after it read the new image's counters (the exec
    /// watch reads /proc before it hands an event on, and a loaded host delays it more) starts
    /// nothing over: the counters read are of the current image (the epoch the read saw is the
    /// kernel's). It used to drop them and read them again: the timeline counted the work twice
    /// and the reservations made meanwhile were lost (an empty list once failed
    /// `a_custom_allocators_reservations_are_seen_at_libcs_wrappers` in a full run). The event
    /// is held 500 ms here (`HEAPTRACE_DELAY_EXEC_EVENTS_MS`), rounds are of 100 ms.
    fn a_late_exec_event_starts_nothing_over() {
        let allocs = fixture("allocs", "", &[]);
        let json = json_path("exec-late-event");
        let mut tracer = heaptrace()
            .env("HEAPTRACE_DELAY_EXEC_EVENTS_MS", "500")
            .args(["--no-tui", "--interval", "100ms", "--json"])
            .arg(&json)
            .arg("--")
            .arg(&allocs)
            .args(["0", "300", "3", "hold"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(tracer.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        assert_eq!(line, "done\n");
        // Rounds before the event comes and after.
        std::thread::sleep(std::time::Duration::from_millis(1200));
        drop(tracer.stdin.take());
        let out = tracer.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        assert!(!stderr.contains("exec'ed"), "{stderr}");
        let doc = read_json(&json);
        let want = Expected::of(&fx());
        assert_eq!(Expected::observed(&doc, &doc["sizes"], &want), want);
        let rows: u64 = doc["timeline"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["allocations"].as_u64().unwrap())
            .sum();
        assert_eq!(
            Some(rows),
            doc["totals"]["allocations"].as_u64(),
            "{stderr}"
        );
        let brk_by_malloc = doc["reservations"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["kind"] == "brk" && r["function"] == "malloc");
        assert!(brk_by_malloc, "{:#}", doc["reservations"]);
    }
);

/// In process: the new image's library takes the region over and starts it over.
#[test]
fn an_in_process_command_that_execs_is_its_new_command_alone() {
    let _g = shared();
    let json = json_path("exec-inproc");
    let out = run_ok(
        heaptrace()
            .args(["--no-tui", "--in-process", "--json"])
            .arg(&json)
            .arg("--")
            .arg(fixture("execfork", "", &[]))
            .args(command()),
    );
    let doc = read_json(&json);
    check_counts(&doc, &String::from_utf8_lossy(&out.stderr));
}
