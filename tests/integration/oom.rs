//! OOM kills: a leaking fixture in a memory cgroup of its own (v2 where the machine has the
//! memory controller there, else v1) runs into the cgroup's limit, and the OOM killer kills it.
use std::{
    fs,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use serde_json::Value;

use crate::{
    support::*,
    system::{process, start_all, stop},
};

/// The cgroup's limit: the fixture is killed with about this much live at `leak_chunk`.
const LIMIT_MIB: u64 = 48;

/// A memory cgroup made for one test, removed when dropped (a test that fails included):
/// whatever still runs in it is killed first.
struct MemCgroup {
    dir: PathBuf,
}

impl MemCgroup {
    fn new(tag: &str) -> MemCgroup {
        let name = format!("heaptrace-{tag}-{}", std::process::id());
        let v2 = fs::read_to_string("/sys/fs/cgroup/cgroup.subtree_control")
            .is_ok_and(|c| c.split_whitespace().any(|c| c == "memory"));
        let (dir, limits): (PathBuf, &[&str]) = if v2 {
            (
                Path::new("/sys/fs/cgroup").join(name),
                &["memory.max", "memory.swap.max"],
            )
        } else {
            (
                Path::new("/sys/fs/cgroup/memory").join(name),
                &["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"],
            )
        };
        let _ = fs::remove_dir(&dir);
        fs::create_dir(&dir).unwrap_or_else(|e| panic!("no memory cgroup {}: {e}", dir.display()));
        let cg = MemCgroup { dir };
        let bytes = (LIMIT_MIB << 20).to_string();
        fs::write(cg.dir.join(limits[0]), &bytes).unwrap();
        // No swap: the limit is reached at once. v1's memsw limit may be missing (swap
        // accounting off), and there is no swap to fall back on then anyway.
        let swap = if v2 { "0" } else { bytes.as_str() };
        let _ = fs::write(cg.dir.join(limits[1]), swap);
        cg
    }

    fn procs(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }
}

impl Drop for MemCgroup {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let pids = fs::read_to_string(self.procs()).unwrap_or_default();
            for p in pids.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                // SAFETY: killing a process of the test's own cgroup.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
            if fs::remove_dir(&self.dir).is_ok() || Instant::now() > deadline {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn fname(frame: &Value) -> &str {
    frame["function"].as_str().unwrap_or("")
}

/// The bytes held by a process's leaks whose innermost frame is `function`, and all of them.
fn held_at(leaks: &Value, function: &str) -> (u64, u64) {
    let sites = leaks["by_stack"].as_array().expect("leaks by stack");
    let at = sites
        .iter()
        .filter(|s| s["frames"].get(0).is_some_and(|f| fname(f) == function))
        .map(|s| s["bytes"].as_u64().unwrap())
        .sum();
    (at, leaks["bytes"].as_u64().unwrap())
}

/// The heap a victim was killed with: most of it at leak_chunk, 1 MiB blocks, about the
/// limit; and the 16 blocks of keep_small, exactly.
fn assert_killed_heap(p: &Value) {
    assert_eq!(p["oom_killed"], true, "{p}");
    let (leaked, all) = held_at(&p["leaks"], "leak_chunk");
    assert_eq!(leaked % (1 << 20), 0, "{}", p["leaks"]);
    let chunks = leaked >> 20;
    // What fit under the limit beside the program's own pages.
    assert!(
        (LIMIT_MIB / 2..=LIMIT_MIB).contains(&chunks),
        "{chunks} chunks of 1 MiB held: {}",
        p["leaks"]
    );
    assert_eq!(held_at(&p["leaks"], "keep_small").0, 16 * 4096);
    assert!(leaked * 10 >= all * 9, "leak_chunk holds {leaked} of {all}");
}

bpf_test!(
    shared,
    /// A launched command killed by the OOM killer: its end says so, with the signal, and its
    /// heap when killed is its leaks.
    fn a_launched_command_killed_by_the_oom_killer_is_reported_so() {
        let cg = MemCgroup::new("oom-cmd");
        let bin = fixture("oomleak", "", &[]);
        let json = json_path("oom-cmd");
        let out = heaptrace()
            .args(["--no-tui", "--mode", "stacks", "--json"])
            .arg(&json)
            .arg("--")
            .arg(&bin)
            .arg(cg.procs())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(137), "{stderr}");
        assert!(
            stderr.contains("was killed by the OOM killer (SIGKILL)"),
            "{stderr}"
        );
        let doc = read_json(&json);
        assert_eq!(doc["target"]["signal"], "SIGKILL");
        let pid = doc["target"]["pids"][0].as_u64().unwrap() as u32;
        assert_killed_heap(process(&doc, pid));
    }
);

bpf_test!(
    exclusive,
    /// Under --all, the victim's report is written at once to --oom-dir, and the whole trace's
    /// document says the same.
    fn all_writes_each_oom_victims_report_at_once() {
        let cg = MemCgroup::new("oom-all");
        let dir = workspace().join(format!("target/test-out/oom-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let (tracer, json) = start_all(
            "oom-all",
            &["--mode", "stacks", "--oom-dir", dir.to_str().unwrap()],
        );
        let mut child = std::process::Command::new(fixture("oomleak", "", &[]))
            .arg(cg.procs())
            .spawn()
            .unwrap();
        let pid = child.id();
        let status = child.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGKILL)
        );
        // Written in the round the kill is heard, while the trace goes on.
        let deadline = Instant::now() + Duration::from_secs(30);
        let report = loop {
            let found = fs::read_dir(&dir).unwrap().flatten().find(|e| {
                let n = e.file_name().to_string_lossy().into_owned();
                n.starts_with(&format!("oom-{pid}-oomleak-")) && n.ends_with(".json")
            });
            if let Some(e) = found {
                break e.path();
            }
            assert!(Instant::now() < deadline, "no report in {}", dir.display());
            std::thread::sleep(Duration::from_millis(50));
        };
        let one = read_json(&report);
        let procs = one["processes"].as_array().unwrap();
        assert_eq!(procs.len(), 1, "{}", one["processes"]);
        assert_killed_heap(&procs[0]);
        let (_, doc) = stop(tracer, &json);
        assert_killed_heap(process(&doc, pid));
        let _ = fs::remove_dir_all(&dir);
    }
);

#[test]
fn oom_dir_must_be_a_writable_directory() {
    let out = heaptrace()
        .args(["--all", "--no-tui", "--oom-dir", "/nonexistent/dir"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        error_line(&out).contains("--oom-dir") && error_line(&out).contains("no such directory"),
        "{}",
        error_line(&out)
    );
}

bpf_test!(
    exclusive,
    /// A host with a v1 memory hierarchy (this one's is hybrid: its unified hierarchy says `/`
    /// for every process): a process in a v1 memory cgroup is reported with that path, and
    /// `--all --cgroup` keeps it by that path.
    fn a_process_in_a_v1_memory_cgroup_is_reported_with_its_path() {
        let v2 = fs::read_to_string("/sys/fs/cgroup/cgroup.subtree_control")
            .is_ok_and(|c| c.split_whitespace().any(|c| c == "memory"));
        if v2 || !Path::new("/sys/fs/cgroup/memory").is_dir() {
            eprintln!("SKIPPED no cgroup v1 memory hierarchy");
            return;
        }
        let cg = MemCgroup::new("v1");
        let name = cg.dir.file_name().unwrap().to_str().unwrap().to_string();
        let (tracer, json) = start_all("oom-v1", &["--mode", "counts", "--cgroup", &name]);
        let script = format!(
            "echo $$ > {} && exec {} 0 100 3",
            cg.procs().display(),
            fixture("allocs", "", &[]).display()
        );
        let mut child = std::process::Command::new("sh")
            .args(["-c", &script])
            .spawn()
            .unwrap();
        let pid = child.id();
        assert!(child.wait().unwrap().success());
        // Past a round: its end is seen.
        std::thread::sleep(Duration::from_millis(500));
        let (_, doc) = stop(tracer, &json);
        let p = process(&doc, pid);
        assert_eq!(p["cgroup"], format!("/{name}"), "{p}");
        assert_eq!(p["comm"], "allocs");
        assert!(p["totals"]["allocations"].as_u64().unwrap() >= 100, "{p}");
        // Every process kept is in it.
        for p in doc["processes"].as_array().unwrap() {
            assert_eq!(p["cgroup"], format!("/{name}"), "{p}");
        }
    }
);
