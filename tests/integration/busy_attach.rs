//! `-p` on a busy multi-threaded process, attached and detached while it runs: the links go
//! on and come off one after the other, and only the COUNTING switch (on once every link is
//! in place, off before the first is removed) keeps a block from being counted while its
//! free is let pass. Every thread of the fixture holds at most one block at any instant.
use std::{io::Write as _, process::Command, time::Duration};

use serde_json::Value;

use crate::support::*;

/// The fixture's threads: each holds at most one block at a time.
const THREADS: u64 = 8;

/// Times each run attaches to and detaches from the same running fixture: each run's edges
/// race with its busy threads anew.
const RUNS: usize = 3;

/// Starts `busythreads`, then `RUNS` times attaches with `-p` and `flags`, lets it run and
/// interrupts heaptrace while the fixture keeps running; then stops the fixture. The runs'
/// JSON documents.
fn attach_busy(tag: &str, flags: &[&str]) -> Vec<Value> {
    let bin = fixture("busythreads", "", &[]);
    let mut cmd = Command::new(&bin);
    cmd.arg(THREADS.to_string());
    let mut target = ready(cmd);
    let docs = (0..RUNS)
        .map(|_| {
            let json = json_path(tag);
            let mut ht = heaptrace();
            ht.args(["--no-tui", "-q", "--interval", "200ms", "--json"])
                .arg(&json)
                .args(flags)
                .args(["-p", &target.id().to_string()]);
            let tracer = start_attached(&mut ht);
            std::thread::sleep(Duration::from_millis(800));
            tracer.signal(libc::SIGINT);
            let (code, stderr) = tracer.wait();
            // The fixture runs throughout: it stops only once its stdin closes.
            assert!(target.try_wait().unwrap().is_none(), "{stderr}");
            assert_eq!(code, 0, "{stderr}");
            assert!(stderr.contains("interrupted; detached"), "{stderr}");
            read_json(&json)
        })
        .collect();
    target.stdin.take().unwrap().write_all(b"x").unwrap();
    assert!(target.wait().unwrap().success());
    docs
}

fn num(v: &Value) -> i64 {
    v.as_i64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// Live figures agree with the leaks block for block, the process's and each stack's, and stay
/// within what the threads can hold; frees of blocks not seen allocated are of the blocks
/// held at the attach.
fn check_live(doc: &Value) {
    let (live, leaks) = (&doc["live"], &doc["leaks"]);
    let summary = format!("live {live}, leaks {}/{}", leaks["blocks"], leaks["bytes"]);
    assert_eq!(live["blocks"], leaks["blocks"], "{summary}");
    assert_eq!(live["bytes"], leaks["bytes"], "{summary}");
    assert!(num(&live["blocks"]) <= THREADS as i64, "{summary}");
    for row in doc["timeline"].as_array().unwrap() {
        let blocks = num(&row["live_blocks"]);
        assert!((0..=THREADS as i64).contains(&blocks), "{row}; {summary}");
    }
    let untracked = num(&doc["functions"]["free"]["untracked"]);
    assert!(
        untracked <= THREADS as i64,
        "{untracked} untracked; {summary}"
    );
    if let Some(stacks) = doc["stacks"].as_array().filter(|s| !s.is_empty()) {
        let mut live: Vec<(i64, i64, i64)> = stacks
            .iter()
            .filter(|s| num(&s["live_blocks"]) != 0)
            .map(|s| {
                let f = |k: &str| num(&s[k]);
                (f("stack_id"), f("live_blocks"), f("live_bytes"))
            })
            .collect();
        let mut leaked: Vec<(i64, i64, i64)> = leaks["by_stack"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| (num(&s["stack_id"]), num(&s["blocks"]), num(&s["bytes"])))
            .collect();
        live.sort();
        leaked.sort();
        assert_eq!(live, leaked, "{summary}");
    }
}

/// Calls mode keeps no live map; the allocations and releases it counts differ by no more
/// than the threads can hold: blocks held at the attach whose releases are counted, blocks
/// counted whose releases come after the detach.
fn check_calls(doc: &Value) {
    let f = &doc["functions"];
    let allocations = num(&doc["totals"]["allocations"]);
    let releases = num(&f["free"]["calls"])
        + num(&f["realloc"]["freed"])
        + num(&f["realloc"]["moved"])
        + num(&f["realloc"]["in_place"]);
    let d = allocations - releases;
    assert!(
        d.abs() <= THREADS as i64,
        "{allocations} allocations, {releases} releases: {d}; {f}"
    );
    assert!(allocations > 10_000, "the fixture was not busy: {f}");
}

fn busy(tag: &str, flags: &[&str]) {
    for doc in attach_busy(tag, flags) {
        if flags.windows(2).any(|w| w == ["--mode", "calls"]) {
            assert!(doc["live"]["blocks"].is_null(), "{}", doc["live"]);
            check_calls(&doc);
        } else {
            assert!(num(&doc["totals"]["allocations"]) > 10_000, "not busy");
            check_live(&doc);
        }
    }
}

bpf_test!(
    shared,
    /// Sizes mode counts live blocks as counts mode does (it adds the size histogram).
    fn busy_pid_counts_mode_live_equals_leaks() {
        busy("busycounts", &["--mode", "counts"]);
    }
);

bpf_test!(
    shared,
    fn busy_pid_stacks_mode_live_equals_leaks_by_stack() {
        busy("busystacks", &["--mode", "stacks"]);
    }
);

bpf_test!(
    shared,
    fn busy_pid_calls_mode_releases_match_allocations() {
        busy("busycalls", &["--mode", "calls"]);
    }
);

bpf_test!(
    shared,
    fn busy_pid_probes_at_entry_live_equals_leaks() {
        busy("busyentry", &["--mode", "stacks", "--probe-at-entry"]);
    }
);

bpf_test!(
    shared,
    /// Perf-event links: one per probe, each closed (and put on) on its own.
    fn busy_pid_perf_event_links_live_equals_leaks() {
        busy("busyperf", &["--mode", "counts", "--perf-uprobes"]);
    }
);

bpf_test!(
    shared,
    fn busy_pid_perf_event_links_calls_mode() {
        busy("busyperfcalls", &["--mode", "calls", "--perf-uprobes"]);
    }
);

bpf_test!(
    shared,
    fn busy_pid_atomic_counters_live_equals_leaks() {
        busy("busyatomic", &["--mode", "stacks", "--atomic-counters"]);
    }
);

/// The blocks live at the end in `p`'s leaks by stack: its threads' (allocated in `work`, the
/// first frame of every stack even where it is cut short, `unwind_late`) and the main
/// thread's, never freed.
fn by_thread(p: &Value) -> (i64, i64) {
    let (mut threads, mut main) = (0, 0);
    for s in p["leaks"]["by_stack"].as_array().unwrap() {
        match s["frames"][0]["function"] == "work" {
            true => threads += num(&s["blocks"]),
            false => main += num(&s["blocks"]),
        }
    }
    (threads, main)
}

bpf_test!(
    exclusive,
    /// Under `--all`, a static binary's allocator is attached once its exec is seen, most
    /// often with its threads already at work: counting is on by then, and the file's entry
    /// probes go on releasing first, so no block is counted whose free is not probed yet.
    /// Each thread holds at most one block. Where the fixture is held back after its exec (a
    /// loaded host) the attach comes first, and the main thread's blocks made after it are
    /// counted too, live for good: glibc's start-up (`_dl_non_dynamic_init`), each thread's
    /// TLS (`pthread_create`), stdout's buffer (`printf`): 14 here, beside the threads' 8 at
    /// most (docs/testing.md).
    fn all_attaches_a_busy_static_binary_live_equals_leaks() {
        let bin = fixture("busythreads", "-static", &["-static"]);
        let json = json_path("busyall");
        let mut ht = heaptrace();
        ht.args([
            "--all",
            "--comm",
            "busythreads",
            "--no-tui",
            "-q",
            "--mode",
            "stacks",
        ])
        .args(["--interval", "200ms", "--json"])
        .arg(&json);
        let tracer = start_attached(&mut ht);
        let mut cmd = Command::new(&bin);
        cmd.arg(THREADS.to_string());
        let mut target = ready(cmd);
        crate::system::wait_for(&tracer, &format!("also tracing {}", bin.display()));
        std::thread::sleep(Duration::from_millis(800));
        let (stderr, doc) = crate::system::stop(tracer, &json);
        assert!(target.try_wait().unwrap().is_none(), "{stderr}");
        target.stdin.take().unwrap().write_all(b"x").unwrap();
        assert!(target.wait().unwrap().success());
        let p = crate::system::process(&doc, target.id());
        let (live, leaks) = (&p["live"], &p["leaks"]);
        assert!(num(&p["totals"]["allocations"]) > 10_000, "not busy: {p}");
        assert_eq!(
            live["blocks"], leaks["blocks"],
            "live {live}, leaks {leaks}"
        );
        assert_eq!(live["bytes"], leaks["bytes"], "live {live}, leaks {leaks}");
        let (threads, main) = by_thread(p);
        assert_eq!(threads + main, num(&leaks["blocks"]), "leaks {leaks}");
        assert!(threads <= THREADS as i64, "live {live}, leaks {leaks}");
    }
);
