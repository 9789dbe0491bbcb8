//! Real services, as a new user traces them: Debian's Redis (jemalloc, its own `zmalloc`
//! wrapper), attached with `-p` while `redis-benchmark` drives it; PostgreSQL and nginx
//! (`postgres`, `nginx`: master and forked workers) with `-p --follow-forks`. The sites must
//! name the service's callers, not its wrappers, through whole stacks.
use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::Value;

use crate::support::*;

mod nginx;
mod postgres;

/// The strings of a JSON array.
fn names(v: &Value) -> Vec<&str> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

/// Asserts that no stack's site is one of `wrappers`, and that every stack through one names
/// its site further out; returns the calls through them.
fn sites_past(doc: &Value, wrappers: &[&str]) -> u64 {
    let mut calls = 0;
    for s in doc["stacks"].as_array().unwrap() {
        let frames = function_names(s);
        let site = s["site_frame"].as_u64().unwrap() as usize;
        assert!(!wrappers.contains(&frames[site]), "{s}");
        if let Some(w) = frames.iter().position(|f| wrappers.contains(f)) {
            assert!(site > w, "site inside a wrapper: {s}");
            calls += s["calls"].as_u64().unwrap();
        }
    }
    calls
}

/// The share of calls whose stack reaches `main` (or a thread's start).
fn whole_share(doc: &Value) -> f64 {
    let (mut whole, mut all) = (0u64, 0u64);
    for s in doc["stacks"].as_array().unwrap() {
        let n = s["calls"].as_u64().unwrap();
        all += n;
        if s["frames"].as_array().unwrap().iter().any(|f| {
            matches!(
                f["function"].as_str(),
                Some("main" | "start_thread" | "clone3" | "_start")
            )
        }) {
            whole += n;
        }
    }
    whole as f64 / all.max(1) as f64
}

/// Whether `cmd` is on the PATH; under CI a missing one fails (setup installs it).
pub(crate) fn present(cmd: &str) -> bool {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var_os("CI").is_none(),
            "{cmd} is missing (cargo xtask setup installs it)"
        );
        eprintln!("SKIPPED: no {cmd}");
    }
    found
}

/// A redis-server of the test's own, on a unix socket in `dir`; killed when dropped.
struct Redis {
    child: Child,
    socket: PathBuf,
}

impl Redis {
    fn start(dir: &Path) -> Redis {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).unwrap();
        let socket = dir.join("redis.sock");
        let child = Command::new("redis-server")
            .args([
                "--port",
                "0",
                "--save",
                "",
                "--appendonly",
                "no",
                "--unixsocket",
            ])
            .arg(&socket)
            .arg("--dir")
            .arg(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server");
        let deadline = Instant::now() + Duration::from_secs(20);
        while !socket.exists() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        Redis { child, socket }
    }

    fn benchmark(&self, n: u32) {
        self.run(
            "redis-benchmark",
            &["-n", &n.to_string(), "-q", "-t", "set,get,lpush,hset"],
        );
    }

    /// Runs a Redis tool on this server's socket; its output.
    fn run(&self, tool: &str, args: &[&str]) -> String {
        let o = Command::new(tool)
            .arg("-s")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect(tool);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

bpf_test!(
    shared,
    /// Redis attached: its sites are named past `zmalloc` (detected as its wrapper, kept in
    /// every stack), and the summary's site lines are all different.
    fn redis_sites_name_its_callers_not_its_wrapper() {
        if !present("redis-server") || !present("redis-benchmark") {
            return;
        }
        let dir = workspace().join("target/test-out/redis");
        let redis = Redis::start(&dir);
        let json = json_path("redis");
        let running = start_attached(
            heaptrace()
                .args(["--no-tui", "-p", &redis.child.id().to_string(), "--json"])
                .arg(&json),
        );
        redis.benchmark(5000);
        running.signal(libc::SIGINT);
        let (code, summary) = running.wait();
        assert_eq!(code, 0, "{summary}");
        let doc = read_json(&json);
        let known = names(&doc["wrappers"]["known"]);
        assert!(known.contains(&"zmalloc"), "{:?}", doc["wrappers"]);
        // Known names are detection's first pass: a caller of zmalloc is never a wrapper.
        assert!(
            !names(&doc["wrappers"]["detected"]).contains(&"dictCreate"),
            "{:?}",
            doc["wrappers"]
        );
        let stacks = doc["stacks"].as_array().unwrap();
        let through: Vec<&Value> = stacks
            .iter()
            .filter(|s| s["frames"][0]["function"] == "zmalloc")
            .collect();
        assert!(
            through.len() >= 10,
            "{} stacks through zmalloc",
            through.len()
        );
        for s in &through {
            assert_ne!(s["site"], "zmalloc", "{s}");
            assert_eq!(s["site_frame"].as_u64(), Some(1), "{s}");
        }
        let calls: u64 = through.iter().map(|s| s["calls"].as_u64().unwrap()).sum();
        assert!(calls >= 20_000, "{calls} calls through zmalloc");
        // Attached, its stacks are whole from the first counted call: none stops at its
        // caller (Redis has no frame pointers; its unwind rows are loaded before counting).
        let short: u64 = stacks
            .iter()
            .filter(|s| s["frames"].as_array().is_some_and(|f| f.len() <= 1))
            .map(|s| s["calls"].as_u64().unwrap())
            .sum();
        assert_eq!(short, 0, "calls with a one-frame stack");
        // Every site line of the summary differs from the others.
        let lines: Vec<&str> = summary
            .lines()
            .filter(|l| l.contains(" calls, live "))
            .map(|l| l.split_once("  ").map_or(l, |(_, site)| site).trim())
            .collect();
        assert!(!lines.is_empty(), "{summary}");
        assert!(
            lines.iter().all(|l| !l.starts_with("malloc <- zmalloc")),
            "{summary}"
        );
    }
);

bpf_test!(
    shared,
    /// Redis (jemalloc) filled with 20 MB before the attach: the memory behind its malloc is
    /// resident, by its mappings, within a stated tolerance of what jemalloc itself says
    /// (`INFO memory`'s allocator_resident, which its docs call a maximum: it counts its
    /// extents' untouched pages too). Before, the summary said only "allocator holds 0 B".
    fn redis_resident_memory_is_read_from_its_mappings() {
        if !present("redis-server") || !present("redis-cli") {
            return;
        }
        let redis = Redis::start(&workspace().join("target/test-out/redis-resident"));
        let fill = [
            "-t", "set", "-n", "20000", "-r", "1000000", "-d", "1000", "-q",
        ];
        redis.run("redis-benchmark", &fill);
        let json = json_path("redis-resident");
        let pid = redis.child.id();
        let running = start_attached(
            heaptrace()
                .args(["--no-tui", "-p", &pid.to_string(), "--json"])
                .arg(&json),
        );
        redis.benchmark(1000);
        let info = redis.run("redis-cli", &["info", "memory"]);
        running.signal(libc::SIGINT);
        let (code, summary) = running.wait();
        assert_eq!(code, 0, "{summary}");
        let theirs: f64 = info
            .lines()
            .find_map(|l| l.strip_prefix("allocator_resident:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("allocator_resident");
        let doc = read_json(&json);
        let proc = doc["processes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["pid"] == pid)
            .unwrap_or_else(|| panic!("{}", doc["processes"]));
        let r = &proc["memory"]["resident"];
        let ours =
            (r["heap_bytes"].as_u64().unwrap() + r["anonymous_bytes"].as_u64().unwrap()) as f64;
        assert!(
            (0.7 * theirs..=1.1 * theirs).contains(&ours),
            "resident {ours} B by the mappings, {theirs} B by jemalloc"
        );
        assert!(summary.contains("; resident ~"), "{summary}");
    }
);
