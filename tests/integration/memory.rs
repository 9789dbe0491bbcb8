//! The memory behind malloc: arenas, mmapped blocks and the brk heap, attributed to the
//! allocation sites that made the allocator reserve them, beside RSS and VIRT.
use serde_json::Value;

use crate::support::*;

const MIB: u64 = 1 << 20;
/// A glibc arena heap (HEAP_MAX_SIZE on 64-bit).
const ARENA: u64 = 64 * MIB;
/// An mmapped chunk of 1 MiB: the 16-byte header rounds the mapping up by a page.
const BIG: u64 = MIB + 4096;

fn trace(tag: &str, fixture_name: &str, args: &[&str], env: &[(&str, &str)]) -> Value {
    let bin = fixture(fixture_name, "", &[]);
    let json = json_path(tag);
    let mut cmd = heaptrace();
    cmd.args(["--no-tui", "-q", "--mode", "stacks", "--interval", "200ms"])
        .arg("--json")
        .arg(&json)
        .arg("--")
        .arg(&bin)
        .args(args)
        .envs(env.iter().copied());
    run_ok(&mut cmd);
    let doc = read_json(&json);
    assert_eq!(doc["lost"]["mem_events"], 0);
    doc
}

/// The line of a /* MARKER */ comment in a fixture.
fn marker_line(file: &str, marker: &str) -> u64 {
    let src = std::fs::read_to_string(workspace().join("tests/fixtures").join(file)).unwrap();
    src.lines()
        .position(|l| l.contains(&format!("/* {marker} */")))
        .map(|i| i as u64 + 1)
        .unwrap()
}

/// Reservation entries of `kind` whose innermost frame is at `line` of the fixture.
fn at_line<'a>(doc: &'a Value, kind: &str, line: u64) -> Vec<&'a Value> {
    doc["reservations"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["kind"] == kind && r["frames"][0]["line"].as_u64() == Some(line))
        .collect()
}

fn of_kind<'a>(doc: &'a Value, kind: &str) -> Vec<&'a Value> {
    doc["reservations"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["kind"] == kind)
        .collect()
}

fn sum(v: &[&Value], field: &str) -> u64 {
    v.iter().map(|r| r[field].as_u64().unwrap()).sum()
}

bpf_test!(
    shared,
    fn each_threads_arena_is_a_64_mib_reservation_of_its_malloc_site() {
        let doc = trace("arenas", "arenas", &["1"], &[]);
        let p = &doc["processes"][0];
        let malloc = &p["functions"]["malloc"];
        assert_eq!(
            (malloc["calls"].as_u64(), malloc["bytes"].as_u64()),
            (Some(10), Some(80))
        );
        let line = marker_line("arenas.c", "ARENA_SITE");
        let site: Vec<&Value> = doc["stacks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["frames"][0]["line"].as_u64() == Some(line))
            .collect();
        assert_eq!(site.len(), 1, "{site:?}");
        assert_eq!(site[0]["live_bytes"].as_i64(), Some(80));

        // glibc gives each thread its own arena up to 8 per core: all 10 here (2 cores or more).
        let cores = std::thread::available_parallelism().unwrap().get() as u64;
        let arenas = at_line(&doc, "arena", line);
        assert!(
            arenas.iter().all(|r| r["function"] == "malloc"),
            "{arenas:?}"
        );
        assert!(
            arenas
                .iter()
                .all(|r| r["stack"]["frames"] == r["frames"] && r["stack"]["id"] == r["stack_id"]),
            "{arenas:?}"
        );
        let n = sum(&arenas, "calls");
        assert_eq!(n, 10.min(8 * cores), "{:#}", doc["reservations"]);
        assert_eq!(sum(&arenas, "bytes"), n * ARENA);
        assert_eq!(
            of_kind(&doc, "arena").len(),
            arenas.len(),
            "no arena elsewhere"
        );

        let mem = &p["memory"];
        assert_eq!(mem["reserved"]["arenas"].as_u64(), Some(n * ARENA));
        assert!(
            mem["requested_live_bytes"].as_i64().unwrap() < 4096,
            "{mem}"
        );
        let virt = mem["virt_bytes"].as_u64().unwrap();
        let rss = mem["rss_bytes"].as_u64().unwrap();
        assert!(virt > n * ARENA, "VIRT holds the arenas: {mem}");
        assert!(rss < 10 * MIB, "RSS barely moves: {mem}");
    }
);

bpf_test!(
    shared,
    fn with_one_arena_the_reservations_disappear() {
        let doc = trace("arenas1", "arenas", &["0.3"], &[("MALLOC_ARENA_MAX", "1")]);
        let p = &doc["processes"][0];
        assert_eq!(p["functions"]["malloc"]["calls"].as_u64(), Some(10));
        assert!(
            of_kind(&doc, "arena").is_empty(),
            "{:#}",
            doc["reservations"]
        );
        assert_eq!(p["memory"]["reserved"]["arenas"].as_u64(), Some(0));
        assert!(p["memory"]["virt_bytes"].as_u64().unwrap() < 10 * ARENA);
    }
);

bpf_test!(
    shared,
    fn large_blocks_are_mappings_of_their_sites_returned_by_free_and_moved_by_realloc() {
        let doc = trace("bigblocks", "bigblocks", &[], &[]);
        let big = marker_line("bigblocks.c", "BIG_SITE");
        let grow = marker_line("bigblocks.c", "GROW_SITE");
        let made = at_line(&doc, "mmap", big);
        assert_eq!((sum(&made, "calls"), sum(&made, "bytes")), (8, 8 * BIG));
        // Four frees, and the realloc's move of a fifth block, give back BIG_SITE's mappings.
        let back = at_line(&doc, "munmap", big);
        assert!(back.iter().all(|r| r["of"] == "mmap"), "{back:?}");
        assert_eq!((sum(&back, "calls"), sum(&back, "bytes")), (5, 5 * BIG));
        let moved = at_line(&doc, "mmap", grow);
        assert_eq!(moved.len(), 1);
        assert_eq!(moved[0]["function"], "realloc");
        assert_eq!(
            (moved[0]["calls"].as_u64(), moved[0]["bytes"].as_u64()),
            (Some(1), Some(2 * MIB + 4096))
        );
        let mem = &doc["processes"][0]["memory"];
        assert_eq!(
            mem["reserved"]["mmapped"].as_u64(),
            Some(3 * BIG + 2 * MIB + 4096),
            "{mem}"
        );
    }
);

bpf_test!(
    shared,
    /// A recording keeps the reservations and per-process memory: `report FILE memory` says what
    /// the live trace said.
    fn a_recording_reports_the_same_reservations() {
        let bin = fixture("bigblocks", "", &[]);
        let rec = json_path("mem-rec").with_extension("bin");
        let live = json_path("mem-rec");
        run_ok(
            heaptrace()
                .args(["record", "-q", "--interval", "200ms", "-o"])
                .arg(&rec)
                .arg("--json")
                .arg(&live)
                .arg("--")
                .arg(&bin),
        );
        let live = read_json(&live);
        let o = heaptrace()
            .args(["report"])
            .arg(&rec)
            .args(["memory", "--format", "json"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let offline: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(offline["reservations"], live["reservations"]);
        assert_eq!(
            offline["processes"][0]["memory"],
            live["processes"][0]["memory"]
        );
        let text = heaptrace()
            .args(["report"])
            .arg(&rec)
            .arg("memory")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&text.stdout);
        let big = marker_line("bigblocks.c", "BIG_SITE");
        assert!(
            text.contains(&format!("(bigblocks.c:{big})")) && text.contains("given back"),
            "{text}"
        );
    }
);

bpf_test!(
    shared,
    /// `--no-reservations` leaves the syscalls alone: no reservations, no reserved figures.
    fn no_reservations_turns_the_syscall_tracing_off() {
        let bin = fixture("bigblocks", "", &[]);
        let json = json_path("mem-off");
        run_ok(
            heaptrace()
                .args(["--no-tui", "-q", "--no-reservations", "--json"])
                .arg(&json)
                .arg("--")
                .arg(&bin),
        );
        let doc = read_json(&json);
        assert_eq!(doc["reservations"], serde_json::json!([]));
        let p = &doc["processes"][0];
        assert_eq!(p["memory"]["reserved"], Value::Null);
        assert_eq!(p["functions"]["malloc"]["calls"].as_u64(), Some(8));
    }
);

/// What each reservation says, without what changes from run to run (stack ids, addresses).
fn reservations_seen(doc: &Value) -> Vec<String> {
    let mut v: Vec<String> = doc["reservations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let lines: Vec<&Value> = r["frames"]
                .as_array()
                .map(|f| f.iter().map(|fr| &fr["line"]).collect())
                .unwrap_or_default();
            format!(
                "{} of {} by {} at {:?}: {} calls, {} bytes",
                r["kind"], r["of"], r["function"], lines, r["calls"], r["bytes"]
            )
        })
        .collect();
    v.sort();
    v
}

bpf_test!(
    shared,
    /// glibc's memory syscalls are seen by a probe just after the `syscall` of each wrapper,
    /// which costs the rest of the host nothing; the syscall tracepoints (kept for allocator files
    /// without such wrappers) see the same reservations, run for run.
    fn the_wrappers_probes_see_what_the_syscall_tracepoints_see() {
        for (fixture_name, args) in [("bigblocks", &[][..]), ("arenas", &["0.3"][..])] {
            let bin = fixture(fixture_name, "", &[]);
            let mut docs = Vec::new();
            for how in [&[][..], &["--syscall-tracepoints"][..]] {
                let json = json_path(&format!("wrappers-{fixture_name}{}", how.len()));
                run_ok(
                    heaptrace()
                        .args(["--no-tui", "-q", "--mode", "stacks", "--probe-stats"])
                        .args(how)
                        .arg("--json")
                        .arg(&json)
                        .arg("--")
                        .arg(&bin)
                        .args(args),
                );
                let doc = read_json(&json);
                assert_eq!(doc["lost"]["mem_events"], 0);
                docs.push(doc);
            }
            let (wrappers, tracepoints) = (&docs[0], &docs[1]);
            assert!(program_runs(wrappers, "mem_syscall") > 0, "{fixture_name}");
            assert_eq!(program_runs(wrappers, "mem_sys_enter"), 0, "{fixture_name}");
            assert_eq!(
                program_runs(tracepoints, "mem_syscall"),
                0,
                "{fixture_name}"
            );
            assert!(
                program_runs(tracepoints, "mem_sys_enter") > 0,
                "{fixture_name}"
            );
            let probed = |d: &Value| -> Vec<String> {
                d["provider"]["syscall_probes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|p| p["name"].as_str().unwrap().to_string())
                    .collect()
            };
            assert_eq!(probed(wrappers), ["mmap", "munmap", "mremap", "brk"]);
            assert!(probed(tracepoints).is_empty());
            let seen = reservations_seen(wrappers);
            assert!(!seen.is_empty(), "{fixture_name}");
            assert_eq!(seen, reservations_seen(tracepoints), "{fixture_name}");
            let reserved = |d: &Value| d["processes"][0]["memory"]["reserved"].clone();
            assert_eq!(reserved(wrappers), reserved(tracepoints), "{fixture_name}");
        }
    }
);

bpf_test!(
    exclusive,
    /// System-wide, the host libc's wrappers are probed for every process: a process started after
    /// heaptrace has its large blocks' mappings and releases attributed to its malloc, as with -p.
    /// (By function, not line: a process this short has exited before its stacks are symbolized.)
    fn all_sees_the_reservations_of_a_process_started_later() {
        let bin = fixture("bigblocks", "", &[]);
        let (tracer, json) = crate::system::start_all(
            "mem-all",
            &["--mode", "stacks", "--probe-stats", "--comm", "bigblocks"],
        );
        let mut child = std::process::Command::new(&bin).spawn().unwrap();
        let pid = child.id();
        assert!(child.wait().unwrap().success());
        std::thread::sleep(std::time::Duration::from_millis(500));
        let (_, doc) = crate::system::stop(tracer, &json);
        assert!(program_runs(&doc, "mem_syscall") > 0);
        assert_eq!(program_runs(&doc, "mem_sys_enter"), 0);
        let of = |kind: &str, func: &str| -> (u64, u64) {
            let v: Vec<&Value> = of_kind(&doc, kind)
                .into_iter()
                .filter(|r| r["pid"] == pid && r["function"] == func)
                .collect();
            (sum(&v, "calls"), sum(&v, "bytes"))
        };
        assert_eq!(
            of("mmap", "malloc"),
            (8, 8 * BIG),
            "{:#}",
            doc["reservations"]
        );
        assert_eq!(of("munmap", "malloc"), (5, 5 * BIG));
        assert_eq!(of("mmap", "realloc"), (1, 2 * MIB + 4096));
    }
);
