//! `--in-process` against a command that does what it likes with what heaptrace gave it: its
//! region (it can write every byte), its descriptors, its environment, its threads. heaptrace
//! ends as usual (the command's exit status, the summary, the JSON), bounded, and says what it
//! could not count, in `lost` and as `complete: false` with the reason.
use std::{io::Write as _, path::PathBuf, process::Stdio};

use serde_json::Value;

use crate::{
    support::*,
    system::{start_all, stop, wait_for},
};

fn hostile() -> PathBuf {
    fixture("hostile", "", &[])
}

/// `hostile ARGS` under `heaptrace --in-process`: its stdout, exit code, stderr and JSON.
fn traced(tag: &str, args: &[&str]) -> (String, i32, String, Value) {
    let json = json_path(tag);
    let out = heaptrace()
        .args(["--no-tui", "-q", "--in-process", "--json"])
        .arg(&json)
        .arg("--")
        .arg(hostile())
        .args(args)
        .output()
        .expect("heaptrace");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(stderr.contains("function"), "no summary: {stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    (
        stdout,
        out.status.code().unwrap_or(-1),
        stderr,
        read_json(&json),
    )
}

/// Blocks of `size` bytes left live at the end.
fn leaked(doc: &Value, size: u64) -> u64 {
    doc["leaks"]["by_stack"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["bytes"] == s["blocks"].as_u64().unwrap() * size)
        .map(|s| s["blocks"].as_u64().unwrap())
        .sum()
}

/// Capacities, counts, losses and the peak in its header, and its thread's counters, written
/// over: the reads keep to the daemon's own layout, leave out what cannot be, and count it.
#[test]
fn in_process_a_command_that_writes_over_its_region_is_traced_to_its_end() {
    let _g = shared();
    let (out, code, stderr, doc) = traced("hostile-scribble", &["scribble"]);
    assert_eq!((out.as_str(), code), ("scribbled\n", 5), "{stderr}");
    assert_eq!(doc["target"]["exit_code"], 5);
    let overwritten = doc["lost"]["region_overwritten"].as_u64().unwrap();
    assert!(overwritten > 0, "{}", doc["lost"]);
    assert!(stderr.contains("region_overwritten"), "{stderr}");
    assert_eq!(doc["complete"], false);
    assert_eq!(doc["incomplete"][0], "lost");
    // The losses it wrote are not taken.
    assert_eq!(doc["lost"]["live_map"], 0, "{}", doc["lost"]);
    // The library counts by the capacities it took the region with: the blocks are found.
    assert_eq!(sized(&doc, "malloc", 4242), 10, "{}", doc["sizes"]);
    assert_eq!(leaked(&doc, 4242), 10, "{}", doc["leaks"]);
    let rss = doc["heaptrace"]["peak_rss_kb"].as_u64().unwrap();
    assert!(rss < 200 << 10, "heaptrace grew to {rss} KiB");
}

/// Its live table and size table filled with entries no call writes (each its own site, of
/// sizes past any address space): left out and counted, heaptrace's memory bounded, its own
/// blocks found.
#[test]
fn in_process_a_command_that_fills_its_tables_with_garbage_is_traced_to_its_end() {
    let _g = shared();
    let (out, code, stderr, doc) = traced("hostile-tables", &["tables"]);
    assert_eq!((out.as_str(), code), ("scribbled\n", 5), "{stderr}");
    assert!(doc["lost"]["region_overwritten"].as_u64().unwrap() > 0);
    assert_eq!(doc["complete"], false);
    assert_eq!(leaked(&doc, 4243), 10, "{}", doc["leaks"]);
    let sites = doc["leaks"]["by_stack"].as_array().unwrap().len();
    assert!(sites < 10, "{sites} sites of leaks");
    assert_eq!(sized(&doc, "malloc", 4243), 10, "{}", doc["sizes"]);
    let rss = doc["heaptrace"]["peak_rss_kb"].as_u64().unwrap();
    assert!(rss < 200 << 10, "heaptrace grew to {rss} KiB");
}

/// The library maps its region as it is loaded: descriptors closed, or others put in their
/// place, before the first allocation do not stop it.
#[test]
fn in_process_a_command_that_spoils_its_descriptors_is_counted() {
    let _g = shared();
    for (mode, size) in [("closefds", 777), ("dup2", 778)] {
        let (out, code, stderr, doc) = traced(&format!("hostile-{mode}"), &[mode]);
        assert_eq!((out.as_str(), code), ("spoiled\n", 0), "{stderr}");
        assert_eq!(sized(&doc, "malloc", size), 10, "{mode}: {}", doc["sizes"]);
        assert_eq!(leaked(&doc, size), 10, "{mode}: {}", doc["leaks"]);
        assert_eq!(doc["complete"], true, "{mode}: {}", doc["incomplete"]);
        assert_eq!(doc["incomplete"], serde_json::json!([]));
    }
}

/// An exec that drops LD_PRELOAD: nothing of the new image is counted, and the JSON and a
/// warning say why.
#[test]
fn in_process_an_exec_without_the_library_is_said_incomplete() {
    let _g = shared();
    let (out, code, stderr, doc) = traced("hostile-execbare", &["execbare"]);
    assert_eq!((out.as_str(), code), ("leaked\n", 0), "{stderr}");
    assert_eq!(doc["complete"], false);
    let why: Vec<&str> = doc["incomplete"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    assert_eq!(why, ["library_not_after_exec"], "{stderr}");
    assert!(stderr.contains("without heaptrace's library"), "{stderr}");
}

/// Threads made by a raw clone share their creator's pthread data: their calls are told
/// apart (by their stack and thread id) and counted in the region's shared slot, each.
#[test]
fn in_process_raw_clone_threads_calls_are_counted_apart() {
    let _g = shared();
    let n = 5000;
    let (out, code, stderr, doc) = traced("hostile-clone", &["clone", &n.to_string()]);
    assert_eq!((out.as_str(), code), ("cloned\n", 0), "{stderr}");
    assert_eq!(sized(&doc, "malloc", 32), 3 * n, "{}", doc["sizes"]);
    assert_eq!(doc["raw_thread_calls"], 4 * n, "{stderr}");
    assert_eq!(doc["functions"]["free"]["untracked"], 0);
    let ours = |s: &&Value| s["bytes"] == s["blocks"].as_u64().unwrap() * 32;
    let left = doc["leaks"]["by_stack"]
        .as_array()
        .unwrap()
        .iter()
        .filter(ours)
        .count();
    assert_eq!(left, 0, "{}", doc["leaks"]);
    assert_eq!(doc["complete"], true, "{}", doc["lost"]);
    assert!(stderr.contains("raw clone"), "{stderr}");
}

bpf_test!(
    exclusive,
    /// `--all` beside an `--in-process` run: it probes the allocator behind heaptrace's own
    /// preload library, never the library (which defines the malloc family too), and the
    /// in-process run's sites keep their names.
    fn all_leaves_heaptraces_own_preload_library_alone() {
        let (tracer, all_json) = start_all("all-preload", &["--comm", "hostile"]);
        let json = json_path("all-preload-inproc");
        let mut inproc = heaptrace()
            .args(["--no-tui", "-q", "--in-process", "--json"])
            .arg(&json)
            .arg("--")
            .arg(hostile())
            .arg("waitleak")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_for(&tracer, "attached");
        // Time for --all to look at the new process (its exec's event, a round of 200 ms):
        // on a slow machine the old code could pass, the new one cannot fail.
        std::thread::sleep(std::time::Duration::from_millis(1500));
        inproc.stdin.take().unwrap().write_all(b"g").unwrap();
        let out = inproc.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{stderr}");
        let (all_stderr, all) = stop(tracer, &all_json);
        assert!(!all_stderr.contains("heaptrace-preload"), "{all_stderr}");
        let probes = all["provider"]["probes"].as_array().unwrap();
        assert!(!probes.is_empty(), "{all_stderr}");
        for p in probes {
            let path = p["path"].as_str().unwrap();
            assert!(!path.contains("heaptrace-preload"), "{path}");
        }
        let doc = read_json(&json);
        let site = doc["leaks"]["by_stack"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["bytes"] == 7800)
            .unwrap_or_else(|| panic!("{}", doc["leaks"]))
            .clone();
        let named = function_names(&site);
        assert!(named.contains(&"keep"), "{site}");
        assert_eq!(doc["complete"], true, "{}", doc["lost"]);
    }
);

/// Sizes the region cannot take are refused in one line naming the option and its range,
/// before anything runs (4294967295 wrapped to 0 and printed a debug dump).
#[test]
fn in_process_refuses_sizes_its_region_cannot_take() {
    for (flags, names) in [
        (&["--live-map-size", "4294967295"][..], "--live-map-size"),
        (&["--stack-map-size", "4294967295"], "--stack-map-size"),
        (
            &[
                "--in-process-threads",
                "65536",
                "--stack-map-size",
                "4194304",
            ],
            "--in-process-threads",
        ),
    ] {
        let out = heaptrace()
            .args(["--no-tui", "-q", "--in-process"])
            .args(flags)
            .arg("--")
            .arg(hostile())
            .arg("leak")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{flags:?}: it ran");
        let first = stderr.lines().next().unwrap_or_default();
        assert!(first.contains(names), "{flags:?}: {stderr}");
        assert!(!stderr.contains('{'), "{flags:?}: {stderr}");
    }
}

/// A user whose heaptrace directory someone else made first: it is not used, the reason is
/// said, and the library goes to the command as a sealed memfd, which counts as the file did.
#[test]
fn in_process_a_directory_someone_else_owns_is_not_used() {
    let _g = shared();
    let base = json_path("foreign-dir").with_extension("d");
    let _ = std::fs::remove_dir_all(&base);
    let theirs = base.join("heaptrace");
    std::fs::create_dir_all(&theirs).unwrap();
    let out_dir = base.join("out");
    std::fs::create_dir_all(&out_dir).unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    for (d, mode) in [(&base, 0o755), (&theirs, 0o755), (&out_dir, 0o777)] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    let json = out_dir.join("doc.json");
    // Root made it; the user is nobody (uid 65534), whose runtime directory it is.
    let out = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(env!("CARGO_BIN_EXE_heaptrace"))
        .args(["--no-tui", "-q", "--in-process", "--json"])
        .arg(&json)
        .arg("--")
        .arg(hostile())
        .arg("leak")
        .env("XDG_RUNTIME_DIR", &base)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "leaked\n");
    assert!(
        stderr.contains(&format!("{} is owned by uid 0", theirs.display())),
        "{stderr}"
    );
    assert!(stderr.contains("sealed memfd"), "{stderr}");
    assert_eq!(std::fs::read_dir(&theirs).unwrap().count(), 0);
    let doc = read_json(&json);
    assert_eq!(leaked(&doc, 779), 10, "{}", doc["leaks"]);
    assert_eq!(doc["complete"], true, "{}", doc["incomplete"]);
    std::fs::remove_dir_all(&base).unwrap();
}
